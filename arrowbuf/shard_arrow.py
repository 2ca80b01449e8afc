"""Arrow views of a `arrowbuf.shard.Shard`'s live rows: an episode's record batch (data
columns zero-copy), every live row as a table (played episodes held in pieces read as one
run each), and the columns of back-to-back episodes with the system columns (episode_id,
step, is_first, is_last) computed from the episode table."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from arrowbuf.fields import numpy_to_arrow
from arrowbuf.indexing import piece_chains
from arrowbuf.played import group_played, played_rows
from arrowbuf.shard import Shard, position_runs


def shard_columns(shard: Shard, first: int, stop: int) -> dict[str, np.ndarray]:
    """Every column (system ones included) of the live episodes at positions
    ``[first, stop)``, which must lie back to back in the arena.

    User fields are views of the arena; the system columns are computed from
    the episode table.
    """
    table = shard.table
    num_rows = table.col("num_rows")[first:stop]
    start = int(table.col("first_row")[first])
    total = int(num_rows.sum())
    starts = np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    local = np.arange(total, dtype=np.int64) - starts
    step = local + np.repeat(table.col("first_step")[first:stop], num_rows) if table.pieces else local
    step = step.astype(np.int32)   # within the episode (a piece that continues one starts past 0)
    columns = {name: shard.stored_rows(name, start, start + total) for name in shard.schema.fields}
    columns["episode_id"] = np.repeat(table.col("episode_id")[first:stop], num_rows)
    columns["step"] = step
    columns["is_first"] = step == 0
    columns["is_last"] = local == np.repeat(num_rows - 1, num_rows)
    return columns


def _batch(shard: Shard, first: int, stop: int, metadata: dict[bytes, bytes] | None = None) -> pa.RecordBatch:
    columns = shard_columns(shard, first, stop)
    # What users read: the id of the played episode, not of the piece (`arrowbuf.played`).
    columns["episode_id"] = np.repeat(shard.table.col("episode")[first:stop], shard.table.col("num_rows")[first:stop])
    arrays = [numpy_to_arrow(spec, columns[name]) for name, spec in shard.specs.items()]
    schema = shard.schema.to_arrow()
    return pa.RecordBatch.from_arrays(arrays, schema=schema.with_metadata({**schema.metadata, **(metadata or {})}))


def episode_view(shard: Shard, position: int) -> pa.RecordBatch:
    """The rows of the live episode at ``position`` (0 = oldest); data columns are zero-copy."""
    has_final = bool(shard.table.col("has_final")[position])
    return _batch(shard, position, position + 1, {b"arrowbuf.has_final": b"1" if has_final else b"0"})


def shard_table(shard: Shard) -> pa.Table:
    """Every live row, oldest episode first: one chunk per contiguous run (data columns
    zero-copy). A played episode held in pieces reads as one run of its rows, in step order,
    each row once (`arrowbuf.played.played_rows`; a copy of those rows)."""
    table = shard.table
    runs = position_runs(table.col("first_row"), table.col("num_rows"))
    rows = pa.Table.from_batches([_batch(shard, a, b) for a, b in runs], schema=shard.schema.to_arrow())
    if not table.pieces:
        return rows
    after = piece_chains(table).next[:len(table)]
    if not np.any((after >= 0) & (after < len(table))):   # no piece continued by a held one
        return rows
    return played_rows(table, group_played(table, sealed_only=True), rows, table.col("num_rows").copy())[0]
