"""The Ray data plane: shards publish sealed blocks, readers in any process draw and gather them."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import ray

import arrowbuf as ab
from arrowbuf import RayOptions
from arrowbuf.ray.bundles import Bundle
from arrowbuf.ray.options import INDEX_SHIFT


pytestmark = pytest.mark.usefixtures("ray_session")
# Ray workers cannot import this test module by name: its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Episodes each writer of the stress test writes (a soak run: ARROWBUF_STRESS_EPISODES=2000).
#: Work is bounded by counts, never by seconds: a loaded machine gives the same verdicts.
STRESS_EPISODES = int(os.environ.get("ARROWBUF_STRESS_EPISODES", "28"))
STRESS_CAPACITY = 1_000   # two writers of STRESS_EPISODES episodes of >= 20 steps fill it more than once


def checksum(key: np.ndarray, step: np.ndarray) -> np.ndarray:
    return (key.astype(np.int64) * 7919 + step.astype(np.int64) * 104729) % 1_000_003


def keyed_episode(key: int, steps: int) -> dict:
    """obs[t] = (key, t), action = key, check = checksum(key, t): every row says which it is."""
    t = np.arange(steps + 1)
    obs = np.stack([np.full(steps + 1, key), t], axis=1).astype(np.float32)
    return {"obs": obs, "action": np.full(steps, key, np.int64), "check": checksum(np.full(steps, key), t[:-1]),
            "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
            "truncated": np.zeros(steps, bool)}


def check_rows(batch, seen: dict) -> int:
    """Raise unless every row is internally consistent and its index always names the same row."""
    key, step = batch["obs"][:, 0].numpy().astype(np.int64), batch["obs"][:, 1].numpy().astype(np.int64)
    np.testing.assert_array_equal(batch["action"].numpy(), key)
    np.testing.assert_array_equal(batch["step"].numpy(), step)
    np.testing.assert_array_equal(batch["check"].numpy(), checksum(key, step))
    np.testing.assert_array_equal(batch["next", "obs"][:, 0].numpy(), key)
    np.testing.assert_array_equal(batch["next", "obs"][:, 1].numpy(), step + 1)
    for index, episode_id, k, s in zip(batch["index"].tolist(), batch["episode_id"].tolist(), key.tolist(),
                                       step.tolist()):
        assert seen.setdefault(("index", index), (k, s)) == (k, s), "an index read two different rows"
        assert seen.setdefault(("episode", episode_id), k) == k, "an episode id read two different episodes"
    return len(key)


@ray.remote(num_cpus=0)   # writers and readers run at once, whatever the CPUs
def write_for(name: str, episodes: int, first_key: int) -> int:
    """Write ``episodes`` episodes of 20 to 60 steps into the store ``name``; how many."""
    store = ab.ExperienceStore.attach(name)
    rng = np.random.default_rng(first_key)
    with store.writer(num_envs=1, name=f"stress-{first_key}", autoreset_mode="disabled") as writer:
        for key in range(first_key, first_key + episodes):
            steps = int(rng.integers(20, 60))
            episode = keyed_episode(key, steps)
            for t in range(steps):
                writer.add(obs=episode["obs"][t:t + 1], action=episode["action"][t:t + 1],
                           check=episode["check"][t:t + 1], reward=episode["reward"][t:t + 1],
                           terminated=episode["terminated"][t:t + 1], truncated=episode["truncated"][t:t + 1],
                           next_obs=episode["obs"][t + 1:t + 2])
    return episodes


@ray.remote(num_cpus=0)
def sample_for(name: str, writers: list, min_batches: int, options: RayOptions) -> dict:
    """Sample from the store ``name`` until ``writers`` (refs, in a list: not waited for by Ray)
    are done and at least ``min_batches`` batches were read, checking every row; what was seen."""
    store = ab.ExperienceStore.attach(name, ray_options=options)
    seen: dict = {}
    rows = batches = 0
    # Between batches the reader waits a little for the writers (leaving them the CPU on a small machine).
    while batches < min_batches or len(ray.wait(writers, num_returns=len(writers), timeout=0.005)[0]) < len(writers):
        rows += check_rows(store.sample(64), seen)
        batches += 1
    for batch in store.iter_batches(256):   # an epoch over a moving store: consistent too
        rows += check_rows(batch, seen)
    return {"rows": rows, "batches": batches, "reader": store.stats()["reader"]}


def test_readers_in_two_processes_sample_consistent_rows_while_writers_evict():
    # Small blocks and a small ring: blocks are sealed, merged and evicted all the time.
    options = RayOptions(block_bytes=8 << 10, seal_latency=0.02)
    store = ab.ExperienceStore(STRESS_CAPACITY, backend="ray", num_shards=2, seed=0, ray_options=options)
    try:
        store.add_episode(keyed_episode(0, 30), env_id="seed")   # the schema, and something to sample
        store.flush()
        writers = [write_for.remote(store.name, STRESS_EPISODES, 1_000_000 * (i + 1)) for i in range(2)]
        readers = [sample_for.remote(store.name, writers, 10, options),
                   # the other reader treats every block as remote (copied), in a cache of about 4 blocks
                   sample_for.remote(store.name, writers, 10,
                                     RayOptions(block_bytes=8 << 10, seal_latency=0.02, copy_blocks=True,
                                                reader_cache_bytes=32 << 10))]
        written = ray.get(writers)
        seen = ray.get(readers)
        store.flush()
        assert written == [STRESS_EPISODES] * 2 and sum(written) * 20 > STRESS_CAPACITY   # the ring was evicted
        assert store.stats()["inserts"] > STRESS_CAPACITY and len(store) <= STRESS_CAPACITY
        for result in seen:   # each read while the writers wrote, until they were done
            assert result["batches"] >= 10 and result["rows"] >= 640
        # The copying reader read copied blocks (whether its cache had to drop one depends on
        # how the reads fell between the writes: the bound is the cache test's job).
        assert seen[1]["reader"]["copy_blocks"] and seen[1]["reader"]["fetches"] >= seen[1]["reader"]["cached_blocks"] > 0
        check_rows(store.sample(512), {})
    finally:
        store.close()


@ray.remote(num_cpus=0)
def write_and_flush(name: str, key: int) -> int:
    store = ab.ExperienceStore.attach(name)
    first = store.add_episode(keyed_episode(key, 25), env_id="w")   # sealed by the latency bound, or by flush
    with store.writer(num_envs=1, autoreset_mode="disabled") as writer:   # delivered within the latency bound, sealed by flush
        episode = keyed_episode(key + 1, 17)
        for t in range(17):
            writer.add(obs=episode["obs"][t:t + 1], action=episode["action"][t:t + 1],
                       check=episode["check"][t:t + 1], reward=episode["reward"][t:t + 1],
                       terminated=episode["terminated"][t:t + 1], truncated=episode["truncated"][t:t + 1],
                       next_obs=episode["obs"][t + 1:t + 2])
    store.flush()
    return first


@ray.remote
class Reader:
    def __init__(self, name: str) -> None:
        self.store = ab.ExperienceStore.attach(name, ray_options=RayOptions(seal_latency=30.0))

    def sample(self, n: int) -> np.ndarray:
        return self.store.sample(n)["action"].numpy()

    def epoch(self) -> list:
        rows = []
        for batch in self.store.iter_batches(64):
            rows += zip(batch["action"].tolist(), batch["step"].tolist())
        return rows


def test_an_episode_flushed_in_one_process_is_read_exactly_once_in_another(ray_stores):
    store = ray_stores.get(capacity=10_000, num_shards=2, seed=0)
    for key in range(4):
        store.add_episode(keyed_episode(key, 10 + key), env_id=f"e{key}")
    reader = Reader.remote(store.name)
    assert set(ray.get(reader.sample.remote(256)).tolist()) <= {0, 1, 2, 3}   # the reader has its blocks
    ray.get(write_and_flush.remote(store.name, 100))
    # A long seal_latency: the reader polls no manifest on its own; its epoch syncs.
    rows = ray.get(reader.epoch.remote())
    expected = [(key, t) for key in range(4) for t in range(10 + key)] + \
               [(100, t) for t in range(25)] + [(101, t) for t in range(17)]
    assert sorted(rows) == sorted(expected)   # every transition once, the new ones included
    deadline = time.monotonic() + 60   # this process sees them within about seal_latency (0.1 s); generous
    while not {100, 101} <= set(store.sample(4096)["action"].tolist()):
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.fixture
def slow_seal_store(ray_stores) -> ab.ExperienceStore:
    """An empty 2-shard store whose shards seal by latency only after 30 s: what a process
    reads before that, it reads because it wrote it."""
    return ray_stores.get(capacity=10_000, num_shards=2, seed=0, ray_options=RayOptions(seal_latency=30.0))


def test_a_process_samples_its_own_add_episode_at_once(slow_seal_store):
    store = slow_seal_store
    for key in range(6):
        store.add_episode(keyed_episode(key, 5), env_id=f"e{key}")
        assert (store.sample(512)["action"].numpy() == key).any()


def test_the_reader_cache_stays_within_its_bound_and_fetches_again():
    episode = 41 * 30   # bytes of an episode of 40 steps (30 bytes a row)
    limit = 6 * episode   # blocks of about 2 episodes: a cache of about 3
    options = RayOptions(block_bytes=episode + 1, reader_cache_bytes=limit)
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=options)
    try:
        for key in range(40):
            store.add_episode(keyed_episode(key, 40), env_id=f"e{key % 4}")
        store.flush()
        cache = store._backend._reader.cache
        seen: dict = {}
        packed = 0
        for _ in range(200):
            check_rows(store.sample(1), seen)
            # What the cached blocks hold, counted: their columns and the records of their small
            # step fields (action, check, reward, flags) that the reader packs and keeps with them.
            held = sum(a.nbytes for columns, _ in cache.entries.values() for a in columns.values()
                       if isinstance(a, np.ndarray))
            packed += sum(isinstance(k, tuple) and k[0] == "packed" for columns, _ in cache.entries.values()
                          for k in columns)
            assert held == cache.nbytes == store.stats()["reader"]["cached_bytes"] <= limit
        assert packed > 0
        reader = store.stats()["reader"]
        assert reader["blocks"] > 10   # many blocks, a cache of 3: fetched again and again
        assert reader["fetches"] > reader["blocks"]
        for batch in store.iter_batches(500):   # batches touching every block: all of them held meanwhile
            check_rows(batch, seen)
    finally:
        store.close()


def test_close_releases_every_block_of_the_object_store():
    def free() -> float:
        return ray.available_resources().get("object_store_memory", 0.0)

    time.sleep(0.5)
    before = free()
    store = ab.ExperienceStore(200_000, backend="ray", num_shards=2, seed=0)
    for key in range(200):
        store.add_episode(keyed_episode(key, 999), env_id=f"e{key}")
    store.flush()
    check_rows(store.sample(1024), {})
    deadline = time.monotonic() + 60   # the object store's figure lags: wait for the condition, generously
    while free() >= before - 4_000_000 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free() < before - 4_000_000   # the blocks are in the object store (200k rows of 30 bytes)
    store.close()
    deadline = time.monotonic() + 60
    while free() < before - 100_000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free() >= before - 100_000


def test_keys_gather_only_the_named_fields_on_ray(ray_stores):
    store = ray_stores.get(capacity=10_000, num_shards=2, seed=0)
    for key in range(4):
        store.add_episode(keyed_episode(key, 20), env_id=f"e{key}")
    batch = store.sample(32, keys=["action"])
    assert sorted(batch.keys()) == ["action", "episode_id", "index", "step"]
    batch = store.sample(32, keys=["obs", ("next", "obs")])
    np.testing.assert_array_equal(batch["next", "obs"][:, 1].numpy(), batch["step"].numpy() + 1)
    assert "action" not in batch.keys()
    epoch = list(store.iter_batches(30, keys=["check"]))
    assert sum(b.batch_size[0] for b in epoch) == 80 and sorted(epoch[0].keys()) == \
        ["check", "episode_id", "index", "step"]
    samples = store.stats()["samples"]
    with pytest.raises(ValueError, match="no field 'nope'"):
        store.sample(8, keys=["nope"])
    assert store.stats()["samples"] == samples   # nothing drawn


def test_rows_gathered_across_many_blocks_match_the_shards_own_gather(many_blocks):
    store, lengths = many_blocks
    seq = ab.ExperienceStore(50_000, backend="ray", num_shards=2, seed=0, ray_options=RayOptions(block_bytes=400),
                             sampler=ab.SequenceSampler(seq_len=4))
    try:
        for key, steps in lengths.items():
            seq.add_episode(keyed_episode(key, steps), env_id=f"e{key % 5}")
        assert store.stats()["reader"]["blocks"] > 15
        batch = store.sample(300, n_step=3, gamma=0.5, frame_stack=2)
        again = store.gather(batch["index"].numpy())   # the shards' own gather, from their arenas
        np.testing.assert_array_equal(batch["obs"][:, -1].numpy(), again["obs"].numpy())
        np.testing.assert_array_equal(batch["action"].numpy(), again["action"].numpy())
        steps_left = batch["obs"][:, -1, 1].numpy()
        assert (batch["n_steps"].numpy() <= 3).all() and (batch["next", "obs"][:, -1, 1].numpy() ==
                                                         steps_left + batch["n_steps"].numpy()).all()
        windows = seq.sample(64)
        assert windows["obs"].shape == (64, 4, 2)
        np.testing.assert_array_equal(np.diff(windows["obs"][:, :, 1].numpy(), axis=1), 1)
        assert (windows["obs"][:, :, 0].numpy() == windows["obs"][:, :1, 0].numpy()).all()
        assert set((batch["index"].numpy() >> INDEX_SHIFT).tolist()) == {0, 1}
    finally:
        seq.close()


def test_samples_carry_the_advantages_compute_gae_wrote_after_the_blocks_were_sealed():
    store = ab.ExperienceStore(2_000, backend="ray", num_shards=1, seed=0)
    try:
        for key in range(6):
            episode = keyed_episode(key, 10 + key)
            episode["value"] = np.linspace(0, 1, 10 + key, dtype=np.float32)
            store.add_episode(episode, env_id=f"e{key}")
        assert "advantage" not in store.sample(8).keys()   # this reader holds blocks without it
        store.compute_gae(0.9, 0.8, bootstrap_value=lambda obs: obs["obs"][:, 1] * 0.5)
        batch = store.sample(256)
        again = store.gather(batch["index"].numpy())   # the shards' arenas
        np.testing.assert_array_equal(batch["advantage"].numpy(), again["advantage"].numpy())
        np.testing.assert_array_equal(batch["value_target"].numpy(), again["value_target"].numpy())
        assert np.abs(batch["advantage"].numpy()).sum() > 0
    finally:
        store.close()


@pytest.fixture(scope="module")
def many_blocks() -> tuple[ab.ExperienceStore, dict[int, int]]:
    """A 2-shard store of 30 keyed episodes (key -> steps) sealed into more than 15 small blocks,
    shared by the tests that only read it."""
    store = ab.ExperienceStore(50_000, backend="ray", num_shards=2, seed=1, ray_options=RayOptions(block_bytes=400))
    lengths = {key: 10 + key % 7 for key in range(30)}
    for key, steps in lengths.items():
        store.add_episode(keyed_episode(key, steps), env_id=f"e{key % 5}")
    store.flush()
    assert store.stats()["reader"]["blocks"] > 15
    yield store, lengths
    store.close()


def assert_keys_drawn_by_length(keys: list[np.ndarray], lengths: dict[int, int]) -> None:
    """The episode keys of drawn items (first items of batches) occur in proportion to the
    episodes' lengths, as uniform draws over transitions do (chi-square)."""
    from scipy.stats import chisquare

    counts = np.bincount(np.concatenate(keys), minlength=len(lengths))
    expected = np.array([lengths[k] for k in range(len(lengths))], np.float64)
    assert chisquare(counts, expected / expected.sum() * counts.sum()).pvalue > 1e-4, counts.tolist()


def test_a_batch_drawn_across_many_blocks_keeps_the_drawn_order_so_its_first_items_are_uniform_too(many_blocks):
    # Items are gathered block by block; were they left in block order, the first
    # items of a batch would always come from the oldest blocks.
    store, lengths = many_blocks
    first = []
    for _ in range(1500):
        batch = store.sample(64)
        check_rows(batch, {})
        first.append(batch["obs"][:4, 0].numpy().astype(np.int64))
    assert not (np.diff(batch["index"].numpy()) >= 0).all()
    assert_keys_drawn_by_length(first, lengths)


def test_batches_drawn_by_several_shards_and_epoch_minibatches_mix_the_shards_items():
    # Prioritized draws are made by each shard, epochs split their chunks by shard:
    # were the parts left one after the other, a slice of a batch would hold one shard.
    per = ab.ExperienceStore(10_000, backend="ray", num_shards=2, seed=2, sampler=ab.PrioritizedSampler(),
                             ray_options=RayOptions(block_bytes=400))
    try:
        for key in range(20):
            per.add_episode(keyed_episode(key, 12), env_id=f"e{key % 4}")
        per.flush()
        mixed = 0
        for _ in range(100):
            batch = per.sample(64)
            check_rows(batch, {})
            mixed += len(set((batch["index"][:8].numpy() >> INDEX_SHIFT).tolist())) == 2
        assert mixed > 60
        for minibatch in per.iter_batches(64, shuffle=True):
            check_rows(minibatch, {})
            shard = minibatch["index"].numpy() >> INDEX_SHIFT
            assert (np.diff(shard) != 0).sum() > 2   # shards interleaved, as the shuffled chunk drew them
        ordered = np.concatenate([b["index"].numpy() for b in per.iter_batches(64, shuffle=False)])
        assert (np.diff(ordered) > 0).all()        # unshuffled: shard 0's indices, then shard 1's, ascending
    finally:
        per.close()


def test_sample_iter_draws_batches_together_yet_each_is_a_uniform_draw_in_drawn_order(many_blocks):
    # sample_iter stages several batches per draw: each must still hold its own items
    # (no two batches of a draw alike), in drawn order (first items uniform), and a
    # batch kept must not be overwritten by the next ones.
    store, lengths = many_blocks
    iterator = store.sample_iter(64, batches_per_request=4)
    first, kept, seen, previous = [], [], {}, None
    for k in range(1200):
        batch = next(iterator)
        check_rows(batch, seen)
        first.append(batch["obs"][:4, 0].numpy().astype(np.int64))
        index = batch["index"].numpy().copy()
        assert previous is None or not np.array_equal(index, previous)
        previous = index
        if k % 97 == 0:
            kept.append((batch, index))
    for batch, index in kept:
        np.testing.assert_array_equal(batch["index"].numpy(), index)
        check_rows(batch, seen)
    assert_keys_drawn_by_length(first, lengths)


def test_an_iterator_samples_its_own_add_episode_at_once(slow_seal_store):
    store = slow_seal_store
    store.add_episode(keyed_episode(0, 5), env_id="e0")
    iterator = store.sample_iter(256, batches_per_request=4)
    samples = store.stats()["samples"]
    assert set(next(iterator)["action"].tolist()) == {0}
    assert store.stats()["samples"] == samples + 256   # counted when returned, not when drawn ahead
    store.add_episode(keyed_episode(1, 500), env_id="e1")   # 100 times the first: any batch holds it
    assert 1 in set(next(iterator)["action"].tolist())


def test_a_ray_store_stores_a_list_of_thousands_of_short_episodes_as_a_local_store_does(ray_stores, monkeypatch):
    """The rollout's end of a vector env on Ray: one request a shard, one array a field on the wire
    (`arrowbuf.ray.bundles`), one run of each shard's ring; the same episodes, values and order as
    a local store's."""
    shipped = []
    reduce = Bundle.__reduce__
    monkeypatch.setattr(Bundle, "__reduce__", lambda self: shipped.append(len(self)) or reduce(self))
    lengths = np.random.default_rng(1).integers(1, 10, 1_200)
    batch = [keyed_episode(k, n) for k, n in enumerate(lengths.tolist())]
    env_ids = [f"w/{k % 64}" for k in range(len(batch))]
    local = ab.ExperienceStore(capacity=10_000, seed=0)
    remote = ray_stores.get(capacity=10_000, num_shards=2, seed=0)
    local_ids = local.add_episodes(batch, env_ids=env_ids)
    ids = remote.add_episodes(batch, env_ids=env_ids)
    assert len(shipped) == 2 and sum(shipped) == len(batch), shipped   # a bundle a shard
    assert len(set(ids)) == len(batch) and len(remote) == len(local) == int(lengths.sum())
    table = remote.episodes().to_pydict()
    by_id = dict(zip(ids, range(len(batch))))
    for shard in (0, 1):   # each shard holds its episodes in the order sent, oldest first
        sent = [by_id[i] for i in table["episode_id"] if i % 2 == shard]
        assert sent and sent == sorted(sent)
    assert [table["length"][table["episode_id"].index(i)] for i in ids] == lengths.tolist()
    assert [table["env_id"][table["episode_id"].index(i)] for i in ids] == env_ids
    for k in (0, 1, 599, 1_199):
        fields = ["obs", "action", "check", "reward", "terminated", "truncated"]
        assert local.episode(local_ids[k]).select(fields).equals(remote.episode(ids[k]).select(fields))
    seen = {}
    assert check_rows(remote.sample(512), seen) == 512   # every row what its episode wrote
