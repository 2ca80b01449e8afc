"""Priority updates on a Ray store left in flight (``wait=False``): ordered before the
next sample of the process, bounded, and their errors raised by the next call."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.ray.options import INDEX_SHIFT

from support.actors import kill_and_wait

pytestmark = pytest.mark.usefixtures("ray_session")


def episode(key: int, steps: int) -> dict:
    return {"obs": np.full((steps + 1, 2), float(key)), "action": np.arange(steps, dtype=np.int64),
            "terminated": np.arange(steps) == steps - 1}


def prioritized(**options) -> ab.ExperienceStore:
    return filled(ab.ExperienceStore(1_000, backend="ray", num_shards=2, seed=0,
                                     sampler=ab.PrioritizedSampler(alpha=1.0, beta=1.0),
                                     ray_options=ab.RayOptions(**options)))


def filled(store: ab.ExperienceStore) -> ab.ExperienceStore:
    for key in range(8):
        store.add_episode(episode(key, 10), env_id=f"env-{key % 2}")
    store.flush()
    return store


@pytest.fixture
def shared(ray_stores) -> ab.ExperienceStore:
    """`prioritized()`'s store and episodes, on one store shared by the tests that leave its shards alive."""
    return filled(ray_stores.get(capacity=1_000, num_shards=2, seed=0,
                                 sampler=ab.PrioritizedSampler(alpha=1.0, beta=1.0)))


def live_indices(store: ab.ExperienceStore) -> np.ndarray:
    return np.sort(np.concatenate([b["index"].numpy() for b in store.iter_batches(64, shuffle=False)]))


def test_an_update_left_in_flight_is_applied_before_this_process_samples_that_shard_again(shared):
    store = shared
    index = live_indices(store)
    target = int(index[5])
    priority = np.where(index == target, 1.0, 1e-6)
    assert store.update_priorities(index, priority, wait=False) is None
    # The shard draws its share of this batch after applying the update (Ray keeps the
    # calls of one process in order); the split across shards may still use older masses.
    batch = store.sample(256)["index"].numpy()
    mine = batch[(batch >> INDEX_SHIFT) == (target >> INDEX_SHIFT)]
    assert len(mine) and np.count_nonzero(mine == target) >= 0.95 * len(mine)
    store.flush()   # the answers are in: the split follows the new masses too
    assert np.count_nonzero(store.sample(256)["index"].numpy() == target) >= 250
    assert store.update_priorities(index, np.ones(len(index))) == len(index)   # waited: the count


def test_updates_left_in_flight_are_bounded_per_shard():
    store = prioritized(max_in_flight=1)
    try:
        index = live_indices(store)
        for k in range(5):
            store.update_priorities(index, np.full(len(index), 1.0 + k), wait=False)
            assert store._backend._updates.pending <= 2   # one per shard
        store.flush()
        assert store._backend._updates.pending == 0
        np.testing.assert_allclose(store.sample(64)["weight"].numpy(), 1.0)   # every priority 5: uniform
    finally:
        store.close()


def kill_shard(store: ab.ExperienceStore, shard: int) -> None:
    """Kill ``shard`` and wait until it is gone: ray.kill returns before, and an update sent
    meanwhile could still be applied (then close raised nothing). The store is not told."""
    kill_and_wait(store._backend.shards.handles[shard])


def test_the_error_of_an_update_left_in_flight_is_raised_by_the_next_call_once():
    store = prioritized()
    try:
        index = live_indices(store)
        kill_shard(store, 1)
        assert store.update_priorities(index, np.ones(len(index)), wait=False) is None   # not known dead yet
        with pytest.raises(ab.ShardError, match="shard 1 .* is dead"):
            store.flush()
        assert store._backend._updates.pending == 0   # raised once, not kept
    finally:
        store.close()


def test_close_raises_the_error_of_an_update_left_in_flight_and_ends_the_shards_all_the_same():
    store = prioritized()
    index = live_indices(store)
    kill_shard(store, 0)
    store.update_priorities(index, np.ones(len(index)), wait=False)
    with pytest.raises(ab.ShardError, match="shard 0 .* is dead"):
        store.close()
    with pytest.raises(ab.ShardError, match="is closed"):
        store.sample(8)


def test_wait_is_checked_before_anything_is_sent_and_a_local_store_applies_the_update_at_once(shared):
    store = shared
    index = live_indices(store)
    with pytest.raises(ValueError, match="wait must be True or False, got 'no'"):
        store.update_priorities(index, np.ones(len(index)), wait="no")
    assert store._backend._updates.pending == 0
    local = ab.ExperienceStore(1_000, seed=0, sampler=ab.PrioritizedSampler())
    local.add_episode(episode(0, 10))
    batch = local.sample(4)
    assert local.update_priorities(batch["index"], np.ones(4), wait=False) == 4


def test_a_closed_sample_iter_takes_the_answers_of_its_draws_still_in_flight(monkeypatch, shared):
    """A prioritized `sample_iter` keeps ``prefetch`` index requests in flight; closing it takes
    their answers (an error they hold is taken, not left to Ray as an "Unhandled error")."""
    from arrowbuf.ray.reader import DrawLoop

    drained = []
    drop = DrawLoop.drop_pending

    def counted(loop):
        before = len(loop.pending)
        drop(loop)
        drained.append((before, len(loop.pending)))

    monkeypatch.setattr(DrawLoop, "drop_pending", counted)
    store = shared
    batches = store.sample_iter(8, prefetch=3)
    assert next(batches)["obs"].shape == (8, 2)
    batches.close()
    assert drained and drained[0][0] == 3 and drained[0][1] == 0
