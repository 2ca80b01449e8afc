"""The episode log's file format: segments of checksummed records, each an Arrow IPC stream.

A segment ``log-<segment:08d>.arrowlog`` is a sequence of records, each a header and
an Arrow IPC stream::

    b"ABL1" | payload bytes (u64) | sum and xor of the payload's u64 words | crc32 of the header | payload

The payload's schema metadata says what the record is: a segment's ``start``
(the writers' last batch numbers, so retried writes stay recognised after
compaction), ``episodes`` (a RecordBatch of one row per episode: each field the
list of its rows in the plain layout of checkpoints, then episode_id, env_id,
metadata, inserted_at, has_final, num_steps) or ``clear``.

`read_segment` reads a segment back: a record whose bytes run past the end of the
newest segment is a torn append and ends it; any other damage raises `FormatError`
naming the file. `arrowbuf.episode_log` appends and replays records.

A segment's ``start`` record also names its predecessor and the bytes it ended
with (``previous``: [segment, bytes], null for the first), so a segment cut at a
record boundary is found; and ``head``: true says the log keeps a head file
(``log-head``, `Head`): the oldest and newest segment and how far the newest one's
appends were acknowledged, so a deleted or cut newest segment is found too.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf._checks import metadata_text
from arrowbuf._persist import encoded_rows, plain_array, plain_field, schema_of
from arrowbuf._version import __version__
from arrowbuf.errors import FormatError, SchemaError
from arrowbuf.fields import arrow_to_numpy
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode

MAGIC = b"ABL1"
HEADER = struct.Struct("<4sQQQ")        # magic, payload bytes, word sum, word xor
HEADER_BYTES = HEADER.size + 4          # + crc32 of the header
META = b"arrowbuf.log"
SEGMENT = re.compile(r"log-(\d{8})\.arrowlog")
HEAD_NAME = "log-head"
HEAD = struct.Struct("<4sQQQQqq")       # magic, first and newest segment, acked bytes and records of the newest,
                                        # next id after the acknowledged episodes, next id of the last checkpoint
HEAD_MAGIC = b"ABH1"
Batch = tuple[str, int]                 # (writer id, the writer's batch number)

# Columns after the user fields in an episodes record.
SYSTEM_COLUMNS = pa.schema([("episode_id", pa.int64()), ("env_id", pa.string()), ("metadata", pa.string()),
                            ("inserted_at", pa.int64()), ("has_final", pa.bool_()), ("num_steps", pa.int64())])


def segment_name(number: int) -> str:
    return f"log-{number:08d}.arrowlog"


class Head:
    """What the log's head file records: segments ``first..newest`` exist, and appends to
    ``newest`` were acknowledged up to byte ``acked_bytes`` (``acked_records`` records
    after its start), every episode below ``acked_next`` among them or before, and
    the last compaction's checkpoint holds every episode below ``covered``.

    Written after the acknowledged append's bytes were flushed, so it never claims
    more than the segment holds; a crash mid-append leaves bytes beyond it (a torn
    record, never acknowledged), while a segment cut below it was damaged.
    """

    def __init__(self, first: int, newest: int, acked_bytes: int, acked_records: int, acked_next: int,
                 covered: int = 0) -> None:
        self.first, self.newest = first, newest
        self.acked_bytes, self.acked_records, self.acked_next = acked_bytes, acked_records, acked_next
        self.covered = covered

    def pack(self) -> bytes:
        body = HEAD.pack(HEAD_MAGIC, self.first, self.newest, self.acked_bytes, self.acked_records, self.acked_next,
                         self.covered)
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def read(cls, path: Path) -> "Head | None":
        """The head in ``path`` (None: no such file).

        Raises:
            FormatError: a damaged head file.
        """
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) != HEAD.size + 4 or zlib.crc32(data[:HEAD.size]) != struct.unpack_from("<I", data, HEAD.size)[0]:
            raise FormatError(f"{path}: a damaged log head ({len(data)} bytes, or a bad checksum); it records "
                              "which segments exist and how far their appends were acknowledged, so the log "
                              "cannot vouch for its newest episodes")
        magic, *values = HEAD.unpack_from(data)
        if magic != HEAD_MAGIC or values[0] > values[1] or min(values) < 0:
            raise FormatError(f"{path}: not a log head (magic {magic!r}, segments {values[0]}..{values[1]})")
        return cls(*values)


def digest(payload: memoryview) -> tuple[int, int]:
    """Wrapping sum and xor of the payload's 8-byte words (IPC streams are 8-byte aligned).

    Both change with any flipped bit and with zeroed words, and numpy computes
    them at memory speed (zlib's crc32 runs at ~0.5 GB/s here, 10x slower than the
    rest of an append).
    """
    words = np.frombuffer(payload, np.uint64)
    return int(np.add.reduce(words, dtype=np.uint64)), int(np.bitwise_xor.reduce(words))


def record_header(payload: pa.Buffer) -> bytes:
    """The header of the record holding ``payload``."""
    total, xor = digest(memoryview(payload))
    header = HEADER.pack(MAGIC, payload.size, total, xor)
    return header + struct.pack("<I", zlib.crc32(header))


def stream(schema: pa.Schema, meta: Mapping[str, Any], batches: Sequence[pa.RecordBatch] = ()) -> pa.Buffer:
    """An Arrow IPC stream whose schema metadata holds ``meta``."""
    schema = schema.with_metadata({**(schema.metadata or {}), META: json.dumps(meta).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()


def episodes_schema(schema: Schema) -> pa.Schema:
    """One list column per user field (its rows, plain layout), then the system columns."""
    fields = [pa.field(name, pa.large_list(plain_field(name, spec, "log").type)) for name, spec in
              schema.fields.items()]
    meta = {b"arrowbuf.schema": schema.to_json().encode(), b"arrowbuf.version": __version__.encode()}
    return pa.schema([*fields, *SYSTEM_COLUMNS], metadata=meta)


def episodes_batch(arrow_schema: pa.Schema, schema: Schema, entries: Sequence[tuple[int, Episode, int]]
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
               pa.array([metadata_text(e.metadata) for e in episodes], pa.string()),
               pa.array([t for _, _, t in entries], pa.int64()), pa.array([e.has_final for e in episodes], pa.bool_()),
               pa.array([e.num_steps for e in episodes], pa.int64())]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


class Record:
    """One decoded record: its kind and JSON, and for ``episodes`` the schema and batches."""

    def __init__(self, payload: pa.Buffer, where: str) -> None:
        try:
            reader = pa.ipc.open_stream(payload)
            self.meta = json.loads(reader.schema.metadata[META])
            self.batches = [batch for batch in reader]
            for batch in self.batches:
                batch.validate(full=True)
            self.kind = self.meta["kind"]
        except (pa.ArrowException, KeyError, TypeError, ValueError) as err:
            raise FormatError(f"{where}: an unreadable log record ({type(err).__name__}: {err})") from None
        self.where = where
        problem = _meta_problem(self.meta)
        if problem is None and self.kind == "episodes":
            problem = _columns_problem(reader.schema, self.batches)
        if problem is not None:
            raise FormatError(f"{where}: a malformed log record ({problem})")
        self.schema = schema_of(reader.schema, where) if self.kind == "episodes" else None

    @property
    def batch(self) -> Batch | None:
        batch = self.meta.get("batch")
        return (batch[0], int(batch[1])) if batch else None

    def ids(self) -> list[int]:
        return [i for batch in self.batches for i in batch.column("episode_id").to_pylist()]

    def owners(self) -> list:
        """The owner (writer id, or None) of each episode's open pieces (`arrowbuf.ray.tails`)."""
        pieces = self.meta.get("pieces")
        return [p[2] for p in pieces] if pieces is not None else [None] * sum(b.num_rows for b in self.batches)

    def closes(self) -> tuple[str | None, list[str], int] | None:
        """(owner, env ids, the next episode id after this record's episodes) of the open episodes
        that ended with this record; None: none did."""
        closes = self.meta.get("closes")
        return None if closes is None else (closes["owner"], list(closes["envs"]), int(closes["next_id"]))

    def episodes(self) -> Iterator[tuple[int, Episode]]:
        """(logged id, episode) of each episode, columns as zero-copy views of the record (with the
        piece each continues and whether its episode goes on, where logged)."""
        first_steps = self.meta.get("first_steps")   # pieces that continue an episode; absent: none does
        pieces = self.meta.get("pieces")   # [prev_piece, open, owner] of each; absent: no piece links
        count = sum(batch.num_rows for batch in self.batches)
        for name, listed in (("first_steps", first_steps), ("pieces", pieces)):
            if listed is not None and len(listed) != count:
                raise FormatError(f"{self.where}: a malformed log record ({name} has {len(listed)} entries "
                                  f"for {count} episodes)")
        serial = 0
        for batch in self.batches:
            rows = {name: batch.column(name).to_pylist() for name in SYSTEM_COLUMNS.names}
            fields = {}
            for name, spec in self.schema.fields.items():
                column = batch.column(name)
                try:
                    values = encoded_rows(column.values, spec, name) if spec.codec is not None \
                        else arrow_to_numpy(column.values, name, spec.shape)
                    fields[name] = (values, column.offsets.to_numpy())
                except (SchemaError, FormatError) as err:
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
                                          inserted_at=rows["inserted_at"][k],
                                          first_step=first_steps[serial] if first_steps is not None else 0,
                                          prev_piece=pieces[serial][0] if pieces is not None else -1,
                                          open=pieces[serial][1] if pieces is not None else False)
                serial += 1


def _is_int(value: Any) -> bool:
    return type(value) is int


def _meta_problem(meta: Any) -> str | None:
    """What is wrong with a record's JSON (None: it has the shape its kind needs).

    Checksums catch damage, not bytes written on purpose: a record is read only
    after its JSON says what `EpisodeLog` will do with it.
    """
    if not isinstance(meta, dict):
        return f"its metadata is {type(meta).__name__}, expected an object"
    kind = meta.get("kind")
    if kind == "start":
        writers = meta.get("writers")
        if not isinstance(writers, dict) or not all(
                isinstance(w, list) and len(w) == 2 and _is_int(w[0]) and isinstance(w[1], list)
                and all(_is_int(n) for n in w[1]) for w in writers.values()):
            return f"writers {writers!r:.80}, expected {{writer: [count, [numbers]]}}"
        previous = meta.get("previous")
        if previous is not None and not (isinstance(previous, list) and len(previous) == 2
                                         and all(_is_int(v) and v >= 0 for v in previous)):
            return f"previous {previous!r:.80}, expected null or [segment, bytes]"
        if not isinstance(meta.get("head", False), bool):
            return f"head {meta.get('head')!r:.80}, expected true or false"
    elif kind == "clear":
        if not _is_int(meta.get("next_id")) or meta["next_id"] < 0:
            return f"next_id {meta.get('next_id')!r:.80}, expected an int >= 0"
    elif kind == "episodes":
        batch = meta.get("batch")
        if batch is not None and not (isinstance(batch, list) and len(batch) == 2 and isinstance(batch[0], str)
                                      and _is_int(batch[1])):
            return f"batch {batch!r:.80}, expected null or [writer, number]"
        first_steps = meta.get("first_steps", [])
        if not (isinstance(first_steps, list) and all(_is_int(v) and v >= 0 for v in first_steps)):
            return f"first_steps {first_steps!r:.80}, expected a list of ints >= 0"
        pieces = meta.get("pieces", [])
        if not (isinstance(pieces, list) and all(
                isinstance(p, list) and len(p) == 3 and _is_int(p[0]) and p[0] >= -1 and isinstance(p[1], bool)
                and (p[2] is None or isinstance(p[2], str)) for p in pieces)):
            return f"pieces {pieces!r:.80}, expected [prev_piece >= -1, open, owner or null] per episode"
        closes = meta.get("closes")
        if closes is not None and not (isinstance(closes, dict) and (closes.get("owner") is None or isinstance(
                closes.get("owner"), str)) and isinstance(closes.get("envs"), list)
                and all(isinstance(e, str) for e in closes["envs"]) and _is_int(closes.get("next_id"))
                and closes["next_id"] >= 0):
            return f"closes {closes!r:.80}, expected {{owner, envs: [env ids], next_id >= 0}}"
    else:
        return f"kind {kind!r:.80}, expected 'start', 'clear' or 'episodes'"
    return None


def _columns_problem(schema: pa.Schema, batches: list[pa.RecordBatch]) -> str | None:
    """What is wrong with an episodes record's columns (None: list fields, then the system columns, no nulls)."""
    names = schema.names
    if len(names) < len(SYSTEM_COLUMNS) or names[-len(SYSTEM_COLUMNS):] != SYSTEM_COLUMNS.names:
        return f"columns {names}, expected the fields then {SYSTEM_COLUMNS.names}"
    for field in schema:
        if field.name in SYSTEM_COLUMNS.names:
            expected = SYSTEM_COLUMNS.field(field.name).type
            if field.type != expected:
                return f"column {field.name!r} is {field.type}, expected {expected}"
        elif not pa.types.is_large_list(field.type):
            return f"field {field.name!r} is {field.type}, expected a large_list of its rows"
    for batch in batches:
        for name in [*SYSTEM_COLUMNS.names, *(n for n in names if n not in SYSTEM_COLUMNS.names)]:
            if name != "metadata" and batch.column(name).null_count:
                return f"column {name!r} has nulls"
    return None


def read_segment(path: Path, last: bool) -> tuple[list[Record], int]:
    """The records of one segment and the bytes they span.

    A record whose bytes run past the end of the newest segment (``last``) is a
    torn append and ends the list; anything else that does not check raises.
    """
    data = path.read_bytes()
    records, offset = [], 0
    while offset < len(data):
        where = f"{path} (record at byte {offset})"
        if len(data) - offset < HEADER_BYTES:
            if last:
                break
            raise FormatError(f"{where}: {len(data) - offset} bytes, shorter than a record header; the segment "
                              "is truncated")
        header = data[offset:offset + HEADER.size]
        (crc,) = struct.unpack_from("<I", data, offset + HEADER.size)
        magic, size, total, xor = HEADER.unpack(header)
        if magic != MAGIC or zlib.crc32(header) != crc:
            raise FormatError(f"{where}: bad record header; the log is corrupted")
        start = offset + HEADER_BYTES
        if start + size > len(data):
            if last:
                break
            raise FormatError(f"{where}: the record needs {size} bytes, the segment holds {len(data) - start}; "
                              "it is truncated")
        payload = memoryview(data)[start:start + size]
        if size % 8 or digest(payload) != (total, xor):
            raise FormatError(f"{where}: the record's checksum does not match its bytes; the log is corrupted")
        records.append(Record(pa.py_buffer(payload), where))
        offset = start + size
    return records, offset
