"""arrowbuf.compat: a vector env's rollout window through a ``postprocess_fn`` is stored whole.

The seed calls the hook once per window of a vector env (``[T + 1, num_envs, ...]``
records, no auto-truncation: RLightning's WBC config) and splits what it returns
into one episode per sub-env. compat writes that window with one
``add_episodes`` call; these tests check it stores exactly what the per-episode
path stored (every row of every sub-env, in env order), and that the cases that
path handled one episode at a time still behave so: a fixed-mode buffer that
fills part-way through the window, episodes longer than the capacity, and the
truncation of one sub-env.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arrowbuf.compat import BatchedData, BufferFullError, EnvMeta, EnvRet, PolicyResponse, RolloutBuffer

ENV = "worker-0"
N, T = 5, 6


def postprocess(episode_buffer):
    """wbc_tracking's hook: next_observation by hand, ``last_*`` shifted, everything stacked by torch."""
    episode_buffer["next_observation"] = episode_buffer["observation"][1:] + [episode_buffer["observation"][-1]]
    return {key[len("last_"):] if key.startswith("last_") else key:
            torch.stack(values[1:] if key.startswith("last_") else values[:-1], dim=0)
            for key, values in episode_buffer.items() if "info" not in key}


def played(steps: int = T) -> dict[str, np.ndarray]:
    """What the envs and the policy hand over, time-major: observation [steps + 1, N, 3], the rest [steps, N]."""
    t = np.arange(steps + 1, dtype=np.float32)[:, None]
    i = np.arange(N, dtype=np.float32)[None, :]
    obs = np.stack([t * 100 + i, t + 0.5 * i, -t - i], axis=-1).astype(np.float32)
    return {"observation": obs, "action": (obs[:-1, :, :2] * 3).astype(np.float32),
            "reward": (obs[:-1, :, 0] / 7).astype(np.float32)}


def rollout(buffer: RolloutBuffer, data: dict[str, np.ndarray], truncate: list[str] | None = None) -> None:
    """RSLRLEngine's rollout: per step the EnvRets, then the responses; the final records; a truncation."""
    steps = len(data["action"])
    zeros = np.zeros(N, np.float32)
    for t in range(steps + 1):
        reward = torch.from_numpy(data["reward"][t - 1] if t else zeros)
        env_ret = EnvRet(ENV, torch.from_numpy(data["observation"][t]), last_reward=reward,
                         last_terminated=torch.zeros(N, dtype=torch.bool), last_truncated=torch.zeros(N, dtype=torch.bool),
                         info={})
        buffer.add_batched_data_async(BatchedData([ENV], [env_ret]))
        action = torch.from_numpy(data["action"][min(t, steps - 1)])
        buffer.add_batched_data_async(BatchedData([ENV], [PolicyResponse(ENV, action=action)]))
    buffer.truncate_episodes(truncate if truncate is not None else [ENV])


def make(capacity: int = 10_000, mode: str = "circular") -> RolloutBuffer:
    config = {"type": "RolloutBuffer", "capacity": capacity, "auto_truncate_episode": False,
              "storage": {"type": "unified", "unit": "episode", "device": "cpu", "mode": mode},
              "sampler": {"type": "batch"}}
    buffer = RolloutBuffer(config, postprocess_fn=postprocess, seed=0)
    buffer.init([EnvMeta(ENV, num_envs=N)], [ENV])
    return buffer


def expect_episode(episode, data: dict[str, np.ndarray], env: int, first: int = 0) -> None:
    """Episode rows = sub-env ``env``'s steps from ``first`` on, every field."""
    obs = data["observation"][:, env]
    steps = len(data["action"])
    np.testing.assert_array_equal(episode["observation"].numpy(), obs[first:steps])
    np.testing.assert_array_equal(episode["next_observation"].numpy(), obs[first + 1:steps + 1])
    np.testing.assert_array_equal(episode["action"].numpy(), data["action"][first:, env])
    np.testing.assert_array_equal(episode["reward"].numpy(), data["reward"][first:, env])
    assert not episode["terminated"].any() and not episode["truncated"].any()


def test_a_window_is_stored_as_one_episode_per_sub_env_in_env_order_with_every_row():
    buffer, data = make(), played()
    rollout(buffer, data)
    assert buffer.size() == N
    episodes = buffer[:]
    assert episodes.batch_size == (N, T)
    for env in range(N):
        expect_episode(episodes[env], data, env)
    assert buffer.store.episodes().column("env_id").to_pylist() == [f"{ENV}/{i}" for i in range(N)]
    assert len(buffer.store) == N * T


def test_a_second_window_after_sample_is_stored_the_same():
    buffer, data = make(), played()
    rollout(buffer, data)
    (batch,) = buffer.sample(batch_size=N)
    assert batch.batch_size == (N, T) and buffer.size() == 0
    later = {name: value * 2 for name, value in data.items()}
    rollout(buffer, later)
    episodes = buffer[:]
    for env in range(N):
        expect_episode(episodes[env], later, env)


def test_a_fixed_buffer_full_part_way_through_a_window_keeps_the_episodes_before_it():
    kept = 3
    buffer, data = make(capacity=kept * T + T // 2, mode="fixed"), played()
    with pytest.raises(BufferFullError, match="buffer is full"):
        rollout(buffer, data)
    assert buffer.size() == kept
    episodes = buffer[:]
    for env in range(kept):
        expect_episode(episodes[env], data, env)


def test_episodes_longer_than_the_capacity_keep_their_newest_steps():
    capacity = T - 2
    buffer, data = make(capacity=capacity), played()
    rollout(buffer, data)
    # The seed's ring of `capacity` rows: only the newest episode that fits is addressed.
    assert buffer.size() == 1
    expect_episode(buffer[0], data, N - 1, first=T - capacity)


def test_truncating_one_sub_env_stores_that_sub_env_only():
    buffer, data = make(), played()
    rollout(buffer, data, truncate=[f"{ENV}/2"])
    assert buffer.size() == 1
    expect_episode(buffer[0], data, 2)
    assert buffer.store.episodes().column("env_id").to_pylist() == [f"{ENV}/2"]
