"""Durable shards: an append-only log of an engine's episodes, replayed after a crash.

A durable shard writes every episode it stores to an on-disk log, and flushes the
log to disk (``fdatasync``) before the write is acknowledged. After a crash its
engine is rebuilt from the last checkpoint plus the log, so every acknowledged
episode is back, exactly once. Nothing here knows about Ray: a Ray shard actor
composes a `DurableShard` with its engine (see ``ShardServer``).

Layout of a durable directory::

    shard-dir/
      log-<segment:08d>.arrowlog   segments of records, the newest one appended to
      checkpoint/                  the last checkpoint (`arrowbuf.checkpoint`); saves compact the log

Each record is a header and an Arrow IPC stream::

    b"ABL1" | payload bytes (u64) | sum and xor of the payload's u64 words | crc32 of the header | payload

The payload's schema metadata says what the record is: a segment's ``start``
(the writers' last batch numbers, so retried writes stay recognised after
compaction), ``episodes`` (a RecordBatch of one row per episode: each field the
list of its rows in the plain layout of checkpoints, then episode_id, env_id,
metadata, inserted_at, has_final, num_steps) or ``clear``.

**Exactly once.** Episode ids follow from the order of writes (``shard + k *
num_shards`` for the k-th episode a shard stores), so the log records each
episode with its id and `EpisodeLog.replay` re-adds exactly the logged episodes
whose id the engine has not reached: those of the checkpoint are skipped, and the
others get their logged ids again. A retried write (the shard died after logging
it, before its answer arrived) carries the batch number its writer gave it, and
`DurableShard.seen` recognises it.

**Crashes.** A record is appended and flushed before the answer, and nothing
is written after it until then, so a crash can only leave a torn last record (its bytes run past the end
of the newest segment): it was never acknowledged, and opening the log drops it.
Any other damage (a bad header or checksum, a short older segment, ids that skip)
raises `FormatError` naming the file.

Example:
    >>> import numpy as np, tempfile, arrowbuf as ab
    >>> from arrowbuf.durable import DurableShard
    >>> from arrowbuf.engine import ShardEngine
    >>> from arrowbuf.episodes import read_episode
    >>> make = lambda: ShardEngine(100, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=0)
    >>> durable = DurableShard(tempfile.mkdtemp())
    >>> engine = durable.recover(make)
    >>> episode, schema = read_episode({"obs": np.zeros((4, 2)), "action": np.zeros(3),
    ...                                 "terminated": np.arange(3) == 2}, None)
    >>> durable.commit(engine, [(engine.add(episode, schema), episode)])
    >>> durable.close()
    >>> with DurableShard(durable.directory) as restarted:   # after a crash: from the log
    ...     restarted.recover(make).num_episodes
    1
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import struct
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf._checks import check_bool, check_int
from arrowbuf._filesink import fsync
from arrowbuf._persist import CHECKPOINT_MANIFEST, plain_array, plain_field, schema_of
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import ArrowbufError, FormatError, SchemaError, ShardError
from arrowbuf.fields import arrow_to_numpy
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode

logger = logging.getLogger("arrowbuf")

MAGIC = b"ABL1"
_HEADER = struct.Struct("<4sQQQ")        # magic, payload bytes, word sum, word xor
_HEADER_BYTES = _HEADER.size + 4         # + crc32 of the header
_META = b"arrowbuf.log"
_SEGMENT = re.compile(r"log-(\d{8})\.arrowlog")
_MAX_WRITERS = 4096                      # writers whose batches are remembered (the most recent ones)
_WINDOW = 1024                           # batch numbers of a writer kept above its first gap
Batch = tuple[str, int]                  # (writer id, the writer's batch number)

# Columns after the user fields in an episodes record.
_SYSTEM = pa.schema([("episode_id", pa.int64()), ("env_id", pa.string()), ("metadata", pa.string()),
                     ("inserted_at", pa.int64()), ("has_final", pa.bool_()), ("num_steps", pa.int64())])


def durable_directory(durable: Any, name: str) -> Path | None:
    """Where a store's durable shards keep ``shard-<k>``: the directory ``durable``, or
    ``~/.cache/arrowbuf/<name>`` for True; None for False (or None).

    Raises:
        ValueError: anything but a bool or a path.
    """
    if durable is False or durable is None:
        return None
    if durable is True:
        return Path.home() / ".cache" / "arrowbuf" / name
    if isinstance(durable, (str, os.PathLike)) and str(durable):
        return Path(durable).expanduser()
    raise ValueError(f"durable must be True, False or a directory path, got {durable!r}")


def next_episode_id(engine: ShardEngine) -> int:
    """The id the engine's next stored episode gets."""
    if engine.shard is None:
        return engine.shard_index
    table = engine.table
    return table.episode_id_of(table.episodes_added)


# -- records ---------------------------------------------------------------------------


def _digest(payload: memoryview) -> tuple[int, int]:
    """Wrapping sum and xor of the payload's 8-byte words (IPC streams are 8-byte aligned).

    Both change with any flipped bit and with zeroed words, and numpy computes
    them at memory speed (zlib's crc32 runs at ~0.5 GB/s here, 10x slower than the
    rest of an append).
    """
    words = np.frombuffer(payload, np.uint64)
    return int(np.add.reduce(words, dtype=np.uint64)), int(np.bitwise_xor.reduce(words))


def _header(payload: pa.Buffer) -> bytes:
    """The header of the record holding ``payload``."""
    total, xor = _digest(memoryview(payload))
    header = _HEADER.pack(MAGIC, payload.size, total, xor)
    return header + struct.pack("<I", zlib.crc32(header))


def _stream(schema: pa.Schema, meta: Mapping[str, Any], batches: Sequence[pa.RecordBatch] = ()) -> pa.Buffer:
    """An Arrow IPC stream whose schema metadata holds ``meta``."""
    schema = schema.with_metadata({**(schema.metadata or {}), _META: json.dumps(meta).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()


def _episodes_schema(schema: Schema) -> pa.Schema:
    """One list column per user field (its rows, plain layout), then the system columns."""
    from arrowbuf import __version__

    fields = [pa.field(name, pa.large_list(plain_field(name, spec, "log").type)) for name, spec in
              schema.fields.items()]
    meta = {b"arrowbuf.schema": schema.to_json().encode(), b"arrowbuf.version": __version__.encode()}
    return pa.schema([*fields, *_SYSTEM], metadata=meta)


def _episodes_batch(arrow_schema: pa.Schema, schema: Schema, entries: Sequence[tuple[int, Episode, int]]
                    ) -> pa.RecordBatch:
    """One row per (id, episode, inserted_at): each field the list of the episode's rows."""
    arrays = []
    for name, spec in schema.fields.items():
        parts = [np.asarray(e.columns[name], spec.numpy_dtype) if name in e.columns   # a derived field left out: []
                 else np.zeros((0, *spec.shape), spec.numpy_dtype) for _, e, _ in entries]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(part) for part in parts], out=offsets[1:])
        values = plain_array(spec, parts[0] if len(parts) == 1 else np.concatenate(parts))
        arrays.append(pa.LargeListArray.from_arrays(pa.array(offsets), values))
    episodes = [e for _, e, _ in entries]
    arrays += [pa.array([i for i, _, _ in entries], pa.int64()), pa.array([e.env_id for e in episodes], pa.string()),
               pa.array([json.dumps(e.metadata) if e.metadata is not None else None for e in episodes], pa.string()),
               pa.array([t for _, _, t in entries], pa.int64()), pa.array([e.has_final for e in episodes], pa.bool_()),
               pa.array([e.num_steps for e in episodes], pa.int64())]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


class _Record:
    """One decoded record: its kind and JSON, and for ``episodes`` the schema and batches."""

    def __init__(self, payload: pa.Buffer, where: str) -> None:
        try:
            reader = pa.ipc.open_stream(payload)
            self.meta = json.loads(reader.schema.metadata[_META])
            self.batches = [batch for batch in reader]
            for batch in self.batches:
                batch.validate(full=True)
            self.kind = self.meta["kind"]
        except (pa.ArrowException, KeyError, TypeError, ValueError) as err:
            raise FormatError(f"{where}: an unreadable log record ({type(err).__name__}: {err})") from None
        self.where = where
        self.schema = schema_of(reader.schema, where) if self.kind == "episodes" else None

    @property
    def batch(self) -> Batch | None:
        batch = self.meta.get("batch")
        return (batch[0], int(batch[1])) if batch else None

    def ids(self) -> list[int]:
        return [i for batch in self.batches for i in batch.column("episode_id").to_pylist()]

    def episodes(self) -> Iterator[tuple[int, Episode]]:
        """(logged id, episode) of each episode, columns as zero-copy views of the record."""
        for batch in self.batches:
            rows = {name: batch.column(name).to_pylist() for name in _SYSTEM.names}
            fields = {}
            for name, spec in self.schema.fields.items():
                column = batch.column(name)
                try:
                    fields[name] = (arrow_to_numpy(column.values, name, spec.shape), column.offsets.to_numpy())
                except SchemaError as err:
                    raise FormatError(f"{self.where}: {err}") from None
            for k, episode_id in enumerate(rows["episode_id"]):
                steps, has_final = rows["num_steps"][k], rows["has_final"][k]
                columns = {}
                for name, (values, offsets) in fields.items():
                    data = values[offsets[k]:offsets[k + 1]]
                    spec = self.schema.fields[name]
                    if not len(data) and spec.derived:
                        continue
                    expected = steps + int(has_final and spec.observation)
                    if len(data) != expected:
                        raise FormatError(f"{self.where}: field {name!r} of episode {episode_id} has "
                                          f"{len(data)} rows, expected {expected}")
                    columns[name] = data
                metadata = json.loads(rows["metadata"][k]) if rows["metadata"][k] is not None else None
                yield episode_id, Episode(columns, steps, has_final, rows["env_id"][k], metadata, owned=True,
                                          inserted_at=rows["inserted_at"][k])


def _read_segment(path: Path, last: bool) -> tuple[list[_Record], int]:
    """The records of one segment and the bytes they span.

    A record whose bytes run past the end of the newest segment (``last``) is a
    torn append and ends the list; anything else that does not check raises.
    """
    data = path.read_bytes()
    records, offset = [], 0
    while offset < len(data):
        where = f"{path} (record at byte {offset})"
        if len(data) - offset < _HEADER_BYTES:
            if last:
                break
            raise FormatError(f"{where}: {len(data) - offset} bytes, shorter than a record header; the segment "
                              "is truncated")
        header = data[offset:offset + _HEADER.size]
        (crc,) = struct.unpack_from("<I", data, offset + _HEADER.size)
        magic, size, total, xor = _HEADER.unpack(header)
        if magic != MAGIC or zlib.crc32(header) != crc:
            raise FormatError(f"{where}: bad record header; the log is corrupted")
        start = offset + _HEADER_BYTES
        if start + size > len(data):
            if last:
                break
            raise FormatError(f"{where}: the record needs {size} bytes, the segment holds {len(data) - start}; "
                              "it is truncated")
        payload = memoryview(data)[start:start + size]
        if size % 8 or _digest(payload) != (total, xor):
            raise FormatError(f"{where}: the record's checksum does not match its bytes; the log is corrupted")
        records.append(_Record(pa.py_buffer(payload), where))
        offset = start + size
    return records, offset


# -- the log ---------------------------------------------------------------------------


class EpisodeLog:
    """The append-only episode log of one engine, in segment files of ``directory``.

    Opening the log reads and checks every segment, drops a torn last record, and
    keeps the records for `replay`.

    Args:
        directory: where the segments live (created if missing).
        segment_bytes: a segment this large is closed and a new one started.
        sync: flush each append to disk (``fdatasync``) before it returns; False
            leaves it to the OS: appends survive a dead process, not a node crash.

    Raises:
        FormatError: a damaged record or segment (never a torn last record).
        ValueError: a bad argument.
    """

    def __init__(self, directory: str | os.PathLike, *, segment_bytes: int = 64 << 20, sync: bool = True) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"directory must be a path, got {directory!r}")
        self.directory = Path(directory)
        self.segment_bytes = check_int("segment_bytes", segment_bytes, 1)
        self.sync = check_bool("sync", sync)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # writer -> [n, [numbers above n]]: its batches 1..n and those listed are logged.
        # Exact whatever order retries come in; a number that never comes (a write
        # refused before it was logged) is passed over once _WINDOW later ones came.
        self.batches: dict[str, list] = {}
        self._records: list[_Record] | None = []  # kept from opening until `replay`
        self._segments: list[tuple[Path, int]] = []   # sealed segments and the next id after their records
        self._next_after = 0
        self._arrow_schema: tuple[Schema, pa.Schema] | None = None   # of the last append, reused
        self._open()

    def _open(self) -> None:
        paths = sorted(p for p in self.directory.iterdir() if _SEGMENT.fullmatch(p.name))
        for k, path in enumerate(paths):
            records, end = _read_segment(path, last=k == len(paths) - 1)
            if end < path.stat().st_size:
                logger.warning("%s: dropping a torn last record (%d bytes) of an append that never returned",
                               path, path.stat().st_size - end)
                os.truncate(path, end)
            for record in records:
                self._note(record)
            self._records += records
            self._segments.append((path, self._next_after))
        if self._segments and self._segments[-1][0].stat().st_size == 0:
            self._segments.pop()[0].unlink()   # a segment whose start record was torn
        if self._segments:
            self._active_path = self._segments.pop()[0]
            self._file = open(self._active_path, "ab")
        else:
            self._start_segment(0)

    def _note(self, record: _Record) -> None:
        if record.kind == "start":
            self.batches.update(record.meta["writers"])
        elif record.kind == "clear":
            self._next_after = max(self._next_after, int(record.meta["next_id"]) + 1)
        else:
            ids = record.ids()
            if ids:
                self._next_after = max(self._next_after, ids[-1] + 1)
        if record.batch is not None:
            self._remember(record.batch)

    def _remember(self, batch: Batch) -> None:
        writer, number = batch
        upto, above = self.batches.pop(writer, [0, []])   # newest last: the oldest writers are forgotten first
        if number > upto and number not in above:
            bisect.insort(above, number)
        while above and (above[0] == upto + 1 or len(above) > _WINDOW):
            upto = above.pop(0)
        self.batches[writer] = [upto, above]
        while len(self.batches) > _MAX_WRITERS:
            del self.batches[next(iter(self.batches))]

    def _start_segment(self, number: int) -> None:
        self._active_path = self.directory / f"log-{number:08d}.arrowlog"
        self._file = open(self._active_path, "ab")
        self._write(_stream(pa.schema([]), {"kind": "start", "writers": self.batches}))
        if self.sync:
            fsync(self.directory)

    def _write(self, payload: pa.Buffer) -> None:
        """Append one record and flush it; a failed append leaves no partial record behind."""
        header = _header(payload)
        start = self._file.tell()
        try:
            self._file.write(header)
            self._file.write(memoryview(payload))
            self._file.flush()
            if self.sync:
                os.fdatasync(self._file.fileno())
        except BaseException:
            self._file.truncate(start)
            raise

    # -- appending ------------------------------------------------------------------------

    def seen(self, batch: Batch) -> bool:
        """Whether the writer's batch number ``batch[1]`` is logged."""
        upto, above = self.batches.get(batch[0], (0, ()))
        return batch[1] <= upto or batch[1] in above

    def append(self, episodes: Sequence[tuple[int, Episode, int]], schema: Schema,
               batch: Batch | None = None) -> None:
        """Log stored episodes as one record and flush it to disk before returning.

        Args:
            episodes: (episode id, episode, inserted_at ns) in the order they were stored.
            schema: the engine's schema.
            batch: (writer id, batch number) of the write they came in, for `seen`.
        """
        if self._arrow_schema is None or self._arrow_schema[0] != schema:
            self._arrow_schema = (schema, _episodes_schema(schema))
        arrow_schema = self._arrow_schema[1]
        meta = {"kind": "episodes", "batch": list(batch) if batch is not None else None}
        payload = _stream(arrow_schema, meta, [_episodes_batch(arrow_schema, schema, episodes)])
        with self._lock:
            self._rotate_if_full()
            self._write(payload)
            if batch is not None:
                self._remember(batch)

    def append_clear(self, next_id: int) -> None:
        """Log that the engine was cleared when its next episode id was ``next_id``."""
        with self._lock:
            self._rotate_if_full()
            self._write(_stream(pa.schema([]), {"kind": "clear", "next_id": int(next_id)}))

    def _rotate_if_full(self) -> None:
        if self._file.tell() >= self.segment_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self._file.close()
        self._segments.append((self._active_path, self._next_after))
        self._start_segment(int(_SEGMENT.fullmatch(self._active_path.name).group(1)) + 1)

    # -- replay and compaction ------------------------------------------------------------

    def replay(self, engine: ShardEngine) -> int:
        """Add the logged episodes the engine does not hold yet; returns how many.

        Episodes whose id is below the engine's next id are in it already (from
        its checkpoint) and skipped; the others must come in id order.

        Raises:
            FormatError: the log skips episodes the engine never stored, or an
                episode the engine refuses.
        """
        with self._lock:
            records, self._records = self._records or [], None
        added = 0
        for record in records:
            if record.kind == "clear":
                if int(record.meta["next_id"]) == next_episode_id(engine):
                    engine.clear()
                continue
            if record.kind != "episodes":
                continue
            for logged, episode in record.episodes():
                expected = next_episode_id(engine)
                if logged < expected:
                    continue
                if logged > expected:
                    raise FormatError(f"{record.where}: episode {logged} follows episode {expected - 1} of the "
                                      f"checkpoint; the episodes between them are missing from the log")
                try:
                    stored = engine.add(episode, record.schema, limited=False)
                except (ArrowbufError, ValueError) as err:
                    raise FormatError(f"{record.where}: the engine refuses logged episode {logged} ({err})") from None
                if stored != logged:
                    raise FormatError(f"{record.where}: episode {logged} was stored as {stored}; the log belongs "
                                      "to another shard")
                added += 1
        return added

    def compact(self, upto: int) -> int:
        """Start a new segment and delete the older ones a checkpoint covers; returns how many.

        Args:
            upto: the next episode id of the checkpoint: every episode with a smaller
                id is in it (or was evicted before it).
        """
        with self._lock:
            self._rotate()
            covered = [path for path, next_after in self._segments if next_after <= upto]
            for path in covered:
                path.unlink()
            self._segments = [(p, n) for p, n in self._segments if p not in covered]
            if self.sync:
                fsync(self.directory)
            return len(covered)

    def segments(self) -> list[Path]:
        """The segment files, oldest first (the last one is appended to)."""
        return [path for path, _ in self._segments] + [self._active_path]

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "EpisodeLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- a durable shard ---------------------------------------------------------------------


class DurableShard:
    """An engine's log and checkpoint in one directory: what a durable shard adds to its engine.

    The owner calls `recover` once to get its engine, `seen` before a write,
    `commit` after storing a write's episodes (before answering), `cleared` after
    `ShardEngine.clear`, and `checkpoint` to save and compact. Writes must be
    serialized with their `commit` (a Ray actor runs one call at a time).

    Args:
        directory: the shard's durable directory.
        shard, num_shards: the engine's place in its store (for checkpoint loads).
        sync: see `EpisodeLog`.

    Raises:
        FormatError: a damaged log (see `EpisodeLog`).
    """

    def __init__(self, directory: str | os.PathLike, shard: int = 0, num_shards: int = 1, sync: bool = True) -> None:
        self.log = EpisodeLog(directory, sync=sync)
        self.directory = self.log.directory
        self.shard = shard
        self.num_shards = num_shards
        self._failed: str | None = None   # why the log stopped taking writes

    @property
    def checkpoint_path(self) -> Path:
        return self.directory / "checkpoint"

    def recover(self, make_engine: Callable[[], ShardEngine]) -> ShardEngine:
        """The engine of the last checkpoint here (else ``make_engine()``) with the log replayed into it.

        Raises:
            FormatError: a damaged checkpoint or log.
        """
        from arrowbuf.checkpoint import load_engine

        if (self.checkpoint_path / CHECKPOINT_MANIFEST).exists():
            engine = load_engine(self.checkpoint_path, progress=False, shard=self.shard,
                                 num_shards=self.num_shards).engine
        else:
            engine = make_engine()
        replayed = self.log.replay(engine)
        if replayed:
            logger.info("%s: %d logged episodes replayed after the last checkpoint", self.directory, replayed)
        return engine

    def seen(self, batch: Batch | None) -> bool:
        """Whether a write with this (writer id, batch number) is logged already (a retry)."""
        return batch is not None and self.log.seen(batch)

    def commit(self, engine: ShardEngine, added: Sequence[tuple[int, Episode]], batch: Batch | None = None) -> None:
        """Log episodes just stored in ``engine``, flushed to disk before it returns.

        Args:
            engine: the engine that stored them.
            added: (id `ShardEngine.add` returned, episode), in the order stored.
            batch: the write's (writer id, batch number), for `seen`.

        Raises:
            ShardError: the log could not be written (now or at an earlier commit:
                the engine holds episodes the log lacks, so later writes would be
                lost at a restart; the shard refuses them until it restarts).
        """
        if self._failed is not None:
            raise ShardError(self._failed)
        if not added:
            return
        table = engine.table
        entries = []
        for episode_id, episode in added:
            position = table.position_of(episode_id)
            live = 0 <= position < len(table) and table.col("episode_id")[position] == episode_id
            # The time the table recorded, so a replay restores the same episode table.
            inserted = int(table.col("inserted_at")[position]) if live else int(episode.inserted_at or 0)
            entries.append((episode_id, episode, inserted))
        try:
            self.log.append(entries, engine.schema, batch)
        except OSError as err:
            self._failed = (f"the durable log {self.directory} could not be written ({err}); this shard refuses "
                            "writes until it restarts (it then recovers every acknowledged write)")
            raise ShardError(self._failed) from None

    def cleared(self, engine: ShardEngine) -> None:
        """Log a `ShardEngine.clear` (call right after it)."""
        self.log.append_clear(next_episode_id(engine))

    def checkpoint(self, engine: ShardEngine, info: Mapping[str, Any]) -> Path:
        """Save the engine into ``<directory>/checkpoint`` (incrementally) and compact the log.

        Args:
            engine: the shard's engine.
            info: the store settings `arrowbuf.checkpoint.save_engine` records.
        """
        from arrowbuf.checkpoint import save_engine

        with engine.lock:
            upto = next_episode_id(engine)   # every episode below it is in the save that follows
        save_engine(engine, self.checkpoint_path, info, progress=False)
        self.log.compact(upto)
        return self.checkpoint_path

    def close(self) -> None:
        self.log.close()

    def __enter__(self) -> "DurableShard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
