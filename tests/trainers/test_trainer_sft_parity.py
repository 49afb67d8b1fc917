"""ODCSFTTrainer (2 CPU processes as `accelerate launch` starts them, forked: tests/support/launched.py, ODC, LB-Mini,
uneven microbatch counts, and a rank that starts training with ZERO microbatches) gives the per-step losses, gradient
norms and evaluation losses of TRL's own SFTTrainer run in one process on each whole minibatch: an independent
reference (TRL's padded batches, transformers' sdpa and its own loss normalisation; no ODC code, no distribution). The
run's timing files hold what the steps did."""

from __future__ import annotations

import json
import math

import pytest
import sft_runs
from sft_runs import assert_same_steps, odc_run, trl_reference

from odc_hf.balance import QuadraticCostModel


@pytest.mark.slow
def test_odc_sft_trainer_matches_trl_sft_trainer_on_whole_minibatches(tmp_path):
    odc = odc_run(tmp_path / "odc", "--zero_rank_first_step", "--eval_steps", "3")
    trl = trl_reference(tmp_path / "trl", "--eval_steps", "3")
    assert odc["odc"] and odc["world"] == 2
    counts = odc["microbatches"]
    assert len(counts) == len(trl["history"]) == sft_runs.MAX_STEPS
    assert counts[0][1] == 0 and counts[0][0] > 1, counts  # the last rank's first step: no microbatch at all
    assert any(len(set(c)) > 1 and min(c) > 0 for c in counts[1:]), counts  # LB-Mini: uneven counts later
    assert_same_steps(odc["history"], trl["history"], range(1, sft_runs.MAX_STEPS + 1))
    # include_num_input_tokens_seen="non_padding": every document token, eos (the pad token) included, as TRL counts
    # them through its padded batches' attention mask (ODC's rows have none: it counted the eos tokens as padding)
    assert odc["tokens_seen"] == trl["tokens_seen"] > 0, (odc["tokens_seen"], trl["tokens_seen"])
    # TRL's activation-offloading context (a counting stand-in: TRL's offloads on CUDA only) is entered around each of
    # rank 0's microbatches, forward and backward (it was never entered: ODC's training_step replaces TRL's)
    offload = odc["offload"]
    assert offload["entered"] == sum(c[0] for c in counts) and offload["packed"] > 0, offload
    assert offload["unpacked_outside"] == 0, offload
    losses = [h["loss"] for h in trl["history"]]
    assert losses[-1] < losses[0] - 0.1  # it learns: a comparison of untrained, flat losses would prove little
    # Evaluation on held-out text before training (eval_on_start), then every 3 steps: the losses of TRL's padded
    # evaluation batches (the same 2-sample batches in either run: accelerate deals whole batches to the ranks). The
    # first evaluation is followed by a step in which the last rank trains nothing: it used to deadlock in the clip.
    # (TRL's eval token accuracy is not compared: it averages one value per gather, over 2 ranks' batches at once.)
    assert [e["step"] for e in odc["evaluations"]] == [e["step"] for e in trl["evaluations"]] == [0, 3, 6]
    for ours, theirs in zip(odc["evaluations"], trl["evaluations"]):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=sft_runs.LOSS_RTOL), (ours, theirs)
    assert trl["evaluations"][-1]["loss"] < trl["evaluations"][0]["loss"] - 0.1

    out = tmp_path / "odc"
    assert (out / "odc_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The microbatches timed after the warm-up steps, each with its documents' lengths, fitted as the next run's
    # cost model: every one of those steps' microbatches, none longer than the budget.
    timings = json.loads((out / "odc_microbatch_timings.json").read_text())
    warm = timings["warmup_steps_skipped"]
    assert len(timings["microbatches"]) == len(timings["seconds"]) == sum(sum(c) for c in counts[warm:])
    assert all(0 < sum(docs) <= sft_runs.BUDGET and min(docs) > 0 for docs in timings["microbatches"])
    assert all(math.isfinite(s) and s > 0 for s in timings["seconds"])
    # The post-warm-up steps hold microbatches of many distinct token counts, so the fit must exist; and it is the
    # fit of the recorded timings (what the next run's cost_model=<this file> will balance with).
    assert "fit_error" not in timings, timings.get("fit_error")
    refit = QuadraticCostModel.fit_microbatches(timings["microbatches"], timings["seconds"]).to_dict()
    assert {k: timings[k] for k in refit} == pytest.approx(refit, rel=1e-12), (timings, refit)
    assert QuadraticCostModel.from_dict(timings).to_dict() == pytest.approx(refit, rel=1e-12)


@pytest.mark.slow
def test_odc_sft_trainer_matches_trl_with_the_dft_loss(tmp_path):
    """TRL's ``loss_type="dft"`` (each token's loss weighted by its detached probability), summed per microbatch and
    divided by the global label-token count, as TRL divides its whole batch's sum."""
    odc = odc_run(tmp_path / "odc", "--loss_type", "dft")
    trl = trl_reference(tmp_path / "trl", "--loss_type", "dft")
    assert [h["step"] for h in odc["history"]] == [h["step"] for h in trl["history"]] == list(range(1, 7))
    for ours, theirs in zip(odc["history"], trl["history"]):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=sft_runs.LOSS_RTOL), (ours, theirs)
        # measured 1.0e-5 to 2.9e-5: the per-token weights (probabilities ~1/vocab) leave gradients that cancel more
        # than the plain loss's; a per-rank normaliser or a lost microbatch moves the norm by > 1e-2
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4), (ours, theirs)
    # dft's loss is the probability-weighted NLL: it grows as the model puts more mass on the targets
    losses = [h["loss"] for h in trl["history"]]
    assert losses[-1] > 1.2 * losses[0], losses


@pytest.mark.slow
def test_load_best_model_at_end_loads_the_best_checkpoint_into_the_sharded_model(tmp_path):
    """``load_best_model_at_end`` with a best model that is not the last (the highest evaluation loss, at step 2): the
    Trainer's own loader copied whole tensors into the sharded ones and crashed ("mixed torch.Tensor and DTensor"); and
    a loaded model must be published, or the peers' gathers keep reading the last step's shards."""
    odc = odc_run(tmp_path / "odc", "--load_best")
    evaluations = {e["step"]: e["loss"] for e in odc["evaluations"]}
    assert list(evaluations) == [0, 2, 4, 6] and evaluations[2] > evaluations[6] + 0.1, evaluations
    assert odc["best_model_checkpoint"].endswith("checkpoint-2"), odc["best_model_checkpoint"]
    # evaluated again after training: the best model's loss, not the last one's
    assert odc["evaluated_after_training"] == pytest.approx(evaluations[2], rel=sft_runs.LOSS_RTOL)
    # and the model saved after training is that one: TRL's evaluation of it in this process gives the same loss
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from odc_hf.testing.data import default_tokenizer

    tokenizer = default_tokenizer()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "odc" / "final")
    data = sft_runs.eval_dataset(tokenizer)
    args = sft_runs.sft_config(tmp_path / "check", use_cpu=True, per_device_eval_batch_size=2)
    check = SFTTrainer(model=saved, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)
    assert check.evaluate()["eval_loss"] == pytest.approx(evaluations[2], rel=sft_runs.LOSS_RTOL)


@pytest.mark.slow
def test_a_second_train_call_continues_as_trls_does(tmp_path):
    """``train()`` called again on the same trainer (a notebook's "train some more"): the model stays as ODC holds
    it (it used to stop with "ODCAccelerator already prepared a model with ODC"), the optimizer keeps its state, and the
    steps equal TRL's trainer doing the same in one process."""
    odc = odc_run(tmp_path / "odc", "--train_twice")
    trl = trl_reference(tmp_path / "trl", "--train_twice")
    assert_same_steps(odc["again"], trl["again"], range(1, sft_runs.MAX_STEPS + 1))
    # the same minibatches as the first call (the sampler starts its epoch again), on a model that learned from them
    assert odc["again"][0]["loss"] < odc["history"][0]["loss"] - 0.3, (odc["again"][0], odc["history"][0])
