"""Multiway number partitioning: split items with costs into ``num_parts`` groups of similar total.

- :func:`karmarkar_karp`: the largest differencing method (LDM) for k parts. Every item starts as a
  k-tuple of subsets (the item alone, k-1 empty); the two tuples with the largest spread (max - min
  subset sum) are merged by pairing the heaviest subset of one with the lightest of the other, until
  one tuple is left. Committing the big differences early is what makes LDM much better than greedy.
- :func:`lpt`: longest processing time first, the classic greedy; cheaper, a fallback and baseline.
- :func:`refine`: local search on any partition: moves and swaps between the heaviest part and the
  others while they lower the heavier part of the pair. Never makes the partition worse.

All three are deterministic (stable sorts, ties broken by item index then part index), so every rank
computes the same partition from the same costs without communicating.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = [
    "karmarkar_karp",
    "karmarkar_karp_labels",
    "labels_to_parts",
    "lpt",
    "part_sums",
    "refine",
    "refine_labels",
]

# A refinement step must lower the pair's maximum by more than this fraction of the largest cost,
# so floating-point noise cannot make it loop.
_RELATIVE_TOLERANCE = 1e-12
# Swaps are searched with the _SWAP_PARTNERS + 1 lightest parts, the heaviest left out when it is among
# them (bounds a round's work to O((n/k)^2)).
_SWAP_PARTNERS = 8


def _validate(costs, num_parts: int) -> np.ndarray:
    arr = np.asarray(costs, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {arr.shape}")
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        raise ValueError("costs must be finite and >= 0")
    if int(num_parts) != num_parts or num_parts < 1:
        raise ValueError(f"num_parts must be a positive integer, got {num_parts}")
    return arr


def part_sums(parts: Sequence[Sequence[int]], costs) -> np.ndarray:
    """Total cost of each part."""
    costs = np.asarray(costs, dtype=np.float64)
    return np.array([costs[list(part)].sum() if len(part) else 0.0 for part in parts])


def lpt(costs, num_parts: int) -> list[list[int]]:
    """Greedy: items by decreasing cost (ties: lower index first) to the currently lightest part."""
    costs = _validate(costs, num_parts)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, p) for p in range(num_parts)]  # (load, part index): ties go to the lower part index
    for item in np.argsort(-costs, kind="stable").tolist():
        load, p = heapq.heappop(heap)
        parts[p].append(item)
        heapq.heappush(heap, (load + costs[item], p))
    return [sorted(part) for part in parts]


def _initial_tuples(order: np.ndarray, k: int, max_tuples: int) -> list[np.ndarray]:
    """Items (sorted by decreasing cost) -> the item ids of each starting k-tuple.

    Textbook LDM starts every item alone (n tuples, n - 1 merges). Past ``max_tuples`` items,
    consecutive items in sorted order start together, g = ceil(n / max_tuples) <= k per tuple (one per
    subset), which bounds the merges. Uniform groups matter: mixing large singletons with groups of
    small items leaves the singletons' imbalance to tuples whose small spreads cannot undo it.
    """
    group = min(k, -(-order.size // max_tuples))
    return [order[i : i + group] for i in range(0, order.size, group)]


def karmarkar_karp_labels(costs, num_parts: int, *, max_tuples: int | None = None) -> np.ndarray:
    """Largest differencing method; returns the part of each item (part 0 has the largest sum).

    Each tuple is kept as (subset sums sorted descending, subset ids aligned with them). Merging
    pairs A's subsets heaviest-first with B's lightest-first, then re-sorts: one argsort of k numbers.
    Which items a subset holds is tracked with union-find over item ids (an item's id names the
    subset it started in), so a merge costs O(k log k) array work and no list copying.
    ``max_tuples`` (default 8192 // num_parts, at least 64) caps the number of starting tuples,
    see :func:`_initial_tuples`.
    """
    costs = _validate(costs, num_parts)
    n, k = costs.size, int(num_parts)
    if n == 0 or k == 1:
        return np.zeros(n, dtype=np.int64)
    if max_tuples is None:
        max_tuples = max(64, 8192 // k)
    order = np.argsort(-costs, kind="stable")
    parent = np.arange(n)
    heap = []  # (-spread, creation counter, sums, ids); the counter breaks ties deterministically
    for counter, members in enumerate(_initial_tuples(order, k, max_tuples)):
        sums = np.zeros(k)
        sums[: members.size] = costs[members]
        ids = np.full(k, -1)
        ids[: members.size] = members
        heap.append((-(sums[0] - sums[-1]), counter, sums, ids))
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, sums_a, ids_a = heapq.heappop(heap)
        _, _, sums_b, ids_b = heapq.heappop(heap)
        merged = sums_a + sums_b[::-1]
        ids_b = ids_b[::-1]
        both = (ids_a >= 0) & (ids_b >= 0)
        parent[ids_b[both]] = ids_a[both]
        ids = np.where(ids_a >= 0, ids_a, ids_b)
        order = np.argsort(-merged, kind="stable")
        merged, ids = merged[order], ids[order]
        heapq.heappush(heap, (-(merged[0] - merged[-1]), counter, merged, ids))
        counter += 1
    ids = heap[0][3]
    # resolve every item to its root subset by pointer jumping (log depth rounds, all vectorised)
    while True:
        grand = parent[parent]
        if np.array_equal(grand, parent):
            break
        parent = grand
    slot_of_root = np.full(n, -1)
    valid = ids >= 0
    slot_of_root[ids[valid]] = np.nonzero(valid)[0]
    return slot_of_root[parent]


def labels_to_parts(labels: np.ndarray, num_parts: int) -> list[list[int]]:
    """Part label per item -> item indices per part, ascending."""
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(num_parts + 1)).tolist()
    items = order.tolist()  # one conversion, then list slices: per-part .tolist() dominated at 16k parts
    return [items[bounds[p] : bounds[p + 1]] for p in range(num_parts)]


def karmarkar_karp(costs, num_parts: int, *, max_tuples: int | None = None) -> list[list[int]]:
    """Largest differencing method for ``num_parts`` parts: item indices per part, heaviest part first."""
    labels = karmarkar_karp_labels(costs, num_parts, max_tuples=max_tuples)
    return labels_to_parts(labels, int(num_parts))


def refine(
    parts: Sequence[Sequence[int]], costs, *, max_rounds: int | None = None, tolerance: float = 1e-5
) -> list[list[int]]:
    """Improve a partition by moves/swaps that lower the heaviest part; returns item indices per part.

    Each round takes the heaviest part h (lowest index among ties) and, over all moves of one of its
    items into the lightest part (lowest index among ties) and all swaps of one of its items with an
    item of one of the 9 lightest other parts p (by sum, then index), picks the change minimising
    max(new sum of h, new sum of p): the first in item order among equals, a swap only if strictly
    better than the best move. It is applied only if that lowers sum(h) by more than 1e-12 of the
    largest cost. The sorted vector of part sums then decreases lexicographically,
    so the loop ends. It also stops once the heaviest part is within ``tolerance`` (relative) of the
    trivial bound max(total / parts, largest item), and after ``max_rounds`` (default 4·(items + parts)).
    """
    costs = np.asarray(costs, dtype=np.float64)
    k = len(parts)
    if k == 0:
        raise ValueError("refine needs at least one part")
    labels = np.full(costs.size, -1)
    for p, part in enumerate(parts):
        for item in part:
            if not 0 <= item < costs.size or labels[item] != -1:
                raise ValueError(f"item {item} is out of range or appears in more than one part")
            labels[item] = p
    if np.any(labels < 0):
        raise ValueError(f"items {np.nonzero(labels < 0)[0].tolist()[:10]} are in no part")
    return labels_to_parts(refine_labels(labels, costs, k, max_rounds=max_rounds, tolerance=tolerance), k)


def refine_labels(
    labels: np.ndarray,
    costs: np.ndarray,
    num_parts: int,
    *,
    max_rounds: int | None = None,
    tolerance: float = 1e-5,
) -> np.ndarray:
    """:func:`refine` on a part label per item (returns new labels)."""
    labels = np.array(labels, dtype=np.int64)
    k = num_parts
    if k == 1 or costs.size == 0:
        return labels
    sums = np.bincount(labels, weights=costs, minlength=k)
    eps = _RELATIVE_TOLERANCE * max(float(costs.max()), 1e-300)
    good_enough = (1.0 + tolerance) * max(float(costs.sum()) / k, float(costs.max()))
    rounds = max_rounds if max_rounds is not None else 4 * (costs.size + k)
    for _ in range(rounds):
        h = int(np.argmax(sums))
        if sums[h] <= good_enough:
            break
        light = int(np.argmin(sums))
        in_h = np.nonzero(labels == h)[0]
        best_value, best_change = sums[h] - eps, None
        # moves: x from h to the lightest part
        if light != h and in_h.size:
            values = np.maximum(sums[h] - costs[in_h], sums[light] + costs[in_h])
            i = int(np.argmin(values))
            if values[i] < best_value:
                best_value, best_change = values[i], (int(in_h[i]), None)
        # swaps: x in h with y in one of the lightest parts p; new sums h - (x - y) and p + (x - y).
        # The pair's max can't drop below (sum h + sum p) / 2, so light partners are where gains are.
        partners = np.argsort(sums, kind="stable")[: _SWAP_PARTNERS + 1]
        others = np.nonzero(np.isin(labels, partners[partners != h]))[0]
        if in_h.size and others.size:
            delta = costs[in_h][:, None] - costs[others][None, :]
            values = np.maximum(sums[h] - delta, sums[labels[others]][None, :] + delta)
            i, j = divmod(int(np.argmin(values)), others.size)
            if values[i, j] < best_value:
                best_value, best_change = values[i, j], (int(in_h[i]), int(others[j]))
        if best_change is None:
            break
        x, y = best_change
        p = light if y is None else int(labels[y])
        labels[x] = p
        moved = costs[x]
        if y is not None:
            labels[y] = h
            moved -= costs[y]
        sums[h] -= moved
        sums[p] += moved
    return labels
