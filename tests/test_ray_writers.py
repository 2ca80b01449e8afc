"""Ray writers deliver without flush, report dead shards, and never drop episodes silently."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import ray

import arrowbuf as ab
from arrowbuf.ray.options import NAMESPACE

from support.actors import kill_and_wait


pytestmark = pytest.mark.usefixtures("ray_session")


def finish(writer: ab.StepWriter, value: float = 0.0) -> int:
    """One step that ends every env's episode (autoreset 'disabled'): one episode per env."""
    n = writer.num_envs
    obs = np.full((n, 3), value, np.float32)
    return writer.add(obs=obs, action=np.zeros(n, np.int64), reward=np.ones(n, np.float32),
                      terminated=np.ones(n, bool), truncated=np.zeros(n, bool), next_obs=obs + 1)


@ray.remote
def count_elsewhere(name: str, expected: int, patience: float) -> int:
    """Attach by name in another process and wait (up to ``patience`` s) to see ``expected`` episodes."""
    store = ab.ExperienceStore.attach(name)
    deadline = time.monotonic() + patience
    while store.episodes().num_rows < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return store.episodes().num_rows


@ray.remote
def write_and_return(writer: ab.StepWriter) -> int:
    """Writes three finished episodes and returns without flush or close (the body of
    `finish`: a task cannot import this test module)."""
    obs = np.zeros((3, 3), np.float32)
    return writer.add(obs=obs, action=np.zeros(3, np.int64), reward=np.ones(3, np.float32),
                      terminated=np.ones(3, bool), truncated=np.zeros(3, bool), next_obs=obs + 1)


def test_finished_episodes_reach_another_process_without_flush(ray_stores):
    store = ray_stores.get(capacity=1_000, num_shards=2, seed=0)
    writer = store.writer(num_envs=3, autoreset_mode="disabled")
    finish(writer)   # three finished episodes, never flushed; the writer stays open
    assert ray.get(count_elsewhere.remote(store.name, 3, patience=60.0)) == 3
    assert writer.pending == 0


def test_a_task_that_returns_without_flush_still_delivers_its_episodes():
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    try:
        assert ray.get(write_and_return.remote(store.writer(num_envs=3, autoreset_mode="disabled"))) == 3
        assert ray.get(count_elsewhere.remote(store.name, 3, patience=60.0)) == 3
    finally:
        store.close()


def test_a_dead_shard_is_reported_to_its_writer_with_the_number_of_episodes_lost():
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    try:
        writer = store.writer(num_envs=3, autoreset_mode="disabled")
        finish(writer)
        writer.flush()
        kill_and_wait(ray.get_actor(f"{store.name}:0", namespace=NAMESPACE))
        finish(writer, 1.0)   # three episodes queued for the dead shard
        # The timer sends them and collects the failure; the next call reports it.
        deadline = time.monotonic() + 60   # generous: the condition, not the time, is what is checked
        obs = np.zeros((3, 3), np.float32)
        with pytest.raises(ab.ShardError, match="episodes are lost") as lost:
            while time.monotonic() < deadline:
                writer.add(obs=obs, action=np.zeros(3, np.int64), reward=np.ones(3, np.float32),
                           terminated=np.zeros(3, bool), truncated=np.zeros(3, bool), next_obs=obs + 1)
                obs = obs + 1   # each step starts from the last one's next_obs
                time.sleep(0.05)
        # The three ended episodes, with the pieces of the open ones if the timer shipped them alongside.
        assert int(re.search(r"(\d+) episodes are lost", str(lost.value)).group(1)) in (3, 6)
        # Episodes that can no longer reach a shard are named too, never dropped quietly.
        with pytest.raises(ab.ShardError, match="episodes of this writer are queued and not stored") as queued:
            writer.close()   # cuts the three open episodes above (their last pieces)
        assert int(re.search(r"(\d+) episodes of this writer are queued", str(queued.value)).group(1)) >= 3
    finally:
        store.close()


@ray.remote
def write_rounds(writer: ab.StepWriter, rounds: int, steps: int) -> int:
    """``rounds`` finished episodes per env, ``steps`` steps each, then flush (the acknowledgement)."""
    n = writer.num_envs
    for _ in range(rounds):
        for t in range(steps):
            obs = np.full((n, 3), t, np.float32)
            writer.add(obs=obs, action=np.zeros(n, np.int64), reward=np.ones(n, np.float32),
                       terminated=np.full(n, t == steps - 1), truncated=np.zeros(n, bool), next_obs=obs + 1)
    writer.flush()
    return rounds * n * steps


@ray.remote
def sizes_elsewhere(name: str) -> tuple[int, int]:
    store = ab.ExperienceStore.attach(name)
    return len(store), store.num_episodes


def test_len_and_num_episodes_are_exact_once_the_writers_flush_returned_in_any_process(ray_stores):
    # They summed the sizes the shards last reported: right after two writer tasks had
    # flushed, both read 0 here, and right only about a second later.
    store = ray_stores.get(capacity=1_000, num_shards=2, seed=0)   # 280 rows written
    assert (len(store), store.num_episodes) == (0, 0)   # a reading of the empty store, cached here
    tasks = [write_rounds.remote(store.writer(num_envs=4, autoreset_mode="disabled"), 10, 3 + k)
             for k in range(2)]
    rows = sum(ray.get(tasks))   # both flushed: every episode acknowledged
    assert (len(store), store.num_episodes) == (rows, 80)
    assert ray.get(sizes_elsewhere.remote(store.name)) == (rows, 80)
    assert store.cached_size == (rows, 80)   # the figure that never waits, refreshed by the calls above


def test_a_writers_delivery_of_many_envs_episodes_travels_as_one_array_a_field(ray_stores, monkeypatch):
    """32 envs' episodes of one delivery go as a `Bundle` a shard (`arrowbuf.ray.bundles`); every
    step arrives as written."""
    from arrowbuf.ray.bundles import Bundle

    shipped = []
    reduce = Bundle.__reduce__
    monkeypatch.setattr(Bundle, "__reduce__", lambda self: shipped.append(len(self)) or reduce(self))
    store = ray_stores.get(capacity=1_000, num_shards=2, seed=0)
    writer = store.writer(num_envs=32, autoreset_mode="disabled")
    steps = 4
    obs = [np.stack([np.arange(32), np.full(32, t), np.zeros(32)], axis=1).astype(np.float32) for t in range(steps + 1)]
    for t in range(steps):
        writer.add(obs=obs[t], action=np.arange(32) * 10 + t, reward=np.ones(32, np.float32),
                   terminated=np.full(32, t == steps - 1), truncated=np.zeros(32, bool), next_obs=obs[t + 1])
    writer.flush()
    assert shipped and sum(shipped) == 32 and len(store) == 32 * steps and store.num_episodes == 32
    batch = store.sample(256)
    env, t = batch["obs"][:, 0].long(), batch["obs"][:, 1].long()
    assert (batch["action"] == env * 10 + t).all() and (batch["step"] == t).all()
