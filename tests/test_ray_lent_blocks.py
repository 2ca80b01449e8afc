"""Lent blocks: a large episode written in the process that started the shards is put once,
and its shard seals that very object as the episode's block (`arrowbuf.ray.blocks`)."""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
import ray

import arrowbuf as ab
from arrowbuf import RayOptions
from arrowbuf.episode_read import read_episode
from arrowbuf.ray.blocks import block_columns
from arrowbuf.ray.options import NAMESPACE
from arrowbuf.ray.sink import RaySink

pytestmark = pytest.mark.usefixtures("ray_session")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Rows of `keyed_episode` take 30 bytes: an episode of 40 steps (41 rows, 1,230 bytes)
#: fills more than an eighth of a block, one of 5 steps (180 bytes) less.
OPTIONS = RayOptions(block_bytes=8_000)
QUICK_SEALS = RayOptions(block_bytes=8_000, seal_latency=0.05)   # open episodes sealed within 50 ms


def keyed_episode(key: int, steps: int) -> dict:
    """obs[t] = (key, t), action = key + t: every row says which it is."""
    t = np.arange(steps + 1)
    return {"obs": np.stack([np.full(steps + 1, key), t], axis=1).astype(np.float32),
            "action": key + t[:-1].astype(np.int64), "check": np.full(steps, key * 3, np.int64),
            "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
            "truncated": np.zeros(steps, bool)}


@pytest.fixture
def lent_refs(monkeypatch) -> list:
    """The ObjectRefs this process's sinks lend to the shards (a spy on `RaySink._outgoing`)."""
    refs: list = []
    outgoing = RaySink._outgoing

    def spy(self, episodes):
        sent, lent = outgoing(self, episodes)
        refs.extend(entry[0] for entry in lent or [] if entry is not None)   # (ref, part)
        return sent, lent

    monkeypatch.setattr(RaySink, "_outgoing", spy)
    return refs


def shard_actors(store) -> list:
    """The shards' actors, by the names the store gives them."""
    return [ray.get_actor(f"{store.name}:{s}", namespace=NAMESPACE) for s in range(store.num_shards)]


def manifests(store, seal: bool = True) -> list:
    """Every shard's manifest, asked now: after sealing its open episodes (as `flush` asks), or
    without (as a reader's poll asks; such a request may compact)."""
    return [ray.get(h.manifest.remote(None, -1, 0, seal))[0] for h in shard_actors(store)]


def unfilled(store) -> list[int]:
    """Per shard, the lent episodes whose rows are not in its arena yet."""
    return [ray.get(h.__ray_call__.remote(lambda server: len(server.unfilled))) for h in shard_actors(store)]


def _sealed(server) -> list:
    with server.engine.lock:
        server.blocks.seal(server.engine)
        return list(server.blocks.blocks)


def sealed_blocks(store) -> list:
    """Every shard's blocks right after sealing its open episodes, before any compaction."""
    return [b for h in shard_actors(store) for b in ray.get(h.__ray_call__.remote(_sealed))]


def check_rows(batch) -> None:
    key, step = batch["obs"][:, 0].numpy().astype(np.int64), batch["obs"][:, 1].numpy().astype(np.int64)
    np.testing.assert_array_equal(batch["action"].numpy(), key + step)
    np.testing.assert_array_equal(batch["check"].numpy(), key * 3)
    np.testing.assert_array_equal(batch["step"].numpy(), step)
    np.testing.assert_array_equal(batch["next", "obs"][:, 1].numpy(), step + 1)


def test_a_large_episode_is_sealed_as_the_object_its_writer_put_and_small_ones_are_copied(lent_refs):
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=2, seed=0, ray_options=OPTIONS)
    try:
        ids = [store.add_episode(keyed_episode(key, 40 if key % 2 else 5), env_id=f"e{key % 4}")
               for key in range(12)]
        stacked = {name: np.stack([keyed_episode(key, 40)[name] for key in (20, 21)]) for name in keyed_episode(0, 40)}
        ids += store.add_episodes(stacked, env_ids=["e0", "e1"])
        assert len(lent_refs) == 8   # the 40-step episodes; none of the 5-step ones
        blocks = sealed_blocks(store)
        lent = {ref.hex() for ref in lent_refs}
        by_ref = [b for b in blocks if b.ref.hex() in lent]
        assert len(by_ref) == 8 and all(b.num_episodes == 1 and b.num_rows == 41 for b in by_ref)
        # Every episode is in exactly one block: serials cover 0..n-1 once per shard.
        for m in manifests(store):
            serials = sorted(s for b in m.blocks for s in range(b.first_serial, b.first_serial + b.num_episodes))
            assert serials == list(range(m.stop_serial))
        assert sum(b.num_episodes for b in blocks) == len(ids) == 14
        check_rows(store.sample(512))
        for batch in store.iter_batches(100):
            check_rows(batch)
        for key, episode_id in zip([*range(12), 20, 21], ids):
            rows = store.episode(episode_id)   # from the shard's arena: the same rows, a zero row beside the final obs
            np.testing.assert_array_equal(rows.column("check").to_numpy(), [key * 3] * (rows.num_rows - 1) + [0])
    finally:
        store.close()


def _loaded(store, path):
    store.save(path)
    loaded = ab.ExperienceStore.load(path)
    try:
        return loaded.to_arrow()
    finally:
        loaded.close()


def _gae(store, path):
    store.compute_gae(0.9, 0.8, bootstrap_value=lambda obs: obs["obs"][:, 1] * 0.5)
    return store.to_arrow()


#: Every way a shard reads its own arena, as a table of the rows it read.
ARENA_READS = {
    "episode": lambda store, path: pa.Table.from_batches(
        [store.episode(i) for i in store.episodes().column("episode_id").to_pylist()]),
    "to_arrow": lambda store, path: store.to_arrow(),
    "save": _loaded,
    "to_parquet": lambda store, path: ab.ExperienceStore.from_parquet(store.to_parquet(path)).to_arrow(),
    "compute_gae": _gae,
}


def test_the_shard_copies_lent_rows_into_its_arena_only_when_it_reads_them(tmp_path):
    # One store for every read (each store starts its actors: seconds of the suite): before each
    # read, 3 new episodes are lent and left uncopied until that read.
    local = ab.ExperienceStore(20_000, seed=0)
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=OPTIONS)
    try:
        for k, (read, rows_of) in enumerate(ARENA_READS.items()):
            episodes = [keyed_episode(key, 40) for key in range(3 * k, 3 * k + 3)]
            for episode in episodes:
                episode["value"] = np.linspace(0, 1, 40, dtype=np.float32)
                local.add_episode(episode, env_id="a")
                store.add_episode(episode, env_id="a")
            store.flush()
            check_rows(store.sample(256))   # readers gather from the lent objects
            assert unfilled(store) == [3], read
            rows = rows_of(store, tmp_path / f"ray-{read}")
            assert unfilled(store) == [0], read
            expected = rows_of(local, tmp_path / f"local-{read}")
            for name in expected.column_names:
                if name not in ("inserted_at", "episode_id"):
                    assert rows.column(name).equals(expected.column(name)), (read, name)
    finally:
        store.close()


def test_a_threaded_shard_copies_lent_rows_at_once_and_still_seals_the_lent_objects(lent_refs):
    # With a rate limiter a shard runs calls in threads: a read must never meet rows placed but not copied.
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=OPTIONS,
                               rate_limiter=ab.MinSize(1))
    try:
        for key in range(3):
            store.add_episode(keyed_episode(key, 40), env_id="a")
        assert unfilled(store) == [0]
        lent = {ref.hex() for ref in lent_refs}
        assert sum(b.ref.hex() in lent for b in sealed_blocks(store)) == 3
        check_rows(store.sample(256))
    finally:
        store.close()


def test_the_lent_episodes_of_one_request_share_one_object_and_read_back_as_blocks_of_their_own(lent_refs):
    # One put per request, not per episode: a put costs per object as well as per byte.
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=QUICK_SEALS)
    try:
        keys = [30, 31, 32]
        stacked = {name: np.stack([keyed_episode(key, 40)[name] for key in keys]) for name in keyed_episode(0, 40)}
        ids = store.add_episodes(stacked, env_ids="a")
        store.add_episode(keyed_episode(33, 5), env_id="a")   # small: copied, beside them
        assert len(lent_refs) == 3 and len({ref.hex() for ref in lent_refs}) == 1
        shared = [b for b in sealed_blocks(store) if b.ref.hex() == lent_refs[0].hex()]
        assert [(b.first_serial, b.part, b.num_episodes, b.num_rows) for b in shared] == \
            [(0, 0, 1, 41), (1, 1, 1, 41), (2, 2, 1, 41)]
        parts = ray.get(shared[0].ref)
        assert [int(parts[b.part]["check"][0]) for b in shared] == [key * 3 for key in keys]
        batch = store.sample(512)
        check_rows(batch)
        assert sorted(set(batch["obs"][:, 0].numpy().astype(int).tolist())) == [*keys, 33]
        for key, episode_id in zip(keys, ids):   # the shard's arena, filled from the parts
            np.testing.assert_array_equal(store.episode(episode_id).column("check").to_numpy()[:-1], key * 3)
    finally:
        store.close()


def test_one_add_episodes_call_puts_one_object_for_every_shard_and_one_shards_eviction_keeps_it_for_the_other(
        lent_refs):
    # A put costs per object: the lent episodes of a call are one object, whichever shard stores them.
    store = ab.ExperienceStore(400, backend="ray", num_shards=2, seed=0, ray_options=QUICK_SEALS)
    try:
        keys = [40, 41, 42, 43]
        stacked = {name: np.stack([keyed_episode(key, 40)[name] for key in keys]) for name in keyed_episode(0, 40)}
        ids = store.add_episodes(stacked, env_ids=[f"env-{key}" for key in keys])
        assert sorted(i % 2 for i in ids) == [0, 0, 1, 1]   # two on each shard
        assert len(lent_refs) == 4 and len({ref.hex() for ref in lent_refs}) == 1
        shared = lent_refs[0].hex()
        lent_refs.clear()   # only the shards' blocks hold the object now
        assert sorted(b.part for b in sealed_blocks(store) if b.ref.hex() == shared) == [0, 1, 2, 3]
        on_one = [key for key, i in zip(keys, ids) if i % 2 == 1]
        for key in range(50, 55):   # 80 + 5 x 40 transitions in a shard of 200: its two episodes of the object go
            store.add_episode(keyed_episode(key, 40), shard=0)
        assert sorted(b.part for b in sealed_blocks(store) if b.ref.hex() == shared) == \
            sorted(k for k, i in enumerate(ids) if i % 2 == 1)
        gc.collect()
        batch = store.sample(2_000)
        check_rows(batch)
        assert set(batch["obs"][:, 0].numpy().astype(int).tolist()) == {*on_one, 50, 51, 52, 53, 54}
    finally:
        store.close()


def test_a_lent_object_holds_the_rows_in_the_layout_of_a_copied_block(ray_stores):
    store = ray_stores.get(capacity=20_000, num_shards=1, seed=0, ray_options=OPTIONS)
    first = store.add_episode(keyed_episode(7, 40), env_id="a")   # lent; one shard: its id is its serial
    store.add_episode(keyed_episode(8, 40), env_id="a")
    with_final, = [b for b in sealed_blocks(store) if b.first_serial == first]
    rows = ray.get(with_final.ref)
    source = keyed_episode(7, 40)
    np.testing.assert_array_equal(rows["obs"], source["obs"])
    for name in ("action", "check", "reward", "terminated", "truncated"):   # one zero row beside the final obs
        assert len(rows[name]) == 41 and rows[name][-1] == 0
        np.testing.assert_array_equal(rows[name][:40], source[name])
    # An episode without its final observation has T rows in every field.
    schema = store.schema
    checked, _ = read_episode({**source, "obs": source["obs"][:40]}, schema, "a", None)
    columns = block_columns(checked, schema)
    assert {name: len(c) for name, c in columns.items()} == dict.fromkeys(schema.fields, 40)
    # Another dtype than the stored one needs a conversion: not lent, the shard copies it.
    checked, _ = read_episode({**source, "reward": source["reward"].astype(np.float16)}, schema, "a", None)
    assert checked.columns["reward"].dtype == np.float16 and block_columns(checked, schema) is None


def test_a_step_writer_lends_the_episodes_it_seals(lent_refs):
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=2, seed=0, ray_options=OPTIONS)
    try:
        with store.writer(num_envs=2, autoreset_mode="disabled") as writer:
            episodes = [keyed_episode(key, 40) for key in (3, 4)]
            for t in range(40):
                step = {name: np.stack([e[name][t] for e in episodes]) for name in episodes[0]}
                step["next_obs"] = np.stack([e["obs"][t + 1] for e in episodes])
                writer.add(**step)
        store.flush()
        assert len(lent_refs) == 2 and len(store) == 80
        lent = {ref.hex() for ref in lent_refs}
        assert sum(b.ref.hex() in lent for b in sealed_blocks(store)) == 2
        check_rows(store.sample(256))
    finally:
        store.close()


@ray.remote(num_cpus=0)
def lends_elsewhere(name: str) -> tuple[bool, int]:
    """In another process: whether its writers lend, and what it stored."""
    store = ab.ExperienceStore.attach(name, ray_options=OPTIONS)
    store.add_episode(keyed_episode(9, 40), env_id="far")
    store.flush()
    return store._backend.shards.started_here(), len(store)   # no public name for who owns the shards


def test_writers_in_other_processes_send_their_rows_and_their_shard_copies_them(lent_refs, ray_stores):
    # Ray frees an object when its owner dies: a task's objects must not become blocks.
    store = ray_stores.get(capacity=20_000, num_shards=1, seed=0, ray_options=OPTIONS)
    assert store._backend.shards.started_here()
    assert ray.get(lends_elsewhere.remote(store.name)) == (False, 40)
    store.flush()
    block, = sealed_blocks(store)
    assert block.num_episodes == 1 and lent_refs == []
    check_rows(store.sample(64))


def test_an_episode_written_after_compute_gae_is_copied_with_the_derived_columns(lent_refs):
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=OPTIONS)
    try:
        for key in range(3):
            episode = keyed_episode(key, 40)
            episode["value"] = np.linspace(0, 1, 40, dtype=np.float32)
            store.add_episode(episode, env_id="a")
        store.compute_gae(0.9, 0.8, bootstrap_value=lambda obs: obs["obs"][:, 1] * 0.5)
        episode = keyed_episode(5, 40)
        episode["value"] = np.ones(40, np.float32)
        store.add_episode(episode, env_id="a")   # its writer's object lacks the shard's derived fields
        lent = {ref.hex() for ref in lent_refs}
        assert len(lent) == 4 and not any(b.ref.hex() in lent for b in sealed_blocks(store))   # all copied
        store.flush()
        batch = store.sample(512)
        again = store.gather(batch["index"].numpy())
        np.testing.assert_array_equal(batch["advantage"].numpy(), again["advantage"].numpy())
        assert (batch["advantage"].numpy()[batch["obs"][:, 0].numpy() == 5] == 0).all()   # not computed yet
        check_rows(batch)
    finally:
        store.close()


def test_close_frees_the_lent_objects_too():
    def free() -> float:
        return ray.available_resources().get("object_store_memory", 0.0)

    time.sleep(0.5)
    before = free()
    store = ab.ExperienceStore(200_000, backend="ray", num_shards=2, seed=0,
                               ray_options=RayOptions(block_bytes=200_000))
    for key in range(150):   # 30 KB episodes: lent
        store.add_episode(keyed_episode(key, 999), env_id=f"e{key}")
    store.flush()
    check_rows(store.sample(1024))
    deadline = time.monotonic() + 60   # the object store's figure lags: wait for the condition, generously
    while free() >= before - 4_000_000 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free() < before - 4_000_000
    store.close()
    deadline = time.monotonic() + 60
    while free() < before - 100_000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free() >= before - 100_000


def test_a_dead_shard_fails_a_lent_write_with_shard_error():
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=OPTIONS)
    try:
        store.add_episode(keyed_episode(1, 40), env_id="a")
        ray.kill(shard_actors(store)[0])
        with pytest.raises(ab.ShardError, match="shard 0 of store"):
            deadline = time.monotonic() + 60   # until the write meets the dead shard (generous)
            while time.monotonic() < deadline:
                store.add_episode(keyed_episode(2, 40), env_id="a")
                time.sleep(0.1)
    finally:
        store.close()


def test_a_restarted_durable_shard_publishes_its_lent_episodes_again_from_its_log(tmp_path, lent_refs):
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=OPTIONS,
                               durable=tmp_path)
    try:
        ids = [store.add_episode(keyed_episode(key, 40), env_id="a") for key in range(3)]
        store.flush()
        victim = shard_actors(store)[0]
        old = ray.get(victim.__ray_call__.remote(lambda server: os.getpid()))
        ray.kill(victim, no_restart=False)   # Ray restarts it; wait until calls reach the new process
        deadline = time.monotonic() + 60
        while ray.get(victim.__ray_call__.remote(lambda server: os.getpid())) == old:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ids.append(store.add_episode(keyed_episode(3, 40), env_id="a"))
        assert len(lent_refs) == 4 and ids == [0, 1, 2, 3]
        blocks = sealed_blocks(store)
        serials = sorted(s for b in blocks for s in range(b.first_serial, b.first_serial + b.num_episodes))
        assert serials == [0, 1, 2, 3]   # the recovered ones copied from the arena, the new one lent
        assert [b.ref.hex() for b in blocks if b.first_serial == 3] == [lent_refs[-1].hex()]
        batch = store.sample(512)
        check_rows(batch)
        assert sorted(set(batch["obs"][:, 0].numpy().astype(int).tolist())) == [0, 1, 2, 3]
    finally:
        store.close()


def test_an_idle_shard_merges_its_small_copied_blocks_on_a_poll_never_in_a_flush_and_leaves_lent_ones_uncopied(
        lent_refs):
    # Readers gather block by block: small copied blocks are merged at idle. Lent blocks are
    # the writers' objects: merging them would copy each lent episode twice in the shard.
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=1, seed=0, ray_options=QUICK_SEALS)
    try:
        for key in range(3):
            store.add_episode(keyed_episode(key, 40), env_id="a")   # lent (1,230 B)
        for key, steps in ((3, 30), (4, 1), (5, 1)):   # copied (below 1,000 B); the seals leave two blocks
            store.add_episode(keyed_episode(key, steps), env_id="a")
            store.flush()
        lent = {ref.hex() for ref in lent_refs}
        assert len(lent) == 3
        copied = [b for b in manifests(store)[0].blocks if b.ref.hex() not in lent]
        assert [b.num_episodes for b in copied] == [1, 2] and not any(b.lent for b in copied)
        time.sleep(0.2)   # idle: no write for more than seal_latency
        # A request its caller waits for (flush's) leaves compaction to the polls.
        assert len(manifests(store)[0].blocks) == 5
        deadline = time.monotonic() + 30
        while len(manifests(store, seal=False)[0].blocks) > 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        blocks = manifests(store)[0].blocks
        assert [(b.ref.hex() in lent, b.lent, b.num_episodes) for b in blocks] == \
            [(True, True, 1)] * 3 + [(False, False, 3)]
        assert unfilled(store) == [3]   # the merge read no lent episode's rows from the arena
        batch = store.sample(1024)
        check_rows(batch)
        assert sorted(set(batch["obs"][:, 0].numpy().astype(int).tolist())) == list(range(6))
    finally:
        store.close()
