#!/usr/bin/env bash
# Build, on a CPU machine with PyPI, what a one-GPU device call needs to run vLLM 0.26.0 (pins torch 2.11, the GPU
# image's): the vllm package without FlashAttention-2's kernels (_vllm_fa2_C: vLLM takes FlashAttention-3 on Hopper,
# and imports FA2 only if present) and without the Rust frontend binary (vllm-rs: not used by the offline LLM class),
# as one .tar.xz (113 MB instead of the 304 MB wheel) split into parts that each fit a call next to the working
# tree (.vllm1, .vllm2, and the small rest in .vllm3, carried with the call that installs), and its pure-Python
# dependencies as wheels. Usage: bash benchmarks/device/vllm_device_bundle.sh
# Then, back to back (the machine goes back after 30 s idle): benchmarks/device/device_run_gpu_tier.sh (parts, then groups).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.vllm\*/' .git/info/exclude 2>/dev/null || echo '/.vllm*/' >> .git/info/exclude
work=$(mktemp -d)
pip_dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 -d "$@"; }
pip_dl "$work" vllm==0.26.0
mkdir -p "$work/site" && unzip -q "$work"/vllm-0.26.0-*.whl -d "$work/site"
tar cf - -C "$work/site" --exclude=./vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so --exclude=./vllm/vllm-rs . \
  | xz -9e -T0 > "$work/vllm.tar.xz"
rm -rf .vllm1 .vllm2 .vllm3 .vllmdeps && mkdir -p .vllm1 .vllm2 .vllm3 .vllmdeps
split -b 56000000 "$work/vllm.tar.xz" "$work/part_"  # three parts: 56 MB, 56 MB and the rest (< 1 MB)
mv "$work/part_aa" .vllm1/ && mv "$work/part_ab" .vllm2/ && mv "$work"/part_a[c-z] .vllm3/
# vLLM's dependencies missing on the GPU image (seen working there with --no-deps, 2026-12-03)
pip_dl .vllmdeps annotated-types apache-tvm-ffi cachetools cbor2 "fastapi<0.137" httpcore2 httpx2 jiter \
  "llguidance>=1.7,<1.8" msgspec "openai>=2" openai-harmony opentelemetry-api partial-json-parser pybase64 "pydantic==2.14.4" \
  "pydantic-core==2.50.5" \
  pyzmq sniffio "starlette>=1.0.1" truststore typing-inspection typing-extensions "xgrammar<1"
du -sh .vllm1 .vllm2 .vllmdeps
