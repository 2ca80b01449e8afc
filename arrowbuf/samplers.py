"""Samplers: pure, vectorized selection of transition ranks; they never touch data.

A sampler draws *ranks* (see `arrowbuf.table`): live transitions hold one
contiguous range of ranks, so uniform sampling costs O(batch) whatever the
capacity or the number of episodes.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from arrowbuf.table import EpisodeTable


def uniform_ranks(rng: np.random.Generator, n: int, first_rank: int, stop_rank: int) -> np.ndarray:
    """``n`` ranks drawn uniformly with replacement from ``[first_rank, stop_rank)``."""
    return rng.integers(first_rank, stop_rank, size=n, dtype=np.int64)


def epoch_ranks(rng: np.random.Generator, batch_size: int, first_rank: int, stop_rank: int,
                shuffle: bool = True, drop_last: bool = False) -> Iterator[np.ndarray]:
    """Every rank of ``[first_rank, stop_rank)`` once, in batches of ``batch_size``."""
    ranks = np.arange(first_rank, stop_rank, dtype=np.int64)
    if shuffle:
        rng.shuffle(ranks)
    stop = len(ranks) - len(ranks) % batch_size if drop_last else len(ranks)
    for start in range(0, stop, batch_size):
        yield ranks[start:start + batch_size]


class UniformSampler:
    """Uniform sampling with replacement over stored transitions (the default).

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=100, sampler=ab.UniformSampler(), seed=0)
        >>> _ = store.add_episode({"obs": np.zeros((4, 2)), "action": np.zeros(3)})
        >>> store.sample(5)["index"].shape
        torch.Size([5])
    """

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable) -> np.ndarray:
        """``n`` live ranks of ``table``, uniform with replacement."""
        return uniform_ranks(rng, n, table.first_live_rank, table.next_rank)

    def __repr__(self) -> str:
        return "UniformSampler()"
