"""Planners: coverage, token budget, equal counts for FSDP, and LB-Mini never predicted worse than LB-Micro."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_hf.balance.cost import FlopCostModel, QuadraticCostModel, TokenCostModel
from odc_hf.balance.plan import Plan
from odc_hf.balance.planner import (
    FALLBACK_SKIP_TOLERANCE,
    makespan_lower_bound,
    plan_lb_micro,
    plan_lb_mini,
    plan_none,
)
from odc_hf.prediction.workloads import qwen2_5_config

COST_MODELS = {
    "flop": FlopCostModel.from_config(qwen2_5_config("1.5B")),
    "tokens": TokenCostModel(),
    "calibrated": QuadraticCostModel(a=0.1, b=2e-6, c=1.5e-10),  # launch overhead per microbatch
}
PLANNERS = {"lb_mini": plan_lb_mini, "lb_micro": plan_lb_micro, "none": plan_none}


@st.composite
def instances(draw):
    budget = draw(st.sampled_from([4096, 16384, 65536]))
    lengths = draw(st.lists(st.integers(0, budget), min_size=0, max_size=64))
    world_size = draw(st.integers(1, 9))
    cost_model = draw(st.sampled_from(sorted(COST_MODELS)))
    return lengths, world_size, budget, COST_MODELS[cost_model]


def check_plan(plan: Plan, lengths, world_size, budget):
    assert plan.world_size == world_size
    seen = sorted(i for mbs in plan.microbatches for mb in mbs for i in mb)
    assert seen == list(range(len(lengths))), "every sample exactly once"
    for mbs in plan.microbatches:
        for mb in mbs:
            assert sum(lengths[i] for i in mb) <= budget, "microbatch over the token budget"
    assert plan.predicted_odc_time <= plan.predicted_fsdp_time * (1 + 1e-12)
    assert plan.predicted_odc_time >= plan.lower_bound * (1 - 1e-9)
    for semantics in ("fsdp", "odc"):
        assert 0.0 <= plan.predicted_bubble(semantics) < 1.0


@settings(max_examples=150, deadline=None)
@given(instance=instances())
def test_plans_cover_every_sample_once_within_budget(instance):
    lengths, world_size, budget, cost_model = instance
    for name, planner in PLANNERS.items():
        plan = planner(lengths, world_size, budget, cost_model)
        assert plan.mode == name
        check_plan(plan, lengths, world_size, budget)


@settings(max_examples=80, deadline=None)
@given(instance=instances())
def test_fsdp_plans_have_equal_counts_and_lb_mini_runs_no_dummies(instance):
    lengths, world_size, budget, cost_model = instance
    for planner in (plan_lb_micro, plan_none):
        assert len(set(planner(lengths, world_size, budget, cost_model).num_microbatches)) == 1
    mini = plan_lb_mini(lengths, world_size, budget, cost_model)
    assert all(mb for mbs in mini.microbatches for mb in mbs)


@settings(max_examples=250, deadline=None)
@given(instance=instances())
def test_lb_mini_odc_makespan_never_exceeds_lb_micro_fsdp(instance):
    lengths, world_size, budget, cost_model = instance
    mini = plan_lb_mini(lengths, world_size, budget, cost_model)
    micro = plan_lb_micro(lengths, world_size, budget, cost_model)
    # LB-Mini skips its LB-Micro candidate once within FALLBACK_SKIP_TOLERANCE (1e-4) of the makespan bound (issue 30:
    # that candidate was half of its planning time at 1,024 ranks), so LB-Micro may be ahead by that much at most;
    # hypothesis found 1 ulp (297, 442, 3448 tokens on one rank, a = 0.1: both at the bound, summed in another order)
    assert mini.predicted_odc_time <= micro.predicted_fsdp_time * (1 + FALLBACK_SKIP_TOLERANCE)


_PLANS_IN_A_FRESH_INTERPRETER = """
import json, sys
import numpy as np
from odc_hf.balance.cost import FlopCostModel
from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini, plan_none
from odc_hf.prediction.workloads import qwen2_5_config
lengths, world, budget = json.loads(sys.argv[1])
model = FlopCostModel.from_config(qwen2_5_config("1.5B"))
print(json.dumps([p(np.array(lengths), world, budget, model).microbatches for p in (plan_lb_mini, plan_lb_micro, plan_none)]))
"""


def test_plans_are_pure_functions_of_their_inputs():
    """Every rank plans alone, so a plan may depend on the lengths' values only: not on the container (list, tuple,
    array), not on the process (another interpreter, another hash seed), and the caller's lengths stay unchanged."""
    import json
    import os
    import subprocess
    import sys

    lengths = [9000, 300, 12000, 4000, 4000, 800, 15000, 2500, 7000]
    model = COST_MODELS["flop"]
    here = [planner(lengths, 3, 16384, model) for planner in PLANNERS.values()]
    for planner, plan in zip(PLANNERS.values(), here):
        assert planner(tuple(lengths), 3, 16384, model) == plan
        assert planner(np.array(lengths, dtype=np.int32), 3, 16384, model) == plan
    assert lengths == [9000, 300, 12000, 4000, 4000, 800, 15000, 2500, 7000]
    env = {**os.environ, "PYTHONHASHSEED": "4242" if os.environ.get("PYTHONHASHSEED") != "4242" else "7"}
    proc = subprocess.run([sys.executable, "-c", _PLANS_IN_A_FRESH_INTERPRETER, json.dumps([lengths, 3, 16384])],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == [plan.microbatches for plan in here]
    # and pinned, so that a change of plan is a visible decision (LB-Mini here: counts 2, 2, 1)
    assert here[0].microbatches == [[[0, 8], [4]], [[2, 3], [7]], [[6, 5, 1]]]


def test_fewer_samples_than_ranks_gives_empty_bundles():
    mini = plan_lb_mini([100, 200], 4, 1024, TokenCostModel())
    assert sorted(mini.num_microbatches) == [0, 0, 1, 1]
    micro = plan_lb_micro([100, 200], 4, 1024, TokenCostModel())
    assert micro.num_microbatches == [1, 1, 1, 1]
    assert sorted(len(mb) for mbs in micro.microbatches for mb in mbs) == [0, 0, 1, 1]  # two dummies


def test_over_budget_sample_raises_unless_truncated():
    with pytest.raises(ValueError, match=r"sample 1 has 5000 tokens.*max_tokens_per_microbatch=4096"):
        plan_lb_mini([100, 5000, 20], 2, 4096, TokenCostModel())
    plan = plan_lb_mini([100, 5000, 20], 2, 4096, TokenCostModel(), truncate=True)
    assert plan.predicted_odc_time == 4096  # the long sample is planned as budget-long


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="world_size"):
        plan_none([1, 2], 0, 10, TokenCostModel())
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_none([1, 2], 2, 0, TokenCostModel())
    with pytest.raises(ValueError, match="integers"):
        plan_none([1.5, 2], 2, 10, TokenCostModel())
    with pytest.raises(ValueError, match=">= 0"):
        plan_none([1, -2], 2, 10, TokenCostModel())


def test_lb_mini_packs_each_rank_into_few_microbatches():
    # one rank's share of 6 x 3000 tokens fits 2 microbatches of 10000, not 6
    plan = plan_lb_mini([3000] * 6, 1, 10000, QuadraticCostModel(a=1.0, b=1e-3, c=0.0))
    assert plan.num_microbatches == [2]


def test_predicted_times_and_bubble_of_a_hand_made_plan():
    plan = Plan(
        mode="x", microbatches=[[[0], [1]], [[2]]], microbatch_costs=[[3.0, 1.0], [2.0]], lower_bound=3.0
    )
    assert plan.predicted_fsdp_time == 3.0 + 1.0  # index 0: max(3, 2); index 1: max(1, 0)
    assert plan.predicted_odc_time == 4.0  # rank 0: 3 + 1
    assert plan.predicted_bubble("odc") == pytest.approx(1 - 3.0 / 4.0)
    assert plan.remap([10, 11, 12]).microbatches == [[[10], [11]], [[12]]]
    with pytest.raises(ValueError, match="semantics"):
        plan.predicted_time("ddp")


def test_lower_bound_counts_overhead_of_the_fewest_microbatches():
    model = QuadraticCostModel(a=1.0, b=1.0, c=0.0)
    # 4 documents of 10 tokens, budget 20 -> at least 2 microbatches; 2 ranks
    assert makespan_lower_bound([10] * 4, 2, 20, model) == (40 + 2 * 1.0) / 2
