"""Played episodes, as users see them: an episode table's entries (whole episodes, pieces
of episodes a step writer cut, open tails) grouped by the episode they belong to.

Pieces are storage: a long or open episode may be held in several entries of the
episode table (`arrowbuf.regions`, `arrowbuf.piece_cutting`), linked by env and
``first_step``. Each entry's ``episode`` column holds the id of its played episode (the
id of the episode's first piece), so one played episode shows one ``episode_id``;
`group_played` groups the entries by it, and `episodes_arrow` writes one row per played
episode: its length and return summed over its held pieces, the flags of its latest
piece, and ``first_step``, the step of its earliest held row (> 0 once its start was
evicted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf.indexing import piece_chains


@dataclass(frozen=True)
class Played:
    """A table's entries grouped by played episode (`group_played`), groups oldest first.

    ``episode``: each group's id (-1: open tails of an episode with no stored piece yet);
    ``first`` / ``last``: its earliest and latest entry (positions in `EpisodeTable.ecol`);
    ``group``: the group of each entry; ``open``: whether the episode goes on.
    """

    episode: np.ndarray
    first: np.ndarray
    last: np.ndarray
    group: np.ndarray
    open: np.ndarray


def group_played(table: Any, open_pieces: np.ndarray | None = None, sealed_only: bool = False) -> Played:
    """The live entries of an `arrowbuf.table.EpisodeTable` (sealed, then the open tails)
    grouped by played episode. ``open_pieces``: a mask over the sealed entries of pieces whose
    episode goes on (a Ray shard's stored open pieces, `arrowbuf.ray.tails`); an open tail's
    episode goes on too. ``sealed_only``: the sealed entries alone (what an export holds)."""
    sealed = len(table)
    n_all = sealed + (0 if sealed_only else table.num_open)
    episode = table.ecol("episode")[:n_all].copy()
    is_open = np.arange(n_all) >= sealed
    if open_pieces is not None:
        is_open[:sealed] |= open_pieces
    unknown = np.flatnonzero(episode < 0)   # open tails of episodes with no stored piece: one each
    episode[unknown] = -2 - np.arange(len(unknown))
    keys, first, inverse = np.unique(episode, return_index=True, return_inverse=True)
    last = np.zeros(len(keys), np.int64)
    np.maximum.at(last, inverse, np.arange(n_all))
    order = np.argsort(first, kind="stable")   # oldest first: by the earliest held piece
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    group_open = np.bincount(inverse, weights=is_open, minlength=len(keys)) > 0
    return Played(np.where(keys < 0, -1, keys)[order], first[order], last[order], rank[inverse],
                  group_open[order])


def episodes_arrow(table: Any, include_open: bool = False, open_pieces: np.ndarray | None = None,
                   played: Played | None = None, open_returns: np.ndarray | None = None) -> pa.Table:
    """`EpisodeTable.to_arrow`: one row per played episode whose end is stored; with
    ``include_open``, the episodes that go on too (``open`` True; episode_id -1 before their
    first piece is stored; ``has_final`` and ``num_rows`` count the observation after the last
    written step, which an open tail holds; its return needs ``open_returns``, the open tails'
    reward sums, else NaN). ``played``: the grouping to list (`group_played`'s, by default)."""
    if played is None and not table.pieces and open_pieces is None:
        return entries_arrow(table, include_open, open_returns)
    played = played or group_played(table, open_pieces)
    keep = np.ones(len(played.episode), bool) if include_open else ~played.open
    first, last = played.first[keep], played.last[keep]
    in_tail = np.arange(len(played.group)) >= len(table)
    col = lambda name: table.ecol(name)[:len(in_tail)]   # noqa: E731
    length = np.bincount(played.group, weights=col("length"), minlength=len(keep)).astype(np.int64)[keep]
    ret = col("return").astype(np.float64)
    ret[in_tail] = np.nan if open_returns is None else open_returns   # not kept in the table: summed when asked
    total = np.bincount(played.group, weights=ret, minlength=len(keep))[keep]
    has_final = col("has_final")[last] | in_tail[last]   # an open tail's last row: the observation after its last step
    inserted = col("inserted_at")[last].copy()
    inserted[in_tail[last]] = time.time_ns()
    columns = {
        "episode_id": played.episode[keep],
        "env_id": _env_ids(table, col("env")[first]),
        "shard": np.full(len(first), table.shard, np.int32),
        "first_row": col("first_row")[first],
        # Rows: its transitions, and the observation row after its last one if stored (a final
        # observation, an open tail's next one, or an episode added without one whose last step
        # has no next observation).
        "num_rows": length + (col("num_rows") - col("length"))[last],
        "length": length,
        "has_final": has_final,
        "terminated": col("terminated")[last],
        "truncated": col("truncated")[last],
        "return": total,
        "inserted_at": pa.array(inserted, pa.timestamp("ns")),
        "first_index": col("first_index")[first],
        "first_step": col("first_step")[first],
    }
    if not include_open and not columns["first_step"].any():
        # Listed where a held episode starts past its first step: the columns follow what is held,
        # not what the ring once held (a store loaded from its checkpoint lists the same).
        del columns["first_step"]
    if include_open:
        columns["open"] = played.open[keep]
    meta = table.metadata() + [None] * (len(in_tail) - len(table))
    return _table(columns, [meta[k] for k in first.tolist()])


def entries_arrow(table: Any, include_open: bool = False, open_returns: np.ndarray | None = None) -> pa.Table:
    """The table's entries as they are stored, one row each (a whole episode, or a piece:
    ``episode_id`` is then the piece's own id), oldest first: `episodes_arrow` of a table
    whose entries are whole episodes. With ``include_open``, the open tails follow
    (episode_id -1, ``open`` True, ``has_final`` True, return ``open_returns`` or NaN,
    provisional first_index)."""
    col = table.ecol if include_open else table.col
    sealed = len(table)
    n = sealed + (table.num_open if include_open else 0)
    ret = col("return").copy()
    ret[sealed:] = np.nan if open_returns is None else open_returns
    has_final = col("has_final").copy()
    has_final[sealed:] = True
    inserted = col("inserted_at").copy()
    inserted[sealed:] = time.time_ns()
    columns = {
        "episode_id": col("episode_id"),
        "env_id": _env_ids(table, col("env")),
        "shard": np.full(n, table.shard, np.int32),
        "first_row": col("first_row"),
        "num_rows": col("num_rows"),
        "length": col("length"),
        "has_final": has_final,
        "terminated": col("terminated"),
        "truncated": col("truncated"),
        "return": ret,
        "inserted_at": pa.array(inserted, pa.timestamp("ns")),
        "first_index": col("first_index"),
    }
    if include_open or table.pieces:
        columns["first_step"] = col("first_step")
    if include_open:
        columns["open"] = np.arange(n) >= sealed
    return _table(columns, table.metadata() + ([None] * table.num_open if include_open else []))


def _env_ids(table: Any, codes: np.ndarray) -> pa.Array:
    if not len(codes):
        return pa.array([], pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(table.env_names, pa.string())).dictionary_decode()


def _table(columns: dict[str, Any], meta: list[Any]) -> pa.Table:
    # Copies (one value per episode): a table handed out must not change when `clear` and
    # new writes reuse these slots.
    table = pa.table({k: v if isinstance(v, pa.Array) else pa.array(np.array(v, copy=True)) for k, v in columns.items()})
    if any(m is not None for m in meta):
        table = table.append_column("metadata", pa.array(meta, pa.string()))
    return table


def played_rows(table: Any, played: Played, rows: pa.Table, num_rows: np.ndarray) -> tuple[pa.Table, np.ndarray]:
    """``rows`` (``num_rows`` of each sealed entry of ``table``, in its order) as one run per
    played episode (``played``, sealed entries; `group_played`): its pieces in step order, each
    piece's last row dropped where the next piece's first row repeats it, ``episode_id`` the
    played episode's. Returns (rows, rows per played episode): what users read
    (`ExperienceStore.to_arrow`, exports) never shows where a writer cut an episode."""
    order = np.lexsort((np.arange(len(played.group)), played.group))
    starts = np.cumsum(num_rows) - num_rows
    after = piece_chains(table).next[:len(num_rows)]
    joined = (after >= 0) & (after < len(num_rows))   # continued by a sealed piece: its last row comes again
    keep = num_rows - joined
    kept = np.repeat(starts[order] - (np.cumsum(keep[order]) - keep[order]), keep[order]) + np.arange(int(keep.sum()))
    merged = rows.take(pa.array(kept))
    per_episode = np.bincount(played.group, weights=keep, minlength=len(played.episode)).astype(np.int64)
    index = merged.schema.get_field_index("episode_id")
    ids = pa.array(np.repeat(played.episode, per_episode), merged.schema.field(index).type)
    return merged.set_column(index, merged.schema.field(index), ids), per_episode
