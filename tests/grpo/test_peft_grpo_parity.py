"""GRPO with LoRA (peft) under ODC: ODCGRPOTrainer's per-step losses and grad norms equal TRL's own GRPOTrainer +
the same LoRA (DDP collectives, TRL's loss code) on the same rollouts (CPU, 2 processes as `accelerate launch` starts them),
with the KL term on (beta > 0: TRL's reference is the base model with the adapter disabled, run under ODC too) and
ranks running different numbers of microbatches on some step. The model's lm_head is untied (Llama / Mistral style):
the fused head reads it through the PeftModel, which crashed at step 1 before the head shared the norm's unit. Runs examples/grpo.py as tests/grpo/test_grpo_parity.py
does, with ``--use_peft``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from example_scripts import grpo_run

LOSS_TYPES = ("dapo", "grpo")  # a global-token normaliser and a per-sequence one
COMMON = ["--fixed_rollouts", "--max_steps", "4", "--loss_type", ",".join(LOSS_TYPES), "--beta", "0.05",
          "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_completion_length", "48",
          "--use_peft", "--lora_r", "8", "--learning_rate", "1e-2",
          "--untied_lm_head"]  # fmt: skip  # LoRA with a tied head: tests/fsdp/test_collective_audit.py's GRPO run


def launch(tmp_path: Path, name: str, *extra: str) -> dict:
    return grpo_run(tmp_path / name, *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft_grpo_parity")
    # attention-bound costs: LB-Mini splits the packed rows (the CPU default) unevenly (see test_grpo_parity.QUADRATIC)
    quadratic = tmp / "quadratic.json"
    quadratic.write_text(json.dumps({"a": 0.0, "b": 1e-6, "c": 1e-5}))
    odc = launch(tmp, "odc", "--trainer", "odc", "--balance", "lb_mini", "--max_tokens_per_microbatch", "64",
                 "--cost_model", str(quadratic), *COMMON)  # fmt: skip
    trl = launch(tmp, "trl", "--trainer", "trl", *COMMON)
    return odc, trl


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_odc_lora_grpo_matches_trl_lora_grpo_step_by_step(runs, loss_type):
    odc, trl = runs[0][loss_type], runs[1][loss_type]
    assert len(odc["history"]) == len(trl["history"]) == 4
    uneven = [s["microbatches"] for s in odc["steps"] if len(set(s["microbatches"])) > 1]
    assert uneven, (
        f"{loss_type}: the ranks should run different microbatch counts on some step: {odc['steps']}"
    )
    # Losses: absolute fp32 error of cancelling per-token terms (see test_grpo_parity): measured <= 3e-8, bound 1e-6.
    # Gradient norms: only the adapters' gradients, which cancel far less than the full model's: measured <= 1.2e-7
    # relative (0 on most steps), bound 2e-6. A lost or doubled microbatch moves both by > 1e-2.
    for a, b in zip(odc["history"], trl["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-6), (a, b)
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-6)  # the same rollouts
    # The loss includes beta * KL against the adapter-disabled base: the adapter moved the policy, so the KL term
    # counts in the equal losses above. (The logged KL itself is a mean of per-microbatch means, and the microbatches
    # differ between the trainers, so it is not compared.)
    assert odc["history"][-1]["kl"] > 0 and trl["history"][-1]["kl"] > 0
