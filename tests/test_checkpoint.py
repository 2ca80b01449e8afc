"""Checkpoints: bit-exact round trips, sampler / limiter / writer state, incremental saves, bad input."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf import checkpoint

from support.compare import assert_same_batches, assert_same_store
from support.persist_data import KINDS, episode_of, fill, schema_of, wrapped_store


def sample_both(a: ab.ExperienceStore, b: ab.ExperienceStore, batches: int = 3, **kwargs) -> None:
    for _ in range(batches):
        assert_same_batches(a.sample(32, **kwargs), b.sample(32, **kwargs))


def row_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("rows-*.arrow"))


def test_a_wrapped_prioritized_store_loads_bit_exact_and_samples_the_same_batches(tmp_path):
    store = wrapped_store("w1", sampler=ab.PrioritizedSampler(alpha=0.7, beta=0.5))
    for _ in range(5):
        batch = store.sample(32)
        store.update_priorities(batch["index"], torch.rand(32, generator=torch.Generator().manual_seed(1)) * 3)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")

    assert_same_store(store, loaded)      # every episode-table column, first_row and inserted_at included
    assert repr(loaded.sampler) == repr(store.sampler)
    assert loaded.sampler.max_priority == store.sampler.max_priority
    assert loaded.sampler.mass(loaded.engine.table) == store.sampler.mass(store.engine.table)
    for _ in range(3):
        a, b = store.sample(32), loaded.sample(32)
        assert_same_batches(a, b)
        priority = a["weight"].double() + 0.5
        store.update_priorities(a["index"], priority)
        loaded.update_priorities(b["index"], priority)
    fill(store, "w1", 5, seed=3, first=100)
    fill(loaded, "w1", 5, seed=3, first=100)
    assert_same_store(store, loaded, skip=("inserted_at",))
    sample_both(store, loaded, n_step=3, frame_stack=2)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_field_round_trips_bit_exact(tmp_path, kind):
    store = wrapped_store(kind, seed=2, track_reuse=True)
    store.sample(100)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert_same_store(store, loaded)
    sample_both(store, loaded)
    assert loaded.track_reuse and loaded.created_at == store.created_at
    assert loaded.stats()["reuse"] == store.stats()["reuse"] is not None


@pytest.mark.parametrize("sampler", [
    lambda: ab.WithoutReplacementSampler(drop_last=True),
    lambda: ab.SequenceSampler(seq_len=4),
    lambda: ab.SequenceSampler(seq_len=3, strict=False),
    lambda: ab.EpisodeSampler(),
], ids=["without-replacement", "sequence", "sequence-padded", "episode"])
def test_sampler_state_is_restored_mid_epoch(tmp_path, sampler):
    store = wrapped_store("w1", sampler=sampler())
    store.sample(32)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert repr(loaded.sampler) == repr(store.sampler)
    sample_both(store, loaded, batches=8)
    if isinstance(store.sampler, ab.WithoutReplacementSampler):
        assert store.sampler.epoch == loaded.sampler.epoch >= 2


def test_rate_limiter_counters_and_settings_are_restored(tmp_path):
    limiter = ab.SampleToInsertRatio(samples_per_insert=2.0, min_size=50, error_buffer=10_000)
    store = wrapped_store("w1", rate_limiter=limiter)
    store.sample(64)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert isinstance(loaded.rate_limiter, ab.SampleToInsertRatio)
    assert loaded.stats()["rate_limiter"] == store.stats()["rate_limiter"]
    assert loaded.stats()["inserts"] == store.stats()["inserts"]


def _step(rng: np.random.Generator, num_envs: int, done_every: int, t: int) -> dict:
    env = np.arange(num_envs)
    episode = (env + t - 1) // done_every   # each env's episode: its observations go on from step to step
    obs = np.broadcast_to((t + 1000 * episode + 0.25 * env)[:, None], (num_envs, 17)).astype(np.float32)
    done = (env + t) % done_every == 0
    return {"obs": obs, "action": rng.standard_normal((num_envs, 6)).astype(np.float32),
            "reward": rng.standard_normal(num_envs).astype(np.float32), "terminated": done,
            "truncated": np.zeros(num_envs, bool), "next_obs": obs + 1}


def test_open_writer_episodes_are_saved_and_the_loaded_writer_continues_them(tmp_path):
    store = ab.ExperienceStore(capacity=500, seed=0, schema=schema_of("w1"))
    writer = store.writer(num_envs=3, name="actor")
    anonymous = store.writer(num_envs=2)
    rng = np.random.default_rng(0)
    for t in range(1, 12):
        writer.add(**_step(rng, 3, 5, t))
    assert writer.open_steps.any()
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert sorted(loaded.writers) == sorted(store.writers) == ["actor", "writer-0"]
    del anonymous

    with pytest.raises(ValueError, match="saved with num_envs=3"):
        loaded.writer(num_envs=4, name="actor")
    restored = loaded.writer(num_envs=3, name="actor", timeout=1.0)
    assert restored is loaded.writers["actor"]
    np.testing.assert_array_equal(restored.open_steps, writer.open_steps)
    with pytest.raises(ValueError, match="already open"):
        loaded.writer(num_envs=3, name="actor")
    for t in range(12, 30):
        step = _step(rng, 3, 5, t)
        writer.add(**step)
        restored.add(**step)
    writer.flush()
    restored.flush()
    assert_same_store(store, loaded, skip=("inserted_at",))


def test_episodes_a_writer_could_not_store_yet_are_saved_as_pending(tmp_path):
    store = ab.ExperienceStore(capacity=40, seed=0, schema=schema_of("w1"), mode="fixed")
    fill(store, "w1", 3, seed=0)
    writer = store.writer(num_envs=2, name="actor")
    rng = np.random.default_rng(1)
    for t in range(1, 30):
        writer.add(**_step(rng, 2, 9, t))
        if writer.pending:
            break
    assert writer.pending, "the full fixed store refused an episode"
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    restored = loaded.writer(num_envs=2, name="actor")
    assert restored.pending == writer.pending
    for s in (store, loaded):
        s.clear()
    writer.flush()
    restored.flush()
    assert_same_store(store, loaded, skip=("inserted_at",))
    assert store.num_episodes >= 2


def test_a_save_only_writes_the_episodes_added_since_the_previous_one(tmp_path):
    path = tmp_path / "ckpt"
    store = ab.ExperienceStore(capacity=300, seed=0, schema=schema_of("w1"), sampler=ab.PrioritizedSampler())
    fill(store, "w1", 10, seed=0)
    store.save(path)
    [first] = row_files(path)
    first_bytes = (path / first).stat().st_size

    fill(store, "w1", 3, seed=1, first=10)
    store.save(path)
    files = row_files(path)
    assert len(files) == 2
    [second] = [f for f in files if f != first]
    manifest = json.loads((path / "manifest.json").read_text())
    entry = next(e for e in manifest["row_files"] if e["path"] == second)
    assert entry["episodes"] == 3 and entry["first_episode_id"] == 10
    assert (path / second).stat().st_size < first_bytes / 2
    assert len(list(path.glob("state-*.arrow"))) == 1
    assert_same_store(store, ab.ExperienceStore.load(path))

    store.save(path)                   # nothing new: no new row file
    assert row_files(path) == files

    fill(store, "w1", 40, seed=2, first=13)    # evicts every episode of the first file
    assert store.episodes()["episode_id"][0].as_py() > 9
    store.save(path)
    assert first not in row_files(path)
    loaded = ab.ExperienceStore.load(path)
    assert_same_store(store, loaded)
    sample_both(store, loaded)


_OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("save")), st.tuples(st.just("sample")), st.tuples(st.just("clear"))), min_size=1, max_size=25)


@settings(max_examples=30, deadline=None)
@given(operations=_OPERATIONS, capacity=st.integers(13, 60))
# CI's derandomized run found it: the first episode trimmed to a piece, then evicted whole; episodes()
# listed first_step (all 0) while a loaded store did not.
@example(operations=[("add", 12, True), ("add", 1, True), ("add", 1, True), ("add", 12, False)], capacity=13)
def test_any_history_of_writes_and_incremental_saves_loads_bit_exact(operations, capacity):
    store = ab.ExperienceStore(capacity=capacity, seed=1, schema=schema_of("w1"), sampler=ab.PrioritizedSampler())
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        for operation in [*operations, ("save",)]:
            if operation[0] == "add":
                store.add_episode(episode_of("w1", rng, operation[1], operation[2]))
            elif operation[0] == "sample" and len(store):
                batch = store.sample(8)
                store.update_priorities(batch["index"], torch.arange(8.0))
            elif operation[0] == "clear":
                store.clear()
            elif operation[0] == "save":
                store.save(path)
                loaded = ab.ExperienceStore.load(path)
                assert_same_store(store, loaded)
                if len(store):
                    sample_both(store, loaded, batches=1)
        live = set(store.episodes()["episode_id"].to_pylist())
        manifest = json.loads((path / "manifest.json").read_text())
        for entry in manifest["row_files"]:   # no file without a live episode is kept
            assert live & set(range(entry["first_episode_id"], entry["last_episode_id"] + 1))
        assert sorted(p.name for p in path.glob("rows-*.arrow")) == sorted(e["path"] for e in manifest["row_files"])


def test_a_loaded_store_saves_incrementally_into_its_own_directory(tmp_path):
    path = tmp_path / "ckpt"
    store = wrapped_store("w1")
    store.save(path)
    loaded = ab.ExperienceStore.load(path)
    fill(loaded, "w1", 2, seed=5, first=50)
    loaded.save(path)
    assert len(row_files(path)) == 2
    assert_same_store(loaded, ab.ExperienceStore.load(path))
    # The original store now differs from what the directory holds: it saves everything again.
    store.save(path)
    assert len(row_files(path)) == 1
    assert_same_store(store, ab.ExperienceStore.load(path))


def test_an_eviction_during_the_save_is_caught_and_the_rows_are_copied_under_the_lock(tmp_path, monkeypatch):
    store = wrapped_store("w1", capacity=100, episodes=20)
    real = checkpoint._write_rows
    calls = []

    def racing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            fill(store, "w1", 12, seed=99, first=100)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "_write_rows", racing_write)
    store.save(tmp_path / "ckpt")
    assert len(calls) == 2
    assert len(row_files(tmp_path / "ckpt")) == 1
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert_same_store(store, loaded)
    sample_both(store, loaded)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    store = wrapped_store("w1")
    store.save(path)
    before = ab.ExperienceStore.load(path)
    fill(store, "w1", 4, seed=9, first=60)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_manifest", crash)
    with pytest.raises(OSError, match="disk full"):
        store.save(path)
    assert_same_store(before, ab.ExperienceStore.load(path))
    monkeypatch.undo()
    store.save(path)
    assert_same_store(store, ab.ExperienceStore.load(path))
    assert not [p.name for p in path.iterdir() if p.name.startswith(".")], "temporary files are cleaned up"


def test_an_empty_store_round_trips(tmp_path):
    store = ab.ExperienceStore(capacity=10, seed=4, mode="fixed")
    idle = store.writer(num_envs=2, name="idle")
    store.writer(num_envs=2, name="dropped")     # no one holds it: not saved
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert loaded.schema is None and loaded.mode == "fixed" and loaded.capacity == 10
    assert list(loaded.writers) == ["idle"] == list(store.writers)
    assert loaded.writers["idle"].num_envs == idle.num_envs
    rng = np.random.default_rng(0)
    episode = episode_of("w1", rng, 4, True)
    store.add_episode(episode)
    loaded.add_episode(episode)
    assert_same_batches(store.sample(8), loaded.sample(8))


def test_a_missing_or_unfinished_checkpoint_is_refused(tmp_path):
    with pytest.raises(ab.FormatError, match="no such directory"):
        ab.ExperienceStore.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ab.FormatError, match=r"manifest.json: missing; .*did not finish"):
        ab.ExperienceStore.load(tmp_path / "empty")
    store = wrapped_store("w1")
    store.save(tmp_path / "ckpt")
    victim = next((tmp_path / "ckpt").glob("rows-*.arrow"))
    victim.unlink()
    with pytest.raises(ab.FormatError, match=rf"{victim.name}: missing"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


@pytest.mark.parametrize("victim", ["rows-*.arrow", "state-*.arrow", "manifest.json"])
def test_a_truncated_checkpoint_file_is_refused_naming_it(tmp_path, victim):
    store = wrapped_store("w1")
    store.save(tmp_path / "ckpt")
    file = next((tmp_path / "ckpt").glob(victim))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ab.FormatError, match=rf"{file.name}: .*truncated"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_a_file_corrupted_in_place_is_refused(tmp_path, monkeypatch):
    store = wrapped_store("w1")
    store.save(tmp_path / "ckpt")
    file = next((tmp_path / "ckpt").glob("rows-*.arrow"))
    data = bytearray(file.read_bytes())
    data[-10:] = b"\0" * 10                 # same size, footer destroyed
    file.write_bytes(bytes(data))
    with pytest.raises(ab.FormatError, match=rf"{file.name}: its content hash differs .* corrupted"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_a_checkpoint_of_a_newer_format_version_is_refused(tmp_path):
    store = wrapped_store("w1")
    store.save(tmp_path / "ckpt")
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = checkpoint.FORMAT_VERSION + 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ab.FormatError, match=f"format version {checkpoint.FORMAT_VERSION + 1} .*Upgrade arrowbuf"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_exports_and_checkpoints_are_not_mistaken_for_each_other(tmp_path):
    store = wrapped_store("w1")
    store.save(tmp_path / "ckpt")
    store.to_parquet(tmp_path / "export")
    with pytest.raises(ab.FormatError, match="an arrowbuf checkpoint, not a Parquet export; .*ExperienceStore.load"):
        ab.ExperienceStore.from_parquet(tmp_path / "ckpt")
    with pytest.raises(ab.FormatError, match="a Parquet export, not a checkpoint; .*from_parquet"):
        ab.ExperienceStore.load(tmp_path / "export")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "manifest.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not an arrowbuf checkpoint"):
        store.save(tmp_path / "foreign")


def test_progress_bars_show_when_asked(tmp_path, capsys):
    store = wrapped_store("w1")
    store.save(tmp_path / "quiet")
    ab.ExperienceStore.load(tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    store.save(tmp_path / "loud", progress=True)
    ab.ExperienceStore.load(tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    assert "save loud" in err and "load loud" in err


def test_saves_and_exports_taken_while_another_thread_writes_are_consistent_snapshots(tmp_path):
    schema = ab.Schema({"obs": ab.Field("float64", (2,), True), "action": ab.Field("int64")})
    store = ab.ExperienceStore(capacity=300, seed=0, schema=schema)
    stop = threading.Event()

    def actor() -> None:
        k = 0
        while not stop.is_set():   # episode k holds obs [k, t]: its id is k
            steps = 3 + k % 17
            t = np.arange(steps + 1, dtype=np.float64)
            store.add_episode({"obs": np.stack([np.full_like(t, k), t], 1), "action": np.full(steps, k)})
            k += 1
            # Let the GIL go between writes, as an env step would: a loop that only writes takes
            # the engine's lock again before the woken saver runs, and alone this test once took
            # 346 s of starved saves (11 s in a full run).
            time.sleep(0)

    thread = threading.Thread(target=actor)
    thread.start()
    try:
        for i in range(6):
            store.save(tmp_path / "ckpt")
            store.to_parquet(tmp_path / f"export-{i}")
            for loaded in (ab.ExperienceStore.load(tmp_path / "ckpt"),
                           ab.ExperienceStore.from_parquet(tmp_path / f"export-{i}")):
                table = loaded.episodes()
                firsts = table["first_step"].to_pylist() if "first_step" in table.column_names else [0] * len(table)
                for episode_id, first in zip(table["episode_id"].to_pylist(), firsts):
                    rows = loaded.episode(episode_id)
                    obs = rows.column("obs").storage.flatten().to_numpy().reshape(-1, 2)
                    np.testing.assert_array_equal(obs[:, 0], episode_id)
                    # (the oldest episode may have lost its first steps to the capacity: it starts at first_step)
                    np.testing.assert_array_equal(obs[:, 1], first + np.arange(len(obs)))
    finally:
        stop.set()
        thread.join()
    store.save(tmp_path / "ckpt")
    assert_same_store(store, ab.ExperienceStore.load(tmp_path / "ckpt"))
