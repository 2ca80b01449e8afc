"""Offline datasets: exports, Arrow IPC directories and LeRobot v3 data, opened memory-mapped."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import arrowbuf as ab
from arrowbuf.errors import EmptyStoreError, FormatError


def _episode(rng: np.random.Generator, T: int, final: bool = True) -> dict:
    return {"obs": rng.standard_normal((T + int(final), 3)).astype(np.float32),
            "action": rng.integers(0, 5, T).astype(np.int64),
            "reward": rng.standard_normal(T).astype(np.float32),
            "terminated": np.arange(T) == T - 1, "truncated": np.zeros(T, bool)}


def _store(seed: int = 0, sampler=None, episodes: int = 6) -> ab.ExperienceStore:
    rng = np.random.default_rng(seed)
    store = ab.ExperienceStore(capacity=10_000, seed=seed, sampler=sampler)
    for k in range(episodes):
        store.add_episode(_episode(rng, 5 + 3 * k, final=k != 2), env_id=f"env-{k % 2}")
    return store


def _same(a, b) -> None:
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kwargs", [{}, {"n_step": 3, "gamma": 0.9}, {"frame_stack": 3}])
def test_an_export_samples_as_the_store_that_wrote_it(tmp_path, kwargs):
    store = _store(seed=5)
    export = store.to_parquet(tmp_path / "export")
    dataset = ab.open_dataset(export, seed=5)
    assert len(dataset) == len(store) and dataset.num_episodes == store.num_episodes
    assert dataset.episodes().column("episode_id").to_pylist() == store.episodes().column("episode_id").to_pylist()
    for _ in range(5):   # the same seed draws the same indices from the same live range
        _same(dataset.sample(64, **kwargs), store.sample(64, **kwargs))


def test_every_transition_of_an_export_reads_back_by_index(tmp_path):
    store = _store(seed=1)
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"))
    index = np.arange(len(store))
    _same(dataset.gather(index), store.gather(index))
    epoch = [b for b in dataset.iter_batches(7, shuffle=False)]
    assert torch.equal(torch.cat([b["index"] for b in epoch]), torch.as_tensor(index))
    with pytest.raises(KeyError):
        dataset.gather(np.array([len(store)]))
    ids = store.episodes().column("episode_id").to_pylist()
    assert dataset.episode(ids[3]).equals(store.episode(ids[3]))


def test_sequence_windows_of_a_dataset_stay_in_their_episodes(tmp_path):
    store = _store(seed=2, sampler=ab.SequenceSampler(seq_len=4))
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"), seed=2, sampler=ab.SequenceSampler(seq_len=4))
    for _ in range(3):
        batch = dataset.sample(32)
        _same(batch, store.sample(32))
        assert batch["index"].shape == (32, 4)
        assert bool((batch["episode_id"] == batch["episode_id"][:, :1]).all())


def test_shaped_fields_are_cached_as_rows_of_bytes_and_a_version_1_cache_still_reads(tmp_path, monkeypatch):
    # Arrow's IPC writer refuses an array of 2**31 values or more: a fixed-size list column's
    # values reach that at 126M rows of obs[17] (a 28 GB W1 dataset failed to convert that
    # way), rows of bytes only at 2**31 rows. Version 1 caches (lists) must still open.
    from arrowbuf import _dataset_cache as cache

    store = _store(seed=4)
    export = store.to_parquet(tmp_path / "export")
    dataset = ab.open_dataset(export, seed=4)
    schema = pa.ipc.open_file(pa.memory_map(str(export / ".arrowbuf-cache" / cache.ROWS))).schema
    assert schema.field("obs").type == pa.binary(12)                     # 3 float32 per row
    assert json.loads((export / ".arrowbuf-cache" / cache.MANIFEST).read_text())["format_version"] == 2
    monkeypatch.setattr(cache, "FORMAT_VERSION", 1)
    old = ab.open_dataset(export, cache_dir=tmp_path / "v1", seed=4)
    monkeypatch.undo()
    assert json.loads((tmp_path / "v1" / cache.MANIFEST).read_text())["format_version"] == 1
    old = ab.open_dataset(export, cache_dir=tmp_path / "v1", seed=4)   # read by this version
    index = np.arange(len(store))
    _same(old.gather(index), store.gather(index))
    _same(dataset.gather(index), store.gather(index))


def test_bfloat16_and_shaped_bool_fields_round_trip_through_the_cache(tmp_path):
    store = ab.ExperienceStore(capacity=200, seed=0)
    rng = np.random.default_rng(0)
    for T in (4, 7):
        store.add_episode({"obs": torch.from_numpy(rng.standard_normal((T + 1, 2, 3)).astype(np.float32)).bfloat16(),
                           "contact": rng.random((T, 4)) < 0.5, "action": rng.integers(0, 3, T),
                           "terminated": np.arange(T) == T - 1})
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"))
    index = np.arange(len(store))
    mine, theirs = dataset.gather(index), store.gather(index)
    assert mine["obs"].dtype == torch.bfloat16 and mine["contact"].dtype == torch.bool and mine["contact"].shape == (11, 4)
    _same(mine, theirs)


def test_an_arrow_ipc_directory_opens_like_the_store(tmp_path):
    store = _store(seed=3)
    directory = tmp_path / "ipc"
    directory.mkdir()
    for name, table in (("rows.arrow", store.to_arrow()), ("episodes.arrow", store.episodes())):
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    dataset = ab.open_dataset(directory, seed=3)
    assert len(dataset) == len(store)
    _same(dataset.sample(50), store.sample(50))


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def _lerobot(root: Path, lengths=(5, 7, 4)) -> dict:
    """A LeRobot v3-shaped dataset: two data files, meta/info.json and meta/episodes."""
    rng = np.random.default_rng(0)
    frames = []
    index = 0
    for episode, T in enumerate(lengths):
        for t in range(T):
            frames.append({"observation.state": rng.standard_normal(3).astype(np.float32).tolist(),
                           "observation.image": rng.integers(0, 256, (4, 5, 3), dtype=np.uint8),
                           "action": rng.standard_normal(2).astype(np.float32).tolist(),
                           "timestamp": np.float32(t / 10), "frame_index": t, "episode_index": episode,
                           "index": index, "task_index": episode % 2, "next.reward": np.float32(rng.random()),
                           "next.done": t == T - 1})
            index += 1

    def table(rows):
        return pa.table({
            "observation.state": pa.array([r["observation.state"] for r in rows], pa.list_(pa.float32())),
            "observation.image": pa.array([{"bytes": _png(r["observation.image"]), "path": None} for r in rows],
                                          pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "action": pa.array([r["action"] for r in rows], pa.list_(pa.float32())),
            **{c: pa.array([r[c] for r in rows]) for c in ("timestamp", "frame_index", "episode_index", "index",
                                                            "task_index", "next.reward", "next.done")}})

    split = lengths[0] + lengths[1]
    for k, rows in enumerate((frames[:split], frames[split:])):
        (root / "data" / "chunk-000").mkdir(parents=True, exist_ok=True)
        pq.write_table(table(rows), root / "data" / "chunk-000" / f"file-{k:03d}.parquet")
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.table({"episode_index": list(range(len(lengths))), "length": list(lengths)}),
                   root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    scalar = {"shape": [1], "names": None}
    info = {"codebase_version": "v3.0", "fps": 10, "total_episodes": len(lengths), "total_frames": sum(lengths),
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "features": {"observation.state": {"dtype": "float32", "shape": [3], "names": None},
                         "observation.image": {"dtype": "image", "shape": [4, 5, 3],
                                               "names": ["height", "width", "channel"]},
                         "language_instruction": {"dtype": "string", "shape": [1], "names": None},
                         "action": {"dtype": "float32", "shape": [2], "names": None},
                         "timestamp": {"dtype": "float32", **scalar}, "frame_index": {"dtype": "int64", **scalar},
                         "episode_index": {"dtype": "int64", **scalar}, "index": {"dtype": "int64", **scalar},
                         "task_index": {"dtype": "int64", **scalar}, "next.reward": {"dtype": "float32", **scalar},
                         "next.done": {"dtype": "bool", **scalar}}}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    return {"frames": frames, "lengths": lengths}


def test_a_lerobot_v3_dataset_opens_and_samples_its_frames(tmp_path):
    made = _lerobot(tmp_path / "lerobot")
    frames, lengths = made["frames"], made["lengths"]
    dataset = ab.open_dataset(tmp_path / "lerobot", seed=0)
    assert len(dataset) == sum(T - 1 for T in lengths)        # no observation after the last frame
    assert dataset.episodes().column("episode_id").to_pylist() == [0, 1, 2]
    assert dataset.episodes().column("terminated").to_pylist() == [True, True, True]
    assert dataset.info["skipped"] == ["language_instruction (string)"]
    starts = np.cumsum([0, *lengths[:-1]])
    batch = dataset.sample(200)
    for k in range(200):
        episode, step = int(batch["episode_id"][k]), int(batch["step"][k])
        frame, after = frames[starts[episode] + step], frames[starts[episode] + step + 1]
        assert batch["observation", "state"][k].tolist() == frame["observation.state"]
        assert batch["next", "observation", "state"][k].tolist() == after["observation.state"]
        assert np.array_equal(batch["observation", "image"][k].numpy(), frame["observation.image"])
        assert np.array_equal(batch["next", "observation", "image"][k].numpy(), after["observation.image"])
        assert batch["action"][k].tolist() == frame["action"]
        assert float(batch["reward"][k]) == float(frame["next.reward"])
        assert bool(batch["terminated"][k]) == frame["next.done"]
        assert int(batch["dataset_index"][k]) == frame["index"]
    stacked = dataset.sample(64, n_step=2, gamma=0.5)
    assert bool((stacked["n_steps"] >= 1).all()) and bool((stacked["n_steps"] <= 2).all())


def test_a_lerobot_video_feature_without_its_episode_metadata_or_files_is_refused(tmp_path):
    # Videos are sampled (tests/test_dataset_lerobot.py): their frames are found through
    # meta/episodes' videos/<key>/... columns, and their files must be there.
    _lerobot(tmp_path / "lerobot")
    info_path = tmp_path / "lerobot" / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.images.wrist"] = {"dtype": "video", "shape": [4, 5, 3], "names": None}
    info_path.write_text(json.dumps(info))
    with pytest.raises(FormatError, match=r"no columns \['videos/observation.images.wrist/chunk_index'"):
        ab.open_dataset(tmp_path / "lerobot")
    episodes = tmp_path / "lerobot" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    key = "videos/observation.images.wrist"
    pq.write_table(pa.table({"episode_index": [0, 1, 2], "length": [5, 7, 4], f"{key}/chunk_index": [0, 0, 0],
                             f"{key}/file_index": [0, 0, 1], f"{key}/from_timestamp": [0.0, 0.5, 0.0],
                             f"{key}/to_timestamp": [0.5, 1.2, 0.4]}), episodes)
    with pytest.raises(FormatError, match=f"{key}/chunk-000/file-000.mp4: missing; video field 'observation.images"):
        ab.open_dataset(tmp_path / "lerobot")


def test_a_lerobot_dataset_whose_episode_lengths_disagree_is_refused(tmp_path):
    _lerobot(tmp_path / "lerobot")
    pq.write_table(pa.table({"episode_index": [0, 1, 2], "length": [5, 6, 4]}),
                   tmp_path / "lerobot" / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    with pytest.raises(FormatError, match="lengths"):
        ab.open_dataset(tmp_path / "lerobot")


def test_the_cache_is_reused_and_rebuilt_when_its_source_changes(tmp_path):
    export = _store(seed=0).to_parquet(tmp_path / "export")
    ab.open_dataset(export)
    cache = export / ".arrowbuf-cache" / "rows.arrow"
    written = cache.stat().st_mtime_ns
    ab.open_dataset(export)
    assert cache.stat().st_mtime_ns == written                 # opened, not converted again
    # The export is replaced by one of another store (its directory swapped, the cache with it):
    # a cache kept elsewhere is stale.
    cache_dir = tmp_path / "cache"
    ab.open_dataset(export, cache_dir=cache_dir)
    bigger = _store(seed=0, episodes=8)
    bigger.to_parquet(export, overwrite=True)
    with pytest.raises(FormatError, match="stale"):
        ab.open_dataset(export, cache_dir=cache_dir, rebuild=False)
    assert len(ab.open_dataset(export, cache_dir=cache_dir)) == len(bigger)


def test_a_damaged_cache_raises_format_error(tmp_path):
    export = _store(seed=0).to_parquet(tmp_path / "export")
    ab.open_dataset(export)
    rows = export / ".arrowbuf-cache" / "rows.arrow"
    stat = rows.stat()
    data = bytearray(rows.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rows.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="damaged"):
        ab.open_dataset(export)
    os.utime(rows, ns=(stat.st_atime_ns, stat.st_mtime_ns))   # mtime as recorded: only verify=True hashes
    with pytest.raises(FormatError, match="damaged"):
        ab.open_dataset(export, verify=True)
    rows.write_bytes(bytes(data[:-100]))
    with pytest.raises(FormatError, match="bytes"):
        ab.open_dataset(export)
    (export / ".arrowbuf-cache" / "_dataset.json").write_text("{not json")
    with pytest.raises(FormatError):
        ab.open_dataset(export)


def test_bad_arguments_and_empty_datasets(tmp_path):
    with pytest.raises(FormatError, match="not a dataset"):
        ab.open_dataset(tmp_path)
    store = _store(seed=0)
    export = store.to_parquet(tmp_path / "export")
    with pytest.raises(ValueError, match="sampler"):
        ab.open_dataset(export, sampler="uniform")
    dataset = ab.open_dataset(export)
    with pytest.raises(ValueError, match="batch_size"):
        dataset.sample(0)
    with pytest.raises(ValueError, match="PrioritizedSampler"):
        dataset.update_priorities(np.array([0]), np.array([1.0]))
    empty = ab.ExperienceStore(capacity=10, schema=store.schema)
    empty.add_episode({"obs": np.zeros((1, 3), np.float32), "action": np.zeros(1, np.int64),
                       "reward": np.zeros(1, np.float32), "terminated": np.array([True]),
                       "truncated": np.array([False])})   # one step, no final observation: no transition
    with pytest.raises(EmptyStoreError):
        ab.open_dataset(empty.to_parquet(tmp_path / "empty")).sample(4)


def test_a_prioritized_dataset_follows_its_priorities(tmp_path):
    export = _store(seed=0).to_parquet(tmp_path / "export")
    dataset = ab.open_dataset(export, seed=0, sampler=ab.PrioritizedSampler(alpha=1.0, beta=1.0))
    batch = dataset.sample(64)
    assert "weight" in batch.keys()
    priority = np.full(len(dataset), 1e-6)
    priority[7] = 1e6
    assert dataset.update_priorities(np.arange(len(dataset)), priority) == len(dataset)
    assert (dataset.sample(256)["index"] == 7).float().mean() > 0.95


_RSS_CHILD = textwrap.dedent("""
    import gc, json, sys, psutil, numpy as np, arrowbuf as ab
    path, process = sys.argv[1], psutil.Process()
    for arg in sys.argv[2:]:
        dataset = ab.open_dataset(path, seed=0, resident_limit=int(arg) if arg != "none" else None)
        dataset.sample(64)
        baseline = process.memory_info().rss
        peak = baseline
        for batch in dataset.iter_batches(64):        # every row once, in random order
            peak = max(peak, process.memory_info().rss)
        for _ in range(100):
            dataset.sample(64)
            peak = max(peak, process.memory_info().rss)
        print(json.dumps({"growth": peak - baseline, "file": dataset.nbytes}), flush=True)
        dataset.close()
        del dataset, batch
        gc.collect()
""")


def test_sampling_a_dataset_larger_than_its_resident_limit_stays_under_it(tmp_path):
    """The rows file is 5x the bound; resident memory (RSS, mapped pages included) grows by less
    than the bound while every row is read. Without the limit, the same reads map the whole file."""
    T, episodes = 499, 16
    store = ab.ExperienceStore(capacity=episodes * (T + 1), seed=0)
    for k in range(episodes):
        obs = np.broadcast_to((np.arange(T + 1) % 251).astype(np.uint8)[:, None, None, None], (T + 1, 32, 32, 12))
        store.add_episode({"pixels": np.ascontiguousarray(obs), "action": np.full(T, k, np.int64),
                           "terminated": np.arange(T) == T - 1})
    export = store.to_parquet(tmp_path / "export")
    ab.open_dataset(export)   # converted here, not in the child
    bound = 16 << 20
    env = {**os.environ, "PYTHONPATH": str(Path(ab.__file__).parents[1])}

    # One child measures both (each imports torch: seconds), the limited dataset first, in a
    # fresh process; the unlimited one, opened once the first is closed, is the control.
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(export), str(bound // 2), "none"],
                         capture_output=True, text=True, env=env, check=True)
    limited, unlimited = map(json.loads, out.stdout.strip().splitlines()[-2:])
    assert limited["file"] > 5 * bound
    assert limited["growth"] < bound, limited
    assert unlimited["growth"] > 3 * bound, unlimited


def test_sampling_small_rows_of_a_dataset_larger_than_its_resident_limit_stays_under_it(tmp_path):
    """W1-sized rows (98 bytes): a gathered row's read of a column can make far more than its
    page resident (the kernel maps the cached pages around a read fault of a file, 64 KiB by
    default), so the bound must hold with that counted. Columns 7x the bound, batches of 16
    (each one maps up to 5 MB); resident memory after each batch stays within the bound."""
    T, episodes = 999, 300
    rng = np.random.default_rng(0)
    store = ab.ExperienceStore(capacity=episodes * (T + 1), seed=0)
    step = {"obs": rng.standard_normal((T + 1, 17), np.float32), "action": rng.standard_normal((T, 6), np.float32),
            "reward": rng.standard_normal(T, np.float32), "terminated": np.arange(T) == T - 1,
            "truncated": np.zeros(T, bool)}
    for _ in range(episodes):
        store.add_episode(step)
    export = store.to_parquet(tmp_path / "export")
    ab.open_dataset(export)   # converted here, not in the child
    bound = 4 << 20
    env = {**os.environ, "PYTHONPATH": str(Path(ab.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", _RSS_SMALL_ROWS_CHILD, str(export), str(bound)],
                         capture_output=True, text=True, env=env, check=True)
    limited = json.loads(out.stdout.strip().splitlines()[-1])
    assert limited["file"] > 7 * bound
    assert limited["growth"] < 2 * bound, limited   # the limit, and one batch's pages at most


_RSS_SMALL_ROWS_CHILD = textwrap.dedent("""
    import json, sys, psutil, arrowbuf as ab
    dataset = ab.open_dataset(sys.argv[1], seed=0, resident_limit=int(sys.argv[2]))
    process = psutil.Process()
    dataset.sample(16)
    dataset.release()
    baseline = peak = process.memory_info().rss
    for _ in range(300):
        dataset.sample(16)
        peak = max(peak, process.memory_info().rss)
    print(json.dumps({"growth": peak - baseline, "file": dataset.nbytes}))
""")


@pytest.mark.parametrize("restore_mtime", [False, True])
def test_flipped_bytes_in_a_cache_raise_format_error_or_read_the_same_rows(tmp_path, restore_mtime):
    """Damage written later (a new mtime) is caught by the hashes by default; damage behind the
    recorded mtime needs verify=True. Either way, no flip ever reads different rows."""
    export = _store(seed=0).to_parquet(tmp_path / "export")
    pristine = ab.open_dataset(export).to_arrow()
    cache = export / ".arrowbuf-cache"
    originals = {name: (cache / name).read_bytes() for name in ("rows.arrow", "episodes.arrow", "_dataset.json")}
    stats = {name: (cache / name).stat() for name in originals}
    rng = np.random.default_rng(0)
    outcomes = {"rejected": 0, "same": 0}
    for trial in range(45):
        name = list(originals)[trial % 3]
        data = bytearray(originals[name])
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        (cache / name).write_bytes(bytes(data))
        if restore_mtime:
            os.utime(cache / name, ns=(stats[name].st_atime_ns, stats[name].st_mtime_ns))
        try:
            dataset = ab.open_dataset(export, verify=restore_mtime, rebuild=False)
        except FormatError:
            outcomes["rejected"] += 1
        else:
            assert dataset.to_arrow().equals(pristine), (name, trial)
            outcomes["same"] += 1
            dataset.close()
        (cache / name).write_bytes(originals[name])
        os.utime(cache / name, ns=(stats[name].st_atime_ns, stats[name].st_mtime_ns))
    assert outcomes["rejected"] >= 40, outcomes


def _damage(path: Path, rng: np.random.Generator, keep: str) -> None:
    """Flip one bit of ``path`` and hide it as ``keep`` does: "utime" restores the mtime (and
    atime), "cp -p" copies the damaged file over the cache file keeping its times (as rsync -t)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    if keep == "utime":
        path.write_bytes(bytes(data))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:
        damaged = path.with_name("damaged")
        damaged.write_bytes(bytes(data))
        os.utime(damaged, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        subprocess.run(["cp", "-p", str(damaged), str(path)], check=True)
        damaged.unlink()
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_size == stat.st_size


@pytest.mark.parametrize("keep", ["utime", "cp -p"])
def test_damage_that_keeps_the_mtime_is_caught_without_verify_and_never_sampled(tmp_path, keep, monkeypatch):
    # Hashes were checked only when the mtime changed: 18 of 64 such damages loaded wrong values.
    from arrowbuf import _dataset_cache

    export = _store(seed=0, episodes=30).to_parquet(tmp_path / "export")   # rows.arrow is mostly values
    pristine = ab.open_dataset(export).to_arrow()
    cache = export / ".arrowbuf-cache"
    originals = {name: (cache / name).read_bytes() for name in ("rows.arrow", "episodes.arrow")}
    times = {name: (cache / name).stat() for name in originals}   # as the manifest records them
    rng = np.random.default_rng(1)
    errors, wrong = [], []
    for trial in range(16):
        name = list(originals)[trial % 2]
        _damage(cache / name, rng, keep)
        try:
            dataset = ab.open_dataset(export, rebuild=False)
        except FormatError as err:
            errors.append(str(err))
        else:
            if not dataset.to_arrow().equals(pristine):
                wrong.append((trial, name))
            dataset.close()
        (cache / name).write_bytes(originals[name])
        os.utime(cache / name, ns=(times[name].st_atime_ns, times[name].st_mtime_ns))
    assert wrong == []
    assert len(errors) == 16 and all("differs from the cache's recorded SHA-256" in e for e in errors), errors
    # Intact again: hashed once (new ctime), its stat recorded; the next open hashes nothing.
    hashed = []
    real = _dataset_cache.file_digest
    monkeypatch.setattr(_dataset_cache, "file_digest", lambda path: hashed.append(path) or real(path))
    assert ab.open_dataset(export, rebuild=False).to_arrow().equals(pristine)
    assert sorted(p.name for p in hashed if p.parent == cache) == ["episodes.arrow", "rows.arrow"]
    hashed.clear()
    assert ab.open_dataset(export, rebuild=False).to_arrow().equals(pristine)
    assert [p for p in hashed if p.parent == cache] == []   # the export's own manifest is hashed, it is small


@pytest.mark.usefixtures("ray_session")
def test_the_export_of_a_sharded_ray_store_opens_with_every_episode_whole(tmp_path):
    store = ab.ExperienceStore(capacity=2_000, backend="ray", num_shards=2, seed=0)
    try:
        rng = np.random.default_rng(0)
        for k in range(8):
            T = 5 + k
            store.add_episode({"obs": rng.standard_normal((T + 1, 2)).astype(np.float32),
                               "action": np.full(T, k, np.int64), "terminated": np.arange(T) == T - 1},
                              env_id=f"env-{k}")
        store.flush()
        dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"), seed=0)
        assert len(dataset) == len(store) == sum(5 + k for k in range(8))
        batch = dataset.gather(np.arange(len(dataset)))
        assert torch.equal(batch["episode_id"], batch["action"])     # each row in its own episode
        assert sorted(dataset.episodes().column("episode_id").to_pylist()) == list(range(8))
    finally:
        store.close()
