"""A CUDA arena is allocated at once, so it starts with fewer rows than a lazy one (an eighth over
the capacity) and grows as its pieces need (`arrowbuf.placement.Ring.grow_arena`): a store of
``num_envs x T`` on the device holds every transition of each rollout, as a host store does.

CI has no GPU: these tests run the same path on a CPU torch arena told it is not lazy (what
``lazy_rows`` says of a CUDA tensor), which is the only difference the placement sees.
Counts and values only; no time is measured.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arrowbuf as ab
from arrowbuf.arena import TorchShard
from arrowbuf.placement import arena_rows

from test_capacity import rollout


@pytest.fixture
def device_like(monkeypatch):
    """CPU torch arenas placed as CUDA ones are: all rows allocated at once, not faulted in later."""
    monkeypatch.setattr(TorchShard, "lazy_rows", property(lambda self: False))


def first_rows(capacity: int) -> int:
    return arena_rows(capacity, lazy=False)


@pytest.mark.parametrize("num_envs, steps, end_rate, new_writer", [
    (512, 24, 0.05, True), (16, 64, 0.2, False), (64, 32, 0.25, True)])
def test_a_device_store_of_num_envs_x_t_holds_every_transition_of_each_rollout(
        device_like, num_envs, steps, end_rate, new_writer):
    # On 1ffb8a7 the arena stayed at capacity + capacity // 8 + 64 rows and its oldest went early:
    # 512 x 24 at 5% episode ends held 11,852-12,222 of 12,288, 16 x 64 at 20% 920-944 of 1,024.
    capacity = num_envs * steps
    store = ab.ExperienceStore(capacity=capacity, storage_device="cpu", seed=0)
    rng = np.random.default_rng(3)
    writer = None
    for k in range(3):
        store.clear()
        if new_writer or writer is None:
            writer = store.writer(num_envs, autoreset_mode="disabled")
        assert rollout(writer, num_envs, steps, end_rate, rng, tag=k) == capacity
        writer.flush()
        assert len(store) == capacity
        batch = store.gather(np.arange(*store.engine.live_range()))
        obs, nxt = batch["obs"].numpy(), batch["next", "obs"].numpy()
        assert (obs[:, 0] == k).all() and (nxt[:, 2] == obs[:, 2] + 1).all() and (nxt[:, :2] == obs[:, :2]).all()
        # every (env, step) once: the whole rollout, nothing twice
        assert len({(int(e), int(t)) for e, t in obs[:, 1:]}) == capacity
    shard = store.engine.shard
    assert first_rows(capacity) < shard.rows <= arena_rows(capacity), "the arena grew, within a lazy one's rows"
    assert all(column.shape[0] == shard.rows for column in shard.arena.values())


def test_a_grown_device_arena_keeps_priorities_reuse_counts_and_a_checkpoint(device_like, tmp_path):
    num_envs, steps = 16, 64
    capacity = num_envs * steps
    store = ab.ExperienceStore(capacity=capacity, storage_device="cpu", seed=0,
                               sampler=ab.PrioritizedSampler(alpha=1.0, beta=0.0), track_reuse=True)
    writer = store.writer(num_envs, autoreset_mode="disabled")
    rng = np.random.default_rng(4)
    played = rollout(writer, num_envs, steps // 2, 0.2, rng, tag=0)
    writer.flush()
    shard = store.engine.shard
    rows_before = shard.rows
    # one step of the first half gets all the priority mass; sampling counts its reuse
    live = np.arange(*store.engine.live_range())
    favourite = int(live[7])
    store.update_priorities(live, np.where(live == favourite, 1e6, 1e-6))
    store.sample(64)
    reuse_before = store.engine.shard.reuse[:rows_before].copy()
    played += rollout(writer, num_envs, steps - steps // 2, 0.2, rng, tag=0)
    writer.flush()
    assert len(store) == played == capacity
    assert shard.rows > rows_before, "the second half did not need the arena to grow: no test"
    assert store.engine.sampler.tree.size >= store.episodes()["first_row"].to_numpy().max() + 1
    assert (shard.reuse[:rows_before] == reuse_before).all() and len(shard.reuse) == shard.rows
    # new steps come in at the largest priority so far: lowered, the favourite's kept leaf has all the mass
    later = np.setdiff1d(np.arange(*store.engine.live_range()), live)
    store.update_priorities(later, np.full(len(later), 1e-6))
    batch = store.sample(256)
    assert (batch["index"] == favourite).float().mean() > 0.99, "the priorities set before the growth are kept"

    store.save(tmp_path / "grown")
    loaded = ab.ExperienceStore.load(tmp_path / "grown")
    assert len(loaded) == capacity and loaded.engine.shard.rows == shard.rows
    again = loaded.gather(np.arange(*loaded.engine.live_range()))
    here = store.gather(np.arange(*store.engine.live_range()))
    for key in ("obs", ("next", "obs"), "action", "reward"):
        assert torch.equal(again[key], here[key])
    assert (loaded.sample(256)["index"] == favourite).float().mean() > 0.99


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_store_of_num_envs_x_t_grows_its_arena_and_holds_every_transition():
    num_envs, steps = 512, 24
    store = ab.ExperienceStore(capacity=num_envs * steps, storage_device="cuda", seed=0)
    rng = np.random.default_rng(3)
    for k in range(3):
        store.clear()
        writer = store.writer(num_envs, autoreset_mode="disabled")
        rollout(writer, num_envs, steps, 0.05, rng, tag=k)
        writer.flush()
        assert len(store) == num_envs * steps
        obs = store.gather(np.arange(*store.engine.live_range()), device="cpu")["obs"].numpy()
        assert (obs[:, 0] == k).all() and len({(int(e), int(t)) for e, t in obs[:, 1:]}) == num_envs * steps
    shard = store.engine.shard
    assert shard.rows > first_rows(num_envs * steps)
    assert all(column.is_cuda and column.shape[0] == shard.rows for column in shard.arena.values())


def test_a_device_arena_that_cannot_grow_is_asked_once_until_cleared(device_like, monkeypatch):
    # A device without room for larger columns: the oldest go early, and the store does not ask for
    # (and allocate) larger columns again on every write after that.
    asked = []

    def refuse(self, rows):
        asked.append(rows)
        return self.rows

    monkeypatch.setattr(TorchShard, "grow_arena", refuse)
    num_envs, steps = 16, 64
    store = ab.ExperienceStore(capacity=num_envs * steps, storage_device="cpu", seed=0)
    writer = store.writer(num_envs, autoreset_mode="disabled")
    rng = np.random.default_rng(5)
    for k in range(3):
        rollout(writer, num_envs, steps, 0.2, rng, tag=k)
        writer.flush()
    assert len(asked) == 1 and len(store) <= num_envs * steps
    store.clear()
    rollout(writer, num_envs, steps, 0.2, rng, tag=3)
    writer.flush()
    assert len(asked) == 2, "a cleared store may ask again"
