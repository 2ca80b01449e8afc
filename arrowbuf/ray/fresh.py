"""Fresh steps (``policy_version >= v``) drawn by a Ray reader from its views, with no actor call.

A shard computes, when it seals a block, each of the block's episodes' least and
greatest version and whether they are non-decreasing (`arrowbuf.ray.blocks.VERSION_CHUNK`,
carried in the block's episode chunk). A reader's view keeps them per live episode
(`view_versions`; a view of several shards joins them), and a draw of bound ``v`` maps
uniform numbers through the spans of qualifying steps (`arrowbuf._version_spans.spans_of`,
the local store's: whole episodes of least version >= v, and the qualifying steps of
an episode whose version rose mid-way), kept per view and bound until the next
manifest replaces the view. Only an episode that qualifies in part has its versions
read, from its block (through the reader's cache). A draw is then as cheap as a plain
one, and every qualifying step is drawn with the same probability.

A `FreshnessSampler` is drawn from the same bounds: a view keeps its live steps as runs
of one version (`view_runs`, `arrowbuf.freshness.runs_of`, the local store's), and a draw
weighs them by their lag behind the newest version of *every* view the reader holds, so
a draw over several shards (or some of them: a worker's node's) weighs steps as one
store of all of them would.

Batches drawn ahead (`arrowbuf.ray.reader.DrawLoop`) belong to one request, and the
bound is part of the request: a batch drawn for one bound is never handed out for
another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from arrowbuf._version_spans import VERSION, Spans, kept_spans, spans_of
from arrowbuf.errors import EmptyStoreError
from arrowbuf.freshness import FreshnessSampler, Runs, runs_of
from arrowbuf.ray.blocks import VERSION_CHUNK
from arrowbuf.samplers import Selection
from arrowbuf.versions import no_fresh, span_selection

if TYPE_CHECKING:
    from arrowbuf.ray.cache import BlockCache


def view_versions(parts: list[tuple[dict, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(least, greatest, non-decreasing) version of the live episodes of a view's block
    chunks, given as (chunk, episodes of it skipped as evicted). A chunk without them
    (a block of a schema without versions) holds version 0 in every step."""
    low, high, ordered = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, bool)]
    for chunk, skip in parts:
        if VERSION_CHUNK[0] in chunk:
            a, b, c = (chunk[name][skip:] for name in VERSION_CHUNK)
        else:
            length = chunk["length"][skip:]
            a = np.where(length > 0, 0, np.iinfo(np.int64).max)
            b = np.where(length > 0, 0, -1)
            c = np.ones(len(length), bool)
        low.append(a.astype(np.int64))
        high.append(b.astype(np.int64))
        ordered.append(c.astype(bool))
    return np.concatenate(low), np.concatenate(high), np.concatenate(ordered)


def join_versions(views: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The versions of a view of several shards' views, episode by episode as it numbers them."""
    return tuple(np.concatenate([view.versions[k] for view in views]) for k in range(3))   # type: ignore[return-value]


def _values_of(view: Any, cache: BlockCache) -> Callable[[int], np.ndarray]:
    """``values_of(p)``: the versions of the steps of ``view``'s episode at live position ``p``,
    read from its block (through ``cache``)."""
    first_row, length = view.table.col("first_row"), view.table.col("length")

    def values_of(p: int) -> np.ndarray:
        # A block holds whole episodes: the one this episode's first row falls in.
        row = int(first_row[p])
        block = int(view.bases.searchsorted(row, "right")) - 1
        columns = cache.columns([(view.keys[block], view.blocks[block])], set())[0]
        local = row - int(view.bases[block])
        return np.asarray(columns[VERSION][local:local + int(length[p])]).reshape(-1)

    return values_of


def view_spans(view: Any, min_version: int, cache: BlockCache) -> Spans | None:
    """The spans of ``view``'s transitions of version >= ``min_version`` (None: none qualifies)."""
    low, high, ordered = view.versions
    return kept_spans(view.spans, min_version, lambda: spans_of(
        view.table, low, high, ordered, min_version, _values_of(view, cache)) if len(view.table) else None)


def view_runs(view: Any, cache: BlockCache) -> Runs:
    """The runs of one version of ``view``'s live steps (kept with the view, as its spans)."""
    return kept_spans(view.spans, "runs", lambda: runs_of(view.table, *view.versions[:2], _values_of(view, cache)))


def fresh_draw(rng: np.random.Generator, n: int, view: Any, min_version: int | None, cache: BlockCache,
               newest: int | None = None) -> Selection | None:
    """``n`` transitions of ``view``: weighted by freshness when its sampler is a
    `FreshnessSampler` (the lag counted from ``newest``, the newest version of every view
    the reader holds), else uniformly; of version >= ``min_version`` only when given.
    None when none may be drawn."""
    if isinstance(view.sampler, FreshnessSampler):
        return view.sampler.select(rng, n, view_runs(view, cache), view.table, min_version, newest)
    spans = view_spans(view, min_version, cache)
    return None if spans is None else span_selection(rng, n, spans, view.table)


def nothing_fresh(sampler: Any, min_version: int | None, newest: int | None) -> EmptyStoreError:
    """The error of a draw that found nothing to draw: below ``min_version``, or (a
    `FreshnessSampler` drawing from some shards) past ``max_lag`` behind ``newest``."""
    if min_version is not None and (newest is None or newest < min_version):
        return no_fresh(min_version, newest)
    if newest is None:
        return EmptyStoreError("cannot sample: the store holds no sealed transition")
    return EmptyStoreError(f"cannot sample: no step of the shards drawn from lags the newest version held "
                           f"({newest}) by at most max_lag={getattr(sampler, 'max_lag', None)}"
                           + ("" if min_version is None else f" with policy_version >= {min_version}")
                           + "; draw from every shard, or raise max_lag")


def newest(views: list[Any]) -> int | None:
    """The newest version among the views' live transitions; None when they hold none."""
    best = max((view.newest for view in views), default=-1)
    return best if best >= 0 else None


def fresh_indices(view: Any, min_version: int, cache: BlockCache) -> np.ndarray:
    """The shard indices of ``view``'s (one shard's) transitions of version >= ``min_version``."""
    spans = view_spans(view, min_version, cache)
    return np.zeros(0, np.int64) if spans is None else spans.indices()


def check_fresh_sampler(sampler: Any, draws_here: bool) -> None:
    """A Ray store draws fresh steps in its readers, with a plain `UniformSampler` or a
    `FreshnessSampler`.

    Raises:
        ValueError: another sampler, or a store whose shards draw (a rate limiter, ``track_reuse``).
    """
    from arrowbuf.samplers import UniformSampler

    if type(sampler) not in (UniformSampler, FreshnessSampler):
        raise ValueError(f"min_version needs a UniformSampler or a FreshnessSampler; this store uses {sampler!r}")
    if not draws_here:
        raise ValueError("min_version on a Ray store needs its readers to draw (no rate limiter, no track_reuse); "
                         "this store's shards draw every sample")
