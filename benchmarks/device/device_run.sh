#!/usr/bin/env bash
# GPU checks run on the device machine (2 GPUs). Usage: bash benchmarks/device/device_run.sh A|B  (writes under $OUT)
#   A: FSDP-adapter GPU tests, 1.5B ODC-vs-FSDP2 parity, the tiny main job on GPUs
#   B: the main job with a 1.5B Qwen2 shape on LongAlign-like lengths, ODC+LB-Mini then FSDP2+LB-Micro
#   E: attention_check.py, then benchmarks/sft/e2e.py (LongAlign-like 4/2/8 per rank, balanced, SWE-smith 4, Tulu 4)
#   F: benchmarks/sft/e2e.py part 2 (SWE-smith-like, Tulu-like), then benchmarks/grpo/e2e.py
#   S: benchmarks/sft/e2e.py, main configurations (LongAlign-like 4 and 2, balanced, Tulu-like 4, SWE-smith-like 4)
#   T: benchmarks/sft/e2e.py, 8 samples per rank for LongAlign-like and SWE-smith-like (B, D; ~7 min)
#   G: benchmarks/grpo/e2e.py
#   P: benchmarks/sft/microbatch_probe.py (fixed microbatch layouts, accumulate-kernel grid cap, profiles)
#   V: benchmarks/sft/trainer_checks.py (SFT/GRPO trainer parity, resume, elastic resume 4 -> 2 GPUs, warm-up, GRPO
#      generate; ~5 min; V_CHECKS=resume,elastic picks some)
#   U: every GPU test of the suite (pytest -m gpu; transport/cuda.py needs 2 GPUs, see tests/README.md; ~4 min)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import torch, transformers, trl, datasets, pyarrow, accelerate; print('versions', torch.__version__, transformers.__version__, trl.__version__, datasets.__version__, pyarrow.__version__, accelerate.__version__)"
if [ "$1" = A ]; then
  timeout 220 python3 -m pytest -q -k cuda tests/fsdp/test_fsdp_exact_gradients.py tests/transport/test_transport_primitives.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  timeout 200 python3 -m benchmarks.sft.fsdp_parity --model 1.5b --steps 20 --out "$OUT" 2>&1 | tail -9
  timeout 150 python3 examples/sft.py --output_dir /tmp/tiny --max_steps 10 > "$OUT/sft_tiny.log" 2>&1
  echo "tiny main job rc=$?"; tail -2 "$OUT/sft_tiny.log"
fi
if [ "$1" = B ]; then
  for mode in "on lb_mini" "off lb_micro"; do
    set -- $mode
    timeout 270 accelerate launch --config_file accelerate_configs/odc.yaml examples/sft.py --model_shape 1.5B \
      --workload longalign --num_samples 96 --max_length 32768 --max_tokens_per_microbatch 32768 \
      --per_device_train_batch_size 4 --max_steps 6 --bf16 --gradient_checkpointing --learning_rate 1e-5 \
      --odc "$1" --balance "$2" --output_dir "/tmp/sft15_$1" --losses_json "$OUT/sft_1.5b_longalign_$2.json" \
      > "/tmp/sft15_$1.log" 2>&1
    echo "1.5B $mode rc=$?"; grep -v "it/s\]\|examples/s\]" "/tmp/sft15_$1.log" | tail -4 | cut -c1-600
  done
  cp /tmp/sft15_on/odc_timeline.png "$OUT/odc_timeline_1.5b_longalign.png" 2>/dev/null
  tail -c 20000 /tmp/sft15_on.log > "$OUT/sft15_on.log"
fi
if [ "$1" = E ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m benchmarks.attention.check --out "$OUT" 2>&1 | tail -8
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/attention/test_attention.py 2>&1 | tail -2
  timeout 470 python3 -m benchmarks.sft.e2e --configs longalign:4,balanced:4,longalign:2,swe_smith:4,tulu:4,longalign:8 \
    --calibration-lengths 1024,4096,8192,12288,16384,20480,24576,28672,32768 --calibration-repeats 1 \
    --expandable-segments --time-budget ${E2E_BUDGET:-420} --out "$OUT" 2>&1 | tee "$OUT/sft_e2e_part1.log" \
    | grep -v "^|" | tail -12
fi
if [ "$1" = F ]; then
  timeout 330 python3 -m benchmarks.sft.e2e --configs swe_smith:4,tulu:4,swe_smith:2,tulu:2,tulu:8,swe_smith:8 \
    --time-budget 280 --out "$OUT" 2>&1 | tee "$OUT/sft_e2e_part2.log" | grep -v "^|" | tail -20
  mkdir -p "$OUT/grpo"
  timeout 250 python3 -m benchmarks.grpo.e2e --out "$OUT/grpo" 2>&1 | tee "$OUT/grpo/grpo_e2e.log" | tail -30
fi
if [ "$1" = P ]; then
  timeout 500 python3 -m benchmarks.sft.microbatch_probe --repeats 2 --max-ctas 32 --profile --out "$OUT" 2>&1 \
    | tee "$OUT/microbatch_probe.log" | grep -v Warning | tail -30
fi
E2E_CAL="--calibration-lengths 512,2048,4096,8192,16384,24576,32768 --calibration-repeats 1"
if [ "$1" = S ]; then
  timeout 560 python3 -m benchmarks.sft.e2e --configs longalign:4:ABCD,balanced:4:BD,longalign:2:BD,tulu:4:ABCD,swe_smith:4:BD \
    $E2E_CAL --time-budget 520 --tag main --out "$OUT" 2>&1 | tee "$OUT/sft_e2e_main.log" | grep -v "^|" | tail -14
fi
if [ "$1" = T ]; then
  timeout ${T_LIMIT:-560} python3 -m benchmarks.sft.e2e --configs longalign:8:BD,swe_smith:8:BD \
    $E2E_CAL --time-budget $(( ${T_LIMIT:-560} - 40 )) --tag rest --out "$OUT" 2>&1 | tee "$OUT/sft_e2e_rest.log" | grep -v "^|" | tail -14
fi
if [ "$1" = G ]; then
  timeout ${G_LIMIT:-560} python3 -m benchmarks.grpo.e2e --out "$OUT" 2>&1 | tee "$OUT/grpo_e2e.log" | tail -30
fi
if [ "$1" = V ]; then
  timeout ${V_LIMIT:-560} python3 -m benchmarks.sft.trainer_checks ${V_CHECKS:+--checks $V_CHECKS} --out "$OUT" \
    --work /tmp/trainer_checks 2>&1 \
    | tee "$OUT/trainer_checks.log" | grep "^|\| ran in "
fi
if [ "$1" = U ]; then
  timeout ${U_LIMIT:-580} python3 -m pytest -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
fi
