"""Parquet export and import: round trips, plain readers, streaming loads, bad input."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf import parquet, parquet_load

from support.compare import assert_same_batches, assert_same_rows, assert_same_store, column_numpy
from support.persist_data import KINDS, episode_of, fill, schema_of, wrapped_store


def test_a_wrapped_store_round_trips_every_column_episode_and_sample(tmp_path):
    for kind in KINDS:
        store = wrapped_store(kind, seed=5)
        store.to_parquet(tmp_path / kind)
        loaded = ab.ExperienceStore.from_parquet(tmp_path / kind, seed=5)
        # Rows are packed from row 0 on import, so only the arena placement differs.
        assert_same_store(store, loaded, skip=("first_row",))
        assert loaded.capacity == store.capacity and loaded.mode == store.mode
        for _ in range(3):
            assert_same_batches(store.sample(64), loaded.sample(64))


def test_an_episode_with_its_final_observation_keeps_the_extra_row(tmp_path):
    store = ab.ExperienceStore(capacity=100, seed=0)
    obs = np.arange(5 * 2, dtype=np.float32).reshape(5, 2)
    store.add_episode({"obs": obs, "action": np.arange(4), "reward": np.ones(4, np.float32),
                       "terminated": np.arange(4) == 3})
    store.add_episode({"obs": obs[:3] + 100, "action": np.arange(3), "reward": np.ones(3, np.float32),
                       "terminated": np.zeros(3, bool)})
    store.to_parquet(tmp_path / "out")

    steps = pq.read_table(tmp_path / "out" / "steps")
    assert steps["is_last"].to_pylist() == [False] * 4 + [True] + [False] * 2 + [True]
    np.testing.assert_array_equal(np.stack(steps["obs"].to_numpy(zero_copy_only=False)[:5]), obs)
    assert steps["action"].to_pylist()[4] == 0, "the final-observation row holds zeros for step fields"

    loaded = ab.ExperienceStore.from_parquet(tmp_path / "out")
    table = loaded.episodes()
    assert table["has_final"].to_pylist() == [True, False]
    assert table["num_rows"].to_pylist() == [5, 3]
    assert table["length"].to_pylist() == [4, 2]
    batch = loaded.sample(200)
    last = (batch["episode_id"] == 0) & (batch["step"] == 3)
    assert last.any()
    np.testing.assert_array_equal(batch["next", "obs"][last].numpy(), np.repeat(obs[4:], int(last.sum()), 0))


def test_duckdb_sums_of_rewards_per_episode_equal_the_episode_returns(tmp_path):
    store = wrapped_store("w1")
    store.to_parquet(tmp_path / "out", rows_per_file=60)
    glob = str(tmp_path / "out" / "steps" / "*.parquet")
    # The final-observation row has reward 0, so summing every row is the return.
    rows = duckdb.sql(f"SELECT episode_id, sum(reward) AS ret, count(*) AS n FROM '{glob}' "
                      "GROUP BY episode_id ORDER BY episode_id").fetchall()
    episodes = store.episodes()
    assert [r[0] for r in rows] == episodes["episode_id"].to_pylist()
    assert [r[2] for r in rows] == episodes["num_rows"].to_pylist()
    np.testing.assert_allclose([r[1] for r in rows], episodes["return"].to_numpy(), rtol=1e-6, atol=1e-6)
    steps = duckdb.sql(f"SELECT episode_id, count(*) FROM '{glob}' WHERE NOT is_last GROUP BY episode_id "
                       "ORDER BY episode_id").fetchall()
    with_final = episodes["has_final"].to_numpy(zero_copy_only=False)
    expected = episodes["num_rows"].to_numpy() - 1
    np.testing.assert_array_equal([n for _, n in steps], expected)
    np.testing.assert_array_equal(expected[with_final], episodes["length"].to_numpy()[with_final])


def test_plain_readers_see_fixed_shape_tensor_columns_with_the_shape_in_their_type(tmp_path):
    store = wrapped_store("pixels", capacity=60, episodes=12)
    store.to_parquet(tmp_path / "out")
    files = sorted((tmp_path / "out" / "steps").glob("*.parquet"))

    frame = pl.read_parquet(files)
    obs = frame.schema["obs"]   # Polars keeps the canonical extension type, its shape in the type's metadata
    assert obs.ext_name() == "arrow.fixed_shape_tensor" and obs.ext_storage() == pl.Array(pl.UInt8, 16 * 16 * 3)
    assert json.loads(obs.ext_metadata())["shape"] == [16, 16, 3]
    assert frame.schema["is_last"] == pl.Boolean
    assert frame.height == store.to_arrow().num_rows

    schema = pq.read_schema(files[0])
    field = schema.field("obs")
    assert field.type == pa.fixed_shape_tensor(pa.uint8(), [16, 16, 3])
    assert json.loads(field.metadata[b"arrowbuf.shape"]) == [16, 16, 3]
    np.testing.assert_array_equal(pq.read_table(files[0]).column("obs").chunk(0).to_numpy_ndarray()[0],
                                  column_numpy(store.to_arrow().column("obs"))[0])
    assert field.metadata[b"arrowbuf.role"] == b"observation"
    assert pa.types.is_boolean(schema.field("terminated").type)
    meta = schema.metadata
    assert meta[b"arrowbuf.version"] == ab.__version__.encode()
    assert json.loads(meta[b"arrowbuf.schema"])["obs"] == ["uint8", [16, 16, 3], True]
    assert json.loads(meta[b"arrowbuf.store"])["capacity"] == 60

    frame = pd.read_parquet(files[0])
    first = frame.iloc[0]
    pixels = column_numpy(store.to_arrow().column("obs"))[0]
    np.testing.assert_array_equal(np.asarray(first["obs"]).reshape(16, 16, 3), pixels)


def test_read_parquet_gives_a_dataset_with_tensor_types_restored(tmp_path):
    store = wrapped_store("nested")
    store.to_parquet(tmp_path / "out", rows_per_file=40)
    dataset = ab.read_parquet(tmp_path / "out")
    table = dataset.to_table()
    assert table.schema.field("obs.pixels").type == pa.fixed_shape_tensor(pa.uint8(), [8, 8, 3])
    assert table.schema.field("obs.state").metadata[b"arrowbuf.role"] == b"observation"
    assert table.schema.field("obs.state").metadata[b"arrowbuf.dtype"] == b"bfloat16"
    # bfloat16 is exported as its float32 values (the arena holds the bits): equal, bit for bit.
    assert table.schema.field("obs.state").type == pa.fixed_shape_tensor(pa.float32(), [5])
    bf16 = [n for n in store.schema.fields if store.schema.fields[n].dtype == "bfloat16"]
    assert bf16 == ["obs.state", "action"]
    for name in bf16:
        bits = column_numpy(store.to_arrow().column(name))
        assert (column_numpy(table.column(name)).view(np.uint32) == bits.astype(np.uint32) << 16).all()
    # The export adds its final_observation column (tests/test_export_rows.py); the rest is the arena's.
    assert_same_rows(table.drop_columns(["final_observation", *bf16]), store.to_arrow().drop_columns(bf16))
    first = dataset.to_table(filter=pc.field("episode_id") == store.episodes()["episode_id"][0])
    assert first.num_rows == store.episodes()["num_rows"][0].as_py()


def test_step_files_hold_whole_episodes_up_to_rows_per_file(tmp_path):
    store = wrapped_store("w1")
    store.to_parquet(tmp_path / "out", rows_per_file=30, compression="snappy")
    manifest = json.loads((tmp_path / "out" / "_arrowbuf.json").read_text())
    assert len(manifest["steps"]) > 2
    names = [Path(e["path"]).name for e in manifest["steps"]]
    assert names == [f"part-00000-{n:05d}.parquet" for n in range(len(names))]
    previous_last = None
    table = store.episodes()
    held_from = dict(zip(table["episode_id"].to_pylist(), table["first_step"].to_pylist()
                         if "first_step" in table.column_names else [0] * table.num_rows))
    for entry in manifest["steps"]:
        rows = pq.read_table(tmp_path / "out" / entry["path"])
        ids = rows["episode_id"].to_numpy()
        # files start with an episode's first held step (the oldest may have lost its first ones) and end with one
        assert rows["step"][0].as_py() == held_from[int(ids[0])] and rows["is_last"][-1].as_py()
        longest = store.episodes()["num_rows"].to_numpy().max()
        assert rows.num_rows <= max(30, longest)
        assert previous_last is None or ids[0] == previous_last + 1
        previous_last = ids[-1]
    assert pq.ParquetFile(tmp_path / "out" / manifest["steps"][0]["path"]).metadata.row_group(0).column(0) \
        .compression == "SNAPPY"


def test_a_load_into_a_smaller_capacity_keeps_the_newest_episodes_that_fit(tmp_path, monkeypatch):
    store = wrapped_store("w1", capacity=400, episodes=100)
    store.to_parquet(tmp_path / "out", rows_per_file=50)
    monkeypatch.setattr(parquet, "_GROUP_BYTES", 1)     # stream 1024-row batches from small row groups
    reads: list[str] = []
    real = pq.ParquetFile

    def spy(path, *args, **kwargs):
        reads.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(parquet_load.pq, "ParquetFile", spy)
    small = ab.ExperienceStore.from_parquet(tmp_path / "out", capacity=100, seed=1)

    episodes = store.episodes()
    num_rows, length = episodes["num_rows"].to_numpy(), episodes["length"].to_numpy()
    keep = np.cumsum(length[::-1])[::-1] <= 100   # capacity counts transitions
    assert small.episodes()["episode_id"].to_pylist() == episodes["episode_id"].to_numpy()[keep].tolist()
    assert small.to_arrow().num_rows == num_rows[keep].sum() and len(small) == length[keep].sum() <= 100
    assert len(reads) < len(list((tmp_path / "out" / "steps").iterdir())), "files of dropped episodes are skipped"
    by_id = {i: store.episode(i) for i in small.episodes()["episode_id"].to_pylist()}
    for episode_id, batch in by_id.items():
        assert_same_rows(pa.Table.from_batches([small.episode(episode_id)]), pa.Table.from_batches([batch]))


@settings(max_examples=30, deadline=None)
@given(episodes=st.lists(st.tuples(st.integers(1, 10), st.booleans()), min_size=1, max_size=20),
       capacity=st.integers(11, 50), load_capacity=st.integers(11, 80), rows_per_file=st.integers(1, 30))
def test_any_export_loads_the_newest_episodes_that_fit_any_capacity(episodes, capacity, load_capacity,
                                                                    rows_per_file):
    store = ab.ExperienceStore(capacity=capacity, seed=3, schema=schema_of("w1"))
    rng = np.random.default_rng(0)
    for steps, has_final in episodes:
        store.add_episode(episode_of("w1", rng, steps, has_final))
    with tempfile.TemporaryDirectory() as tmp:
        store.to_parquet(Path(tmp) / "out", rows_per_file=rows_per_file)
        loaded = ab.ExperienceStore.from_parquet(Path(tmp) / "out", capacity=load_capacity, seed=3)
    table = store.episodes()
    length = table["length"].to_numpy()
    keep = np.cumsum(length[::-1])[::-1] <= load_capacity   # capacity counts transitions
    ids = table["episode_id"].to_numpy()[keep].tolist()
    assert loaded.episodes()["episode_id"].to_pylist() == ids
    for episode_id in ids:
        assert_same_rows(pa.Table.from_batches([loaded.episode(episode_id)]),
                         pa.Table.from_batches([store.episode(episode_id)]))
    if load_capacity >= capacity:
        assert_same_store(store, loaded, skip=("first_row",))
        if len(store):
            assert_same_batches(store.sample(16), loaded.sample(16))


def test_an_episode_filter_selects_by_expression_mask_or_ids(tmp_path):
    store = wrapped_store("w1")
    store.to_parquet(tmp_path / "out")
    episodes = store.episodes()
    good = episodes.filter(pc.field("return") > 0)["episode_id"].to_pylist()
    assert 0 < len(good) < episodes.num_rows

    filters = [pc.field("return") > 0,
               lambda table: pc.greater(table["return"], 0),
               lambda table: good]
    for episode_filter in filters:
        loaded = ab.ExperienceStore.from_parquet(tmp_path / "out", episode_filter=episode_filter)
        table = loaded.episodes()
        np.testing.assert_array_equal(table["return"].to_numpy(),
                                      episodes.filter(pc.field("return") > 0)["return"].to_numpy())
        # Gaps in the ids: the loaded episodes are numbered from 0.
        assert table["episode_id"].to_pylist() == list(range(len(good)))
        for new_id, old_id in zip(table["episode_id"].to_pylist(), good):
            new, old = loaded.episode(new_id), store.episode(old_id)
            for name in ("obs", "action", "reward", "step", "is_last"):
                np.testing.assert_array_equal(column_numpy(new.column(name)), column_numpy(old.column(name)))

    with pytest.raises(ValueError, match="ids not in the export"):
        ab.ExperienceStore.from_parquet(tmp_path / "out", episode_filter=lambda table: [10_000])
    with pytest.raises(ValueError, match="mask of shape"):
        ab.ExperienceStore.from_parquet(tmp_path / "out", episode_filter=lambda table: np.ones(3, bool))


def test_a_fixed_store_refuses_an_import_it_cannot_hold(tmp_path):
    store = wrapped_store("w1")
    store.to_parquet(tmp_path / "out")
    with pytest.raises(ab.CapacityError, match="mode='fixed'"):
        ab.ExperienceStore.from_parquet(tmp_path / "out", capacity=60, mode="fixed")
    with pytest.raises(ab.CapacityError, match="more transitions than the capacity"):
        ab.ExperienceStore.from_parquet(tmp_path / "out", capacity=5)


def test_an_empty_store_exports_its_schema(tmp_path):
    store = ab.ExperienceStore(capacity=10, schema=schema_of("w1"))
    store.to_parquet(tmp_path / "out")
    assert pl.read_parquet(tmp_path / "out" / "steps" / "*.parquet").height == 0
    loaded = ab.ExperienceStore.from_parquet(tmp_path / "out")
    assert loaded.schema == store.schema and loaded.num_episodes == 0
    with pytest.raises(ValueError, match="no schema yet"):
        ab.ExperienceStore(capacity=10).to_parquet(tmp_path / "none")


def _export(tmp_path: Path) -> Path:
    store = wrapped_store("w1", capacity=100, episodes=20)
    return store.to_parquet(tmp_path / "out", rows_per_file=40)


def test_a_missing_or_unfinished_export_is_refused(tmp_path):
    with pytest.raises(ab.FormatError, match="no such directory"):
        ab.ExperienceStore.from_parquet(tmp_path / "nowhere")
    out = _export(tmp_path)
    (out / "_arrowbuf.json").unlink()      # what a crash before the manifest leaves
    with pytest.raises(ab.FormatError, match=r"_arrowbuf.json: missing; .*did not finish"):
        ab.ExperienceStore.from_parquet(out)
    with pytest.raises(ab.FormatError, match="_arrowbuf.json"):
        ab.read_parquet(out)


def test_a_truncated_step_file_is_refused_naming_it(tmp_path):
    out = _export(tmp_path)
    victim = out / "steps" / "part-00000-00001.parquet"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ab.FormatError, match=r"part-00000-00001\.parquet: not a readable Parquet file.*truncated"):
        ab.ExperienceStore.from_parquet(out)
    victim.write_bytes(data[:-1] + b"\0")     # same length, footer magic broken
    with pytest.raises(ab.FormatError, match=r"part-00000-00001\.parquet"):
        ab.read_parquet(out)


def test_a_step_file_of_another_schema_is_refused_naming_the_column(tmp_path):
    out = _export(tmp_path)
    victim = out / "steps" / "part-00000-00000.parquet"
    table = pq.read_table(victim)
    pq.write_table(table.drop_columns(["action"]).append_column("action", pa.array(np.zeros(table.num_rows))),
                   victim)
    with pytest.raises(ab.FormatError, match=r"part-00000-00000\.parquet: .*column 'action' is double"):
        ab.ExperienceStore.from_parquet(out)
    pq.write_table(pa.table({"x": [1, 2]}), out / "steps" / "part-00000-00000.parquet")
    with pytest.raises(ab.FormatError, match=r"missing \['obs'"):
        ab.ExperienceStore.from_parquet(out)


def test_a_stray_file_in_steps_is_refused(tmp_path):
    out = _export(tmp_path)
    pq.write_table(pa.table({"x": [1]}), out / "steps" / "other.parquet")
    with pytest.raises(ab.FormatError, match=r"\['other.parquet'\] are not part of this export"):
        ab.ExperienceStore.from_parquet(out)


def test_a_truncated_episode_table_or_manifest_is_refused(tmp_path):
    out = _export(tmp_path)
    data = (out / "episodes.parquet").read_bytes()
    (out / "episodes.parquet").write_bytes(data[:100])
    with pytest.raises(ab.FormatError, match=r"episodes\.parquet"):
        ab.ExperienceStore.from_parquet(out)
    (out / "episodes.parquet").write_bytes(data)
    manifest = (out / "_arrowbuf.json").read_text()
    (out / "_arrowbuf.json").write_text(manifest[:50])
    with pytest.raises(ab.FormatError, match=r"_arrowbuf\.json: unreadable JSON"):
        ab.ExperienceStore.from_parquet(out)


def test_an_export_of_a_newer_format_version_is_refused(tmp_path):
    out = _export(tmp_path)
    manifest = json.loads((out / "_arrowbuf.json").read_text())
    manifest["format_version"] = parquet.FORMAT_VERSION + 1
    (out / "_arrowbuf.json").write_text(json.dumps(manifest))
    with pytest.raises(ab.FormatError, match=f"format version {parquet.FORMAT_VERSION + 1} .* reads versions up to {parquet.FORMAT_VERSION}"):
        ab.ExperienceStore.from_parquet(out)


def test_an_export_never_replaces_a_directory_unless_asked(tmp_path):
    store = wrapped_store("w1", capacity=100, episodes=20)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        store.to_parquet(tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
    store.to_parquet(tmp_path / "busy", overwrite=True)
    assert not (tmp_path / "busy" / "notes.txt").exists()
    assert ab.ExperienceStore.from_parquet(tmp_path / "busy").num_episodes == store.num_episodes
    (tmp_path / "empty").mkdir()
    store.to_parquet(tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "empty"], "no temporary directory left"


def test_a_failed_export_leaves_no_directory_behind(tmp_path, monkeypatch):
    store = wrapped_store("w1", capacity=100, episodes=20)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(parquet, "finish_export", crash)
    with pytest.raises(OSError, match="disk full"):
        store.to_parquet(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_an_eviction_during_the_export_is_caught_and_the_rows_are_copied_under_the_lock(tmp_path, monkeypatch):
    store = wrapped_store("w1", capacity=100, episodes=20)
    real = parquet.write_steps
    calls = []

    def racing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:   # another thread writes while the first attempt runs
            fill(store, "w1", 12, seed=99, first=100)
        return real(*args, **kwargs)

    monkeypatch.setattr(parquet, "write_steps", racing_write)
    store.to_parquet(tmp_path / "out")
    assert len(calls) == 2
    loaded = ab.ExperienceStore.from_parquet(tmp_path / "out")
    assert_same_store(store, loaded, skip=("first_row",))


def test_progress_bars_show_when_asked_and_stay_quiet_otherwise(tmp_path, capsys):
    store = wrapped_store("w1", capacity=100, episodes=20)
    store.to_parquet(tmp_path / "quiet", progress=False)
    ab.ExperienceStore.from_parquet(tmp_path / "quiet", progress=False)
    ab.ExperienceStore.from_parquet(tmp_path / "quiet")     # auto: stderr is not a terminal here
    assert capsys.readouterr().err == ""
    store.to_parquet(tmp_path / "loud", progress=True)
    ab.ExperienceStore.from_parquet(tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    assert "export" in err and "import" in err and "rows" in err


def test_the_demo_command_exports_its_replay_buffer(tmp_path, monkeypatch, capsys):
    from arrowbuf import cli

    store = wrapped_store("w1", capacity=100, episodes=20)
    result = types.SimpleNamespace(store=store, steps=10, episodes=2, mean_return_last20=1.0,
                                   samples_per_second=1.0, wall_seconds=0.1)
    fake = types.ModuleType("arrowbuf.demo")
    fake.run_demo = lambda **kwargs: result
    monkeypatch.setitem(sys.modules, "arrowbuf.demo", fake)
    assert cli.main(["demo", "--quiet", "--export", str(tmp_path / "demo")]) == 0
    assert "exported" in capsys.readouterr().out
    assert_same_store(store, ab.ExperienceStore.from_parquet(tmp_path / "demo"), skip=("first_row",))
    assert os.path.exists(tmp_path / "demo" / "episodes.parquet")


def test_imported_rows_match_torch_dtypes_of_the_original(tmp_path):
    store = wrapped_store("nested")
    store.to_parquet(tmp_path / "out")
    batch = ab.ExperienceStore.from_parquet(tmp_path / "out", seed=0).sample(8)
    assert batch["obs", "state"].dtype == torch.bfloat16 and batch["next", "obs", "state"].dtype == torch.bfloat16
    assert batch["action"].dtype == torch.bfloat16 and batch["obs", "pixels"].shape == (8, 8, 8, 3)
