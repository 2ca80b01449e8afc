"""What Parquet export and checkpoints share: plain columns, row snapshots, verified files.

**Plain columns.** Files hold what any Arrow reader understands: fixed-shape fields
are ``FixedSizeList`` columns (the storage of Arrow's ``fixed_shape_tensor``, the
shape flattened), booleans are Arrow ``boolean``, bfloat16 is ``uint16``. Each
field's metadata keeps its role, dtype name and shape, and the schema metadata the
whole arrowbuf schema as JSON, so arrowbuf restores the tensor types. Checkpoints
keep these columns; a Parquet export (format 4) writes them in the encoding of
`arrowbuf.fields.export_type` (bfloat16 widened to float32, fixed shapes as
``arrow.fixed_shape_tensor``), and `batch_columns` reads both.

**Snapshots.** Files are written without the store's lock, from zero-copy views of
the arena. Rows are only overwritten after their episode is evicted, and eviction
is FIFO, so if the oldest episode written is still live once the file is complete,
no row of the file changed while it was written. `snapshot_and_write` checks that
and, when an eviction raced the write, takes the snapshot again copying the rows
under the lock, and writes that copy.

**Verified files.** Manifests carry a checksum of their own content
(`write_manifest`, `check_checksum`) and the size and SHA-256 of every file they
list (`file_entry`, `check_file`); Arrow IPC record batches are validated in full
before use (`ipc_batches`). Writing the files atomically is `arrowbuf._filesink`'s job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, TypeVar

import numpy as np
import pyarrow as pa

from arrowbuf._version import __version__
from arrowbuf.encoded import EncodedRows
from arrowbuf.errors import FormatError, SchemaError
from arrowbuf.ragged import RaggedRows, ragged_rows
from arrowbuf.text import text_values
from arrowbuf.fields import Field, arrow_to_numpy, export_array, narrow_bfloat16, numpy_to_arrow
from arrowbuf.schema import SCHEMA_VERSION, SYSTEM_SPECS, Schema
from arrowbuf.shard import position_runs
from arrowbuf.shard_arrow import shard_columns

logger = logging.getLogger("arrowbuf")

ROLE, DTYPE, SHAPE, CODEC = b"arrowbuf.role", b"arrowbuf.dtype", b"arrowbuf.shape", b"arrowbuf.codec"
EXPORT_MANIFEST = "_arrowbuf.json"        # of a Parquet export (arrowbuf.parquet)
CHECKPOINT_MANIFEST = "manifest.json"     # of a checkpoint (arrowbuf.checkpoint)
SCHEMA_KEY = b"arrowbuf.schema"
CHECKSUM = "checksum"                     # a manifest's hash of its own content
_ARRAY = "__arrowbuf_array__"
_T = TypeVar("_T")
_R = TypeVar("_R")


# -- progress -------------------------------------------------------------------------


def progress_bar(progress: bool | None, total: int, desc: str, unit: str = "rows") -> Any:
    """A tqdm bar; ``progress=None`` shows it when stderr is a terminal, False never."""
    from tqdm import tqdm

    enabled = getattr(sys.stderr, "isatty", lambda: False)() if progress is None else bool(progress)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, leave=False)


# -- plain columns ---------------------------------------------------------------------


def plain_field(name: str, spec: Field, role: str) -> pa.Field:
    """The Arrow field of one column as plain readers see it (shape in the metadata)."""
    meta = {ROLE: role.encode(), DTYPE: spec.dtype.encode(), SHAPE: json.dumps(list(spec.shape)).encode()}
    if spec.codec is not None:   # the rows as stored: their bytes
        arrow_type, meta[CODEC] = pa.large_binary(), spec.codec.encode()
    elif spec.ragged:            # values and offsets
        arrow_type = spec.arrow_type()
    elif spec.text:              # the strings (Parquet dictionary-encodes them itself)
        arrow_type = pa.large_string()
    else:
        value = pa.bool_() if spec.dtype == "bool" else pa.from_numpy_dtype(spec.numpy_dtype)
        arrow_type = pa.list_(value, int(np.prod(spec.shape, dtype=np.int64))) if spec.shape else value
    return pa.field(name, arrow_type, nullable=False, metadata=meta)


def plain_schema(schema: Schema, metadata: Mapping[str, str] | None = None) -> pa.Schema:
    """User fields then the system columns, with the arrowbuf schema in the metadata."""
    fields = [plain_field(n, f, "observation" if f.observation else "derived" if f.derived else "step")
              for n, f in schema.fields.items()]
    fields += [plain_field(n, f, "system") for n, f in SYSTEM_SPECS.items()]
    meta = {"arrowbuf.schema_version": SCHEMA_VERSION, SCHEMA_KEY.decode(): schema.to_json(), **(metadata or {})}
    return pa.schema(fields, metadata=meta)


def plain_array(spec: Field, data: np.ndarray) -> pa.Array:
    """An Arrow array of rows of ``spec`` in the plain layout; zero-copy except for bools
    (an encoded field's rows: their bytes, `EncodedRows`)."""
    if spec.text:
        return export_array(spec, numpy_to_arrow(spec, data))
    if spec.codec is not None or spec.ragged:
        return numpy_to_arrow(spec, data)
    values = numpy_to_arrow(Field(spec.dtype), np.ascontiguousarray(data).reshape(-1))
    if not spec.shape:
        return values
    return pa.FixedSizeListArray.from_arrays(values, int(np.prod(spec.shape, dtype=np.int64)))


def tensor_schema(schema: Schema, metadata: Mapping[bytes, bytes] | None = None) -> pa.Schema:
    """The plain schema with fixed-shape fields typed as ``fixed_shape_tensor`` again
    (the types of `ExperienceStore.to_arrow`), field metadata kept."""
    fields = []
    for field in plain_schema(schema):
        spec = schema.fields.get(field.name)
        if spec is not None and spec.shape:
            field = field.with_type(pa.fixed_shape_tensor(field.type.value_type, list(spec.shape)))
        fields.append(field)
    return pa.schema(fields, metadata={**plain_schema(schema).metadata, **(metadata or {})})


def schema_of(arrow_schema: pa.Schema, where: str) -> Schema:
    """The arrowbuf schema recorded in a file's metadata.

    Raises:
        FormatError: the file was not written by arrowbuf.
    """
    text = (arrow_schema.metadata or {}).get(SCHEMA_KEY)
    if text is None:
        raise FormatError(f"{where}: no arrowbuf schema in the file metadata; not written by arrowbuf")
    try:
        return Schema.from_json(text.decode())
    except (ValueError, TypeError, KeyError) as err:
        raise FormatError(f"{where}: unreadable arrowbuf schema in the file metadata ({err})") from None


def check_columns(actual: pa.Schema, expected: pa.Schema, where: str) -> None:
    """Same column names and types (metadata aside).

    Raises:
        FormatError: naming the missing, unexpected or differently typed columns.
    """
    have = {f.name: f.type for f in actual}
    want = {f.name: f.type for f in expected}
    problems = []
    if list(have) != list(want):
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        problems.append(f"columns {list(have)}, expected {list(want)}"
                        + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else ""))
    for name in want:
        if name in have and not _same_type(have[name], want[name]):
            problems.append(f"column {name!r} is {have[name]}, expected {want[name]}")
    if problems:
        raise FormatError(f"{where}: not the schema of this arrowbuf data: " + "; ".join(problems))


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    if pa.types.is_fixed_size_list(a) and pa.types.is_fixed_size_list(b):
        return a.list_size == b.list_size and a.value_type == b.value_type
    return a == b


def batch_columns(batch: pa.RecordBatch, specs: Mapping[str, Field], where: str) -> dict[str, np.ndarray]:
    """numpy arrays of a plain (or tensor-typed, or exported) batch, one per spec, rows first;
    bfloat16 as its uint16 bits (an export's float32 values narrowed, `narrow_bfloat16`).

    Raises:
        FormatError: a column with nulls, or float32 values of a bfloat16 field that are
            not bfloat16 values.
    """
    try:
        columns = {name: encoded_rows(batch.column(name), spec, name) if spec.codec is not None
                   else ragged_rows(batch.column(name), name, spec.shape[1:]) if spec.ragged
                   else text_rows(batch.column(name), name) if spec.text
                   else arrow_to_numpy(batch.column(name), name, spec.shape) for name, spec in specs.items()}
        for name, spec in specs.items():
            if spec.dtype == "bfloat16" and columns[name].dtype == np.float32:
                columns[name] = narrow_bfloat16(columns[name], name)
        return columns
    except (SchemaError, FormatError) as err:
        raise FormatError(f"{where}: {err}") from None


def text_rows(column: pa.Array, name: str) -> np.ndarray:
    """The str rows of a text field's string column (a numpy object array).

    Raises:
        SchemaError: another type, or nulls.
    """
    rows = text_values(column, name)
    if rows is None:
        raise SchemaError(f"field {name!r} is text: a string column, got {column.type}")
    return rows


def encoded_rows(column: pa.Array, spec: Field, name: str) -> EncodedRows:
    """The rows of an encoded field's ``binary`` column, as stored (decoded when gathered).

    Raises:
        SchemaError: another type, or nulls.
    """
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise SchemaError(f"field {name!r} is encoded: a (large_)binary column, got {column.type}")
    if column.null_count:
        raise SchemaError(f"field {name!r} has {column.null_count} nulls; arrowbuf columns have none")
    rows = EncodedRows(column, spec.encoder)
    rows.check(name)
    return rows


# -- row snapshots ---------------------------------------------------------------------


@dataclass
class EpisodeRows:
    """The rows of consecutive live episodes of one shard, oldest first.

    ``batches`` hold one RecordBatch (plain columns) per contiguous run of rows:
    zero-copy views of the arena, or copies when taken with ``copy=True``.
    """

    ids: np.ndarray
    first_row: np.ndarray
    num_rows: np.ndarray
    batches: list[pa.RecordBatch]
    mark: tuple[int, int] | None = None   # `entry_mark` of the first episode, when taken from a shard

    @property
    def rows(self) -> int:
        return int(self.num_rows.sum())

    def still_live(self, shard: Any) -> bool:
        """Whether every row is still live (call under the lock that guards ``shard``): `none_freed`."""
        return none_freed(shard.table, self.mark)


def entry_mark(table: Any, position: int = 0) -> tuple[int, int] | None:
    """(episode_id, first_index) of the live entry at ``position`` of an episode table (None:
    no such entry): what `none_freed` compares."""
    if position >= len(table):
        return None
    return int(table.col("episode_id")[position]), int(table.col("first_index")[position])


def none_freed(table: Any, mark: tuple[int, int] | None) -> bool:
    """Whether no row of the entries from ``mark`` (`entry_mark`) on was freed since it was taken.

    Eviction is FIFO and ids only grow, so the oldest live entry decides: its id must not be
    past the marked one, and where it is the marked entry, no trim (which frees the oldest
    piece's first rows, `EpisodeTable.trim_oldest`) moved its ``first_index``.
    """
    if mark is None:
        return True
    live = table.col("episode_id")
    if not len(live):
        return False
    oldest = int(live[0])
    return mark[0] > oldest or (mark[0] == oldest and int(table.col("first_index")[0]) == mark[1])


def take_rows(shard: Any, start: int, stop: int, schema: pa.Schema, copy: bool) -> EpisodeRows:
    """Rows of the live episodes at positions ``[start, stop)`` of ``shard`` (0 = oldest).

    Call under the lock that guards the shard. With ``copy=False`` the batches are
    views that later writes to the shard can overwrite (see `EpisodeRows.still_live`).
    """
    table = shard.table
    first = table.col("first_row")[start:stop].copy()
    num = table.col("num_rows")[start:stop].copy()
    batches = []
    for a, b in position_runs(first, num):
        columns = shard_columns(shard, start + a, start + b)
        arrays = [plain_array(spec, columns[name].copy() if copy else columns[name])
                  for name, spec in shard.specs.items()]
        batches.append(pa.RecordBatch.from_arrays(arrays, schema=schema))
    return EpisodeRows(table.col("episode_id")[start:stop].copy(), first, num, batches, entry_mark(table, start))


def snapshot_and_write(lock: ContextManager, take: Callable[[bool], _T], valid: Callable[[_T], bool],
                       write: Callable[[_T], _R], discard: Callable[[_R], None]) -> tuple[_T, _R]:
    """Take a snapshot under ``lock`` (views), write it without the lock, check it.

    ``take(copy)`` runs under the lock; ``valid(snapshot)`` too, after the write.
    When the write raced an eviction, its output is discarded and the snapshot is
    taken again with ``copy=True`` (rows copied under the lock) and written.
    """
    with lock:
        snapshot = take(False)
    result = write(snapshot)
    with lock:
        if valid(snapshot):
            return snapshot, result
        snapshot = take(True)
    logger.info("episodes were evicted while their rows were written; writing a copy taken under the lock")
    discard(result)
    return snapshot, write(snapshot)


# -- files -----------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex (recorded in manifests, checked on load)."""
    digest = hashlib.sha256()   # read in chunks: hashlib.file_digest is Python 3.11+, and we support 3.10
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """What a manifest records to check a file: its size and content hash."""
    return {"bytes": path.stat().st_size, "sha256": file_digest(path)}


def check_hash_entry(entry: Mapping[str, Any], hashed: bool, where: Path) -> None:
    """Raises `FormatError` unless ``entry`` records a ``sha256`` where its format requires one
    (``hashed``: format version 2 on); a null there would skip every content check."""
    expected = entry.get("sha256")
    if hashed and not (isinstance(expected, str) and len(expected) == 64):
        raise FormatError(f"{where}: the entry of {entry.get('path', 'a file')!r} has sha256={expected!r}; this "
                          "format version records every file's content hash (64 hex digits), so the manifest was "
                          "edited or damaged")


def check_file(path: Path, entry: Mapping[str, Any], hashed: bool = True) -> None:
    """Check a file against its manifest entry: present, ``bytes`` long, and with
    its recorded ``sha256``, which ``hashed`` requires (manifests of format version 1
    have none: pass False for them).

    Raises:
        FormatError: naming the file and what differs.
    """
    check_hash_entry(entry, hashed, path)
    check_size(path, entry["bytes"])
    expected = entry.get("sha256")
    if expected is not None and file_digest(path) != expected:
        raise FormatError(f"{path}: its content hash differs from the one the manifest recorded; the file is "
                          "corrupted or was modified")


def _canonical(value: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in value.items() if k != CHECKSUM}, sort_keys=True,
                      separators=(",", ":")).encode()


def write_manifest(path: Path, value: Mapping[str, Any]) -> None:
    """Write a manifest with a checksum of its own content (`read_manifest` checks it).

    The file is written in place: manifests are written into a `FileSink`'s
    pending directory, whose commit flushes and publishes them.
    """
    sealed = {**value, CHECKSUM: hashlib.sha256(_canonical(value)).hexdigest()}
    path.write_text(json.dumps(sealed, indent=1))


def check_checksum(manifest: Mapping[str, Any], path: Path) -> None:
    """Check a manifest's checksum of its own content (required from format version 2).

    Raises:
        FormatError: no checksum where one is required, or content that differs.
    """
    found = manifest.get(CHECKSUM)
    if found is None:
        if manifest.get("format_version", 1) >= 2:
            raise FormatError(f"{path}: no {CHECKSUM!r}; the manifest is corrupted or was edited")
        return
    if found != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise FormatError(f"{path}: its content differs from its checksum; the manifest is corrupted or was edited")


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``.

    Raises:
        FormatError: missing, unreadable or not a JSON object.
    """
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise FormatError(f"{path}: missing; {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"{path}: unreadable JSON ({err}); the file is truncated or corrupted") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_manifest(directory: Path, kind: str) -> tuple[Path, dict]:
    """The manifest of an export (``kind="export"``) or checkpoint directory.

    Raises:
        FormatError: no such directory, no manifest (naming the other kind when
            the directory is one), or an unreadable one.
    """
    if not directory.is_dir():
        raise FormatError(f"{directory}: {'not a directory' if directory.exists() else 'no such directory'}; "
                          f"expected an arrowbuf {'Parquet export' if kind == 'export' else 'checkpoint'}")
    name, other = ((EXPORT_MANIFEST, CHECKPOINT_MANIFEST) if kind == "export"
                   else (CHECKPOINT_MANIFEST, EXPORT_MANIFEST))
    path = directory / name
    if not path.exists() and (directory / other).exists():
        if kind == "export":
            raise FormatError(f"{directory}: an arrowbuf checkpoint, not a Parquet export; open it with "
                              "ExperienceStore.load")
        raise FormatError(f"{directory}: a Parquet export, not a checkpoint; open it with "
                          "ExperienceStore.from_parquet or arrowbuf.read_parquet")
    what = ("not an arrowbuf Parquet export, or an export that did not finish" if kind == "export"
            else "not an arrowbuf checkpoint, or its first save did not finish")
    return path, read_json(path, what + " (the manifest is written last)")


def check_format(manifest: Mapping[str, Any], path: Path, fmt: str, version: int) -> None:
    """Check a manifest's format name, version and checksum (`check_checksum`).

    Raises:
        FormatError: another format, a version newer than this arrowbuf reads, or
            a manifest whose content does not match its checksum.
    """
    if manifest.get("format") != fmt:
        raise FormatError(f"{path}: format {manifest.get('format')!r}, expected {fmt!r}")
    found = manifest.get("format_version")
    if not isinstance(found, int) or found < 1:
        raise FormatError(f"{path}: bad format_version {found!r}")
    if found > version:
        raise FormatError(f"{path}: {fmt} format version {found} was written by arrowbuf "
                          f"{manifest.get('arrowbuf_version', '?')}; this arrowbuf ({__version__}) reads versions "
                          f"up to {version}. Upgrade arrowbuf to read it.")
    check_checksum(manifest, path)


def check_size(path: Path, expected: int) -> None:
    """Raises `FormatError` when ``path`` is missing or not ``expected`` bytes long."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FormatError(f"{path}: missing; the manifest lists it (a partial copy?)") from None
    if size != expected:
        raise FormatError(f"{path}: {size} bytes, but {expected} were written; the file is truncated or was "
                          "modified")


# -- JSON state with numpy arrays --------------------------------------------------------


def split_arrays(tree: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Replace the numpy arrays in nested dicts / lists by references; returns (JSON tree, arrays)."""
    arrays: dict[str, np.ndarray] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            key = f"a{len(arrays)}"
            arrays[key] = value
            return {_ARRAY: key, "dtype": value.dtype.name, "shape": list(value.shape)}
        if isinstance(value, Mapping):
            return {str(k): walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        if isinstance(value, np.generic):
            return value.item()
        return value

    return walk(tree), arrays


def join_rows(parts: list[Any]) -> Any:
    """One field's rows read in several batches (an episode across row groups), joined: numpy
    rows concatenated, `EncodedRows` and `RaggedRows` (which have no dense form) joined as such."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, EncodedRows):
        return EncodedRows.concat(parts)
    if isinstance(first, RaggedRows):
        offsets = np.zeros(sum(len(p) for p in parts) + 1, np.int64)
        np.cumsum(np.concatenate([p.lengths for p in parts]), out=offsets[1:])
        return RaggedRows(np.concatenate([p.values[p.offsets[0]:p.offsets[-1]] for p in parts]), offsets)
    return np.concatenate(parts)


def join_arrays(tree: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """Inverse of `split_arrays`."""
    if isinstance(tree, dict):
        if _ARRAY in tree:
            flat = arrays[tree[_ARRAY]]
            return np.array(flat, dtype=np.dtype(tree["dtype"])).reshape(tree["shape"])
        return {k: join_arrays(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_arrays(v, arrays) for v in tree]
    return tree


def arrays_table(arrays: Mapping[str, np.ndarray]) -> pa.Table:
    """One row, one list column per (flattened) array."""
    columns = {}
    for key, array in arrays.items():
        flat = np.ascontiguousarray(array).reshape(-1)
        columns[key] = pa.LargeListArray.from_arrays(pa.array([0, flat.size], pa.int64()), pa.array(flat))
    return pa.table(columns) if columns else pa.table({"_": pa.array([0], pa.int8())})


def table_arrays(table: pa.Table) -> dict[str, np.ndarray]:
    """Inverse of `arrays_table` (flat arrays)."""
    return {name: table.column(name)[0].values.to_numpy(zero_copy_only=False)
            for name in table.column_names if name != "_"}


# -- Arrow IPC -----------------------------------------------------------------------------


def ipc_batches(file: Path) -> Iterator[pa.RecordBatch]:
    """The record batches of an Arrow IPC file, each fully validated before it is
    handed out (no offset of the file is trusted unchecked).

    Raises:
        FormatError: an unreadable or invalid file, naming it.
    """
    try:
        with pa.memory_map(str(file)) as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                batch.validate(full=True)
                yield batch
    except (pa.ArrowException, OSError) as err:
        raise FormatError(f"{file}: not a readable Arrow IPC file ({err}); it is truncated or corrupted") from None


def ipc_schema(file: Path) -> pa.Schema:
    """The schema of an Arrow IPC file.

    Raises:
        FormatError: an unreadable file, naming it.
    """
    try:
        with pa.memory_map(str(file)) as source:
            return pa.ipc.open_file(source).schema
    except (pa.ArrowException, OSError) as err:
        raise FormatError(f"{file}: not a readable Arrow IPC file ({err}); it is truncated or corrupted") from None


def write_ipc(file: Path, schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> None:
    """Write record batches as an Arrow IPC file (into a sink's pending directory)."""
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
