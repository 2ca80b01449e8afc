"""The memory-mappable form of an offline dataset: rows as one Arrow IPC record batch.

`arrowbuf.dataset.open_dataset` samples a dataset straight from this form. Its
directory holds::

    rows.arrow        every row, episode after episode (an episode's T steps, then its
                      final observation when it has one: the arena's layout), as ONE
                      record batch of plain columns, so that each column is one
                      contiguous buffer that numpy views in place (flags stored as
                      uint8, bfloat16 as its uint16 bits, a shaped field as fixed-size binary
                      of its row's bytes: Arrow's IPC writer refuses an array of 2**31 or
                      more values, which a list column's values reach at 126M rows of
                      obs[17] or 14k rows of a 224x224x3 image; rows of bytes reach it only
                      at 2**31 rows. Version 1 caches, of fixed-size lists, are still read).
                      A video field (format 3) is stored as each row's frame reference
                      (`arrowbuf.video.FRAME_REF`), never as pixels: it is decoded when sampled.
                      An encoded, ragged or text field (format 4) is stored as where each
                      row's bytes lie in its heap file (`arrowbuf._dataset_heaps.HEAP_REF`)
    heap-<k>.bytes    an encoded or ragged field's rows as stored, one after another (an
                      encoded field's bytes are decoded when sampled), or a text field's
                      distinct strings, each once (`arrowbuf._dataset_heaps`)
    episodes.arrow    the episode table (id, first row, rows, transitions, flags, return...)
    _dataset.json     manifest, written last: format, schema, counts, the video fields'
                      files (`arrowbuf.video.VideoSpec`), the heap file of each encoded or
                      ragged field, the source it was
                      converted from (each file's size and mtime, hashes of its small
                      metadata files) and each cache file's size, mtime, ctime, inode
                      and SHA-256

A source (Parquet export, Arrow IPC directory, LeRobot dataset: `arrowbuf._dataset_sources`)
is converted once by `write_cache`: ``rows.arrow`` is laid out first with every value
zero (`_lay_out_rows`: the row count is known from the episodes), then the source's rows
stream into their places in it (memory stays bounded whatever the dataset's size, and
the disk holds one copy of the rows beside the source). `MappedRows` maps a checked cache with
``pyarrow.memory_map``; nothing is read until sampled, and `MappedRows.release` drops
the pages sampling touched from this process's resident set (they stay in the page
cache), which keeps resident memory bounded on datasets larger than memory.

Checks: every open compares each cache file's size with the manifest and parses the
IPC footer and batch layout (cheap); the SHA-256 of a cache file is checked too when
its stat differs from the one recorded (`_STAT`: mtime, and the inode and its change
time, which no user call sets back: a write whose mtime was restored with ``os.utime``,
or a copy that keeps it, ``cp -p`` or ``rsync -t``, changes them), or with
``verify=True``. A file found intact has its new stat recorded (when the directory is
writable), so a copied cache is hashed once, not at every open. A mismatch raises
`FormatError`. Damage that no write through the file system made (bit rot, a bad
disk) keeps the stat: only ``verify=True`` catches it.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pyarrow as pa

from arrowbuf._dataset_heaps import HEAP_REF, HeapFiles, heap_fields, is_heap_file
from arrowbuf._filesink import DirectorySink
from arrowbuf._persist import CHECKSUM, check_format, file_digest, progress_bar, read_json, write_manifest
from arrowbuf._resident import madvise
from arrowbuf.errors import FormatError
from arrowbuf.fields import Field
from arrowbuf.schema import Schema, unflatten
from arrowbuf.video import FRAME_REF, VideoSpec

FORMAT = "arrowbuf.dataset"
# 2: shaped fields as fixed-size binary (version 1's fixed-size lists are still read); 3: video
# fields as frame references; 4: encoded and ragged fields in heap files (versions 2 and 3 kept
# encoded fields decoded, and are still read so). A cache is written as the oldest version that
# holds its fields, which older readers open.
FORMAT_VERSION = 4
MANIFEST = "_dataset.json"
ROWS = "rows.arrow"
EPISODES = "episodes.arrow"
_DTYPE = b"arrowbuf.dtype"
#: What a cache file's recorded stat holds (manifest key: ``os.stat_result`` field). Any
#: write changes the change time (ctime), which no user call can set (``os.utime`` sets
#: only atime and mtime); a copy is a new inode.
_STAT = {"bytes": "st_size", "mtime_ns": "st_mtime_ns", "ctime_ns": "st_ctime_ns", "inode": "st_ino"}
_SHAPE = b"arrowbuf.shape"

#: Columns of the episode table in the cache (numpy dtypes); env_id and metadata are strings.
EPISODE_COLUMNS: dict[str, Any] = {
    "episode_id": np.int64, "first_row": np.int64, "num_rows": np.int64, "length": np.int64,
    "has_final": np.bool_, "terminated": np.bool_, "truncated": np.bool_, "return": np.float64,
    "inserted_at": np.int64,
}


@dataclass
class Source:
    """A dataset to convert: schema, episodes, and its rows in order.

    ``episodes`` holds one array per `EPISODE_COLUMNS` name but ``first_row`` and
    ``length`` (derived here), plus ``env_id`` and ``metadata`` (lists of str / None).
    ``rows()`` yields dicts of numpy arrays, one per schema field, rows first, in the
    order of the episodes (each episode's ``num_rows`` rows together); an encoded field's
    rows as stored (`arrowbuf.encoded.EncodedRows`), a ragged field's as
    `arrowbuf.ragged.RaggedRows`.
    ``files`` are the source files whose size and mtime decide whether a cache is
    still the source's; ``hashed`` the small ones whose SHA-256 decides it too.
    ``videos``: the video fields (`arrowbuf.video`), whose rows yield their frame
    references (`arrowbuf.video.FRAME_REF`) instead of pixels.
    """

    kind: str
    path: Path
    schema: Schema
    episodes: dict[str, Any]
    rows: Callable[[], Iterator[Mapping[str, np.ndarray]]]
    files: list[Path]
    hashed: list[Path]
    info: dict[str, Any]
    videos: dict[str, VideoSpec] = field(default_factory=dict)


def fingerprint(source_path: Path, files: list[Path], hashed: list[Path]) -> dict[str, Any]:
    """What a cache records of its source: each file's size and mtime, hashes of the small ones."""
    def rel(file: Path) -> str:
        return str(file.relative_to(source_path)) if file.is_relative_to(source_path) else str(file)

    entries = {}
    for file in files:
        stat = file.stat()
        entries[rel(file)] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    for file in hashed:
        entries.setdefault(rel(file), {})["sha256"] = file_digest(file)
    return entries


def stored_schema(schema: Schema, videos: Mapping[str, VideoSpec], heaps: Mapping[str, str]) -> Schema:
    """``schema`` as ``rows.arrow`` stores its rows: a video field as its frame references
    (`arrowbuf.video.FRAME_REF`), an encoded or ragged field of ``heaps`` as where each row's
    bytes lie in its heap file (`arrowbuf._dataset_heaps.HEAP_REF`)."""
    refs = {**dict.fromkeys(videos, FRAME_REF), **dict.fromkeys(heaps, HEAP_REF)}
    if not refs:
        return schema
    return Schema(unflatten({name: replace(refs[name], observation=spec.observation) if name in refs else spec
                             for name, spec in schema.fields.items()}))


def _arrow_field(name: str, spec: Field, version: int) -> pa.Field:
    value = _value_type(spec)
    if not spec.shape:
        arrow_type = value
    elif version == 1:
        arrow_type = pa.list_(value, int(np.prod(spec.shape, dtype=np.int64)))
    else:
        arrow_type = pa.binary(spec.row_bytes)
    return pa.field(name, arrow_type, nullable=False,
                    metadata={_DTYPE: spec.dtype.encode(), _SHAPE: json.dumps(list(spec.shape)).encode()})


def _value_type(spec: Field) -> pa.DataType:
    return pa.uint8() if spec.dtype == "bool" else pa.from_numpy_dtype(spec.numpy_dtype)


def rows_schema(schema: Schema, version: int = FORMAT_VERSION) -> pa.Schema:
    """The Arrow schema of ``rows.arrow`` of cache format ``version`` (one plain column per field)."""
    return pa.schema([_arrow_field(name, spec, version) for name, spec in schema.fields.items()],
                     metadata={b"arrowbuf.schema": schema.to_json().encode()})


def write_cache(directory: Path, source: Source, progress: bool | None = None) -> None:
    """Convert ``source`` into a cache at ``directory`` (replacing one that is there).

    Written through a `DirectorySink`: an interrupted conversion leaves no cache.

    Raises:
        FormatError: the source's rows disagree with its episode table.
    """
    # FORMAT_VERSION is read at the call: a test writes caches of older versions through it (which
    # keep encoded fields decoded, as those versions' writers did).
    heaps = heap_fields(source.schema) if FORMAT_VERSION >= 4 else {}
    schema = stored_schema(source.schema, source.videos, heaps)   # as the rows are stored
    episodes = source.episodes
    num_rows = np.asarray(episodes["num_rows"], np.int64)
    has_final = np.asarray(episodes["has_final"], bool)
    total = int(num_rows.sum())
    names = list(schema.fields)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with DirectorySink(directory) as sink:
        version = min(FORMAT_VERSION, 4 if heaps else 3 if source.videos else 2)
        where = _lay_out_rows(sink.pending / ROWS, schema, total, version)
        written = 0
        with open(sink.pending / ROWS, "r+b") as out, HeapFiles(sink.pending, source.schema, heaps) as heap, \
                progress_bar(progress, total, f"convert {source.path.name}") as bar:
            for columns in source.rows():
                arrays, count = [], None
                for name in names:
                    spec = schema.fields[name]
                    value = heap.append(name, columns[name], str(source.path)) if name in heaps else columns[name]
                    array = np.ascontiguousarray(value, dtype=spec.numpy_dtype)
                    if array.shape[1:] != spec.shape:
                        raise FormatError(f"{source.path}: field {name!r} has rows of shape {array.shape[1:]}, "
                                          f"expected {spec.shape}")
                    if count is None:
                        count = len(array)
                    elif len(array) != count:
                        raise FormatError(f"{source.path}: columns of unequal lengths in one batch of rows")
                    arrays.append(array)
                if written + (count or 0) > total:
                    written += count or 0
                    break
                for name, array in zip(names, arrays):   # each column's rows at their place in its buffer
                    if array.size:
                        os.pwrite(out.fileno(), memoryview(array.reshape(-1)).cast("B"),
                                  where[name] + written * schema.fields[name].row_bytes)
                written += count or 0
                bar.update(count or 0)
        if written != total:
            raise FormatError(f"{source.path}: {written} rows, but its episodes hold {total}")
        first_row = np.concatenate([[0], np.cumsum(num_rows)[:-1]]).astype(np.int64) if len(num_rows) else num_rows
        # With observation fields, an episode has T + 1 rows and T transitions with its final
        # observation, T rows and T - 1 transitions without (its last step has no next one).
        length = num_rows - 1 if schema.observation_names else num_rows - has_final
        table = {**{k: np.asarray(episodes[k], EPISODE_COLUMNS[k]) for k in EPISODE_COLUMNS
                    if k not in ("first_row", "length")},
                 "first_row": first_row, "length": length.astype(np.int64)}
        # Flags as uint8: converting an Arrow boolean array to numpy imports pandas (1 s at open).
        arrow = pa.table({**{k: pa.array(table[k].view(np.uint8) if table[k].dtype == bool else table[k])
                             for k in EPISODE_COLUMNS},
                          "env_id": pa.array(list(episodes["env_id"]), pa.string()),
                          "metadata": pa.array(list(episodes["metadata"]), pa.string())})
        with pa.OSFile(str(sink.pending / EPISODES), "wb") as out, pa.ipc.new_file(out, arrow.schema) as writer:
            writer.write_table(arrow)
        files = {}
        for name in (ROWS, EPISODES, *heaps.values()):
            stat = (sink.pending / name).stat()
            files[name] = {**_stat_entry(stat), "sha256": file_digest(sink.pending / name)}
        write_manifest(sink.pending / MANIFEST, {
            "format": FORMAT, "format_version": version, "schema": json.loads(source.schema.to_json()),
            **({"videos": {name: spec.to_json() for name, spec in source.videos.items()}} if source.videos else {}),
            **({"heaps": heaps} if heaps else {}),
            "num_rows": total, "num_episodes": len(num_rows), "num_transitions": int(length.sum()),
            "source": {"kind": source.kind, "path": str(source.path.resolve()), "info": source.info,
                       "files": fingerprint(source.path, source.files, source.hashed)},
            "files": files,
        })


def _lay_out_rows(path: Path, schema: Schema, rows: int, version: int) -> dict[str, int]:
    """Write ``rows.arrow`` at ``path`` with every column's values zero, and return where
    each column's values start in the file, for the conversion to write them in place.

    The zeros come from a sparse file (read without disk reads; the IPC writer writes them
    out), so the conversion never holds a second copy of the rows on disk: it needs the
    cache's size beside its source, not twice that (raw column files copied into the IPC
    file took 3x a 28 GB dataset, source included, and ran out of disk).
    """
    nbytes = max([rows * spec.row_bytes for spec in schema.fields.values()] + [0])
    holes = path.with_name(path.name + ".zeros")
    with open(holes, "wb") as f:
        f.truncate(nbytes)
    try:
        with open(holes, "rb") as f:
            zeros = pa.py_buffer(mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)) if nbytes else pa.py_buffer(b"")
        arrays = [_column_array(zeros, spec, rows, version) for spec in schema.fields.values()]
        batch = pa.RecordBatch.from_arrays(arrays, schema=rows_schema(schema, version))
        with pa.OSFile(str(path), "wb") as out, pa.ipc.new_file(out, batch.schema) as writer:
            writer.write_batch(batch)
        del arrays, batch, zeros
    finally:
        holes.unlink()
    with pa.memory_map(str(path)) as mapped:
        whole = mapped.read_buffer()
        batch = pa.ipc.open_file(pa.BufferReader(whole)).get_batch(0)
        where = {}
        for name, spec in schema.fields.items():
            column = batch.column(name)
            values = column.values if spec.shape and version == 1 else column
            where[name] = values.buffers()[1].address - whole.address if rows else 0
        del batch, whole
    return where


def _column_array(buffer: pa.Buffer, spec: Field, rows: int, version: int) -> pa.Array:
    """The column of ``rows`` rows of ``spec`` over the first bytes of ``buffer``."""
    buffer = buffer.slice(0, rows * spec.row_bytes)
    if not spec.shape:
        return pa.Array.from_buffers(_value_type(spec), rows, [None, buffer])
    if version == 1:
        size = int(np.prod(spec.shape, dtype=np.int64))
        return pa.FixedSizeListArray.from_arrays(pa.Array.from_buffers(_value_type(spec), rows * size, [None, buffer]), size)
    return pa.Array.from_buffers(pa.binary(spec.row_bytes), rows, [None, buffer])


# -- reading ----------------------------------------------------------------------------


def read_cache_manifest(directory: Path) -> dict[str, Any]:
    """The checked manifest of a cache directory.

    Raises:
        FormatError: missing, unreadable, of another format or a newer version.
    """
    if not directory.is_dir():
        raise FormatError(f"{directory}: no such directory; expected an arrowbuf dataset cache")
    path = directory / MANIFEST
    manifest = read_json(path, "not an arrowbuf dataset cache, or its conversion did not finish "
                               "(the manifest is written last)")
    check_format(manifest, path, FORMAT, FORMAT_VERSION)
    for key, kind in (("schema", dict), ("num_rows", int), ("num_episodes", int), ("files", dict), ("source", dict)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise FormatError(f"{path}: manifest entry {key!r} is {manifest.get(key)!r}; expected a {kind.__name__}")
    for name in {ROWS: None, EPISODES: None, **manifest["files"]}:
        entry = manifest["files"].get(name)
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), t) for k, t in
                                                  (("bytes", int), ("mtime_ns", int), ("sha256", str))):
            raise FormatError(f"{path}: manifest lacks a complete entry for {name} ({entry!r})")
        if name not in (ROWS, EPISODES) and not is_heap_file(name):
            raise FormatError(f"{path}: manifest lists {name!r}, not a file of a dataset cache")
    cache_videos(manifest, path)
    return manifest


def cache_videos(manifest: Mapping[str, Any], path: Path) -> dict[str, VideoSpec]:
    """The video fields a cache manifest (at ``path``) records, by field name.

    Raises:
        FormatError: a bad entry, one of no video field, or one in a cache older than format 3.
    """
    videos = manifest.get("videos", {})
    if not isinstance(videos, dict) or (videos and manifest["format_version"] < 3):
        raise FormatError(f"{path}: manifest entry 'videos' is {videos!r}; expected a mapping, in a cache of "
                          "format 3 or later")
    specs = {}
    for name, entry in videos.items():
        spec = VideoSpec.from_json(entry, f"{path}: video field {name!r}")
        field_spec = manifest["schema"].get(name)
        if not isinstance(field_spec, list) or field_spec[:2] != ["uint8", list(spec.shape)]:
            raise FormatError(f"{path}: video field {name!r} of shape {spec.shape} is not a uint8 field of that "
                              f"shape in the cache's schema ({field_spec!r})")
        specs[name] = spec
    return specs


def source_changed(manifest: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The source files whose size, mtime or hash differ from what the cache recorded."""
    recorded = manifest["source"].get("files", {})
    names = sorted(set(recorded) | set(current))
    return [name for name in names if recorded.get(name) != current.get(name)]


def _stat_entry(stat: os.stat_result) -> dict[str, int]:
    return {key: int(getattr(stat, field)) for key, field in _STAT.items()}


def check_cache_files(directory: Path, manifest: Mapping[str, Any], verify: bool) -> None:
    """Sizes always; SHA-256 when ``verify`` or a file's stat differs from the recorded one
    (`_STAT`; caches written before ctime and inode were recorded are hashed once). The
    stat of a file found intact is recorded (`_record_stats`).

    Raises:
        FormatError: naming the file and what differs.
    """
    restat = {}
    for name in manifest["files"]:
        entry, path = manifest["files"][name], directory / name
        try:
            stat = path.stat()
        except OSError:
            raise FormatError(f"{path}: missing; the dataset cache's manifest lists it") from None
        if stat.st_size != entry["bytes"]:
            raise FormatError(f"{path}: {stat.st_size} bytes, the cache's manifest says {entry['bytes']} "
                              "(truncated or overwritten)")
        changed = any(entry.get(key) != value for key, value in _stat_entry(stat).items())
        if (verify or changed) and file_digest(path) != entry["sha256"]:
            raise FormatError(f"{path}: its content differs from the cache's recorded SHA-256; the cache is "
                              "damaged (delete it, or open the source with rebuild=True, to convert again)")
        if changed:
            restat[name] = stat   # taken before the hash: a write during it changes the stat again
    if restat:
        _record_stats(directory, manifest, restat)


def _record_stats(directory: Path, manifest: Mapping[str, Any], stats: Mapping[str, os.stat_result]) -> None:
    """Record the stats of cache files just found intact in the manifest (replaced at once),
    so that the next open needs no hash; a directory this process cannot write keeps the
    old manifest (and every open hashes those files)."""
    files = {**manifest["files"], **{name: {**manifest["files"][name], **_stat_entry(stat)}
                                     for name, stat in stats.items()}}
    path = directory / MANIFEST
    pending = directory / f".{MANIFEST}.tmp-{os.getpid()}"
    try:
        write_manifest(pending, {**{k: v for k, v in manifest.items() if k != CHECKSUM}, "files": files})
        os.replace(pending, path)
    except OSError:
        try:
            pending.unlink(missing_ok=True)
        except OSError:
            pass


def read_episodes(directory: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The cache's episode table as numpy arrays (+ env_id, metadata lists), checked.

    Raises:
        FormatError: an unreadable file, a missing column, or values that do not
            describe the rows (first rows not consecutive, counts off).
    """
    path = directory / EPISODES
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
        table.validate(full=True)
        columns = {name: primitive_numpy(table.column(name).combine_chunks(), np.dtype(dtype), name).astype(dtype)
                   for name, dtype in EPISODE_COLUMNS.items()}
        columns["env_id"] = table.column("env_id").to_pylist()
        columns["metadata"] = table.column("metadata").to_pylist()
    except (pa.ArrowException, OSError, KeyError, ValueError, TypeError) as err:
        raise FormatError(f"{path}: not a readable episode table ({err})") from None
    n, rows = manifest["num_episodes"], manifest["num_rows"]
    num_rows, first_row, length = columns["num_rows"], columns["first_row"], columns["length"]
    expected_first = np.concatenate([[0], np.cumsum(num_rows)[:-1]]) if n else num_rows
    if (len(num_rows) != n or np.any(num_rows < 1) or int(num_rows.sum()) != rows
            or not np.array_equal(first_row, expected_first) or np.any(length < 0) or np.any(length > num_rows)
            or (n and int(length.sum()) != manifest.get("num_transitions"))):
        raise FormatError(f"{path}: its episodes do not describe the {rows} rows of {ROWS} "
                          "(counts, first rows or lengths disagree)")
    return columns


def primitive_numpy(array: pa.Array, dtype: np.dtype, name: str) -> np.ndarray:
    """A zero-copy numpy view of a primitive Arrow array without nulls (its data buffer).

    Not ``Array.to_numpy``: pyarrow imports pandas on its first call (1 s here).

    Raises:
        FormatError: nulls, or a buffer too short for the array.
    """
    data = array.buffers()[1] if len(array.buffers()) > 1 else None
    if array.null_count or data is None:
        raise FormatError(f"column {name!r} has nulls or no data buffer")
    start, stop = array.offset * dtype.itemsize, (array.offset + len(array)) * dtype.itemsize
    if stop > data.size:
        raise FormatError(f"column {name!r}: {len(array)} values need {stop} bytes, its buffer holds {data.size}")
    return np.frombuffer(data, dtype, len(array), start)


class MappedRows:
    """The columns of a cache's ``rows.arrow``, and its heap files, memory-mapped: numpy
    views, read-only (``columns`` by field; ``heaps``: each heap file's bytes by field).

    Args:
        directory: the cache directory (checked by `check_cache_files`).
        schema: the fields it must hold, as stored (`stored_schema`).
        num_rows: rows it must hold.
        version: the cache's format version (its manifest's).
        heaps: {field: heap file} (`arrowbuf._dataset_heaps.cache_heaps`).

    Raises:
        FormatError: not one record batch of the expected columns and rows, or a heap
            file that cannot be mapped.
    """

    def __init__(self, directory: Path, schema: Schema, num_rows: int, version: int = FORMAT_VERSION,
                 heaps: Mapping[str, str] | None = None) -> None:
        path = directory / ROWS
        self._files: list[Any] = []
        try:
            self._files.append(pa.memory_map(str(path)))
            reader = pa.ipc.open_file(self._files[0])
            if reader.num_record_batches != 1:
                raise FormatError(f"{path}: {reader.num_record_batches} record batches; a dataset cache has one")
            if not reader.schema.equals(rows_schema(schema, version)):
                raise FormatError(f"{path}: its columns differ from the cache manifest's schema {schema}")
            batch = reader.get_batch(0)
            batch.validate()   # buffer sizes against the row count: no read past the file
            if batch.num_rows != num_rows:
                raise FormatError(f"{path}: {batch.num_rows} rows, the cache's manifest says {num_rows}")
            self.columns: dict[str, np.ndarray] = {}
            for name, spec in schema.fields.items():
                column = batch.column(name)
                if column.null_count or column.offset:
                    raise FormatError(f"{path}: column {name!r} has nulls or an offset")
                dtype = np.dtype(np.uint8 if spec.dtype == "bool" else spec.numpy_dtype)
                if spec.shape and version == 1:
                    array = primitive_numpy(column.values, dtype, name)
                elif spec.shape:   # fixed-size binary: its data buffer holds the rows' values
                    array = primitive_numpy(column, np.dtype((np.void, spec.row_bytes)), name).view(dtype)
                else:
                    array = primitive_numpy(column, dtype, name)
                if spec.dtype == "bool":
                    array = array.view(np.bool_)
                self.columns[name] = array.reshape(num_rows, *spec.shape)
            self._files[0].seek(0)
            self._wholes = [self._files[0].read_buffer()]   # the mappings, for `release`
            self.heaps: dict[str, np.ndarray] = {}
            for name, file in (heaps or {}).items():
                path = directory / file
                self._files.append(pa.memory_map(str(path)))
                self._wholes.append(self._files[-1].read_buffer())
                self.heaps[name] = np.frombuffer(self._wholes[-1], np.uint8)
        except (pa.ArrowException, OSError, ValueError) as err:
            raise FormatError(f"{path}: not a readable dataset cache ({err}); it is truncated or damaged") from None
        self.nbytes = sum(whole.size for whole in self._wholes)
        # Sampling reads rows at random: a fault reads its page from disk, not a readahead
        # window around it. Sampling a 28 GB dataset on a 24 GB machine took 0.5-1 s a
        # W1 batch with the kernel's readahead (each of a batch's ~1,300 faults read up to
        # a few hundred KB), 17-40 ms without.
        self._advise(1)   # MADV_RANDOM

    def release(self) -> None:
        """Drop the mapped pages from this process's resident set (``MADV_DONTNEED``):
        they stay in the page cache, and the next read maps them again. Linux only; a
        no-op elsewhere."""
        self._advise(4)   # MADV_DONTNEED

    def _advise(self, advice: int) -> None:
        for whole in self._wholes:
            madvise(whole, advice)

    def close(self) -> None:
        self.columns, self.heaps = {}, {}
        self._wholes = []
        for file in self._files:
            file.close()
