"""Plain FSDP2 (its own collectives, no ODC) with the gradient semantics ODC has: the baseline ODC is compared with.

ODC adds every rank's gradient contribution into the owner's shard as a plain SUM and leaves normalisation to the
loss (divided by the global token count). FSDP2 by default averages over ranks (and on NCCL pre-multiplies inside
the reduce-scatter, which gloo cannot do). :func:`sum_reduction` turns that off on every unit, so that one training
loop gives the same gradients under ODC and under FSDP2's collectives.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["sum_reduction"]


def sum_reduction(model: torch.nn.Module) -> torch.nn.Module:
    """Make every FSDP2 unit of ``model`` (``fully_shard`` applied) reduce gradients as a plain SUM over ranks.

    ``set_gradient_divide_factor(1.0)``: no division by the world size (the loss carries the global normaliser);
    ``set_force_sum_reduction_for_comms(True)``: the reduce-scatter itself is a SUM (gloo has no PREMUL_SUM).
    Returns the model.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("sum_reduction: the model has no FSDP2 unit; apply fully_shard (or shard_model) first")
    for module in units:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model
