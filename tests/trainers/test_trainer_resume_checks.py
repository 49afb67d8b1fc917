"""What a resume must refuse, and what it must not warn about (2 CPU ranks, ODCSFTTrainer, tests/support/resume_runs.py).

- A checkpoint that lacks a part the run needs (the sharded optimizer ``odc_optimizer/``, one rank's optimizer shard,
  the scheduler, ``trainer_state.json``) is an error naming the part and the checkpoint, on every rank. Before, a
  missing ``odc_optimizer/`` resumed silently with a fresh AdamW.
- A correct resume logs no "missing keys" warning (the tied ``lm_head.weight`` is never saved); a checkpoint whose
  weights really lack a tensor still warns, naming it.
"""

from __future__ import annotations

import shutil

import pytest
from resume_runs import train_ranks

SAVE_STEPS, MAX_STEPS = 2, 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume_checks")
    (result,), _ = train_ranks(2, (path / "run", {"save_steps": SAVE_STEPS, "max_steps": MAX_STEPS}))
    return path, result


def _broken_copies(path):
    """Copies of checkpoint-2, each with one part removed, and one whose weights lack a tensor."""
    from safetensors.torch import load_file, save_file

    source = path / "run" / f"checkpoint-{SAVE_STEPS}"
    broken = {}
    for name, remove in (("no_optimizer", "odc_optimizer"), ("no_scheduler", "scheduler.pt"),
                         ("no_state", "trainer_state.json"), ("no_shard", "odc_optimizer/__1_0.distcp"),
                         ("no_weight", None)):  # fmt: skip
        copy = path / "broken" / name / f"checkpoint-{SAVE_STEPS}"
        shutil.copytree(source, copy)
        if remove is None:
            weights = load_file(copy / "model.safetensors")
            del weights["model.norm.weight"]
            save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
        elif (copy / remove).is_dir():
            shutil.rmtree(copy / remove)
        else:
            (copy / remove).unlink()
        broken[name] = copy
    return broken


@pytest.fixture(scope="module")
def resumed(uninterrupted):
    path, _ = uninterrupted
    broken = _broken_copies(path)
    runs = [(path / "resumed", {"resume": str(path / "run" / f"checkpoint-{SAVE_STEPS}"), "max_steps": MAX_STEPS})]
    runs += [(path / f"out_{name}", {"resume": str(broken[name]), "max_steps": MAX_STEPS})
             for name in ("no_weight", "no_optimizer", "no_scheduler", "no_state", "no_shard")]  # fmt: skip
    per_rank = train_ranks(2, *runs)
    names = ["good", "no_weight", "no_optimizer", "no_scheduler", "no_state", "no_shard"]
    return {name: [results[i] for results in per_rank] for i, name in enumerate(names)}, broken


def test_a_correct_resume_repeats_the_steps_without_warnings(uninterrupted, resumed):
    _, first = uninterrupted
    good = resumed[0]["good"][0]
    assert good["error"] is None, good["error"]
    assert [h["step"] for h in good["history"]] == list(range(1, MAX_STEPS + 1))
    # the same ranks, plans and arithmetic as the uninterrupted run: bit for bit
    assert good["history"][SAVE_STEPS:] == first["history"][SAVE_STEPS:]
    for rank_result in resumed[0]["good"]:
        assert not [w for w in rank_result["warnings"] if "missing keys" in w], rank_result["warnings"]


def test_weights_that_really_lack_a_tensor_still_warn(resumed):
    for rank_result in resumed[0]["no_weight"]:
        assert rank_result["error"] is None, rank_result["error"]
        missing = [w for w in rank_result["warnings"] if "missing keys" in w]
        assert len(missing) == 1 and "model.norm.weight" in missing[0] and "lm_head" not in missing[0], missing


@pytest.mark.parametrize("name, part", [("no_optimizer", "odc_optimizer/"), ("no_scheduler", "scheduler.pt"),
                                        ("no_state", "trainer_state.json"),
                                        ("no_shard", "odc_optimizer/__1_0.distcp")])  # fmt: skip
def test_a_checkpoint_without_a_part_the_run_needs_is_refused(resumed, name, part):
    results, broken = resumed
    for rank_result in results[name]:
        error = rank_result["error"]
        assert error is not None and error.startswith("CheckpointPartMissing"), error
        assert f"checkpoint {broken[name]} cannot be resumed: {part}" in error, error
        assert rank_result["microbatches"] == [], "no step may run on a checkpoint without its optimizer"
