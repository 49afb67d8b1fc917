"""Resuming an ODCGRPOTrainer run from its checkpoints, against TRL's GRPOTrainer resuming from its own (2 CPU
processes, fixed rollouts, a reference model, a generation batch spanning two optimizer steps).

From a checkpoint at the end of a generation batch the resumed run trains the same steps as the run that was never
stopped. From one inside a generation batch TRL generates anew (its buffer of completions is not in the checkpoint)
and trains the new batch's first step: the resumed ODC run must do what TRL's resumed run does."""

from __future__ import annotations

import pytest
from example_scripts import grpo_run

COMMON = ["--fixed_rollouts", "--max_steps", "4", "--loss_type", "dapo", "--beta", "0.05", "--steps_per_generation", "4",
          "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_completion_length", "48",
          "--save_steps", "1"]  # fmt: skip
ODC = ["--trainer", "odc", "--balance", "lb_mini", "--max_tokens_per_microbatch", "64"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_resume")
    out = {"odc": grpo_run(tmp / "odc", *COMMON, *ODC), "trl": grpo_run(tmp / "trl", *COMMON, "--trainer", "trl")}
    for step in (1, 2):
        out[f"odc_from_{step}"] = grpo_run(tmp / f"odc_from_{step}", *COMMON, *ODC, "--resume_from_checkpoint",
                                           str(tmp / "odc" / "dapo" / f"checkpoint-{step}"))  # fmt: skip
    out["trl_from_1"] = grpo_run(tmp / "trl_from_1", *COMMON, "--trainer", "trl", "--resume_from_checkpoint",
                                 str(tmp / "trl" / "dapo" / "checkpoint-1"))  # fmt: skip
    return {name: run["dapo"]["history"] for name, run in out.items()}


def _after(history: list[dict], step: int) -> list[dict]:
    return [h for h in history if h["step"] > step]


@pytest.mark.slow
def test_resuming_at_the_end_of_a_generation_batch_trains_the_same_steps(runs):
    resumed, full = _after(runs["odc_from_2"], 2), _after(runs["odc"], 2)
    assert [h["step"] for h in resumed] == [3, 4] and "reward" in resumed[0]  # step 3 generates
    for a, b in zip(resumed, full):  # the same process layout, the same arithmetic: bit for bit
        assert (a["loss"], a["grad_norm"], a.get("reward")) == (b["loss"], b["grad_norm"], b.get("reward")), (a, b)


@pytest.mark.slow
def test_resuming_inside_a_generation_batch_does_what_trl_does(runs):
    ours, theirs = _after(runs["odc_from_1"], 1), _after(runs["trl_from_1"], 1)
    assert [h["step"] for h in ours] == [h["step"] for h in theirs] == [2, 3, 4]
    # TRL generates at the resumed step 2 (a reward is logged there, none in the run that was never stopped)
    assert "reward" in theirs[0] and "reward" not in _after(runs["trl"], 1)[0]
    # tolerances of test_grpo_parity.py; the control: the run that was never stopped differs from both
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
        assert a.get("reward") == (None if "reward" not in b else pytest.approx(b["reward"], rel=1e-6))
    assert abs(_after(runs["odc"], 1)[0]["loss"] - theirs[0]["loss"]) > 1e-3
