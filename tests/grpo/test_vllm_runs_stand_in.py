"""tests/support/vllm_runs.py, the runner of the vLLM GPU test (tests/gpu/test_grpo_vllm_gpu.py), on CPU with ``--stand_in``
(odc_hf/testing/vllm_fake.py's engine: vLLM's stacked ``qkv_proj`` / ``gate_up_proj`` layout and ``load_weights`` contract),
each run a fresh process as on the GPU (forked from the test process's fork server:
tests/support/launched.py), checked with the GPU test's own checks (``sync_problems``,
``start_problems``, ``key_problems``, ``prompt_problems``, ``loss_comparison``): ODCGRPOTrainer and TRL's GRPOTrainer
at world 1 (with TRL's default importance sampling, with its token-level truncated one, and with that one under the
``vespo`` loss), ODC with sleep mode and
LoRA, ODC with its sync switched off (the negative control), ODC on 2 CPU ranks.

The runs use ``--eos_prone`` (completions of 1 to 16 tokens) so that the losses compared are not zero up to
rounding, and 16 completion tokens at most to stay quick.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launched import run_launched, run_plain
from vllm_runs import (
    TOKEN_IS,
    TRL_VLLM_KEYS,
    key_problems,
    loss_comparison,
    prompt_problems,
    same_rollout_steps,
    start_problems,
    sync_distance,
    sync_problems,
)

RUNNER = Path(__file__).resolve().parents[2] / "tests/support/vllm_runs.py"
STEPS = 3
COMMON = ("--stand_in", "--eos_prone", "--max_completion_length", "16")


def _one_process(out: Path, trainer: str, *args) -> dict:
    run_plain(RUNNER, trainer, out, *COMMON, *args, env={"ACCELERATE_USE_CPU": "true"}, timeout_s=600)
    return {**json.loads((out / "rank0.json").read_text()), "out": str(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_runs_stand_in")
    result = {name: _one_process(base / name, trainer, *args) for name, (trainer, args) in {
        "odc": ("odc", ()), "trl": ("trl", ()), "lora_sleep": ("odc", ("--sleep", "--peft")),
        "no_sync": ("odc", ("--no_sync", "--steps", "1")),
        "odc_token": ("odc", ("--importance_sampling_mode", TOKEN_IS)),
        "trl_token": ("trl", ("--importance_sampling_mode", TOKEN_IS)),
        "odc_vespo": ("odc", ("--importance_sampling_mode", TOKEN_IS, "--loss_type", "vespo")),
        "trl_vespo": ("trl", ("--importance_sampling_mode", TOKEN_IS, "--loss_type", "vespo"))}.items()}  # fmt: skip
    run_launched(RUNNER, "odc", base / "two", *COMMON, timeout_s=600)
    result["two"] = [json.loads((base / "two" / f"rank{r}.json").read_text()) for r in range(2)]
    return result


def test_the_engine_holds_the_trainers_weights_after_every_sync_and_started_elsewhere(runs):
    for name, merged in (("odc", ()), ("trl", ()), ("lora_sleep", ("qkv_proj",))):
        run = runs[name]
        assert start_problems(run) == [] and sync_problems(run, STEPS, merged=merged) == [], name
        # the stand-in runs fp32 and merges as peft does on the same CPU: even the LoRA-merged weights are bit-equal
        assert all(s["unequal"] == [] and s["compared"] == 16 for s in run["syncs"]), (name, run["syncs"])
    assert runs["lora_sleep"]["start"]["source"] == "checkpoint" and runs["odc"]["start"]["source"] == "engine"


def test_without_the_sync_every_check_fails(runs):
    # the negative control of the sync check and of the log-probability difference: the engine keeps the perturbed
    # checkpoint it loaded (final norm x5). Measured: every parameter unequal (max |diff| 4.2), logp difference 2.9.
    off = runs["no_sync"]
    (sync,) = off["syncs"]
    assert off["no_sync"] and start_problems(off) == []
    assert len(sync["unequal"]) == len(sync["beyond_ulp"]) == sync["compared"] == 16, sync
    assert any("unequal" in p for p in sync_problems(off, 1))
    # synced, fp32 on both sides: measured <= 3.8e-6; bound 1e-4 (as tests/grpo/test_grpo_vllm.py). Unsynced: > 1e-1.
    assert off["history"][0]["sampling/sampling_logp_difference/max"] > 1e-1, off["history"]
    for name in ("odc", "trl", "lora_sleep"):
        assert all(h["sampling/sampling_logp_difference/max"] < 1e-4 for h in runs[name]["history"]), name


def test_losses_equal_trls_on_the_same_rollouts(runs):
    # the GPU test's comparison, with the CPU's bound: ODC (packed rows) vs TRL (padded rows), fp32, the same
    # completions at every step (measured). Gradient norms measured <= 1.6e-6 relative, bound 1e-4. Losses (0.002 to
    # 0.14) measured <= 1.4e-4 relative, 1.1e-6 absolute: TRL's default sequence-level importance ratio exponentiates
    # the sum of a completion's log-probability differences, in which the two trainers' kernels differ by ~1e-6 per
    # token; bound 1e-3 relative. A lost microbatch or another normaliser moves a loss by 10% or more.
    odc, trl = runs["odc"], runs["trl"]
    same = same_rollout_steps(odc, trl)
    assert 0 in same
    assert len({len(c) for c in odc["rollouts"][0]}) > 2  # completions of varied lengths: the loss is not ~0
    for i in same:
        a, b = odc["history"][i], trl["history"][i]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (i, a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=0.0), (i, a, b)


def test_losses_with_token_importance_sampling_differ_only_as_far_as_the_engines_do(runs):
    # the GPU test's comparison where the engines' weights differ (steps 2 and 3 here: the fp32 stand-in copies the
    # trainers' rounding differences), with its bound from the runs' logged engine noise (vllm_runs.engine_noise_bound).
    # Measured: losses 0.0025 to 0.14 apart by <= 3.0e-8, bounds ~3e-6: every step's check can fail, and fails on
    # ODC's loss of another step (the stale-loss control).
    odc, trl = runs["odc_token"], runs["trl_token"]
    distances = sync_distance(Path(odc["out"]), Path(trl["out"]), STEPS)
    same = same_rollout_steps(odc, trl)
    assert same == [0, 1, 2] and any(d["engine_elements_differing"] for d in distances), (same, distances)
    result = loss_comparison(odc, trl, distances, same, rtol=1e-3)
    print(result)
    assert result["problems"] == [], result["problems"]
    assert result["meaningful"] == same and all(result["stale_loss_fails"]), result
    broken = {**odc, "history": [dict(h, loss=h["loss"] * 1.01) for h in odc["history"]]}  # a 1% normaliser error
    assert len(loss_comparison(broken, trl, distances, same, rtol=1e-3)["problems"]) == len(same)


def test_vespo_with_token_importance_sampling_equals_trls(runs):
    # vespo (TRL requires a token-level vLLM importance ratio with it) sums the log of that ratio over every column of
    # a row, TRL's padding included, where TRL's ratio is 1; ODC's microbatches are padded otherwise, so its padding
    # must add nothing either (grpo_batch._RIGHT_PAD; test_grpo_trl_surface.py checks the value). Measured: step 1
    # (the same engine weights) equal to 4e-8 relative, steps 2-3 within 3.3e-5 (the engines' noise, as above); with
    # the ratio padded with 0 (each padding column then adds log(1e-8) to a sequence's log-ratio) ODC's step-1 loss
    # was -1.178 against TRL's -0.461.
    odc, trl = runs["odc_vespo"], runs["trl_vespo"]
    distances = sync_distance(Path(odc["out"]), Path(trl["out"]), STEPS)
    assert same_rollout_steps(odc, trl) == [0, 1, 2] and distances[0]["engine_elements_differing"] == 0, distances
    assert len({len(c) for c in odc["rollouts"][0]}) > 2  # completions of varied lengths: padding in both layouts
    first, theirs = odc["history"][0], trl["history"][0]
    assert first["loss"] == pytest.approx(theirs["loss"], rel=1e-5) and abs(theirs["loss"]) > 1e-2, (first, theirs)
    assert first["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    for a, b in zip(odc["history"], trl["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a, b)
        assert a["vespo/phi_seq_mean"] == pytest.approx(b["vespo/phi_seq_mean"], rel=1e-4), (a, b)


def test_every_trl_metric_is_logged(runs):
    keys = set(runs["trl"]["history"][0]) - {"step", "epoch", "learning_rate", "step_time"}
    assert set(TRL_VLLM_KEYS) <= keys, sorted(set(TRL_VLLM_KEYS) - keys)
    for name in ("odc", "lora_sleep"):
        assert key_problems(runs[name], keys, STEPS) == [], name


def test_two_ranks(runs):
    ranks = runs["two"]
    for run in ranks:
        assert run["world"] == 2 and "CPU shared-memory transport" in run["odc"], run["odc"]
        assert start_problems(run) == [] and sync_problems(run, STEPS) == []
        assert key_problems(run, TRL_VLLM_KEYS, STEPS) == []
    assert prompt_problems(ranks) == []
    assert prompt_problems([ranks[0], ranks[0]]), "the prompt check cannot fail"


def test_the_distance_of_two_runs_trainers_and_engines(runs):
    # what the GPU test reads to tell where a loss may differ (the engines' weights): here, fp32 trainers and the
    # stand-in's fp32 engine. Sync 1: both start from the same weights (no difference anywhere). After steps on the
    # same rollouts the trainers agree to rounding as a whole (measured 4.6e-7 / 6.3e-7 of the weights' norm at syncs 2
    # and 3; bound 1e-5), while single elements differ by up to 1.3% of their tensor's largest: AdamW divides each
    # gradient by its running RMS, so rounding noise in a gradient of ~0 becomes an lr-sized step. A fp32 engine
    # copies those differences (14% of its elements at sync 2); a bf16 engine keeps those that cross a rounding step.
    odc, trl, off = runs["odc"], runs["trl"], runs["no_sync"]
    distances = sync_distance(Path(odc["out"]), Path(trl["out"]), STEPS)
    print(distances)
    assert distances[0]["trainer_norm"] == 0.0 and distances[0]["engine_elements_differing"] == 0, distances
    same = same_rollout_steps(odc, trl)
    after_same = [d for d in distances[1:] if all(step in same for step in range(d["sync"] - 1))]
    assert after_same and all(d["trainer_norm"] < 1e-5 for d in after_same), (same, distances)
    (against_unsynced,) = sync_distance(Path(off["out"]), Path(odc["out"]), 1)  # negative control: its engine kept
    assert against_unsynced["engine_elements_differing"] == against_unsynced["engine_elements"], against_unsynced
