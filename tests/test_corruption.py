"""Corrupted, edited and interrupted persistence: typed errors, never a crash or wrong data."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import arrowbuf as ab
from arrowbuf import _filesink
from arrowbuf.ray.options import NAMESPACE

from support.compare import assert_same_store
from support.persist_data import edit_checkpoint, wrapped_store


_spec = importlib.util.spec_from_file_location("corrupt", Path(__file__).parents[1] / "tools" / "corrupt.py")
corrupt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corrupt)


# -- byte flips and truncations ------------------------------------------------------------


def test_flipped_bytes_and_cut_files_never_crash_never_load_wrong_data_and_raise_format_error(tmp_path):
    result = corrupt.campaign(flips=210, seed=1, root=tmp_path)
    total = result["total"]
    examples = [e for r in result["fixtures"].values() for e in r["examples"]]
    assert total["flips"] == 210 and total["truncations"] > 0
    assert (total["crash"], total["untyped"], total["wrong"]) == (0, 0, 0), examples[:10]
    assert total["rejected"] + total["same"] == total["tried"]
    for fixture in corrupt.FIXTURES:   # every kind of file of every fixture was hit
        assert result["fixtures"][fixture]["tried"] > 70


def test_corruptions_behind_a_resealed_manifest_never_crash_and_raise_only_format_error(tmp_path):
    # The manifest is made to match each corruption, so the hashes cannot catch it:
    # Arrow validation, page checksums and the state checks must. A flipped value in
    # a checkpoint's data buffer then loads as written, which no check can tell.
    result = corrupt.campaign(flips=120, seed=2, root=tmp_path, reseal=True)
    total = result["total"]
    examples = [e for r in result["fixtures"].values() for e in r["examples"] if "wrong" not in e]
    assert total["flips"] == 120 and total["truncations"] > 0
    assert (total["crash"], total["untyped"]) == (0, 0), examples[:10]
    for fixture in ("parquet-none", "parquet-zstd"):   # page checksums: no wrong data from Parquet
        assert result["fixtures"][fixture]["wrong"] == 0, result["fixtures"][fixture]["examples"][:10]


def test_a_flipped_byte_in_a_data_page_fails_the_page_checksum_of_plain_readers(tmp_path):
    store = wrapped_store("w1", capacity=100, episodes=20)
    out = store.to_parquet(tmp_path / "out", compression="none")
    part = next((out / "steps").glob("*.parquet"))
    chunk = pq.ParquetFile(part).metadata.row_group(0).column(0)
    data = bytearray(part.read_bytes())
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    data[start + chunk.total_compressed_size - 8] ^= 0x40   # inside the last page's values
    part.write_bytes(bytes(data))
    with pytest.raises(OSError, match="CRC|checksum"):
        pq.read_table(part, page_checksum_verification=True)
    with pytest.raises(ab.FormatError, match=rf"{part.name}: its content hash differs"):
        ab.ExperienceStore.from_parquet(out)


def test_read_parquet_raises_format_error_for_flipped_bytes_as_from_parquet_does(tmp_path):
    # read_parquet's dataset met them in a scan, as pyarrow's untyped OSError ("CRC checksum
    # verification failed"), or not at all where no page checksum covers the byte.
    store = wrapped_store("w1", capacity=100, episodes=20)
    out = store.to_parquet(tmp_path / "out", compression="none")
    part = next((out / "steps").glob("*.parquet"))
    pristine, expected = part.read_bytes(), ab.read_parquet(out).to_table()
    for offset in np.linspace(4, len(pristine) - 9, 12).astype(int).tolist():
        data = bytearray(pristine)
        data[offset] ^= 0x40
        part.write_bytes(bytes(data))
        with pytest.raises(ab.FormatError, match=part.name):
            ab.read_parquet(out).to_table()
        with pytest.raises(ab.FormatError, match=part.name):
            ab.ExperienceStore.from_parquet(out)
    part.write_bytes(pristine)
    assert ab.read_parquet(out).to_table().equals(expected)


def _without_hashes(manifest_path: Path) -> None:
    """Null every file's sha256 and seal the manifest again (its own checksum matches)."""
    from arrowbuf._persist import write_manifest

    def drop(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: None if k == "sha256" else drop(v) for k, v in value.items()}
        return [drop(v) for v in value] if isinstance(value, list) else value

    manifest = json.loads(manifest_path.read_text())
    manifest.pop("checksum", None)
    write_manifest(manifest_path, drop(manifest))


def test_current_manifests_without_content_hashes_are_refused(tmp_path):
    store = wrapped_store("w1", capacity=100, episodes=20)
    out = store.to_parquet(tmp_path / "out")
    _without_hashes(out / "_arrowbuf.json")
    for read in (ab.ExperienceStore.from_parquet, ab.read_parquet):
        with pytest.raises(ab.FormatError, match=r"_arrowbuf.json: the entry of .* has sha256=None; this format "
                                                 r"version records every file's content hash"):
            read(out)
    store.save(tmp_path / "ckpt")
    _without_hashes(tmp_path / "ckpt" / "manifest.json")
    with pytest.raises(ab.FormatError, match=r"has sha256=None; this format version records"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


# -- edited manifests: well-formed, re-sealed, impossible ----------------------------------


def _last(state: dict, column: str) -> int:
    return int(state["shard"]["table"]["columns"][column][-1])


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def edit(state: dict) -> None:
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(state) if callable(value) else value
    return edit


def _overlap(state: dict) -> None:
    columns = state["shard"]["table"]["columns"]
    columns["first_row"][-2] = columns["first_row"][-1]


EDITS = {
    "write_pos inside the newest episode": (_set(("shard", "write_pos"), lambda s: _last(s, "first_row") + 1),
                                            "shard.write_pos is [0-9]+; expected [0-9]+, the row after the newest"),
    "overlapping episodes": (_overlap, "first_row is .*; expected episodes whose rows do not overlap"),
    "rows past the arena": (_set(("shard", "table", "columns", "num_rows"),
                                 lambda s: s["shard"]["table"]["columns"]["num_rows"] + 1000), "inside the arena"),
    "mode": (_set(("store", "mode"), "sideways"), "store.mode is 'sideways'"),
    "alpha": (_set(("sampler", "config", "alpha"), -1.0), "alpha"),
    "beta": (_set(("sampler", "config", "beta"), 7.0), "beta"),
    "sampler type": (_set(("sampler", "type"), "MagicSampler"), "MagicSampler"),
    "max priority inf": (_set(("sampler", "max_priority"), math.inf), "max_priority is inf"),
    "max priority 0": (_set(("sampler", "max_priority"), 0.0), "max_priority is 0.0"),
    "negative leaves": (_set(("sampler", "tree", "levels"), lambda s: [-lv for lv in s["sampler"]["tree"]["levels"]]),
                        "sampler.tree.levels"),
    "generator state": (_set(("rng", "state"), {"state": "x", "inc": 1}), "rng is"),
    "generator kind": (_set(("rng", "bit_generator"), "MT19937"), "rng is"),
    "limiter counter": (_set(("rate_limiter", "samples"), -5), "rate_limiter.samples is -5"),
    "episode ids": (_set(("shard", "table", "episodes_added"), 3), "episodes_added"),
    "capacity": (_set(("store", "capacity"), 0), "store.capacity is 0"),
    "played episode after the piece": (_set(("shard", "table", "columns", "episode"),
                                            lambda s: s["shard"]["table"]["columns"]["episode_id"] + 1),
                                       "each <= its own episode_id"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_state_outside_its_domain_is_refused_naming_the_file_and_field(tmp_path, edit):
    change, message = EDITS[edit]
    store = wrapped_store("w1", sampler=ab.PrioritizedSampler())
    store.save(tmp_path / "ckpt")
    edit_checkpoint(tmp_path / "ckpt", change)
    with pytest.raises(ab.FormatError, match=r"manifest.json: .*" + f"({message})"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_an_edit_that_keeps_the_state_valid_still_loads(tmp_path):
    store = wrapped_store("w1", sampler=ab.PrioritizedSampler())
    store.save(tmp_path / "ckpt")
    edit_checkpoint(tmp_path / "ckpt", lambda state: None)
    assert_same_store(store, ab.ExperienceStore.load(tmp_path / "ckpt"))


def test_a_manifest_edited_without_its_checksum_is_refused(tmp_path):
    store = wrapped_store("w1")
    store.save(tmp_path / "ckpt")
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["state"]["shard"]["write_pos"] += 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ab.FormatError, match="manifest.json: its content differs from its checksum"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_a_row_file_resealed_with_one_row_given_twice_is_refused_not_loaded_with_a_row_never_written(tmp_path):
    # Rows were counted per episode: a duplicated (episode, step) made up for a missing
    # one, and the load put row 0's values in row 1, silently.
    store = ab.ExperienceStore(100, seed=0)
    store.add_episode({"obs": np.arange(4, dtype=np.float32)[:, None] * 10, "action": np.zeros(3, np.float32),
                       "terminated": np.array([False, False, True])})
    store.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    names = [entry["path"] for entry in manifest["row_files"]]
    assert len(names) == 1
    row_file = tmp_path / "ckpt" / names[0]
    with pa.memory_map(str(row_file)) as source:
        table = pa.ipc.open_file(source).read_all()
    steps = table.column("step").to_numpy().copy()
    assert sorted(steps) == [0, 1, 2, 3]
    steps[steps == 1] = 0   # step 1 is gone, step 0 is there twice
    table = table.set_column(table.schema.get_field_index("step"), "step", pa.array(steps, table.schema.field("step").type))
    with pa.OSFile(str(row_file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    corrupt._reseal(tmp_path / "ckpt" / "manifest.json", names[0])
    with pytest.raises(ab.FormatError, match="given twice"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


# -- the overwrite window of exports ---------------------------------------------------------


def test_an_overwritten_export_is_complete_at_every_step_of_the_overwrite(tmp_path, monkeypatch):
    old, new = wrapped_store("w1", episodes=20, seed=1), wrapped_store("w1", episodes=30, seed=2)
    out = old.to_parquet(tmp_path / "out")
    seen = []
    real = _filesink._exchange

    def watched(a: Path, b: Path) -> bool:
        seen.append(ab.ExperienceStore.from_parquet(out).num_episodes)
        swapped = real(a, b)
        seen.append(ab.ExperienceStore.from_parquet(out).num_episodes)
        return swapped

    monkeypatch.setattr(_filesink, "_exchange", watched)
    new.to_parquet(out, overwrite=True)
    assert seen == [old.num_episodes, new.num_episodes]
    assert_same_store(new, ab.ExperienceStore.from_parquet(out), skip=("first_row",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_without_an_atomic_exchange_a_failed_second_rename_puts_the_old_export_back(tmp_path, monkeypatch):
    old, new = wrapped_store("w1", episodes=20, seed=1), wrapped_store("w1", episodes=30, seed=2)
    out = old.to_parquet(tmp_path / "out")
    monkeypatch.setattr(_filesink, "_exchange", lambda a, b: False)
    real_rename = Path.rename

    def rename(self: Path, target: Path) -> Path:
        if self.name.startswith(".out.tmp-"):
            assert not out.exists() and _filesink.aside_copies(out), "the old export is aside"
            raise OSError("crash between the two renames")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="between the two renames"):
        new.to_parquet(out, overwrite=True)
    monkeypatch.undo()
    assert_same_store(old, ab.ExperienceStore.from_parquet(out), skip=("first_row",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_export_renamed_aside_by_a_crash_is_named_by_the_error(tmp_path):
    out = wrapped_store("w1", episodes=20).to_parquet(tmp_path / "out")
    aside = out.rename(tmp_path / ".out.old-0123456789ab")    # what a crash between the renames leaves
    with pytest.raises(ab.FormatError, match=rf"out: no such directory, but .*{aside.name} holds the export"):
        ab.ExperienceStore.from_parquet(out)
    assert ab.ExperienceStore.from_parquet(aside).num_episodes > 0


# -- Ray checkpoints: generations ------------------------------------------------------------


def _rows(store: ab.ExperienceStore) -> list:
    table = store.to_arrow()
    order = np.lexsort((table.column("step").to_numpy(), table.column("episode_id").to_numpy()))
    return table.take(pa.array(order)).select(["episode_id", "step", "obs", "reward"]).to_pylist()


def _episode(key: int, steps: int) -> dict:
    obs = np.stack([np.full(steps + 1, key, np.float32), np.arange(steps + 1, dtype=np.float32)], axis=1)
    return {"obs": obs, "action": np.zeros(steps, np.int64), "reward": np.full(steps, key, np.float32),
            "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool)}


def _kill(handle) -> None:
    """ray.kill returns before the actor is gone: wait until calls to it fail."""
    import ray

    ray.kill(handle)
    while True:
        try:
            ray.get(handle.ping.remote())
        except ray.exceptions.RayActorError:
            return


@pytest.mark.usefixtures("ray_session")
def test_a_ray_save_that_fails_on_one_shard_leaves_the_previous_checkpoint_loading_complete(tmp_path):
    store = ab.ExperienceStore(2_000, backend="ray", num_shards=2, seed=0, sampler=ab.PrioritizedSampler())
    loaded = None
    try:
        for key in range(12):
            store.add_episode(_episode(key, 5 + key), env_id=f"env-{key % 4}")
        store.save(tmp_path / "ckpt")
        saved = _rows(store)
        for key in range(12, 20):
            store.add_episode(_episode(key, 4), env_id=f"env-{key % 4}")
        store.flush()
        import ray

        _kill(ray.get_actor(f"{store.name}:1", namespace=NAMESPACE))   # shard 0 saves, shard 1 fails
        with pytest.raises(ab.ShardError, match="shard 1"):
            store.save(tmp_path / "ckpt")
        names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert len(names) == 2 and names[0].startswith("gen-") and names[1] == "ray_checkpoint.json", names
        loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
        assert _rows(loaded) == saved
    finally:
        store.close()
        if loaded is not None:
            loaded.close()


@pytest.fixture(scope="module")
def two_shard_store(ray_session):
    """A 2-shard Ray store of 8 episodes, 4 a shard (each test saves it where it needs)."""
    store = ab.ExperienceStore(2_000, backend="ray", num_shards=2, seed=0)
    for key in range(8):
        store.add_episode(_episode(key, 6), env_id=f"env-{key % 2}")
    yield store
    store.close()


def test_a_damaged_row_file_of_shard_1_of_a_ray_checkpoint_raises_format_error_not_a_ray_error(
        two_shard_store, tmp_path):
    two_shard_store.save(tmp_path / "ckpt")
    generation = json.loads((tmp_path / "ckpt" / "ray_checkpoint.json").read_text())["generation"]
    row_file = next((tmp_path / "ckpt" / generation / "shard-1").glob("rows-*"))
    data = bytearray(row_file.read_bytes())
    data[len(data) // 2] ^= 0x40
    row_file.write_bytes(bytes(data))
    with pytest.raises(ab.FormatError, match=row_file.name):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_a_second_ray_save_is_a_new_generation_that_writes_only_the_new_episodes(two_shard_store, tmp_path):
    store = two_shard_store   # its 8 episodes; the 4 added here, after the other test's save
    loaded = None
    try:
        store.save(tmp_path / "ckpt")
        first = json.loads((tmp_path / "ckpt" / "ray_checkpoint.json").read_text())["generation"]
        first_files = {s: {p.name for p in (tmp_path / "ckpt" / first / f"shard-{s}").glob("rows-*")}
                       for s in range(2)}
        for key in range(8, 12):
            store.add_episode(_episode(key, 6), env_id=f"env-{key % 2}")
        store.save(tmp_path / "ckpt")
        second = json.loads((tmp_path / "ckpt" / "ray_checkpoint.json").read_text())["generation"]
        assert second != first and not (tmp_path / "ckpt" / first).exists()
        for s in range(2):
            manifest = json.loads((tmp_path / "ckpt" / second / f"shard-{s}" / "manifest.json").read_text())
            new = [e for e in manifest["row_files"] if e["path"] not in first_files[s]]
            assert {e["path"] for e in manifest["row_files"]} >= first_files[s]
            assert [e["episodes"] for e in new] == [2], manifest["row_files"]
        loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
        assert _rows(loaded) == _rows(store)
    finally:
        if loaded is not None:
            loaded.close()


def _open_writer_store() -> tuple[ab.ExperienceStore, ab.StepWriter]:
    """A local store and its writer named "runner", holding 2 envs' open episodes of 3 steps."""
    store = ab.ExperienceStore(100, seed=0)
    writer = store.writer(2, autoreset_mode="disabled", name="runner")
    for t in range(3):
        obs = np.full((2, 3), t, np.float32)
        writer.add(obs=obs, action=np.full(2, t, np.int64), reward=np.ones(2, np.float32),
                   terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=obs + 1)
    return store, writer   # the store holds its writers weakly: save sees only those kept


def test_a_writer_state_claiming_more_open_steps_than_it_staged_is_refused_naming_pos(tmp_path):
    # It loaded: len 9 instead of 6, and the 3 extra steps were arena rows never written.
    store, _writer = _open_writer_store()
    assert len(store) == 6
    store.save(tmp_path / "ckpt")

    def more_steps(state: dict) -> None:
        state["writers"]["runner"]["pos"] = state["writers"]["runner"]["pos"] + np.array([3, 0])

    edit_checkpoint(tmp_path / "ckpt", more_steps)
    with pytest.raises(ab.FormatError, match=r"manifest.json: writers.runner.pos is .*6.*; expected step counts "
                                             r"of at most the 3 staged rows"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_a_writer_state_with_open_steps_but_no_last_observation_is_refused(tmp_path):
    store, _writer = _open_writer_store()
    store.save(tmp_path / "ckpt")
    edit_checkpoint(tmp_path / "ckpt", lambda state: state["writers"]["runner"]["last_next"].clear())
    with pytest.raises(ab.FormatError, match=r"writers.runner.last_next is .*; expected the observation after"):
        ab.ExperienceStore.load(tmp_path / "ckpt")


def test_a_ray_shards_saved_open_pieces_must_name_its_live_pieces():
    from arrowbuf.ray.tails import OpenPieces

    store = wrapped_store("w1")   # evicted its oldest episodes: serials start past 0
    table = store.engine.table
    head, added = table.episodes_added - len(table), table.episodes_added
    pieces = OpenPieces()
    pieces.load([["writer-a", "env-0", [added - 2, added - 1]], [None, "env-1", [head]]], table, "ckpt")
    assert pieces.state(table) == [["writer-a", "env-0", [added - 2, added - 1]], [None, "env-1", [head]]]
    for bad in ([["writer-a", "env-0", [added]]], [["writer-a", "env-0", [head - 1]]], [["w", "env-0", []]],
                [["w", 3, [head]]], {"w": [head]}, [["w", "env-0", [True]]]):
        with pytest.raises(ab.FormatError, match=r"ckpt: store.open_pieces has .*; expected \[writer id, env id, "
                                                 rf"serials of live pieces in \[{head}, {added}\)\]"):
            OpenPieces().load(bad, table, "ckpt")
