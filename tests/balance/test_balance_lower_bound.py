"""Acceptance: LB-Mini within 5% of max(Σcost/W, max cost) on >= 95% of LongAlign-like minibatches."""

import numpy as np

from odc_hf.balance.cost import FlopCostModel, QuadraticCostModel
from odc_hf.balance.planner import plan_lb_mini
from odc_hf.prediction.workloads import generate_lengths, qwen2_5_config


def test_lb_mini_is_within_five_percent_of_the_bound_on_longalign_like_minibatches():
    cost_model = FlopCostModel.from_config(qwen2_5_config("7B"))
    world_size, minibatch_size, budget, num_instances = 8, 32, 64 * 1024, 200
    ratios = []
    for seed in range(num_instances):
        lengths = generate_lengths("longalign", minibatch_size, seed)
        costs = cost_model.doc_costs(lengths)
        bound = max(costs.sum() / world_size, costs.max())
        plan = plan_lb_mini(lengths, world_size, budget, cost_model)
        ratios.append(plan.predicted_odc_time / bound)
    ratios = np.array(ratios)
    assert ratios.min() >= 1 - 1e-9
    assert np.mean(ratios <= 1.05) >= 0.95, f"only {np.mean(ratios <= 1.05):.1%} within 5%"


def test_lb_mini_prices_each_sample_s_share_of_the_microbatch_overhead():
    """With a per-microbatch launch overhead (a calibrated model's ``a``), LB-Mini weighs a sample by its cost plus
    the overhead its tokens will cost (a · tokens / budget): within 5% of the bound on >= 95% of LongAlign-like
    minibatches (median 1.02 at 8 ranks, 64k budget). Weighing the overhead by tokens x budget instead (balancing
    tokens) measured a median of 1.18 and no minibatch within 5%."""
    cost_model = QuadraticCostModel(a=0.01, b=2e-6, c=1.5e-10)
    ratios = []
    for seed in range(100):
        plan = plan_lb_mini(generate_lengths("longalign", 32, seed), 8, 64 * 1024, cost_model)
        ratios.append(plan.predicted_odc_time / plan.lower_bound)
    assert np.mean(np.array(ratios) <= 1.05) >= 0.95, sorted(ratios)[-10:]
    assert np.median(ratios) <= 1.05
