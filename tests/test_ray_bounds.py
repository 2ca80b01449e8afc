"""Bounded resources on a Ray store: writers know a shard's capacity, the driver bounds batches."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab

pytestmark = pytest.mark.usefixtures("ray_session")


def step(num_envs: int, t: int, done: np.ndarray) -> dict:
    obs = np.full((num_envs, 2), float(t))
    return {"obs": obs, "action": np.zeros(num_envs, np.int64), "reward": np.ones(num_envs),
            "terminated": done, "truncated": np.zeros(num_envs, bool), "next_obs": obs + 1}


def test_a_ray_writers_episode_longer_than_a_shard_is_stored_in_pieces_not_refused():
    store = ab.ExperienceStore(20, backend="ray", num_shards=2, seed=0)   # 10 rows a shard
    try:
        writer = store.writer(num_envs=2, autoreset_mode="disabled", env_ids=["long", "short"])
        for t in range(30):   # 'long' never ends: 30 steps, 3x a shard; 'short' ends every 4th step
            writer.add(**step(2, t, np.array([False, t % 4 == 3])))
        assert int(writer.open_steps.max()) <= 2   # cut at a quarter of a shard (`arrowbuf.piece_cutting`)
        writer.flush()
        table = store.episodes().to_pydict()
        long = [k for k, env in enumerate(table["env_id"]) if env == "long"]
        assert len(long) == 1   # its pieces are storage: one row of the played episode, its held steps
        (k,) = long
        assert 0 < table["length"][k] <= 10 and table["first_step"][k] + table["length"][k] == 30   # newest, to step 29
        assert writer.open_steps.tolist() == [0, 0]
        assert len(store) <= 20
    finally:
        store.close()


def test_a_ray_batch_that_cannot_be_allocated_is_refused_before_any_shard_draws():
    store = ab.ExperienceStore(100, backend="ray", num_shards=2, seed=0)
    try:
        steps = 6
        store.add_episode({"obs": np.zeros((steps + 1, 17), np.float32), "action": np.zeros((steps, 6), np.float32),
                           "terminated": np.arange(steps) == steps - 1}, env_id="a")
        store.flush()
        with pytest.raises(ab.ResourceError, match="batch_size=2,147,483,648"):
            store.sample(2**31)
        assert store.stats()["samples"] == 0
        assert store.sample(8).batch_size == (8,)
    finally:
        store.close()


def test_a_store_whose_full_ring_exceeds_the_object_store_is_refused_at_start_or_at_its_first_write():
    import ray

    object_store = ray.cluster_resources()["object_store_memory"]
    row_bytes = 4096 * 4 + 8 + 1   # obs float32[4096], action int64, terminated bool
    capacity = int(object_store // row_bytes) + 1_000
    schema = {"obs": ab.Field("float32", (4096,), True), "action": "int64", "terminated": "bool"}
    # Schema given: refused before any shard actor starts.
    with pytest.raises(ab.ResourceError, match=rf"{capacity:,} rows of {row_bytes:,} bytes .* GiB of sealed blocks "
                                               r"in Ray's object store, which holds .* GiB"):
        ab.ExperienceStore(capacity, backend="ray", num_shards=2, schema=schema)
    # Schema inferred: the first write is refused, the store stays empty and takes a smaller schema.
    store = ab.ExperienceStore(capacity, backend="ray", num_shards=1, seed=0)   # the ring, whole: any shards
    try:
        done = np.array([False, False, True])
        with pytest.raises(ab.ResourceError, match="larger object_store_memory"):
            store.add_episode({"obs": np.zeros((4, 4096), np.float32), "action": np.zeros(3, np.int64),
                               "terminated": done})
        assert len(store) == 0 and store.schema is None
        store.add_episode({"obs": np.zeros((4, 8), np.float32), "action": np.zeros(3, np.int64), "terminated": done})
        store.flush()
        assert len(store) == 3
    finally:
        store.close()
