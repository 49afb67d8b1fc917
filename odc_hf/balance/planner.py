"""Planners: split one global minibatch over ranks and into memory-feasible microbatches.

All three are pure functions of ``(lengths, world_size, max_tokens_per_microbatch, cost_model)``, so
every rank computes the same :class:`~odc_hf.balance.plan.Plan` alone. Indices in the plan are
positions in ``lengths``.

- :func:`plan_lb_mini` (ODC): balance *cost* across ranks with Karmarkar-Karp + refinement, any number
  of samples per rank; each rank then packs its share into as few microbatches as fit the budget.
- :func:`plan_lb_micro` (FSDP-compatible baseline, verl-style): every rank gets the same number k of
  microbatches; W·k cost-balanced microbatches, grouped so each microbatch index holds similar costs.
- :func:`plan_none` (plain sharding): samples dealt round-robin like ``DistributedSampler``, packed in
  order, padded with empty dummy microbatches to equal counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .cost import CostModel
from .partition import karmarkar_karp, refine
from .plan import Plan

__all__ = ["Plan", "makespan_lower_bound", "pack_first_fit_decreasing", "plan_lb_mini", "plan_lb_micro", "plan_none"]


def _effective_lengths(lengths, max_tokens: int, truncate: bool) -> np.ndarray:
    """Validated integer lengths; over-budget samples are an error unless ``truncate`` clips them."""
    if int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be a positive integer, got {max_tokens}")
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"lengths must be a 1-D sequence of integers, got {arr.dtype} with shape {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"lengths must be >= 0; sample {int(np.argmin(arr))} has length {int(arr.min())}")
    too_long = np.nonzero(arr > max_tokens)[0]
    if too_long.size and not truncate:
        i = int(too_long[0])
        raise ValueError(
            f"sample {i} has {int(arr[i])} tokens, more than max_tokens_per_microbatch={max_tokens} "
            f"({too_long.size} such samples); raise the budget or pass truncate=True"
        )
    return np.minimum(arr, max_tokens)


def _validate_world_size(world_size: int) -> int:
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    return int(world_size)


def makespan_lower_bound(lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel,
                         *, truncate: bool = False) -> float:
    """No plan can finish faster: max(total cost / W, cost of the single most expensive microbatch).

    The total counts each document once plus the per-microbatch overhead of the fewest microbatches
    the token budget allows (ceil(total tokens / budget)); the second term is overhead + the
    costliest document, which some rank must run.
    """
    world_size = _validate_world_size(world_size)
    eff = _effective_lengths(lengths, max_tokens_per_microbatch, truncate)
    if eff.size == 0:
        return 0.0
    costs = cost_model.doc_costs(eff)
    min_microbatches = max(1, math.ceil(int(eff.sum()) / max_tokens_per_microbatch))
    total = float(costs.sum()) + cost_model.overhead * min_microbatches
    return max(total / world_size, cost_model.overhead + float(costs.max()))


def pack_first_fit_decreasing(indices: Sequence[int], lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Pack samples into as few microbatches of <= ``max_tokens`` tokens as first-fit decreasing finds.

    Fewer microbatches means less fixed per-microbatch overhead. Longest first (ties: lower index),
    so the first microbatch holds the heaviest sample.
    """
    items = np.asarray(indices, dtype=np.int64)
    items = items[np.lexsort((items, -lengths[items]))]
    bins: list[list[int]] = []
    room = np.empty(len(items), dtype=np.int64)
    for item in items.tolist():
        fits = np.nonzero(room[: len(bins)] >= lengths[item])[0]
        if fits.size:
            b = int(fits[0])
        else:
            b = len(bins)
            bins.append([])
            room[b] = max_tokens
        bins[b].append(item)
        room[b] -= lengths[item]
    return bins


def _make_plan(mode, microbatches, eff, cost_model, max_tokens, world_size, truncate, sort_heaviest_first):
    costs = [[cost_model.microbatch_cost(eff[mb]) if mb else 0.0 for mb in mbs] for mbs in microbatches]
    if sort_heaviest_first:
        orders = [sorted(range(len(c)), key=lambda j, c=c: (-c[j], j)) for c in costs]
        microbatches = [[mbs[j] for j in order] for mbs, order in zip(microbatches, orders)]
        costs = [[c[j] for j in order] for c, order in zip(costs, orders)]
    bound = makespan_lower_bound(eff, world_size, max_tokens, cost_model, truncate=truncate)
    return Plan(mode=mode, microbatches=microbatches, microbatch_costs=costs, lower_bound=bound,
                cost_model=cost_model.describe())


def plan_lb_mini(lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel,
                 *, truncate: bool = False) -> Plan:
    """LB-Mini: balance each rank's total cost; ranks may run different numbers of microbatches.

    Samples are partitioned by weight = document cost + the overhead its tokens will cost
    (overhead · tokens / budget, since a rank needs about tokens / budget microbatches), with
    Karmarkar-Karp then :func:`refine`. Each rank's share is packed first-fit decreasing, heaviest
    microbatch first. The LB-Micro plan's rank assignment is also a valid ODC plan, so it is kept as a
    second candidate: the plan with the lower predicted ODC time wins, which guarantees LB-Mini never
    predicts worse than LB-Micro (ties keep the Karmarkar-Karp plan).
    """
    world_size = _validate_world_size(world_size)
    eff = _effective_lengths(lengths, max_tokens_per_microbatch, truncate)
    weights = cost_model.doc_costs(eff) + cost_model.overhead * eff / max_tokens_per_microbatch
    parts = refine(karmarkar_karp(weights, world_size), weights)
    microbatches = [pack_first_fit_decreasing(part, eff, max_tokens_per_microbatch) for part in parts]
    plan = _make_plan("lb_mini", microbatches, eff, cost_model, max_tokens_per_microbatch, world_size,
                      truncate, sort_heaviest_first=True)
    micro = plan_lb_micro(eff, world_size, max_tokens_per_microbatch, cost_model)
    if micro.predicted_odc_time < plan.predicted_odc_time:
        kept = [[mb for mb in mbs if mb] for mbs in micro.microbatches]
        plan = _make_plan("lb_mini", kept, eff, cost_model, max_tokens_per_microbatch, world_size,
                          truncate, sort_heaviest_first=True)
    return plan


def _cost_balanced_microbatches(eff, costs, num_parts, max_tokens):
    """Split into ``num_parts`` cost-balanced groups within the token budget, or None if none found.

    Karmarkar-Karp on cost first; if some group overflows the budget, a budget-aware greedy (costliest
    sample to the cheapest group that still has room). With num_parts >= samples the greedy always
    succeeds (every sample fits an empty group), which bounds the search over k in plan_lb_micro.
    """
    parts = karmarkar_karp(costs, num_parts)
    if all(eff[part].sum() <= max_tokens for part in parts):
        return parts
    if num_parts >= eff.size:
        return [[i] for i in range(eff.size)] + [[] for _ in range(num_parts - eff.size)]
    loads = np.zeros(num_parts)
    room = np.full(num_parts, max_tokens, dtype=np.int64)
    parts = [[] for _ in range(num_parts)]
    for item in np.argsort(-costs, kind="stable").tolist():
        open_parts = np.nonzero(room >= eff[item])[0]
        if open_parts.size == 0:
            return None
        p = int(open_parts[np.argmin(loads[open_parts])])
        parts[p].append(item)
        loads[p] += costs[item]
        room[p] -= eff[item]
    return parts


def plan_lb_micro(lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel,
                  *, truncate: bool = False) -> Plan:
    """LB-Micro: equal microbatch count k on every rank, balanced per microbatch index (FSDP-compatible).

    k starts at ceil(total tokens / (W · budget)) and grows until W·k cost-balanced microbatches all
    fit the budget. The W·k microbatches are sorted by cost and cut into k groups of W (sorted
    grouping minimises Σ_j max over the group); inside each group the costliest microbatch goes to the
    rank with the least work so far, which also evens out per-rank totals.
    """
    world_size = _validate_world_size(world_size)
    eff = _effective_lengths(lengths, max_tokens_per_microbatch, truncate)
    if eff.size == 0:
        return _make_plan("lb_micro", [[] for _ in range(world_size)], eff, cost_model,
                          max_tokens_per_microbatch, world_size, truncate, sort_heaviest_first=False)
    doc_costs = cost_model.doc_costs(eff)
    k = max(1, math.ceil(int(eff.sum()) / (world_size * max_tokens_per_microbatch)))
    while (parts := _cost_balanced_microbatches(eff, doc_costs, world_size * k, max_tokens_per_microbatch)) is None:
        k += 1
    part_costs = np.array([cost_model.microbatch_cost(eff[part]) if part else 0.0 for part in parts])
    order = np.argsort(-part_costs, kind="stable")
    microbatches: list[list[list[int]]] = [[] for _ in range(world_size)]
    busy = np.zeros(world_size)
    for j in range(k):
        group = order[j * world_size : (j + 1) * world_size]  # already costliest first
        taken = np.zeros(world_size, dtype=bool)
        for p in group.tolist():
            rank = int(np.argmin(np.where(taken, np.inf, busy)))
            taken[rank] = True
            microbatches[rank].append(parts[p])
            busy[rank] += part_costs[p]
    return _make_plan("lb_micro", microbatches, eff, cost_model, max_tokens_per_microbatch, world_size,
                      truncate, sort_heaviest_first=False)


def plan_none(lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel,
              *, truncate: bool = False) -> Plan:
    """No balancing: sample i to rank i mod W, packed in order, padded with dummies to equal counts."""
    world_size = _validate_world_size(world_size)
    eff = _effective_lengths(lengths, max_tokens_per_microbatch, truncate)
    microbatches: list[list[list[int]]] = []
    for rank in range(world_size):
        mbs: list[list[int]] = []
        tokens = 0
        for i in range(rank, eff.size, world_size):
            if not mbs or tokens + eff[i] > max_tokens_per_microbatch:
                mbs.append([])
                tokens = 0
            mbs[-1].append(i)
            tokens += int(eff[i])
        microbatches.append(mbs)
    width = max(len(mbs) for mbs in microbatches)
    microbatches = [mbs + [[] for _ in range(width - len(mbs))] for mbs in microbatches]
    return _make_plan("none", microbatches, eff, cost_model, max_tokens_per_microbatch, world_size,
                      truncate, sort_heaviest_first=False)


PLANNERS = {"lb_mini": plan_lb_mini, "lb_micro": plan_lb_micro, "none": plan_none}
"""Planner by sampler mode name."""
