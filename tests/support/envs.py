"""Environments for the tests: a scripted vector env for the step writer, and real CartPole.

`FakeVectorRollout` feeds a `StepWriter` tagged steps (`support.episodes`) in any
gymnasium autoreset mode and records the episodes the writer should seal.
`EpisodeLog` wraps a real env and logs every episode it plays; `cartpole_store` and
`pixel_store` fill stores with CartPole-v1 episodes from random actions (rendering
needs pygame, ``gymnasium[classic-control]``; SDL's dummy video driver keeps it
headless and quiet).
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
import numpy as np

import arrowbuf as ab

from .episodes import ExpectedEpisode, tagged_action, tagged_reward


class FakeVectorRollout:
    """Drives a `StepWriter` with tagged data in any gymnasium autoreset mode.

    Env ``e`` plays episodes of the lengths ``lengths[e]`` (cycled). Every step
    follows gymnasium's conventions for ``mode``: in ``next_step`` an ended env spends
    the next step resetting (stale obs in, reset obs out, zero reward, no flags); in
    ``same_step`` the ending step already returns the reset obs and the final one is
    in ``final_obs`` (an object array with None elsewhere, like ``info["final_obs"]``);
    in ``disabled`` the caller resets, so the step after an end starts the new episode.
    The episodes the writer should seal are appended, in sealing order, to ``sealed``.
    """

    def __init__(self, lengths: list[list[int]], mode: str, first_tag: int = 0) -> None:
        self.lengths = lengths
        self.mode = mode
        self.num_envs = n = len(lengths)
        self.next_tag = first_tag
        self.episode_count = [0] * n
        self.tag = [self._new_tag() for _ in range(n)]
        self.t = [0] * n
        self.resetting = [False] * n        # next_step: the coming step resets this env
        self.stale_obs = np.zeros((n, 2))   # next_step: the final obs fed back on the reset step
        self.sealed: list[ExpectedEpisode] = []

    def _new_tag(self) -> int:
        self.next_tag += 1
        return self.next_tag - 1

    def step_arrays(self) -> dict[str, Any]:
        """The keyword arguments of one `StepWriter.add` call, advancing every env."""
        n = self.num_envs
        obs, next_obs = np.zeros((n, 2)), np.zeros((n, 2))
        action, reward = np.full(n, -1, np.int64), np.zeros(n)
        term, trunc = np.zeros(n, bool), np.zeros(n, bool)
        final = np.full(n, None, dtype=object)
        for e in range(n):
            tag, t = self.tag[e], self.t[e]
            if self.resetting[e]:
                obs[e], next_obs[e] = self.stale_obs[e], [tag, 0]
                self.resetting[e] = False
                continue
            obs[e] = [tag, t]
            action[e] = tagged_action(tag, t)
            reward[e] = tagged_reward(tag, t)
            seq = self.lengths[e]
            if t + 1 < seq[self.episode_count[e] % len(seq)]:
                self.t[e] = t + 1
                next_obs[e] = [tag, t + 1]
                continue
            term[e], trunc[e] = tag % 2 == 0, tag % 2 == 1
            self.sealed.append(ExpectedEpisode(tag, t + 1, True, bool(term[e]), bool(trunc[e]), f"env-{e}"))
            self.episode_count[e] += 1
            self.tag[e], self.t[e] = self._new_tag(), 0
            if self.mode == "same_step":
                final[e] = np.array([tag, t + 1], np.float64)
                next_obs[e] = [self.tag[e], 0]
            else:
                next_obs[e] = [tag, t + 1]
            if self.mode == "next_step":
                self.resetting[e] = True
                self.stale_obs[e] = [tag, t + 1]
        step = {"obs": obs, "action": action, "reward": reward, "terminated": term, "truncated": trunc,
                "next_obs": next_obs}
        if self.mode == "same_step":
            step["final_obs"] = final if (term | trunc).any() else None
        return step

    def flush(self) -> None:
        """Record the episodes a writer flush cuts (env order); call once, at the end."""
        for e in range(self.num_envs):
            if self.t[e] > 0:
                self.sealed.append(ExpectedEpisode(self.tag[e], self.t[e], True, False, False, f"env-{e}"))
                self.t[e] = 0


class EpisodeLog(gym.Wrapper):
    """Records every episode this env plays: observations, actions, rewards, flags.

    The reward is reshaped (``1 + |x|``, x the cart position) so returns differ from
    lengths. ``finished`` holds ended episodes; ``current`` the one in progress.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.finished: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        self.current = {"obs": [obs], "action": [], "reward": [], "terminated": False, "truncated": False}
        return obs, info

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        reward = 1.0 + abs(float(obs[0]))
        current = self.current
        current["obs"].append(obs)
        current["action"].append(int(action))
        current["reward"].append(reward)
        if terminated or truncated:
            current["terminated"], current["truncated"] = bool(terminated), bool(truncated)
            self.finished.append(current)
            self.current = None
        return obs, reward, terminated, truncated, info


def make_cartpole(num_envs: int, autoreset_mode: gym.vector.AutoresetMode) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: EpisodeLog(gym.make("CartPole-v1", max_episode_steps=30)) for _ in range(num_envs)],
        autoreset_mode=autoreset_mode)


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
