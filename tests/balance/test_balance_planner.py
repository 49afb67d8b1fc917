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
    with pytest.raises(ValueError, match="lengths must be >= 0; sample 1 has length -2"):
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


def test_a_plan_checks_its_shape_answers_per_rank_and_keeps_its_fields_through_remap():
    """Plan's own contract: one cost per microbatch per rank (refused by message otherwise), for_rank within
    [0, world), each semantics its own time (FSDP's sum of per-index maxima vs ODC's busiest rank), a bubble on
    costs far below 1 (seconds), remap keeping mode, dummies, costs, bound and cost model, and the summary's numbers."""
    with pytest.raises(ValueError, match="microbatches and microbatch_costs must have one entry per rank"):
        Plan(mode="x", microbatches=[[[0]], [[1]]], microbatch_costs=[[1.0]], lower_bound=0.0)
    with pytest.raises(ValueError, match=r"rank 1: 2 microbatches but 1 costs"):
        Plan(mode="x", microbatches=[[[0]], [[1], [2]]], microbatch_costs=[[1.0], [1.0]], lower_bound=0.0)
    # rank 0: two light microbatches; rank 1: one heavy one and a dummy (FSDP pads counts with empty microbatches)
    plan = Plan(mode="lb_micro", microbatches=[[[0], [1]], [[2], []]], microbatch_costs=[[0.02, 0.03], [0.04, 0.0]],
                lower_bound=0.04, cost_model="quadratic(a=0)")  # fmt: skip
    assert plan.for_rank(1) == [[2], []] and plan.for_rank(0) == [[0], [1]]
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=rf"rank must be in \[0, 2\), got {bad}"):
            plan.for_rank(bad)
    assert plan.predicted_time("fsdp") == pytest.approx(0.04 + 0.03) and plan.predicted_fsdp_time == plan.predicted_time("fsdp")
    assert plan.predicted_time("odc") == pytest.approx(0.05) and plan.predicted_odc_time == plan.predicted_time("odc")
    assert plan.predicted_bubble("fsdp") == pytest.approx(1 - 0.045 / 0.07)
    assert plan.predicted_bubble("odc") == pytest.approx(1 - 0.045 / 0.05)
    moved = plan.remap(np.array([7, 8, 9]))
    assert moved == Plan(mode="lb_micro", microbatches=[[[7], [8]], [[9], []]], microbatch_costs=plan.microbatch_costs,
                         lower_bound=0.04, cost_model="quadratic(a=0)")  # fmt: skip
    assert moved.for_rank(1)[1] == [] and all(type(i) is int for mbs in moved.microbatches for mb in mbs for i in mb)
    assert plan.summary() == {
        "mode": "lb_micro", "num_microbatches": [2, 2], "predicted_fsdp_time": plan.predicted_fsdp_time,
        "predicted_odc_time": plan.predicted_odc_time, "predicted_bubble_fsdp": plan.predicted_bubble("fsdp"),
        "predicted_bubble_odc": plan.predicted_bubble("odc"), "lower_bound": 0.04, "cost_model": "quadratic(a=0)",
    }  # fmt: skip
    # no ranks, and ranks with no microbatches: nothing to run, no time, no bubble
    for empty in (Plan(mode="x", microbatches=[], microbatch_costs=[], lower_bound=0.0),
                  Plan(mode="x", microbatches=[[], []], microbatch_costs=[[], []], lower_bound=0.0)):  # fmt: skip
        assert empty.predicted_fsdp_time == 0.0 and empty.predicted_odc_time == 0.0
        assert empty.predicted_bubble("fsdp") == 0.0 and empty.predicted_bubble("odc") == 0.0


def test_lower_bound_counts_overhead_of_the_fewest_microbatches():
    model = QuadraticCostModel(a=1.0, b=1.0, c=0.0)
    # 4 documents of 10 tokens, budget 20 -> at least 2 microbatches; 2 ranks
    assert makespan_lower_bound([10] * 4, 2, 20, model) == (40 + 2 * 1.0) / 2


def test_budget_of_one_token_is_valid_and_non_integer_or_zero_budgets_are_refused():
    """The budget check is "a positive integer": 1 passes, 0 and 2.5 are refused with the budget named."""
    assert plan_none([1, 1, 0, 1], 2, 1, TokenCostModel()).microbatches == [[[0, 2], []], [[1], [3]]]  # 1 + 0 fits 1
    for budget in (0, 2.5, -3):
        for planner in PLANNERS.values():
            with pytest.raises(ValueError, match=rf"max_tokens_per_microbatch must be a positive integer, got {budget}"):
                planner([1, 1], 2, budget, TokenCostModel())
        with pytest.raises(ValueError, match="max_tokens_per_microbatch must be a positive integer"):
            makespan_lower_bound([1, 1], 2, budget, TokenCostModel())


def test_every_planner_and_the_bound_refuse_over_budget_samples_by_default():
    """Truncation is opt-in everywhere, not only in LB-Mini: the default names the sample and the budget."""
    lengths = [100, 5000, 20]
    for call in (*PLANNERS.values(), makespan_lower_bound):
        with pytest.raises(ValueError, match=r"sample 1 has 5000 tokens, more than max_tokens_per_microbatch=4096"):
            call(lengths, 2, 4096, TokenCostModel())
        call(lengths, 2, 4096, TokenCostModel(), truncate=True)
    assert makespan_lower_bound(lengths, 2, 4096, TokenCostModel(), truncate=True) == 4096


@settings(max_examples=60, deadline=None)
@given(instance=instances(), seed=st.integers(0, 2**16))
def test_vectorised_packing_is_first_fit_decreasing_per_rank_heaviest_first(instance, seed):
    """LB-Mini's packing of all ranks at once equals the plain first-fit decreasing of each rank's share, member for
    member (longest first inside a microbatch), with each rank's microbatches ordered heaviest first (ties: the order
    first-fit opened them) and priced max(floor, overhead + documents); the plan names its cost model."""
    from odc_hf.balance.planner import _packed_plan, pack_first_fit_decreasing

    lengths, world_size, budget, cost_model = instance
    eff = np.asarray(lengths, dtype=np.int64)
    labels = np.random.default_rng(seed).integers(0, world_size, size=eff.size)
    doc_costs = cost_model.doc_costs(eff)
    plan = _packed_plan("lb_mini", labels, eff, doc_costs, cost_model, 0.0, world_size, budget)
    assert plan.cost_model == cost_model.describe()
    for rank in range(world_size):
        bins = pack_first_fit_decreasing(np.nonzero(labels == rank)[0], eff, budget)
        prices = [cost_model.price(doc_costs[b].sum()) for b in bins]
        order = sorted(range(len(bins)), key=lambda j: (-prices[j], j))
        assert plan.microbatches[rank] == [bins[j] for j in order]
        assert plan.microbatch_costs[rank] == pytest.approx([prices[j] for j in order], rel=1e-12)


def test_plain_sharding_deals_round_robin_packs_in_order_and_pads_at_the_end():
    """plan_none is DistributedSampler's layout: rank r takes samples r, r+W, ... in order, cuts a microbatch when
    the next sample would overflow the budget (a sample that fills it exactly stays), dummies go last and cost 0
    even when every microbatch has an overhead."""
    lengths = [30, 50, 80, 50, 15, 20]  # rank 0: 30 | 80 + 15 (its second microbatch is the heavier); rank 1: 50 + 50 | 20
    model = QuadraticCostModel(a=1.0, b=1.0, c=0.0)
    plan = plan_none(lengths, 2, 100, model)
    assert plan.microbatches == [[[0], [2, 4]], [[1, 3], [5]]]  # in data order; 50 + 50 fills the budget exactly
    assert plan.microbatch_costs == [[31.0, 96.0], [101.0, 21.0]]
    assert plan.cost_model == model.describe()
    plan = plan_none([30, 50, 80], 2, 100, model)
    assert plan.microbatches == [[[0], [2]], [[1], []]] and plan.microbatch_costs == [[31.0, 81.0], [51.0, 0.0]]


def test_lb_micro_dummies_cost_nothing_and_microbatch_index_j_holds_the_jth_costliest_group():
    """With fewer samples than ranks the dummies are priced 0 despite the overhead; otherwise every microbatch at
    index j costs at least every microbatch at index j + 1 (the W·k microbatches sorted and cut into k groups)."""
    model = QuadraticCostModel(a=1.0, b=1.0, c=0.0)
    plan = plan_lb_micro([5, 7], 4, 16, model)
    assert sorted(c for costs in plan.microbatch_costs for c in costs) == [0.0, 0.0, 6.0, 8.0]
    rng = np.random.default_rng(3)
    for _ in range(20):
        lengths = rng.integers(1, 4096, size=int(rng.integers(8, 40)))
        plan = plan_lb_micro(lengths, 3, 4096, COST_MODELS["flop"])
        costs = np.array(plan.microbatch_costs)
        assert all(costs[:, j].min() >= costs[:, j + 1].max() for j in range(costs.shape[1] - 1)), costs


def test_lb_micro_keeps_groups_that_fill_the_budget_exactly_and_repairs_groups_no_single_move_fixes():
    # four 50-token samples fill two 100-token microbatches exactly: one microbatch per rank, nothing moved
    assert plan_lb_micro([50] * 4, 2, 100, TokenCostModel()).num_microbatches == [1, 1]
    # cost c·s² sets the 110-token sample apart from fifteen 10-token ones (150 tokens, 20 over a 130 budget): no
    # single sample brings that group within budget, so the repair moves the largest, then the smallest that is
    # enough, into the 110-token group, which the last move fills exactly: still one microbatch per rank
    lengths = [110] + [10] * 15
    plan = plan_lb_micro(lengths, 2, 130, QuadraticCostModel(a=0.0, b=0.0, c=1.0))
    assert plan.num_microbatches == [1, 1]
    assert [sum(lengths[i] for i in mbs[0]) for mbs in plan.microbatches] == [130, 130]
