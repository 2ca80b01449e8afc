"""A vectorized K-ary sum tree with float64 totals.

Leaves are priorities (already raised to alpha). A batch update writes the leaves,
then recomputes each touched parent from its children, level by level: recomputing
instead of adding deltas keeps the totals exact and makes duplicate indices
harmless. A batch search walks all queries down together.

The tree has no root: its top level is the widest one with at most ``TOP_NODES``
nodes (for a million leaves and K = 32: 1,024 nodes, then 32,768, then the leaves).
A search starts with one prefix sum over the top and one ``searchsorted`` for all
queries, which costs less than walking the two levels above it, and an update has
two fewer levels to refresh. Prefix sums are sequential loops (torch's CPU
``cumsum``, numpy's ``add.accumulate``), and therefore monotone for non-negative
values: a query never lands on a zero-priority child. Where torch is loaded (the
process that makes tensors) the prefix sums and per-node searches use it: ~5x
numpy's on rows of `ARITY`. Elsewhere (a Ray shard, which makes no tensor and would
pay ~2 CPU s and a few hundred MB to import torch: `arrowbuf._lazy_torch`) they use
numpy, with the same sums, in the same order.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

ARITY = 32
TOP_NODES = 1024


class SumTree:
    """Sum tree over ``size`` leaves.

    Example:
        >>> t = SumTree(5)
        >>> t.update(np.array([0, 3]), np.array([1.0, 3.0]))
        >>> t.total, t.find(np.array([0.5, 1.5])).tolist()
        (4.0, [0, 3])
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        top, depth = _shape(size)
        # levels[0] is the top (a prefix of ``top`` nodes); levels[-1] the leaves,
        # padded with zeros to ``top * ARITY ** depth``.
        self.levels = [np.zeros(top * ARITY ** d, np.float64) for d in range(depth + 1)]

    @property
    def total(self) -> float:
        return float(self.levels[0].sum())

    @property
    def leaves(self) -> np.ndarray:
        return self.levels[-1][:self.size]

    def state_dict(self) -> dict:
        """Every level (copies): restoring them, not re-summing, keeps totals bit-exact."""
        return {"size": self.size, "levels": [level.copy() for level in self.levels]}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` into a tree of the same size, or the leaves of a smaller one
        into this tree's first leaves (a checkpoint of a version whose arena had fewer rows:
        before capacity counted transitions).

        Raises:
            ValueError: a tree of another size or shape.
        """
        levels = state["levels"]
        if int(state["size"]) < self.size and levels and len(levels[-1]) >= int(state["size"]):
            leaves = np.asarray(levels[-1][:int(state["size"])], np.float64)
            self.levels = [np.zeros_like(level) for level in self.levels]
            held = np.flatnonzero(leaves)
            self.update(held, leaves[held])
            return
        if int(state["size"]) != self.size or [len(x) for x in levels] != [len(x) for x in self.levels]:
            raise ValueError(f"sum tree state has {state['size']} leaves in levels of "
                             f"{[len(x) for x in levels]} nodes; this tree has {self.size} leaves in "
                             f"{[len(x) for x in self.levels]} (a checkpoint from another tree layout)")
        self.levels = [np.array(level, np.float64) for level in levels]

    def update(self, index: np.ndarray, value: np.ndarray) -> None:
        """Set leaves ``index`` to ``value`` (the last one wins for duplicates)."""
        self.levels[-1][index] = value
        index = np.asarray(index, np.int64)
        for level in range(len(self.levels) - 2, -1, -1):
            index = index // ARITY
            children = self.levels[level + 1].reshape(-1, ARITY)
            self.levels[level][index] = children.take(index, axis=0).sum(axis=1)

    def fill(self, start: int, stop: int, value: float) -> None:
        """Set leaves ``[start, stop)`` to ``value``."""
        if stop <= start:
            return
        self.levels[-1][start:stop] = value
        for level in range(len(self.levels) - 2, -1, -1):
            start //= ARITY
            stop = (stop - 1) // ARITY + 1
            children = self.levels[level + 1][start * ARITY:stop * ARITY].reshape(-1, ARITY)
            self.levels[level][start:stop] = children.sum(axis=1)

    def find(self, mass: np.ndarray) -> np.ndarray:
        """Leaf index holding each prefix ``mass`` in ``[0, total)``; never a zero leaf."""
        mass = np.array(mass, np.float64)
        node = _choose(_cumsum(self.levels[0]), mass)
        for level in self.levels[1:]:
            node = node * ARITY + _choose(_cumsum(level.reshape(-1, ARITY).take(node, axis=0)), mass)
        return node


def _shape(size: int) -> tuple[int, int]:
    """(nodes of the top level, levels below it) of a tree of ``size`` leaves."""
    top, depth = size, 0
    while top > TOP_NODES:
        top = -(-top // ARITY)
        depth += 1
    return top, depth


def leaves_at_depth(size: int) -> int:
    """The most leaves a tree as deep as one of ``size`` leaves holds: a search walks one level
    per ``ARITY``-fold, so a tree that grows into this many costs nothing more per search."""
    return TOP_NODES * ARITY ** _shape(size)[1]


def _cumsum(values: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums along the last axis, in order: torch's where it is loaded, else numpy's."""
    torch = sys.modules.get("torch")
    if torch is None:
        return np.cumsum(values, axis=-1)
    return torch.cumsum(torch.from_numpy(values), values.ndim - 1).numpy()


def _choose(cumulative: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """Per query, the child whose prefix interval holds ``mass``; ``mass`` becomes the rest.

    ``cumulative`` holds inclusive prefix sums: one row shared by every query (1-D)
    or one row per query (2-D).
    """
    # Rounding can put a query at or past its node's total: keep it just below,
    # so it never lands on the empty children after the last non-empty one.
    np.minimum(mass, np.nextafter(cumulative[..., -1], 0.0), out=mass)
    if cumulative.ndim == 1:
        choice = np.searchsorted(cumulative, mass, side="right")
        before = cumulative.take(choice - 1)
    else:
        torch = sys.modules.get("torch")
        if torch is None:   # each row's count of prefix sums <= its query: searchsorted(side="right")
            choice = np.count_nonzero(cumulative <= mass[:, None], axis=1)
        else:
            choice = torch.searchsorted(torch.from_numpy(cumulative), torch.from_numpy(mass[:, None]),
                                        right=True).numpy().reshape(-1)
        before = cumulative.reshape(-1).take(_row_starts(len(mass), cumulative.shape[1]) + choice)
    mass -= before * (choice > 0)   # choice 0 reads the previous row's last entry: zeroed
    return choice


@functools.lru_cache(maxsize=16)
def _row_starts(rows: int, width: int) -> np.ndarray:
    """Flat index of the entry before each row of a (rows, width) array."""
    return np.arange(rows, dtype=np.int64) * width - 1
