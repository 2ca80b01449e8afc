"""How much of the ring in-place step writers keep sampleable (`arrowbuf.regions.region_rows`,
`arrowbuf.placement`).

Streaming past the capacity, eviction takes the oldest transitions and no more: the store
holds exactly its capacity, and the ring's rows stay near it (region sizes bound how far
seal order strays from ring order, and rows freed out of order are reused where they lie).
Counts only: no time is measured.
"""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab


def play(store: ab.ExperienceStore, writer, steps: int, end_rate: float, seed: int) -> list[int]:
    """len(store) after each of ``steps`` steps of the writer's envs, whose episodes end at random."""
    n = writer.num_envs
    rng = np.random.default_rng(seed)
    obs = np.zeros((n, 3), np.float32)
    lens = []
    for _ in range(steps):
        done = rng.random(n) < end_rate
        writer.add(obs=obs, action=np.zeros(n, np.int64), reward=np.ones(n, np.float32), terminated=done,
                   truncated=np.zeros(n, bool), next_obs=obs)
        lens.append(len(store))
    return lens


@pytest.mark.parametrize("num_envs, capacity, end_rate, rows", [
    (1, 2_000, 0.01, 1.1), (8, 6_000, 0.02, 1.2), (64, 24_000, 0.01, 1.2)])
def test_a_ring_streamed_for_many_laps_keeps_its_capacity_sampleable(num_envs, capacity, end_rate, rows):
    store = ab.ExperienceStore(capacity, seed=0)
    writer = store.writer(num_envs=num_envs, autoreset_mode="disabled")
    steps = 8 * capacity // num_envs
    lens = np.array(play(store, writer, steps, end_rate, seed=1))
    laps = np.arange(1, steps + 1) * num_envs / capacity
    assert lens.max() <= capacity
    steady = lens[laps > 1]                  # past the first lap
    assert steady.min() == capacity          # (>= 0.85-0.9 of it when capacity counted rows)
    assert store.engine.shard.ring <= rows * capacity   # rows beyond it: final observations, regions


def test_rollouts_into_a_cleared_store_keep_every_step_in_one_piece_an_episode():
    num_envs, steps = 128, 24
    store = ab.ExperienceStore(2 * num_envs * (steps + 1), seed=0)
    writer = store.writer(num_envs=num_envs, autoreset_mode="disabled")
    for rollout in range(3):
        assert play(store, writer, steps, 0.05, seed=rollout)[-1] == num_envs * steps
        writer.flush()
        table = store.episodes()
        assert sum(table["length"].to_pylist()) == len(store) == num_envs * steps
        # one region per env for the whole rollout: no episode was cut by a full region
        assert "first_step" not in table.column_names or not any(table["first_step"].to_pylist())
        store.clear()
