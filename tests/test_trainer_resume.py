"""Trainer checkpoint + resume with ODC on CPU (2 processes through accelerate launch): resuming from the
step-5 checkpoint (model, sharded optimizer, scheduler, RNG, sampler position) reproduces steps 6-10."""

from __future__ import annotations

import pytest
from test_trainer_sft_parity import launch


@pytest.mark.slow
def test_resume_from_step_5_reproduces_steps_6_to_10(tmp_path):
    full = launch(tmp_path, "run", "--save_steps", "5")
    checkpoint = tmp_path / "run" / "checkpoint-5"
    assert (checkpoint / "odc_optimizer").is_dir(), "the optimizer must be saved shard by shard"
    resumed = launch(tmp_path, "run", "--resume_from_checkpoint", str(checkpoint))
    first = {h["step"]: h["loss"] for h in full["history"]}
    again = {h["step"]: h["loss"] for h in resumed["history"]}
    assert len(resumed["steps"]) == 5  # only steps 6-10 ran
    for step in range(6, 11):
        assert again[step] == first[step], (step, again[step], first[step])
