"""Parquet export: a directory any dataframe tool opens, and arrowbuf reloads.

Layout of ``store.to_parquet("out/")``::

    out/
      steps/part-00000-00000.parquet   rows of the live episodes, oldest first (whole
      steps/part-00000-00001.parquet   episodes per file; part-<shard>-<n>)
      episodes.parquet                 the episode table (``store.episodes()``)
      _arrowbuf.json                   manifest, written last: files, sizes, schema, store

Step columns open in any Arrow or Parquet reader (DuckDB, Polars, pandas) without
arrowbuf: bfloat16 fields are widened to float32 (exactly: every bfloat16 is a
float32), fixed-shape fields use Arrow's canonical ``arrow.fixed_shape_tensor``
extension type (its storage a fixed-size list of the flattened values), and each
field's metadata keeps its role, arrowbuf dtype and shape, from which `from_parquet`
restores bfloat16 bit for bit (format 4, `arrowbuf.fields.export_type`; exports of
formats 1-3 hold the plain columns of `arrowbuf._persist`, uint16 bits for bfloat16,
and load as before). Rows follow RLDS (`ROW_CONVENTION`, also in every file's
metadata): one per step, and an episode stored with its final observation has one
row more, holding it, with zeros in its step fields; a ``final_observation`` bool
column marks those rows, as Ray Data does (format 3; exports of format 2 lack it
and load as before). Every Parquet file carries the arrowbuf version, the schema
JSON (dtypes, shapes, which fields are observations) and the store's settings
(capacity, mode, creation time) in its key-value metadata.

An export is written through a `arrowbuf._filesink.DirectorySink`: into a hidden
sibling directory, flushed, then renamed into place (an old export is swapped out
atomically and deleted only after), and readers require the manifest: an
interrupted export never looks complete. Every page carries a CRC checksum that
readers verify, and the manifest records every file's size and SHA-256 (checked
by `from_parquet` for the files it reads) and a checksum of its own content.
`open_export` checks a directory, `read_parquet` opens its rows as a dataset, and
`arrowbuf.parquet_load` loads it into a store (`ExperienceStore.from_parquet`).

Example:
    >>> import numpy as np, arrowbuf as ab, tempfile, os
    >>> store = ab.ExperienceStore(capacity=100, seed=0)
    >>> _ = store.add_episode({"obs": np.zeros((4, 3), np.float32), "action": np.zeros(3, np.int64),
    ...                        "terminated": np.array([False, False, True])})
    >>> out = os.path.join(tempfile.mkdtemp(), "export")
    >>> _ = store.to_parquet(out)
    >>> ab.read_parquet(out).to_table().num_rows
    4
    >>> len(ab.ExperienceStore.from_parquet(out))
    3
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from arrowbuf._checks import check_bool, check_compression, check_progress, is_int
from arrowbuf._filesink import DirectorySink, aside_copies
from arrowbuf._persist import (EXPORT_MANIFEST, EpisodeRows, check_columns, check_file, check_format,
                               check_hash_entry, check_size, file_entry, none_freed, plain_array, plain_schema,
                               progress_bar, read_manifest,
                               schema_of, snapshot_and_write,
                               take_rows, tensor_schema, write_manifest)
from arrowbuf._version import __version__
from arrowbuf.errors import FormatError
from arrowbuf.fields import export_array, export_type
from arrowbuf.played import Played, episodes_arrow, group_played, played_rows
from arrowbuf.schema import Schema
from arrowbuf.shard import MODES, Shard
from arrowbuf.shard_arrow import open_returns, open_tail_columns

FORMAT = "arrowbuf.parquet"
# 2: page checksums, content hashes of every file and of the manifest; 3: final_observation;
# 4: bfloat16 widened to float32, fixed shapes as arrow.fixed_shape_tensor (`step_schema`)
FORMAT_VERSION = 4
#: The export-only column marking each episode's final-observation row (Ray Data's name).
FINAL_OBSERVATION = "final_observation"
#: What a step file's rows are, in words (every file's metadata, ``arrowbuf.row_convention``).
ROW_CONVENTION = (
    "One row per step (RLDS): a step's observation fields hold the observation before it, its other fields "
    "(action, reward, terminated, truncated, ...) what the step did. An episode stored with its final observation "
    "(has_final in episodes.parquet) has one row more, after its last step: final_observation=True and "
    "is_last=True, its observation fields hold the final observation and its step fields zeros; the episode's "
    "terminated / truncated flags are on the row before it. The next observation of step t is row t+1.")
MANIFEST = EXPORT_MANIFEST
STEPS = "steps"
EPISODES = "episodes.parquet"
_GROUP_BYTES = 64 << 20       # target row-group size: streamed imports hold about one in memory
_EPISODE_COLUMNS = ("episode_id", "env_id", "num_rows", "length", "has_final", "inserted_at")

if TYPE_CHECKING:   # pyarrow.dataset takes ~0.3 s to import: only when used
    import pyarrow.dataset as ds


def group_rows(row_bytes: int) -> int:
    """Rows per Parquet row group (and per streamed batch): about 64 MiB."""
    return int(min(1 << 20, max(1024, _GROUP_BYTES // max(row_bytes, 1))))


def file_metadata(store_info: Mapping[str, Any]) -> dict[str, str]:
    """The key-value metadata of every file of an export."""
    return {"arrowbuf.version": __version__, "arrowbuf.format": FORMAT, "arrowbuf.row_convention": ROW_CONVENTION,
            "arrowbuf.format_version": str(FORMAT_VERSION), "arrowbuf.store": json.dumps(dict(store_info))}


# -- export ----------------------------------------------------------------------------


def export_schema(plain: pa.Schema) -> pa.Schema:
    """The columns of a step file: the plain columns and ``final_observation``."""
    role = {b"arrowbuf.role": b"export", b"arrowbuf.doc": b"this row holds its episode's final observation"}
    return plain.append(pa.field(FINAL_OBSERVATION, pa.bool_(), nullable=False, metadata=role))


def step_schema(schema: Schema, version: int, metadata: Mapping[str, str] | None = None) -> pa.Schema:
    """The columns of a step file of format ``version``: the plain columns
    (`arrowbuf._persist.plain_schema`), in the export encoding from format 4
    (`encoded`), with ``final_observation`` from format 3."""
    columns = plain_schema(schema, metadata)
    if version >= 4:
        columns = encoded(columns, schema)
    return export_schema(columns) if version >= 3 else columns


def encoded(plain: pa.Schema, schema: Schema) -> pa.Schema:
    """``plain`` with the user fields typed as exports write them (`arrowbuf.fields.export_type`),
    field and schema metadata kept."""
    return pa.schema([f.with_type(export_type(schema.fields[f.name])) if f.name in schema.fields else f for f in plain],
                     metadata=plain.metadata)


def encode_columns(table: pa.Table, schema: Schema) -> pa.Table:
    """The plain columns of ``table`` in the export encoding (`arrowbuf.fields.export_array`)."""
    for i, field in enumerate(table.schema):
        spec = schema.fields.get(field.name)
        if spec is None or (not spec.shape and spec.dtype != "bfloat16"):
            continue
        kind = export_type(spec)
        chunks = [export_array(spec, chunk) for chunk in table.column(i).chunks]
        table = table.set_column(i, field.with_type(kind), pa.chunked_array(chunks, kind))
    return table


def final_observations(num_rows: np.ndarray, has_final: np.ndarray) -> np.ndarray:
    """The ``final_observation`` column of consecutive episodes: the last row of each
    episode stored with its final observation."""
    column = np.zeros(int(num_rows.sum()), bool)
    column[np.cumsum(num_rows)[has_final] - 1] = True
    return column


def write_steps(rows: EpisodeRows, steps_dir: Path, shard: int, schema: pa.Schema, has_final: np.ndarray, *,
                group: int, compression: str = "zstd", rows_per_file: int | None = None,
                bar: Any = None) -> list[dict[str, Any]]:
    """Write one shard's rows as ``part-<shard>-<n>.parquet`` files of whole episodes,
    with the ``final_observation`` column (``has_final``: one flag per episode).

    A file gets episodes until the next would take it past ``rows_per_file`` rows
    (an episode longer than that gets a file of its own); row groups have ``group``
    rows. A shard without episodes writes one empty file, so the schema is there
    for readers.

    Returns:
        The manifest entries: path (relative to the export), shard, rows, episodes,
        first and last episode id, bytes.
    """
    table = pa.Table.from_batches(rows.batches, schema=schema)
    fields = schema_of(schema, str(steps_dir))
    encode = FORMAT_VERSION >= 4     # read at the call: a test writes an export of format 3 through it
    schema = export_schema(encoded(schema, fields) if encode else schema)
    table = table.append_column(schema.field(FINAL_OBSERVATION),
                                pa.array(final_observations(rows.num_rows, np.asarray(has_final, bool))))
    limit = rows_per_file or max(rows.rows, 1)
    ends = np.cumsum(rows.num_rows)
    entries, first_episode, first_row = [], 0, 0
    while first_episode < len(rows.ids) or not entries:
        stop = first_episode + 1
        while stop < len(rows.ids) and ends[stop] - first_row <= limit:
            stop += 1
        stop = min(stop, len(rows.ids))
        last_row = int(ends[stop - 1]) if stop else 0
        path = steps_dir / f"part-{shard:05d}-{len(entries):05d}.parquet"
        part = table.slice(first_row, last_row - first_row)
        with pq.ParquetWriter(path, schema, compression=compression, write_page_checksum=True) as writer:
            for offset in range(0, max(part.num_rows, 1), group):
                piece = part.slice(offset, group)
                writer.write_table(encode_columns(piece, fields) if encode else piece, row_group_size=group)
                if bar is not None:
                    bar.update(piece.num_rows)
        ids = rows.ids[first_episode:stop]
        entries.append({"path": f"{STEPS}/{path.name}", "shard": shard, "rows": part.num_rows,
                        "episodes": len(ids), "first_episode_id": int(ids[0]) if len(ids) else None,
                        "last_episode_id": int(ids[-1]) if len(ids) else None, **file_entry(path)})
        first_episode, first_row = stop, last_row
    return entries


def export_shard(shard: Shard, lock: Any, steps_dir: Path, schema: pa.Schema, *, shard_index: int = 0,
                 compression: str = "zstd", rows_per_file: int | None = None, progress: bool | None = None,
                 label: str = "export") -> tuple[pa.Table, list[dict[str, Any]]]:
    """Write every live episode of ``shard`` into ``steps_dir``; returns (episode table, entries).

    ``lock`` guards the shard; it is held only to take the snapshot (see
    `arrowbuf._persist.snapshot_and_write`). A sharded store calls this once per shard.
    """
    def take(copy: bool) -> tuple[EpisodeRows, pa.Table, Any]:
        table = shard.table
        rows = take_rows(shard, 0, len(table), schema, copy)
        if table.num_open:   # open episodes: their written steps too, as to_arrow() reads them
            rows, played = with_open_tails(shard, rows, schema)
            return merged_rows(table, played, rows), episodes_arrow(
                table, True, played=played, open_returns=open_returns(shard)).drop(["open"]), rows.mark
        if table.pieces:   # pieces are storage: one episode, its rows once, as a whole one
            played = group_played(table, sealed_only=True)
            return merged_rows(table, played, rows), episodes_arrow(table, True, played=played).drop(["open"]), \
                rows.mark
        episodes = table.to_arrow()
        return rows, episodes.take(np.arange(episodes.num_rows)), rows.mark   # a copy: the table's columns change

    def still_live(snapshot: tuple[EpisodeRows, pa.Table, Any]) -> bool:
        return none_freed(shard.table, snapshot[2])

    def write(snapshot: tuple[EpisodeRows, pa.Table, Any]) -> list[dict[str, Any]]:
        rows, episodes, _ = snapshot
        has_final = episodes.column("has_final").to_numpy(zero_copy_only=False)
        with progress_bar(progress, rows.rows, label) as bar:
            return write_steps(rows, steps_dir, shard_index, schema, has_final,
                               group=group_rows(shard.schema.row_bytes),
                               compression=compression, rows_per_file=rows_per_file, bar=bar)

    def discard(entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            (steps_dir.parent / entry["path"]).unlink()

    (_, episodes, _), entries = snapshot_and_write(lock, take, still_live, write, discard)
    return episodes, entries


def merged_rows(table: Any, played: Played, rows: EpisodeRows) -> EpisodeRows:
    """``rows`` (of every sealed entry of ``table``, in its order, then of its open tails where
    ``rows`` holds them) as one run per played episode (`arrowbuf.played.played_rows`)."""
    merged, per_episode = played_rows(table, played, pa.Table.from_batches(rows.batches), rows.num_rows)
    return EpisodeRows(played.episode.copy(), table.ecol("first_row")[played.first].copy(), per_episode,
                       merged.combine_chunks().to_batches())


def with_open_tails(shard: Shard, rows: EpisodeRows, schema: pa.Schema) -> tuple[EpisodeRows, Played]:
    """``rows`` (of the sealed entries) followed by the open tails' written rows, copied
    (`arrowbuf.shard_arrow.open_tail_columns`), and the entries grouped by played episode; an
    open episode none of whose pieces is sealed yet (no id) is numbered after the store's newest."""
    table = shard.table
    tails = [pa.RecordBatch.from_arrays([plain_array(spec, columns[name]) for name, spec in shard.specs.items()],
                                        schema=schema) for columns in open_tail_columns(shard)]
    played = group_played(table)
    unknown = np.flatnonzero(played.episode < 0)
    episode = played.episode.copy()
    episode[unknown] = [table.episode_id_of(table.episodes_added + k) for k in range(len(unknown))]
    n = len(table) + table.num_open
    rows = EpisodeRows(table.ecol("episode_id")[:n].copy(), table.ecol("first_row")[:n].copy(),
                       table.ecol("num_rows")[:n].copy(), rows.batches + tails, rows.mark)
    return rows, replace(played, episode=episode)


def export_store(store: Any, export_steps: Callable[..., tuple[pa.Table, list]], path: str | Path, *,
                 compression: str = "zstd", rows_per_file: int | None = None, progress: bool | None = None,
                 overwrite: bool = False) -> Path:
    """`ExperienceStore.to_parquet`: written through a `DirectorySink` (a hidden sibling
    directory, flushed, then swapped in: an old export stays until the new one is complete).

    ``export_steps(steps_dir, schema, **options)`` writes the rows of every shard
    (the backend's; see `export_shard`) and returns (episode table, file entries).

    Raises:
        ValueError: the store has no schema yet, or a bad ``compression``, ``rows_per_file``,
            ``progress`` or ``overwrite``.
        FileExistsError: ``path`` exists and is not empty, and ``overwrite`` is False.
    """
    compression, progress = check_compression(compression), check_progress(progress)
    overwrite = check_bool("overwrite", overwrite)
    if rows_per_file is not None and not is_int(rows_per_file, 1):
        raise ValueError(f"rows_per_file must be an int >= 1 or None, got {rows_per_file!r}")
    rows_per_file = int(rows_per_file) if rows_per_file is not None else None
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    store_schema = store.schema
    if store_schema is None:
        raise ValueError("nothing to export: the store has no schema yet (add an episode first)")
    info = store_info(store)
    schema = plain_schema(store_schema, file_metadata(info))
    with DirectorySink(path) as sink:
        (sink.pending / STEPS).mkdir()
        episodes, entries = export_steps(sink.pending / STEPS, schema, compression=compression,
                                         rows_per_file=rows_per_file, progress=progress, label=f"export {path.name}")
        finish_export(sink.pending, store_schema, info, episodes, entries)
    return path


def store_info(store: Any) -> dict[str, Any]:
    """The store settings recorded in an export."""
    return {"capacity": store.capacity, "mode": store.mode, "backend": store.backend,
            "num_shards": getattr(store, "num_shards", 1),
            "seed": store.seed, "sampler": repr(store.sampler),
            "created_at": _iso(store.created_at)}


def finish_export(directory: Path, schema: Schema, info: Mapping[str, Any], episodes: pa.Table,
                  entries: Sequence[Mapping[str, Any]]) -> None:
    """Write the episode table, then the manifest (it lists every file with its hash)."""
    episodes = episodes.replace_schema_metadata(file_metadata(info))
    pq.write_table(episodes, directory / EPISODES, compression="zstd", write_page_checksum=True)
    write_manifest(directory / MANIFEST, {
        "format": FORMAT, "format_version": FORMAT_VERSION, "arrowbuf_version": __version__,
        "exported_at": _iso(time.time()), "store": dict(info), "schema": json.loads(schema.to_json()),
        "steps": list(entries),
        "episodes": {"path": EPISODES, "rows": episodes.num_rows, **file_entry(directory / EPISODES)},
        "num_rows": sum(e["rows"] for e in entries), "num_episodes": episodes.num_rows,
    })


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


# -- import ----------------------------------------------------------------------------


@dataclass
class Export:
    """A checked export: its manifest, schema, episode table and step files."""

    path: Path
    manifest: dict[str, Any]
    schema: Schema
    episodes: pa.Table
    files: list[dict[str, Any]]

    @property
    def store(self) -> dict[str, Any]:
        return self.manifest["store"]


def open_export(path: str | Path) -> Export:
    """Check an export directory (manifest, version, every file's size and schema).

    Raises:
        FormatError: a missing or incomplete directory, a newer format, a missing,
            truncated or foreign file; the message names the file.
    """
    path = Path(path)
    if not path.exists() and aside_copies(path):
        raise FormatError(f"{path}: no such directory, but {aside_copies(path)[-1]} holds the export it replaced: "
                          "an overwrite was interrupted; rename that directory back to use it")
    manifest_path, manifest = read_manifest(path, "export")
    check_format(manifest, manifest_path, FORMAT, FORMAT_VERSION)
    try:
        schema = Schema.from_json(json.dumps(manifest["schema"]))
        files = list(manifest["steps"])
        episodes_entry = manifest["episodes"]
        hashed = manifest["format_version"] >= 2
        for entry in files:
            _check_entry(entry, _STEP_ENTRY, manifest_path)
            check_hash_entry(entry, hashed, manifest_path)
        _check_entry(episodes_entry, _FILE_ENTRY, manifest_path)
        check_hash_entry(episodes_entry, hashed, manifest_path)
        _check_entry(manifest["store"], _STORE_ENTRY, manifest_path)
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{manifest_path}: incomplete manifest ({err!r})") from None
    store = manifest["store"]
    if store["capacity"] < 1 or store["mode"] not in MODES:   # what `from_parquet` makes its store with
        raise FormatError(f"{manifest_path}: store settings capacity={store['capacity']!r}, mode={store['mode']!r}; "
                          f"expected a capacity >= 1 and a mode of {MODES}")
    expected = step_schema(schema, manifest["format_version"])
    for entry in files:
        file = path / entry["path"]
        num_rows, arrow_schema = _footer(file)
        check_columns(arrow_schema, expected, str(file))
        if schema_of(arrow_schema, str(file)) != schema:
            raise FormatError(f"{file}: its arrowbuf schema differs from the manifest's {schema}")
        if num_rows != entry["rows"]:
            raise FormatError(f"{file}: {num_rows} rows, the manifest says {entry['rows']}")
        check_size(file, entry["bytes"])
    listed = {(path / e["path"]).name for e in files}
    strays = sorted(p.name for p in (path / STEPS).glob("*.parquet") if p.name not in listed)
    if strays:
        raise FormatError(f"{path / STEPS}: files {strays} are not part of this export (the manifest lists "
                          f"{sorted(listed)}); plain readers of steps/*.parquet would mix them in")
    episodes_path = path / episodes_entry["path"]
    check_file(episodes_path, episodes_entry, hashed)
    try:
        episodes = pq.read_table(episodes_path, page_checksum_verification=True)
        names = episodes.column_names     # decoded here: a name may not be UTF-8
    except (pa.ArrowException, OSError, ValueError) as err:
        raise FormatError(f"{episodes_path}: unreadable episode table ({err})") from None
    missing = [c for c in _EPISODE_COLUMNS if c not in names]
    if missing:
        raise FormatError(f"{episodes_path}: episode table lacks column(s) {missing}")
    return Export(path, manifest, schema, episodes, files)


_FILE_ENTRY = {"path": str, "rows": int, "bytes": int, "sha256": (str, type(None))}
_STEP_ENTRY = {**_FILE_ENTRY, "episodes": int, "first_episode_id": (int, type(None)),
               "last_episode_id": (int, type(None))}
_STORE_ENTRY = {"capacity": int, "mode": str}


def _check_entry(entry: Any, fields: Mapping[str, Any], where: Path) -> None:
    """Raises `FormatError` unless a manifest entry has ``fields`` of their types, and
    its file path (if any) is a relative path inside the export."""
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: manifest entry {entry!r} is not an object")
    for key, kind in fields.items():
        value = entry.get(key)
        if key not in entry or isinstance(value, bool) or not isinstance(value, kind):
            raise FormatError(f"{where}: manifest entry {entry!r} has {key}={value!r}; expected {kind}")
    name = entry.get("path", "")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise FormatError(f"{where}: file {name!r} is not a path inside the export")


def _footer(file: Path) -> tuple[int, pa.Schema]:
    """The row count and Arrow schema in a Parquet file's footer.

    Raises:
        FormatError: a missing file, or a footer that does not parse.
    """
    if not file.exists():
        raise FormatError(f"{file}: missing; the export's manifest lists it (a partial copy?)")
    try:
        metadata = pq.read_metadata(file)
        schema = metadata.schema.to_arrow_schema()
        _ = schema.names                  # decoded here: a name may not be UTF-8
        return metadata.num_rows, schema
    except (pa.ArrowException, OSError, ValueError) as err:
        raise FormatError(f"{file}: not a readable Parquet file ({err}); it is truncated or corrupted") from None


def read_parquet(path: str | Path) -> ds.Dataset:
    """The step rows of an export as a lazy `pyarrow.dataset.Dataset`, tensor types restored.

    Fixed-shape fields come back as ``fixed_shape_tensor`` columns (as in
    `ExperienceStore.to_arrow`), bfloat16 fields as the float32 values an export
    holds (exports of formats 1-3: their uint16 bits), with role, dtype and shape in the field
    metadata and the arrowbuf schema in the schema metadata; a ``final_observation``
    column marks final-observation rows (`ROW_CONVENTION`; not in exports of format
    2). Every step file's content hash is checked first (one pass over the bytes, as
    `from_parquet` does), so damaged bytes raise `FormatError` here rather than an
    untyped error from a later scan; the dataset then reads only what it is asked for:
    ``.to_table()``, ``.to_batches()``, ``.scanner(filter=...)``, ``.head(n)``.

    Raises:
        FormatError: not a complete, readable arrowbuf export (see `open_export`),
            or a step file whose bytes differ from the manifest's hash.
    """
    import pyarrow.dataset as ds

    export = open_export(path)
    hashed = export.manifest["format_version"] >= 2
    for entry in export.files:
        check_file(export.path / entry["path"], entry, hashed)
    version = export.manifest["format_version"]
    if version >= 4:
        schema = step_schema(export.schema, version, file_metadata(export.store))
    else:
        meta = {k.encode(): v.encode() for k, v in file_metadata(export.store).items()}
        schema = tensor_schema(export.schema, meta)
        if version >= 3:
            schema = export_schema(schema)
    checked = ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(
        page_checksum_verification=True))
    return ds.dataset([str(export.path / e["path"]) for e in export.files], schema=schema, format=checked)
