"""Row-packed small fields (`arrowbuf.packing`): the record layout, and stores whose
small per-step fields share one block giving back exactly what was written."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.packing import PACK_MAX_ROW_BYTES, column_view, pack_layout

from support.compare import column_numpy

DTYPES = ["bool", "int8", "uint8", "int16", "float16", "int32", "float32", "int64", "float64"]

fields_strategy = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=4),
    st.builds(lambda dtype, shape, observation: ab.Field(dtype, shape, observation=observation),
              st.sampled_from(DTYPES), st.sampled_from([(), (1,), (3,), (2, 3), (6,), (9,)]), st.booleans()),
    max_size=8)


@settings(max_examples=300, deadline=None)
@given(fields=fields_strategy)
def test_packed_fields_are_aligned_disjoint_and_every_small_step_field(fields):
    record, offsets = pack_layout(fields)
    small = {n for n, f in fields.items() if not f.observation and f.row_bytes <= PACK_MAX_ROW_BYTES}
    if len(small) < 2:
        assert (record, offsets) == (0, {})
        return
    assert set(offsets) == small
    widest = max(fields[n].numpy_dtype.itemsize for n in small)
    assert record % widest == 0 and record >= sum(fields[n].row_bytes for n in small)
    spans = sorted((offsets[n], offsets[n] + fields[n].row_bytes) for n in small)
    assert all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:]))   # disjoint
    assert spans[-1][1] <= record
    for name in small:
        assert offsets[name] % fields[name].numpy_dtype.itemsize == 0, name


@settings(max_examples=100, deadline=None)
@given(fields=fields_strategy, rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_each_field_view_reads_back_what_was_written_through_it(fields, rows, seed):
    record, offsets = pack_layout(fields)
    if not offsets:
        return
    block = np.zeros((rows, record), np.uint8)
    views = {n: column_view(block, offsets[n], fields[n].numpy_dtype, fields[n].shape) for n in offsets}
    rng = np.random.default_rng(seed)
    written = {}
    for name, view in views.items():
        data = rng.integers(0, 2, view.shape).astype(view.dtype) if view.dtype == bool else \
            rng.integers(-50, 50, view.shape).astype(view.dtype)
        view[...] = data
        written[name] = data
    for name, view in views.items():   # no field overwrote another
        np.testing.assert_array_equal(view, written[name], err_msg=name)
        assert np.shares_memory(view, block)


SMALL = {"obs": ab.Field("float32", (5,), observation=True), "action": ab.Field("float32", (6,)),
         "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool"),
         "flags": ab.Field("uint8", (2, 3)), "count": ab.Field("int64"), "half": ab.Field("float16", (3,)),
         "big": ab.Field("float64", (9,))}   # 72 bytes a row: its own column


def small_episode(rng: np.random.Generator, steps: int, transposed: bool = False) -> dict[str, np.ndarray]:
    action = rng.standard_normal((6, steps)).astype(np.float32)
    return {"obs": rng.standard_normal((steps + 1, 5)).astype(np.float32),
            # a strided (non-contiguous) input takes the plain copy, not the item copy
            "action": action.T if transposed else np.ascontiguousarray(action.T),
            "reward": rng.standard_normal(steps).astype(np.float32),
            "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool),
            "flags": rng.integers(0, 255, (steps, 2, 3), dtype=np.uint8),
            "count": rng.integers(-2**40, 2**40, steps), "half": rng.standard_normal((steps, 3)).astype(np.float16),
            "big": rng.standard_normal((steps, 9))}


def fill(sampler: ab.Sampler | None = None) -> tuple[ab.ExperienceStore, dict]:
    rng = np.random.default_rng(3)
    store = ab.ExperienceStore(200, schema=ab.Schema(SMALL), seed=1, sampler=sampler)
    episodes = {}
    for k in range(12):   # 12 x ~20 rows: the ring wraps and evicts
        episode = small_episode(rng, int(rng.integers(5, 30)), transposed=k % 2 == 1)
        episodes[store.add_episode(episode)] = episode
    shard = store.engine.shard
    assert sorted(shard._pack_offsets) == ["action", "count", "flags", "half", "reward", "terminated", "truncated"]
    return store, episodes


@pytest.fixture
def written():
    return fill()


def expected(episodes: dict, episode_id: int, step: int, key) -> np.ndarray:
    if isinstance(key, tuple):   # ("next", obs)
        return episodes[episode_id][key[1]][step + 1]
    return episodes[episode_id][key][step]


def test_samples_of_packed_fields_are_the_rows_written(written):
    store, episodes = written
    batch = store.sample(300)
    keys = [*SMALL, ("next", "obs")]
    for i in range(300):
        episode_id, step = int(batch["episode_id"][i]), int(batch["step"][i])
        for key in keys:
            np.testing.assert_array_equal(batch[key][i].numpy(), expected(episodes, episode_id, step, key),
                                          err_msg=str(key))
    for key in keys:   # contiguous outputs, as from columnar fields
        assert batch[key].is_contiguous(), key


def test_selected_packed_fields_alone_and_sequences_of_them(written):
    store, episodes = written
    batch = store.sample(50, keys=["flags", "reward"])
    assert set(batch.keys()) == {"flags", "reward", "index", "episode_id", "step"}
    for i in range(50):
        episode_id, step = int(batch["episode_id"][i]), int(batch["step"][i])
        np.testing.assert_array_equal(batch["flags"][i].numpy(), episodes[episode_id]["flags"][step])
        assert batch["reward"][i].item() == episodes[episode_id]["reward"][step]
    store, episodes = fill(ab.SequenceSampler(4))
    windows = store.sample(40)
    assert windows["action"].shape == (40, 4, 6) and windows["half"].shape == (40, 4, 3)
    for i in range(40):
        for j in range(4):
            episode_id, step = int(windows["episode_id"][i, j]), int(windows["step"][i, j])
            for key in ("action", "count", "half", "terminated"):
                np.testing.assert_array_equal(windows[key][i, j].numpy(), episodes[episode_id][key][step], err_msg=key)


def test_export_and_views_of_packed_fields_hold_the_rows_written(written, tmp_path):
    store, episodes = written
    for episode_id, episode in episodes.items():
        try:
            view = store.episode(episode_id)
        except KeyError:   # evicted
            continue
        first = int(column_numpy(view.column("step"))[0])   # > 0 once its oldest transitions were evicted
        assert first == 0 or episode_id == store.episodes()["episode_id"][0].as_py(), "only the oldest is trimmed"
        for name in ("action", "flags", "count", "half", "reward"):
            values = column_numpy(view.column(name))   # its held steps, then the final observation's row
            assert len(values) == len(episode[name]) - first + 1, name
            np.testing.assert_array_equal(values[:len(episode[name]) - first], episode[name][first:], err_msg=name)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    a, b = store.to_arrow(), loaded.to_arrow()
    assert a.equals(b)


def test_a_payload_of_packed_fields_holds_the_rows_and_not_the_gathered_records(written):
    store, _ = written
    shard = store.engine.shard
    rows = np.array([3, 17, 4, 40])
    extra = {"index": np.arange(4)}
    payload = shard.gatherer.payload(rows, extra)
    end = max(offset + size for _, _, offset, size, _ in payload.spec)
    assert payload.flat.nbytes == end   # what a Ray shard sends: the leaves only
    batch = pickle.loads(pickle.dumps(payload)).to_tensordict()
    for name in ("action", "flags", "count", "half", "reward", "terminated"):
        np.testing.assert_array_equal(batch[name].numpy(), shard.arena[name][rows], err_msg=name)


@pytest.mark.parametrize("derived", [False, True])
def test_the_final_observation_row_reads_zero_in_every_packed_field_after_the_ring_reused_it(derived):
    # Shard.write_episode zeroes that row's record with one store when every packed field
    # is one row short, and field by field otherwise (a derived field left out: zeroed whole).
    fields = {"obs": ab.Field("float32", (3,), observation=True), "action": ab.Field("float32", (6,)),
              "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}
    if derived:
        fields["advantage"] = ab.Field("float32", derived=True)
    store = ab.ExperienceStore(10, schema=fields, seed=0)   # transitions
    assert len(store.engine.shard._pack_offsets) == (5 if derived else 4)   # obs is not packed
    rng = np.random.default_rng(0)

    def episode(steps):
        data = {"obs": rng.standard_normal((steps + 1, 3), np.float32),
                "action": rng.standard_normal((steps, 6), np.float32) + 5,
                "reward": np.full(steps, 7, np.float32), "terminated": np.ones(steps, bool),
                "truncated": np.ones(steps, bool)}
        if derived:
            data["advantage"] = np.full(steps, 3, np.float32)
        return data

    store.add_episode(episode(10))                     # rows 0-10: nonzero step fields at rows 0-9
    filler = episode(4)
    if derived:
        del filler["advantage"]
    store.add_episode(filler)                          # trims the first's oldest 4; rows 11-15 (the ring grows)
    second = episode(6)
    if derived:   # written without it: the store zeroes the derived field, and the others one by one
        del second["advantage"]
    store.add_episode(second)                          # evicts the first; rows 0-6, row 6 the final observation
    assert store.episodes()["first_row"].to_pylist() == [11, 0], "the second reuses the first's rows"
    table = store.to_arrow().slice(len(filler["obs"]))   # the filler's rows come first
    last = len(second["obs"]) - 1
    for name in ("action", "reward", "terminated", "truncated"):
        values = column_numpy(table.column(name))
        np.testing.assert_array_equal(values[:last], second[name], err_msg=name)
        assert not values[last].any(), name            # the final observation's row: zero
    if derived:
        assert not column_numpy(table.column("advantage")).any()
