"""transformers' batch_rebalance as a baseline (issue 30): its plans are read from transformers itself, priced padded
by odc_hf's cost models, and the simulator's step time of a batch_rebalance schedule equals a hand-computed case."""

import numpy as np
import pytest

from odc_hf.balance.cost import QuadraticCostModel
from odc_hf.prediction import batch_rebalance as hf
from odc_hf.prediction.cluster import Cluster, ModelShape, StepOverheads
from odc_hf.prediction.lockstep import lockstep_cost_matrix, padded_tokens, padding_waste
from odc_hf.prediction.simulate import plan_steps, step_times, summarize

AVAILABLE, WHY = hf.available()
# transformers without the batch_rebalance sampler (an older or newer release) has no baseline to compare with
needs_sampler = pytest.mark.skipif(not AVAILABLE, reason=f"this transformers has no usable batch_rebalance sampler: {WHY}")

SHAPE = ModelShape(name="tiny", num_layers=2, layer_params=1000, root_params=500, num_matmul_params=2000,
                   attn_dim=64)  # fmt: skip
OVERHEADS = StepOverheads(odc_s_per_param=2e-4, fsdp_s_per_param=1e-4)
LINEAR = QuadraticCostModel(a=0.0, b=1e-3, c=0.0)  # 1 ms per token: padded tokens are the step time


@needs_sampler
def test_plans_are_the_samplers_own_for_every_rank():
    """rebalance_plan reads all ranks' plans in one call of the sampler's _assign; each rank's must be what the
    public sampler (the Trainer's batch_sampler) yields on that rank."""
    lengths = np.random.default_rng(0).integers(50, 5000, size=48).tolist()
    world, grad_accum = 4, 3
    plan = hf.rebalance_plan(lengths, world, grad_accum)
    cls = hf.sampler_class()
    for rank in range(world):
        sampler = cls(lengths=lengths, effective_batch_size=len(lengths), dp_size=world, grad_accum=grad_accum,
                      shuffle=False, rank=rank)  # fmt: skip
        assert [list(mb) for mb in sampler] == plan[rank]
    assert sorted(i for mbs in plan for mb in mbs for i in mb) == list(range(len(lengths)))
    assert {len(mbs) for mbs in plan} == {grad_accum}  # lockstep: every rank the same number of microbatches


@needs_sampler
def test_simulated_step_time_equals_a_hand_computed_case():
    """Lengths 1000, 900, 200, 100 on 2 ranks x 1 microbatch. The sampler sorts them, starts from groups of 2
    ([1000, 900]: 2·1000 + 0.001·2·1000² = 4000; [200, 100]: 480), moves one sample from the dearest group to the
    cheapest ([1000]: 2000; [900, 200, 100]: 3·900 + 0.001·3·900² = 5130; spread 3130 < 3520), and stops when the
    next move returns to a state seen. The dearer group goes to rank 0. Padded at 1 ms per token: rank 0 runs 3 rows
    x 900 = 2.7 s, rank 1 runs 1.0 s; FSDP2's lockstep step = 2.7 s + its optimizer overhead."""
    lengths = np.array([1000, 900, 200, 100])
    plan = hf.rebalance_plan(lengths, 2, 1)
    assert plan == [[[1, 2, 3]], [[0]]]
    assert lockstep_cost_matrix(plan, lengths, LINEAR) == pytest.approx(np.array([[2.7], [1.0]]))
    assert padded_tokens(plan, lengths).tolist() == [[2700], [1000]]
    assert padding_waste(plan, lengths) == pytest.approx(1 - 2200 / 3700)
    cluster = Cluster(gpus_per_node=2, num_nodes=1)
    steps = plan_steps(lengths, 2, 2, 1000, LINEAR, shuffle=False, lockstep=lambda b: hf.rebalance_plan(b, 2, 1))
    times = step_times(steps, SHAPE, cluster, OVERHEADS)
    overhead = OVERHEADS.fsdp(SHAPE, 2)
    assert times["rebalance_hsdp"]["total"].tolist() == pytest.approx([2.7 + overhead])
    assert times["rebalance_hsdp"]["bubble"].tolist() == pytest.approx([1 - 1.85 / 2.7])
    # packed (padding-free) the same plan costs what its real tokens cost: 1.2 s and 1.0 s
    assert lockstep_cost_matrix(plan, lengths, LINEAR, layout="packed") == pytest.approx(np.array([[1.2], [1.0]]))
    summary = summarize(times)
    odc = times["odc_hsdp"]["total"][0]
    assert summary["speedup_vs_rebalance_hsdp"] == pytest.approx((2.7 + overhead) / odc)


def test_lockstep_plans_are_checked():
    with pytest.raises(ValueError, match="same number of microbatches"):
        lockstep_cost_matrix([[[0]], [[1], [2]]], [1, 2, 3], LINEAR)
    with pytest.raises(ValueError, match="outside the 3 lengths"):
        lockstep_cost_matrix([[[0]], [[5]]], [1, 2, 3], LINEAR)


def test_missing_sampler_is_a_clear_error(monkeypatch):
    """A transformers without BatchRebalanceSampler: the baseline is skipped with a message naming the versions."""
    import transformers.trainer_pt_utils as tpu

    monkeypatch.delattr(tpu, "BatchRebalanceSampler", raising=False)
    ok, why = hf.available()
    assert not ok and why.startswith("transformers' BatchRebalanceSampler is not importable (")
    assert why.endswith("the batch_rebalance baseline needs a transformers that has "
                        "TrainingArguments(train_sampling_strategy='batch_rebalance') (5.17 and 5.24 do)")  # fmt: skip
    with pytest.raises(hf.RebalanceUnavailable, match="not importable"):
        hf.quadratic_coefficient()


@needs_sampler
def test_a_sampler_without_the_method_read_is_named(monkeypatch):
    """A release whose sampler keeps its name but not ``_assign`` (the private method all ranks' plans come from)."""
    import transformers

    monkeypatch.delattr(hf.sampler_class(), "_assign")
    ok, why = hf.available()
    assert not ok and why == (f"transformers {transformers.__version__}: BatchRebalanceSampler has no "
                              "_assign(indices, lengths); odc_hf reads all ranks' plans through it (checked on 5.17 "
                              "and 5.24)")  # fmt: skip


def test_a_lockstep_planner_may_stop_and_its_rows_cover_the_steps_before():
    """The estimate stops transformers' (slow) sampler after a time budget by returning None: the lockstep rows then
    cover the steps planned so far, the other rows all steps."""
    calls = []

    def planner(batch):
        calls.append(len(batch))
        return None if len(calls) > 2 else [[list(range(r, len(batch), 2))] for r in range(2)]

    steps = plan_steps(np.full(40, 300), 2, 4, 1200, LINEAR, shuffle=False, lockstep=planner)
    assert len(steps) == 5 and len(calls) == 3  # asked again only until it said stop
    times = step_times(steps, SHAPE, Cluster(gpus_per_node=2, num_nodes=1), OVERHEADS)
    assert times["rebalance_hsdp"]["total"].size == 2 and times["odc_hsdp"]["total"].size == 5
    summary = summarize(times)
    assert summary["rebalance_hsdp"]["steps"] == 2 and summary["speedup_vs_rebalance_hsdp_steps"] == 2


@needs_sampler
def test_batch_rebalance_on_one_rank_and_its_refusals():
    plan = hf.rebalance_plan([300, 100, 200, 50], 1, 2)
    assert len(plan) == 1 and len(plan[0]) == 2
    assert sorted(i for mb in plan[0] for i in mb) == [0, 1, 2, 3]
    assert hf.available() == (True, "")
    assert hf.quadratic_coefficient() == float(hf.sampler_class().QUADRATIC_COST_COEF)
    for world, accum in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match=rf"^world_size and grad_accum must be >= 1, got {world} and {accum}$"):
            hf.rebalance_plan([1, 2, 3, 4], world, accum)
    with pytest.raises(ValueError, match=r"^batch_rebalance needs one sample per microbatch: 5 samples for 2 ranks x 3 "):
        hf.rebalance_plan([1, 2, 3, 4, 5], 2, 3)
