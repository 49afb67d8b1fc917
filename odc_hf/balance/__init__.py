"""Minibatch load balancing for ODC, pure planning (numbers in, plans out): cost models, partitioners, planners,
the batch sampler, and the padded (GRPO) layout.

Data flow: ``ODCBatchSampler`` (plans each global minibatch with a cost model) yields this rank's bundle of
microbatches as dataset indices; ``odc_hf.integrations.trainer.bundle`` fetches and packs them. This package imports neither
transformers, TRL nor torch.distributed (``tests/project/test_layering.py`` holds it to that). See docs/balancing.md.
"""

from .cost import CostModel, FlopCostModel, QuadraticCostModel, TokenCostModel
from .padded import pack_padded, padded_microbatch_width, padded_width, plan_padded
from .partition import karmarkar_karp, lpt, refine
from .plan import Plan
from .planner import makespan_lower_bound, plan_lb_micro, plan_lb_mini, plan_none
from .sampler import ODCBatchSampler

__all__ = [
    "CostModel",
    "FlopCostModel",
    "ODCBatchSampler",
    "Plan",
    "QuadraticCostModel",
    "TokenCostModel",
    "karmarkar_karp",
    "lpt",
    "makespan_lower_bound",
    "pack_padded",
    "padded_microbatch_width",
    "padded_width",
    "plan_lb_micro",
    "plan_lb_mini",
    "plan_none",
    "plan_padded",
    "refine",
]
