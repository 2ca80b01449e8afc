"""The sum tree against a plain numpy reference: updates, fills, totals and searches."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrowbuf._sumtree import ARITY, TOP_NODES, SumTree

# Multiples of 1/4 add up exactly in float64, so tree and reference agree to the bit.
dyadic = st.integers(0, 12).map(lambda k: k / 4)


@st.composite
def operations(draw, size):
    kind = draw(st.sampled_from(["update", "fill"]))
    if kind == "update":
        index = draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=20))
        values = draw(st.lists(dyadic, min_size=len(index), max_size=len(index)))
        return "update", np.array(index, np.int64), np.array(values, np.float64)
    start = draw(st.integers(0, size))
    stop = draw(st.integers(0, size))
    return "fill", start, stop, draw(dyadic)


@st.composite
def trees(draw):
    size = draw(st.one_of(st.integers(1, 40), st.integers(TOP_NODES - 40, TOP_NODES + 80),
                            st.integers(TOP_NODES * ARITY - 40, TOP_NODES * ARITY + 80)))
    ops = draw(st.lists(operations(size), min_size=1, max_size=12))
    return size, ops


def apply(tree, reference, op):
    if op[0] == "update":
        _, index, values = op
        tree.update(index, values)
        for i, v in zip(index.tolist(), values.tolist()):  # duplicates: the last one wins
            reference[i] = v
    else:
        _, start, stop, value = op
        tree.fill(start, stop, value)
        reference[start:max(start, stop)] = value


def check_levels_are_sums_of_children(tree):
    for parent, children in zip(tree.levels[:-1], tree.levels[1:]):
        np.testing.assert_array_equal(parent, children.reshape(-1, ARITY).sum(axis=1))


def expected_leaf(reference, mass):
    """The leaf whose interval [cumsum[i-1], cumsum[i]) contains ``mass``."""
    return np.searchsorted(np.cumsum(reference), mass, side="right")


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(0, 2**32 - 1))
def test_tree_matches_a_numpy_reference_after_random_updates_and_fills(case, seed):
    size, ops = case
    tree = SumTree(size)
    reference = np.zeros(size)
    for op in ops:
        apply(tree, reference, op)
        np.testing.assert_array_equal(tree.leaves, reference)
        assert tree.total == reference.sum()
        check_levels_are_sums_of_children(tree)
        assert not tree.levels[-1][size:].any(), "padding leaves past size must stay zero"
    if tree.total == 0:
        return
    cumulative = np.cumsum(reference)
    rng = np.random.default_rng(seed)
    # Random masses, every interval boundary and the largest mass below the total.
    boundaries = np.unique(cumulative[cumulative < tree.total])
    mass = np.concatenate([rng.random(200) * tree.total, [0.0], boundaries, [np.nextafter(tree.total, 0)]])
    found = tree.find(mass)
    np.testing.assert_array_equal(found, expected_leaf(reference, mass))
    assert (reference[found] > 0).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40_000), st.integers(0, 2**32 - 1))
def test_find_of_random_masses_lands_in_the_interval_holding_the_mass(size, seed):
    rng = np.random.default_rng(seed)
    values = rng.exponential(size=size) * (rng.random(size) < 0.6)
    values[rng.integers(size)] = rng.exponential() + 1e-3  # at least one non-zero leaf
    tree = SumTree(size)
    tree.update(np.arange(size), values)
    assert tree.total == pytest.approx(values.sum(), rel=1e-12)
    mass = np.concatenate([rng.random(500) * tree.total, [0.0, np.nextafter(tree.total, 0)]])
    found = tree.find(mass)
    assert (values[found] > 0).all(), "find returned a zero leaf"
    cumulative = np.cumsum(values)
    tolerance = 1e-9 * tree.total
    assert (cumulative[found] - values[found] - tolerance <= mass).all()
    assert (mass < cumulative[found] + tolerance).all()


def test_find_never_returns_a_zero_leaf_between_non_zero_ones():
    tree = SumTree(100)
    tree.update(np.array([3, 40, 99]), np.array([1.0, 2.0, 1.0]))
    mass = np.array([0.0, 0.999, 1.0, 2.5, 3.0, 3.999])
    assert tree.find(mass).tolist() == [3, 3, 40, 40, 99, 99]


def test_duplicate_indices_in_one_update_keep_the_last_value_and_exact_totals():
    tree = SumTree(70)
    tree.update(np.array([5, 5, 64, 5]), np.array([1.0, 2.0, 4.0, 8.0]))
    assert tree.leaves[5] == 8.0
    assert tree.total == 12.0
    check_levels_are_sums_of_children(tree)


def test_fill_then_clear_a_range_leaves_the_rest_untouched():
    tree = SumTree(2000)
    tree.fill(0, 2000, 0.5)
    tree.fill(1000, 1500, 0.0)
    assert tree.total == 750.0
    assert tree.find(np.array([499.75, 500.0])).tolist() == [999, 1500]
    check_levels_are_sums_of_children(tree)


def test_a_tree_needs_at_least_one_leaf():
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        SumTree(0)


@pytest.mark.parametrize("size", [37, TOP_NODES * ARITY + 77])
def test_a_process_without_torch_finds_the_same_leaves_with_numpy(size, monkeypatch):
    """A Ray shard never imports torch (`arrowbuf._lazy_torch`): its searches use numpy's prefix sums
    and per-row counts, which must land every query on the leaf torch's cumsum and searchsorted give."""
    rng = np.random.default_rng(size)
    tree = SumTree(size)
    priorities = rng.lognormal(0.0, 2.0, size) * (rng.random(size) < 0.8)   # zeros among them
    tree.update(np.arange(size), priorities)
    mass = rng.random(4096) * tree.total
    mass[:3] = [0.0, np.nextafter(tree.total, 0.0), tree.total]   # the ends, and the rounding guard
    with_torch = tree.find(mass)
    monkeypatch.delitem(sys.modules, "torch")
    without = tree.find(mass)
    np.testing.assert_array_equal(without, with_torch)
    assert (priorities[without] > 0).all()
