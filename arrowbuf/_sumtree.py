"""A vectorized K-ary sum tree with float64 totals.

Leaves are priorities (already raised to alpha). A batch update writes the leaves,
then recomputes each touched parent from its children, level by level: recomputing
instead of adding deltas keeps the totals exact and makes duplicate indices
harmless. A batch search walks all queries down together. With K = 32 a tree of a
million leaves is 4 levels deep, so both cost a handful of numpy calls.
"""

from __future__ import annotations

import numpy as np

ARITY = 32


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
        depth = 1
        while ARITY ** depth < size:
            depth += 1
        # levels[0] is the root; levels[-1] the leaves, padded with zeros.
        self.levels = [np.zeros(ARITY ** d, np.float64) for d in range(depth + 1)]

    @property
    def total(self) -> float:
        return float(self.levels[0][0])

    @property
    def leaves(self) -> np.ndarray:
        return self.levels[-1][:self.size]

    def state_dict(self) -> dict:
        """Every level (copies): restoring them, not re-summing, keeps totals bit-exact."""
        return {"size": self.size, "levels": [level.copy() for level in self.levels]}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` into a tree of the same size.

        Raises:
            ValueError: a tree of another size or shape.
        """
        levels = state["levels"]
        if int(state["size"]) != self.size or [len(x) for x in levels] != [len(x) for x in self.levels]:
            raise ValueError(f"sum tree state is for {state['size']} leaves, this tree has {self.size}")
        self.levels = [np.array(level, np.float64) for level in levels]

    def update(self, index: np.ndarray, value: np.ndarray) -> None:
        """Set leaves ``index`` to ``value`` (the last one wins for duplicates)."""
        self.levels[-1][index] = value
        self._refresh(np.asarray(index, np.int64))

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

    def _refresh(self, index: np.ndarray) -> None:
        for level in range(len(self.levels) - 2, -1, -1):
            index = index // ARITY
            children = self.levels[level + 1].reshape(-1, ARITY)
            self.levels[level][index] = children[index].sum(axis=1)

    def find(self, mass: np.ndarray) -> np.ndarray:
        """Leaf index holding each prefix ``mass`` in ``[0, total)``; never a zero leaf."""
        mass = np.array(mass, np.float64)
        node = np.zeros(len(mass), np.int64)
        rows = np.arange(len(mass))
        for level in self.levels[1:]:
            cumulative = np.cumsum(level.reshape(-1, ARITY)[node], axis=1)
            # Rounding can put a query at or past its node's total: keep it just below,
            # so it never lands on the empty children after the last non-empty one.
            np.minimum(mass, np.nextafter(cumulative[:, -1], 0.0), out=mass)
            choice = (cumulative <= mass[:, None]).sum(axis=1)
            mass -= np.where(choice > 0, cumulative[rows, np.maximum(choice - 1, 0)], 0.0)
            node = node * ARITY + choice
        return node
