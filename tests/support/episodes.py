"""Tagged episodes: the one encoding the tests write, its decoder, and the check of a sample.

Step t of the episode tagged ``tag`` stores the observation ``[tag, t]``, the action
``1000 * tag + t`` and the reward ``(tag + 1) / 2 + t / 4`` (quarters: exact in float32
and float64), so any row read back, sampled, viewed or exported, says which episode and
step it came from (`decode`). An episode of T steps carries its end flag on step T - 1
and, when it has its final observation, a row T holding only ``[tag, T]``.

`add_tagged` writes one such episode and records it as an `ExpectedEpisode` under the id
the store returned; `check_batch_reads_its_rows` checks a sample against those records
and the store's current episode table (`LiveTable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

import arrowbuf as ab
from arrowbuf.played import entries_arrow


def tagged_obs(tag: int, steps: Any) -> np.ndarray:
    """Observations ``[tag, t]`` for the given steps (float64, exact for small ints)."""
    steps = np.asarray(steps, np.float64)
    return np.stack([np.full_like(steps, tag), steps], axis=-1)


def tagged_action(tag: Any, steps: Any) -> np.ndarray:
    return np.asarray(tag, np.int64) * 1000 + np.asarray(steps, np.int64)


def tagged_reward(tag: Any, steps: Any, dtype: str = "float64") -> np.ndarray:
    return ((np.asarray(tag, np.float64) + 1) * 0.5 + np.asarray(steps, np.float64) * 0.25).astype(dtype)


def decode(obs: Any) -> tuple[np.ndarray, np.ndarray]:
    """The (tag, step) of observations ``[..., 2]`` read back (numpy or torch)."""
    obs = np.asarray(obs)
    tag, step = obs[..., 0], obs[..., 1]
    assert (tag == np.round(tag)).all() and (step == np.round(step)).all(), "not a tagged observation"
    return tag.astype(np.int64), step.astype(np.int64)


def episode_schema(reward_dtype: str = "float64") -> ab.Schema:
    """The schema of `make_episode` episodes (and of `FakeVectorRollout` steps)."""
    return ab.Schema({"obs": ab.Field("float64", (2,), observation=True), "action": ab.Field("int64"),
                      "reward": ab.Field(reward_dtype), "terminated": ab.Field("bool"),
                      "truncated": ab.Field("bool")})


#: Stores that may receive an episode without its final observation first are given
#: it: inferred from such an episode, ``obs`` would be a step field (no field has T+1 rows).
EPISODE_SCHEMA = episode_schema()


def versioned_episode(versions: Any, key: int = 0) -> dict[str, np.ndarray]:
    """An episode whose steps carry ``versions`` (``policy_version``); obs[t] = (key, t) says which row it is."""
    versions = np.asarray(versions, np.int64)
    T = len(versions)
    t = np.arange(T + 1)
    return {"obs": np.stack([np.full(T + 1, key), t], axis=1).astype(np.float32),
            "action": np.full(T, key, np.int64), "reward": np.ones(T, np.float32),
            "terminated": np.arange(T) == T - 1, "truncated": np.zeros(T, bool), "policy_version": versions}


def make_episode(tag: int, steps: int, has_final: bool = True, terminated: bool = True,
                 truncated: bool = False, reward_dtype: str = "float64") -> dict[str, np.ndarray]:
    """A flat episode dict of numpy arrays encoding ``tag`` and the step in its values."""
    t = np.arange(steps)
    end = t == steps - 1
    return {
        "obs": tagged_obs(tag, np.arange(steps + int(has_final))),
        "action": tagged_action(tag, t),
        "reward": tagged_reward(tag, t, reward_dtype),
        "terminated": end & terminated,
        "truncated": end & truncated,
    }


@dataclass
class ExpectedEpisode:
    """One tagged episode: what was written, and where the store should hold it."""

    tag: int
    steps: int
    has_final: bool
    terminated: bool = False
    truncated: bool = False
    env_id: str = "default"
    episode_id: int = -1
    first_row: int = -1
    reward_dtype: str = "float64"
    first_step: int = 0   # the first step still held (its oldest went to the capacity)

    @property
    def num_rows(self) -> int:
        return self.steps + int(self.has_final) - self.first_step

    @property
    def length(self) -> int:
        """Transitions held: steps that have a next observation."""
        return (self.steps if self.has_final else self.steps - 1) - self.first_step

    @property
    def ret(self) -> float:
        return float(np.sum(tagged_reward(self.tag, np.arange(self.first_step, self.steps)), dtype=np.float64))

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """The episode as `make_episode` writes it."""
        return make_episode(self.tag, self.steps, self.has_final, self.terminated, self.truncated,
                            self.reward_dtype)


def add_tagged(store: ab.ExperienceStore, recorded: dict[int, ExpectedEpisode], steps: int,
               has_final: bool = True, terminated: bool = True, reward_dtype: str = "float64") -> int:
    """Add the episode tagged ``len(recorded)``, ending terminated (else truncated);
    record it under the id the store returns."""
    episode = ExpectedEpisode(len(recorded), steps, has_final, terminated, not terminated,
                              reward_dtype=reward_dtype)
    episode.episode_id = store.add_episode(episode.arrays)
    assert episode.episode_id not in recorded
    recorded[episode.episode_id] = episode
    return episode.episode_id


class LiveTable:
    """The store's episode table at one moment, as numpy columns."""

    def __init__(self, store: ab.ExperienceStore) -> None:
        table = store.episodes()
        pieces = len(entries_arrow(store.engine.table)) if store.engine.table is not None else 0
        # A played episode of several pieces (a writer's, cut by its region) is one row here whose
        # steps are not contiguous in the arena: `rows` would be wrong. Read the pieces instead.
        assert pieces == len(table), (f"LiveTable reads whole episodes; this store holds {pieces} pieces of "
                                      f"{len(table)} episodes: read entries_arrow(store.engine.table)")
        self.ids = table["episode_id"].to_numpy()
        self.first_index = table["first_index"].to_numpy()
        self.length = table["length"].to_numpy()
        self.first_row = table["first_row"].to_numpy()
        self.first_step = table["first_step"].to_numpy() if "first_step" in table.column_names \
            else np.zeros(len(self.ids), np.int64)

    def position(self, episode_id: np.ndarray) -> np.ndarray:
        """Positions of ``episode_id`` in the table; fails unless every id is live."""
        episode_id = np.asarray(episode_id)
        pos = np.searchsorted(self.ids, episode_id)
        live = (pos < len(self.ids)) & (self.ids[np.minimum(pos, len(self.ids) - 1)] == episode_id)
        assert live.all(), f"stale episode ids {np.unique(episode_id[~live]).tolist()}, live {self.ids.tolist()}"
        return pos

    def indices(self) -> np.ndarray:
        """Every live transition index, oldest first."""
        if not len(self.ids):
            return np.zeros(0, np.int64)
        return np.concatenate([f + np.arange(n) for f, n in zip(self.first_index, self.length)])

    def rows(self) -> np.ndarray:
        """Arena rows of every live transition, in the order of `indices`."""
        if not len(self.ids):
            return np.zeros(0, np.int64)
        return np.concatenate([f + np.arange(n) for f, n in zip(self.first_row, self.length)])

    def check_live(self, episode_id: np.ndarray, step: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Every (episode, step, index) is a live transition; returns the positions."""
        pos = self.position(episode_id)
        local = step - self.first_step[pos]   # a piece whose oldest steps went holds from its first_step
        assert (local >= 0).all() and (local < self.length[pos]).all(), "a step past its episode's transitions"
        np.testing.assert_array_equal(index, self.first_index[pos] + local)
        return pos


def tags_of(recorded: dict[int, ExpectedEpisode], episode_id: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda e: recorded[int(e)].tag, otypes=[np.int64])(episode_id)


def check_batch_reads_its_rows(batch: Any, recorded: dict[int, ExpectedEpisode], live: LiveTable) -> None:
    """Indices are live and every field holds the values of its (episode, step).

    Works for batches of any shape (windows, whole episodes); the reward is checked
    when it is the step's own (no ``n_step`` lookahead).
    """
    episode_id = batch["episode_id"].numpy()
    step = batch["step"].numpy().astype(np.int64)
    live.check_live(episode_id, step, batch["index"].numpy())
    tags = tags_of(recorded, episode_id)
    for key, offset in (("obs", 0), (("next", "obs"), 1)):
        tag_read, step_read = decode(batch[key].numpy())
        np.testing.assert_array_equal(tag_read, tags, err_msg=str(key))
        np.testing.assert_array_equal(step_read, step + offset, err_msg=str(key))
    np.testing.assert_array_equal(batch["action"].numpy(), tagged_action(tags, step))
    if "n_steps" not in batch.keys():
        reward = batch["reward"].numpy()
        np.testing.assert_array_equal(reward, tagged_reward(tags, step, reward.dtype))
