"""Ragged fields (``ab.Field(dtype, (None,))``): a sequence per step, stored unpadded, sampled as jagged
nested tensors, and compared element by element with what was written on every path."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf import byte_heap
from arrowbuf.errors import SchemaError
from arrowbuf.ragged import RaggedRows, ragged_rows


def tokens(episode: int, step: int) -> np.ndarray:
    """The sequence written at (episode, step): its length and values say where it came from."""
    length = (7 * episode + 3 * step) % 13
    return (np.arange(length) + 1000 * episode + 10 * step).astype(np.int32)


SCHEMA = {"obs": ab.Field("float32", (2,), observation=True), "tokens": ab.Field("int32", (None,)),
          "action": ab.Field("int64"), "reward": ab.Field("float32"), "terminated": ab.Field("bool"),
          "truncated": ab.Field("bool")}


def episode(e: int, steps: int, form: str = "list") -> dict:
    seqs = [tokens(e, t) for t in range(steps)]
    if form == "nested":
        seqs = torch.nested.nested_tensor([torch.from_numpy(s) for s in seqs], layout=torch.jagged)
    elif form == "arrow":
        seqs = pa.array([s.tolist() for s in seqs], pa.list_(pa.int32()))
    return {"obs": np.zeros((steps + 1, 2), np.float32), "tokens": seqs, "action": np.arange(steps) + 100 * e,
            "reward": np.full(steps, e, np.float32), "terminated": np.r_[np.zeros(steps - 1, bool), True],
            "truncated": np.zeros(steps, bool)}


def filled(capacity: int = 500, episodes=((0, 9), (1, 14), (2, 5), (3, 11))) -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=capacity, schema=SCHEMA, seed=0)
    for e, steps in episodes:
        store.add_episode(episode(e, steps, ("list", "nested", "arrow")[e % 3]))
    return store


def check_batch(batch) -> None:
    """Every row's tokens are the ones written at its (episode, step), known by its action."""
    action = batch["action"].numpy()
    nested = batch["tokens"]
    assert nested.layout == torch.jagged and nested.dtype == torch.int32
    offsets, values = nested.offsets().numpy(), nested.values().numpy()
    assert len(offsets) == len(action) + 1
    for i, a in enumerate(action.tolist()):
        np.testing.assert_array_equal(values[offsets[i]:offsets[i + 1]], tokens(a // 100, a % 100))


def test_every_input_form_samples_back_the_sequences_written():
    store = filled()
    check_batch(store.sample(64))
    seen = []
    for batch in store.iter_batches(16, shuffle=True):
        check_batch(batch)
        seen += batch["action"].tolist()
    assert sorted(seen) == sorted(a + 100 * e for e, n in ((0, 9), (1, 14), (2, 5), (3, 11)) for a in range(n))
    check_batch(store.sample(32, n_step=3, gamma=0.5))   # a step field: read at the transition's row
    assert set(store.sample(8, keys=["action"]).keys()) == {"action", "index", "episode_id", "step"}


def test_pad_gives_a_padded_tensor_to_the_batch_s_longest_row_and_the_lengths():
    store = filled()
    batch = store.sample(48, pad={"tokens": -1})
    dense, lengths = batch["tokens"].numpy(), batch["tokens_length"].numpy()
    assert dense.shape == (48, lengths.max()) and dense.dtype == np.int32
    for row, n, a in zip(dense, lengths, batch["action"].tolist()):
        np.testing.assert_array_equal(row[:n], tokens(a // 100, a % 100))
        assert (row[n:] == -1).all()
    for bad, message in (({"action": 0}, "not a ragged field"), ({"tokens": "x"}, "must be a number"),
                         (["tokens"], "must be a dict")):
        with pytest.raises(ValueError, match=message):
            store.sample(4, pad=bad)


def test_a_step_writer_writes_sequences_in_place_and_a_ring_that_laps_keeps_only_what_it_holds(monkeypatch):
    monkeypatch.setattr(byte_heap, "CHUNK_BYTES", 4 << 10)
    store = ab.ExperienceStore(capacity=60, schema=SCHEMA, seed=0)
    writer = store.writer(num_envs=3)
    step = np.zeros(3, int)
    episode_of = np.arange(3)
    for _ in range(300):
        done = step + 1 == np.array([5, 8, 13])
        writer.add(obs=np.zeros((3, 2), np.float32), tokens=[tokens(int(e), int(t)) for e, t in zip(episode_of, step)],
                   action=episode_of * 100 + step, reward=np.zeros(3, np.float32), terminated=done,
                   truncated=np.zeros(3, bool), next_obs=np.zeros((3, 2), np.float32))
        step += 1
        episode_of = np.where(done, episode_of + 3, episode_of)
        step[done] = 0
    writer.flush()
    assert len(store) == 60
    check_batch(store.sample(100))
    column = store.engine.shard.arena["tokens"]
    assert column.heap.live == int(column.size.sum())
    assert column.heap.allocated <= 1.5 * column.heap.live + 2 * column.heap.chunk_bytes


def test_exports_checkpoints_and_episodes_round_trip_the_sequences(tmp_path):
    store = filled()
    column = store.to_arrow().column("tokens")
    assert pa.types.is_large_list(column.type)
    expected = {(e, t): tokens(e, t).tolist() for e, n in ((0, 9), (1, 14), (2, 5), (3, 11)) for t in range(n)}
    store.to_parquet(tmp_path / "export")
    imported = ab.ExperienceStore.from_parquet(tmp_path / "export")
    assert imported.schema.fields["tokens"] == ab.Field("int32", (None,))
    check_batch(imported.sample(64))
    store.save(tmp_path / "checkpoint")
    loaded = ab.ExperienceStore.load(tmp_path / "checkpoint")
    check_batch(loaded.sample(64))
    copied = ab.ExperienceStore(capacity=500, schema=SCHEMA, seed=0)
    for episode_id in store.episodes()["episode_id"].to_pylist():
        copied.add_episode(store.episode(episode_id))
    check_batch(copied.sample(64))
    table = store.to_arrow()
    got = {(a // 100, a % 100): row for a, row, last in zip(table.column("action").to_pylist(),
                                                            table.column("tokens").to_pylist(),
                                                            table.column("is_last").to_pylist()) if not last}
    assert got == expected
    duckdb = pytest.importorskip("duckdb")
    lengths = duckdb.sql(f"select len(tokens) from read_parquet('{tmp_path}/export/steps/*.parquet')").fetchall()
    assert sorted(n for (n,) in lengths) == sorted([len(v) for v in expected.values()] + [0] * 4)


def test_rows_of_k_values_keep_their_items_and_an_inferred_list_is_ragged():
    schema = {"points": ab.Field("float32", (None, 3)), "action": ab.Field("int64"), "terminated": ab.Field("bool")}
    store = ab.ExperienceStore(capacity=50, schema=schema, seed=0)
    rows = [np.arange(3 * n, dtype=np.float32).reshape(n, 3) + 100 * t for t, n in enumerate([2, 0, 5, 1])]
    store.add_episode({"points": rows, "action": np.arange(4), "terminated": np.array([0, 0, 0, 1], bool)})
    batch = store.sample(20)
    offsets, values = batch["points"].offsets().numpy(), batch["points"].values().numpy()
    assert values.shape[1:] == (3,)
    for i, t in enumerate(batch["action"].tolist()):
        np.testing.assert_array_equal(values[offsets[i]:offsets[i + 1]], rows[t])
    inferred = ab.ExperienceStore(capacity=50, seed=0)
    inferred.add_episode({"prompt": [np.array([5, 6, 7]), np.array([8])], "action": np.zeros(2),
                          "terminated": np.array([False, True])})
    assert inferred.schema.fields["prompt"] == ab.Field("int64", (None,))


def test_max_bytes_bounds_the_values_held():
    field = ab.Field("int32", (None,), max_bytes=4 * 200)
    store = ab.ExperienceStore(capacity=1000, schema={**SCHEMA, "tokens": field}, seed=0)
    for e in range(12):
        store.add_episode(episode(e, 10))
        assert store.engine.shard.arena["tokens"].heap.live <= 800
    kept = store.episodes()["episode_id"].to_pylist()
    assert kept == list(range(12 - len(kept), 12)) and len(kept) < 12
    check_batch(store.sample(32))


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_max_bytes_of_a_ragged_field_binds_in_a_loaded_checkpoint_and_on_ray(backend, tmp_path, request):
    # The schema's JSON (checkpoints, Ray shards) kept max_bytes only beside a codec: a loaded
    # store and every Ray shard held a ragged field's values unbounded.
    kwargs = {"backend": "ray", "num_shards": 2} if backend == "ray" else {}
    if backend == "ray":
        request.getfixturevalue("ray_session")
    field = ab.Field("int32", (None,), max_bytes=4 * 200)
    store = ab.ExperienceStore(capacity=1000, schema={**SCHEMA, "tokens": field}, seed=0, **kwargs)
    try:
        for e in range(6):
            store.add_episode(episode(e, 10))
        store.save(tmp_path / "saved")
        again = store if backend == "ray" else ab.ExperienceStore.load(tmp_path / "saved")
        assert again.schema.fields["tokens"] == field
        for e in range(6, 40):
            again.add_episode(episode(e, 10))
        again.flush()
        held = again.gather(np.concatenate([np.arange(*r) for r in again.live_ranges()]))["tokens"]
        assert 0 < held.values().numel() * 4 <= 800 and len(again) < 200
    finally:
        if backend == "ray":
            store.close()


def test_bad_sequences_are_refused_naming_the_field_and_leave_the_store_as_it_was():
    store = filled()
    before = store.to_arrow()
    bad = episode(5, 4)
    bad["tokens"] = [np.zeros((2, 2), np.int32)] * 4                      # a 2-D list for a (None,) field
    with pytest.raises(SchemaError, match=r"field 'tokens'.*\(None,\) takes a list of sequences"):
        store.add_episode(bad)
    bad["tokens"] = [np.zeros(3, np.float32), np.zeros(1, np.float32), np.zeros(0, np.float32), np.ones(2, np.float32)]
    with pytest.raises(SchemaError, match="field 'tokens': dtype float32; expected int32"):
        store.add_episode(bad)
    bad["tokens"] = [np.zeros(3, np.int32), np.zeros(2, np.float64), np.zeros(1, np.int32), np.zeros(1, np.int32)]
    with pytest.raises(SchemaError, match="field 'tokens': rows of dtypes"):
        store.add_episode(bad)
    bad["tokens"] = [[1, 2], [[3]], [4], [5]]
    with pytest.raises(SchemaError, match="field 'tokens'"):
        store.add_episode(bad)
    fixed = episode(5, 4)
    fixed["action"] = [np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64)]
    with pytest.raises(SchemaError, match="field 'action': got ragged rows"):
        store.add_episode(fixed)
    assert store.to_arrow().equals(before)
    with pytest.raises(SchemaError, match="ragged field"):
        ab.Field("int32", (None,), observation=True)
    with pytest.raises(SchemaError, match=r"\(None,\) or \(None, k\)"):
        ab.Field("int32", (None, 2, 2))


def test_what_does_not_take_ragged_fields_yet_says_so_before_anything_is_written(tmp_path):
    with pytest.raises(SchemaError, match="storage_device"):
        ab.ExperienceStore(capacity=10, schema=SCHEMA, storage_device="cpu")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(-5, 5), max_size=6), min_size=1, max_size=12), st.data())
def test_ragged_rows_index_like_lists_of_their_rows(rows, data):
    ragged = ragged_rows([np.array(r, np.int64) for r in rows], "x")
    assert ragged.lengths.tolist() == [len(r) for r in rows]
    pick = data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=10))
    assert [r.tolist() for r in ragged[np.array(pick, np.int64)].rows()] == [rows[i] for i in pick]
    start, stop = sorted(data.draw(st.tuples(st.integers(0, len(rows)), st.integers(0, len(rows)))))
    assert [r.tolist() for r in ragged[start:stop].rows()] == rows[start:stop]
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows))))
    assert [r.tolist() for r in ragged[mask].rows()] == [r for r, m in zip(rows, mask) if m]
    back = ragged_rows(ragged.to_arrow(), "x")
    assert isinstance(back, RaggedRows) and [r.tolist() for r in back.rows()] == rows


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_store_of_exactly_num_envs_x_t_holds_each_rollout_of_sequences_text_and_encoded_frames(backend, request):
    """The size PPO users choose, a new writer per rollout dropped without flush() (closed on Ray, whose
    dropped writers tests/test_ray_writer_lifetime.py covers), clear() between: every transition kept,
    each with its own sequence, instruction and frame; pieces never show as episodes."""
    pytest.importorskip("zstandard")
    num_envs, steps = 4, 25
    schema = {"obs": ab.Field("uint8", (8, 8, 3), observation=True, codec="zstd"), "tokens": ab.Field("int32", (None,)),
              "instruction": ab.Field("string"), "action": ab.Field("int64"), "reward": ab.Field("float32"),
              "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}
    if backend == "ray":
        request.getfixturevalue("ray_session")
        store = ab.ExperienceStore(capacity=num_envs * steps, schema=schema, seed=0, backend="ray", num_shards=2)
        request.addfinalizer(store.close)
    else:
        store = ab.ExperienceStore(capacity=num_envs * steps, schema=schema, seed=0)

    def frame(env: int, t: int) -> np.ndarray:
        return np.full((8, 8, 3), (7 * env + t) % 251, np.uint8)

    for rollout in range(3):   # (each step's obs is the last next_obs: no autoreset step to drop)
        writer = store.writer(num_envs=num_envs, autoreset_mode="disabled")
        for t in range(steps):
            done = np.array([(t + 1) % (5 + env) == 0 for env in range(num_envs)])
            writer.add(obs=np.stack([frame(e, t) for e in range(num_envs)]),
                       tokens=[tokens(e, t) for e in range(num_envs)],
                       instruction=[f"rollout {rollout} env {e}" for e in range(num_envs)],
                       action=np.arange(num_envs) * 100 + t, reward=np.zeros(num_envs, np.float32),
                       terminated=done, truncated=np.zeros(num_envs, bool),
                       next_obs=np.stack([frame(e, t + 1) for e in range(num_envs)]))
        if backend == "ray":
            writer.close()
        del writer   # dropped without flush(): its open episodes are sealed, nothing lost
        assert len(store) == num_envs * steps
        played = sum(len(range(0, steps, 5 + e)) for e in range(num_envs))   # episodes each env began
        assert store.num_episodes == played
        seen = []
        for batch in store.iter_batches(32, shuffle=False):
            check_batch(batch)
            action = batch["action"].numpy()
            env, t = action // 100, action % 100
            assert list(batch["instruction"]) == [f"rollout {rollout} env {e}" for e in env.tolist()]
            np.testing.assert_array_equal(batch["obs"].numpy(), np.stack([frame(e, s) for e, s in zip(env, t)]))
            np.testing.assert_array_equal(batch["next", "obs"].numpy(),
                                          np.stack([frame(e, s + 1) for e, s in zip(env, t)]))
            seen += action.tolist()
        assert sorted(seen) == sorted(e * 100 + t for e in range(num_envs) for t in range(steps))
        store.clear()


def test_a_sampled_jagged_tensor_records_its_longest_row_as_torch_s_own_constructor_does():
    # (built by torch's private constructor where a probe allows it: `arrowbuf._pool.torch_internals`)
    store = filled()
    for _ in range(5):
        batch = store.sample(6)["tokens"]
        lengths = batch.offsets().diff()
        padded = batch.to_padded_tensor(-1)   # its width is the recorded longest row
        assert padded.shape[:2] == (6, int(lengths.max())), (padded.shape, lengths.tolist())
        for i, n in enumerate(lengths.tolist()):
            assert torch.equal(padded[i, :n], batch.values()[int(batch.offsets()[i]):int(batch.offsets()[i + 1])])


@pytest.mark.parametrize("form", ["list", "nested", "inferred", "writer"])
def test_bfloat16_ragged_rows_given_as_torch_tensors_are_stored_bit_for_bit(form):
    # bfloat16 tensors are read as their uint16 bits: a (None,) bfloat16 field refused them as uint16,
    # and inference named no dtype.
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(k, generator=gen).to(torch.bfloat16) for k in (2, 5, 1, 3)]
    schema = {**SCHEMA, "tokens": ab.Field("bfloat16", (None,))}
    store = ab.ExperienceStore(capacity=50, schema=None if form == "inferred" else schema, seed=0)
    if form == "writer":
        writer = store.writer(2, autoreset_mode="disabled")
        for t in range(2):
            writer.add(obs=np.zeros((2, 2), np.float32), next_obs=np.zeros((2, 2), np.float32), action=np.arange(2),
                       reward=np.zeros(2, np.float32), terminated=np.zeros(2, bool), truncated=np.zeros(2, bool),
                       tokens=rows[2 * t:2 * t + 2])
        writer.flush()
    else:
        given = torch.nested.nested_tensor(rows, layout=torch.jagged) if form == "nested" else rows
        store.add_episode({**episode(0, 4), "tokens": given})
    assert store.schema.fields["tokens"] == ab.Field("bfloat16", (None,)) and len(store) == 4
    values = store.gather(np.concatenate([np.arange(*r) for r in store.live_ranges()]))["tokens"]
    assert values.dtype == torch.bfloat16   # every row held, bit for bit (lengths are distinct: order by length)
    assert [t.view(torch.int16).tolist() for t in sorted(values.unbind(), key=len)] == \
        [t.view(torch.int16).tolist() for t in sorted(rows, key=len)]


def test_bfloat16_tensor_rows_beside_rows_of_another_dtype_are_refused():
    store = ab.ExperienceStore(capacity=50, schema={**SCHEMA, "tokens": ab.Field("bfloat16", (None,))}, seed=0)
    mixed = [torch.ones(2, dtype=torch.bfloat16), np.ones(3, np.uint16), torch.ones(1, dtype=torch.bfloat16),
             torch.ones(1, dtype=torch.bfloat16)]
    with pytest.raises(SchemaError, match="field 'tokens': rows of bfloat16 tensors beside rows of other dtypes"):
        store.add_episode({**episode(0, 4), "tokens": mixed})
    assert len(store) == 0
