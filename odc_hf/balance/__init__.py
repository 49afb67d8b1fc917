"""Minibatch load balancing for ODC: cost models, partitioners, planners, sampler and bundle collator.

Data flow: ``ODCBatchSampler`` (plans each global minibatch with a cost model) -> ``BundleDataset``
(fetches the examples of this rank's bundle) -> ``BundleCollator`` (packs each microbatch). See
docs/balancing.md.
"""

from .collator import BundleCollator, BundleDataset
from .cost import CostModel, FlopCostModel, QuadraticCostModel, TokenCostModel, calibrate
from .partition import karmarkar_karp, lpt, refine
from .plan import Plan
from .planner import makespan_lower_bound, plan_lb_micro, plan_lb_mini, plan_none
from .sampler import ODCBatchSampler

__all__ = [
    "BundleCollator",
    "BundleDataset",
    "CostModel",
    "FlopCostModel",
    "ODCBatchSampler",
    "Plan",
    "QuadraticCostModel",
    "TokenCostModel",
    "calibrate",
    "karmarkar_karp",
    "lpt",
    "makespan_lower_bound",
    "plan_lb_micro",
    "plan_lb_mini",
    "plan_none",
    "refine",
]
