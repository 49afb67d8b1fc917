"""Acceptance (CPU, 2 processes as `accelerate launch` starts them, forked: tests/support/launched.py):
ODCGRPOTrainer's per-step losses and gradient norms equal TRL's own GRPOTrainer (DDP collectives, TRL's loss code
with its per-microbatch collectives) on the same rollouts, for every supported loss type, with a reference model
(beta > 0, on ODC): once with LB-Mini giving the ranks different numbers of microbatches, once with a launch-bound
cost model under which one rank trains every sample of a step and the other none, from the first step on. The uneven
plan runs the packed layout (the default on CPU: each microbatch one row of prompt+completion sequences on
sdpa_varlen, the reference log-probs from packed rows too), the zero plan TRL's padded layout
(ODCConfig.grpo_layout="padded"). A rank without microbatches runs no forward at all, whatever the layout; the
packed planner (LB-Mini's) never leaves a rank idle when splitting lowers the step time, so the zero plan is
reachable through the padded planner's tie-break (least total cost) only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from example_scripts import grpo_run

from odc_hf.integrations.trl.grpo_batch import SUPPORTED_LOSS_TYPES

LOSS_TYPES = SUPPORTED_LOSS_TYPES  # TRL 1.16's eight
COMMON = ["--fixed_rollouts", "--max_steps", "4", "--loss_type", ",".join(LOSS_TYPES), "--beta", "0.05",
          "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_completion_length", "48",
          "--eval_steps", "2", "--eval_on_start"]  # fmt: skip


def launch(tmp_path: Path, name: str, *extra: str) -> dict:
    return grpo_run(tmp_path / name, *COMMON, *extra)


# A cost model file (a public ODCConfig.cost_model choice) for launch-bound microbatches: every microbatch costs at
# least the floor, far above its work. With a budget that fits a whole generation batch in one padded microbatch,
# the cheapest plan is one microbatch on one rank: the other rank trains nothing, every step, the first included.
LAUNCH_BOUND = {"a": 0.0, "b": 1e-6, "c": 0.0, "floor": 1.0}
# Attention-bound costs (quadratic term dominant): LB-Mini then gives the rank of long sequences fewer tokens, so the
# packed rows of 64 tokens split 3/4 and 4/3 in this run's steps (the flop model of the tiny model is nearly linear and
# splits evenly).
QUADRATIC = {"a": 0.0, "b": 1e-6, "c": 1e-5}


NO_EVALUATION = COMMON[: COMMON.index("--eval_steps")]


def _quadratic(tmp: Path) -> Path:
    path = tmp / "quadratic.json"
    path.write_text(json.dumps(QUADRATIC))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_parity")
    launch_bound, quadratic = tmp / "launch_bound.json", _quadratic(tmp)
    launch_bound.write_text(json.dumps(LAUNCH_BOUND))
    return {
        "uneven": launch(tmp, "odc", "--trainer", "odc", "--balance", "lb_mini", "--max_tokens_per_microbatch", "64",
                         "--cost_model", str(quadratic)),
        "zero": launch(tmp, "zero", "--trainer", "odc", "--balance", "lb_mini", "--max_tokens_per_microbatch", "4096",
                       "--cost_model", str(launch_bound), "--grpo_layout", "padded"),
        "trl": launch(tmp, "trl", "--trainer", "trl"),
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("plan", ["uneven", "zero"])
def test_odc_grpo_matches_trl_grpo_step_by_step(runs, loss_type, plan):
    odc, trl = runs[plan][loss_type], runs["trl"][loss_type]
    assert len(odc["history"]) == len(trl["history"]) == 4
    assert odc["packed"] == (plan == "uneven") and odc["attention"]["implementation"] == "sdpa_varlen", odc
    counts = [s["microbatches"] for s in odc["steps"]]
    if plan == "uneven":
        assert any(len(set(c)) > 1 and min(c) > 0 for c in counts), f"{loss_type}: no step with uneven counts: {counts}"
    else:
        assert 0 in counts[0] and max(counts[0]) > 0, f"{loss_type}: no rank without microbatches in step 1: {counts}"
    # GRPO losses are sums of per-token terms of size ~|advantage| (0.1-1) that cancel (advantages sum to zero per
    # group; the losses are 4e-9 to 0.36), so their fp32 error is absolute, a few ulps of the terms: measured <= 6e-8
    # on CPU (any loss type, both plans), bound 1e-6 and no relative part (a relative 1e-5 would allow 3.6e-6 at the
    # largest loss). Gradient norms carry the summation order of gradients that cancel across the group's completions:
    # measured 6e-6 to 3.2e-5 relative, bound 1e-4 (packed rows: losses within 6e-8, gradient norms 2.4e-5 to
    # 3.2e-5, as padded). A lost or doubled microbatch moves both by > 1e-2.
    for a, b in zip(odc["history"], trl["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-6)  # the same rollouts


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("plan", ["uneven", "zero"])
def test_odc_grpo_logs_every_metric_trl_logs(runs, loss_type, plan):
    """kl, entropy, clip ratios, rewards, lengths...: TRL's definitions, not the ODC layout's (issue 21)."""
    from test_grpo_metrics import assert_same_metrics

    # loss and grad_norm: compared above, with the tolerances their arithmetic allows
    assert_same_metrics(runs[plan][loss_type]["history"], runs["trl"][loss_type]["history"], rel=1e-5, abs=1e-7,
                        skip=("loss", "grad_norm"))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["uneven", "zero"])
def test_odc_grpo_evaluates_as_trl(runs, plan):
    """Evaluation before step 1 and every 2 steps (TRL's own path under ODC: generation, scoring and loss on TRL's
    evaluation batches; on packed rows in the uneven plan). In the zero plan a rank trains nothing right after each
    evaluation, the case where FSDP2's root unit was left gathered by the evaluation's forwards."""
    from test_grpo_metrics import assert_same_metrics

    timing = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    for loss_type in LOSS_TYPES:
        odc, trl = runs[plan][loss_type]["evaluations"], runs["trl"][loss_type]["evaluations"]
        assert [e["step"] for e in odc] == [e["step"] for e in trl] == [0, 2, 4], (loss_type, odc)
        # losses as in training (absolute fp32 error of cancelling terms); the metrics as test_grpo_metrics's
        for a, b in zip(odc, trl):
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=0, abs=1e-6), (loss_type, a, b)
        assert_same_metrics(odc, trl, rel=1e-4, abs=1e-6, skip=("eval_loss", *timing))


@pytest.fixture(scope="module")
def several_steps_per_generation(tmp_path_factory):
    """TRL's steps_per_generation = 2 x gradient_accumulation_steps: each generation batch (twice a step's samples)
    trains two optimizer steps, its first and second halves after TRL's shuffle, each with TRL's normalisers of a
    step (dapo: the generation batch's tokens, rescaled to a step)."""
    tmp = tmp_path_factory.mktemp("grpo_steps_per_generation")
    common = [*NO_EVALUATION, "--steps_per_generation", "4", "--loss_type", "dapo,grpo,bnpo"]
    quadratic = _quadratic(tmp)
    return {"odc": grpo_run(tmp / "odc", *common, "--trainer", "odc", "--balance", "lb_mini",
                            "--max_tokens_per_microbatch", "64", "--cost_model", str(quadratic)),
            "trl": grpo_run(tmp / "trl", *common, "--trainer", "trl")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_a_generation_batch_of_several_steps_trains_as_trls(several_steps_per_generation, loss_type):
    from test_grpo_metrics import assert_same_metrics

    odc, trl = (several_steps_per_generation[k][loss_type] for k in ("odc", "trl"))
    assert len(odc["history"]) == len(trl["history"]) == 4
    # a generation every 2 steps: its metrics (rewards) logged at steps 1 and 3 only, by both
    assert [("reward" in h) for h in trl["history"]] == [True, False, True, False], trl["history"]
    for a, b in zip(odc["history"], trl["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    assert_same_metrics(odc["history"], trl["history"], rel=1e-5, abs=1e-7, skip=("loss", "grad_norm"))


@pytest.fixture(scope="module")
def entropy_bonus(tmp_path_factory):
    """TRL's entropy bonus, static (dapo, grpo) and adaptive (bnpo, sapo: the coefficient starts at 0.01 and is
    applied from step 2, raised by 0.005 while the step's mean entropy, ~8.3 nats here, stays below the target 9),
    on the uneven plan (quadratic costs: ranks run 3 and 4 microbatches) against TRL."""
    tmp = tmp_path_factory.mktemp("grpo_entropy_bonus")
    quadratic = _quadratic(tmp)
    base = [*NO_EVALUATION, "--num_iterations", "2", "--epsilon", "0.05"]
    odc = ["--trainer", "odc", "--balance", "lb_mini", "--max_tokens_per_microbatch", "64", "--cost_model", str(quadratic)]
    runs = {}
    for name, extra in (("static", ["--loss_type", "dapo,grpo", "--entropy_coef", "0.01"]),
                        ("adaptive", ["--loss_type", "bnpo,sapo", "--entropy_coef", "0.01", "--use_adaptive_entropy",
                                      "--entropy_target", "9.0"])):  # fmt: skip
        runs[name] = {"odc": grpo_run(tmp / f"odc_{name}", *base, *extra, *odc),
                      "trl": grpo_run(tmp / f"trl_{name}", *base, *extra, "--trainer", "trl")}  # fmt: skip
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "loss_type"), [("static", "dapo"), ("static", "grpo"), ("adaptive", "bnpo"),
                                                 ("adaptive", "sapo")])  # fmt: skip
def test_the_entropy_bonus_trains_as_trls(entropy_bonus, kind, loss_type):
    """TRL subtracts, per microbatch of its own, the coefficient times that microbatch's token mean of the entropy:
    ODC weighs each sample's entropy as that mean weighs it and logs TRL's policy_loss and entropy_coef."""
    from test_grpo_metrics import assert_same_metrics

    odc, trl = (entropy_bonus[kind][k][loss_type] for k in ("odc", "trl"))
    assert any(len(set(s["microbatches"])) > 1 for s in odc["steps"]), odc["steps"]
    coefficients = [h["entropy_coef"] for h in trl["history"]]
    assert coefficients == ([0.01] * 4 if kind == "static" else pytest.approx([0.015, 0.02, 0.025, 0.03])), coefficients
    for a, b in zip(odc["history"], trl["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    assert_same_metrics(odc["history"], trl["history"], rel=1e-5, abs=1e-7, skip=("loss", "grad_norm"))


@pytest.fixture(scope="module")
def top_entropy(tmp_path_factory):
    """TRL's ``top_entropy_quantile=0.5``, every loss type, a second iteration per generation, on the uneven plan
    (packed rows of 64 tokens: ranks run 3 and 4 microbatches where TRL runs 2) and the zero plan (padded, one rank
    trains nothing), against TRL, and TRL training on every token (the control). The tiny model starts with weights
    of standard deviation 0.2: at 0.02 its token entropies lie within 1e-5 of each other (8.3048 +- 1e-5 nats,
    measured), where the two runs' float noise (~1e-6) reorders the tokens next to a quantile."""
    tmp = tmp_path_factory.mktemp("grpo_top_entropy")
    base = [*NO_EVALUATION, "--num_iterations", "2", "--epsilon", "0.05", "--initializer_range", "0.2"]
    quantile = ["--top_entropy_quantile", "0.5"]
    launch_bound = tmp / "launch_bound.json"
    launch_bound.write_text(json.dumps(LAUNCH_BOUND))
    return {"uneven": grpo_run(tmp / "odc", *base, *quantile, "--trainer", "odc", "--balance", "lb_mini",
                               "--max_tokens_per_microbatch", "64", "--cost_model", str(_quadratic(tmp))),
            "zero": grpo_run(tmp / "zero", *base, *quantile, "--trainer", "odc", "--balance", "lb_mini",
                             "--max_tokens_per_microbatch", "4096", "--cost_model", str(launch_bound),
                             "--grpo_layout", "padded"),
            "trl": grpo_run(tmp / "trl", *base, *quantile, "--trainer", "trl"),
            "every_token": grpo_run(tmp / "every_token", *base, "--trainer", "trl"),
            # with TRL's adaptive entropy bonus: a mean over each TRL microbatch's kept tokens on its rank
            "bonus": grpo_run(tmp / "bonus", *base, *quantile, *BONUS, "--trainer", "odc", "--balance", "lb_mini",
                              "--max_tokens_per_microbatch", "64", "--cost_model", str(_quadratic(tmp))),
            "trl_bonus": grpo_run(tmp / "trl_bonus", *base, *quantile, *BONUS, "--trainer", "trl")}  # fmt: skip


BONUS = ["--loss_type", "dapo,grpo,bnpo,sapo", "--entropy_coef", "0.01", "--use_adaptive_entropy", "--entropy_target",
         "9.0"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("plan", ["uneven", "zero"])
def test_training_on_the_highest_entropy_tokens_is_trls(top_entropy, loss_type, plan):
    """Each row keeps the tokens that reach its TRL microbatch's entropy quantile over every rank (from a pass
    without gradients before the step): losses, gradient norms and every metric equal TRL's; training on every
    token (the control) moves the gradient norms by > 1e-2 relative at every step."""
    from test_grpo_metrics import assert_same_metrics

    odc, trl = top_entropy[plan][loss_type], top_entropy["trl"][loss_type]
    counts = [s["microbatches"] for s in odc["steps"]]
    if plan == "uneven":
        assert any(len(set(c)) > 1 and min(c) > 0 for c in counts), counts
    else:
        assert 0 in counts[0], counts
    for a, b in zip(odc["history"], trl["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    assert_same_metrics(odc["history"], trl["history"], rel=1e-5, abs=1e-7, skip=("loss", "grad_norm"))
    every = top_entropy["every_token"][loss_type]["history"]
    assert all(abs(a["grad_norm"] / c["grad_norm"] - 1) > 1e-2 for a, c in zip(trl["history"], every))


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "sapo"])
def test_the_highest_entropy_tokens_with_an_entropy_bonus_train_as_trls(top_entropy, loss_type):
    """The bonus acts on the kept tokens, a mean over those of each TRL microbatch on its rank (their count, from the
    pass before the step, is each sample's weight), and the adaptive coefficient follows their entropy."""
    from test_grpo_metrics import assert_same_metrics

    odc, trl = top_entropy["bonus"][loss_type], top_entropy["trl_bonus"][loss_type]
    assert [h["entropy_coef"] for h in trl["history"]] == pytest.approx([0.015, 0.02, 0.025, 0.03])
    for a, b in zip(odc["history"], trl["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    assert_same_metrics(odc["history"], trl["history"], rel=1e-5, abs=1e-7, skip=("loss", "grad_norm"))
    without = top_entropy["trl"][loss_type]["history"]  # the control: no bonus
    assert all(abs(a["loss"] - c["loss"]) > 1e-3 for a, c in zip(trl["history"][1:], without[1:]))
