"""Acceptance: LB-Mini within 5% of max(Σcost/W, max cost) on >= 95% of LongAlign-like minibatches."""

import numpy as np

from odc_hf.balance.cost import FlopCostModel
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
