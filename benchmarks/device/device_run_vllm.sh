#!/usr/bin/env bash
# vLLM on one H200: ODCGRPOTrainer + vLLM colocate against TRL's GRPOTrainer + vLLM (tests/gpu/test_grpo_vllm_gpu.py) and
# benchmarks/grpo/vllm_colocate.py. Build the bundle first (benchmarks/device/vllm_device_bundle.sh). Stages, back to back:
#   1 (carry .vllm1): keep the archive's first part in /tmp/v
#   2 (carry .vllm2, .vllmdeps, .whl): join, unpack into /tmp/site, install the dependencies and .whl (trl ...);
#     the GPU tests (~5 min)
#   3 (after 2, carry .whl): the benchmark, one variant per call: VARIANT=T or VARIANT=O (~5 min each)
#   4 (after 2): TRL's GRPO recipe with vLLM as docs/trl_recipes.md writes it, ranks sharing the GPU (~3 min)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OUT=${OUT:-/tmp/out}
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 ODC_COMMIT=${ODC_COMMIT:-unknown}
mkdir -p "$OUT" /tmp/v
stage=$1
if [ "$stage" = 1 ]; then cp .vllm1/part_aa /tmp/v/ && ls -la /tmp/v; exit; fi
if [ "$stage" = 2 ]; then
  mkdir -p /tmp/site && cat /tmp/v/part_aa .vllm2/part_ab | xz -d | tar xf - -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .vllmdeps/*.whl \
    .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import vllm; print('vllm', vllm.__version__)" || exit 1
if [ "$stage" = 2 ]; then
  timeout 480 python3 -m pytest -m gpu -rP -q -p no:cacheprovider tests/gpu/test_grpo_vllm_gpu.py > "$OUT/vllm_gpu_tests.log" 2>&1
  grep -E "passed|failed" "$OUT/vllm_gpu_tests.log" | tail -3
fi
if [ "$stage" = 4 ]; then
  timeout 560 python3 -m pytest -m gpu -rP -q -p no:cacheprovider tests/gpu/test_gpu_shared_entry_points.py -k grpo_recipe \
    > "$OUT/grpo_recipe_vllm_gpu.log" 2>&1
  grep -E "passed|failed" "$OUT/grpo_recipe_vllm_gpu.log" | tail -3
fi
if [ "$stage" = 3 ]; then
  timeout 540 python3 -m benchmarks.grpo.vllm_colocate --variants "${VARIANT:-T}" --commit "$ODC_COMMIT" --out "$OUT" \
    > "$OUT/grpo_vllm_${VARIANT:-T}.log" 2>&1; tail -15 "$OUT/grpo_vllm_${VARIANT:-T}.log"
fi
