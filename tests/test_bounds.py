"""Bounded resources: arenas and batches that cannot fit, long look-aheads, priority
underflow and lossy casts are refused (or made harmless) before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf import _bounds
from arrowbuf.table import EpisodeTable

W1 = ab.Schema({"obs": ab.Field("float32", (17,), True), "action": ab.Field("float32", (6,)),
                "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")})


def w1_episode(steps: int, tag: float = 0.0) -> dict:
    t = np.arange(steps + 1, dtype=np.float32)
    return {"obs": np.repeat(t[:, None] + tag, 17, axis=1), "action": np.zeros((steps, 6), np.float32),
            "reward": t[:-1] + 1, "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool)}


def snapshot(store: ab.ExperienceStore) -> tuple:
    """Everything a failed call must leave as it was."""
    episodes = store.episodes().drop_columns(["inserted_at"]).to_pylist() if store.num_episodes else []
    stats = store.stats()
    return len(store), store.num_episodes, store.schema, stats["inserts"], stats["samples"], episodes


# -- the arena ----------------------------------------------------------------------------------


def test_a_capacity_beyond_memory_is_refused_at_the_first_write_before_allocating():
    store = ab.ExperienceStore(capacity=10**12, seed=0)
    before = snapshot(store)
    with pytest.raises(ab.ResourceError) as caught:
        store.add_episode(w1_episode(5))
    message = str(caught.value)
    assert "capacity=1,000,000,000,000 rows of" in message and "GiB" in message and "available" in message
    assert "use capacity <=" in message
    assert isinstance(caught.value, ab.CapacityError)
    assert snapshot(store) == before and store.schema is None


def test_a_capacity_beyond_memory_with_an_explicit_schema_is_refused_at_construction():
    with pytest.raises(ab.ResourceError, match=r"capacity=10,000,000,000,000 rows of 126 bytes \(98 of fields"):
        ab.ExperienceStore(capacity=10**13, schema=W1)


def test_the_arena_check_names_the_bytes_needed_and_available(monkeypatch):
    monkeypatch.setattr(_bounds, "available_memory", lambda: 1_000_000)
    row = W1.field_bytes + _bounds.ROW_OVERHEAD
    with pytest.raises(ab.ResourceError, match=rf"use capacity <= {1_000_000 // row:,}"):
        ab.ExperienceStore(capacity=1_000_000 // row + 1, schema=W1)
    store = ab.ExperienceStore(capacity=1_000_000 // row, schema=W1)   # the largest that fits is accepted
    assert store.schema == W1


def test_memory_is_not_checked_where_the_platform_does_not_say(monkeypatch):
    monkeypatch.setattr(_bounds, "available_memory", lambda: None)
    _bounds.check_arena(W1, 10**12)   # no error of ours: numpy's own MemoryError is all there is


def test_available_memory_reads_a_positive_number_of_bytes_on_linux():
    available = _bounds.available_memory()
    assert available is not None and 0 < available < 2**60


# -- batches ------------------------------------------------------------------------------------


def filled_store(sampler=None, capacity: int = 1_000, seed: int = 0) -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=capacity, seed=seed, sampler=sampler, schema=W1)
    for k, steps in enumerate((5, 9, 3)):
        store.add_episode(w1_episode(steps, tag=100 * k))
    return store


@pytest.mark.parametrize("sampler", [None, ab.PrioritizedSampler(), ab.SequenceSampler(4), ab.EpisodeSampler()],
                         ids=["uniform", "prioritized", "sequence", "episode"])
def test_a_batch_that_cannot_be_allocated_is_refused_before_the_generator_moves(sampler):
    store = filled_store(sampler)
    before = snapshot(store)
    with pytest.raises(ab.ResourceError, match=r"batch_size=2,147,483,648 needs .* GiB .* available"):
        store.sample(2**31)
    assert snapshot(store) == before
    twin = filled_store(type(sampler)(**sampler.config()) if sampler is not None else None)
    assert store.sample(8)["index"].tolist() == twin.sample(8)["index"].tolist(), "the generator did not move"


def test_a_frame_stack_too_large_to_gather_is_refused_before_anything_is_drawn():
    store = filled_store()
    before = snapshot(store)
    with pytest.raises(ab.ResourceError, match="frame_stack=1000000000"):
        store.sample(64, frame_stack=10**9)
    assert snapshot(store) == before


def test_sampling_with_replacement_beyond_the_store_size_stays_legal():
    store = filled_store()
    batch = store.sample(20 * len(store))
    assert batch.batch_size == (20 * len(store),)


def test_the_batch_bound_counts_sequences_episodes_and_frames():
    table = EpisodeTable(capacity=100)
    for length in (5, 9, 3):
        table.append(first_row=0, num_rows=length + 1, length=length, has_final=True, terminated=True,
                     truncated=False, ret=0.0, env_id="e")
    plain = _bounds.batch_bytes(W1, 10)
    assert plain == 10 * (W1.field_bytes + W1.observation_bytes + 2 * 0 + _bounds.FRAME_OVERHEAD
                          + _bounds.DRAW_OVERHEAD)
    assert _bounds.batch_bytes(W1, 10, frame_stack=4) - plain == 10 * 3 * (2 * 17 * 4 + _bounds.FRAME_OVERHEAD)
    assert _bounds.draw_steps(ab.SequenceSampler(7), table) == 7
    assert _bounds.draw_steps(ab.EpisodeSampler(), table) == 9
    assert _bounds.draw_steps(ab.UniformSampler(), table) == 1


# -- look-aheads --------------------------------------------------------------------------------


def test_an_n_step_far_beyond_every_episode_gives_the_same_batch_as_the_longest_episode():
    huge = filled_store(capacity=10**6, seed=3)
    exact = filled_store(capacity=10**6, seed=3)
    longest = max(huge.episodes().column("length").to_pylist())
    assert longest == 9
    a = huge.sample(64, n_step=10**6, gamma=0.9)   # used to allocate [64, 10**6] windows
    b = exact.sample(64, n_step=longest, gamma=0.9)
    for key in ("index", "reward", "discount", "n_steps", "terminated", ("next", "obs")):
        assert (a[key] == b[key]).all(), key


def test_a_frame_stack_longer_than_every_episode_repeats_the_first_frame():
    store = filled_store()
    batch = store.sample(16, frame_stack=12)
    first = batch["obs"][:, 0, 0]
    tags = batch["obs"][:, -1, 0] - batch["step"].float()
    assert (first == tags).all(), "frames before the episode start repeat its first frame"


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 30)),
                              st.tuples(st.just("evict"), st.integers(1, 4)),
                              st.tuples(st.just("clear"), st.just(0))), max_size=60))
def test_the_episode_table_knows_its_longest_live_episode(ops):
    table = EpisodeTable(capacity=1000)
    for op, value in ops:
        if op == "add":
            table.append(first_row=0, num_rows=value + 1, length=value, has_final=True, terminated=False,
                         truncated=False, ret=0.0, env_id="e")
        elif op == "evict":
            table.pop_oldest(min(value, len(table)))
        else:
            table.clear()
        lengths = table.col("length")
        assert table.longest == (int(lengths.max()) if len(lengths) else 0)
    restored = EpisodeTable(capacity=1000)
    restored.load_state_dict(table.state_dict())
    assert restored.longest == table.longest


# -- priority underflow (D7) --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(alpha=st.floats(0, 200), beta=st.floats(0, 1),
       priorities=st.lists(st.one_of(st.just(0.0), st.floats(0, 1e-3), st.floats(0, 10)), min_size=1, max_size=17),
       seed=st.integers(0, 2**16))
def test_priorities_that_underflow_to_zero_never_break_prioritized_sampling(alpha, beta, priorities, seed):
    store = ab.ExperienceStore(capacity=40, seed=seed, sampler=ab.PrioritizedSampler(alpha=alpha, beta=beta),
                               schema=W1)
    store.add_episode(w1_episode(17))
    index = np.arange(len(priorities))
    store.update_priorities(index, np.array(priorities))
    batch = store.sample(64)
    weight = batch["weight"].numpy()
    assert np.isfinite(weight).all() and (weight > 0).all() and (weight <= 1).all()
    assert ((batch["index"] >= 0) & (batch["index"] < 17)).all()
    leaves = store.sampler.tree.leaves[:17]
    assert (leaves > 0).all(), "every live transition stays drawable"


def test_all_zero_priorities_with_a_huge_alpha_sample_uniformly():
    store = ab.ExperienceStore(capacity=400, seed=0, sampler=ab.PrioritizedSampler(alpha=60), schema=W1)
    store.add_episode(w1_episode(100))
    store.update_priorities(np.arange(100), np.zeros(100))   # (0 + 1e-6) ** 60 underflows to 0
    counts = np.bincount(store.sample(20_000)["index"].numpy(), minlength=100)
    assert counts.min() > 100 and counts.max() < 300   # ~200 each: uniform among equal (clamped) leaves


def test_priorities_above_the_underflow_keep_their_proportions():
    store = ab.ExperienceStore(capacity=400, seed=0, sampler=ab.PrioritizedSampler(alpha=60), schema=W1)
    store.add_episode(w1_episode(100))
    store.update_priorities(np.arange(100), np.where(np.arange(100) < 50, 1e-3, 0.0))
    assert (store.sample(2_000)["index"] < 50).all(), "1e-180 outweighs the clamped 2e-308 of zero priorities"


# -- lossy casts (D8) ---------------------------------------------------------------------------


FLOAT_SCHEMA = ab.Schema({"obs": ab.Field("float64", (), True), "action": ab.Field("float64"),
                          "terminated": ab.Field("bool")})


def float_episode(action: np.ndarray) -> dict:
    steps = len(action)
    return {"obs": np.zeros(steps + 1), "action": action, "terminated": np.zeros(steps, bool)}


def test_int64_values_beyond_2_53_are_refused_by_a_float64_field():
    store = ab.ExperienceStore(capacity=50, seed=0, schema=FLOAT_SCHEMA)
    before = snapshot(store)
    with pytest.raises(ab.SchemaError, match=r"'action': int64 value 9007199254740993 has no exact float64 .*2\*\*53"):
        store.add_episode(float_episode(np.array([1, 2**53 + 1], np.int64)))
    with pytest.raises(ab.SchemaError, match=r"int64 value -9007199254740993"):
        store.add_episode(float_episode(np.array([-(2**53) - 1, 0], np.int64)))
    assert snapshot(store) == before


def test_int64_values_up_to_2_53_are_stored_exactly_in_float64():
    store = ab.ExperienceStore(capacity=50, seed=0, schema=FLOAT_SCHEMA)
    store.add_episode(float_episode(np.array([2**53, -(2**53), 7], np.int64)))
    assert store.episode(0).column("action").to_pylist() == [2.0**53, -(2.0**53), 7.0, 0.0]


def test_a_writer_refuses_a_lossy_step_and_records_nothing():
    schema = ab.Schema({"obs": ab.Field("float64", (), True), "action": ab.Field("float64"),
                        "reward": ab.Field("float64"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")})
    store = ab.ExperienceStore(capacity=50, seed=0, schema=schema)
    writer = store.writer(num_envs=2)
    with pytest.raises(ab.SchemaError, match="'action': int64 value 9007199254740993"):
        writer.add(obs=np.zeros(2), action=np.array([0, 2**53 + 1], np.int64), reward=np.zeros(2),
                   terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=np.ones(2))
    assert writer.open_steps.tolist() == [0, 0] and store.num_episodes == 0


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6))
def test_an_int64_to_float64_write_is_exact_or_refused(values):
    store = ab.ExperienceStore(capacity=50, seed=0, schema=FLOAT_SCHEMA)
    action = np.array(values, np.int64)
    try:
        store.add_episode(float_episode(action))
    except ab.SchemaError:
        assert np.abs(action.astype(object)).max() > 2**53
        assert store.num_episodes == 0
        return
    stored = store.episode(0).column("action").to_numpy()[:len(values)]
    assert [int(v) for v in stored] == values
