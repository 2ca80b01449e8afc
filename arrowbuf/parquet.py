"""Parquet export and import: a directory any dataframe tool opens, and arrowbuf reloads.

Layout of ``store.to_parquet("out/")``::

    out/
      steps/part-00000-00000.parquet   rows of the live episodes, oldest first (whole
      steps/part-00000-00001.parquet   episodes per file; part-<shard>-<n>)
      episodes.parquet                 the episode table (``store.episodes()``)
      _arrowbuf.json                   manifest, written last: files, sizes, schema, store

Step columns are plain (see `arrowbuf._persist`): DuckDB, Polars and pandas read
them without arrowbuf (fixed-shape fields as fixed-size lists, flattened, the shape
in the field metadata). Every Parquet file carries the arrowbuf version, the schema
JSON (dtypes, shapes, which fields are observations) and the store's settings
(capacity, mode, creation time) in its key-value metadata.

An export is written into a hidden sibling directory and renamed into place, and
readers require the manifest: an interrupted export never looks complete.

Example:
    >>> import numpy as np, arrowbuf as ab, tempfile, os
    >>> store = ab.ExperienceStore(capacity=100, seed=0)
    >>> _ = store.add_episode({"obs": np.zeros((4, 3), np.float32), "action": np.zeros(3, np.int64)})
    >>> out = os.path.join(tempfile.mkdtemp(), "export")
    >>> _ = store.to_parquet(out)
    >>> ab.read_parquet(out).to_table().num_rows
    4
    >>> len(ab.ExperienceStore.from_parquet(out))
    3
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from arrowbuf._persist import (EpisodeRows, batch_columns, check_columns, check_format, check_size, fsync,
                               plain_schema, progress_bar, read_json, schema_of, snapshot_and_write, take_rows,
                               temp_path, write_json)
from arrowbuf.errors import CapacityError, FormatError
from arrowbuf.schema import SYSTEM_SPECS, Schema
from arrowbuf.shard import Episode, Shard

FORMAT = "arrowbuf.parquet"
FORMAT_VERSION = 1
MANIFEST = "_arrowbuf.json"
STEPS = "steps"
EPISODES = "episodes.parquet"
_GROUP_BYTES = 64 << 20       # target row-group size: streamed imports hold about one in memory
_EPISODE_COLUMNS = ("episode_id", "env_id", "num_rows", "length", "has_final", "inserted_at")

#: What `from_parquet` accepts as ``episode_filter``.
EpisodeFilter = Union[Callable[[pa.Table], Any], pc.Expression]


def group_rows(row_bytes: int) -> int:
    """Rows per Parquet row group (and per streamed batch): about 64 MiB."""
    return int(min(1 << 20, max(1024, _GROUP_BYTES // max(row_bytes, 1))))


def file_metadata(store_info: Mapping[str, Any]) -> dict[str, str]:
    """The key-value metadata of every file of an export."""
    from arrowbuf import __version__

    return {"arrowbuf.version": __version__, "arrowbuf.format": FORMAT,
            "arrowbuf.format_version": str(FORMAT_VERSION), "arrowbuf.store": json.dumps(dict(store_info))}


# -- export ----------------------------------------------------------------------------


def write_steps(rows: EpisodeRows, steps_dir: Path, shard: int, schema: pa.Schema, *, group: int,
                compression: str = "zstd", rows_per_file: int | None = None, bar: Any = None) -> list[dict[str, Any]]:
    """Write one shard's rows as ``part-<shard>-<n>.parquet`` files of whole episodes.

    A file gets episodes until the next would take it past ``rows_per_file`` rows
    (an episode longer than that gets a file of its own); row groups have ``group``
    rows. A shard without episodes writes one empty file, so the schema is there
    for readers.

    Returns:
        The manifest entries: path (relative to the export), shard, rows, episodes,
        first and last episode id, bytes.
    """
    table = pa.Table.from_batches(rows.batches, schema=schema)
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
        with pq.ParquetWriter(path, schema, compression=compression) as writer:
            for offset in range(0, max(part.num_rows, 1), group):
                piece = part.slice(offset, group)
                writer.write_table(piece, row_group_size=group)
                if bar is not None:
                    bar.update(piece.num_rows)
        ids = rows.ids[first_episode:stop]
        entries.append({"path": f"{STEPS}/{path.name}", "shard": shard, "rows": part.num_rows,
                        "episodes": len(ids), "first_episode_id": int(ids[0]) if len(ids) else None,
                        "last_episode_id": int(ids[-1]) if len(ids) else None, "bytes": path.stat().st_size})
        first_episode, first_row = stop, last_row
    return entries


def export_shard(shard: Shard, lock: Any, steps_dir: Path, schema: pa.Schema, *, shard_index: int = 0,
                 compression: str = "zstd", rows_per_file: int | None = None,
                 progress: bool | None = None) -> tuple[pa.Table, list[dict[str, Any]]]:
    """Write every live episode of ``shard`` into ``steps_dir``; returns (episode table, entries).

    ``lock`` guards the shard; it is held only to take the snapshot (see
    `arrowbuf._persist.snapshot_and_write`). A sharded store calls this once per shard.
    """
    def take(copy: bool) -> tuple[EpisodeRows, pa.Table]:
        episodes = shard.table.to_arrow()
        return (take_rows(shard, 0, len(shard.table), schema, copy),
                episodes.take(np.arange(episodes.num_rows)))    # a copy: the table's columns change

    def write(snapshot: tuple[EpisodeRows, pa.Table]) -> list[dict[str, Any]]:
        rows = snapshot[0]
        with progress_bar(progress, rows.rows, f"export {steps_dir.parent.name}") as bar:
            return write_steps(rows, steps_dir, shard_index, schema, group=group_rows(shard.schema.row_bytes),
                               compression=compression, rows_per_file=rows_per_file, bar=bar)

    def discard(entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            (steps_dir.parent / entry["path"]).unlink()

    (_, episodes), entries = snapshot_and_write(lock, take, lambda s: s[0].still_live(shard), write, discard)
    return episodes, entries


def export_store(store: Any, path: str | Path, *, compression: str = "zstd", rows_per_file: int | None = None,
                 progress: bool | None = None, overwrite: bool = False) -> Path:
    """`ExperienceStore.to_parquet`: write the export into a hidden sibling, then rename it.

    Raises:
        ValueError: the store has no schema yet, or a bad ``rows_per_file``.
        FileExistsError: ``path`` exists and is not empty, and ``overwrite`` is False.
    """
    if rows_per_file is not None and (isinstance(rows_per_file, bool) or not isinstance(rows_per_file, int)
                                      or rows_per_file < 1):
        raise ValueError(f"rows_per_file must be an int >= 1 or None, got {rows_per_file!r}")
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    with store._lock:
        shard = store._shard
    if shard is None:
        raise ValueError("nothing to export: the store has no schema yet (add an episode first)")
    info = store_info(store)
    schema = plain_schema(shard.schema, file_metadata(info))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        (tmp / STEPS).mkdir(parents=True)
        episodes, entries = export_shard(shard, store._lock, tmp / STEPS, schema, compression=compression,
                                         rows_per_file=rows_per_file, progress=progress)
        finish_export(tmp, shard.schema, info, episodes, entries)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def store_info(store: Any) -> dict[str, Any]:
    """The store settings recorded in an export."""
    return {"capacity": store.capacity, "mode": store.mode, "backend": store.backend, "num_shards": 1,
            "seed": store.seed, "sampler": repr(store.sampler),
            "created_at": _iso(getattr(store, "created_at", time.time()))}


def finish_export(directory: Path, schema: Schema, info: Mapping[str, Any], episodes: pa.Table,
                  entries: Sequence[Mapping[str, Any]]) -> None:
    """Write the episode table, then the manifest (last: it marks the export complete)."""
    from arrowbuf import __version__

    episodes = episodes.replace_schema_metadata(file_metadata(info))
    pq.write_table(episodes, directory / EPISODES, compression="zstd")
    for entry in entries:
        fsync(directory / entry["path"])
    fsync(directory / EPISODES)
    fsync(directory / STEPS)
    write_json(directory / MANIFEST, {
        "format": FORMAT, "format_version": FORMAT_VERSION, "arrowbuf_version": __version__,
        "exported_at": _iso(time.time()), "store": dict(info), "schema": json.loads(schema.to_json()),
        "steps": list(entries),
        "episodes": {"path": EPISODES, "rows": episodes.num_rows, "bytes": (directory / EPISODES).stat().st_size},
        "num_rows": sum(e["rows"] for e in entries), "num_episodes": episodes.num_rows,
    })


def _replace_dir(tmp: Path, path: Path) -> None:
    old = None
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:12]}")
        path.rename(old)
    tmp.rename(path)
    fsync(path.parent)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


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
    if not path.is_dir():
        raise FormatError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; expected an "
                          "arrowbuf Parquet export (a directory written by store.to_parquet)")
    manifest_path = path / MANIFEST
    manifest = read_json(manifest_path, "not an arrowbuf Parquet export, or an export that did not finish "
                                        "(the manifest is written last)")
    check_format(manifest, manifest_path, FORMAT, FORMAT_VERSION)
    try:
        schema = Schema.from_json(json.dumps(manifest["schema"]))
        files = list(manifest["steps"])
        episodes_entry = manifest["episodes"]
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{manifest_path}: incomplete manifest ({err!r})") from None
    expected = plain_schema(schema)
    for entry in files:
        file = path / entry["path"]
        metadata = _footer(file)
        check_columns(metadata.schema.to_arrow_schema(), expected, str(file))
        if schema_of(metadata.schema.to_arrow_schema(), str(file)) != schema:
            raise FormatError(f"{file}: its arrowbuf schema differs from the manifest's {schema}")
        if metadata.num_rows != entry["rows"]:
            raise FormatError(f"{file}: {metadata.num_rows} rows, the manifest says {entry['rows']}")
        check_size(file, entry["bytes"])
    listed = {(path / e["path"]).name for e in files}
    strays = sorted(p.name for p in (path / STEPS).glob("*.parquet") if p.name not in listed)
    if strays:
        raise FormatError(f"{path / STEPS}: files {strays} are not part of this export (the manifest lists "
                          f"{sorted(listed)}); plain readers of steps/*.parquet would mix them in")
    episodes_path = path / episodes_entry["path"]
    _footer(episodes_path)
    check_size(episodes_path, episodes_entry["bytes"])
    try:
        episodes = pq.read_table(episodes_path)
    except (pa.ArrowException, OSError) as err:
        raise FormatError(f"{episodes_path}: unreadable episode table ({err})") from None
    missing = [c for c in _EPISODE_COLUMNS if c not in episodes.column_names]
    if missing:
        raise FormatError(f"{episodes_path}: episode table lacks column(s) {missing}")
    return Export(path, manifest, schema, episodes, files)


def _footer(file: Path) -> pq.FileMetaData:
    if not file.exists():
        raise FormatError(f"{file}: missing; the export's manifest lists it (a partial copy?)")
    try:
        return pq.read_metadata(file)
    except (pa.ArrowException, OSError) as err:
        raise FormatError(f"{file}: not a readable Parquet file ({err}); it is truncated or corrupted") from None


def read_parquet(path: str | Path) -> ds.Dataset:
    """The step rows of an export as a lazy `pyarrow.dataset.Dataset`, tensor types restored.

    Fixed-shape fields come back as ``fixed_shape_tensor`` columns (as in
    `ExperienceStore.to_arrow`), observation roles in the field metadata. The
    dataset reads nothing until asked: ``.to_table()``, ``.to_batches()``,
    ``.scanner(filter=...)``, ``.head(n)``.

    Raises:
        FormatError: not a complete, readable arrowbuf export (see `open_export`).
    """
    export = open_export(path)
    meta = {k.encode(): v.encode() for k, v in file_metadata(export.store).items()}
    arrow = export.schema.to_arrow()
    schema = arrow.with_metadata({**arrow.metadata, **meta, b"arrowbuf.schema": export.schema.to_json().encode()})
    return ds.dataset([str(export.path / e["path"]) for e in export.files], schema=schema, format="parquet")


def select_episodes(episodes: pa.Table, episode_filter: EpisodeFilter | None) -> np.ndarray:
    """A boolean mask over the episode table from ``episode_filter``.

    The filter is a `pyarrow.compute.Expression` over the episode table's columns,
    or a callable taking the table and returning a boolean mask (one per episode)
    or the episode ids to keep.

    Raises:
        ValueError: a filter result of the wrong length, type, or with unknown ids.
    """
    n = episodes.num_rows
    if episode_filter is None:
        return np.ones(n, bool)
    ids = episodes.column("episode_id").to_numpy()
    if isinstance(episode_filter, pc.Expression):
        kept = episodes.filter(episode_filter).column("episode_id").to_numpy()
        return np.isin(ids, kept)
    if not callable(episode_filter):
        raise ValueError(f"episode_filter must be a callable or a pyarrow.compute.Expression, got {episode_filter!r}")
    result = episode_filter(episodes)
    if isinstance(result, (pa.Array, pa.ChunkedArray)):
        result = result.to_numpy(zero_copy_only=False)
    result = np.asarray(result)
    if result.dtype == bool:
        if result.shape != (n,):
            raise ValueError(f"episode_filter returned a mask of shape {result.shape}; expected ({n},), one per episode")
        return result
    if result.size and not np.issubdtype(result.dtype, np.integer):
        raise ValueError(f"episode_filter must return a boolean mask or episode ids, got dtype {result.dtype}")
    unknown = np.setdiff1d(result, ids)
    if unknown.size:
        raise ValueError(f"episode_filter returned ids not in the export: {unknown[:5].tolist()}")
    return np.isin(ids, result)


def newest_that_fit(num_rows: np.ndarray, selected: np.ndarray, capacity: int, mode: str) -> np.ndarray:
    """The selected episodes a store of ``capacity`` rows keeps: the newest whose rows fit.

    Raises:
        CapacityError: a selected episode is longer than the capacity, or
            ``mode="fixed"`` and they do not all fit.
    """
    too_long = selected & (num_rows > capacity)
    if too_long.any():
        raise CapacityError(f"{int(too_long.sum())} selected episode(s) have more rows than the capacity of "
                            f"{capacity} (up to {int(num_rows[too_long].max())}); raise capacity or filter them out")
    rows = np.where(selected, num_rows, 0)
    from_newest = np.cumsum(rows[::-1])[::-1]
    kept = selected & (from_newest <= capacity)
    if mode == "fixed" and not np.array_equal(kept, selected):
        raise CapacityError(f"the selected episodes take {int(rows.sum())} rows, more than the capacity of "
                            f"{capacity}, and mode='fixed' does not evict; raise capacity or filter episodes")
    return kept


def load_episodes(shard: Shard, export: Export, kept: np.ndarray, progress: bool | None = None) -> int:
    """Stream the kept episodes' rows into an empty ``shard``, oldest first; returns transitions added.

    Reads row group by row group (about 64 MiB each), skipping files and row groups
    without kept episodes. Episode ids and indices are kept when the kept episodes
    are consecutive (no filter, or only the oldest dropped); otherwise they are
    renumbered from 0.

    Raises:
        FormatError: rows that disagree with the episode table.
    """
    episodes = export.episodes.filter(pa.array(kept))
    ids = episodes.column("episode_id").to_numpy()
    info = {int(i): k for k, i in enumerate(ids)}
    num_rows = episodes.column("num_rows").to_numpy()
    has_final = episodes.column("has_final").to_numpy(zero_copy_only=False)
    env_ids = episodes.column("env_id").to_pylist()
    inserted = episodes.column("inserted_at").cast(pa.int64()).to_numpy()
    metadata = (episodes.column("metadata").to_pylist() if "metadata" in episodes.column_names
                else [None] * len(ids))
    _resume_numbering(shard, episodes, export.store)
    schema = export.schema
    specs = {**schema.fields, **SYSTEM_SPECS}
    group = group_rows(schema.row_bytes)
    added, transitions = 0, 0
    parts: list[dict[str, np.ndarray]] = []
    have = 0
    with progress_bar(progress, int(num_rows.sum()), f"import {export.path.name}") as bar:
        for entry in export.files:
            if not len(ids) or entry["episodes"] == 0 or not _overlaps(entry, ids):
                continue
            file = export.path / entry["path"]
            reader = pq.ParquetFile(file)
            groups = _row_groups(reader, int(ids.min()), int(ids.max()))
            try:
                batches = reader.iter_batches(batch_size=group, row_groups=groups)
                for batch in batches:
                    columns = batch_columns(batch, specs, str(file))
                    episode_ids = columns["episode_id"]
                    cuts = np.flatnonzero(episode_ids[1:] != episode_ids[:-1]) + 1
                    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(episode_ids)]):
                        k = info.get(int(episode_ids[a]))
                        if k is None:
                            continue
                        if k != added:
                            raise FormatError(f"{file}: rows of episode {int(episode_ids[a])} come before those "
                                              f"of episode {int(ids[added])}, or it has too few rows")
                        parts.append({name: array[a:b] for name, array in columns.items()})
                        have += b - a
                        if have > num_rows[k]:
                            raise FormatError(f"{file}: episode {int(ids[k])} has more than the {int(num_rows[k])} "
                                              "rows the episode table says")
                        if have == num_rows[k]:
                            episode = _episode(parts, schema, int(num_rows[k]), bool(has_final[k]), env_ids[k],
                                               metadata[k], int(inserted[k]))
                            shard.add(episode)
                            transitions += shard.transitions_of(episode)
                            bar.update(have)
                            parts, have, added = [], 0, added + 1
            except (pa.ArrowException, OSError) as err:
                raise FormatError(f"{file}: unreadable ({err}); the file is truncated or corrupted") from None
    if added != len(ids):
        raise FormatError(f"{export.path}: episode {int(ids[added])} of {EPISODES} has "
                          f"{'only some of its' if have else 'no'} rows in {STEPS}/")
    return transitions


def _resume_numbering(shard: Shard, episodes: pa.Table, store: Mapping[str, Any]) -> None:
    ids = episodes.column("episode_id").to_numpy()
    if not len(ids) or store.get("num_shards", 1) != shard.table.id_stride:
        return
    first_index = episodes.column("first_index").to_numpy() if "first_index" in episodes.column_names else None
    stride = shard.table.id_stride
    k, rest = divmod(int(ids[0]) - shard.table.id_offset, stride)
    consecutive = bool(np.all(np.diff(ids) == stride))
    if first_index is None or rest or k < 0 or not consecutive:
        return
    lengths = episodes.column("length").to_numpy()
    if np.array_equal(first_index[1:], first_index[:-1] + lengths[:-1]):
        shard.table.resume(k, int(first_index[0]))


def _episode(parts: list[dict[str, np.ndarray]], schema: Schema, num_rows: int, has_final: bool, env_id: str,
             metadata: str | None, inserted_at: int) -> Episode:
    steps = num_rows - int(has_final)
    columns = {}
    for name, spec in schema.fields.items():
        rows = parts[0][name] if len(parts) == 1 else np.concatenate([p[name] for p in parts])
        columns[name] = rows if spec.observation else rows[:steps]
    return Episode(columns, steps, has_final, env_id, json.loads(metadata) if metadata else None, inserted_at)


def _overlaps(entry: Mapping[str, Any], ids: np.ndarray) -> bool:
    first, last = entry["first_episode_id"], entry["last_episode_id"]
    return bool(np.any((ids >= first) & (ids <= last)))


def _row_groups(reader: pq.ParquetFile, low: int, high: int) -> list[int]:
    """Row groups whose episode_id statistics overlap [low, high] (all when unknown)."""
    column = reader.schema_arrow.get_field_index("episode_id")
    groups = []
    for g in range(reader.metadata.num_row_groups):
        stats = reader.metadata.row_group(g).column(column).statistics
        if stats is None or not stats.has_min_max or (stats.max >= low and stats.min <= high):
            groups.append(g)
    return groups


def load_store(cls: type, path: str | Path, capacity: int | None = None,
               episode_filter: EpisodeFilter | None = None, progress: bool | None = None,
               **store_kwargs: Any) -> Any:
    """`ExperienceStore.from_parquet`: a new store holding an export's (selected) episodes."""
    export = open_export(path)
    for name in ("schema", "backend"):
        if name in store_kwargs and not (name == "backend" and store_kwargs[name] == "local"):
            raise ValueError(f"from_parquet takes no {name}={store_kwargs[name]!r}: the schema comes from the "
                             "export and the store is local")
    capacity = int(export.store["capacity"]) if capacity is None else capacity
    mode = store_kwargs.setdefault("mode", export.store.get("mode", "circular"))
    store = cls(capacity, schema=export.schema, **store_kwargs)
    selected = select_episodes(export.episodes, episode_filter)
    kept = newest_that_fit(export.episodes.column("num_rows").to_numpy(), selected, store.capacity, mode)
    with store._lock:
        store.rate_limiter.inserts += load_episodes(store._shard, export, kept, progress)
    return store
