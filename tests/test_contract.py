"""One contract, two backends: every test here runs on a local store and on a Ray store,
and on a local store whose arena is torch tensors on the CPU device ("local-torch":
`arrowbuf.arena`, the code a ``storage_device="cuda"`` store runs).

Ray stores are started once per module (a few seconds each on 2 cores) and
cleared before each test; local ones are made per test.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab

from support.episodes import EPISODE_SCHEMA, make_episode


BACKENDS = ["local", "local-torch", "ray"]


def build(backend: str, **kwargs) -> ab.ExperienceStore:
    schema = kwargs.pop("schema", EPISODE_SCHEMA)
    if backend == "ray":
        return ab.ExperienceStore(2_000, backend="ray", num_shards=kwargs.pop("num_shards", 2), seed=0,
                                  schema=schema, **kwargs)
    if backend == "local-torch":
        kwargs.pop("num_shards", None)
        return ab.ExperienceStore(2_000, seed=0, schema=schema, storage_device="cpu", **kwargs)
    return ab.ExperienceStore(2_000, seed=0, schema=schema, **kwargs)


class Stores:
    """Ray stores of this module, started at first use and closed at the end."""

    def __init__(self) -> None:
        self.started: dict[str, ab.ExperienceStore] = {}

    def get(self, backend: str, kind: str, **kwargs) -> ab.ExperienceStore:
        if backend != "ray":
            return build(backend, **kwargs)
        if kind not in self.started:
            self.started[kind] = build("ray", **kwargs)
        store = self.started[kind]
        store.clear()
        return store


@pytest.fixture(scope="module")
def stores(request):
    kept = Stores()
    yield kept
    for store in kept.started.values():
        store.close()


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture
def store(backend, stores):
    return stores.get(backend, "uniform")


def add_tagged(store: ab.ExperienceStore, tags: range, steps: int = 6) -> list[int]:
    return [store.add_episode(make_episode(tag, steps), env_id=f"env-{tag % 3}") for tag in tags]


def test_add_episode_returns_the_id_under_which_the_episode_is_read_back(store):
    ids = add_tagged(store, range(5))
    assert len(set(ids)) == 5 and all(isinstance(i, int) for i in ids)
    for tag, episode_id in enumerate(ids):
        rows = store.episode(episode_id)
        np.testing.assert_array_equal(rows.column("action").to_numpy()[:6], tag * 1000 + np.arange(6))
    assert sorted(store.episodes().column("episode_id").to_pylist()) == sorted(ids)
    with pytest.raises(KeyError, match="not in the store"):
        store.episode(max(ids) + 1000)


def test_len_after_flush_counts_every_transition_and_episode(store):
    add_tagged(store, range(4), steps=5)
    store.flush()
    assert (len(store), store.num_episodes) == (20, 4)
    assert "transitions=20" in repr(store)


def test_samples_have_the_same_keys_and_shapes_on_both_backends(store):
    add_tagged(store, range(6))
    batch = store.sample(32)
    assert batch.batch_size == (32,)
    assert set(batch.keys(include_nested=True, leaves_only=True)) >= {
        "obs", ("next", "obs"), "action", "reward", "terminated", "truncated", "index", "episode_id", "step"}
    assert batch["obs"].shape == (32, 2) and batch["next", "obs"].shape == (32, 2)
    np.testing.assert_array_equal(batch["next", "obs"][:, 1].numpy(), batch["obs"][:, 1].numpy() + 1)


def test_gather_by_index_returns_the_sampled_transitions_in_order(store):
    add_tagged(store, range(6))
    batch = store.sample(16)
    index = batch["index"].numpy()[::-1].copy()
    again = store.gather(index)
    np.testing.assert_array_equal(again["obs"].numpy(), batch["obs"].numpy()[::-1])
    again["obs"] += 1   # writable on both backends
    with pytest.raises(KeyError, match="not live"):
        store.gather(np.array([int(index.max()) + 10_000]))


def test_live_ranges_and_episode_spans_cover_every_transition(store):
    add_tagged(store, range(5), steps=4)
    ranges = store.live_ranges()
    assert len(ranges) == store.num_shards and sum(b - a for a, b in ranges) == 20
    shard, first, length = store.episode_spans()
    assert length.sum() == 20 and len(first) == 5
    index = np.concatenate([np.arange(a, b) for a, b in ranges])
    assert store.gather(index).batch_size == (20,)


def test_iter_batches_walks_every_transition_once_per_epoch(store):
    add_tagged(store, range(7), steps=5)
    seen = np.concatenate([b["action"].numpy() for b in store.iter_batches(8, shuffle=True, epochs=2)])
    assert sorted(seen.tolist()) == sorted(2 * [tag * 1000 + t for tag in range(7) for t in range(5)])


def test_to_arrow_holds_every_row_and_clear_empties_the_store(store):
    add_tagged(store, range(3), steps=4)
    table = store.to_arrow()
    assert isinstance(table, pa.Table) and table.num_rows == 3 * 5   # final observations included
    store.clear()
    store.flush()
    assert (len(store), store.num_episodes, store.episodes().num_rows) == (0, 0, 0)
    with pytest.raises(ab.EmptyStoreError):
        store.sample(4)


def test_named_writers_are_listed_unique_and_deliver_on_close(store):
    with store.writer(num_envs=2, name="runner", autoreset_mode="disabled") as writer:
        assert "runner" in store.writers
        with pytest.raises(ValueError, match="already open"):
            store.writer(num_envs=1, name="runner")
        obs = np.zeros((2, 2))
        for t in range(3):
            writer.add(obs=obs + t, action=np.zeros(2, np.int64), reward=np.ones(2), terminated=np.zeros(2, bool),
                       truncated=np.zeros(2, bool), next_obs=obs + t + 1)
    store.flush()
    assert (len(store), store.num_episodes) == (6, 2)   # close() cut and stored both open episodes


def test_update_priorities_changes_what_is_sampled(backend, stores):
    store = stores.get(backend, "prioritized", sampler=ab.PrioritizedSampler(alpha=1.0, beta=1.0))
    add_tagged(store, range(6))
    batch = store.sample(64)
    assert float(batch["weight"].max()) == pytest.approx(1.0)
    first = batch["index"].numpy()[:1]
    everything = np.concatenate([np.arange(a, b) for a, b in store.live_ranges()])
    priority = np.where(everything == first[0], 1e6, 1e-6)
    assert store.update_priorities(everything, priority) == len(everything)
    assert (store.sample(64)["index"].numpy() == first[0]).mean() > 0.9
    with pytest.raises(ValueError, match="priority must be finite"):
        store.update_priorities(first, [float("nan")])


def test_a_rate_limiter_refuses_and_lets_a_waiting_sample_through_an_insert(backend, stores):
    # On Ray the limiter applies per shard: one shard keeps the count global here.
    store = stores.get(backend, "limited", rate_limiter=ab.MinSize(10), num_shards=1)
    store.add_episode(make_episode(0, 5))
    with pytest.raises(ab.RateLimited):
        store.sample(4)
    result = {}
    waiting = threading.Thread(target=lambda: result.update(batch=store.sample(4, timeout=60)))
    waiting.start()
    store.add_episode(make_episode(1, 5))   # gets through while the sample waits
    waiting.join(90)
    assert result["batch"].batch_size == (4,)


def test_a_pinned_env_sends_its_episodes_to_its_shard(store):
    last = store.num_shards - 1
    store.pin_env("pinned", last)
    ids = [store.add_episode(make_episode(tag, 3), env_id="pinned") for tag in range(3)]
    assert all(i % store.num_shards == last for i in ids)   # a shard's ids are shard + k * num_shards
    with pytest.raises(ValueError, match="shard must be an int in"):
        store.pin_env("other", store.num_shards)


# -- compute_gae ------------------------------------------------------------------------

GAE_SCHEMA = ab.Schema({**EPISODE_SCHEMA.fields, "value": ab.Field("float32")})


def gae_episodes() -> list[tuple[dict, str]]:
    """Episodes of every ending (terminated, truncated, cut without a final observation), with values."""
    episodes = []
    for tag, (steps, has_final, terminated, truncated) in enumerate(
            [(5, True, True, False), (4, True, False, True), (6, False, False, False), (3, True, False, False),
             (7, True, False, True), (2, True, True, False)]):
        episode = make_episode(tag, steps, has_final, terminated, truncated)
        episode["value"] = (tag * 0.5 + np.arange(steps) * 0.25).astype(np.float32)
        episodes.append((episode, f"env-{tag % 3}"))
    return episodes


def final_value(final_obs):
    """A value function of the final observation: ``2 * tag + step``, so a value sent to the
    wrong episode shows."""
    return final_obs["obs"][:, 0] * 2.0 + final_obs["obs"][:, 1]


def advantages_by_episode(store: ab.ExperienceStore) -> dict[int, list[float]]:
    result = {}
    for episode_id in store.episodes().column("episode_id").to_pylist():
        rows = store.episode(episode_id)
        result[int(rows.column("obs").to_numpy(zero_copy_only=False)[0][0])] = rows.column("advantage").to_pylist()
    return result


def test_compute_gae_gives_a_local_stores_advantages_and_calls_the_value_function_here(backend, stores):
    store = stores.get(backend, "gae", schema=GAE_SCHEMA)
    reference = ab.ExperienceStore(2_000, seed=0, schema=GAE_SCHEMA)
    for episode, env_id in gae_episodes():
        store.add_episode(episode, env_id=env_id)
        reference.add_episode(episode, env_id=env_id)
    calls = []

    def value_fn(final_obs):
        calls.append(final_obs.batch_size[0])
        return final_value(final_obs)

    assert store.compute_gae(0.9, 0.8, bootstrap_value=value_fn) == reference.compute_gae(
        0.9, 0.8, bootstrap_value=final_value) == 26
    assert calls == [3]                        # once, in this process, with every cut episode's final observation
    expected, got = advantages_by_episode(reference), advantages_by_episode(store)
    assert got.keys() == expected.keys()
    for tag in expected:
        np.testing.assert_allclose(got[tag], expected[tag], rtol=1e-6)
    assert store.schema.fields["advantage"].derived and "value_target" in store.sample(8).keys()
    episode, env_id = gae_episodes()[0]
    store.add_episode(episode, env_id=env_id)  # writes without the derived fields still go through
    store.flush()
    assert store.num_episodes == 7


def test_compute_gae_refuses_before_any_shard_writes(backend, stores):
    store = stores.get(backend, "gae-refused", schema=GAE_SCHEMA)   # a store whose schema has no derived fields
    for episode, env_id in gae_episodes():
        store.add_episode(episode, env_id=env_id)
    with pytest.raises(ValueError, match="pass bootstrap_value=fn"):
        store.compute_gae()
    with pytest.raises(ValueError, match="expected 3 finite values"):
        store.compute_gae(bootstrap_value=lambda obs: np.zeros(2))
    with pytest.raises(ValueError, match="value_key 'nope' is not a field"):
        store.compute_gae(value_key="nope")
    assert "advantage" not in store.to_arrow().column_names


# -- batched and pinned adds --------------------------------------------------------------


def stacked_episodes(tags: list[int], steps: int) -> dict[str, np.ndarray]:
    """`make_episode` of each tag, stacked on a leading axis: [E, T(+1), ...]."""
    episodes = [make_episode(tag, steps, terminated=False, truncated=True) for tag in tags]
    return {name: np.stack([episode[name] for episode in episodes]) for name in episodes[0]}


def test_add_episodes_stores_a_padded_batch_as_its_episodes_in_order(store):
    batch = stacked_episodes([10, 11, 12, 13], steps=6)
    lengths = np.array([6, 2, 4, 1])
    batch["truncated"][:] = np.arange(6)[None, :] == (lengths - 1)[:, None]   # flags at each episode's end
    ids = store.add_episodes(batch, lengths=lengths, env_ids=[f"env-{k}" for k in range(4)],
                             metadata=[{"k": k} for k in range(4)])
    assert len(ids) == 4 and len(set(ids)) == 4
    for tag, length, episode_id in zip([10, 11, 12, 13], lengths, ids):
        rows = store.episode(episode_id)
        assert rows.num_rows == length + 1                       # the final observation included
        np.testing.assert_array_equal(rows.column("action").to_numpy()[:length], tag * 1000 + np.arange(length))
        assert rows.column("truncated").to_pylist()[length - 1]
    store.flush()
    table = store.episodes()
    assert (len(store), store.num_episodes) == (13, 4)
    assert sorted(table.column("env_id").to_pylist()) == [f"env-{k}" for k in range(4)]
    assert sorted(table.column("truncated").to_pylist()) == [True] * 4


def test_add_episodes_takes_a_tensordict_of_a_vector_env_rollout(store):
    import torch
    from tensordict import TensorDict

    batch = stacked_episodes([7, 8, 9], steps=4)
    rollout = TensorDict({name: torch.from_numpy(array) for name, array in batch.items()}, batch_size=[3])
    ids = store.add_episodes(rollout, env_ids="vec-0")
    sampled = store.gather(np.concatenate([np.arange(a, b) for a, b in store.live_ranges()]))
    assert sorted(set(sampled["obs"][:, 0].tolist())) == [7.0, 8.0, 9.0] and len(ids) == 3
    np.testing.assert_array_equal(sampled["next", "obs"][:, 1].numpy(), sampled["obs"][:, 1].numpy() + 1)


@pytest.mark.parametrize("change, message", [
    (lambda b: b.update(action=b["action"].astype(np.float32)), "action"),
    (lambda b: b.update(reward=b["reward"][:3]), "different numbers of episodes"),
    (lambda b: b.pop("terminated"), "missing"),
])
def test_add_episodes_with_one_bad_field_stores_nothing(store, change, message):
    batch = stacked_episodes([1, 2, 3, 4], steps=3)
    change(batch)
    with pytest.raises(ab.SchemaError, match=message):
        store.add_episodes(batch)
    batch = stacked_episodes([1, 2, 3, 4], steps=3)
    for kwargs, message in [({"lengths": [3, 3, 4, 3]}, r"lengths must be None or 4 ints in \[1, 3\]"),
                            ({"env_ids": ["a", "b"]}, "env_ids must be None, one env id, or 4"),
                            ({"metadata": {"a": 1}}, "metadata must be None or 4 mappings"),
                            ({"shard": store.num_shards}, "shard must be an int in")]:
        with pytest.raises(ValueError, match=message):
            store.add_episodes(batch, **kwargs)
    store.flush()
    assert (len(store), store.num_episodes) == (0, 0)


def test_add_episodes_into_a_full_fixed_store_stores_every_episode_that_fits_and_says_how_many_it_refused(
        backend, stores):
    # The local backend stopped at the first refused episode, a Ray shard went on with
    # the rest: one rule now, a Ray shard's.
    store = stores.get(backend, "fixed", mode="fixed")
    rows = store.capacity // store.num_shards              # of the one shard written to
    quarter, half = rows // 4 - 1, rows // 2 - 1           # steps: episodes of rows/4 and rows/2 rows
    batch = stacked_episodes([1, 2, 3, 4, 5], steps=half)
    lengths = np.array([quarter, quarter, quarter, half, 1])
    with pytest.raises(ab.CapacityError, match=r"refused 1 of the 5 episodes of this write"):
        store.add_episodes(batch, lengths=lengths, shard=0)
    store.flush()
    assert (len(store), store.num_episodes) == (3 * quarter + 1, 4)   # the 1-step episode after it fits


def test_a_sample_right_after_add_episodes_draws_from_the_new_episodes(store):
    # On Ray add_episodes did not mark its shards as written: a sample soon after it
    # drew from the reader's older views only, where `add_episode` reads its own writes.
    store.add_episodes(stacked_episodes([1], steps=3))
    store.sample(8)   # the reader's views are current now
    store.add_episodes(stacked_episodes([2], steps=3))
    tags = set(store.sample(2_000)["obs"][:, 0].tolist())
    assert tags == {1.0, 2.0}


def test_an_episode_pinned_to_a_shard_is_stored_there(store):
    last = store.num_shards - 1
    ids = [store.add_episode(make_episode(tag, 3), env_id="env-0", shard=last) for tag in range(2)]
    ids += store.add_episodes(stacked_episodes([5, 6], steps=2), env_ids="env-0", shard=last)
    assert all(i % store.num_shards == last for i in ids)   # a shard's ids are shard + k * num_shards
    with pytest.raises(ValueError, match=r"shard must be an int in \[0, %d\) or None, got %d" % (
            store.num_shards, store.num_shards)):
        store.add_episode(make_episode(9, 3), shard=store.num_shards)
    store.flush()
    assert store.num_episodes == 4
