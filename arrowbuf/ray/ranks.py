"""A Ray store's global batches split over data-parallel ranks, each rank's reader gathering only its rows.

``store.iter_batches(batch_size, world_size=W, rank=r, balance="tokens")`` on Ray: every rank's
process walks the same epoch (the router's generator, seeded alike, shuffles every shard's indices
together), and keeps of each global batch the rows `arrowbuf.groups.balanced_ranks` gives rank r,
as an embedded store does (`arrowbuf.groups.rank_share`). The tokens of each row are its ragged
field's lengths, read from the offsets of the blocks the reader holds (`rank_indices`): no row's
values are read before the split, and the reader gathers only its own rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from arrowbuf.groups import RankSplit, balanced_ranks
from arrowbuf.ray.options import INDEX_SHIFT, LOCAL_MASK
from arrowbuf.samplers import select_indices


def rank_indices(chunk: np.ndarray, views: dict, cache: Any, split: RankSplit) -> np.ndarray:
    """Rank ``split.rank``'s indices (``shard << 48 | local index``) of global batch ``chunk``, in
    its order; ``views``: the epoch's `arrowbuf.ray.views.ShardView` by shard, ``cache``: the
    reader's `arrowbuf.ray.cache.BlockCache`. Rows no view holds any more weigh nothing."""
    weights = np.ones(len(chunk), np.int64)
    if split.balance is not None:
        shards = chunk >> INDEX_SHIFT
        for shard in np.unique(shards).tolist():
            mine = shards == shard
            weights[mine] = _lengths(views.get(shard), chunk[mine] & LOCAL_MASK, cache, split.balance)
    return chunk[balanced_ranks(weights, split.world_size) == split.rank]


def _lengths(view: Any, local: np.ndarray, cache: Any, name: str) -> np.ndarray:
    """The lengths of ragged field ``name``'s rows at ``view``'s local indices ``local`` (0: not live)."""
    lengths = np.zeros(len(local), np.int64)
    if view is None:
        return lengths
    live = view.table.is_live(local)
    if not live.any():
        return lengths
    rows = select_indices(view.table, local[live]).rows
    block = np.searchsorted(view.bases, rows, side="right") - 1
    touched = np.unique(block).tolist()
    keys = [view.keys[b] for b in touched]
    found = np.zeros(len(rows), np.int64)
    for b, columns in zip(touched, cache.columns([(view.keys[b], view.blocks[b]) for b in touched], set(keys))):
        at = block == b
        found[at] = columns[name].lengths[rows[at] - int(view.bases[b])]
    lengths[live] = found
    return lengths
