"""`FreshnessSampler`: draws weighted toward steps of recent policy versions.

A step's *lag* is the newest ``policy_version`` the store holds (on a Ray store: across
all its shards) minus its own. The sampler draws a step with probability proportional
to ``0.5 ** (lag / half_life)`` (TorchRL's `StalenessAwareSampler` weights by freshness
too), and never one whose lag exceeds ``max_lag`` when that is given (a hard staleness
window). Steps of one version are equally likely.

The draw needs no per-step weights: the live steps are kept as *runs* of one version
(a whole episode when its least and greatest versions agree, else the runs of its steps,
read once), built from per-episode version bounds (`runs_of`: a local shard's, kept by
`arrowbuf._version_spans`, or a Ray reader's view's, `arrowbuf.ray.fresh`), and rebuilt
when episodes are added or evicted. A draw picks a run by its weight (its steps times
its version's weight) and a step inside it uniformly: O(batch log runs) (`select`).
``min_version`` (a store's ``sample(..., min_version=v)``) drops the runs below ``v`` first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from arrowbuf._version_spans import episode_versions, kept_spans, shard_bounds
from arrowbuf.errors import EmptyStoreError
from arrowbuf.samplers import Sampler, Selection
from arrowbuf.table import EpisodeTable
from arrowbuf.versions import no_fresh


@dataclass(frozen=True)
class Runs:
    """Live steps as runs of one version: run k covers ``count[k]`` steps from ``step0[k]``
    of the episode at live position ``pos[k]``, all of version ``version[k]``."""

    pos: np.ndarray
    step0: np.ndarray
    count: np.ndarray
    version: np.ndarray


def version_runs(shard: Any) -> Runs:
    """The runs of one version of ``shard``'s live sealed steps (kept until the table changes)."""
    bounds = shard_bounds(shard)
    # dropped with the spans when the table changes
    return kept_spans(bounds.spans, "runs", lambda: runs_of(shard.table, bounds.low, bounds.high,
                                                             episode_versions(shard)))


def runs_of(table: EpisodeTable, low: np.ndarray, high: np.ndarray, values_of: Callable[[int], np.ndarray]) -> Runs:
    """The runs of one version of ``table``'s live episodes, given each one's least and
    greatest version and ``values_of(p)``, the versions of episode ``p``'s steps (read only
    for an episode whose version changed mid-way). A local shard's and a Ray reader's view alike."""
    length = table.col("length")
    some = length > 0
    flat = np.flatnonzero(some & (low == high))
    pos, step0, count, version = [flat], [np.zeros(len(flat), np.int64)], [length[flat]], [low[flat]]
    for p in np.flatnonzero(some & (low != high)).tolist():
        values = values_of(p)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(values)) + 1])
        stops = np.concatenate([starts[1:], [len(values)]])
        pos.append(np.full(len(starts), p))
        step0.append(starts)
        count.append(stops - starts)
        version.append(values[starts])
    return Runs(*(np.concatenate(part).astype(np.int64) for part in (pos, step0, count, version)))


class FreshnessSampler(Sampler):
    """Draws weighted toward fresh steps: ``P(step) ~ 0.5 ** (lag / half_life)``, where lag
    is the newest policy version held (by any shard) minus the step's (see the module docstring).

    Args:
        half_life: versions of lag that halve a step's weight (> 0; ``inf``: uniform).
        max_lag: steps lagging more than this many versions are never drawn (None: no bound).

    Raises:
        ValueError: a bad ``half_life`` or ``max_lag``.

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=100, sampler=ab.FreshnessSampler(half_life=1.0, max_lag=1), seed=0)
        >>> for version in range(3):
        ...     _ = store.add_episode({"obs": np.zeros((5, 2)), "action": np.zeros(4),
        ...                            "terminated": np.arange(4) == 3}, policy_version=version)
        >>> sorted(set(store.sample(64)["policy_version"].tolist()))
        [1, 2]
    """

    def __init__(self, half_life: float = 1.0, max_lag: int | None = None) -> None:
        super().__init__()
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not half_life > 0:
            raise ValueError(f"half_life must be a number > 0 (versions of lag that halve a step's weight), "
                             f"got {half_life!r}")
        if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, (int, np.integer))
                                    or max_lag < 0):
            raise ValueError(f"max_lag must be an int >= 0 or None, got {max_lag!r}")
        self.half_life = float(half_life)
        self.max_lag = None if max_lag is None else int(max_lag)

    def weights(self, lag: np.ndarray) -> np.ndarray:
        """The weight of a step of each ``lag`` (0 beyond ``max_lag``)."""
        lag = np.asarray(lag, np.float64)
        weight = np.exp2(-lag / self.half_life) if math.isfinite(self.half_life) else np.ones_like(lag)
        return weight if self.max_lag is None else np.where(lag <= self.max_lag, weight, 0.0)

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable,
               min_version: int | None = None) -> Selection:
        """``n`` steps drawn by freshness (only of version >= ``min_version`` when given).

        Raises:
            EmptyStoreError: no step may be drawn.
        """
        if self.bound_shard is None:
            raise ValueError(f"{self!r} is not bound to a store")
        runs = version_runs(self.bound_shard)
        if not len(runs.count):
            raise EmptyStoreError("cannot sample: the store holds no sealed transition")
        selection = self.select(rng, n, runs, table, min_version)
        if selection is None:   # only a min_version past every step
            raise no_fresh(min_version, int(runs.version.max()))
        return selection

    def select(self, rng: np.random.Generator, n: int, runs: Runs, table: EpisodeTable,
               min_version: int | None = None, newest: int | None = None) -> Selection | None:
        """``n`` steps of ``runs`` (of ``table``'s live episodes) drawn by freshness, the lag
        counted from ``newest`` (None: the newest of ``runs``; a Ray reader drawing from some
        shards passes the newest of all); None when no step may be drawn."""
        if not len(runs.count):
            return None
        newest = int(runs.version.max()) if newest is None else newest
        weight = runs.count * self.weights(newest - runs.version)
        if min_version is not None:
            weight = np.where(runs.version >= min_version, weight, 0.0)
        total = np.cumsum(weight)
        if not total[-1] > 0:
            return None
        # The run of each draw (a draw rounded up to the total: the last run with weight).
        last = int(np.flatnonzero(weight > 0)[-1])
        k = np.minimum(total.searchsorted(rng.random(n) * total[-1], "right"), last)
        offset = np.minimum((rng.random(n) * runs.count[k]).astype(np.int64), runs.count[k] - 1)
        pos = runs.pos.take(k)
        step = runs.step0.take(k) + offset
        rows = table.col("first_row").take(pos) + step
        indices = table.col("first_index").take(pos) + step
        if table.pieces:   # the step within the episode of a piece that continues one
            step = step + table.col("first_step").take(pos)
        return Selection(rows, indices, pos, {}, step)

    def config(self) -> dict:
        return {"half_life": self.half_life, "max_lag": self.max_lag}

    def __repr__(self) -> str:
        return f"FreshnessSampler(half_life={self.half_life}, max_lag={self.max_lag})"
