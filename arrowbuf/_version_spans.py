"""The transitions of ``policy_version >= v`` as spans of steps, for draws without rejection.

`arrowbuf.versions` draws fresh steps uniformly among the qualifying ones. Rejection
(draw from all, keep the fresh) pays a locate and a version look-up per discarded
draw and a second gather path; this module keeps, per shard:

- per live episode (by serial: the k-th episode ever added), the least and greatest
  version of its transitions and whether they are non-decreasing. Computed once per
  episode, when a sample first sees it (vectorized over the new episodes); episodes
  leave FIFO, so the arrays are trimmed at the front and grown at the back;
- per bound ``v``, the qualifying transitions as spans ``(episode position, first
  step, count)``: a whole episode when its least version qualifies, none when its
  greatest does not, and for the episodes in between (a version bump mid-episode)
  the suffix found by a binary search (non-decreasing versions, the writer's case)
  or the runs of qualifying steps (any other order). Rebuilt when the table changes.

A draw is then ``u`` uniform in ``[0, qualifying)`` mapped through the spans' running
counts: every qualifying transition is drawn with the same probability, in O(batch).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from arrowbuf.shard import Shard

VERSION = "policy_version"
#: Bounds whose spans a shard (or a Ray reader's view) keeps at once.
MAX_BOUNDS = 4


@dataclass(frozen=True)
class Spans:
    """Qualifying transitions of one bound: span k covers ``count[k]`` steps from
    ``step0[k]`` of the episode at live position ``pos[k]``; ``end`` the running counts."""

    total: int
    end: np.ndarray      # cumulative counts (searchsorted maps a draw to its span)
    start: np.ndarray    # end - count
    pos: np.ndarray
    step0: np.ndarray
    index0: np.ndarray   # transition index of each span's first step
    row0: np.ndarray     # arena row of each span's first step
    episode_id: np.ndarray
    #: Index of the first qualifying transition when they are one run of consecutive
    #: indices (one writer whose versions rise: every step from some point on), else -1.
    #: A draw then needs no span look-up: ``first + u`` is the index, located as a plain
    #: sample locates it. ``searchsorted`` of random draws mispredicts a branch at every
    #: level (14 us for 256 draws over 750 spans, against 2 us for a repeated batch).
    first: int = -1

    def draw(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(span of each draw, offset in it) of draws ``u`` in ``[0, total)``."""
        k = self.end.searchsorted(u, "right")
        return k, u - self.start.take(k)

    def indices(self) -> np.ndarray:
        """Every qualifying transition index, oldest first."""
        counts = self.end - self.start
        return np.repeat(self.index0 - self.start, counts) + np.arange(self.total, dtype=np.int64)


class EpisodeBounds:
    """Per-episode (least, greatest, non-decreasing) versions of one shard, by serial, and
    what is derived from them (``spans``: the `Spans` per bound, a `FreshnessSampler`'s
    runs under ``"runs"``), dropped when the table changes."""

    def __init__(self) -> None:
        self.base: object = None           # the table's column array they were read against
        self.first = 0                     # serial of row 0 of the arrays
        self.low = np.zeros(0, np.int64)
        self.high = np.zeros(0, np.int64)
        self.sorted = np.zeros(0, bool)
        self.token: tuple = ()
        self.spans: dict[Any, Any] = {}


_BOUNDS: "weakref.WeakKeyDictionary[Shard, EpisodeBounds]" = weakref.WeakKeyDictionary()


def version_column(shard: Shard) -> np.ndarray | None:
    """The shard's column of versions (None: it has none, every version is 0)."""
    return shard.reader(VERSION) if VERSION in shard.schema.fields else None


def episode_versions(shard: Shard) -> Callable[[int], np.ndarray]:
    """``values_of(p)``: the versions of the transitions of ``shard``'s live episode at position ``p``."""
    table = shard.table
    column, first_row, length = version_column(shard), table.col("first_row"), table.col("length")

    def values_of(p: int) -> np.ndarray:
        # By an index array: a torch arena's reader takes those (`Shard.reader`), not slices.
        return np.asarray(column[np.arange(first_row[p], first_row[p] + length[p])]).reshape(-1)

    return values_of


def shard_bounds(shard: Shard) -> EpisodeBounds:
    """The shard's bounds, brought up to its live episodes."""
    bounds = _BOUNDS.get(shard)
    if bounds is None:
        bounds = _BOUNDS[shard] = EpisodeBounds()
    table = shard.table
    base = table.col("first_row").base
    # A version column added later (`Shard.extend`) holds 0 in earlier rows: what its absence means.
    token = (table.head, table.tail, table.episodes_added, table.next_index)
    if base is bounds.base and token == bounds.token:
        return bounds
    live = len(table)
    first_serial = table.episodes_added - live
    if base is not bounds.base or first_serial < bounds.first or first_serial > bounds.first + len(bounds.low):
        bounds.first, bounds.low, bounds.high = first_serial, bounds.low[:0], bounds.high[:0]
        bounds.sorted = bounds.sorted[:0]
    drop = first_serial - bounds.first
    bounds.low, bounds.high, bounds.sorted = bounds.low[drop:], bounds.high[drop:], bounds.sorted[drop:]
    bounds.first = first_serial
    known = len(bounds.low)
    if known < live:
        low, high, ordered = _episode_bounds(shard, known, live)
        bounds.low = np.concatenate([bounds.low, low])
        bounds.high = np.concatenate([bounds.high, high])
        bounds.sorted = np.concatenate([bounds.sorted, ordered])
    bounds.base, bounds.token, bounds.spans = base, token, {}
    return bounds


def _episode_bounds(shard: Shard, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(least, greatest, non-decreasing) version of the transitions of live episodes ``start..stop``."""
    table = shard.table
    return episode_bounds(table.col("first_row")[start:stop], table.col("length")[start:stop], version_column(shard))


def episode_bounds(first_row: np.ndarray, length: np.ndarray, column: Any
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(least, greatest, non-decreasing) version of the ``length`` transitions from each
    ``first_row`` of ``column`` (indexed by row arrays; None: every version 0). An episode
    without transitions: least past any bound, greatest -1."""
    n = len(length)
    low, high, ordered = np.full(n, np.iinfo(np.int64).max), np.full(n, -1, np.int64), np.ones(n, bool)
    some = np.flatnonzero(np.asarray(length) > 0)
    if column is None or not len(some):
        low[some], high[some] = 0, 0
        return low, high, ordered
    counts = np.asarray(length)[some].astype(np.int64)
    offsets = np.cumsum(counts) - counts
    rows = np.repeat(np.asarray(first_row)[some] - offsets, counts) + np.arange(int(counts.sum()))
    values = np.asarray(column[rows]).reshape(-1)
    low[some] = np.minimum.reduceat(values, offsets)
    high[some] = np.maximum.reduceat(values, offsets)
    down = np.zeros(len(values), bool)
    down[1:] = values[1:] < values[:-1]
    down[offsets] = False
    ordered[some] = ~np.logical_or.reduceat(down, offsets)
    return low, high, ordered


def newest(shard: Shard) -> int | None:
    """The newest version among the live transitions; None when there are none."""
    high = shard_bounds(shard).high
    return int(high.max()) if len(high) and high.max() >= 0 else None


def fresh_spans(shard: Shard, min_version: int) -> Spans | None:
    """The spans of transitions of version >= ``min_version``; None when none qualifies."""
    bounds = shard_bounds(shard)
    return kept_spans(bounds.spans, min_version, lambda: spans_of(
        shard.table, bounds.low, bounds.high, bounds.sorted, min_version, episode_versions(shard)))


def kept_spans(kept: dict, key: Any, build: Callable[[], Any]) -> Any:
    """The spans of bound ``key`` (a ``min_version``; or "runs", `arrowbuf.freshness.Runs`) kept in
    ``kept`` (a shard's `EpisodeBounds.spans`, or a Ray reader's view's), built by ``build()`` the
    first time; past `MAX_BOUNDS` bounds, all are dropped."""
    if key in kept:
        return kept[key]
    spans = build()
    if len(kept) >= MAX_BOUNDS:
        kept.clear()
    kept[key] = spans
    return spans


def spans_of(table: Any, low: np.ndarray, high: np.ndarray, ordered: np.ndarray, min_version: int,
             values_of: Callable[[int], np.ndarray]) -> Spans | None:
    """The spans of transitions of version >= ``min_version`` of ``table``'s live episodes,
    given each episode's (least, greatest, non-decreasing) version and ``values_of(p)``,
    the versions of episode ``p``'s transitions (read only for episodes that qualify in
    part); None when none qualifies. A local shard's and a Ray reader's view alike."""
    length = table.col("length")
    whole = np.flatnonzero(low >= min_version)
    pos, step0, count = [whole], [np.zeros(len(whole), np.int64)], [length[whole]]
    mixed = np.flatnonzero((low < min_version) & (high >= min_version))
    for p in mixed.tolist():
        values = values_of(p)
        if ordered[p]:
            starts = np.array([values.searchsorted(min_version)])
            stops = np.array([len(values)])
        else:
            edges = np.diff(np.concatenate([[0], (values >= min_version).astype(np.int8), [0]]))
            starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        pos.append(np.full(len(starts), p))
        step0.append(starts.astype(np.int64))
        count.append((stops - starts).astype(np.int64))
    pos_, step0_, count_ = (np.concatenate(part).astype(np.int64) for part in (pos, step0, count))
    order = np.lexsort((step0_, pos_))
    pos_, step0_, count_ = pos_[order], step0_[order], count_[order]
    if not len(pos_) or not count_.sum():
        return None
    end = np.cumsum(count_)
    index0 = table.col("first_index").take(pos_) + step0_
    one_run = bool(np.array_equal(index0[1:], index0[:-1] + count_[:-1]))
    return Spans(int(end[-1]), end, end - count_, pos_, step0_, index0, table.col("first_row").take(pos_) + step0_,
                 table.col("episode").take(pos_), int(index0[0]) if one_run else -1)
