"""`ShardView`: shards as a reader sees them, built from their manifests' episode chunks.

A view of one shard (`shard_view`) holds the shard's blocks, placed at *virtual*
rows (each block after the previous one), and an `EpisodeTable` rebuilt from the
blocks' episode chunks with the shard's own indices, so a batch's ``"index"`` is
the one the shard knows; where readers draw, a copy of the store's sampler is bound
to it. A view of several shards (`joined_view`) numbers their transitions one after
the other, so one draw over it is a draw over all of them in proportion to their
mass, and one gather plan serves it. Views never change: a new manifest makes a new
view (`arrowbuf.ray.reader.BlockReader`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import numpy as np

from arrowbuf.indexing import PieceChains, piece_chains
from arrowbuf.ray.blocks import BlockInfo, Manifest
from arrowbuf.ray.fresh import join_versions, view_versions
from arrowbuf.ray.options import INDEX_SHIFT, LOCAL_MASK
from arrowbuf.samplers import Sampler
from arrowbuf.table import EpisodeTable

_TEMPLATE = EpisodeTable().state_dict()["columns"]   # zero-length columns of every chunk column


@dataclass
class ShardView:
    """Shards as this reader sees them: their blocks and a table of their live sealed episodes.

    A view of one shard keeps the shard's own indices; a view of several (`BlockReader`
    draws from one over all the shards it samples: one draw, one gather plan) numbers
    their transitions one after the other, and ``index_base`` per episode turns
    those numbers back into the shards' indices.
    """

    shard: int                 # -1 for a view of several shards
    manifest: Manifest | None  # of the one shard
    blocks: tuple[BlockInfo, ...]
    bases: np.ndarray          # virtual first row of each block
    table: EpisodeTable
    sampler: Sampler | None    # a copy bound to `table`, when readers draw
    mass: float
    columns: dict[str, np.ndarray]        # what `table` was built from
    index_base: int | np.ndarray          # added to the table's indices: one value, or one per episode
    shards: np.ndarray | None = None      # shard of each episode (a view of several)
    keys: tuple = ()                      # `BlockInfo.key` of each block (the cache's)
    # (least, greatest, non-decreasing) policy version of each episode, and the spans of
    # fresh steps per bound drawn so far (`arrowbuf.ray.fresh`).
    versions: tuple = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
    spans: dict = field(default_factory=dict)
    newest: int = field(init=False)   # the newest version of its live steps (-1: none), read once
    _chains: PieceChains | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        high = self.versions[1]
        self.newest = int(high.max()) if len(high) else -1

    def chains(self) -> PieceChains | None:
        """The table's `PieceChains` (None: no entry continues another), found on first use:
        the view never changes."""
        if self._chains is None and self.table.pieces:
            self._chains = piece_chains(self.table)
        return self._chains


def view_table(columns: dict, episodes_added: int, stop_index: int, sampler: Sampler | None, shard: int = 0,
               num_shards: int = 1) -> tuple[EpisodeTable, Sampler | None, float]:
    """A table of ``columns`` and, given the store's ``sampler`` (readers draw), a copy of it
    bound to that table, and its mass."""
    table = EpisodeTable(shard=shard, id_offset=shard, id_stride=num_shards)
    table.load_state_dict({"shard": shard, "id_offset": shard, "id_stride": num_shards,
                           "episodes_added": episodes_added, "env_names": [],
                           "counters": {"index": stop_index}, "columns": columns, "metadata": []})
    table.build_lookup()   # never changed, sampled until the next manifest
    copy, mass = None, 0.0
    if sampler is not None:   # a copy that draws from this view (stateless samplers only)
        copy = type(sampler)(**sampler.config())
        copy.bind(types.SimpleNamespace(table=table))
        mass = copy.mass(table) if len(table) else 0.0
    return table, copy, mass


def shard_view(shard: int, manifest: Manifest, chunks: dict, sampler: Sampler, num_shards: int) -> ShardView:
    """The view of ``shard`` by its ``manifest``, whose blocks' episode chunks are in ``chunks``
    (by `BlockInfo.key`); ``sampler`` is bound to it when the manifest says readers draw."""
    blocks = manifest.blocks
    sizes = np.array([b.num_rows for b in blocks], np.int64)
    bases = np.cumsum(sizes) - sizes
    columns: dict[str, list] = {name: [empty] for name, empty in _TEMPLATE.items()}
    kept = []
    for block, base in zip(blocks, bases.tolist()):
        chunk = chunks[block.key]
        skip = max(0, manifest.first_live_serial - block.first_serial)
        kept.append((chunk, skip))
        for name in columns:
            part = chunk[name][skip:]
            columns[name].append(part + base if name == "first_row" else part)
    columns = {name: np.concatenate(parts) for name, parts in columns.items()}
    table, copy, mass = view_table(columns, manifest.stop_serial, manifest.stop_index,
                                   sampler if manifest.draws_here else None, shard, num_shards)
    return ShardView(shard, manifest, blocks, bases, table, copy, mass, columns, shard << INDEX_SHIFT,
                     keys=tuple(b.key for b in blocks), versions=view_versions(kept))


def joined_view(views: list[ShardView], sampler: Sampler) -> ShardView:
    """One view of several shards' ``views``: their transitions numbered one after the other,
    each piece linked to the one it continues by its place in the joined table (its
    ``prev_piece``: `arrowbuf.indexing.piece_chains`), ``sampler`` bound to it when every
    view has a copy of its own."""
    columns: dict[str, list] = {name: [] for name in _TEMPLATE}
    bases, index_base, owners, rows, indices, entries = [], [], [], 0, 0, 0
    for view in views:
        first, stop = view.table.live_range()
        for name in columns:
            part = view.columns[name]
            if name == "first_row":
                part = part + rows
            elif name == "first_index":
                part = part - first + indices
            elif name == "prev_piece":   # a shard's serial -> the position in the joined table (its serial)
                head = view.table.episodes_added - len(view.table)
                part = np.where(part >= head, part - head + entries, -1)
            columns[name].append(part)
        count = len(view.columns["first_row"])
        entries += count
        index_base.append(np.full(count, (view.shard << INDEX_SHIFT) + first - indices, np.int64))
        owners.append(np.full(count, view.shard, np.int64))
        bases.append(view.bases + rows)
        rows += int(sum(b.num_rows for b in view.blocks))
        indices += stop - first
    columns = {name: np.concatenate(parts) for name, parts in columns.items()}
    drawn = sampler if all(v.sampler is not None for v in views) else None
    table, copy, mass = view_table(columns, len(columns["first_row"]), indices, drawn)
    return ShardView(-1, None, tuple(b for v in views for b in v.blocks), np.concatenate(bases), table,
                     copy, mass, columns, np.concatenate(index_base), np.concatenate(owners),
                     tuple(key for v in views for key in v.keys), join_versions(views))


def held_in(views: dict[int, ShardView], index: np.ndarray) -> np.ndarray:
    """Which of the store's ``index`` (shard << INDEX_SHIFT | the shard's own) ``views`` (by shard)
    hold: an epoch's rows evicted since it drew them, or of a shard gone, are not held."""
    shards = index >> INDEX_SHIFT
    held = np.zeros(len(index), bool)
    for shard in np.unique(shards).tolist():
        view = views.get(shard)
        if view is not None:
            at = shards == shard
            held[at] = view.table.is_live(index[at] & LOCAL_MASK)
    return held
