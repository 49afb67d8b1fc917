"""GRPO with vLLM (``use_vllm=True, vllm_mode="colocate"``) on one GPU: ODCGRPOTrainer against TRL's GRPOTrainer with
the same seed, tiny Qwen2 (head_dim 64), prompts and reward (tests/support/vllm_runs.py; every run a fresh process).

    python -m pytest -m gpu -rP tests/gpu/test_grpo_vllm_gpu.py                  # -rP prints the measured differences
    python -m pytest -m gpu -rP tests/gpu/test_grpo_vllm_gpu.py -k two_ranks     # the shared-GPU world 2 alone

Needs vLLM (``pip install 'odc_hf[vllm]'``: vllm 0.26.0, torch 2.11). What is checked, per run (the checks are
tests/support/vllm_runs.py's; tests/grpo/test_vllm_runs_stand_in.py runs the same runner and checks on CPU with a stand-in engine):

- the engine starts from other weights than the trainer's (vllm_runs saves it a perturbed copy): none of its
  parameters equals the trainer's first synced weights before the first sync, so a sync that writes nothing fails;
- after every weight sync, the engine's parameters read back from vLLM (``LLM.apply_model``) equal the weights it must
  hold, computed without odc_hf's sync code (the trainer's parameters gathered through the CPU; LoRA merged by peft's
  ``merge_and_unload()`` on a CPU copy; hand-stacked ``qkv_proj`` / ``gate_up_proj``), cast to the engine's dtype, bit
  for bit (LoRA-merged projections: within one rounding step of it), no engine parameter unwritten, unexpected or of
  another shape (vLLM's zero vocabulary padding aside); one sync per optimizer step;
- a run with the sync switched off fails that comparison in every parameter and shows TRL's
  ``sampling/sampling_logp_difference/max`` far above the synced runs' (the negative control of both);
- every metric key TRL's GRPOTrainer logs with vLLM is logged (TRL's importance-sampling metrics included);
- per-step losses and gradient norms equal TRL's on the same rollouts: both engines start from the same weights and
  seed (TRL's ``seed=rank``), so step 1's completions are the same; a later step is compared where its completions
  are too (the trainers' fp32 weights agree to rounding, the bf16 engines usually sample the same tokens from them).
  The model ends completions early (``--eos_prone``), so losses are not zero up to rounding. Where the engines' bf16
  weights differ, TRL's token-level importance sampling gives a bound from the logged engine noise, which must sit
  below the loss it checks and fail on a stale loss (``vllm_runs.loss_comparison``);
- at world 2, each rank's engine generated its own rank's prompts (no prompt on both ranks).
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
from vllm_runs import (
    TOKEN_IS,
    TRL_VLLM_KEYS,
    engine_noise_bound,
    key_problems,
    loss_comparison,
    prompt_problems,
    same_rollout_steps,
    start_problems,
    sync_distance,
    sync_problems,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'odc_hf[vllm]')"
    ),
]
STEPS = 3
NOT_COMPARED = ("step", "epoch", "learning_rate", "step_time")
# Every run's model ends completions early (--eos_prone, as the CPU twin): completions of varied lengths, so the
# dapo loss (a mean over tokens of standardised advantages, which sum to zero per prompt) is not zero up to rounding
# (without it, steps 2-3 logged -1.0e-8 vs 0.0 on the H200 and a 1e-6 absolute tolerance let anything through).
COMMON = ("--eos_prone",)
MIN_LOSS = 1e-3  # every compared step's |loss| is at least this: a relative comparison of it means something
# fp32 trainers on the same rollouts: measured on one H200 at 056618d, step 1 bit-equal (loss and gradient norm).
# Losses 1e-5 relative, as the one-GPU GRPO test (test_gpu_one_device); gradient norms 1e-4 (step 2 measured 5.1e-5).
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4


def _env() -> dict:
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
           **sft_runs.launch_env(), "ODC_NO_RELAUNCH": "1"}  # fmt: skip
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def one_process(out: Path, trainer: str, *args) -> dict:
    """``tests/support/vllm_runs.py TRAINER OUT *args`` in a new plain process (world 1); its rank0.json."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests/support/vllm_runs.py"), trainer, str(out), *COMMON,
                           *map(str, args)],
                          env=_env(), capture_output=True, text=True, timeout=900)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {**json.loads((out / "rank0.json").read_text()), "out": str(out)}


def two_ranks(out: Path, *args) -> list[dict]:
    """``tests/support/vllm_runs.py odc OUT *args`` on 2 ranks (accelerate_configs/odc.yaml; one GPU: they share it)."""
    proc = gpu_launch(ROOT / "tests/support/vllm_runs.py", "odc", out, *COMMON, *args, processes=2, timeout=1200)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def assert_synced_exactly(run: dict, what: str, *, merged: tuple[str, ...] = (), steps: int = STEPS) -> None:
    """The engine started elsewhere and holds, after every sync, what it must (tests/support/vllm_runs.py's checks)."""
    syncs = run["syncs"]
    print(f"{what}: {len(syncs)} syncs, engine vs expected max |diff| {[s['max_abs'] for s in syncs]}, unequal "
          f"{[len(s['unequal']) for s in syncs]}, start {run['start']}, sync seconds {run.get('sync_seconds')}")  # fmt: skip
    assert start_problems(run) == [], (what, start_problems(run))
    assert sync_problems(run, steps, merged=merged) == [], (what, sync_problems(run, steps, merged=merged))


def _logp_max(run: dict) -> float:
    return max(h["sampling/sampling_logp_difference/max"] for h in run["history"])


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_vllm_gpu")
    return one_process(base / "odc", "odc"), one_process(base / "trl", "trl")


def test_world1_engine_weights_equal_the_trainers_after_every_sync(world1):
    odc, trl = world1
    assert odc["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and odc["versions"]["vllm"].startswith("0.26")
    assert odc["start"]["source"] == "engine"
    assert_synced_exactly(odc, "ODCGRPOTrainer")
    assert_synced_exactly(trl, "GRPOTrainer (TRL's own sync)")


def test_world1_without_the_sync_the_checks_fail_and_the_logp_difference_is_large(world1, tmp_path):
    # The negative control: the same runner with the trainer's sync skipped (one step). The engine generates from its
    # own starting weights (the perturbed checkpoint, final norm x5): every parameter differs from the trainer's, and
    # TRL's sampling_logp_difference/max is of order 1 (measured with the CPU stand-in: 2.9; bound 0.5) and more than
    # 10 times the synced runs' (bf16 engine vs fp32 trainer: their rounding).
    odc, trl = world1
    off = one_process(tmp_path / "no_sync", "odc", "--no_sync", "--steps", 1)
    (sync,) = off["syncs"]
    print(f"no sync: {len(sync['unequal'])} of {sync['compared']} engine parameters unequal, max |diff| "
          f"{sync['max_abs']:.3g}; logp difference max {_logp_max(off):.3g} vs synced ODC {_logp_max(odc):.3g}, "
          f"TRL {_logp_max(trl):.3g}")  # fmt: skip
    assert off["no_sync"] and start_problems(off) == []
    assert len(sync["unequal"]) == sync["compared"] > 0 and sync_problems(off, 1), sync
    assert _logp_max(off) > 0.5, off["history"]
    assert _logp_max(off) > 10 * max(_logp_max(odc), _logp_max(trl)), (off["history"], odc["history"])


def test_world1_logs_every_metric_trl_logs(world1):
    odc, trl = world1
    keys = set(trl["history"][0]) - set(NOT_COMPARED)
    assert set(TRL_VLLM_KEYS) <= keys, sorted(set(TRL_VLLM_KEYS) - keys)
    assert key_problems(odc, keys, STEPS) == []
    assert all(h["odc/vllm_sync_s"] > 0 for h in odc["history"])


def _compared_steps(odc: dict, trl: dict) -> list[int]:
    same = same_rollout_steps(odc, trl)
    pairs = [((odc["history"][i]["loss"], trl["history"][i]["loss"]),
              (odc["history"][i]["grad_norm"], trl["history"][i]["grad_norm"])) for i in range(STEPS)]  # fmt: skip
    print(f"steps with the same rollouts: {[i + 1 for i in same]}; (loss, grad norm) ODC vs TRL: {pairs}")
    assert 0 in same, "step 1's completions differ: the engines did not start from the same weights and seed"
    assert len({len(c) for c in odc["rollouts"][0]}) > 2, "completions of one length: the loss would be ~0"
    assert all(abs(trl["history"][i]["loss"]) >= MIN_LOSS for i in same), pairs
    return same


def _assert_equal_step(a: dict, b: dict, step: int) -> None:
    assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL, abs=0.0), (step, a, b)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_NORM_RTOL), (step, a, b)
    assert a["reward"] == b["reward"]


@pytest.fixture(scope="module")
def world1_without_importance_sampling(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_vllm_gpu_no_is")
    flag = "--no_importance_sampling"
    return one_process(base / "odc", "odc", flag), one_process(base / "trl", "trl", flag)


def test_world1_losses_equal_trls_on_the_same_rollouts_without_importance_sampling(world1_without_importance_sampling):
    # TRL's importance-sampling correction off: the loss is the trainer's alone, so on the same rollouts ODC's equals
    # TRL's at every step (fp32 trainers, the one-GPU tier's bounds)
    odc, trl = world1_without_importance_sampling
    for i in _compared_steps(odc, trl):
        _assert_equal_step(odc["history"][i], trl["history"][i], i + 1)


def test_world1_losses_with_importance_sampling_on_the_same_engine_weights_are_equal(world1):
    # TRL's default correction (sequence-level, masked): where both engines hold the same weights (step 1 always:
    # the same start and seed) the losses and gradient norms are equal to the fp32 bounds
    odc, trl = world1
    distances = sync_distance(Path(odc["out"]), Path(trl["out"]), STEPS)
    same_engines = [i for i in _compared_steps(odc, trl) if distances[i]["engine_elements_differing"] == 0]
    assert 0 in same_engines, distances
    for i in same_engines:
        _assert_equal_step(odc["history"][i], trl["history"][i], i + 1)


@pytest.fixture(scope="module")
def world1_token_importance_sampling(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo_vllm_gpu_token_is")
    flag = ("--importance_sampling_mode", TOKEN_IS)
    return one_process(base / "odc", "odc", *flag), one_process(base / "trl", "trl", *flag)


# Where the engines hold different weights, the importance weights differ. The two trainers' fp32 weights agree to
# rounding after a step (~5e-7 of their norm; single elements further: AdamW turns rounding noise in a gradient of ~0
# into an lr-sized step, tests/grpo/test_vllm_runs_stand_in.py), and a bf16 engine keeps every element that lands on
# the other side of a rounding step: the engines' log-probabilities differ, so the losses may too (on the H200 at
# step 2: -0.0042002 vs -0.0041199, with completions all of one length). Under TRL's token-level truncated correction
# that difference has a bound from what both runs log (vllm_runs.engine_noise_bound: sqrt(G - 1) x ratio max x the two
# engines' mean log-prob difference); TRL's default sequence-level ratio exponentiates sums over a completion, which
# no logged mean bounds. The check must be able to fail: at least one compared step where the engines differ has its
# bound below the loss itself, and there the stale-loss control (ODC's loss of another step) fails it.
def test_world1_losses_with_token_importance_sampling_differ_only_as_far_as_the_engines_do(
    world1_token_importance_sampling,
):
    odc, trl = world1_token_importance_sampling
    distances = sync_distance(Path(odc["out"]), Path(trl["out"]), STEPS)
    print(f"trainers and engines of ODC vs TRL at each sync: {distances}")
    same = _compared_steps(odc, trl)
    result = loss_comparison(odc, trl, distances, same, rtol=LOSS_RTOL)
    bounds = {i + 1: engine_noise_bound(odc["history"][i], trl["history"][i]) for i in same}
    print(f"engine-noise bounds by step {bounds}; {result}")
    assert result["problems"] == [], result["problems"]
    differing = [i for i in same if distances[i]["engine_elements_differing"] > 0]
    if differing:
        assert set(differing) & set(result["meaningful"]), (
            f"no step where the engines differ has a bound below its loss ({bounds}): the comparison cannot fail")
    assert result["meaningful"] and all(result["stale_loss_fails"]), result
    for i in same:
        a, b = odc["history"][i], trl["history"][i]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (i, a, b)  # measured 5.1e-5
        assert a["reward"] == b["reward"]


def test_world1_sleep_mode_and_lora(tmp_path):
    # sleep level 2 after every generation (TRL's sleep mode): the sync wakes the weights, then writes them all; LoRA
    # merged into the base weights (W + scaling * B @ A; the adapter moves after step 1, so syncs 2 and 3 differ from
    # the base model). The expected merge is peft's, on the CPU: one rounding step of the engine's dtype allowed in
    # the merged qkv_proj (q and v adapted).
    run = one_process(tmp_path / "odc", "odc", "--sleep", "--peft")
    assert run["start"]["source"] == "checkpoint"  # level 2 discards the weights: the loaded checkpoint compared
    assert_synced_exactly(run, "ODCGRPOTrainer, sleep mode + LoRA", merged=("qkv_proj",))
    assert key_problems(run, TRL_VLLM_KEYS, STEPS) == []


def test_two_ranks_sharing_the_gpu(tmp_path):
    # world 2 (on a one-GPU machine the shared-GPU mode: gloo, CUDA IPC, both engines on cuda:0, each taking 15% of
    # the GPU): each rank's engine gets the whole model from ODC's published shards (one-sided, no collective)
    ranks = two_ranks(tmp_path / "odc", "--gpu_memory_utilization", "0.15")
    for rank, run in enumerate(ranks):
        assert run["world"] == 2 and run["device"].startswith("cuda"), run["device"]
        assert "CUDA transport" in (run["odc"] or ""), run["odc"]
        assert_synced_exactly(run, f"rank {rank} of 2")
        assert key_problems(run, TRL_VLLM_KEYS, STEPS) == []
    # each engine generated its own rank's share of the step's prompts (TRL splits every generation batch by rank)
    assert prompt_problems(ranks) == [], prompt_problems(ranks)
