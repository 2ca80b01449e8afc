"""Episodes whose every value says where it came from, and a slow reference to check samples.

An episode written by `add_encoded` stores ``obs[t] = (tag, t)``, ``action[t] =
1000 * tag + t`` and a small integer reward, so a sampled value tells which episode
and step it was read from. `Recorded` keeps what was written, keyed by the episode
id the store returned, and the `LiveTable` helpers compare samples with the store's
current episode table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import arrowbuf as ab

SCHEMA = ab.Schema({
    "obs": ab.Field("float64", (2,), observation=True),
    "action": ab.Field("int64"),
    "reward": ab.Field("float32"),
    "terminated": ab.Field("bool"),
    "truncated": ab.Field("bool"),
})


@dataclass
class Recorded:
    """What one `add_encoded` call wrote."""

    tag: int
    obs: np.ndarray          # [T(+1), 2]
    reward: np.ndarray       # [T]
    terminated: np.ndarray   # [T]
    truncated: np.ndarray    # [T]
    has_final: bool

    @property
    def transitions(self) -> int:
        return len(self.reward) if self.has_final else len(self.reward) - 1


def encoded_episode(tag: int, steps: int, has_final: bool = True, terminated: bool = True) -> dict:
    """An episode of ``steps`` steps whose values encode (tag, step)."""
    t = np.arange(steps + int(has_final))
    obs = np.stack([np.full(len(t), tag, np.float64), t.astype(np.float64)], axis=1)
    end = np.arange(steps) == steps - 1
    return {
        "obs": obs,
        "action": 1000 * tag + np.arange(steps, dtype=np.int64),
        "reward": (np.arange(steps) + 1 + 16 * (tag % 8)).astype(np.float32),
        "terminated": end & terminated,
        "truncated": end & (not terminated),
    }


def add_encoded(store: ab.ExperienceStore, recorded: dict[int, Recorded], steps: int,
                has_final: bool = True, terminated: bool = True) -> int:
    """Add one encoded episode; record it under the id the store returns."""
    tag = len(recorded)
    data = encoded_episode(tag, steps, has_final, terminated)
    episode_id = store.add_episode(data)
    assert episode_id not in recorded
    recorded[episode_id] = Recorded(tag, data["obs"], data["reward"], data["terminated"], data["truncated"],
                                    has_final)
    return episode_id


class LiveTable:
    """The store's episode table at one moment, as numpy columns."""

    def __init__(self, store: ab.ExperienceStore) -> None:
        table = store.episodes()
        self.ids = table["episode_id"].to_numpy()
        self.first_index = table["first_index"].to_numpy()
        self.length = table["length"].to_numpy()
        self.first_row = table["first_row"].to_numpy()

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
        assert (step >= 0).all() and (step < self.length[pos]).all(), "a step past its episode's transitions"
        np.testing.assert_array_equal(index, self.first_index[pos] + step)
        return pos


def tags_of(recorded: dict[int, Recorded], episode_id: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda e: recorded[int(e)].tag, otypes=[np.float64])(episode_id)


def check_batch_reads_its_rows(batch, recorded: dict[int, Recorded], live: LiveTable) -> None:
    """Indices are live and every field holds the values of its (episode, step)."""
    episode_id = batch["episode_id"].numpy()
    step = batch["step"].numpy().astype(np.int64)
    live.check_live(episode_id, step, batch["index"].numpy())
    tags = tags_of(recorded, episode_id)
    obs = batch["obs"].numpy()
    np.testing.assert_array_equal(obs[..., 0], tags)
    np.testing.assert_array_equal(obs[..., 1], step)
    np.testing.assert_array_equal(batch["next", "obs"].numpy()[..., 1], step + 1)
    np.testing.assert_array_equal(batch["next", "obs"].numpy()[..., 0], tags)
    np.testing.assert_array_equal(batch["action"].numpy(), 1000 * tags.astype(np.int64) + step)
