"""A LeRobot v3 dataset written by ``lerobot`` itself (``tests/data``, made by ``tests/data/make_lerobot_v3.py``).

The tabular columns are opened and sampled as the writer wrote them; the camera feature is an AV1 video,
decoded at gather (`arrowbuf.video`) to the frames the script encoded, within AV1's loss.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import arrowbuf as ab
from arrowbuf import video

DATA = Path(__file__).parent / "data"
CAMERA = "observation.images.front"
VIDEO = Path("videos") / CAMERA / "chunk-000" / "file-000.mp4"
sys.path.insert(0, str(DATA))
import make_lerobot_v3 as made  # noqa: E402

FRAME_BYTES = made.HEIGHT * made.WIDTH * 3
KEY = tuple(CAMERA.split("."))
# PyAV (the [test] extra has it) decodes the videos; without it only the tabular checks could run.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="needs PyAV (pip install av)")


def _copy(tmp_path: Path) -> Path:
    """The dataset copied where its cache may be written (the committed copy stays read-only)."""
    root = tmp_path / "lerobot"
    shutil.copytree(DATA / "lerobot_v3_video", root)
    return root


def test_a_dataset_written_by_lerobot_opens_with_its_episodes_and_values(tmp_path):
    dataset = ab.open_dataset(_copy(tmp_path), seed=0)
    assert dataset.info["kind"] == "lerobot" and dataset.info["codebase_version"] == "v3.0"
    assert dataset.info["skipped"] == []
    assert dataset.schema.fields[CAMERA] == ab.Field("uint8", (made.HEIGHT, made.WIDTH, 3), observation=True)
    episodes = dataset.episodes().to_pandas()
    # LeRobot's last frame of an episode is its final observation: T frames make T - 1 transitions.
    assert episodes["length"].tolist() == [n - 1 for n in made.EPISODES]
    assert len(dataset) == sum(made.EPISODES) - len(made.EPISODES)
    batch = dataset.sample(256)
    state = batch["observation", "state"].numpy()
    step = batch["step"].numpy()
    episode = state[:, 0].astype(int)            # the script writes [episode, t, t / 2, -t]
    np.testing.assert_array_equal(state[:, 1], step)
    expected_action = np.stack([made.action(e, t) for e, t in zip(episode, step)])
    np.testing.assert_array_equal(batch["action"].numpy(), expected_action)
    np.testing.assert_array_equal(batch["next", "observation", "state"].numpy()[:, 1], step + 1)
    rewards = [made.reward(e, t, made.EPISODES[e]) for e, t in zip(episode, step)]
    np.testing.assert_array_equal(batch["reward"].numpy(), np.array(rewards, np.float32))
    assert not batch["terminated"].any()         # next.done is set on the last frame only, which has no next one


def test_the_cache_keeps_each_video_rows_frame_reference_and_no_pixels(tmp_path):
    root = _copy(tmp_path)
    ab.open_dataset(root)
    cache = root / ".arrowbuf-cache"
    rows = pa.ipc.open_file(pa.memory_map(str(cache / "rows.arrow"))).read_all()
    assert rows.schema.field(CAMERA).type == pa.binary(8)          # (file, frame) as two int32
    refs = np.frombuffer(rows.column(CAMERA).combine_chunks().buffers()[1], np.int32).reshape(-1, 2)
    np.testing.assert_array_equal(refs, [[0, n] for n in range(sum(made.EPISODES))])   # the episodes back to back
    assert (cache / "rows.arrow").stat().st_size < FRAME_BYTES * 2   # 36 frames' pixels would be 331 KB
    manifest = json.loads((cache / "_dataset.json").read_text())
    assert manifest["format_version"] == 4 and list(manifest["heaps"]) == ["task"]   # the task strings: a heap
    assert manifest["videos"][CAMERA] == {"key": CAMERA, "files": [str(VIDEO)], "fps": float(made.FPS),
                                          "shape": [made.HEIGHT, made.WIDTH, 3]}


def test_sampled_frames_and_next_frames_are_the_ones_lerobot_encoded(tmp_path):
    """Row t of an episode is its frame t, and its next observation frame t + 1 (the next row)."""
    dataset = ab.open_dataset(_copy(tmp_path), seed=1)
    for batch in (dataset.sample(64), dataset.gather(np.arange(len(dataset)))):
        episode, step = _episode_and_step(batch)
        frames, following = batch[KEY].numpy(), batch[("next", *KEY)].numpy()
        assert frames.shape == (len(step), made.HEIGHT, made.WIDTH, 3) and frames.dtype == np.uint8
        assert min(_psnr(f, made.frame(e, t)) for f, e, t in zip(frames, episode, step)) > 30.0
        assert min(_psnr(f, made.frame(e, t + 1)) for f, e, t in zip(following, episode, step)) > 30.0
    stacked = dataset.sample(16, frame_stack=3)[KEY].numpy()             # [16, 3, H, W, C], within episodes
    assert stacked.shape == (16, 3, made.HEIGHT, made.WIDTH, 3)
    last = dataset.episode(2)                                            # an episode's rows, decoded
    frames = np.stack(last.column(CAMERA).to_numpy(zero_copy_only=False)).reshape(-1, made.HEIGHT, made.WIDTH, 3)
    assert min(_psnr(f, made.frame(2, t)) for t, f in enumerate(frames)) > 30.0


def test_keys_that_leave_the_video_out_decode_nothing(tmp_path, monkeypatch):
    dataset = ab.open_dataset(_copy(tmp_path), seed=0)

    def refused(*args, **kwargs):
        raise AssertionError("a video frame was decoded")

    with monkeypatch.context() as patch:
        patch.setattr(video.VideoFile, "read", refused)
        batch = dataset.sample(32, keys=["observation.state", "action", ("next", "observation", "state")])
        assert ("observation", "images", "front") not in batch.keys(include_nested=True)
        dataset.iter_batches(8, keys=["action"]).__next__()
    assert (dataset.video_cache.hits, dataset.video_cache.misses, dataset.video_cache.decoded) == (0, 0, 0)
    dataset.sample(32, keys=[("next", *KEY)])                            # the next frames only
    assert dataset.video_cache.decoded > 0


def test_a_gather_decodes_a_files_frames_in_time_order_from_one_seek(tmp_path, monkeypatch):
    dataset = ab.open_dataset(_copy(tmp_path), seed=0, video_cache_bytes=0)
    seeks = []
    seek = video.VideoFile._seek
    monkeypatch.setattr(video.VideoFile, "_seek", lambda self, w: seeks.append(w) or seek(self, w))
    backwards = np.arange(len(dataset))[::-1].copy()
    batch = dataset.engine.gather(backwards, None, frozenset([KEY]))     # every transition's frame, asked backwards
    assert seeks == [0]                            # one run from the first frame: no seek back, none per frame
    assert dataset.video_cache.decoded <= sum(made.EPISODES)              # no frame decoded twice
    episode, step = _episode_and_step(dataset.gather(backwards))
    assert min(_psnr(f, made.frame(e, t)) for f, e, t in zip(batch[KEY].numpy(), episode, step)) > 30.0


def test_observations_and_next_observations_are_decoded_in_one_run_each_frame_once(tmp_path, monkeypatch):
    """A batch's frames and next frames are one request: decoded apart, each next frame cost a seek
    back and its keyframe's frames again (on 224x224 AV1, 1.3x the time of decoding them alone)."""
    dataset = ab.open_dataset(_copy(tmp_path), seed=0, video_cache_bytes=0)
    seeks = []
    seek = video.VideoFile._seek
    monkeypatch.setattr(video.VideoFile, "_seek", lambda self, w: seeks.append(w) or seek(self, w))
    every = np.arange(len(dataset))[::-1].copy()
    batch = dataset.engine.gather(every, None, frozenset([KEY, ("next", *KEY)]))
    assert seeks == [0] and dataset.video_cache.decoded == sum(made.EPISODES)   # one run, each frame once
    episode, step = _episode_and_step(dataset.gather(every))
    for key, shift in ((KEY, 0), (("next", *KEY), 1)):
        assert min(_psnr(f, made.frame(e, t + shift)) for f, e, t in zip(batch[key].numpy(), episode, step)) > 30.0


def test_two_cameras_are_decoded_in_one_request_each_from_its_own_file(tmp_path, monkeypatch):
    """A second camera (the same video under another feature) samples as the first: one decode call
    a batch for both cameras and their next frames, every frame its own."""
    root = _copy(tmp_path)
    wrist = "observation.images.wrist"
    (root / "videos" / wrist).mkdir()
    shutil.copytree(root / "videos" / CAMERA / "chunk-000", root / "videos" / wrist / "chunk-000")
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"][wrist] = info["features"][CAMERA]
    (root / "meta" / "info.json").write_text(json.dumps(info))
    episodes = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(episodes)
    for column in [c for c in table.column_names if c.startswith(f"videos/{CAMERA}/")]:
        table = table.append_column(column.replace(CAMERA, wrist), table.column(column))
    pq.write_table(table, episodes)
    dataset = ab.open_dataset(root, seed=0, video_cache_bytes=0)
    calls = []
    decode = video.VideoReader.decode
    monkeypatch.setattr(video.VideoReader, "decode", lambda self, requests: calls.append(len(requests))
                        or decode(self, requests))
    batch = dataset.sample(24)
    assert calls == [4]                                   # front, wrist, and each one's next frames
    episode, step = _episode_and_step(batch)
    for camera in (KEY, ("observation", "images", "wrist")):
        for key, shift in ((camera, 0), (("next", *camera), 1)):
            assert min(_psnr(f, made.frame(e, t + shift)) for f, e, t in zip(batch[key].numpy(), episode, step)) > 30
    np.testing.assert_array_equal(batch["observation", "images", "wrist"].numpy(), batch[KEY].numpy())


def test_the_frame_cache_stays_within_its_byte_bound(tmp_path):
    bound = 5 * FRAME_BYTES + 100
    dataset = ab.open_dataset(_copy(tmp_path), seed=3, video_cache_bytes=bound)
    cache = dataset.video_cache
    assert cache.max_bytes == bound
    for _ in range(20):
        batch = dataset.sample(8)
        assert cache.nbytes <= bound and len(cache) <= 10          # RGB frames, or smaller YUV ones on the way
        episode, step = _episode_and_step(batch)
        assert min(_psnr(f, made.frame(e, t)) for f, e, t in zip(batch[KEY].numpy(), episode, step)) > 30.0
    assert cache.hits > 0 and cache.decoded > 0
    unbounded = ab.open_dataset(_copy(tmp_path / "again"), seed=3)
    unbounded.gather(np.arange(len(unbounded)))                     # every frame, as obs or next obs
    decoded = unbounded.video_cache.decoded
    assert len(unbounded.video_cache) == sum(made.EPISODES)
    for _ in range(20):
        unbounded.sample(8)
    assert unbounded.video_cache.decoded == decoded                 # all from the cache since
    nothing = ab.open_dataset(_copy(tmp_path / "none"), seed=3, video_cache_bytes=0)
    nothing.sample(8)
    assert len(nothing.video_cache) == 0 and nothing.video_cache.nbytes == 0
    with pytest.raises(ValueError, match="video_cache_bytes"):
        ab.open_dataset(_copy(tmp_path / "bad"), video_cache_bytes=-1)


def test_the_frame_cache_drops_the_least_recently_used_frames_first():
    cache = video.FrameCache(max_bytes=250)
    for n in range(3):
        cache.put((0, n), np.zeros(100, np.uint8))                  # (0, 0) made room for (0, 2)
    assert cache.get((0, 0)) is None and cache.get((0, 1)) is not None
    cache.put((0, 3), np.zeros(100, np.uint8))                      # (0, 1) was used last: (0, 2) goes
    assert cache.get((0, 2)) is None and cache.get((0, 1)) is not None and cache.nbytes == 200
    cache.put((0, 4), np.zeros(251, np.uint8))                      # larger than the bound: not kept
    assert cache.get((0, 4)) is None and len(cache) == 2


@pytest.mark.parametrize("damage", ["truncated", "garbled", "missing"])
def test_a_damaged_video_raises_format_error_naming_the_file_and_the_field(tmp_path, damage):
    root = _copy(tmp_path)
    before = ab.open_dataset(root, seed=0, video_cache_bytes=0)     # opened, its video not read yet
    path = root / VIDEO
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
    elif damage == "garbled":
        start = data.find(b"mdat") + 8
        data[start:] = np.random.default_rng(0).integers(0, 256, len(data) - start, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    named = f"{re.escape(str(path))}.*{re.escape(CAMERA)}"
    opened = [before]
    if damage == "missing":                        # the conversion checks that every video file is there
        with pytest.raises(ab.FormatError, match=named):
            ab.open_dataset(root)
    else:
        opened.append(ab.open_dataset(root, seed=0, video_cache_bytes=0))   # converted again: the file changed
    for dataset in opened:
        with pytest.raises(ab.FormatError, match=named):
            dataset.gather(np.arange(len(dataset)))
        dataset.sample(4, keys=["action"])                              # the other fields still read


@pytest.mark.parametrize("codec", [None, "jpeg:90"])
def test_a_mixture_samples_the_dataset_and_an_online_store_of_the_same_image_shape(tmp_path, codec):
    """The offline-to-online VLA setup: video demos beside an online camera stored raw or JPEG-encoded."""
    dataset = ab.open_dataset(_copy(tmp_path), seed=0)
    camera = dataset.schema.fields[CAMERA]
    online = ab.ExperienceStore(capacity=100, seed=1, schema={
        "observation": {"images": {"front": ab.Field("uint8", camera.shape, observation=True, codec=codec)},
                        "state": ab.Field("float32", (4,), observation=True)},
        "action": ab.Field("float32", (2,)), "reward": "float32", "terminated": "bool", "timestamp": "float32",
        "dataset_index": "int64", "task_index": "int64", "task": ab.Field("string")})
    T = 10
    images = np.random.default_rng(0).integers(0, 256, (T + 1, made.HEIGHT, made.WIDTH, 3), dtype=np.uint8)
    online.add_episode({"observation": {"images": {"front": images}, "state": np.full((T + 1, 4), -1, np.float32)},
                        "action": np.zeros((T, 2), np.float32), "reward": np.zeros(T, np.float32),
                        "terminated": np.arange(T) == T - 1, "timestamp": np.zeros(T, np.float32),
                        "dataset_index": np.zeros(T, np.int64), "task_index": np.zeros(T, np.int64),
                        "task": ["stack the blocks"] * T})
    mixture = ab.Mixture({"demos": dataset, "online": online}, weights={"demos": 0.5, "online": 0.5}, seed=0)
    for kwargs in ({}, {"device": "cpu"}):          # one pooled batch, and each source's batch joined
        batch = mixture.sample(32, **kwargs)
        assert batch["source"].bincount().tolist() == [16, 16]
        demos, mine = batch[batch["source"] == 0], batch[batch["source"] == 1]
        episode, step = _episode_and_step(demos)
        for key, shift in ((KEY, 0), (("next", *KEY), 1)):
            assert min(_psnr(f, made.frame(e, t + shift)) for f, e, t in zip(demos[key].numpy(), episode, step)) > 30
            # the online rows as the store decodes them (JPEG: lossy; raw: the images written)
            expected = online.gather(mine["index"])[key].numpy() if codec else images[mine["step"].numpy() + shift]
            np.testing.assert_array_equal(mine[key].numpy(), expected)


def _episode_and_step(batch) -> tuple[np.ndarray, np.ndarray]:
    """Each row's episode (the script's state holds it first) and step."""
    return batch["observation", "state"].numpy()[:, 0].astype(int), batch["step"].numpy()


def test_the_committed_video_holds_the_frames_the_script_encoded():
    """The data's video decodes (PyAV, FFmpeg in its wheel) to the script's frames within AV1's loss."""
    import av
    video = DATA / "lerobot_v3_video" / VIDEO
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    expected = [made.frame(e, t) for e, n in enumerate(made.EPISODES) for t in range(n)]
    assert len(frames) == len(expected) == pq.read_table(DATA / "lerobot_v3_video" / "data").num_rows
    assert min(_psnr(a, b) for a, b in zip(frames, expected)) > 30.0


def _psnr(decoded: np.ndarray, expected: np.ndarray) -> float:
    return 10 * np.log10(255.0 ** 2 / np.mean((decoded.astype(np.float64) - expected) ** 2))


def test_a_forked_process_reopens_the_video_files_rather_than_share_its_parents(tmp_path, monkeypatch):
    """A child shares its parent's file offsets: the reader drops the files it inherited."""
    dataset = ab.open_dataset(_copy(tmp_path), seed=0, video_cache_bytes=0)
    dataset.sample(8)
    (file,) = dataset.engine.shard.arena[CAMERA].files
    inherited = file._container
    assert inherited is not None
    monkeypatch.setattr(video.os, "getpid", lambda: -1)                  # as seen from a child
    batch = dataset.sample(8)
    assert file._container is not None and file._container is not inherited
    episode, step = _episode_and_step(batch)
    assert min(_psnr(f, made.frame(e, t)) for f, e, t in zip(batch[KEY].numpy(), episode, step)) > 30.0


@pytest.mark.parametrize("shift, said", [(0.05, "off its frame grid"), (0.3, "outside its episode segment")])
def test_timestamps_that_are_not_frames_of_their_episodes_video_are_refused(tmp_path, shift, said):
    root = _copy(tmp_path)
    episodes = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(episodes)
    name = f"videos/{CAMERA}/from_timestamp"
    moved = pa.array([t + shift for t in table.column(name).to_pylist()], table.schema.field(name).type)
    pq.write_table(table.set_column(table.schema.get_field_index(name), name, moved), episodes)
    with pytest.raises(ab.FormatError, match=f"{re.escape(CAMERA)}: a row at timestamp .* {said}"):
        ab.open_dataset(root)


def test_each_frame_carries_its_task_string_from_meta_tasks_as_a_text_field(tmp_path):
    """The instruction a VLA policy reads: ``task_index``'s string in ``meta/tasks.parquet``."""
    root = _copy(tmp_path)
    dataset = ab.open_dataset(root, seed=0)
    assert dataset.schema.fields["task"] == ab.Field("string")
    for batch in (dataset.sample(32), dataset.gather(np.arange(len(dataset)))):
        episode, _ = _episode_and_step(batch)
        assert list(batch["task"]) == [made.TASKS[e] for e in episode]
    assert dataset.to_arrow().column("task").to_pylist()[:3] == [made.TASKS[0]] * 3


def test_a_task_index_that_names_no_task_is_a_format_error_naming_the_file(tmp_path):
    root = _copy(tmp_path)
    tasks = pq.read_table(root / "meta" / "tasks.parquet")
    pq.write_table(tasks.slice(0, 1), root / "meta" / "tasks.parquet")   # task 1 gone: episode 1's frames name it
    with pytest.raises(ab.FormatError, match=r"task_index \[1, 1, 1, 1, 1\] names no task of meta/tasks.parquet"):
        ab.open_dataset(root, seed=0)


@pytest.mark.parametrize("bad", [(-1, 0), (1, 0), (0, -3)], ids=["negative file", "file past the last", "negative frame"])
def test_a_frame_reference_naming_no_file_or_frame_is_a_format_error_not_another_file_s_frame(tmp_path, bad):
    # Damage the cache's references behind the recorded stat could leave (only verify=True hashes them):
    # a negative file index would have read the last file's frame as numpy wraps it.
    dataset = ab.open_dataset(_copy(tmp_path), seed=0, video_cache_bytes=0)
    column = dataset.engine.shard.arena[CAMERA]
    column.refs = np.array(column.refs)   # (a writable copy of the mapped references)
    column.refs[5] = bad
    with pytest.raises(ab.FormatError, match=rf"video field '{re.escape(CAMERA)}': row 5 refers to frame"):
        dataset.gather(np.arange(len(dataset)))
    assert dataset.gather(np.arange(3))[KEY].shape[0] == 3   # the other rows still read
