"""GRPO with vLLM (``use_vllm=True, vllm_mode="colocate"``) on one GPU: ODCGRPOTrainer against TRL's GRPOTrainer with
the same seed, tiny Qwen2 (head_dim 64), prompts and reward (tests/vllm_runs.py; every run a fresh process).

    python -m pytest -m gpu -rP tests/test_grpo_vllm_gpu.py                  # -rP prints the measured differences
    python -m pytest -m gpu -rP tests/test_grpo_vllm_gpu.py -k two_ranks     # the shared-GPU world 2 alone

Needs vLLM (``pip install 'odc_hf[vllm]'``: vllm 0.26.0, torch 2.11). What is checked, per run:

- after every weight sync, the engine's parameters read back from vLLM (``LLM.apply_model``) equal the trainer's own
  parameters at that moment (gathered through the CPU, independently of ODC), cast to the engine's dtype, bit for bit
  (LoRA: the merged weight), and no engine parameter is left unwritten; one sync per optimizer step;
- every metric key TRL's GRPOTrainer logs with vLLM is logged (TRL's importance-sampling metrics included);
- per-step losses and gradient norms equal TRL's on the same rollouts: both engines start from the same weights and
  seed (TRL's ``seed=rank``), so step 1's completions are the same; a later step is compared where its completions
  are too (the trainers' fp32 weights agree to rounding, the bf16 engines usually sample the same tokens from them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sft_runs
import torch
from one_process_runs import ROOT, gpu_launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'odc_hf[vllm]')"
    ),
]
STEPS = 3
NOT_COMPARED = ("step", "epoch", "learning_rate", "step_time")
# What TRL 1.16's GRPOTrainer logs with vLLM and this reward (measured with TRL's own trainer on the CPU stand-in
# engine, tests/test_grpo_vllm.py): the world-2 test, which has no TRL run beside it, checks these.
TRL_VLLM_KEYS = (
    "loss", "grad_norm", "num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "completions/mean_terminated_length", "completions/min_terminated_length",
    "completions/max_terminated_length", "rewards/digit_reward/mean", "rewards/digit_reward/std", "reward",
    "reward_std", "frac_reward_zero_std", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
    "clip_ratio/high_max",
)  # fmt: skip
# fp32 trainers on the same rollouts (the one-GPU GRPO test's bounds, test_gpu_one_device): losses 1e-5 relative
# (absolute 1e-6: GRPO's on-policy loss is ~0 up to rounding), gradient norms 1e-4. vLLM's importance-sampling ratio
# (bf16 engine vs fp32 trainer) enters both runs' losses alike.
LOSS_RTOL, LOSS_ATOL, GRAD_NORM_RTOL = 1e-5, 1e-6, 1e-4


def _env() -> dict:
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
           **sft_runs.launch_env(), "ODC_NO_RELAUNCH": "1"}  # fmt: skip
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def one_process(out: Path, trainer: str, *args) -> dict:
    """``tests/vllm_runs.py TRAINER OUT *args`` in a new plain process (world 1); its rank0.json."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests/vllm_runs.py"), trainer, str(out), *map(str, args)],
                          env=_env(), capture_output=True, text=True, timeout=900)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "rank0.json").read_text())


def two_ranks(out: Path, *args) -> list[dict]:
    """``tests/vllm_runs.py odc OUT *args`` on 2 ranks (accelerate_configs/odc.yaml; one GPU: they share it)."""
    proc = gpu_launch(ROOT / "tests/vllm_runs.py", "odc", out, *args, processes=2, timeout=1200)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def assert_synced_exactly(run: dict, what: str, *, merged: tuple[str, ...] = ()) -> None:
    """Every engine parameter equals the trainer's cast to the engine's dtype. ``merged``: LoRA-merged projections,
    whose fp32 sum the test recomputes on the same GPU (the same kernel: expected equal too); should a kernel
    choice differ, one rounding step of the engine's dtype is all they may differ by."""
    syncs = run["syncs"]
    print(f"{what}: {len(syncs)} syncs, engine vs trainer max |diff| {[s['max_abs'] for s in syncs]}, unequal "
          f"{[len(s['unequal']) for s in syncs]}, sync seconds {run.get('sync_seconds')}")  # fmt: skip
    assert [s["global_step"] for s in syncs] == list(range(STEPS)), (what, syncs)  # once per optimizer step
    for s in syncs:
        assert s["uncovered"] == [] and s["beyond_ulp"] == [], (what, s)
        assert all(any(f".{m}." in name for m in merged) for name in s["unequal"]), (what, s)


def assert_logs_trl_keys(run: dict, keys, what: str) -> None:
    assert [h["step"] for h in run["history"]] == list(range(1, STEPS + 1)), what
    for h in run["history"]:
        missing = sorted(set(keys) - set(h))
        assert not missing, (what, missing)


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_vllm_gpu")
    return one_process(base / "odc", "odc"), one_process(base / "trl", "trl")


def test_world1_engine_weights_equal_the_trainers_after_every_sync(world1):
    odc, trl = world1
    assert odc["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and odc["versions"]["vllm"].startswith("0.26")
    assert_synced_exactly(odc, "ODCGRPOTrainer")
    assert_synced_exactly(trl, "GRPOTrainer (TRL's own sync)")


def test_world1_logs_every_metric_trl_logs(world1):
    odc, trl = world1
    keys = set(trl["history"][0]) - set(NOT_COMPARED)
    assert set(TRL_VLLM_KEYS) <= keys, sorted(set(TRL_VLLM_KEYS) - keys)
    assert_logs_trl_keys(odc, keys, "ODCGRPOTrainer")
    assert all(h["odc/vllm_sync_s"] > 0 for h in odc["history"])


def test_world1_losses_equal_trls_on_the_same_rollouts(world1):
    odc, trl = world1
    same = [i for i in range(STEPS) if odc["rollouts"][i] == trl["rollouts"][i]]
    pairs = [((odc["history"][i]["loss"], trl["history"][i]["loss"]),
              (odc["history"][i]["grad_norm"], trl["history"][i]["grad_norm"])) for i in range(STEPS)]  # fmt: skip
    print(f"steps with the same rollouts: {[i + 1 for i in same]}; (loss, grad norm) ODC vs TRL: {pairs}")
    assert 0 in same, "step 1's completions differ: the engines did not start from the same weights and seed"
    for i in same:
        a, b = odc["history"][i], trl["history"][i]
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL, abs=LOSS_ATOL), (i, a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_NORM_RTOL), (i, a, b)
        assert a["reward"] == b["reward"]


def test_world1_sleep_mode_and_lora(tmp_path):
    # sleep level 2 after every generation (TRL's sleep mode): the sync wakes the weights, then writes them all; LoRA
    # merged into the base weights (W + scaling * B @ A; the adapter moves after step 1, so syncs 2 and 3 differ from
    # the base model)
    run = one_process(tmp_path / "odc", "odc", "--sleep", "--peft")
    assert_synced_exactly(run, "ODCGRPOTrainer, sleep mode + LoRA", merged=("qkv_proj",))
    assert_logs_trl_keys(run, TRL_VLLM_KEYS, "ODCGRPOTrainer, sleep mode + LoRA")


def test_two_ranks_sharing_the_gpu(tmp_path):
    # world 2 (on a one-GPU machine the shared-GPU mode: gloo, CUDA IPC, both engines on cuda:0, each taking 15% of
    # the GPU): each rank's engine gets the whole model from ODC's published shards (one-sided, no collective)
    ranks = two_ranks(tmp_path / "odc", "--gpu_memory_utilization", "0.15")
    for rank, run in enumerate(ranks):
        assert run["world"] == 2 and run["device"].startswith("cuda"), run["device"]
        assert "CUDA transport" in (run["odc"] or ""), run["odc"]
        assert_synced_exactly(run, f"rank {rank} of 2")
        assert_logs_trl_keys(run, TRL_VLLM_KEYS, f"rank {rank} of 2")
    assert ranks[0]["rollouts"] != ranks[1]["rollouts"]  # each rank generated its own prompts (seed = rank)
