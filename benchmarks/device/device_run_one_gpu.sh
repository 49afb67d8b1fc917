#!/usr/bin/env bash
# One-GPU runs on the device machine (one H200). Usage: ODC_COMMIT=<hash> bash benchmarks/device/device_run_one_gpu.sh STAGE
# Wheels (ignored folders, see tests/README.md): .whl/ holds trl, datasets, dill, multiprocess, liger_kernel and
# FlashAttention-4's small wheels plus the first part of nvidia_cutlass_dsl_libs_cu13 (split -b 46000000: over one
# call's 64 MiB), .whl2/ the second part and whichever small FA4 wheels do not fit in .whl next to the working tree. Stages run back to back (the machine goes back after 30 s idle):
#   1: copy FA4's wheels to /tmp/fa, install the others; README command 1, pytest -m gpu (no FA4) (~4 min)
#   2: join and install FA4 (--target /tmp/fa4); single_gpu.py sft_longalign T,O,T+,T+t,O_sdpa,T2 (~8.5 min)
#   3: single_gpu.py sft_tulu T,O,T+,O_sdpa,T+t; lora (~9 min)
#   4: single_gpu.py resume, grpo (~6 min)
#   0: stage 1's copying and installing only (before 6)
#   6 (after 0 or 1, carrying .whl2): compute_ceiling.py FA4 vs sdpa_varlen on the GRPO-like group in its four layouts
#      (padded as ODCGRPOTrainer pads on CUDA, padded unrounded, TRL's, packed), 9 repeats (~5 min)
#   7 (after 0 or 1, carrying .whl2): the GRPO GPU tests, FA4's included (~4 min)
#   5 (after 1, carrying .whl2): FA4's GPU tests and the LoRA test on FA4; compute_ceiling.py FA4 vs sdpa_varlen on
#      the 1.5B rows and the GRPO-like group padded vs packed, 7 repeats (~7 min)
# Results go under $OUT (one tarball per stage: the device returns at most 8 files); trainers' checkpoints stay out.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OUT=${OUT:-/tmp/out} ODC_COMMIT=${ODC_COMMIT:-unknown}
mkdir -p "$OUT"
stage=$1
if [ "$stage" = 1 ] || [ "$stage" = 0 ]; then
  mkdir -p /tmp/fa && cp .whl/cu13part_aa /tmp/fa/ || exit 1
  for w in .whl/flash_attn_4* .whl/nvidia_cutlass* .whl/apache* .whl/torch_c* .whl/quack*; do  # those that fit here
    [ -f "$w" ] && cp "$w" /tmp/fa/
  done
fi
if [ ! -d /tmp/fa4/flash_attn ] && [ -f /tmp/fa/cu13part_aa ] && [ -f .whl2/cu13part_ab ]; then  # stage 2 or 5 after 1
  cp .whl2/*.whl /tmp/fa/ 2>/dev/null  # FA4 wheels that did not fit next to the first part
  cat /tmp/fa/cu13part_aa .whl2/cu13part_ab > /tmp/fa/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
    && rm /tmp/fa/cu13part_aa
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fa4 /tmp/fa/*.whl \
    || echo "FA4 INSTALL FAILED"
fi
if [ ! -d /tmp/site/trl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl .whl/liger_kernel-*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site
if [ -d /tmp/fa4/flash_attn ]; then export PYTHONPATH=$PYTHONPATH:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages; fi
t0=$SECONDS
say() { echo "$* (t=$((SECONDS - t0)))"; }
sg() {  # single_gpu.py PARTS VARIANTS LIMIT_S NAME
  timeout "$3" python3 -m benchmarks.single_gpu.run --parts "$1" --variants "$2" --steps 30 --warmup 2 \
    ${SG_EXTRA:-} --out "$OUT/$4" > "$OUT/$4.log" 2>&1
  grep -E "ok \(|failed" "$OUT/$4.log" | tail -10; say "$4 done"
}
if [ "$stage" = 1 ]; then
  (timeout 120 python3 examples/sft.py --max_steps 3 --output_dir /tmp/r1 > "$OUT/readme_cmd1.log" 2>&1
   echo "rc=$?" >> "$OUT/readme_cmd1.log"); tail -2 "$OUT/readme_cmd1.log"
  timeout 200 python3 -m pytest -m gpu -rP -q -p no:cacheprovider tests/gpu/test_gpu_one_device.py tests/attention/test_attention.py \
    > "$OUT/gpu_tests_without_fa4.log" 2>&1; tail -2 "$OUT/gpu_tests_without_fa4.log"; say "stage 1"
fi
if [ "$stage" = 2 ]; then
  python3 -c "from transformers.utils import is_flash_attn_4_available as f; print('fa4 available', f())"
  SG_EXTRA="--rows_per_step 1 --profile 8 --profile_variants O" \
    sg sft_longalign T,O,T+,T+t,O_sdpa,T2 520 sg_longalign
fi
if [ "$stage" = 3 ]; then
  SG_EXTRA="--profile 8 --profile_variants O" sg sft_tulu T,O,T+,O_sdpa,T+t 380 sg_tulu
  sg lora T,O $((560 - (SECONDS - t0))) sg_lora
fi
if [ "$stage" = 4 ]; then
  sg resume T,O 180 sg_resume
  sg grpo T,O $((560 - (SECONDS - t0))) sg_grpo
fi
if [ "$stage" = 5 ]; then
  timeout 200 python3 -m pytest -m gpu -rP -q -p no:cacheprovider tests/gpu/test_attention_fa4_gpu.py \
    tests/gpu/test_gpu_one_device.py -k "flash or fa4 or lora or attention_auto" > "$OUT/gpu_tests_fa4.log" 2>&1; tail -2 "$OUT/gpu_tests_fa4.log"
  say "fa4 tests"
  timeout 360 python3 -m benchmarks.single_gpu.compute_ceiling --attn flash_attention_4,sdpa_varlen --models 1.5B \
    --repeats 7 --out "$OUT" > "$OUT/attention_compare.log" 2>&1; tail -4 "$OUT/attention_compare.log"; say "attention"
fi
if [ "$stage" = 6 ]; then
  timeout 420 python3 -m benchmarks.single_gpu.compute_ceiling --attn flash_attention_4,sdpa_varlen --models 1.5B --rows grpo \
    --repeats 9 --tag _grpo --out "$OUT" > "$OUT/attention_compare_grpo.log" 2>&1
  tail -8 "$OUT/attention_compare_grpo.log"; say "grpo layouts"
fi
if [ "$stage" = 7 ]; then
  timeout 400 python3 -m pytest -m gpu -rP -q -p no:cacheprovider tests/gpu/test_gpu_one_device.py -k grpo \
    > "$OUT/gpu_tests_grpo.log" 2>&1; tail -2 "$OUT/gpu_tests_grpo.log"; say "grpo tests"
fi
cd "$OUT" && tar czf /tmp/stage.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/stage.tgz "$OUT/stage$stage.tgz"; ls -la "$OUT"
