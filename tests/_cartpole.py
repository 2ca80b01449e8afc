"""Real data for the inspection tests: CartPole-v1 episodes from random actions.

Rendering needs pygame (``gymnasium[classic-control]``); SDL's dummy video driver
keeps it headless and quiet.
"""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np

import arrowbuf as ab

FRAME_SHAPE = (64, 96, 3)


def cartpole_store(steps: int = 600, seed: int = 0, num_envs: int = 2, **store_kwargs) -> ab.ExperienceStore:
    """A store of CartPole-v1 episodes played with random actions by ``num_envs`` envs.

    Only finished episodes are kept (open ones are not flushed), so every episode
    ends terminated or truncated and has its final observation.
    """
    store = ab.ExperienceStore(capacity=store_kwargs.pop("capacity", 20_000), seed=seed, **store_kwargs)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
    writer = store.writer(num_envs=num_envs)
    rng = np.random.default_rng(seed)
    obs, _ = envs.reset(seed=seed)
    for _ in range(steps // num_envs):
        action = rng.integers(0, 2, size=num_envs)
        next_obs, reward, terminated, truncated, _ = envs.step(action)
        writer.add(obs=obs, action=action, reward=reward.astype(np.float32), terminated=terminated,
                   truncated=truncated, next_obs=next_obs)
        obs = next_obs
    envs.close()
    return store


def frame(env: gym.Env) -> np.ndarray:
    """The env's 400x600 RGB rendering downscaled to 64x96 by striding (every 6th pixel)."""
    return env.render()[:384:6, :576:6]


def pixel_store(episodes: int = 2, seed: int = 0) -> ab.ExperienceStore:
    """A store of CartPole-v1 episodes whose observations are uint8 frames [64, 96, 3]."""
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    store = ab.ExperienceStore(capacity=2_000, seed=seed)
    env = gym.make("CartPole-v1", render_mode="rgb_array")
    rng = np.random.default_rng(seed)
    for k in range(episodes):
        env.reset(seed=seed + k)
        frames, actions, rewards = [frame(env)], [], []
        done = terminated = False
        while not done:
            action = int(rng.integers(2))
            _, reward, terminated, truncated, _ = env.step(action)
            frames.append(frame(env))
            actions.append(action)
            rewards.append(reward)
            done = terminated or truncated
        last = np.arange(len(actions)) == len(actions) - 1
        store.add_episode({"obs": np.stack(frames), "action": np.array(actions), "reward": np.array(rewards, np.float32),
                           "terminated": last & terminated, "truncated": last & (not terminated)})
    env.close()
    return store
