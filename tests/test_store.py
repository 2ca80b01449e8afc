"""`ExperienceStore`: the ring under random writes, sampling, inputs, dtypes, views, errors, clear."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from tensordict import TensorDict

import arrowbuf as ab
from arrowbuf.episodes import StepWriter
from arrowbuf.shard import position_runs

from support.compare import assert_same_batches, assert_same_snapshot, column_numpy, snapshot
from support.envs import FakeVectorRollout
from support.episodes import EPISODE_SCHEMA, ExpectedEpisode, make_episode, tagged_obs
from support.ring import RingModel, assert_store_matches

# -- the ring under random writes ------------------------------------------------------------

episode_specs = st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(1, 40), specs=episode_specs, mode=st.sampled_from(["circular", "fixed"]))
def test_random_episodes_keep_every_ring_invariant(capacity, specs, mode):
    store = ab.ExperienceStore(capacity=capacity, seed=1, mode=mode, schema=EPISODE_SCHEMA)
    model = RingModel(capacity, mode)
    for tag, (steps, has_final) in enumerate(specs):
        expected = ExpectedEpisode(tag, steps, has_final, terminated=True)
        if model.fits(expected):
            episode_id = store.add_episode(make_episode(tag, steps, has_final))
            model.add(expected)
            assert episode_id == expected.episode_id
        else:
            before = snapshot(store)
            with pytest.raises(ab.CapacityError):
                store.add_episode(make_episode(tag, steps, has_final))
            assert_same_snapshot(before, snapshot(store))
        assert_store_matches(store, model, sample_size=32, epoch_batch=5)


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(8, 40), data=st.data())
def test_whole_episodes_and_writer_steps_interleave_in_one_ring(capacity, data):
    store = ab.ExperienceStore(capacity=capacity, seed=2, schema=EPISODE_SCHEMA)
    model = RingModel(capacity)
    lengths = data.draw(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=3))
    rollout = FakeVectorRollout(lengths, "next_step", first_tag=1000)   # tags apart from the whole episodes'
    # A staged writer (as a Ray store's): whole episodes, placed as `RingModel` places them.
    # A local store's in-place writer: tests/test_inplace.py.
    writer = StepWriter(store._backend.sink(None, None), rollout.num_envs, "next_step", in_place=False)
    tag = 0
    ops = st.tuples(st.sampled_from(["episode", "writer steps"]), st.integers(1, 7), st.booleans())
    for kind, count, has_final in data.draw(st.lists(ops, min_size=1, max_size=12)):
        if kind == "episode":
            store.add_episode(make_episode(tag, count, has_final))
            model.add(ExpectedEpisode(tag, count, has_final, terminated=True))
            tag += 1
        else:
            for _ in range(count):
                sealed = len(rollout.sealed)
                writer.add(**rollout.step_arrays())
                for episode in rollout.sealed[sealed:]:
                    model.add(episode)
    assert_store_matches(store, model, sample_size=32, epoch_batch=6)


# -- sampling ---------------------------------------------------------------------------------


def test_uniform_sampling_is_uniform_over_stored_transitions():
    store = ab.ExperienceStore(capacity=60, seed=1234)
    model = RingModel(60)
    for tag, (steps, has_final) in enumerate([(9, True), (14, True), (3, False), (11, True), (6, True),
                                              (13, False), (5, True), (8, True), (2, True)]):
        store.add_episode(make_episode(tag, steps, has_final))
        model.add(ExpectedEpisode(tag, steps, has_final, terminated=True))
    assert store.episodes().column("episode_id").to_pylist()[0] > 0, "the test needs evictions"
    live = {(e.episode_id, t) for e in model.live for t in range(e.length)}
    counts: Counter = Counter()
    for _ in range(40):
        batch = store.sample(2000)
        counts.update(zip(batch["episode_id"].tolist(), batch["step"].tolist()))
    assert set(counts) == live
    observed = np.array([counts[key] for key in sorted(live)])
    assert chisquare(observed).pvalue > 1e-3


def test_sample_returns_the_documented_keys_and_dtypes():
    store = ab.ExperienceStore(capacity=50, seed=0)
    store.add_episode(make_episode(4, 6))
    batch = store.sample(10)
    assert isinstance(batch, TensorDict) and batch.batch_size == torch.Size([10])
    assert set(batch.keys(True, True)) == {"obs", ("next", "obs"), "action", "reward", "terminated", "truncated",
                                           "index", "episode_id", "step"}
    assert batch["index"].dtype == torch.int64 and batch["episode_id"].dtype == torch.int64
    assert batch["step"].dtype == torch.int32
    assert batch["terminated"].dtype == torch.bool
    np.testing.assert_array_equal(batch["terminated"].numpy(), batch["step"].numpy() == 5)
    np.testing.assert_array_equal(batch["index"].numpy(), batch["step"].numpy())   # one episode: index = step


def test_stores_with_the_same_seed_and_writes_sample_identical_batches():
    stores = [ab.ExperienceStore(capacity=30, seed=seed) for seed in (99, 99, 100)]
    for store in stores:
        for tag, steps in enumerate([5, 8, 3, 9, 4]):
            store.add_episode(make_episode(tag, steps))
    for _ in range(3):
        a, b, c = (store.sample(64) for store in stores)
        assert_same_batches(a, b)
        assert not torch.equal(a["index"], c["index"])
    epoch_a = [mb["index"] for mb in stores[0].iter_batches(7)]
    epoch_b = [mb["index"] for mb in stores[1].iter_batches(7)]
    assert all(torch.equal(x, y) for x, y in zip(epoch_a, epoch_b, strict=True))


def test_iter_batches_without_shuffle_goes_in_insertion_order():
    store = ab.ExperienceStore(capacity=30, seed=0)
    for tag, steps in enumerate([4, 2, 5]):
        store.add_episode(make_episode(tag, steps))
    batches = list(store.iter_batches(3, shuffle=False))
    assert [len(b["index"]) for b in batches] == [3, 3, 3, 2]
    pairs = [p for b in batches for p in zip(b["episode_id"].tolist(), b["step"].tolist())]
    assert pairs == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert [len(b["index"]) for b in store.iter_batches(3, drop_last=True)] == [3, 3, 3]


def test_iter_batches_skips_transitions_evicted_during_the_epoch():
    store = ab.ExperienceStore(capacity=20, seed=3)
    model = RingModel(20)
    for tag, steps in enumerate([5, 5, 5]):
        store.add_episode(make_episode(tag, steps))
        model.add(ExpectedEpisode(tag, steps, True, terminated=True))
    epoch = store.iter_batches(4, shuffle=True)
    first = next(epoch)
    store.add_episode(make_episode(3, 15))   # 30 transitions in a capacity of 20: evicts episodes 0 and 1
    model.add(ExpectedEpisode(3, 15, True, terminated=True))
    rest = list(epoch)
    tags = {e.episode_id: e.tag for e in model.added}
    for batch in rest:
        assert set(batch["episode_id"].tolist()) == {2}, "only episode 2 was live for the whole epoch"
        np.testing.assert_array_equal(batch["obs"].numpy()[:, 0], [tags[i] for i in batch["episode_id"].tolist()])
        np.testing.assert_array_equal(batch["obs"].numpy()[:, 1], batch["step"].numpy())
    seen = [p for b in [first, *rest] for p in zip(b["episode_id"].tolist(), b["step"].tolist())]
    assert len(seen) == len(set(seen))
    assert {(2, t) for t in range(5)} <= set(seen)


# -- dtypes, nesting and explicit schemas ---------------------------------------------------------


def values_of(dtype: str, shape: tuple[int, ...], rows: int, tag: int) -> np.ndarray | torch.Tensor:
    """Distinct, exactly representable values for each row: tag * 16 + row (+ element)."""
    base = (tag * 16 + np.arange(rows)).reshape((rows,) + (1,) * len(shape))
    values = base + np.arange(int(np.prod(shape))).reshape(shape) if shape else base.reshape(rows)
    if dtype == "bool":
        return values % 2 == 1
    if dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32) / 4).to(torch.bfloat16)
    return values.astype(dtype)


DTYPES = ["bool", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_is_stored_and_sampled_back_with_identical_values(dtype):
    T = 6
    episode = {"obs": values_of(dtype, (2, 3), T + 1, 1), "x": values_of(dtype, (), T, 1),
               "v": values_of(dtype, (4,), T, 1), "terminated": np.arange(T) == T - 1}
    store = ab.ExperienceStore(capacity=20, seed=0)
    store.add_episode(episode)
    assert store.schema.fields["x"].dtype == dtype
    assert store.schema.observation_names == ("obs",)
    batch = store.sample(40)
    step = batch["step"].numpy()
    torch_dtype = ab.Field(dtype).torch_dtype
    for key, values, rows in [("x", episode["x"], step), ("v", episode["v"], step), ("obs", episode["obs"], step),
                              (("next", "obs"), episode["obs"], step + 1)]:
        assert batch[key].dtype == torch_dtype, key
        expected = values[torch.from_numpy(rows.astype(np.int64))] if isinstance(values, torch.Tensor) else values[rows]
        if isinstance(expected, torch.Tensor):
            assert torch.equal(batch[key], expected), key
        else:
            np.testing.assert_array_equal(batch[key].numpy(), expected, err_msg=str(key))
    rows = store.to_arrow()   # the export holds the same values (bfloat16 as its uint16 bits)
    for name in ("obs", "x", "v"):
        stored = column_numpy(rows.column(name))
        assert stored.dtype == ab.Field(dtype).numpy_dtype, name
        np.testing.assert_array_equal(stored[:len(episode[name])], bits(episode[name]), err_msg=name)


def bits(values: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.view(torch.int16).numpy().view(np.uint16)
    return values


def test_bfloat16_is_stored_as_uint16_bits_with_field_metadata():
    values = torch.tensor([0.1, -3.5, 1e30, -0.0], dtype=torch.bfloat16)
    store = ab.ExperienceStore(capacity=10, seed=0)
    store.add_episode({"obs": torch.zeros(5, 2), "w": values, "terminated": torch.zeros(4, dtype=torch.bool)})
    field = store.to_arrow().schema.field("w")
    assert field.type == pa.uint16() and field.metadata[b"arrowbuf.dtype"] == b"bfloat16"
    bits = column_numpy(store.episode(0).column("w"))[:4]
    assert bits.tolist() == values.view(torch.int16).numpy().view(np.uint16).tolist()
    batch = store.sample(8)
    assert torch.equal(batch["w"], values[batch["step"].long()])


NESTED = ab.Schema({"obs": {"pixels": ab.Field("uint8", (2, 2), True), "state": ab.Field("float32", (2,), True)},
                    "action": ab.Field("int64"), "reward": ab.Field("float32"), "terminated": ab.Field("bool")})


def nested_episode(tag: int, steps: int) -> dict:
    t = np.arange(steps + 1)
    return {"obs": {"pixels": np.broadcast_to((tag * 10 + t)[:, None, None], (steps + 1, 2, 2)).astype(np.uint8),
                    "state": tagged_obs(tag, t).astype(np.float32)},
            "action": tag * 1000 + t[:-1], "reward": np.ones(steps, np.float32), "terminated": t[:-1] == steps - 1}


def assert_nested_batch(batch) -> None:
    step = batch["step"].numpy()
    np.testing.assert_array_equal(batch["obs", "state"].numpy()[:, 1], step)
    np.testing.assert_array_equal(batch["next", "obs", "state"].numpy()[:, 1], step + 1)
    tag = batch["obs", "state"].numpy()[:, 0].astype(np.int64)
    np.testing.assert_array_equal(batch["obs", "pixels"].numpy()[:, 0, 0], tag * 10 + step)
    np.testing.assert_array_equal(batch["next", "obs", "pixels"].numpy()[:, 1, 1], tag * 10 + step + 1)
    np.testing.assert_array_equal(batch["action"].numpy(), tag * 1000 + step)


def test_nested_observations_with_an_explicit_schema_come_back_nested():
    store = ab.ExperienceStore(capacity=30, seed=0, schema=NESTED)
    for tag in range(3):
        store.add_episode(nested_episode(tag, 4 + tag))
    assert store.to_arrow().column_names[:2] == ["obs.pixels", "obs.state"]
    batch = store.sample(50)
    assert isinstance(batch["obs"], TensorDict) and batch["obs"].batch_size == torch.Size([50])
    assert_nested_batch(batch)


def test_nested_observations_infer_dotted_fields_and_come_back_nested():
    store = ab.ExperienceStore(capacity=30, seed=0)
    store.add_episode(nested_episode(0, 4))
    assert store.schema == NESTED
    assert_nested_batch(store.sample(20))


def test_an_explicit_schema_is_enforced_from_the_start():
    schema = ab.Schema({"obs": ab.Field("float32", (2,), True), "action": ab.Field("int32")})
    store = ab.ExperienceStore(capacity=30, seed=0, schema=schema)
    assert store.schema == schema
    assert store.to_arrow().num_rows == 0 and store.to_arrow().schema.names[:2] == ["obs", "action"]
    with pytest.raises(ab.SchemaError, match="'action': dtype int64; expected int32"):
        store.add_episode({"obs": np.zeros((4, 2), np.float32), "action": np.zeros(3, np.int64)})
    store.add_episode({"obs": np.zeros((4, 2), np.float16), "action": np.arange(3, dtype=np.int16)})
    batch = store.sample(8)
    assert batch["obs"].dtype == torch.float32 and batch["action"].dtype == torch.int32
    np.testing.assert_array_equal(batch["action"].numpy(), batch["step"].numpy())


def test_the_first_episode_decides_which_fields_are_observations():
    with_final = ab.ExperienceStore(capacity=20)
    with_final.add_episode(make_episode(0, 3))
    assert with_final.schema == EPISODE_SCHEMA
    without = ab.ExperienceStore(capacity=20)
    without.add_episode(make_episode(0, 3, has_final=False))
    assert without.schema.observation_names == ()
    assert len(without) == 3   # no observation field: every step is a transition, without "next"
    assert "next" not in without.sample(4).keys()


def test_a_schema_given_as_a_mapping_is_the_same_as_a_schema():
    store = ab.ExperienceStore(capacity=10, schema={"obs": ab.Field("float32", (2,), True), "action": "int64"})
    assert store.schema == ab.Schema({"obs": ab.Field("float32", (2,), True), "action": ab.Field("int64")})


# -- inputs ----------------------------------------------------------------------------------


def as_torch(episode: dict) -> dict:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in episode.items()}


@pytest.mark.parametrize("convert", [lambda e: e, as_torch, lambda e: TensorDict(as_torch(e), batch_size=[])],
                         ids=["numpy", "torch", "tensordict"])
def test_numpy_torch_and_tensordict_inputs_store_the_same_rows(convert):
    reference = ab.ExperienceStore(capacity=30, seed=0)
    store = ab.ExperienceStore(capacity=30, seed=0)
    for tag, steps in enumerate([4, 6]):
        reference.add_episode(make_episode(tag, steps))
        store.add_episode(convert(make_episode(tag, steps)))
    assert store.schema == reference.schema
    assert store.to_arrow().equals(reference.to_arrow())
    assert_same_batches(store.sample(16), reference.sample(16))


def test_a_plain_record_batch_is_an_episode_without_final_observation():
    batch = pa.RecordBatch.from_pydict({"obs": pa.array([0.0, 1.0, 2.0]), "action": pa.array([5, 6, 7])})
    store = ab.ExperienceStore(capacity=10, seed=0, schema={"obs": ab.Field("float64", (), True), "action": "int64"})
    store.add_episode(batch)
    table = store.episodes()
    assert table.column("has_final").to_pylist() == [False]
    assert table.column("length").to_pylist() == [2]
    sample = store.sample(10)
    np.testing.assert_array_equal(sample["next", "obs"].numpy(), sample["obs"].numpy() + 1)


def readd_cases() -> dict[str, tuple[dict, ab.Schema | None]]:
    reward = np.linspace(-1.0, 1.0, 5)   # a return that is not NaN: Arrow's equals says NaN != NaN
    cases = {d: ({"obs": values_of(d, (2,), 6, 2), "x": values_of(d, (), 5, 2), "v": values_of(d, (3,), 5, 2),
                  "reward": reward, "terminated": np.arange(5) == 4}, None) for d in DTYPES}
    cases["no final obs"] = ({"o": values_of("float32", (2,), 5, 2), "x": values_of("int64", (), 5, 2),
                              "reward": reward},
                             ab.Schema({"o": ab.Field("float32", (2,), True), "x": ab.Field("int64"),
                                        "reward": ab.Field("float64")}))
    cases["nested"] = (nested_episode(3, 5), NESTED)
    return cases


@pytest.mark.parametrize("episode, schema", readd_cases().values(), ids=list(readd_cases()))
def test_re_adding_an_episode_view_into_another_store_gives_identical_rows(episode, schema):
    first = ab.ExperienceStore(capacity=20, seed=0, schema=schema)
    first.add_episode(episode)
    second = ab.ExperienceStore(capacity=20, seed=0)
    second.add_episode(first.episode(0))
    assert second.schema == first.schema
    assert second.episode(0).equals(first.episode(0))
    assert second.episodes().drop_columns(["inserted_at"]).equals(first.episodes().drop_columns(["inserted_at"]))
    assert_same_batches(second.sample(12), first.sample(12))


def test_an_episode_view_re_added_to_the_same_store_is_a_new_identical_episode():
    store = ab.ExperienceStore(capacity=40, seed=0, schema=EPISODE_SCHEMA)
    store.add_episode(make_episode(7, 5, has_final=False))
    store.add_episode(store.episode(0))
    a, b = store.episode(0), store.episode(1)
    for name in a.schema.names:
        if name != "episode_id":
            assert a.column(name).equals(b.column(name)), name
    assert store.episodes().column("length").to_pylist() == [4, 4]


# -- zero-copy views -------------------------------------------------------------------------


def buffer_address(column: pa.Array) -> int:
    if isinstance(column.type, pa.FixedShapeTensorType):
        return column.storage.values.buffers()[1].address
    return column.buffers()[1].address


ZERO_COPY = ["obs"]   # columnar data fields; system columns are computed
PACKED = ["action", "reward", "terminated", "truncated"]   # small per-step fields: one row-packed block (`arrowbuf.packing`)


def test_an_episode_view_shares_memory_with_the_arena_and_copies_packed_fields(filled_store):
    store, model = filled_store
    shard = store.engine.shard
    arena = shard.arena
    assert sorted(shard._pack_offsets) == sorted(PACKED)
    first_rows = dict(zip(store.episodes()["episode_id"].to_pylist(), store.episodes()["first_row"].to_pylist()))
    for e in model.live:
        e.first_row = first_rows[e.episode_id]   # where the store placed it (the model counts transitions only)
        view = store.episode(e.episode_id)
        for name in ZERO_COPY:
            column = arena[name]
            assert buffer_address(view.column(name)) == column[e.first_row:].ctypes.data, name
        for name in PACKED:
            values = column_numpy(view.column(name))
            assert not np.shares_memory(values, shard.packed), name
            np.testing.assert_array_equal(values, arena[name][e.first_row:e.first_row + len(values)])
        arena["obs"][e.first_row] = -5   # writes to the arena show through the view
        assert view.column("obs")[0].as_py() == [-5.0] * len(view.column("obs")[0].as_py())


def test_to_arrow_chunks_share_memory_with_the_arena(filled_store):
    store, model = filled_store
    arena = store.engine.shard.arena
    table = store.to_arrow()
    first, num = store.engine.shard.table.col("first_row"), store.engine.shard.table.col("num_rows")
    runs = [(int(first[a]), int(first[b - 1] + num[b - 1])) for a, b in position_runs(first, num)]
    assert len(runs) >= 2, "the fixture should have wrapped the ring"
    for name in ZERO_COPY:
        chunks = table.column(name).chunks
        assert [len(c) for c in chunks] == [stop - start for start, stop in runs]
        for chunk, (start, _) in zip(chunks, runs):
            assert buffer_address(chunk) == arena[name][start:].ctypes.data, name


# -- errors leave the store unchanged ------------------------------------------------------------


def twins() -> tuple[ab.ExperienceStore, ab.ExperienceStore]:
    pair = []
    for _ in range(2):
        store = ab.ExperienceStore(capacity=14, seed=5)   # 25 transitions: the first two episodes' 11 go
        for tag, (steps, has_final) in enumerate([(5, True), (7, False), (6, True), (8, True)]):
            store.add_episode(make_episode(tag, steps, has_final))
        store.sample(3)
        pair.append(store)
    return pair[0], pair[1]


def renamed(episode: dict, old: str, new: str) -> dict:
    episode = dict(episode)
    episode[new] = episode.pop(old)
    return episode


EP = make_episode(9, 4)
BAD_CALLS = {
    "misspelled field": (lambda s: s.add_episode(renamed(EP, "action", "actoin")), ab.SchemaError,
                         ["actoin", "action"]),
    "extra field": (lambda s: s.add_episode({**EP, "log_prob": np.zeros(4)}), ab.SchemaError, ["log_prob"]),
    "missing field": (lambda s: s.add_episode({k: v for k, v in EP.items() if k != "reward"}), ab.SchemaError,
                      ["reward"]),
    "wrong dtype": (lambda s: s.add_episode({**EP, "action": EP["action"].astype(np.float32)}), ab.SchemaError,
                    ["'action'", "float32", "int64"]),
    "wrong torch dtype": (lambda s: s.add_episode({**EP, "reward": torch.zeros(4, dtype=torch.bfloat16)}),
                          ab.SchemaError, ["'reward'", "bfloat16", "float64"]),
    "wrong shape": (lambda s: s.add_episode({**EP, "obs": np.zeros((5, 3))}), ab.SchemaError,
                    ["'obs'", "(3,)", "(2,)"]),
    "ragged step fields": (lambda s: s.add_episode({**EP, "action": EP["action"][:3]}), ab.SchemaError,
                           ["ragged", "'action': 3", "'reward': 4"]),
    "obs two rows too long": (lambda s: s.add_episode({**EP, "obs": tagged_obs(9, np.arange(6))}), ab.SchemaError,
                              ["'obs': 6", "5"]),
    "longer than capacity": (lambda s: s.add_episode(make_episode(9, 24)), ab.CapacityError,
                             ["24 transitions", "capacity of 14 transitions"]),
    "bad env_id": (lambda s: s.add_episode(EP, env_id=3), ValueError, ["env_id", "3"]),
    "bad metadata": (lambda s: s.add_episode(EP, metadata={"f": object()}), ValueError, ["metadata"]),
    "batch_size 0": (lambda s: s.sample(0), ValueError, ["batch_size", "0"]),
    "batch_size -3": (lambda s: s.sample(-3), ValueError, ["batch_size", "-3"]),
    "batch_size 2.5": (lambda s: s.sample(2.5), ValueError, ["batch_size", "2.5"]),
    "batch_size True": (lambda s: s.sample(True), ValueError, ["batch_size", "True"]),
    "iter_batches 0": (lambda s: s.iter_batches(0), ValueError, ["batch_size", "0"]),
    "num_workers 0": (lambda s: s.sample(32, num_workers=0), ValueError, ["num_workers", "0"]),
    "num_workers not dividing": (lambda s: s.sample(32, num_workers=3), ValueError, ["num_workers", "3", "32"]),
    "unknown episode": (lambda s: s.episode(0), KeyError, ["episode 0", "2..3"]),
}


@pytest.mark.parametrize("call, error, words", BAD_CALLS.values(), ids=list(BAD_CALLS))
def test_a_failed_call_names_the_bad_value_and_changes_nothing(call, error, words):
    store, twin = twins()
    assert store.episodes().column("episode_id").to_pylist() == [2, 3], "the twins should have evicted"
    before = snapshot(store)
    with pytest.raises(error) as info:
        call(store)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert_same_snapshot(before, snapshot(store))
    for _ in range(2):
        assert_same_batches(store.sample(32), twin.sample(32))


def test_a_full_fixed_store_refuses_an_episode_and_changes_nothing():
    store = ab.ExperienceStore(capacity=10, seed=0, mode="fixed")
    twin = ab.ExperienceStore(capacity=10, seed=0, mode="fixed")
    for s in (store, twin):
        s.add_episode(make_episode(0, 4))
        s.add_episode(make_episode(1, 5))
    before = snapshot(store)
    with pytest.raises(ab.CapacityError) as info:
        store.add_episode(make_episode(2, 2))
    assert "mode='fixed'" in str(info.value) and "capacity=10" in str(info.value)
    assert_same_snapshot(before, snapshot(store))
    assert_same_batches(store.sample(20), twin.sample(20))
    store.add_episode(make_episode(2, 1))   # the tenth transition still fits
    assert store.num_episodes == 3


def test_sampling_an_empty_store_raises_empty_store_error():
    store = ab.ExperienceStore(capacity=10, seed=0, schema=EPISODE_SCHEMA)
    with pytest.raises(ab.EmptyStoreError, match="0 transitions"):
        store.sample(4)
    store.add_episode(make_episode(0, 1, has_final=False))   # one step, no transition
    assert len(store) == 0 and store.num_episodes == 1
    with pytest.raises(ab.EmptyStoreError, match=r"0 transitions \(1 episodes\)"):
        store.sample(4)
    assert list(store.iter_batches(4)) == []


@pytest.mark.parametrize("kwargs, words", [
    (dict(capacity=0), ["capacity", "0"]), (dict(capacity=-5), ["capacity", "-5"]),
    (dict(capacity=2.5), ["capacity", "2.5"]), (dict(capacity=True), ["capacity", "True"]),
    (dict(capacity="10"), ["capacity", "'10'"]),
    (dict(capacity=10, mode="ring"), ["mode", "'ring'"]),
    (dict(capacity=10, seed=-1), ["seed", "-1"]), (dict(capacity=10, seed=1.5), ["seed", "1.5"]),
    (dict(capacity=10, seed="abc"), ["seed", "'abc'"]),
    (dict(capacity=10, backend="spark"), ["backend", "'spark'"]),
    (dict(capacity=10, sampler="uniform"), ["sampler", "'uniform'"]),
])
def test_bad_constructor_arguments_raise_value_error_naming_them(kwargs, words):
    with pytest.raises(ValueError) as info:
        ab.ExperienceStore(**kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def test_a_bad_explicit_schema_is_a_schema_error():
    with pytest.raises(ab.SchemaError, match="'index'"):
        ab.ExperienceStore(capacity=10, schema={"index": "int64", "action": "int64"})


# -- episode table, clear ---------------------------------------------------------------------


def test_the_episode_table_records_env_ids_metadata_and_returns():
    store = ab.ExperienceStore(capacity=50, seed=0)
    store.add_episode(make_episode(0, 3), env_id="a", metadata={"level": 3})
    store.add_episode(make_episode(1, 4, terminated=False, truncated=True), env_id="b")
    table = store.episodes()
    assert table.column("env_id").to_pylist() == ["a", "b"]
    assert table.column("metadata").to_pylist() == ['{"level": 3}', None]
    assert table.column("terminated").to_pylist() == [True, False]
    assert table.column("truncated").to_pylist() == [False, True]
    assert table.column("return").to_pylist() == [0.5 + 0.75 + 1.0, 1.0 + 1.25 + 1.5 + 1.75]
    assert table.column("first_index").to_pylist() == [0, 3]


def test_clear_empties_the_store_keeps_the_schema_and_old_indices_never_return():
    store = ab.ExperienceStore(capacity=30, seed=0)
    for tag, steps in enumerate([4, 6, 5]):
        store.add_episode(make_episode(tag, steps))
    schema = store.schema
    old_index = set(store.sample(200)["index"].tolist())
    store.clear()
    assert len(store) == 0 and store.num_episodes == 0
    assert store.schema == schema
    assert store.episodes().num_rows == 0
    assert store.to_arrow().num_rows == 0 and store.to_arrow().schema == schema.to_arrow()
    with pytest.raises(ab.EmptyStoreError):
        store.sample(1)
    with pytest.raises(KeyError):
        store.episode(0)
    for tag, steps in enumerate([4, 6, 5], start=3):
        assert store.add_episode(make_episode(tag, steps)) == tag
    new_index = set(store.sample(500)["index"].tolist())
    assert not new_index & old_index
    assert min(new_index) >= 15
    model = RingModel(30)
    model.added = [ExpectedEpisode(t, 1, True) for t in range(3)]
    for tag, steps in enumerate([4, 6, 5], start=3):
        model.add(ExpectedEpisode(tag, steps, True, terminated=True))
    assert_store_matches(store, model)


def test_an_episode_table_already_returned_does_not_change_after_clear_and_new_writes():
    store = ab.ExperienceStore(capacity=30, seed=0)
    store.add_episode(make_episode(0, 4))
    table = store.episodes()
    copy = pa.Table.from_pylist(table.to_pylist(), schema=table.schema)
    store.clear()
    store.add_episode(make_episode(1, 9))
    assert table.equals(copy)


def _episode_of(steps: int, tag: float) -> dict:
    return {"obs": np.full((steps + 1, 2), tag, np.float32), "action": np.arange(steps),
            "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
            "truncated": np.zeros(steps, bool)}


def test_add_episodes_takes_a_list_of_episodes_of_any_lengths():
    store = ab.ExperienceStore(capacity=100, seed=0)
    ids = store.add_episodes([_episode_of(3, 0.0), _episode_of(5, 1.0), TensorDict(_episode_of(1, 2.0))],
                             env_ids=["a", "b", "c"], metadata=[{"k": 1}, None, None])
    assert ids == [0, 1, 2] and len(store) == 9
    table = store.episodes()
    assert table.column("length").to_pylist() == [3, 5, 1] and table.column("env_id").to_pylist() == ["a", "b", "c"]
    assert store.episode(1).column("obs").to_pylist()[0] == [1.0, 1.0]
    bad = _episode_of(4, 3.0)
    bad["action"] = bad["action"].astype(np.float32)
    with pytest.raises(ab.SchemaError, match="episode 1 of the list.*action"):
        store.add_episodes([_episode_of(2, 4.0), bad])
    with pytest.raises(ValueError, match="lengths"):
        store.add_episodes([_episode_of(2, 4.0)], lengths=[1])
    with pytest.raises(ValueError, match="env_ids"):
        store.add_episodes([_episode_of(2, 4.0)], env_ids=["a", "b"])
    assert len(store) == 9 and store.num_episodes == 3   # the refused calls stored nothing
