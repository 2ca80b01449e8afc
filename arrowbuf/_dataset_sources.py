"""What `arrowbuf.open_dataset` reads: sources converted once into a dataset cache.

Each reader checks a source and describes it as a `arrowbuf._dataset_cache.Source`
(schema, episode table, a stream of rows in episode order) without loading its rows:

- `export_source`: an arrowbuf Parquet export (``store.to_parquet``), checked by
  `arrowbuf.parquet.open_export`; every file's SHA-256 and page checksums are
  verified as it is converted.
- `ipc_source`: an Arrow IPC directory: ``episodes.arrow`` (``store.episodes()``)
  and one or more other ``*.arrow`` files of rows (``store.to_arrow()``), in name order.
- `lerobot_source`: a LeRobot v3 dataset (``meta/info.json``,
  ``data/chunk-XXX/file-XXX.parquet``, ``meta/episodes/...``, ``videos/...``); see
  `lerobot_source` for how its columns become fields. Its videos are not converted:
  the cache keeps which frame of which file each row is (`arrowbuf.video`).
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
from arrowbuf.video import VideoSpec

EPISODES_IPC = "episodes.arrow"
LEROBOT_INFO = Path("meta") / "info.json"
LEROBOT_TASKS = Path("meta") / "tasks.parquet"


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


#: Where a LeRobot v3 dataset keeps its videos (``video_path`` of ``info.json`` when it gives one).
LEROBOT_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
#: How far a frame's time (``from_timestamp`` + ``timestamp``) may lie from its video's
#: frame grid, in frames: rounding, never a frame rate that is not the video's.
_GRID = 0.1


def lerobot_fields(info: Mapping[str, Any], where: str) -> tuple[dict[str, tuple[str, Field, str | None]], list[str]]:
    """(LeRobot column -> (field name, field, "image", "video" or None), features left out) of ``info.json``."""
    features = info.get("features")
    if not isinstance(features, dict):
        raise FormatError(f"{where}: no 'features' mapping")
    fields, skipped = {}, []
    for column, feature in features.items():
        dtype = feature.get("dtype") if isinstance(feature, dict) else None
        shape = tuple(feature.get("shape") or ()) if isinstance(feature, dict) else ()
        if column in _LEROBOT_SKIPPED:
            continue
        if dtype in ("image", "video"):
            names = list(feature.get("names") or [])
            if names and str(names[0]).startswith("channel"):   # (C, H, W) declared: stored as decoded (H, W, C)
                shape = (*shape[1:], shape[0])
            if dtype == "video" and (len(shape) != 3 or shape[2] not in (1, 3)):
                skipped.append(f"{column} (video of shape {shape}: arrowbuf decodes (H, W, 3) and (H, W, 1))")
                continue
            fields[column] = (column, Field("uint8", shape, observation=True), dtype)
        elif dtype in _LEROBOT_DTYPES:
            name = LEROBOT_NAMES.get(column, column)
            if shape == (1,):
                shape = ()
            fields[column] = (name, Field(dtype, shape, observation=column.startswith("observation.")), None)
        else:
            skipped.append(f"{column} ({dtype})")   # strings: not tabular
    return fields, skipped


def lerobot_files(path: Path) -> tuple[list[Path], list[Path]]:
    """(files, hashed files) whose stat (and hash) say whether a cache is still that of the
    LeRobot dataset at ``path``: data, episode metadata, videos and ``info.json``."""
    tasks = [path / LEROBOT_TASKS] if (path / LEROBOT_TASKS).is_file() else []
    files = [*sorted(path.glob("data/chunk-*/file-*.parquet")), *sorted(path.glob("meta/episodes/chunk-*/file-*.parquet")),
             *sorted(path.glob("videos/*/chunk-*/file-*.mp4")), path / LEROBOT_INFO, *tasks]
    return files, [path / LEROBOT_INFO, *tasks]


def lerobot_tasks(path: Path) -> np.ndarray | None:
    """Each task's string by its ``task_index`` (``meta/tasks.parquet``: the task strings, as
    LeRobot writes them, a pandas index, beside ``task_index``), an object array with None
    where no task has that index; None for a dataset without the file.

    Raises:
        FormatError: an unreadable file, no ``task_index`` or no one string column, nulls,
            negative or repeated indices.
    """
    file = path / LEROBOT_TASKS
    if not file.is_file():
        return None
    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as err:
        raise FormatError(f"{file}: unreadable ({err})") from None
    text = [name for name, kind in zip(table.column_names, table.schema.types)
            if name != "task_index" and (pa.types.is_string(kind) or pa.types.is_large_string(kind))]
    text = ["task"] if "task" in text else text
    if "task_index" not in table.column_names or len(text) != 1 or not pa.types.is_integer(
            table.schema.field("task_index").type):
        raise FormatError(f"{file}: expected an integer task_index column and one string column of the tasks, "
                          f"got {table.schema}")
    if table["task_index"].null_count or table[text[0]].null_count:
        raise FormatError(f"{file}: null task_index or task")
    index = table["task_index"].to_numpy()
    if len(index) and (index.min() < 0 or len(np.unique(index)) != len(index) or index.max() > 1 << 24):
        raise FormatError(f"{file}: task_index must be distinct integers in [0, 2**24], got {index.tolist()[:10]}")
    tasks = np.full(int(index.max(initial=-1)) + 1, None, object)
    tasks[index] = table[text[0]].to_pylist()
    return tasks


def _task_strings(tasks: np.ndarray, codes: np.ndarray, where: str) -> np.ndarray:
    """The task string of each row's ``task_index`` (``codes``).

    Raises:
        FormatError: an index no task of ``meta/tasks.parquet`` has.
    """
    codes = np.asarray(codes).reshape(-1)
    bad = (codes < 0) | (codes >= len(tasks))
    if not bad.any():
        found = tasks[codes]
        bad = np.equal(found, None)
        if not bad.any():
            return found
    raise FormatError(f"{where}: task_index {codes[bad][:5].tolist()} names no task of {LEROBOT_TASKS}")


def lerobot_source(path: Path) -> Source:
    """A LeRobot v3 dataset.

    Its frames become rows: ``episode_index`` the episode id, ``frame_index`` the step
    (checked to count 0..T-1), ``observation.*`` observation fields (nested:
    ``batch["observation", "state"]``, ``batch["next", "observation", "state"]``),
    ``next.reward`` -> ``reward``, ``next.done`` -> ``terminated``, ``index`` ->
    ``dataset_index``; other numeric features (``action``, ``timestamp``,
    ``task_index``) keep their names. Image features stored in the Parquet files
    (``dtype: image``, PNG/JPEG bytes) are decoded into uint8 (H, W, C) fields. Video
    features (``dtype: video``, RGB or gray) are uint8 (H, W, C) fields decoded when
    sampled (`arrowbuf.video`): the cache keeps each row's frame, the one shown at
    ``from_timestamp`` (its episode's start in its file, ``meta/episodes``) +
    ``timestamp`` in its episode's file. ``task_index``'s strings (``meta/tasks.parquet``)
    are a text field ``task``, the frame's instruction; other strings are left out
    (``dataset.info["skipped"]``). LeRobot stores no observation after an episode's
    last frame, so an episode of T frames has T - 1 transitions.
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
    # The task strings, by each frame's task_index, as a text field "task" (an instruction for a VLA policy).
    tasks = lerobot_tasks(path) if "task_index" in fields and "task" not in fields else None
    schema = Schema(unflatten({**{name: spec for name, spec, _ in fields.values()},
                               **({"task": Field("string")} if tasks is not None else {})}))
    episodes = _lerobot_episodes(data_files, fields)
    total = info.get("total_frames")
    if isinstance(total, int) and total != int(episodes["num_rows"].sum()):
        raise FormatError(f"{info_path}: total_frames {total}, the data files hold {int(episodes['num_rows'].sum())}")
    meta_files = sorted(path.glob("meta/episodes/chunk-*/file-*.parquet"))
    _check_lerobot_meta(meta_files, episodes)
    videos = {column: name for column, (name, _, kind) in fields.items() if kind == "video"}
    specs, segments = _lerobot_videos(path, info, {c: fields[c][1] for c in videos}, meta_files, episodes)
    tabular = [column for column, (_, _, kind) in fields.items() if kind != "video"]
    read = [*tabular, *(c for c in ("episode_index", "timestamp") if videos and c not in tabular)]
    ids = episodes["episode_id"]

    def rows() -> Iterator[dict[str, np.ndarray]]:
        for file in data_files:
            try:
                reader = pq.ParquetFile(file)
                for batch in reader.iter_batches(batch_size=4096, columns=read):
                    out = {fields[c][0]: _lerobot_column(batch.column(c), fields[c][1], fields[c][2], f"{file}: {c}")
                           for c in tabular}
                    if videos:
                        episode = _positions(ids, batch.column("episode_index").to_numpy())
                        time = batch.column("timestamp").to_numpy(zero_copy_only=False).astype(np.float64)
                        for column, name in videos.items():
                            out[name] = _frame_refs(segments[column], episode, time, specs[column].fps,
                                                    f"{file}: {column}")
                    if tasks is not None:
                        out["task"] = _task_strings(tasks, out[fields["task_index"][0]], str(file))
                    yield out
            except (pa.ArrowException, OSError) as err:
                raise FormatError(f"{file}: unreadable ({err})") from None

    files, hashed = lerobot_files(path)
    return Source("lerobot", path, schema, episodes, rows, files, hashed,
                  {"fps": info.get("fps"), "codebase_version": version, "skipped": skipped},
                  {videos[c]: spec for c, spec in specs.items()})


def _lerobot_videos(path: Path, info: Mapping[str, Any], videos: Mapping[str, Field], meta_files: list[Path],
                    episodes: Mapping[str, Any]) -> tuple[dict[str, VideoSpec], dict[str, np.ndarray]]:
    """(column -> `VideoSpec`, column -> each episode's (file position, start, end) in
    frames, in the table's order) of the video features, from ``meta/episodes``.

    Raises:
        FormatError: no episode metadata of a video, a missing file, or a bad fps.
    """
    if not videos:
        return {}, {}
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise FormatError(f"{path / LEROBOT_INFO}: fps {fps!r}; its videos need a frame rate > 0")
    if not meta_files:
        raise FormatError(f"{path}: video features {list(videos)} but no meta/episodes/chunk-XXX/file-XXX.parquet "
                          "to find their frames in")
    columns = ["episode_index"] + [f"videos/{c}/{k}" for c in videos
                                   for k in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
    try:
        for file in meta_files:
            missing = [c for c in columns if c not in pq.read_schema(file).names]
            if missing:
                raise FormatError(f"{file}: no columns {missing}; LeRobot v3 episode metadata locates the frames "
                                  f"of the video features {list(videos)} by them")
        table = pa.concat_tables([pq.read_table(f, columns=columns) for f in meta_files])
    except (pa.ArrowException, OSError) as err:
        raise FormatError(f"{meta_files[0]}: unreadable episode metadata ({err})") from None
    meta = {name: np.asarray(table.column(name).to_numpy(zero_copy_only=False)) for name in columns}
    at = _positions(meta["episode_index"], episodes["episode_id"])   # each episode's row of the metadata
    template = str(info.get("video_path") or LEROBOT_VIDEO_PATH)
    specs, segments = {}, {}
    for column, spec in videos.items():
        chunk, number = (meta[f"videos/{column}/{k}"][at].astype(np.int64) for k in ("chunk_index", "file_index"))
        pairs = sorted(set(zip(chunk.tolist(), number.tolist())))
        try:
            files = [template.format(video_key=column, chunk_index=c, file_index=f) for c, f in pairs]
        except (KeyError, IndexError, ValueError) as err:
            raise FormatError(f"{path / LEROBOT_INFO}: video_path {template!r} does not format ({err!r})") from None
        for file in files:
            if not (path / file).is_file():
                raise FormatError(f"{path / file}: missing; video field {column!r} has frames in it")
        position = {pair: k for k, pair in enumerate(pairs)}
        segments[column] = np.stack([np.array([position[p] for p in zip(chunk.tolist(), number.tolist())]),
                                     meta[f"videos/{column}/from_timestamp"][at].astype(np.float64) * fps,
                                     meta[f"videos/{column}/to_timestamp"][at].astype(np.float64) * fps], axis=1)
        specs[column] = VideoSpec(column, tuple(files), float(fps), spec.shape)
    return specs, segments


def _positions(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Where each of ``wanted`` is in ``ids`` (distinct, any order; every one is there)."""
    order = np.argsort(ids, kind="stable")
    return order[np.searchsorted(ids[order], wanted)]


def _frame_refs(segments: np.ndarray, episode: np.ndarray, time: np.ndarray, fps: float, where: str) -> np.ndarray:
    """`arrowbuf.video.FRAME_REF` rows (file position, frame number) of frames at ``time``
    (``timestamp``) in episodes at positions ``episode`` of the episode table.

    Raises:
        FormatError: a time off its video's frame grid, or past its episode's segment of it.
    """
    file, start, end = segments[episode].T
    frame = start + time * fps
    number = np.rint(frame)
    first, end = np.rint(start), np.rint(end)
    off = np.abs(frame - number) > _GRID
    outside = (number < first) | (number >= end)
    if off.any() or outside.any():
        row = int(np.flatnonzero(off | outside)[0])
        raise FormatError(f"{where}: a row at timestamp {time[row]:.6f} s is frame {frame[row]:.3f} of its video, "
                          f"{'off its frame grid at' if off[row] else 'outside its episode segment,'} frames "
                          f"{first[row]:.0f}..{end[row] - 1:.0f} at {fps:g} fps")
    return np.stack([file, number], axis=1).astype(np.int32)   # file positions are exact in float64


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


def _lerobot_column(column: pa.Array, spec: Field, kind: str | None, where: str) -> np.ndarray:
    if column.null_count:
        raise FormatError(f"{where}: has nulls")
    if kind == "image":
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
