"""Ray writers deliver without flush, report dead shards, and never drop episodes silently."""

from __future__ import annotations

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


def test_finished_episodes_reach_another_process_without_flush():
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=2, seed=0)
    try:
        writer = store.writer(num_envs=3, autoreset_mode="disabled")
        finish(writer)   # three finished episodes, never flushed; the writer stays open
        assert ray.get(count_elsewhere.remote(store.name, 3, patience=5.0)) == 3
        assert writer.pending == 0
    finally:
        store.close()


def test_a_task_that_returns_without_flush_still_delivers_its_episodes():
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    try:
        assert ray.get(write_and_return.remote(store.writer(num_envs=3, autoreset_mode="disabled"))) == 3
        assert ray.get(count_elsewhere.remote(store.name, 3, patience=5.0)) == 3
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
        deadline = time.monotonic() + 5.0
        with pytest.raises(ab.ShardError, match="3 episodes are lost"):
            while time.monotonic() < deadline:
                writer.add(obs=np.zeros((3, 3), np.float32), action=np.zeros(3, np.int64),
                           reward=np.ones(3, np.float32), terminated=np.zeros(3, bool),
                           truncated=np.zeros(3, bool), next_obs=np.ones((3, 3), np.float32))
                time.sleep(0.05)
        # Episodes that can no longer reach a shard are named too, never dropped quietly.
        with pytest.raises(ab.ShardError, match="3 episodes of this writer are queued and not stored"):
            writer.close()   # cuts the three open episodes above
    finally:
        store.close()
