"""Planners: split one global minibatch over ranks and into memory-feasible microbatches.

All three are pure functions of ``(lengths, world_size, max_tokens_per_microbatch, cost_model)``, so
every rank computes the same :class:`~odc_hf.balance.plan.Plan` alone. Indices in the plan are
positions in ``lengths``. They validate their arguments (:func:`effective_lengths`: the one check of lengths
against the token budget); :data:`PLANNERS_ON_VALID_INPUT` are the same planners for callers that validated
already (the sampler, once for the whole dataset).

- :func:`plan_lb_mini` (ODC): balance *cost* across ranks with Karmarkar-Karp + refinement, any number
  of samples per rank; each rank then packs its share into as few microbatches as fit the budget.
- :func:`plan_lb_micro` (FSDP-compatible baseline, verl-style): every rank gets the same number k of
  microbatches; W·k cost-balanced microbatches, grouped so each microbatch index holds similar costs.
- :func:`plan_none` (plain sharding): samples dealt round-robin like ``DistributedSampler``, packed in
  order, padded with empty dummy microbatches to equal counts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

from .cost import CostModel
from .partition import karmarkar_karp_labels, labels_to_parts, refine_labels
from .plan import Plan

__all__ = [
    "PLANNERS",
    "PLANNERS_ON_VALID_INPUT",
    "Plan",
    "effective_lengths",
    "makespan_lower_bound",
    "pack_first_fit_decreasing",
    "plan_lb_mini",
    "plan_lb_micro",
    "plan_none",
]


FALLBACK_SKIP_TOLERANCE = 1e-4
"""LB-Mini skips its LB-Micro fallback candidate when its own plan is within this fraction of the makespan lower
bound: no plan beats the bound, so the candidate could win by this fraction at most (at 1,024 ranks it took half of
LB-Mini's planning time and up to 5 s when refinement ended at 1.1e-5 above the bound)."""


def effective_lengths(lengths, max_tokens: int, truncate: bool, *, what: str = "sample") -> np.ndarray:
    """Validated integer lengths, clipped to the budget; over-budget samples are an error unless ``truncate``.

    Also validates the budget itself (a positive integer). ``what`` names a sample in the error message."""
    if int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be a positive integer, got {max_tokens}")
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(
            f"lengths must be a 1-D sequence of integers, got {arr.dtype} with shape {arr.shape}"
        )
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"lengths must be >= 0; {what} {int(np.argmin(arr))} has length {int(arr.min())}")
    too_long = np.nonzero(arr > max_tokens)[0]
    if too_long.size and not truncate:
        i = int(too_long[0])
        raise ValueError(
            f"{what} {i} has {int(arr[i])} tokens, more than max_tokens_per_microbatch={max_tokens} "
            f"({too_long.size} such samples); raise the budget, filter the data, or pass truncate=True"
        )
    return np.minimum(arr, max_tokens)


def _validate_world_size(world_size: int) -> int:
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    return int(world_size)


def makespan_lower_bound(
    lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel, *, truncate: bool = False
) -> float:
    """No plan can finish faster: max(total cost / W, cost of the single most expensive microbatch).

    The total counts each document once plus the per-microbatch overhead of the fewest microbatches
    the token budget allows (ceil(total tokens / budget)); the second term is the price of the
    costliest document alone, which some rank must run. The cost model's floor is left out of the total
    (it only raises costs), so this stays a lower bound.
    """
    world_size = _validate_world_size(world_size)
    eff = effective_lengths(lengths, max_tokens_per_microbatch, truncate)
    return _lower_bound(eff, world_size, max_tokens_per_microbatch, cost_model, cost_model.doc_costs(eff))


def _lower_bound(eff, world_size, max_tokens, cost_model, costs) -> float:
    if eff.size == 0:
        return 0.0
    min_microbatches = max(1, math.ceil(int(eff.sum()) / max_tokens))
    total = float(costs.sum()) + cost_model.overhead * min_microbatches
    return max(total / world_size, cost_model.price(float(costs.max())))


def pack_first_fit_decreasing(
    indices: Sequence[int], lengths: np.ndarray, max_tokens: int
) -> list[list[int]]:
    """Pack samples into as few microbatches of <= ``max_tokens`` tokens as first-fit decreasing finds.

    Fewer microbatches means less fixed per-microbatch overhead. Longest first (ties: lower index),
    so the first microbatch holds the heaviest sample. A rank has few bins, so a plain scan is fastest.
    """
    items = np.asarray(indices, dtype=np.int64)
    items = items[np.lexsort((items, -lengths[items]))]
    bins: list[list[int]] = []
    room: list[int] = []
    for item, size in zip(items.tolist(), lengths[items].tolist()):
        for b, free in enumerate(room):
            if free >= size:
                bins[b].append(item)
                room[b] = free - size
                break
        else:
            bins.append([item])
            room.append(max_tokens - size)
    return bins


def _ffd_bins(labels: np.ndarray, lengths: np.ndarray, num_parts: int, max_tokens: int):
    """First-fit decreasing of every part at once: (sorted items, their part, their bin, bins per part).

    Items are sorted by part, then longest first (ties: lower index), as :func:`pack_first_fit_decreasing` takes
    them. Round j places the j-th item of every part together (numpy over parts and their open bins), so the
    Python loop runs over the largest part's item count, not over all items (65,536 samples over 1,024
    ranks took 0.2 s one part at a time).
    """
    items = np.arange(labels.size)
    order = np.lexsort((items, -lengths, labels))
    owner = labels[order]
    counts = np.bincount(labels, minlength=num_parts)
    width = int(counts.max(initial=0))
    position = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)
    sizes = np.full((num_parts, width), -1, dtype=np.int64)
    sizes[owner, position] = lengths[order]
    room = np.full((num_parts, max(width, 1)), -1, dtype=np.int64)  # -1: no bin opened there yet
    opened = np.zeros(num_parts, dtype=np.int64)
    bin_at = np.zeros((num_parts, width), dtype=np.int64)
    rows = np.arange(num_parts)
    for j in range(width):
        size = sizes[:, j]
        live = size >= 0
        used = int(opened.max()) + 1  # bins beyond the most any part opened so far are all unopened
        fits = room[:, :used] >= size[:, None]
        first = np.argmax(fits, axis=1)
        has = fits[rows, first]
        target = np.where(has, first, opened)
        new = live & ~has
        room[rows[new], opened[new]] = max_tokens  # open a bin where nothing fit
        r, t = rows[live], target[live]
        room[r, t] -= size[live]
        opened += new
        bin_at[r, j] = t
    return order, owner, bin_at[owner, position], opened


def _packed_plan(mode, labels, eff, doc_costs, cost_model, bound, num_parts, max_tokens) -> Plan:
    """LB-Mini's packing and pricing, vectorised: first-fit decreasing per rank, microbatches heaviest first."""
    order, owner, bins, opened = _ffd_bins(labels, eff, num_parts, max_tokens)
    first_bin = np.concatenate([[0], np.cumsum(opened)[:-1]])
    global_bin = first_bin[owner] + bins
    total = int(opened.sum())
    sums = np.bincount(global_bin, weights=doc_costs[order], minlength=total)
    prices = np.maximum(cost_model.floor, cost_model.overhead + sums)
    bin_rank = np.repeat(np.arange(num_parts), opened)
    # heaviest first within a rank, ties by first-fit order (as _make_plan(heaviest_first=True) sorts)
    ranked = np.lexsort((np.arange(total), -prices, bin_rank))
    slot = np.empty(total, dtype=np.int64)
    slot[ranked] = np.arange(total)
    by_slot = np.argsort(slot[global_bin], kind="stable")  # keeps first-fit order inside a microbatch
    bounds = np.searchsorted(slot[global_bin][by_slot], np.arange(total + 1)).tolist()
    flat = order[by_slot].tolist()
    members = [flat[bounds[g] : bounds[g + 1]] for g in range(total)]
    price_list = prices[ranked].tolist()
    microbatches, costs, at = [], [], 0
    for k in opened.tolist():
        microbatches.append(members[at : at + k])
        costs.append(price_list[at : at + k])
        at += k
    return Plan(mode=mode, microbatches=microbatches, microbatch_costs=costs, lower_bound=bound,
                cost_model=cost_model.describe())  # fmt: skip


def _make_plan(mode, microbatches, doc_costs, cost_model, bound, *, heaviest_first):
    """Price every microbatch (empty ones cost 0) and wrap it all in a Plan."""
    costs = _microbatch_prices(microbatches, doc_costs, cost_model)
    if heaviest_first:
        orders = [sorted(range(len(c)), key=lambda j, c=c: (-c[j], j)) for c in costs]
        microbatches = [[mbs[j] for j in order] for mbs, order in zip(microbatches, orders)]
        costs = [[c[j] for j in order] for c, order in zip(costs, orders)]
    return Plan(
        mode=mode,
        microbatches=microbatches,
        microbatch_costs=costs,
        lower_bound=bound,
        cost_model=cost_model.describe(),
    )


def _microbatch_prices(microbatches, doc_costs, cost_model) -> list[list[float]]:
    """Per rank, the price of each microbatch (0.0 for an empty one), summed in one pass over all of them."""
    sizes = [len(mb) for mbs in microbatches for mb in mbs]
    if not sizes:
        return [[] for _ in microbatches]
    items = np.fromiter((i for mbs in microbatches for mb in mbs for i in mb), dtype=np.int64, count=sum(sizes))
    owner = np.repeat(np.arange(len(sizes)), sizes)
    sums = np.bincount(owner, weights=doc_costs[items], minlength=len(sizes))
    priced = np.where(np.asarray(sizes) > 0, np.maximum(cost_model.floor, cost_model.overhead + sums), 0.0).tolist()
    out, at = [], 0
    for mbs in microbatches:
        out.append(priced[at : at + len(mbs)])
        at += len(mbs)
    return out


def _validated(lengths, world_size, max_tokens, truncate):
    """The planners' entry check: (world_size, effective lengths)."""
    return _validate_world_size(world_size), effective_lengths(lengths, max_tokens, truncate)


def _priced(eff, world_size, max_tokens, cost_model):
    doc_costs = cost_model.doc_costs(eff)
    return doc_costs, _lower_bound(eff, world_size, max_tokens, cost_model, doc_costs)


def plan_lb_mini(
    lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel, *, truncate: bool = False
) -> Plan:
    """LB-Mini: balance each rank's total cost; ranks may run different numbers of microbatches.

    Samples are partitioned by weight = document cost + the overhead its tokens will cost
    (overhead · tokens / budget, since a rank needs about tokens / budget microbatches), with
    Karmarkar-Karp then :func:`refine`. Each rank's share is packed first-fit decreasing, heaviest
    microbatch first. The LB-Micro plan's rank assignment is also a valid ODC plan, so it is kept as a
    second candidate: the plan with the lower predicted ODC time wins, which guarantees LB-Mini never
    predicts worse than LB-Micro (ties keep the Karmarkar-Karp plan). The candidate is skipped when the
    Karmarkar-Karp plan is within ``FALLBACK_SKIP_TOLERANCE`` (1e-4) of the lower bound, which no plan beats.
    """
    world_size, eff = _validated(lengths, world_size, max_tokens_per_microbatch, truncate)
    return _lb_mini(eff, world_size, max_tokens_per_microbatch, cost_model)


def _lb_mini(eff, world_size, max_tokens_per_microbatch, cost_model) -> Plan:
    doc_costs, bound = _priced(eff, world_size, max_tokens_per_microbatch, cost_model)
    weights = doc_costs + cost_model.overhead * eff / max_tokens_per_microbatch
    labels = refine_labels(karmarkar_karp_labels(weights, world_size), weights, world_size)
    plan = _packed_plan("lb_mini", labels, eff, doc_costs, cost_model, bound, world_size, max_tokens_per_microbatch)
    if plan.predicted_odc_time <= bound * (1 + FALLBACK_SKIP_TOLERANCE):
        return plan  # no plan is faster than the bound: LB-Micro's could win by this tolerance at most
    micro = _lb_micro(eff, world_size, max_tokens_per_microbatch, cost_model, doc_costs, bound)
    if micro.predicted_odc_time < plan.predicted_odc_time:
        kept = [[mb for mb in mbs if mb] for mbs in micro.microbatches]
        plan = _make_plan("lb_mini", kept, doc_costs, cost_model, bound, heaviest_first=True)
    return plan


def _cost_balanced_labels(eff, costs, num_parts, max_tokens):
    """Split into ``num_parts`` cost-balanced groups within the token budget (labels), or None.

    Karmarkar-Karp on cost, then a repair of the (few) groups over the token budget: while a group
    is over, move out the smallest sample that alone brings it within budget (or else its largest) to
    the cheapest group with room for it. Balancing cost crowds short documents together, so some
    groups overflow; moving a few of them disturbs the balance least. With num_parts >= samples every
    sample gets its own group, which is always feasible and bounds the search over k in plan_lb_micro.
    """
    if num_parts >= eff.size:
        return np.arange(eff.size)
    labels = karmarkar_karp_labels(costs, num_parts)
    tokens = np.bincount(labels, weights=eff, minlength=num_parts)
    over = np.nonzero(tokens > max_tokens)[0].tolist()
    if not over:
        return labels
    loads = np.bincount(labels, weights=costs, minlength=num_parts)
    others = np.arange(num_parts)
    # members of every part from one argsort (a scan of all labels per move took a second at 1,024 ranks)
    grouped = np.argsort(labels, kind="stable")
    starts = np.searchsorted(labels[grouped], np.arange(num_parts + 1))
    for part in over:
        members = grouped[starts[part] : starts[part + 1]]
        members = members[np.lexsort((members, eff[members]))].tolist()  # ascending size, ties by index
        sizes = [int(eff[i]) for i in members]
        while tokens[part] > max_tokens:
            at = bisect.bisect_left(sizes, tokens[part] - max_tokens)
            at = at if at < len(sizes) else len(sizes) - 1  # the smallest that is enough, else the largest
            item = members.pop(at)
            sizes.pop(at)
            room_ok = (max_tokens - tokens >= eff[item]) & (others != part)
            if not room_ok.any():
                return None
            target = int(np.argmin(np.where(room_ok, loads, np.inf)))
            labels[item] = target
            for array, amount in ((tokens, eff[item]), (loads, costs[item])):
                array[part] -= amount
                array[target] += amount
    return labels


def _lb_micro(eff, world_size, max_tokens, cost_model, doc_costs, bound) -> Plan:
    if eff.size == 0:
        return _make_plan(
            "lb_micro", [[] for _ in range(world_size)], doc_costs, cost_model, bound, heaviest_first=False
        )
    k = max(1, math.ceil(int(eff.sum()) / (world_size * max_tokens)))
    while (labels := _cost_balanced_labels(eff, doc_costs, world_size * k, max_tokens)) is None:
        k += 1
    parts = labels_to_parts(labels, world_size * k)
    sizes = np.bincount(labels, minlength=world_size * k)
    part_costs = np.bincount(labels, weights=doc_costs, minlength=world_size * k)
    part_costs = np.where(sizes > 0, np.maximum(cost_model.floor, part_costs + cost_model.overhead), 0.0)
    order = np.argsort(-part_costs, kind="stable")
    microbatches: list[list[list[int]]] = [[] for _ in range(world_size)]
    busy = np.zeros(world_size)
    ranks_by_index = np.arange(world_size)
    for j in range(k):
        group = order[j * world_size : (j + 1) * world_size]  # costliest first
        ranks = np.lexsort((ranks_by_index, busy))  # least busy first (ties: lower rank)
        for p, rank in zip(group.tolist(), ranks.tolist()):
            microbatches[rank].append(parts[p])
        busy[ranks] += part_costs[group]
    return _make_plan("lb_micro", microbatches, doc_costs, cost_model, bound, heaviest_first=False)


def plan_lb_micro(
    lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel, *, truncate: bool = False
) -> Plan:
    """LB-Micro: equal microbatch count k on every rank, balanced per microbatch index (FSDP-compatible).

    k starts at ceil(total tokens / (W · budget)) and grows until W·k cost-balanced microbatches all
    fit the budget (so k is the smallest count for which this search finds a feasible split). The W·k
    microbatches are sorted by cost and cut into k groups of W (sorted grouping minimises Σ_j of the
    group maxima); inside a group the costliest microbatch goes to the rank with the least work so far,
    which also evens out per-rank totals.
    """
    world_size, eff = _validated(lengths, world_size, max_tokens_per_microbatch, truncate)
    return _lb_micro_priced(eff, world_size, max_tokens_per_microbatch, cost_model)


def _lb_micro_priced(eff, world_size, max_tokens_per_microbatch, cost_model) -> Plan:
    doc_costs, bound = _priced(eff, world_size, max_tokens_per_microbatch, cost_model)
    return _lb_micro(eff, world_size, max_tokens_per_microbatch, cost_model, doc_costs, bound)


def plan_none(
    lengths, world_size: int, max_tokens_per_microbatch: int, cost_model: CostModel, *, truncate: bool = False
) -> Plan:
    """No balancing: sample i to rank i mod W, packed in order, padded with dummies to equal counts."""
    world_size, eff = _validated(lengths, world_size, max_tokens_per_microbatch, truncate)
    return _none(eff, world_size, max_tokens_per_microbatch, cost_model)


def _none(eff, world_size, max_tokens_per_microbatch, cost_model) -> Plan:
    doc_costs, bound = _priced(eff, world_size, max_tokens_per_microbatch, cost_model)
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
    return _make_plan("none", microbatches, doc_costs, cost_model, bound, heaviest_first=False)


PLANNERS = {"lb_mini": plan_lb_mini, "lb_micro": plan_lb_micro, "none": plan_none}
"""Planner by sampler mode name."""

PLANNERS_ON_VALID_INPUT = {"lb_mini": _lb_mini, "lb_micro": _lb_micro_priced, "none": _none}
"""The same planners without the entry check: ``planner(effective_lengths, world_size, max_tokens, cost_model)``
for a caller that has validated its arguments with :func:`effective_lengths` and clipped the lengths to the budget."""
