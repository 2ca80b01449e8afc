"""What `arrowbuf.open_dataset` reads: sources converted once into a dataset cache.

Each reader checks a source and describes it as a `arrowbuf._dataset_cache.Source`
(schema, episode table, a stream of rows in episode order) without loading its rows:

- `export_source`: an arrowbuf Parquet export (``store.to_parquet``), checked by
  `arrowbuf.parquet.open_export`; every file's SHA-256 and page checksums are
  verified as it is converted.
- `ipc_source`: an Arrow IPC directory: ``episodes.arrow`` (``store.episodes()``)
  and one or more other ``*.arrow`` files of rows (``store.to_arrow()``), in name order.
- `lerobot_source`: the tabular data of a LeRobot v3 dataset (``meta/info.json``,
  ``data/chunk-XXX/file-XXX.parquet``, ``meta/episodes/...``); see `lerobot_source`
  for how its columns become fields.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from arrowbuf._dataset_cache import Source
from arrowbuf._persist import batch_columns, check_file, ipc_batches, ipc_schema, schema_of
from arrowbuf.errors import FormatError, SchemaError
from arrowbuf.fields import Field
from arrowbuf.parquet import MANIFEST, group_rows, open_export
from arrowbuf.schema import SYSTEM_SPECS, Schema, unflatten

EPISODES_IPC = "episodes.arrow"
LEROBOT_INFO = Path("meta") / "info.json"


def detect(path: Path) -> str:
    """The kind of source at ``path``: "cache", "export", "lerobot" or "ipc".

    Raises:
        FormatError: none of them.
    """
    from arrowbuf._dataset_cache import MANIFEST as CACHE_MANIFEST

    if (path / CACHE_MANIFEST).is_file():
        return "cache"
    if (path / MANIFEST).is_file():
        return "export"
    if (path / LEROBOT_INFO).is_file():
        return "lerobot"
    if (path / EPISODES_IPC).is_file():
        return "ipc"
    raise FormatError(f"{path}: not a dataset arrowbuf opens: no {MANIFEST} (Parquet export), "
                      f"{LEROBOT_INFO} (LeRobot v3), {EPISODES_IPC} (Arrow IPC directory) or dataset cache")


def _episode_arrays(table: pa.Table, where: str) -> dict[str, Any]:
    """The episode columns a `Source` needs, from a store's episode table (``store.episodes()``)."""
    try:
        n = table.num_rows
        return {
            "episode_id": table.column("episode_id").to_numpy().astype(np.int64),
            "num_rows": table.column("num_rows").to_numpy().astype(np.int64),
            "has_final": table.column("has_final").to_numpy(zero_copy_only=False).astype(bool),
            "terminated": table.column("terminated").to_numpy(zero_copy_only=False).astype(bool),
            "truncated": table.column("truncated").to_numpy(zero_copy_only=False).astype(bool),
            "return": table.column("return").to_numpy().astype(np.float64),
            "inserted_at": table.column("inserted_at").cast(pa.int64()).to_numpy(),
            "env_id": table.column("env_id").to_pylist(),
            "metadata": table.column("metadata").to_pylist() if "metadata" in table.column_names else [None] * n,
        }
    except (KeyError, pa.ArrowException, ValueError, TypeError) as err:
        raise FormatError(f"{where}: not an arrowbuf episode table ({err})") from None


def _in_order(batches: Iterator[tuple[Mapping[str, np.ndarray], str]], episodes: Mapping[str, Any],
              names: list[str]) -> Iterator[dict[str, np.ndarray]]:
    """The fields of row batches, checked to hold the episodes' rows in the table's order."""
    ids = np.asarray(episodes["episode_id"])
    ends = np.cumsum(episodes["num_rows"])
    offset = 0
    for columns, where in batches:
        got = columns["episode_id"]
        n = len(got)
        positions = np.searchsorted(ends, offset + np.arange(n), side="right")
        if n and (positions[-1] >= len(ids) or not np.array_equal(ids[positions], got)):
            raise FormatError(f"{where}: rows {offset}..{offset + n} are not those of the episode table's "
                              "episodes in its order (missing, extra or reordered rows)")
        offset += n
        yield {name: columns[name] for name in names}


def export_source(path: Path) -> Source:
    """An arrowbuf Parquet export (see `arrowbuf.parquet`), checked by `open_export`."""
    export = open_export(path)
    schema = export.schema
    episodes = _episode_arrays(export.episodes, str(path))
    specs = {**schema.fields, "episode_id": SYSTEM_SPECS["episode_id"]}
    group = group_rows(schema.row_bytes)

    def batches() -> Iterator[tuple[dict[str, np.ndarray], str]]:
        for entry in export.files:
            file = path / entry["path"]
            check_file(file, entry)
            try:
                reader = pq.ParquetFile(file, page_checksum_verification=True)
                for batch in reader.iter_batches(batch_size=group, columns=list(specs)):
                    yield batch_columns(batch, specs, str(file)), str(file)
            except (pa.ArrowException, OSError) as err:
                raise FormatError(f"{file}: unreadable ({err}); the file is truncated or corrupted") from None

    files = [path / MANIFEST, *(path / e["path"] for e in export.files), path / export.manifest["episodes"]["path"]]
    return Source("export", path, schema, episodes, lambda: _in_order(batches(), episodes, list(schema.fields)),
                  files, [path / MANIFEST], {"store": export.store})


def ipc_source(path: Path) -> Source:
    """An Arrow IPC directory: ``episodes.arrow`` and the rows in the other ``*.arrow`` files."""
    row_files = sorted(p for p in path.glob("*.arrow") if p.name != EPISODES_IPC)
    if not row_files:
        raise FormatError(f"{path}: {EPISODES_IPC} but no *.arrow file of rows beside it")
    schemas = [ipc_schema(file) for file in row_files]
    schema = schema_of(schemas[0], str(row_files[0])) if schemas[0].metadata and b"arrowbuf.schema" in \
        schemas[0].metadata else _schema_from_arrow(schemas[0], row_files[0])
    episodes = _episode_arrays(pa.Table.from_batches(list(ipc_batches(path / EPISODES_IPC))), str(path / EPISODES_IPC))
    specs = {**schema.fields, "episode_id": SYSTEM_SPECS["episode_id"]}

    def batches() -> Iterator[tuple[dict[str, np.ndarray], str]]:
        for file in row_files:
            for batch in ipc_batches(file):
                yield batch_columns(batch, specs, str(file)), str(file)

    return Source("ipc", path, schema, episodes, lambda: _in_order(batches(), episodes, list(schema.fields)),
                  [*row_files, path / EPISODES_IPC], [path / EPISODES_IPC], {})


def _schema_from_arrow(arrow_schema: pa.Schema, file: Path) -> Schema:
    try:
        return Schema.from_arrow(arrow_schema)
    except SchemaError as err:
        raise FormatError(f"{file}: {err}") from None


# -- LeRobot v3 -------------------------------------------------------------------------------

#: LeRobot columns renamed to arrowbuf's names (``index`` and ``next`` are reserved by batches).
LEROBOT_NAMES = {"next.reward": "reward", "next.done": "terminated", "next.success": "success",
                 "index": "dataset_index"}
_LEROBOT_SKIPPED = {"episode_index", "frame_index"}   # the episode id and the step
_LEROBOT_DTYPES = {"float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def lerobot_fields(info: Mapping[str, Any], where: str) -> tuple[dict[str, tuple[str, Field, bool]], list[str]]:
    """(LeRobot column -> (field name, field, is an image), features left out) of ``info.json``."""
    features = info.get("features")
    if not isinstance(features, dict):
        raise FormatError(f"{where}: no 'features' mapping")
    fields, skipped = {}, []
    for column, feature in features.items():
        dtype = feature.get("dtype") if isinstance(feature, dict) else None
        shape = tuple(feature.get("shape") or ()) if isinstance(feature, dict) else ()
        if column in _LEROBOT_SKIPPED:
            continue
        if dtype == "image":
            names = list(feature.get("names") or [])
            if names and str(names[0]).startswith("channel"):   # (C, H, W) declared: stored as decoded (H, W, C)
                shape = (*shape[1:], shape[0])
            fields[column] = (column, Field("uint8", shape, observation=True), True)
        elif dtype in _LEROBOT_DTYPES:
            name = LEROBOT_NAMES.get(column, column)
            if shape == (1,):
                shape = ()
            fields[column] = (name, Field(dtype, shape, observation=column.startswith("observation.")), False)
        else:
            skipped.append(f"{column} ({dtype})")   # videos, strings: not tabular
    return fields, skipped


def lerobot_source(path: Path) -> Source:
    """The tabular data of a LeRobot v3 dataset.

    Its frames become rows: ``episode_index`` the episode id, ``frame_index`` the step
    (checked to count 0..T-1), ``observation.*`` observation fields (nested:
    ``batch["observation", "state"]``, ``batch["next", "observation", "state"]``),
    ``next.reward`` -> ``reward``, ``next.done`` -> ``terminated``, ``index`` ->
    ``dataset_index``; other numeric features (``action``, ``timestamp``,
    ``task_index``) keep their names. Image features stored in the Parquet files
    (``dtype: image``, PNG/JPEG bytes) are decoded into uint8 (H, W, C) fields; video
    features and strings are left out (``dataset.info["skipped"]``). LeRobot stores no
    observation after an episode's last frame, so an episode of T frames has T - 1
    transitions.
    """
    info_path = path / LEROBOT_INFO
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError) as err:
        raise FormatError(f"{info_path}: unreadable ({err})") from None
    version = str(info.get("codebase_version", ""))
    if not version.startswith("v3"):
        raise FormatError(f"{info_path}: codebase_version {version!r}; arrowbuf reads LeRobot v3 datasets")
    fields, skipped = lerobot_fields(info, str(info_path))
    data_files = sorted(path.glob("data/chunk-*/file-*.parquet"))
    if not data_files:
        raise FormatError(f"{path}: no data/chunk-XXX/file-XXX.parquet files")
    schema = Schema(unflatten({name: spec for name, spec, _ in fields.values()}))
    episodes = _lerobot_episodes(data_files, fields)
    total = info.get("total_frames")
    if isinstance(total, int) and total != int(episodes["num_rows"].sum()):
        raise FormatError(f"{info_path}: total_frames {total}, the data files hold {int(episodes['num_rows'].sum())}")
    meta_files = sorted(path.glob("meta/episodes/chunk-*/file-*.parquet"))
    _check_lerobot_meta(meta_files, episodes)

    def rows() -> Iterator[dict[str, np.ndarray]]:
        for file in data_files:
            try:
                reader = pq.ParquetFile(file)
                for batch in reader.iter_batches(batch_size=4096, columns=list(fields)):
                    yield {name: _lerobot_column(batch.column(column), spec, image, f"{file}: {column}")
                           for column, (name, spec, image) in fields.items()}
            except (pa.ArrowException, OSError) as err:
                raise FormatError(f"{file}: unreadable ({err})") from None

    return Source("lerobot", path, schema, episodes, rows, [*data_files, *meta_files, info_path], [info_path],
                  {"fps": info.get("fps"), "codebase_version": version, "skipped": skipped})


def _lerobot_episodes(files: list[Path], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The episode table of LeRobot data files, from their index, flag and reward columns."""
    wanted = [c for c in ("episode_index", "frame_index", "next.done", "next.reward") if c == "episode_index"
              or c == "frame_index" or c in fields]
    parts = []
    for file in files:
        try:
            table = pq.read_table(file, columns=wanted)
        except (pa.ArrowException, OSError, KeyError) as err:
            raise FormatError(f"{file}: unreadable or without {wanted} ({err})") from None
        parts.append({c: table.column(c).to_numpy(zero_copy_only=False) for c in wanted})
    episode = np.concatenate([p["episode_index"] for p in parts]).astype(np.int64)
    frame = np.concatenate([p["frame_index"] for p in parts]).astype(np.int64)
    starts = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    num_rows = np.diff(np.r_[starts, len(episode)]).astype(np.int64)
    ids = episode[starts]
    if len(np.unique(ids)) != len(ids):
        raise FormatError(f"{files[0].parent.parent}: frames of an episode are not contiguous across the data files")
    expected = np.arange(len(episode)) - np.repeat(starts, num_rows)
    if not np.array_equal(frame, expected):
        raise FormatError(f"{files[0].parent.parent}: frame_index does not count 0..T-1 in each episode")
    last = starts + num_rows - 1
    done = np.concatenate([p["next.done"] for p in parts]).astype(bool)[last] if "next.done" in wanted \
        else np.zeros(len(ids), bool)
    reward = np.add.reduceat(np.concatenate([p["next.reward"] for p in parts]).astype(np.float64), starts) \
        if "next.reward" in wanted and len(starts) else np.full(len(ids), np.nan)
    return {"episode_id": ids, "num_rows": num_rows, "has_final": np.zeros(len(ids), bool),
            "terminated": done, "truncated": np.zeros(len(ids), bool), "return": reward,
            "inserted_at": np.zeros(len(ids), np.int64), "env_id": ["lerobot"] * len(ids),
            "metadata": [None] * len(ids)}


def _check_lerobot_meta(files: list[Path], episodes: Mapping[str, Any]) -> None:
    """The lengths in ``meta/episodes`` (when present) must match the data files."""
    if not files:
        return
    try:
        table = pa.concat_tables([pq.read_table(f, columns=["episode_index", "length"]) for f in files])
    except (pa.ArrowException, OSError, KeyError) as err:
        raise FormatError(f"{files[0]}: unreadable episode metadata ({err})") from None
    lengths = dict(zip(table.column("episode_index").to_pylist(), table.column("length").to_pylist()))
    found = dict(zip(episodes["episode_id"].tolist(), episodes["num_rows"].tolist()))
    if lengths != found:
        bad = sorted(k for k in set(lengths) | set(found) if lengths.get(k) != found.get(k))[:5]
        raise FormatError(f"{files[0].parent.parent}: episode lengths in meta/episodes differ from the data "
                          f"files for episodes {bad}")


def _lerobot_column(column: pa.Array, spec: Field, image: bool, where: str) -> np.ndarray:
    if column.null_count:
        raise FormatError(f"{where}: has nulls")
    if image:
        return _decode_images(column, spec, where)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or \
            pa.types.is_fixed_size_list(column.type):
        values = column.flatten().to_numpy(zero_copy_only=False)
        size = int(np.prod(spec.shape, dtype=np.int64)) if spec.shape else 1
        if values.size != len(column) * size:
            raise FormatError(f"{where}: rows of {values.size // max(len(column), 1)} values, expected {size}")
        return values.reshape(len(column), *spec.shape)
    return column.to_numpy(zero_copy_only=False).reshape(len(column), *spec.shape)


def _decode_images(column: pa.Array, spec: Field, where: str) -> np.ndarray:
    from PIL import Image

    data = column.field("bytes") if pa.types.is_struct(column.type) else column
    out = np.empty((len(column), *spec.shape), np.uint8)
    for i, raw in enumerate(data.to_pylist()):
        try:
            image = np.asarray(Image.open(io.BytesIO(raw)))
        except (OSError, ValueError, TypeError) as err:
            raise FormatError(f"{where}: row {i} is not a readable image ({err})") from None
        if image.ndim == 2:
            image = image[..., None]
        if image.shape != spec.shape:
            raise FormatError(f"{where}: row {i} is an image of shape {image.shape}, info.json says {spec.shape}")
        out[i] = image
    return out
