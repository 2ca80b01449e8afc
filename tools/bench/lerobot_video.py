"""VLA's demonstrations: a LeRobot v3 dataset with a video camera, written by the bench with PyAV.

lerobot itself pins an older torch than arrowbuf's (the committed test dataset,
``tests/data/lerobot_v3_video``, was written by it in a venv of its own, and is 36 frames
of 48 x 64: too small and of the wrong shape for a 224 x 224 bench). So the bench writes
the same layout itself: ``meta/info.json`` (codebase v3.0), ``data/chunk-000/file-000.parquet``
(``observation.state``, ``action``, ``next.reward``, ``next.done``, ``timestamp``,
``frame_index``, ``episode_index``, ``index``, ``task_index``), ``meta/episodes/...`` (each
episode's length and ``videos/<key>/{chunk_index, file_index, from_timestamp,
to_timestamp}``), ``meta/tasks.parquet``, and every episode's frames one after another in
``videos/observation.images.front/chunk-000/file-000.mp4``, encoded as lerobot encodes
by default: AV1 (``libsvtav1``), ``yuv420p``, a keyframe every 2 frames (``g=2``), ``crf=30``
(`encoder`: another encoder where PyAV's FFmpeg lacks SVT-AV1, named in the report).
No per-episode statistics (``meta/stats.json``): arrowbuf does not read them.

The frames are the IMAGES footage (`camera`: crops of a photograph along camera paths),
each source episode's T + 1 frames an episode of T + 1 LeRobot frames (T transitions).

Example:
    >>> import tempfile
    >>> from tools.bench.camera import make_footage
    >>> root = write_lerobot(tempfile.mkdtemp(), make_footage(2, 5, (32, 48, 3)))
    >>> sorted(p.name for p in (root / "meta").iterdir())
    ['episodes', 'info.json', 'tasks.parquet']
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .camera import Footage

CAMERA = "observation.images.front"
VIDEO = f"videos/{CAMERA}/chunk-000/file-000.mp4"
FPS = 30
TASK = "pan over the photo"   # the one task of the demos (meta/tasks.parquet), a text field "task" when read
#: lerobot's default video settings (``encode_video_frames``): AV1 by SVT-AV1, 4:2:0, GOP 2, CRF 30.
CODEC, GOP, CRF = "libsvtav1", 2, 30
#: Encoders taken in this order where PyAV's FFmpeg lacks SVT-AV1 (the report names the one used).
FALLBACKS = ("libaom-av1", "libx264", "mpeg4")


def encoder() -> str:
    """The first of `CODEC` and `FALLBACKS` that PyAV's FFmpeg can encode with."""
    import av

    for name in (CODEC, *FALLBACKS):
        try:
            av.Codec(name, "w")
            return name
        except Exception:   # noqa: BLE001  (av.codec.codec.UnknownCodecError, and older PyAVs' ValueError)
            continue
    raise RuntimeError(f"PyAV's FFmpeg encodes none of {[CODEC, *FALLBACKS]}")
STATE = 4


def state(source: int, steps: int) -> np.ndarray:
    """The float32 (steps, 4) robot state of a source episode: its source first, then its step."""
    t = np.arange(steps, dtype=np.float32)
    return np.stack([np.full(steps, source, np.float32), t, np.sin(t / 9), np.cos(t / 5)], axis=1)


def write_video(path: Path, frames: list[np.ndarray], fps: int = FPS) -> None:
    """Every frame of ``frames`` (uint8 (N, H, W, 3) arrays) one after another, in one MP4."""
    import av

    os.environ.setdefault("SVT_LOG", "1")   # SVT-AV1's banner and warnings off (errors still show)
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = frames[0].shape[1:3]
    with av.open(str(path), "w") as out:
        name = encoder()
        options = {"g": str(GOP)} if name == "mpeg4" else {"g": str(GOP), "crf": str(CRF)}
        stream = out.add_stream(name, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for episode in frames:
            for image in episode:
                out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")))
        out.mux(stream.encode())


def write_lerobot(root: str | Path, footage: Footage, fps: int = FPS) -> Path:
    """A LeRobot v3 dataset of every source episode of ``footage`` at ``root`` (made or emptied)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    frames = footage.frames
    lengths = [len(f) for f in frames]
    write_video(root / VIDEO, frames, fps)
    starts = np.cumsum([0, *lengths])
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("observation.state", "action", "next.reward", "next.done",
                                                              "timestamp", "frame_index", "episode_index")}
    for e, n in enumerate(lengths):
        steps = np.arange(n)
        columns["observation.state"].append(state(e, n))
        columns["action"].append(np.stack([np.cos(steps / 7), (steps % 6) / 6.0], axis=1).astype(np.float32))
        columns["next.reward"].append((steps == n - 1).astype(np.float32))
        columns["next.done"].append(steps == n - 1)
        columns["timestamp"].append((steps / fps).astype(np.float32))
        columns["frame_index"].append(steps.astype(np.int64))
        columns["episode_index"].append(np.full(n, e, np.int64))
    data = {k: np.concatenate(v) for k, v in columns.items()}
    total = len(data["timestamp"])

    def vectors(values: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])

    table = pa.table({"observation.state": vectors(data["observation.state"]), "action": vectors(data["action"]),
                      **{k: data[k] for k in ("next.reward", "next.done", "timestamp", "frame_index", "episode_index")},
                      "index": np.arange(total, dtype=np.int64), "task_index": np.zeros(total, np.int64)})
    (root / "data/chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / "data/chunk-000/file-000.parquet")
    video = f"videos/{CAMERA}"
    episodes = pa.table({
        "episode_index": np.arange(len(lengths), dtype=np.int64), "tasks": [[TASK]] * len(lengths),
        "length": np.array(lengths, np.int64), "data/chunk_index": np.zeros(len(lengths), np.int64),
        "data/file_index": np.zeros(len(lengths), np.int64), "dataset_from_index": starts[:-1].astype(np.int64),
        "dataset_to_index": starts[1:].astype(np.int64), f"{video}/chunk_index": np.zeros(len(lengths), np.int64),
        f"{video}/file_index": np.zeros(len(lengths), np.int64), f"{video}/from_timestamp": starts[:-1] / fps,
        f"{video}/to_timestamp": starts[1:] / fps})
    (root / "meta/episodes/chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(episodes, root / "meta/episodes/chunk-000/file-000.parquet")
    pq.write_table(pa.table({"task_index": [0], "task": [TASK]}), root / "meta/tasks.parquet")
    shape = list(frames[0].shape[1:])
    scalar = {"shape": [1], "names": None}
    info = {"codebase_version": "v3.0", "robot_type": None, "total_episodes": len(lengths), "total_frames": total,
            "total_tasks": 1, "chunks_size": 1000, "fps": fps, "splits": {"train": f"0:{len(lengths)}"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
            "features": {
                CAMERA: {"dtype": "video", "shape": shape, "names": ["height", "width", "channels"],
                         "info": {"video.height": shape[0], "video.width": shape[1], "video.codec": "av1",
                                  "video.pix_fmt": "yuv420p", "video.fps": fps, "video.channels": shape[2],
                                  "has_audio": False}},
                "observation.state": {"dtype": "float32", "shape": [STATE], "names": None},
                "action": {"dtype": "float32", "shape": [2], "names": None},
                "next.reward": {"dtype": "float32", **scalar}, "next.done": {"dtype": "bool", **scalar},
                "timestamp": {"dtype": "float32", **scalar},
                **{k: {"dtype": "int64", **scalar} for k in ("frame_index", "episode_index", "index", "task_index")}}}
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    return root
