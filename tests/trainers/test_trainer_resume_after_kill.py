"""kill -9 of a rank while the trainer saves a checkpoint (2 CPU ranks, ODCSFTTrainer, tests/support/resume_runs.py).

A run saves every 2 steps and keeps one checkpoint (``save_total_limit=1``); rank 1 SIGKILLs itself inside the save
of checkpoint-4 (after the model was written, before its optimizer shard). checkpoint-2 must stay loadable, and
``resume_from_checkpoint=True`` must take it, not the newer, partial checkpoint-4: the resumed steps 3-4 repeat the
killed run's. Before the fix the Trainer took checkpoint-4 (the highest-numbered folder) and failed on its missing
trainer_state.json. Then the resumed run writes checkpoint-4 again, complete, and only then rotates checkpoint-2
away.
"""

from __future__ import annotations

import json

import pytest
from resume_runs import train_ranks

MARKER = "odc_checkpoint.json"  # odc_hf.integrations.checkpoint.resume.MARKER


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("kill_in_save") / "run"
    options = {"save_steps": 2, "save_total_limit": 1, "max_steps": 6}
    killed = train_ranks(2, (out, {**options, "kill_rank_in_save": (1, 4)}), raise_on_failure=False)
    partial = sorted(p.name for p in (out / "checkpoint-4").iterdir())
    (resumed, _) = train_ranks(2, (out, {**options, "max_steps": 4, "resume": True}))
    return out, killed, partial, resumed[0]


def test_the_killed_save_leaves_the_previous_checkpoint_and_an_unmarked_partial_one(runs):
    out, killed, partial, _ = runs
    assert killed[1].exitcode == -9, killed[1]  # SIGKILL inside the save
    (survivor,) = killed[0].value  # rank 0 raised inside train(): the peer's death, reported by ODC
    assert "PeerFailedError" in survivor["error"] and "rank 1" in survivor["error"], survivor["error"]
    assert [h["step"] for h in survivor["history"]] == [1, 2, 3, 4]  # step 4 logs before its save
    assert "model.safetensors" in partial and MARKER not in partial and "trainer_state.json" not in partial, partial


def test_resume_takes_the_last_complete_checkpoint_and_repeats_the_steps(runs):
    out, killed, _, resumed = runs
    assert resumed["error"] is None, resumed["error"]
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]  # 1-2 from checkpoint-2's trainer state
    assert len(resumed["microbatches"]) == 2, resumed["microbatches"]  # only steps 3 and 4 ran
    # the same ranks, plans and arithmetic from the same state: bit for bit the killed run's steps
    assert resumed["history"] == killed[0].value[0]["history"]


def test_the_new_checkpoint_is_marked_before_the_old_one_is_rotated(runs):
    out, *_ = runs
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # save_total_limit=1
    marker = json.loads((out / "checkpoint-4" / MARKER).read_text())
    assert marker["global_step"] == 4 and marker["world_size"] == 2 and marker["global_batch_size"] == 8, marker
    assert (out / "checkpoint-4" / "odc_optimizer" / ".metadata").is_file()
