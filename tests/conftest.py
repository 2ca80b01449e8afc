"""Shared fakes, models and checks for the arrowbuf tests.

Episodes used across the tests carry their identity in their values: the
observation of step t of the episode tagged ``tag`` is ``[tag, t]`` and its action
is ``tag * 1000 + t``, so any row read back (sampled, viewed or exported) says
which episode and step it came from.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from hypothesis import HealthCheck, settings
import numpy as np
import pyarrow as pa
import pytest
import torch

import arrowbuf as ab
from arrowbuf.errors import EmptyStoreError

# CI (CI=true) replays the same examples every run and tolerates slow data generation
# on a loaded 2-core box; locally hypothesis explores new examples each run.
settings.register_profile("ci", derandomize=True, suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    # When a property fails, hypothesis imports libcst to suggest an @example patch;
    # libcst uses the deprecated mypy_extensions.TypedDict, and with warnings as
    # errors that turns a failing test into a pytest INTERNALERROR.
    config.addinivalue_line("filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


# -- tagged episodes -------------------------------------------------------------------


def tagged_obs(tag: int, steps: np.ndarray) -> np.ndarray:
    """Observations ``[tag, t]`` for the given steps (float64, exact for small ints)."""
    steps = np.asarray(steps, np.float64)
    return np.stack([np.full_like(steps, tag), steps], axis=-1)


def tagged_action(tag: int, steps: np.ndarray) -> np.ndarray:
    return tag * 1000 + np.asarray(steps, np.int64)


def tagged_reward(tag: int, steps: np.ndarray) -> np.ndarray:
    return (tag + 1) * 0.5 + np.asarray(steps, np.float64) * 0.25


#: The schema of `make_episode` (and of `FakeVectorRollout` steps). Stores that may
#: receive an episode without its final observation first are given it: inferred
#: from such an episode, ``obs`` would be a step field (no field has T+1 rows).
EPISODE_SCHEMA = ab.Schema({"obs": ab.Field("float64", (2,), observation=True), "action": ab.Field("int64"),
                            "reward": ab.Field("float64"), "terminated": ab.Field("bool"),
                            "truncated": ab.Field("bool")})


@dataclass
class ExpectedEpisode:
    """What the store should hold for one episode."""

    tag: int
    steps: int
    has_final: bool
    terminated: bool = False
    truncated: bool = False
    env_id: str = "default"
    episode_id: int = -1
    first_row: int = -1

    @property
    def num_rows(self) -> int:
        return self.steps + int(self.has_final)

    @property
    def length(self) -> int:
        """Transitions: steps that have a next observation."""
        return self.steps if self.has_final else self.steps - 1

    @property
    def ret(self) -> float:
        return float(np.sum(tagged_reward(self.tag, np.arange(self.steps)), dtype=np.float64))


def make_episode(tag: int, steps: int, has_final: bool = True, terminated: bool = True,
                 truncated: bool = False) -> dict[str, np.ndarray]:
    """A flat episode dict of numpy arrays encoding ``tag`` and the step in its values."""
    t = np.arange(steps)
    flags = np.zeros(steps, bool)
    term, trunc = flags.copy(), flags.copy()
    term[-1], trunc[-1] = terminated, truncated
    return {
        "obs": tagged_obs(tag, np.arange(steps + int(has_final))),
        "action": tagged_action(tag, t),
        "reward": tagged_reward(tag, t),
        "terminated": term,
        "truncated": trunc,
    }


# -- a reference model of the ring -----------------------------------------------------


def reference_plan(live: list[tuple[int, int]], write_pos: int, capacity: int, rows: int) -> tuple[int, int]:
    """Slow, obviously-correct placement: the DESIGN rule written out row by row.

    The episode goes at ``write_pos`` when the tail can hold it, else at row 0; then
    the shortest prefix of the oldest episodes is evicted so that no remaining live
    episode shares a row with it (FIFO: a newer episode never goes before an older one).
    """
    start = write_pos if write_pos + rows <= capacity else 0
    span = set(range(start, start + rows))
    evicted = 0
    for i, (first, num_rows) in enumerate(live):
        if span & set(range(first, first + num_rows)):
            evicted = i + 1
    return start, evicted


@dataclass
class RingModel:
    """The live episodes a store of ``capacity`` rows should hold, by `reference_plan`."""

    capacity: int
    mode: str = "circular"
    live: list[ExpectedEpisode] = field(default_factory=list)
    added: list[ExpectedEpisode] = field(default_factory=list)
    write_pos: int = 0

    def fits(self, episode: ExpectedEpisode) -> bool:
        if episode.num_rows > self.capacity:
            return False
        _, evicted = reference_plan([(e.first_row, e.num_rows) for e in self.live], self.write_pos,
                                    self.capacity, episode.num_rows)
        return not (evicted and self.mode == "fixed")

    def add(self, episode: ExpectedEpisode) -> None:
        start, evicted = reference_plan([(e.first_row, e.num_rows) for e in self.live], self.write_pos,
                                        self.capacity, episode.num_rows)
        episode.first_row = start
        episode.episode_id = len(self.added)
        self.live = self.live[evicted:] + [episode]
        self.added.append(episode)
        self.write_pos = start + episode.num_rows

    def clear(self) -> None:
        self.live = []
        self.write_pos = 0


# -- reading values back ---------------------------------------------------------------


def column_numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Values of an Arrow column as numpy, for any arrowbuf column (bool tensors included)."""
    if isinstance(column, pa.ChunkedArray):
        parts = [column_numpy(chunk) for chunk in column.chunks]
        return np.concatenate(parts) if parts else np.empty(0)
    if isinstance(column.type, pa.FixedShapeTensorType):
        shape = tuple(column.type.shape)
        values = column.storage.flatten().to_numpy(zero_copy_only=False)
        return values.reshape((len(column), *shape))
    return column.to_numpy(zero_copy_only=False)


def snapshot(store: ab.ExperienceStore) -> dict[str, Any]:
    """A deep copy of everything observable about a store's contents.

    Copies, not views: `to_arrow` and `episode` are zero-copy views of the arena, so a
    view taken before a call would change along with the store.
    """
    episodes = store.episodes()
    rows = store.to_arrow()
    return {
        "len": len(store),
        "num_episodes": store.num_episodes,
        "schema": store.schema,
        "episodes": pa.Table.from_pylist(episodes.to_pylist(), schema=episodes.schema),
        "rows": {name: column_numpy(rows.column(name)).copy() for name in rows.column_names},
    }


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after["len"] == before["len"]
    assert after["num_episodes"] == before["num_episodes"]
    assert after["schema"] == before["schema"]
    assert after["episodes"].equals(before["episodes"])
    assert after["rows"].keys() == before["rows"].keys()
    for name, values in before["rows"].items():
        np.testing.assert_array_equal(after["rows"][name], values, err_msg=name)


def assert_same_batches(a: Any, b: Any) -> None:
    """Two sampled TensorDicts hold the same keys, dtypes and values."""
    keys = sorted(a.keys(True, True), key=str)
    assert keys == sorted(b.keys(True, True), key=str)
    for key in keys:
        assert a.get(key).dtype == b.get(key).dtype, key
        same = torch.equal(a.get(key), b.get(key))
        assert same, f"sampled {key!r} differs"


# -- the big consistency check ---------------------------------------------------------


def assert_store_matches(store: ab.ExperienceStore, model: RingModel, *, sample_size: int = 64,
                         epoch_batch: int = 7) -> None:
    """Check a store holding tagged episodes against its reference model, exhaustively.

    Checks the episode table (ids, placement, lengths, flags, returns), the ring
    invariants (episodes contiguous, inside the arena, disjoint), each episode's rows,
    `to_arrow`, uniform samples (``next`` observations, steps, actions) and one
    shuffled epoch of `iter_batches` (every live transition exactly once).
    """
    table = store.episodes()
    ids = table.column("episode_id").to_pylist()
    live = model.live
    # FIFO: the live ids are a suffix of every id ever added, in order.
    all_ids = [e.episode_id for e in model.added]
    assert ids == all_ids[len(all_ids) - len(ids):]
    assert ids == [e.episode_id for e in live]
    assert table.column("first_row").to_pylist() == [e.first_row for e in live]
    assert table.column("num_rows").to_pylist() == [e.num_rows for e in live]
    assert table.column("length").to_pylist() == [e.length for e in live]
    assert table.column("has_final").to_pylist() == [e.has_final for e in live]
    assert table.column("terminated").to_pylist() == [e.terminated for e in live]
    assert table.column("truncated").to_pylist() == [e.truncated for e in live]
    assert table.column("env_id").to_pylist() == [e.env_id for e in live]
    np.testing.assert_allclose(table.column("return").to_numpy(), [e.ret for e in live], rtol=1e-12)

    # The ring never splits an episode: every episode is one run of rows in [0, capacity).
    spans = sorted((e.first_row, e.first_row + e.num_rows) for e in live)
    for first, stop in spans:
        assert 0 <= first < stop <= model.capacity
    for (_, stop), (first, _) in zip(spans, spans[1:]):
        assert stop <= first

    assert len(store) == sum(table.column("length").to_pylist()) == sum(e.length for e in live)
    assert store.num_episodes == table.num_rows == len(live)

    for e in live:
        batch = store.episode(e.episode_id)
        assert batch.num_rows == e.num_rows
        steps = np.arange(e.num_rows)
        np.testing.assert_array_equal(column_numpy(batch.column("obs")), tagged_obs(e.tag, steps))
        action = np.zeros(e.num_rows, np.int64)
        action[:e.steps] = tagged_action(e.tag, np.arange(e.steps))
        np.testing.assert_array_equal(column_numpy(batch.column("action")), action)
        np.testing.assert_array_equal(column_numpy(batch.column("step")), steps)
        np.testing.assert_array_equal(column_numpy(batch.column("episode_id")), np.full(e.num_rows, e.episode_id))
        np.testing.assert_array_equal(column_numpy(batch.column("is_first")), steps == 0)
        np.testing.assert_array_equal(column_numpy(batch.column("is_last")), steps == e.num_rows - 1)

    rows = store.to_arrow()
    assert rows.num_rows == sum(e.num_rows for e in live)
    if live:
        np.testing.assert_array_equal(column_numpy(rows.column("episode_id")),
                                      np.concatenate([np.full(e.num_rows, e.episode_id) for e in live]))
        np.testing.assert_array_equal(column_numpy(rows.column("obs")),
                                      np.concatenate([tagged_obs(e.tag, np.arange(e.num_rows)) for e in live]))

    tag_of = {e.episode_id: e.tag for e in live}
    length_of = {e.episode_id: e.length for e in live}
    if len(store) == 0:
        with pytest.raises(EmptyStoreError):
            store.sample(sample_size)
    else:
        batch = store.sample(sample_size)
        assert_transitions_consistent(batch, tag_of, length_of)

    expected = {(e.episode_id, t) for e in live for t in range(e.length)}
    seen: list[tuple[int, int]] = []
    for batch in store.iter_batches(epoch_batch, shuffle=True):
        assert 1 <= batch.batch_size[0] <= epoch_batch
        assert_transitions_consistent(batch, tag_of, length_of)
        seen += list(zip(batch["episode_id"].tolist(), batch["step"].tolist()))
    assert len(seen) == len(set(seen)), "a transition came twice in one epoch"
    assert set(seen) == expected


def assert_transitions_consistent(batch: Any, tag_of: dict[int, int], length_of: dict[int, int]) -> None:
    """Every sampled transition is live, and its fields come from its own episode and step."""
    episode_id = batch["episode_id"].numpy()
    step = batch["step"].numpy().astype(np.int64)
    assert set(episode_id.tolist()) <= set(tag_of)
    tags = np.array([tag_of[i] for i in episode_id.tolist()])
    lengths = np.array([length_of[i] for i in episode_id.tolist()])
    assert np.all((step >= 0) & (step < lengths))
    np.testing.assert_array_equal(batch["obs"].numpy(), np.stack([tags, step], -1).astype(np.float64))
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), np.stack([tags, step + 1], -1).astype(np.float64))
    np.testing.assert_array_equal(batch["action"].numpy(), tags * 1000 + step)
    np.testing.assert_allclose(batch["reward"].numpy(), (tags + 1) * 0.5 + step * 0.25)


# -- a synthetic vectorized environment for the writer ----------------------------------


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


# -- a real gymnasium environment that logs its own episodes ----------------------------


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


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture
def filled_store() -> tuple[ab.ExperienceStore, RingModel]:
    """A circular store of 40 rows that has wrapped and evicted, with its model."""
    store = ab.ExperienceStore(capacity=40, seed=7)
    model = RingModel(40)
    for tag, (steps, has_final) in enumerate([(6, True), (9, True), (4, False), (12, True), (7, True), (5, True)]):
        store.add_episode(make_episode(tag, steps, has_final))
        model.add(ExpectedEpisode(tag, steps, has_final, terminated=True))
    return store, model


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session (2 CPUs, like CI)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def kill_and_wait(handle, seconds: float = 60.0) -> None:
    """ray.kill returns before the actor is gone: wait until calls to it fail."""
    import ray

    ray.kill(handle)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ping.remote(), timeout=seconds)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor still answers {seconds} s after ray.kill")
