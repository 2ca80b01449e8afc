"""Arrow views of a `arrowbuf.shard.Shard`'s live rows: an episode's record batch (data
columns zero-copy), every live row as a table (played episodes held in pieces read as one
run each, open tails' written rows included), the columns of back-to-back episodes with the
system columns (episode_id, step, is_first, is_last) computed from the episode table, and
the episode table with the open tails' returns summed from the arena."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf.fields import numpy_to_arrow
from arrowbuf.indexing import piece_chains
from arrowbuf.played import group_played, played_rows
from arrowbuf.shard import Shard, position_runs
from arrowbuf.table import EpisodeTable


def shard_columns(shard: Shard, first: int, stop: int) -> dict[str, np.ndarray]:
    """Every column (system ones included) of the live episodes at positions
    ``[first, stop)``, which must lie back to back in the arena.

    User fields are views of the arena; the system columns are computed from
    the episode table.
    """
    table = shard.table
    col = table.ecol   # positions past the sealed ones: open tails (`EpisodeTable.publish_open`)
    num_rows = col("num_rows")[first:stop]
    start = int(col("first_row")[first])
    total = int(num_rows.sum())
    starts = np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    local = np.arange(total, dtype=np.int64) - starts
    step = local + np.repeat(col("first_step")[first:stop], num_rows) if table.pieces else local
    step = step.astype(np.int32)   # within the episode (a piece that continues one starts past 0)
    columns = {name: shard.stored_rows(name, start, start + total) for name in shard.schema.fields}
    columns["episode_id"] = np.repeat(col("episode_id")[first:stop], num_rows)
    columns["step"] = step
    columns["is_first"] = step == 0
    columns["is_last"] = local == np.repeat(num_rows - 1, num_rows)
    return columns


def _batch(shard: Shard, first: int, stop: int, metadata: dict[bytes, bytes] | None = None,
           columns: dict[str, Any] | None = None) -> pa.RecordBatch:
    columns = shard_columns(shard, first, stop) if columns is None else columns
    # What users read: the id of the played episode, not of the piece (`arrowbuf.played`).
    columns["episode_id"] = np.repeat(shard.table.ecol("episode")[first:stop], shard.table.ecol("num_rows")[first:stop])
    arrays = [numpy_to_arrow(spec, columns[name]) for name, spec in shard.specs.items()]
    schema = shard.schema.to_arrow()
    return pa.RecordBatch.from_arrays(arrays, schema=schema.with_metadata({**schema.metadata, **(metadata or {})}))


def played_episode(shard: Shard | None, table: Any, episode_id: int) -> pa.RecordBatch:
    """The rows of live episode ``episode_id`` (its held pieces read as one: a piece's last row
    repeats the next one's first observation); zero-copy for an episode of one piece.

    Raises:
        KeyError: no live episode has this id.
    """
    if shard is not None and table.pieces:
        held = np.flatnonzero(table.col("episode") == episode_id)
        if len(held) == 1:
            return episode_view(shard, int(held[0]))
        if len(held):
            views = [episode_view(shard, int(k)) for k in held.tolist()]
            return pa.concat_batches([v.slice(0, v.num_rows - 1) for v in views[:-1]] + views[-1:])
    elif shard is not None:
        position = table.position_of(episode_id)
        if 0 <= position < len(table) and table.col("episode_id")[position] == episode_id:
            return episode_view(shard, int(position))
    ids = table.col("episode")
    live = f"{ids[0]}..{ids[-1]}" if len(ids) else "none"
    raise KeyError(f"episode {episode_id!r} is not in the store (live episode ids: {live})")


def episode_view(shard: Shard, position: int) -> pa.RecordBatch:
    """The rows of the live episode at ``position`` (0 = oldest); data columns are zero-copy."""
    has_final = bool(shard.table.col("has_final")[position])
    return _batch(shard, position, position + 1, {b"arrowbuf.has_final": b"1" if has_final else b"0"})


def shard_table(shard: Shard) -> pa.Table:
    """Every live row, oldest episode first: one chunk per contiguous run (data columns
    zero-copy), then the open tails' written rows, copied (`open_tail_batches`). A played
    episode held in pieces reads as one run of its rows, in step order, each row once
    (`arrowbuf.played.played_rows`; a copy of those rows)."""
    table = shard.table
    runs = position_runs(table.col("first_row"), table.col("num_rows"))
    batches = [_batch(shard, a, b) for a, b in runs] + open_tail_batches(shard)
    rows = pa.Table.from_batches(batches, schema=shard.schema.to_arrow())
    if not table.pieces:
        return rows
    n = len(table) + table.num_open
    after = piece_chains(table).next[:n]
    if not np.any((after >= 0) & (after < n)):   # no piece continued by a held one
        return rows
    return played_rows(table, group_played(table), rows, table.ecol("num_rows")[:n].copy())[0]


def open_tail_batches(shard: Shard) -> list[pa.RecordBatch]:
    """The rows of each open tail (`EpisodeTable.publish_open`) as a batch of its own (`open_tail_columns`)."""
    n = len(shard.table)
    return [_batch(shard, n + k, n + k + 1, columns=columns) for k, columns in enumerate(open_tail_columns(shard))]


def open_tail_columns(shard: Shard) -> list[dict[str, Any]]:
    """The columns (`shard_columns`) of each open tail, copied (its writer goes on writing them):
    its written steps and the observation after the last, whose step fields read zero, as once the
    tail is sealed (`finish_open_tails`). `to_arrow` and exports read open tails through this."""
    table = shard.table
    if not table.num_open:
        return []
    finish_open_tails(shard)
    return [{name: c.copy() if isinstance(c, np.ndarray) else c   # (`APART` fields' columns are copies already)
             for name, c in shard_columns(shard, k, k + 1).items()}
            for k in range(len(table), len(table) + table.num_open)]


def finish_open_tails(shard: Shard) -> None:
    """Zero the step fields of each open tail's last row, the observation after its last
    written step, as sealing the tail does (`arrowbuf.inplace`): the next step its writer
    adds writes them; nothing reads them before."""
    table = shard.table
    n = len(table)
    last = table.ecol("first_row")[n:] + table.ecol("length")[n:]
    for name, spec in shard.schema.fields.items():
        if not spec.observation:
            shard.zero_at(name, last)


def open_returns(shard: Shard | None) -> np.ndarray | None:
    """The reward sum of each open tail's written steps (`EpisodeTable.publish_open`'s order;
    None without open tails): the episode table keeps a return only once a piece is sealed."""
    if shard is None or not shard.table.num_open:
        return None
    table, n = shard.table, len(shard.table)
    spans = zip(table.ecol("first_row")[n:].tolist(), table.ecol("length")[n:].tolist())
    return np.array([shard.reward_sum(a, a + length) for a, length in spans], np.float64)


def episode_table(shard: Shard | None, table: EpisodeTable, include_open: bool = False,
                  open_pieces: np.ndarray | None = None) -> pa.Table:
    """`EpisodeTable.to_arrow` of ``table`` (``shard``'s, or an empty one), the open episodes'
    returns summed over their written steps with ``include_open``."""
    return table.to_arrow(include_open, open_pieces, open_returns(shard) if include_open else None)
