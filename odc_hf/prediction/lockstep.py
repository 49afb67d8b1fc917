"""Price a lockstep plan built elsewhere (pure: index lists in, seconds out), e.g. transformers' ``batch_rebalance``.

A lockstep plan gives every rank the same number of microbatches (``plan[rank][slot]`` = sample positions), as
FSDP2 needs: microbatch ``slot`` ends in per-layer collectives on all ranks together, so a step lasts
``Σ_slot max_rank cost[rank][slot]`` (:class:`~odc_hf.balance.plan.Plan`'s FSDP semantics).

A microbatch's cost depends on its layout:

- **padded** (what ``Trainer`` + ``batch_rebalance`` runs with TRL's default collator): ``r`` rows, each padded to
  the widest sample ``L``, so attention and the matmuls run over ``r·L`` tokens: ``price(r · doc_cost(L))``;
- **packed** (padding-free, ``position_ids`` restarting per sample, as odc_hf's collator does): ``price(Σ doc_cost(l))``.

The plan's own cost model is not used here: whoever built it balanced what it believed; this module prices the
result with odc_hf's (measured or FLOP) cost models, so plans of different planners compare on one scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..balance.cost import CostModel

__all__ = ["LAYOUTS", "lockstep_cost_matrix", "padded_tokens", "padding_waste"]

LAYOUTS = ("padded", "packed")


def _check(plan: Sequence[Sequence[Sequence[int]]], size: int) -> int:
    if not plan:
        raise ValueError("a lockstep plan needs at least one rank")
    width = len(plan[0])
    for rank, mbs in enumerate(plan):
        if len(mbs) != width:
            raise ValueError(f"a lockstep plan gives every rank the same number of microbatches; rank {rank} has "
                             f"{len(mbs)}, rank 0 has {width}")  # fmt: skip
        for mb in mbs:
            for i in mb:
                if not 0 <= i < size:
                    raise ValueError(f"rank {rank}: sample position {i} is outside the {size} lengths given")
    return width


def lockstep_cost_matrix(plan, lengths, cost_model: CostModel, *, layout: str = "padded") -> np.ndarray:
    """``(ranks, slots)`` cost of every microbatch of ``plan`` (0 for an empty one) in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    width = _check(plan, lengths.size)
    doc = cost_model.doc_costs(lengths)
    out = np.zeros((len(plan), width))
    for rank, mbs in enumerate(plan):
        for slot, mb in enumerate(mbs):
            if not len(mb):
                continue
            idx = np.asarray(mb, dtype=np.int64)
            work = idx.size * doc[idx].max() if layout == "padded" else doc[idx].sum()  # doc cost grows with length
            out[rank, slot] = cost_model.price(work)
    return out


def padded_tokens(plan, lengths) -> np.ndarray:
    """``(ranks, slots)`` tokens each padded microbatch holds: rows x widest row."""
    lengths = np.asarray(lengths, dtype=np.int64)
    width = _check(plan, lengths.size)
    out = np.zeros((len(plan), width), dtype=np.int64)
    for rank, mbs in enumerate(plan):
        for slot, mb in enumerate(mbs):
            if len(mb):
                out[rank, slot] = len(mb) * int(lengths[np.asarray(mb, dtype=np.int64)].max())
    return out


def padding_waste(plan, lengths) -> float:
    """Fraction of the padded tokens that are padding: ``1 - real tokens / padded tokens``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = int(padded_tokens(plan, lengths).sum())
    real = sum(int(lengths[np.asarray(mb, dtype=np.int64)].sum()) for mbs in plan for mb in mbs if len(mb))
    return 0.0 if padded == 0 else 1.0 - real / padded
