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

Batches drawn ahead (`arrowbuf.ray.reader.DrawLoop`) belong to one request, and the
bound is part of the request: a batch drawn for one bound is never handed out for
another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from arrowbuf._version_spans import VERSION, Spans, spans_of
from arrowbuf.ray.blocks import VERSION_CHUNK
from arrowbuf.samplers import Selection
from arrowbuf.versions import span_selection

if TYPE_CHECKING:
    from arrowbuf.ray.cache import BlockCache
    from arrowbuf.ray.reader import ShardView

#: Bounds whose spans a view keeps at once.
MAX_BOUNDS = 4


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


def join_versions(views: list[ShardView]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The versions of a view of several shards' views, episode by episode as it numbers them."""
    return tuple(np.concatenate([view.versions[k] for view in views]) for k in range(3))   # type: ignore[return-value]


def view_spans(view: ShardView, min_version: int, cache: BlockCache) -> Spans | None:
    """The spans of ``view``'s transitions of version >= ``min_version`` (None: none qualifies)."""
    if min_version in view.spans:
        return view.spans[min_version]
    table = view.table
    first_row, length = table.col("first_row"), table.col("length")

    def values_of(p: int) -> np.ndarray:
        # A block holds whole episodes: the one this episode's first row falls in.
        row = int(first_row[p])
        block = int(view.bases.searchsorted(row, "right")) - 1
        columns = cache.columns([(view.keys[block], view.blocks[block])], set())[0]
        local = row - int(view.bases[block])
        return np.asarray(columns[VERSION][local:local + int(length[p])]).reshape(-1)

    low, high, ordered = view.versions
    spans = spans_of(table, low, high, ordered, min_version, values_of) if len(table) else None
    if len(view.spans) >= MAX_BOUNDS:
        view.spans.clear()
    view.spans[min_version] = spans
    return spans


def fresh_draw(rng: np.random.Generator, n: int, view: ShardView, min_version: int,
               cache: BlockCache) -> Selection | None:
    """``n`` transitions of ``view`` drawn uniformly among those of version >= ``min_version``;
    None when none qualifies."""
    spans = view_spans(view, min_version, cache)
    return None if spans is None else span_selection(rng, n, spans, view.table)


def newest(views: list[ShardView]) -> int | None:
    """The newest version among the views' live transitions; None when they hold none."""
    highs = [int(view.versions[1].max()) for view in views if len(view.versions[1])]
    best = max(highs, default=-1)
    return best if best >= 0 else None


def fresh_indices(view: ShardView, min_version: int, cache: BlockCache) -> np.ndarray:
    """The shard indices of ``view``'s (one shard's) transitions of version >= ``min_version``."""
    spans = view_spans(view, min_version, cache)
    return np.zeros(0, np.int64) if spans is None else spans.indices()


def check_fresh_sampler(sampler: Any, draws_here: bool) -> None:
    """A Ray store draws fresh steps in its readers, with a plain `UniformSampler`.

    Raises:
        ValueError: another sampler, or a store whose shards draw (a rate limiter, ``track_reuse``).
    """
    from arrowbuf.samplers import UniformSampler

    if type(sampler) is not UniformSampler:
        raise ValueError(f"min_version needs a UniformSampler; this store uses {sampler!r}")
    if not draws_here:
        raise ValueError("min_version on a Ray store needs its readers to draw (no rate limiter, no track_reuse); "
                         "this store's shards draw every sample")
