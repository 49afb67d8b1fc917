"""Partitioners: complete, deterministic, and good."""

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_hf.balance.partition import (
    karmarkar_karp,
    karmarkar_karp_labels,
    labels_to_parts,
    lpt,
    part_sums,
    refine,
    refine_labels,
)

costs_strategy = st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=0, max_size=80)


def assert_is_partition(parts, n, k):
    assert len(parts) == k
    flat = sorted(i for part in parts for i in part)
    assert flat == list(range(n))


@settings(max_examples=60, deadline=None)
@given(costs=costs_strategy, k=st.integers(1, 12))
def test_every_item_lands_in_exactly_one_part(costs, k):
    for parts in (karmarkar_karp(costs, k), lpt(costs, k), refine(karmarkar_karp(costs, k), costs)):
        assert_is_partition(parts, len(costs), k)


@settings(max_examples=60, deadline=None)
@given(costs=costs_strategy, k=st.integers(1, 12))
def test_refine_never_raises_the_maximum(costs, k):
    for start in (karmarkar_karp(costs, k), lpt(costs, k)):
        before = part_sums(start, costs).max(initial=0)
        after = part_sums(refine(start, costs), costs).max(initial=0)
        assert after <= before + 1e-9 * max(before, 1)


@settings(max_examples=30, deadline=None)
@given(costs=costs_strategy, k=st.integers(1, 12))
def test_partitions_depend_on_the_values_only(costs, k):
    """Every rank partitions alone: the result may depend on the cost values, not on the container they come in
    (a list on one rank, an array on another), and the caller's costs are left as they were."""
    as_array, as_tuple = np.array(costs, dtype=np.float64), tuple(costs)
    kept = list(costs)
    expected = karmarkar_karp(costs, k)
    assert karmarkar_karp(as_array, k) == expected and karmarkar_karp(as_tuple, k) == expected
    assert refine(lpt(as_array, k), as_array) == refine(lpt(as_tuple, k), as_tuple) == refine(lpt(costs, k), costs)
    assert list(costs) == kept and as_array.tolist() == kept


def test_refinement_fixes_a_classic_differencing_miss():
    costs = [8, 7, 6, 5, 4]  # LDM gives 16/14; the optimum is 15/15
    assert sorted(part_sums(karmarkar_karp(costs, 2), costs)) == [14, 16]
    assert sorted(part_sums(refine(karmarkar_karp(costs, 2), costs), costs)) == [15, 15]


def test_ties_are_broken_by_index():
    # Pinned: equal costs are taken in index order, so every rank (and every release) splits them the same way.
    assert karmarkar_karp([1, 1, 1, 1], 2) == [[0, 3], [1, 2]]
    assert karmarkar_karp([1, 1, 1, 1, 1, 1], 3) == [[2, 4], [0, 5], [1, 3]]
    assert lpt([1, 1, 1, 1], 2) == [[0, 2], [1, 3]]


def test_more_parts_than_items_leaves_parts_empty():
    parts = karmarkar_karp([5, 3], 4)
    assert_is_partition(parts, 2, 4)
    assert sorted(len(p) for p in parts) == [0, 0, 1, 1]


def test_large_minibatch_is_balanced_to_a_tiny_fraction():
    rng = np.random.default_rng(0)
    costs = rng.lognormal(10, 1.0, size=4096)
    sums = part_sums(refine(karmarkar_karp(costs, 64), costs), costs)
    assert sums.max() <= costs.sum() / 64 * (1 + 1e-4)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="num_parts"):
        karmarkar_karp([1.0], 0)
    with pytest.raises(ValueError, match=">= 0"):
        lpt([1.0, -2.0], 2)
    with pytest.raises(ValueError, match="more than one part"):
        refine([[0, 1], [1]], [1.0, 2.0])
    with pytest.raises(ValueError, match="in no part"):
        refine([[0], []], [1.0, 2.0])


# -- properties stated by the docstrings, each killing mutants that the tests above let live -------------------------
def _reference_lpt(costs, k):
    """The docstring's rule, written plainly: items by decreasing cost, ties by lower index, each to the lightest
    part (ties: lower part index)."""
    loads, parts = [0.0] * k, [[] for _ in range(k)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        p = min(range(k), key=lambda q: (loads[q], q))
        parts[p].append(item)
        loads[p] += costs[item]
    return [sorted(p) for p in parts]


def test_lpt_is_largest_first_with_ties_in_index_order():
    # many equal costs: an unstable sort (numpy's default) deals them to other parts; smallest-first loses balance
    costs = np.random.default_rng(0).integers(1, 4, 100).astype(float).tolist()
    for k in (2, 3, 7):
        assert lpt(costs, k) == _reference_lpt(costs, k), k
    assert max(part_sums(lpt([1, 1, 2], 2), [1, 1, 2])) == 2  # largest first: {2}, {1, 1}


def test_part_sums_are_float64_and_an_empty_part_weighs_nothing():
    sums = part_sums([[0, 1], [], [2]], [2, 3, 4])  # integer costs in, float sums out (compared with tolerances)
    assert sums.dtype == np.float64 and sums.tolist() == [5.0, 0.0, 4.0]


def test_karmarkar_karp_reads_its_labels_for_every_cap_on_starting_tuples():
    costs = np.random.default_rng(1).lognormal(0, 1, 300)
    capped = labels_to_parts(karmarkar_karp_labels(costs, 4, max_tuples=64), 4)
    assert karmarkar_karp(costs, 4, max_tuples=64) == capped
    assert capped != karmarkar_karp(costs, 4)  # the cap changes this split: the comparison above can see it


def test_refine_honours_its_round_limit_and_tolerance():
    costs = [8, 7, 6, 5, 4]
    start = karmarkar_karp(costs, 2)  # 16 / 14; one move or swap makes it 15 / 15
    assert refine(start, costs, max_rounds=0) == [sorted(p) for p in start]  # no round: nothing changes
    assert refine(start, costs, tolerance=1.0) == [sorted(p) for p in start]  # 16 is within 100% of the bound 15
    assert sorted(part_sums(refine(start, costs, max_rounds=1), costs)) == [15, 15]


def test_refine_names_what_is_wrong_with_the_parts():
    with pytest.raises(ValueError, match="^refine needs at least one part$"):
        refine([], [1.0])
    with pytest.raises(ValueError, match=r"^item 2 is out of range or appears in more than one part$"):
        refine([[0, 1, 2]], [1.0, 1.0])  # index == number of items: out of range
    with pytest.raises(ValueError, match=r"^items \[1, 2, 3, 4, 5, 6, 7, 8, 9, 10\] are in no part$"):
        refine([[0]], [1.0] * 13)  # the first ten of the twelve missing ones; item 0 (in part 0) is not among them


def _reference_ldm_labels(costs, k, max_tuples):
    """Largest differencing as karmarkar_karp_labels' docstring states it, written plainly with sets: items by
    decreasing cost (ties: lower index first), g = min(k, ceil(n / max_tuples)) consecutive items per starting k-tuple
    (one per subset, the rest empty); the two tuples of largest spread (heaviest minus lightest subset; ties: the
    earlier made) merge, heaviest subset of one with lightest of the other, and the merged subsets are ordered by
    sum, heaviest first (ties: in pairing order). An item's label is the position of its subset in the last tuple."""
    n = len(costs)
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    g = min(k, -(-n // max_tuples))
    heap = []  # (-spread, made, sums, subsets)
    for made, start in enumerate(range(0, n, g)):
        members = order[start : start + g]
        sums = [costs[i] for i in members] + [0.0] * (k - len(members))
        subsets = [{i} for i in members] + [set() for _ in range(k - len(members))]
        heap.append((-(sums[0] - sums[-1]), made, sums, subsets))
    heapq.heapify(heap)
    made = len(heap)
    while len(heap) > 1:
        _, _, sums_a, sets_a = heapq.heappop(heap)
        _, _, sums_b, sets_b = heapq.heappop(heap)
        paired = sorted(
            ((sums_a[j] + sums_b[k - 1 - j], sets_a[j] | sets_b[k - 1 - j]) for j in range(k)), key=lambda t: -t[0]
        )
        sums, subsets = [t[0] for t in paired], [t[1] for t in paired]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), made, sums, subsets))
        made += 1
    labels = [0] * n
    for position, subset in enumerate(heap[0][3] if heap else []):
        for i in subset:
            labels[i] = position
    return labels


@pytest.mark.parametrize("k", [2, 3, 5])
def test_karmarkar_karp_is_largest_differencing(k):
    rng = np.random.default_rng(k)
    for _ in range(5):
        costs = rng.lognormal(0, 1, 40)  # fewer than the starting-tuple cap: the textbook method, item by item
        assert karmarkar_karp_labels(costs, k).tolist() == _reference_ldm_labels(costs.tolist(), k, 64)


@pytest.mark.parametrize("k", [2, 3, 5, 20])
def test_karmarkar_karp_follows_its_stated_rule_on_equal_costs_and_capped_starts(k):
    """Integer costs (many ties between items and between subset sums: with more than 16 items or parts an unstable
    sort would reorder them) and caps on the starting tuples that group 2, 3 or k items: the labels are the
    reference's, item for item."""
    rng = np.random.default_rng(30 + k)
    for n, max_tuples in ((40, 64), (90, 64), (90, 40), (90, 30), (7 * k + 3, (7 * k + 3) // k)):
        costs = rng.integers(0, 5, n).astype(float).tolist()
        assert karmarkar_karp_labels(costs, k, max_tuples=max_tuples).tolist() == _reference_ldm_labels(
            costs, k, max_tuples
        ), (n, max_tuples)


@pytest.mark.parametrize(("n", "k"), [(2731, 3), (65, 127), (300, 4)])
def test_karmarkar_karps_default_cap_is_8192_over_parts_and_at_least_64(n, k):
    """The default cap on starting tuples as documented, max(64, 8192 // num_parts), at the sizes where one more or
    one less changes the grouping (2731 items over 3 parts, 65 items over 127 parts)."""
    costs = np.random.default_rng(n).integers(1, 50, n).astype(float).tolist()
    assert karmarkar_karp_labels(costs, k).tolist() == _reference_ldm_labels(costs, k, max(64, 8192 // k))


def test_one_part_or_no_items_label_every_item_zero_as_integers():
    for costs, k in (([3.0, 1.0, 2.0], 1), ([], 4)):
        labels = karmarkar_karp_labels(costs, k)
        assert labels.dtype == np.int64 and labels.tolist() == [0] * len(costs)


def _reference_refine(parts, costs, tolerance=1e-5, partners=9, swap_on_ties=False):
    """refine's rule as its docstring states it, written plainly (ties included): each round the heaviest part h; the
    best move of one of its items to the lightest part and the best swap of one of its items with an item of one of
    the ``partners`` lightest other parts (by sum, then index), the first in item order among equals; the swap only if
    strictly better than the move (``swap_on_ties``: also if equal), and either only if it lowers sum(h) by more than
    1e-12 of the largest cost. It stops within ``tolerance`` of max(total / parts, largest item), the edge included,
    when no change helps, or after 4 (items + parts) rounds. Returns the item indices per part, ascending."""
    k = len(parts)
    parts = [sorted(p) for p in parts]
    bound = (1 + tolerance) * max(float(np.sum(costs)) / k, max(costs))
    eps = 1e-12 * max(max(costs), 1e-300)
    for _ in range(4 * (len(costs) + k)):
        sums = [sum(costs[i] for i in p) for p in parts]
        h = max(range(k), key=lambda q: (sums[q], -q))
        if sums[h] <= bound:
            break
        light = min(range(k), key=lambda q: (sums[q], q))
        move = (float("inf"), None)
        for x in parts[h] if light != h else []:
            value = max(sums[h] - costs[x], sums[light] + costs[x])
            if value < move[0]:
                move = (value, (x, None))
        swap = (float("inf"), None)
        lightest = [q for q in sorted(range(k), key=lambda q: (sums[q], q))[:partners] if q != h]
        label = {y: q for q in lightest for y in parts[q]}
        for x in parts[h]:
            for y in sorted(label):
                d = costs[x] - costs[y]
                value = max(sums[h] - d, sums[label[y]] + d)
                if value < swap[0]:
                    swap = (value, (x, y))
        best = swap if swap[0] < move[0] or (swap_on_ties and swap[0] == move[0]) else move
        if best[1] is None or not best[0] < sums[h] - eps:
            break
        x, y = best[1]
        p = light if y is None else label[y]
        parts[h].remove(x)
        parts[p].append(x)
        if y is not None:
            parts[p].remove(y)
            parts[h].append(y)
        parts = [sorted(q) for q in parts]
    return parts


def _poor_start(n, k):
    start = [list(range(p, n, k)) for p in range(k)]  # dealt round robin, then the first part overloaded
    start[0] += start[-1][:2]
    start[-1] = start[-1][2:]
    return start


@pytest.mark.parametrize("k", [2, 3, 12])
def test_refine_follows_its_stated_rule(k):
    rng = np.random.default_rng(10 + k)
    for _ in range(4):
        costs = rng.lognormal(0, 1, 3 * k + 5).tolist()
        start = _poor_start(len(costs), k)
        assert refine(start, costs) == _reference_refine(start, costs)


def _random_split(rng, n, k):
    return [sorted(part.tolist()) for part in np.array_split(rng.permutation(n), k)]


@pytest.mark.parametrize("k", [2, 5, 11, 20, 32])
def test_refine_follows_its_stated_rule_on_equal_costs(k):
    """Integer costs: many parts and changes tie, so the rule's order (the first change of the smallest value, the
    swap only when strictly better than the move, partners by sum then index among the 9 lightest: with 20 parts
    and more, equal sums straddle the 9th, where an unstable sort would pick others) decides. Controls: the same
    rule with 7 or 10 swap partners or with swaps taken on ties gives other parts on some of these runs, so the
    comparison sees a partner count off by one or a ``<=`` for a ``<``."""
    runs = []
    for seed in range(40, 50):
        rng = np.random.default_rng(seed)
        costs = rng.integers(1, 6, 4 * k + 7).astype(float).tolist()
        start = _random_split(rng, len(costs), k)
        got = refine(start, costs)
        assert got == _reference_refine(start, costs)
        runs.append((start, costs, got))
    if k >= 20:  # more than 9 other parts: the partner count can matter
        for partners in (7, 10):
            assert any(_reference_refine(start, costs, partners=partners) != got for start, costs, got in runs)
    assert any(_reference_refine(start, costs, swap_on_ties=True) != got for start, costs, got in runs)


def test_bad_costs_are_named_in_full():
    with pytest.raises(ValueError, match=r"^costs must be 1-D, got shape \(2, 2\)$"):
        karmarkar_karp([[1.0, 2.0], [3.0, 4.0]], 2)
    for bad in ([1.0, float("nan")], [1.0, -1.0], [float("inf")]):
        with pytest.raises(ValueError, match=r"^costs must be finite and >= 0$"):
            lpt(bad, 2)


def test_refine_fills_empty_last_parts():
    """Parts left empty at the end of the list are parts too: refine moves items into them."""
    assert sorted(part_sums(refine([[0, 1, 2, 3], [], []], [1.0, 1.0, 1.0, 1.0]), [1.0] * 4)) == [1.0, 1.0, 2.0]


def test_costs_of_any_numeric_type_partition_as_their_values():
    """Token counts often come as unsigned integers (numpy arrays of lengths, zeros included): a partitioner that
    negated or subtracted them before converting would wrap around (-0 stays 0 and sorts first; 5 - 10 is 65531 in
    uint16). Every entry point reads them as float64 values."""
    counts = np.random.default_rng(3).integers(0, 5000, 70)
    counts[::7] = 0
    as_float = counts.astype(np.float64)
    for dtype in (np.uint16, np.uint32, np.uint64, np.int32):
        costs = counts.astype(dtype)
        for k in (2, 3, 8):
            assert karmarkar_karp(costs, k) == karmarkar_karp(as_float, k)
            assert lpt(costs, k) == lpt(as_float, k)
            start = _random_split(np.random.default_rng(k), len(costs), k)
            assert refine(start, costs) == refine(start, as_float)
        sums = part_sums([[0, 1], [2]], costs)
        assert sums.dtype == np.float64 and sums.tolist() == [float(counts[0] + counts[1]), float(counts[2])]
    # one part of 300005 tokens, the other of 10: swapping the 5 for the 10 would look like a gain of 65531 in uint16
    small = np.array([3000] * 100 + [5, 10], dtype=np.uint16)
    start = [list(range(101)), [101]]
    assert refine(start, small) == refine(start, small.astype(np.float64))


def test_refine_labels_is_refine_on_labels():
    """The planner calls refine_labels with its defaults: the same tolerance and rounds as refine, and int64 labels
    back (what karmarkar_karp_labels gives) whatever integer type came in."""
    costs = np.array([8.0, 7.0, 6.0, 5.0, 4.0])
    labels = karmarkar_karp_labels(costs, 2)  # 16 / 14: the default tolerance (1e-5 of the bound 15) refines it
    refined = refine_labels(labels.astype(np.int32), costs, 2)
    assert refined.dtype == np.int64
    assert labels_to_parts(refined, 2) == refine(labels_to_parts(labels, 2), costs)
    assert sorted(np.bincount(refined, weights=costs).tolist()) == [15.0, 15.0]


@pytest.mark.parametrize("scale", [1e3, 1e-3])
def test_a_refining_step_must_gain_more_than_1e_12_of_the_largest_cost(scale):
    """Two parts {1, c, c} and {1} (times ``scale``): moving one c lowers the heavier part by exactly c. Made when c is
    5x the threshold 1e-12 x largest cost, not made at the threshold itself nor at half of it, at costs far above
    and far below 1."""
    for c_rel, moved in ((5e-12, True), (1e-12, False), (5e-13, False)):
        c = c_rel * scale
        costs = [scale, c, c, scale]
        got = refine([[0, 1, 2], [3]], costs, tolerance=0.0)
        assert (got != [[0, 1, 2], [3]]) == moved, (scale, c_rel)


def test_refine_stops_at_the_tolerance_edge_itself():
    """Bound max(6 / 2, 2.5) = 3, tolerance 0.5: the heaviest part at exactly 1.5 x 3 = 4.5 is good enough."""
    costs = [2.5, 2.0, 1.0, 0.5]
    assert refine([[0, 1], [2, 3]], costs, tolerance=0.5) == [[0, 1], [2, 3]]
    assert refine([[0, 1], [2, 3]], costs, tolerance=0.49) != [[0, 1], [2, 3]]  # just inside: refined


def test_refine_with_more_parts_than_items_spreads_them():
    """Fewer items than parts: each item ends alone (the first of the heaviest part moves to the lightest part of
    lowest index), and the parts left over stay empty."""
    assert refine([[0, 1], [], []], [1.0, 1.0]) == [[1], [0], []]
    assert refine([[0, 1, 2], [], [], []], [1.0, 1.0, 1.0]) == [[2], [0], [1], []]
