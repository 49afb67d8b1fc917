"""Partitioners: complete, deterministic, and good."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_hf.balance.partition import karmarkar_karp, lpt, part_sums, refine

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
    from odc_hf.balance.partition import karmarkar_karp_labels, labels_to_parts

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


def _reference_ldm_sums(costs, k):
    """Largest differencing, written plainly: every item starts as a k-tuple (its cost, then zeros); the two tuples
    of largest spread (largest minus smallest subset) merge, heaviest subset of one with lightest of the other;
    the last tuple's subset sums, ascending."""
    tuples = [[c] + [0.0] * (k - 1) for c in sorted(costs, reverse=True)]
    while len(tuples) > 1:
        tuples.sort(key=lambda t: -(t[0] - t[-1]))  # stable: ties in creation order
        a, b = tuples.pop(0), tuples.pop(0)
        tuples.append(sorted((a[j] + b[k - 1 - j] for j in range(k)), reverse=True))
    return sorted(tuples[0])


@pytest.mark.parametrize("k", [2, 3, 5])
def test_karmarkar_karp_is_largest_differencing(k):
    rng = np.random.default_rng(k)
    for _ in range(5):
        costs = rng.lognormal(0, 1, 40)  # fewer than the starting-tuple cap: the textbook method, item by item
        got = sorted(part_sums(karmarkar_karp(costs, k), costs))
        assert got == pytest.approx(_reference_ldm_sums(costs.tolist(), k), rel=1e-12)


def test_one_part_or_no_items_label_every_item_zero_as_integers():
    from odc_hf.balance.partition import karmarkar_karp_labels

    for costs, k in (([3.0, 1.0, 2.0], 1), ([], 4)):
        labels = karmarkar_karp_labels(costs, k)
        assert labels.dtype == np.int64 and labels.tolist() == [0] * len(costs)


def _reference_refine_sums(parts, costs, swap_partners=8, tolerance=1e-5):
    """refine's rule as its docstring states it, written plainly for real-valued costs without ties: each round the
    heaviest part h; the best of every move of one of its items to the lightest part and every swap of one of its
    items with an item of one of the ``swap_partners`` lightest other parts, by the larger of the two new sums,
    applied only if below sum(h); stop within ``tolerance`` of max(total / parts, largest item), or when no change
    helps. Returns the part sums, ascending."""
    k = len(parts)
    parts = [list(p) for p in parts]
    bound = (1 + tolerance) * max(sum(costs) / k, max(costs))
    for _ in range(4 * (len(costs) + k)):
        sums = [sum(costs[i] for i in p) for p in parts]
        h = max(range(k), key=lambda q: (sums[q], -q))
        if sums[h] <= bound:
            break
        light = min(range(k), key=lambda q: (sums[q], q))
        best = (sums[h], None)
        for x in parts[h]:
            if light != h:
                value = max(sums[h] - costs[x], sums[light] + costs[x])
                if value < best[0]:
                    best = (value, ("move", x, light))
        lightest = sorted(range(k), key=lambda q: (sums[q], q))[: swap_partners + 1]
        for p in (q for q in lightest if q != h):
            for x in parts[h]:
                for y in parts[p]:
                    d = costs[x] - costs[y]
                    value = max(sums[h] - d, sums[p] + d)
                    if value < best[0]:
                        best = (value, ("swap", x, y, p))
        if best[1] is None:
            break
        change = best[1]
        parts[h].remove(change[1])
        if change[0] == "move":
            parts[change[2]].append(change[1])
        else:
            parts[change[3]].remove(change[2])
            parts[change[3]].append(change[1])
            parts[h].append(change[2])
    return sorted(sum(costs[i] for i in p) for p in parts)


@pytest.mark.parametrize("k", [2, 3, 12])
def test_refine_follows_its_stated_rule(k):
    rng = np.random.default_rng(10 + k)
    for _ in range(4):
        costs = rng.lognormal(0, 1, 3 * k + 5).tolist()
        start = [list(range(p, len(costs), k)) for p in range(k)]  # a poor start: dealt round robin
        start[0] += start[-1][:2]  # the first part overloaded
        start[-1] = start[-1][2:]
        got = sorted(part_sums(refine(start, costs), costs))
        assert got == pytest.approx(_reference_refine_sums(start, costs), rel=1e-12)


def test_bad_costs_are_named_in_full():
    with pytest.raises(ValueError, match=r"^costs must be 1-D, got shape \(2, 2\)$"):
        karmarkar_karp([[1.0, 2.0], [3.0, 4.0]], 2)
    for bad in ([1.0, float("nan")], [1.0, -1.0], [float("inf")]):
        with pytest.raises(ValueError, match=r"^costs must be finite and >= 0$"):
            lpt(bad, 2)


def test_refine_fills_empty_last_parts():
    """Parts left empty at the end of the list are parts too: refine moves items into them."""
    assert sorted(part_sums(refine([[0, 1, 2, 3], [], []], [1.0, 1.0, 1.0, 1.0]), [1.0] * 4)) == [1.0, 1.0, 2.0]
