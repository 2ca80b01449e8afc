"""`FreshnessSampler`: draws weighted toward steps of recent policy versions.

A step's *lag* is the newest ``policy_version`` the shard holds minus its own. The
sampler draws a step with probability proportional to ``0.5 ** (lag / half_life)``
(TorchRL's `StalenessAwareSampler` weights by freshness too), and never one whose lag
exceeds ``max_lag`` when that is given (a hard staleness window). Steps of one version
are equally likely.

The draw needs no per-step weights: the live steps are kept as *runs* of one version
(a whole episode when its least and greatest versions agree, else the runs of its steps,
read once), built from the per-episode version bounds `arrowbuf._version_spans`
keeps, and rebuilt when episodes are added or evicted. A draw picks a run by its
weight (its steps times its version's weight) and a step inside it uniformly: O(batch
log runs). ``min_version`` (a store's ``sample(..., min_version=v)``) drops the runs
below ``v`` first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from arrowbuf._version_spans import _column, _refresh
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
    bounds = _refresh(shard)
    runs = bounds.spans.get("runs")   # dropped with the spans when the table changes
    if runs is not None:
        return runs
    table = shard.table
    length, first_row = table.col("length"), table.col("first_row")
    some = length > 0
    flat = np.flatnonzero(some & (bounds.low == bounds.high))
    pos, step0, count, version = [flat], [np.zeros(len(flat), np.int64)], [length[flat]], [bounds.low[flat]]
    column = _column(shard)
    for p in np.flatnonzero(some & (bounds.low != bounds.high)).tolist():
        values = np.asarray(column[np.arange(first_row[p], first_row[p] + length[p])]).reshape(-1)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(values)) + 1])
        stops = np.concatenate([starts[1:], [len(values)]])
        pos.append(np.full(len(starts), p))
        step0.append(starts)
        count.append(stops - starts)
        version.append(values[starts])
    runs = Runs(*(np.concatenate(part).astype(np.int64) for part in (pos, step0, count, version)))
    bounds.spans["runs"] = runs   # type: ignore[index]
    return runs


class FreshnessSampler(Sampler):
    """Draws weighted toward fresh steps: ``P(step) ~ 0.5 ** (lag / half_life)``, where lag
    is the newest policy version held minus the step's (see the module docstring).

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
        if self._shard is None:
            raise ValueError(f"{self!r} is not bound to a store")
        runs = version_runs(self._shard)
        if not len(runs.count):
            raise EmptyStoreError("cannot sample: the store holds no sealed transition")
        newest = int(runs.version.max())
        weight = runs.count * self.weights(newest - runs.version)
        if min_version is not None:
            weight = np.where(runs.version >= min_version, weight, 0.0)
        total = np.cumsum(weight)
        if not total[-1] > 0:   # only a min_version past every step
            raise no_fresh(min_version, newest)
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
