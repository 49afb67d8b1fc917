"""Trainer checkpoint + resume with ODC (2 CPU processes as `accelerate launch` starts them, forked:
tests/support/launched.py): a run saves at step 3 (model, sharded optimizer, scheduler, RNG, sampler position); a
second job resumes from that checkpoint and trains steps 4-6. Both are compared with an uninterrupted run of TRL's
own SFTTrainer in one process on the whole minibatches (tests/support/sft_runs.py): per-step losses, gradient norms,
and the checkpointed weights themselves."""

from __future__ import annotations

import pytest
import sft_runs
import torch
from sft_runs import assert_same_steps, odc_run, trl_reference

SAVE_AT = 3


def _weights(checkpoint):
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


@pytest.mark.slow
def test_resumed_odc_run_matches_an_uninterrupted_trl_run(tmp_path):
    first = odc_run(tmp_path / "first", "--save_steps", str(SAVE_AT))
    checkpoint = tmp_path / "first" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "odc_optimizer").is_dir(), "the optimizer must be saved shard by shard"
    resumed = odc_run(tmp_path / "resumed", "--resume_from_checkpoint", str(checkpoint))
    trl = trl_reference(tmp_path / "trl", "--save_steps", str(SAVE_AT))
    steps = range(1, sft_runs.MAX_STEPS + 1)
    assert_same_steps(first["history"], trl["history"], steps)
    # The resumed job ran only the steps after the checkpoint (its log starts with the checkpoint's history).
    assert len(resumed["microbatches"]) == sft_runs.MAX_STEPS - SAVE_AT
    assert resumed["history"][:SAVE_AT] == first["history"][:SAVE_AT]
    assert_same_steps(resumed["history"][SAVE_AT:], trl["history"], range(SAVE_AT + 1, sft_runs.MAX_STEPS + 1))
    # The checkpoint holds the full (unsharded) model as it was after step 3: TRL's weights at its own step 3.
    # Adam moves every element by ~lr = 1e-3 per step whatever its gradient; the runs' fp32 differences in the
    # gradients (<= ~1e-5 relative) change an update by about that fraction of lr: measured <= 7e-7 absolute after
    # 3 steps, bound 1e-5. A checkpoint from the wrong step, or with one rank's shard only, is off by ~1e-3 or more.
    ours, theirs = _weights(checkpoint), _weights(tmp_path / "trl" / f"checkpoint-{SAVE_AT}")
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)  # the tied lm_head is saved by neither
    for name, value in ours.items():
        assert value.shape == theirs[name].shape, name
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-5, msg=name)

