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

__all__ = ["karmarkar_karp", "lpt", "refine", "part_sums"]

# A refinement step must lower the pair's maximum by more than this fraction of the largest cost,
# so floating-point noise cannot make it loop.
_RELATIVE_TOLERANCE = 1e-12


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


def karmarkar_karp(costs, num_parts: int) -> list[list[int]]:
    """Largest differencing method for ``num_parts`` parts; returns item indices per part.

    Each tuple is kept as (subset sums sorted descending, subset ids aligned with them). Merging
    pairs A's subsets heaviest-first with B's lightest-first, then re-sorts: one argsort of k numbers.
    Which items a subset holds is tracked with union-find over item ids (an item's id names the
    subset it started in), so a merge costs O(k) array work and no list copying; that keeps 4096
    items x 64 parts well under 100 ms.
    """
    costs = _validate(costs, num_parts)
    n, k = costs.size, int(num_parts)
    if n == 0:
        return [[] for _ in range(k)]
    parent = np.arange(n)
    # heap entries: (-spread, creation counter, sums, ids); the counter breaks ties deterministically
    heap = []
    for item in np.argsort(-costs, kind="stable").tolist():
        sums = np.zeros(k)
        sums[0] = costs[item]
        ids = np.full(k, -1)
        ids[0] = item
        heap.append((-costs[item], item, sums, ids))
    heapq.heapify(heap)
    counter = n
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
    _, _, _, ids = heap[0]
    # resolve every item to its root subset by pointer jumping (log depth rounds, all vectorised)
    while True:
        grand = parent[parent]
        if np.array_equal(grand, parent):
            break
        parent = grand
    slot_of_root = np.full(n, -1)
    valid = ids >= 0
    slot_of_root[ids[valid]] = np.nonzero(valid)[0]
    slots = slot_of_root[parent]
    order = np.argsort(slots, kind="stable")  # items ascending within each part
    bounds = np.searchsorted(slots[order], np.arange(k + 1))
    return [order[bounds[p] : bounds[p + 1]].tolist() for p in range(k)]


def refine(parts: Sequence[Sequence[int]], costs, *, max_rounds: int | None = None) -> list[list[int]]:
    """Improve a partition by moves/swaps that lower the heavier part of a pair (the heaviest part).

    Each round looks at the heaviest part h (lowest index among ties) and picks, over all single
    moves out of h into the lightest part and all swaps of one item of h with one item of another
    part p, the change that minimises max(new sum of h, new sum of p); it is applied only if that is
    strictly below sum(h). The multiset of part sums then decreases lexicographically, so the loop
    ends; ``max_rounds`` (default 4·(items + parts)) bounds the work anyway.
    """
    costs = np.asarray(costs, dtype=np.float64)
    k = len(parts)
    if k == 0:
        raise ValueError("refine needs at least one part")
    assignment = np.full(costs.size, -1)
    for p, part in enumerate(parts):
        for item in part:
            if not 0 <= item < costs.size or assignment[item] != -1:
                raise ValueError(f"item {item} is out of range or appears in more than one part")
            assignment[item] = p
    if np.any(assignment < 0):
        raise ValueError(f"items {np.nonzero(assignment < 0)[0].tolist()[:10]} are in no part")
    if k == 1 or costs.size == 0:
        return [sorted(int(i) for i in part) for part in parts]
    sums = np.bincount(assignment, weights=costs, minlength=k)
    eps = _RELATIVE_TOLERANCE * max(float(costs.max()), 1e-300)
    rounds = max_rounds if max_rounds is not None else 4 * (costs.size + k)
    for _ in range(rounds):
        h = int(np.argmax(sums))
        light = int(np.argmin(sums))
        in_h = np.nonzero(assignment == h)[0]
        best_value, best_change = sums[h] - eps, None
        # moves: item x from h to the lightest part
        if light != h and in_h.size:
            values = np.maximum(sums[h] - costs[in_h], sums[light] + costs[in_h])
            i = int(np.argmin(values))
            if values[i] < best_value:
                best_value, best_change = values[i], (int(in_h[i]), None)
        # swaps: x in h with y in p != h; new sums h - (x - y) and p + (x - y)
        others = np.nonzero(assignment != h)[0]
        if in_h.size and others.size:
            delta = costs[in_h][:, None] - costs[others][None, :]
            values = np.maximum(sums[h] - delta, sums[assignment[others]][None, :] + delta)
            flat = int(np.argmin(values))
            i, j = divmod(flat, others.size)
            if values[i, j] < best_value:
                best_value, best_change = values[i, j], (int(in_h[i]), int(others[j]))
        if best_change is None:
            break
        x, y = best_change
        if y is None:
            assignment[x] = light
            sums[h] -= costs[x]
            sums[light] += costs[x]
        else:
            p = int(assignment[y])
            assignment[x], assignment[y] = p, h
            sums[h] += costs[y] - costs[x]
            sums[p] += costs[x] - costs[y]
    return [np.nonzero(assignment == p)[0].tolist() for p in range(k)]
