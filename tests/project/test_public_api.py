"""odc_hf's public entry points, each training on 2 CPU processes and compared with a single-process reference on
the whole minibatches (tests/support/api_runs.py), with uneven microbatch counts and a rank without microbatches in step 1:

- ``ODCAccelerator(...)`` + ``prepare()`` in a user's own accelerate loop, and ``odc_hf.prepare(Accelerator(), ...)``:
  against plain torch in one process (every sample alone through the unsharded model);
- ``ODCTrainer`` on a plain transformers causal-LM task, with transformers' causal-LM data collator given (its labels
  trained), with the Trainer's label smoothing, on a LoRA model, and ``make_odc_trainer`` on a user's Trainer subclass
  with its own loss: against those same Trainer classes in one process (padded batches, sdpa), final saved weights included.
"""

from __future__ import annotations

import json

import api_runs
import pytest
import torch
from sft_runs import assert_same_steps, launch, one_process

# Same data, model and arithmetic as tests/support/sft_runs.py (losses within 1.2e-7 relative, gradient norms within 1.2e-5,
# measured here too; see its tolerances). Weights after 4 AdamW steps: measured <= 1.9e-6 apart; every update moves an
# element by ~lr = 1e-3, so a lost or doubled update is off by orders of magnitude more than the 1e-5 allowed.
WEIGHTS_ATOL = 1e-5


def _check_counts(counts) -> None:
    assert counts[0][1] == 0 and counts[0][0] > 1, counts  # the last rank runs no microbatch in step 1
    assert any(len(set(c)) > 1 and min(c) > 0 for c in counts[1:]), counts


def _close(ours: dict, theirs: dict, *, saved: bool = False) -> None:
    """Same tensors within WEIGHTS_ATOL. In-memory state dicts may list the tied lm_head.weight (then it is the
    embedding); saved files never do, as transformers' own save."""
    if saved:
        assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    assert set(ours) ^ set(theirs) <= {"lm_head.weight"}, set(ours) ^ set(theirs)
    for weights in (ours, theirs):
        if "lm_head.weight" in weights:
            assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    for name in set(ours) & set(theirs):
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=WEIGHTS_ATOL, msg=name)


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    out = tmp_path_factory.mktemp("loops")
    launch("api_runs.py", "loops", out)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is fastest, and other tests' processes share the cores
    try:
        reference = api_runs.loop_reference()
    finally:
        torch.set_num_threads(previous)
    return out, reference


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["odc_accelerator", "odc_hf_prepare"])
def test_user_accelerate_loop_matches_single_process(loops, entry):
    out, reference = loops
    run = json.loads((out / f"{entry}.json").read_text())
    _check_counts(run["microbatches"])
    assert_same_steps(run["history"], reference["history"], range(1, api_runs.STEPS + 1))
    _close(torch.load(out / f"{entry}.pt"), reference["weights"])


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    odc, ref = tmp_path_factory.mktemp("trainers_odc"), tmp_path_factory.mktemp("trainers_ref")
    launch("api_runs.py", "trainers", odc)
    one_process("api_runs.py", "trainers-reference", ref)
    return odc, ref


@pytest.mark.slow
@pytest.mark.parametrize("task", ["plain_trainer", "user_subclass", "lm_collator", "label_smoothing", "lora"])
def test_odc_trainers_match_their_trainer_class_in_one_process(trainers, task):
    from safetensors.torch import load_file

    odc_dir, ref_dir = trainers
    odc, ref = (json.loads((d / f"{task}.json").read_text()) for d in trainers)
    assert (odc["class"], ref["class"]) == {"plain_trainer": ("ZeroFirstODCTrainer", "Trainer"),
                                            "user_subclass": ("ZeroFirstODCLabelSmoothingTrainer", "LabelSmoothingTrainer"),
                                            "lm_collator": ("ZeroFirstODCTrainer", "Trainer"),
                                            "label_smoothing": ("ZeroFirstODCTrainer", "Trainer"),
                                            "lora": ("ZeroFirstODCTrainer", "Trainer")}[task]  # fmt: skip
    _check_counts(odc["microbatches"])
    assert_same_steps(odc["history"], ref["history"], range(1, api_runs.STEPS + 1))
    saved = "adapter_model.safetensors" if task == "lora" else "model.safetensors"  # a PeftModel saves its adapter
    _close(load_file(str(odc_dir / task / saved)), load_file(str(ref_dir / task / saved)), saved=True)


@pytest.mark.slow
def test_the_user_subclass_loss_is_really_its_own(trainers):
    """Label smoothing changes the loss (8.3137 vs 8.3118 at step 1): equal values above mean the subclass's
    compute_loss ran under ODC, not the model's default loss."""
    odc_dir, _ = trainers
    plain, user = (json.loads((odc_dir / f"{t}.json").read_text())["history"][0]["loss"] for t in ("plain_trainer", "user_subclass"))
    assert user - plain > 1e-3, (plain, user)


@pytest.mark.slow
def test_the_trainers_label_smoothing_is_the_users_own_loss(trainers):
    """``label_smoothing_factor=0.1`` gives the user subclass's label-smoothed loss (the same definition) at every
    step, to float noise: the smoother shifts the labels under sharding as the Trainer does without."""
    odc_dir, _ = trainers
    smoothed, user = (json.loads((odc_dir / f"{t}.json").read_text())["history"]
                      for t in ("label_smoothing", "user_subclass"))  # fmt: skip
    assert_same_steps(smoothed, user, range(1, api_runs.STEPS + 1))


@pytest.mark.slow
def test_the_collators_labels_are_what_was_trained(trainers):
    """Control of ``lm_collator``: transformers' causal-LM collator labels no end-of-text token (the pad token here),
    which ends every document; the same run training them (the dataset's labels, what odc_hf trained before it read
    a collator's labels) has gradient norms >= 1e-3 apart at every step, 20x the comparison's tolerance."""
    _, ref_dir = trainers
    collator, end_of_text = (json.loads((ref_dir / f"{t}.json").read_text())["history"]
                             for t in ("lm_collator", "end_of_text_trained"))  # fmt: skip
    for ours, control in zip(collator, end_of_text):
        assert abs(ours["grad_norm"] / control["grad_norm"] - 1) > 1e-3, (ours, control)
