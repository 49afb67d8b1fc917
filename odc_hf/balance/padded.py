"""Padded microbatches (TRL's GRPO layout): which samples each rank trains, in which padded microbatches.

GRPO trains on padded rows (prompts left-padded, completions right-padded), so a microbatch of r rows costs r times
its widest row, not the sum of its samples. :func:`plan_padded` splits a generation batch over ranks by cost and
packs each rank's share into the fewest padded microbatches within the token budget (:func:`pack_padded`); the
trainer (``odc_hf.integrations.trl.grpo_trainer``) and the benchmark (``benchmarks/grpo/e2e.py``) both plan with it. Pure
functions of the lengths: every rank computes the same plan alone.
"""

from __future__ import annotations

import numpy as np

from .partition import karmarkar_karp, refine
from .plan import Plan
from .planner import PLANNERS

__all__ = ["PaddedPrices", "pack_padded", "padded_microbatch_width", "padded_width", "plan_padded"]


def pack_padded(share, lengths, budget: int, cost_model=None, *, prompts=None, multiple: int = 1) -> list[list[int]]:
    """Pack one rank's samples into padded microbatches (TRL's layout) of rows x longest <= ``budget`` tokens.

    Fewest microbatches first (each one costs at least a launch-bound floor on a GPU), then, among the layouts with
    that count, the least predicted cost of the padded microbatches (``cost_model.microbatch_cost([longest] *
    rows)``; padded tokens when ``cost_model`` is None). Exact: with the samples sorted by length (descending, ties
    by index) some best layout cuts the sorted order into consecutive runs (giving each microbatch of a layout the
    next-longest samples never raises its longest), and a dynamic programme over the cut points finds it. So it
    never has more microbatches than any other padded layout of the same samples within the budget (e.g. first-fit
    decreasing by tokens, then splitting). A pure function of the lengths; a sample longer than the budget gets a
    microbatch of its own. Returns index lists, longest microbatch first.

    ``prompts`` (prompt length per sample, so completion = length - prompt) makes the budget exact for TRL's
    layout, where rows are padded to the longest prompt *plus* the longest completion (more than the longest
    sample when they come from different samples), rounded up to ``multiple`` columns (the GRPO trainer rounds to
    128 on CUDA, see ``odc_hf.integrations.trl.grpo_batch``): the cut points are then chosen by :func:`_padded_runs_wide`
    on those widths (still the fewest microbatches, then the cheapest, among cuts of the sorted order).
    """
    return [mb for mb, _ in _pack(share, lengths, PaddedPrices(cost_model, budget), prompts, multiple)]


def _pack(share, lengths, prices, prompts=None, multiple: int = 1) -> list[tuple[list[int], int]]:
    """:func:`pack_padded` with the caller's price cache: (microbatch, padded width) pairs."""
    order = sorted(share, key=lambda i: (-lengths[i], i))
    if prompts is None:
        runs = _padded_runs([lengths[i] for i in order], prices)[2]
        return [(order[a:b], lengths[order[a]]) for a, b in runs]
    pairs = [(int(prompts[i]), int(lengths[i]) - int(prompts[i])) for i in order]
    return [(order[a:b], width) for a, b, width in _padded_runs_wide(pairs, prices, multiple)[2]]


def _padded_runs_wide(pairs, prices, multiple: int = 1) -> tuple[int, float, list[tuple[int, int, int]]]:
    """(count, cost, [(start, end, width), ...]) of the best cut of (prompt, completion) pairs into padded microbatches.

    Width of a run = longest prompt + longest completion, rounded up to ``multiple``. It only grows as a run takes
    more samples, so the runs from i that fit end at the first sample that breaks the budget (a sample always fits
    alone). Same dynamic programme as :func:`_padded_runs` (:func:`_cut_at`), with a width per run length.
    """
    n, budget, multiple = len(pairs), prices.budget, max(1, multiple)
    count, cost, cut = [0] * (n + 1), [0.0] * (n + 1), [n] * (n + 1)
    widths_at = [()] * n
    for i in range(n - 1, -1, -1):
        widths, prompt, completion = [], 0, 0
        for p, c in pairs[i:]:
            prompt, completion = max(prompt, p), max(completion, c)
            width = prompt + completion
            width += -width % multiple  # padded_width, inlined: this loop is the planner's hot path
            if widths and (len(widths) + 1) * width > budget:
                break
            widths.append(width)
        _cut_at(i, len(widths), lambda rows, w=widths: prices(w[rows - 1], rows)[rows], count, cost, cut)
        widths_at[i] = widths
    return count[0], cost[0], [(a, b, widths_at[a][b - a - 1]) for a, b in _runs(cut)]


def _cut_at(i: int, rows: int, price, count: list, cost: list, cut: list) -> None:
    """One step of the cut DP: the best first run from sample i, of at most ``rows`` samples (``price(r)``: r rows).

    ``count[j]`` (fewest microbatches for the samples from j on) never grows with j, so the runs that reach the
    fewest count from i are the longest ones: scan down from the longest run while it holds, keep the cheapest
    (ties: fewer rows).
    """
    fewest, best, best_j = count[i + rows], float("inf"), i + rows
    for r in range(rows, 0, -1):
        j = i + r
        if count[j] != fewest:
            break
        c = cost[j] + price(r)
        if c <= best:
            best, best_j = c, j
    count[i], cost[i], cut[i] = fewest + 1, best, best_j


def _runs(cut: list[int]) -> list[tuple[int, int]]:
    """The (start, end) runs of a filled cut table, from sample 0."""
    runs, i = [], 0
    while i < len(cut) - 1:
        runs.append((i, cut[i]))
        i = cut[i]
    return runs


def padded_microbatch_width(prompts, completions, multiple: int = 1) -> int:
    """Columns of TRL's padded layout for samples with these prompt / completion lengths (rounded to ``multiple``)."""
    prompt = max(prompts)
    return prompt + padded_width(prompt, max(completions), multiple)


class PaddedPrices:
    """``prices(longest, rows)[r]``: the cost of r rows padded to ``longest`` (r = 0..rows), cached per length."""

    def __init__(self, cost_model, budget: int):
        self.cost_model, self.budget, self.table = cost_model, int(budget), {}

    def max_rows(self, longest: int) -> int:
        return max(1, self.budget // max(longest, 1))

    def __call__(self, longest: int, rows: int) -> list[float]:
        prices = self.table.get(longest)
        if prices is None or len(prices) <= rows:
            if self.cost_model is None:
                unit, price = float(longest), float
            else:  # microbatch_cost([longest] * r) = price(r * doc cost)
                unit, price = float(self.cost_model.doc_costs([longest])[0]), self.cost_model.price
            prices = [0.0] + [price(r * unit) for r in range(1, max(rows, 2 * len(prices or ())) + 1)]
            self.table[longest] = prices
        return prices


def _padded_runs(descending: list[int], prices: PaddedPrices) -> tuple[int, float, list[tuple[int, int]]]:
    """(count, cost, [(start, end), ...]) of the best cut of ``descending`` lengths into padded microbatches.

    Dynamic programme over the cut points (:func:`_cut_at`, inlined); a run is as wide as its first sample. Same
    result as :func:`_padded_runs_wide` with no prompt part (checked on random inputs), kept because the rank
    balancing's local search calls it thousands of times and the width bookkeeping there doubles planning time.
    """
    n = len(descending)
    count, cost, cut = [0] * (n + 1), [0.0] * (n + 1), [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        longest = descending[i]
        rows = min(n - i, prices.max_rows(longest))
        row_price = prices(longest, rows)
        # _cut_at, inlined: the call per sample costs 10-15 % of plan_padded's time (256 samples, 8 ranks)
        fewest, best, best_j = count[i + rows], float("inf"), i + rows
        for r in range(rows, 0, -1):
            j = i + r
            if count[j] != fewest:
                break
            c = cost[j] + row_price[r]
            if c <= best:
                best, best_j = c, j
        count[i], cost[i], cut[i] = fewest + 1, best, best_j
    return count[0], cost[0], _runs(cut)


# The rebalancing's local search stops after this many samples' worth of layout evaluations (each evaluation of a
# rank's layout counts its samples): a deterministic bound on its work (under a second), not a quality knob.
_SEARCH_WORK = 200_000


def _balance_padded(shares: list[list[int]], lengths: list[int], prices: PaddedPrices) -> list[list[int]]:
    """Rank shares balanced by their *padded* cost (the cost of their :func:`pack_padded` layouts).

    Two starts: the planner's shares, and the padded microbatches of all samples (one :func:`_padded_runs` over the
    whole generation batch: least padding) dealt to ranks by Karmarkar-Karp + refinement on their costs. The one
    whose busiest rank is cheaper (then: lower total) is polished by a local search: moves and swaps of samples
    (distinct lengths; equal lengths are interchangeable) between the busiest rank and the others; the change that
    leaves the pair least busy (then with the lowest pair total) is applied while both end below the busiest rank's
    cost. Deterministic (ties: lower rank, first candidate), bounded by ``_SEARCH_WORK``.
    """
    world = len(shares)
    memo: dict[tuple[int, ...], float] = {}
    work = 0

    def rank_cost(lens) -> float:
        nonlocal work
        key = tuple(sorted(lens, reverse=True))
        if key not in memo:
            work += len(key)
            memo[key] = _padded_runs(list(key), prices)[1]
        return memo[key]

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    runs = [order[a:b] for a, b in _padded_runs([lengths[i] for i in order], prices)[2]]
    run_costs = np.array([prices(lengths[run[0]], len(run))[len(run)] for run in runs])
    parts = refine(karmarkar_karp(run_costs, world), run_costs)
    dealt = [[i for k in part for i in runs[k]] for part in parts]

    def score(candidate):
        loads = [rank_cost([lengths[i] for i in s]) for s in candidate]
        return max(loads), sum(loads)

    shares = [sorted(s) for s in min(([list(s) for s in shares], dealt), key=score)]
    lens = [[lengths[i] for i in s] for s in shares]
    loads = [rank_cost(x) for x in lens]

    def without(values, x):
        out = list(values)
        out.remove(x)
        return out

    while work < _SEARCH_WORK:
        hi = min(range(world), key=lambda r: (-loads[r], r))
        best = None  # ((pair max, pair total), partner, length x from hi, length y from the partner or None)
        for lo in sorted((r for r in range(world) if r != hi), key=lambda r: (loads[r], r)):
            hi_lengths, lo_lengths = sorted(set(lens[hi]), reverse=True), sorted(set(lens[lo]), reverse=True)
            swaps = [(x, y) for x in hi_lengths for y in lo_lengths if x != y]
            changes = [(x, None) for x in hi_lengths] + swaps
            for x, y in changes:
                a = rank_cost(without(lens[hi], x) + ([] if y is None else [y]))
                b = rank_cost((lens[lo] if y is None else without(lens[lo], y)) + [x])
                key = (max(a, b), a + b)
                if key[0] < loads[hi] * (1 - 1e-9) and (best is None or key < best[0]):
                    best = (key, lo, x, y)
                if work >= _SEARCH_WORK:
                    break
            if work >= _SEARCH_WORK:
                break
        if best is None:
            break
        _, lo, x, y = best
        i = max(k for k in shares[hi] if lengths[k] == x)  # which of equal lengths changes rank: the last
        shares[hi].remove(i)
        if y is not None:
            j = max(k for k in shares[lo] if lengths[k] == y)
            shares[lo].remove(j)
            shares[hi].append(j)
        shares[lo].append(i)
        for r in (hi, lo):
            shares[r].sort()
            lens[r] = [lengths[k] for k in shares[r]]
            loads[r] = rank_cost(lens[r])
    return shares


def plan_padded(
    lengths, world_size: int, budget: int, cost_model, balance: str = "lb_mini", *, prompts=None, multiple: int = 1
) -> Plan:
    """ODC's GRPO layout, one function for the trainer and the benchmark: each rank's padded microbatches.

    ``PLANNERS[balance]`` (over prompt + completion lengths) decides which samples each rank gets; with ``lb_mini``
    the shares are then balanced by their cost as padded (:func:`_balance_padded`; the planner prices packed rows,
    but GRPO microbatches are padded). Each rank's whole share is packed by :func:`pack_padded`: fewest
    microbatches of rows x longest <= ``budget``, then the least padded cost. The :class:`Plan` holds those
    microbatches (costliest first) and their padded costs; its ``lower_bound`` is the planner's. A pure function of
    its arguments: every rank computes the same plan alone, and every sample is in exactly one microbatch.

    Pass ``prompts`` (and the column ``multiple`` the collator pads to) to hold the budget for the real padded width
    (longest prompt + longest completion, rounded): the final packing and the plan's costs then use it; the rank
    balancing still prices rows by the longest sample, an approximation.
    """
    lengths = [int(x) for x in lengths]
    plan = PLANNERS[balance](lengths, world_size, budget, cost_model)
    shares = [sorted(i for mb in mbs for i in mb) for mbs in plan.microbatches]
    prices = PaddedPrices(cost_model, budget)
    if balance == "lb_mini" and world_size > 1:
        shares = _balance_padded(shares, lengths, prices)
    microbatches, costs = [], []
    for share in shares:
        packed = _pack(share, lengths, prices, prompts, multiple)
        mbs = [mb for mb, _ in packed]
        priced = [prices(width, len(mb))[len(mb)] for mb, width in packed]
        ranked = sorted(range(len(mbs)), key=lambda k: (-priced[k], k))
        microbatches.append([mbs[k] for k in ranked])
        costs.append([priced[k] for k in ranked])
    return Plan(mode=plan.mode, microbatches=microbatches, microbatch_costs=costs, lower_bound=plan.lower_bound,
                cost_model=plan.cost_model)  # fmt: skip


def padded_width(prompt: int, completion: int, multiple: int = 1) -> int:
    """Completion columns of a padded microbatch whose longest prompt/completion are ``prompt``/``completion``."""
    return completion + (-(prompt + completion)) % max(1, multiple)
