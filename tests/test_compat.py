"""arrowbuf.compat: RLightning's DataBuffer driven the way its engines drive it.

Fake env workers put their identity in every value: sub-env ``i`` of worker ``w``
has code ``c = 100 * w + i``; its observation at step t is ``[c, t]``, the policy's
action is ``1000 * c + t`` and the reward of that action is ``action / 2``, so a
stored transition says which env and step it came from and whether its next
observation, reward and flags are aligned.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch

import arrowbuf.types as ab_types
from arrowbuf.compat import (
    BatchedData,
    BufferFullError,
    DataBuffer,
    EnvMeta,
    EnvRet,
    PolicyResponse,
    ReplayBuffer,
    RolloutBuffer,
    parse_config,
    resolve,
)

from arrowbuf.compat.data_buffer import MAX_STAGE_ROWS
from arrowbuf.compat.staging import Stage
from support.envs import make_cartpole


class TaggedWorker:
    """A vectorized env worker (``num_envs=None``: a plain, unvectorized env).

    Every sub-env's episode lasts ``episode_steps`` steps (never, if None); the
    step that ends it returns ``last_truncated`` and the final observation, and
    the next step resets that sub-env (reward 0, no flags), as gymnasium's
    ``next_step`` autoreset does.
    """

    def __init__(self, worker: int, num_envs: int | None = None, episode_steps: int | None = None) -> None:
        self.env_id = f"w{worker}"
        self.vector = num_envs is not None
        n = num_envs or 1
        self.codes = 100 * worker + np.arange(n)
        self.episode_steps = episode_steps
        self.t = np.zeros(n, np.int64)
        self.resetting = np.zeros(n, bool)

    def _obs(self) -> np.ndarray:
        return np.stack([self.codes, self.t], axis=-1).astype(np.float32)

    def _out(self, value):
        return value if self.vector else value[0]

    def reset(self) -> EnvRet:
        self.t[:] = 0
        self.resetting[:] = False
        return EnvRet(self.env_id, self._out(self._obs()))   # dummy last_* of a reset

    def step(self, action) -> EnvRet:
        action = np.atleast_1d(np.asarray(action))
        reward = np.where(self.resetting, 0.0, action / 2).astype(np.float32)
        self.t = np.where(self.resetting, 0, self.t + 1)
        truncated = ~self.resetting & (self.t == self.episode_steps if self.episode_steps else False)
        self.resetting = truncated.copy()
        return EnvRet(self.env_id, self._out(self._obs()), last_reward=self._out(reward),
                      last_terminated=self._out(np.zeros_like(truncated)), last_truncated=self._out(truncated))


def policy(env_ret: EnvRet) -> PolicyResponse:
    obs = np.asarray(env_ret.observation)
    action = (obs[..., 0] * 1000 + obs[..., 1]).astype(np.int64)
    return PolicyResponse(env_ret.env_id, action=action, value=(obs[..., 1] * 0.5).astype(np.float32))


def sync_rollout(buffer: DataBuffer, workers: list[TaggedWorker], max_rollout_steps: int) -> None:
    """SyncRLEngine.rollout: reset, then step; every step added; truncation on the last one."""
    ids = [w.env_id for w in workers]
    responses = None
    for step in range(max_rollout_steps + 1):
        if responses is None:
            env_rets = BatchedData(ids, [w.reset() for w in workers])
        else:
            env_rets = BatchedData(ids, [w.step(responses[w.env_id].action) for w in workers])
        responses = BatchedData(ids, [policy(r) for r in env_rets.values()])
        truncations = [step == max_rollout_steps] * len(workers)
        buffer.add_batched_transition(env_rets, responses, truncations)


def assert_tagged_transitions(batch) -> None:
    """Every transition's next observation, action, reward and value belong to its own env and step."""
    obs, nxt = batch["observation"].numpy(), batch["next_observation"].numpy()
    code, t = obs[:, 0].astype(np.int64), obs[:, 1].astype(np.int64)
    np.testing.assert_array_equal(nxt[:, 0], obs[:, 0])
    np.testing.assert_array_equal(nxt[:, 1], obs[:, 1] + 1)
    np.testing.assert_array_equal(batch["action"].numpy(), code * 1000 + t)
    np.testing.assert_array_equal(batch["reward"].numpy(), ((code * 1000 + t) / 2).astype(np.float32))
    np.testing.assert_array_equal(batch["value"].numpy(), t * 0.5)
    np.testing.assert_array_equal(batch["step"].numpy(), t)


def rollout_config(**overrides) -> dict:
    config = {"type": "RolloutBuffer", "capacity": 1000, "sampler": {"type": "all"}}
    config.update(overrides)
    return config


# -- the sync engine ------------------------------------------------------------------------


def test_a_sync_rollout_of_vector_envs_stores_each_sub_env_window_as_its_transitions():
    workers = [TaggedWorker(0, num_envs=3), TaggedWorker(1, num_envs=3)]
    buffer = DataBuffer(rollout_config(), seed=0, num_train_workers=2)
    assert isinstance(buffer, RolloutBuffer)
    buffer.init([EnvMeta(w.env_id, num_envs=3) for w in workers], [w.env_id for w in workers])

    sync_rollout(buffer, workers, max_rollout_steps=5)

    assert len(buffer) == buffer.size() == 2 * 3 * 5
    episodes = buffer.store.episodes()
    assert episodes.column("env_id").to_pylist() == ["w0/0", "w0/1", "w0/2", "w1/0", "w1/1", "w1/2"]
    assert episodes.column("length").to_pylist() == [5] * 6
    everything = buffer.get_all()
    assert everything.batch_size == (30,)
    assert_tagged_transitions(everything)
    expected_codes = np.repeat([0, 1, 2, 100, 101, 102], 5)
    np.testing.assert_array_equal(everything["observation"][:, 0].numpy(), expected_codes)
    assert not everything["terminated"].any() and not everything["truncated"].any()


def test_rollouts_of_changing_lengths_reuse_the_staging_rows_without_mixing_them_up():
    # Staging starts with room for a rollout of the capacity (167 records); a finished segment's rows are
    # reused by the env's next one.
    workers = [TaggedWorker(0, num_envs=3), TaggedWorker(1, num_envs=3)]
    buffer = DataBuffer(rollout_config(), seed=0, num_train_workers=1)
    buffer.init([EnvMeta(w.env_id, num_envs=3) for w in workers])
    for steps in (40, 3, 70, 5):
        sync_rollout(buffer, workers, max_rollout_steps=steps)
        batch, = buffer.sample(batch_size=None, shuffle=False)
        assert batch.batch_size == (2 * 3 * steps,) and len(buffer) == 0
        assert_tagged_transitions(batch)
        np.testing.assert_array_equal(np.sort(batch["observation"][:, 1].numpy()),
                                      np.repeat(np.arange(steps), 6))
    buffer.clear()                                       # clear keeps the memory, not the rows
    sync_rollout(buffer, workers[:1], max_rollout_steps=4)
    assert len(buffer) == 12
    assert_tagged_transitions(buffer[:])


@pytest.mark.parametrize("kind, capacity, steps, rows, grown", [
    ("RolloutBuffer", 2 * 3 * 100, 100, 101, 101), ("RolloutBuffer", 2 * 3 * 20, 20, 32, 32),
    ("RolloutBuffer", 10**7, 100, MAX_STAGE_ROWS, MAX_STAGE_ROWS), ("ReplayBuffer", 600, 100, 32, 128)])
def test_a_rollout_buffers_first_rollout_is_staged_in_rows_sized_by_its_capacity(monkeypatch, kind, capacity, steps,
                                                                                  rows, grown):
    """A RolloutBuffer's capacity is its rollout's transitions (num_envs x T, as the seed sizes it): a
    fresh staging starts with room for the rollout's records (at least 32, at most MAX_STAGE_ROWS) and
    does not grow (each growth copied every record staged). A ReplayBuffer's starts at 32 and grows."""
    stages, first = [], {}
    write = Stage.write

    def spied(stage, *args):
        row = write(stage, *args)
        if row == 0:
            stages.append(stage)
            first[id(stage)] = dict(stage.columns)
        return row

    monkeypatch.setattr(Stage, "write", spied)
    workers = [TaggedWorker(0, num_envs=3), TaggedWorker(1, num_envs=3)]
    buffer = DataBuffer({"type": kind, "capacity": capacity, "sampler": {"type": "all"}}, seed=0, num_train_workers=1)
    buffer.init([EnvMeta(w.env_id, num_envs=3) for w in workers])
    sync_rollout(buffer, workers, max_rollout_steps=steps)
    assert len(stages) == 2
    for stage in stages:
        staged = first[id(stage)]
        assert {len(column) for column in staged.values()} == {rows}
        assert {len(column) for column in stage.columns.values()} == {grown}
    assert len(buffer) == 2 * 3 * steps
    assert_tagged_transitions(buffer[:])


def test_sampling_a_rollout_buffer_gives_every_transition_once_per_worker_and_clears_it():
    workers = [TaggedWorker(0, num_envs=3), TaggedWorker(1, num_envs=3)]
    buffer = DataBuffer(rollout_config(), seed=0, num_train_workers=2)
    buffer.init([EnvMeta(w.env_id, num_envs=3) for w in workers])
    for _ in range(2):   # two epochs: the arena is reused after the clear
        sync_rollout(buffer, workers, max_rollout_steps=5)
        batches = buffer.sample(batch_size=30)
        assert [b.batch_size for b in batches] == [torch.Size([15]), torch.Size([15])]
        for batch in batches:
            assert_tagged_transitions(batch)
        seen = {tuple(row) for b in batches for row in b["observation"].tolist()}
        assert len(seen) == 30
        assert len(buffer) == 0


def test_rewards_and_dones_of_a_step_come_from_the_next_records_last_values():
    buffer = ReplayBuffer({"capacity": 100}, seed=0)
    rewards = [0.0, 1.5, 2.5, 3.5]            # the reset's reward is a dummy
    terminated = [False, False, False, True]
    for t in range(4):
        env_ret = EnvRet("solo", np.array([t, -t], np.float32), last_reward=rewards[t],
                         last_terminated=terminated[t], info={"note": "dropped"})
        buffer.add_transition("solo", env_ret, PolicyResponse("solo", action=np.int64(10 + t)), truncated=t == 3)

    batch = buffer[:]
    np.testing.assert_array_equal(batch["observation"].numpy(), [[0, 0], [1, -1], [2, -2]])
    np.testing.assert_array_equal(batch["next_observation"].numpy(), [[1, -1], [2, -2], [3, -3]])
    np.testing.assert_array_equal(batch["reward"].numpy(), [1.5, 2.5, 3.5])
    assert batch["reward"].dtype == torch.float32          # Python floats, as torch.tensor makes them
    np.testing.assert_array_equal(batch["terminated"].numpy(), [False, False, True])
    np.testing.assert_array_equal(batch["action"].numpy(), [10, 11, 12])   # the last record's action is dropped
    assert "info" not in batch.keys()
    assert buffer[-1]["action"].item() == 12 and buffer[0].batch_size == torch.Size([])
    with pytest.raises(IndexError, match="index 3 out of range"):
        buffer[3]


# -- the async engines ------------------------------------------------------------------------


def test_async_pairing_stores_the_same_transitions_as_sync_with_per_env_truncations():
    workers = [TaggedWorker(0, episode_steps=3), TaggedWorker(1, episode_steps=4)]
    ids = [w.env_id for w in workers]
    buffer = DataBuffer({"type": "ReplayBuffer", "capacity": 1000}, seed=0)
    buffer.init([EnvMeta(w.env_id) for w in workers], ids)
    env_rets = BatchedData(ids, [w.reset() for w in workers])
    for _ in range(13):   # AsyncRLEngine's rollout thread
        buffer.add_batched_data_async(env_rets)
        responses = BatchedData(ids, [policy(r) for r in env_rets.values()])
        truncations = [bool(r.last_truncated) for r in env_rets.values()]
        buffer.add_batched_data_async(responses, truncations)
        env_rets = BatchedData(ids, [w.step(responses[w.env_id].action) for w in workers])

    episodes = buffer.store.episodes()
    assert episodes.column("env_id").to_pylist() == ["w0", "w1", "w0", "w1", "w0"]
    assert episodes.column("length").to_pylist() == [3, 4, 3, 4, 3]
    assert episodes.column("truncated").to_pylist() == [True] * 5
    batch = buffer.get_all()
    assert_tagged_transitions(batch)
    last_steps = batch["step"].numpy() == np.where(batch["observation"][:, 0].numpy() == 0, 2, 3)
    np.testing.assert_array_equal(batch["truncated"].numpy(), last_steps)


def test_rsl_rl_rollouts_share_their_boundary_env_return_and_a_waiting_one_survives_a_truncation():
    """RSL-RL's pattern: the rollout's last EnvRet (answered) ends it and is re-added as the next one's first."""
    worker = TaggedWorker(0, num_envs=2)
    buffer = RolloutBuffer({"capacity": 100, "storage": {"unit": "episode"}, "sampler": {"type": "batch"}}, seed=0)
    buffer.init([{"env_id": "w0", "num_envs": 2}])
    env_ret = worker.reset()
    for rollout in range(2):
        for step in range(5):                      # 4 steps, then the final EnvRet and its response
            buffer.add_data_async("w0", env_ret)
            response = policy(env_ret)
            buffer.add_data_async("w0", response)
            if step < 4:
                env_ret = worker.step(response.action)
        buffer.truncate_episodes(["w0"])
        assert len(buffer) == 2                    # one episode per sub-env
        batch, = buffer.sample(batch_size=2)
        assert batch.batch_size == (2, 4) and batch["mask"].all()
        assert batch["observation"][:, :, 1].tolist() == [list(range(4 * rollout, 4 * rollout + 4))] * 2
        assert batch["next_observation"][:, -1, 1].tolist() == [4 * rollout + 4] * 2
        assert len(buffer) == 0                    # a RolloutBuffer clears after sampling

    buffer.add_data_async("w0", env_ret)           # waits for its response ...
    buffer.truncate_episodes(["w0"])               # ... through a truncation (nothing paired: nothing stored)
    buffer.add_data_async("w0", policy(env_ret))   # and pairs with it after
    with pytest.raises(ValueError, match="PolicyResponse arrived with no EnvRet waiting"):
        buffer.add_data_async("w0", policy(env_ret))


# -- auto truncation with a real environment ---------------------------------------------------


@pytest.mark.parametrize("vectorized", [True, False], ids=["vector-env", "single-env"])
def test_auto_truncate_with_cartpole_stores_exactly_the_episodes_the_env_played(vectorized):
    buffer = ReplayBuffer({"capacity": 10_000, "auto_truncate_episode": True}, seed=0)
    rng = np.random.default_rng(0)
    if vectorized:
        envs = make_cartpole(3, gym.vector.AutoresetMode.NEXT_STEP)
        logs = [env for env in envs.envs]
        buffer.init([EnvMeta("cartpole", num_envs=3)], ["cartpole"])
        obs, _ = envs.reset(seed=0)
        env_ret = EnvRet("cartpole", obs)
        for _ in range(150):
            action = rng.integers(0, 2, size=3)
            buffer.add_transition("cartpole", env_ret, PolicyResponse("cartpole", action=action))
            waiting = np.asarray(env_ret.last_terminated) | np.asarray(env_ret.last_truncated)
            obs, reward, terminated, truncated, _ = envs.step(action)   # next_step autoreset: done -> reset next
            env_ret = EnvRet("cartpole", obs, reward, terminated, truncated)
        env_ids = [f"cartpole/{i}" for i in range(3)]
        # The default reading (autoreset_mode="auto") is told next-step from same-step by the record
        # after a done one (the reset's reward of 0): an episode that ended on the last record added
        # is stored with the next record (or at a truncation).
        for log, wait in zip(logs, waiting):
            if wait:
                log.finished.pop()
    else:
        from support.envs import EpisodeLog

        env = EpisodeLog(gym.make("CartPole-v1", max_episode_steps=15))
        logs = [env]
        obs, _ = env.reset(seed=0)
        env_ret, done = EnvRet("cartpole", obs), False
        for _ in range(150):
            action = np.int64(rng.integers(0, 2))
            buffer.add_transition("cartpole", env_ret, PolicyResponse("cartpole", action=action))
            if done:   # the engine resets: a reset EnvRet carries a dummy reward
                obs, _ = env.reset()
                env_ret, done = EnvRet("cartpole", obs), False
            else:
                obs, reward, terminated, truncated, _ = env.step(int(action))
                env_ret, done = EnvRet("cartpole", obs, reward, terminated, truncated), terminated or truncated
        env_ids = ["cartpole"]

    table = buffer.store.episodes()
    rows = buffer.get_all()
    episode_of_row = rows["episode_id"].numpy()
    flags = set()
    for env_id, log in zip(env_ids, logs):
        stored = [i for i, e in enumerate(table.column("env_id").to_pylist()) if e == env_id]
        assert len(stored) == len(log.finished) >= 3
        for position, played in zip(stored, log.finished):
            mine = rows[torch.from_numpy(episode_of_row == table.column("episode_id")[position].as_py())]
            played_obs = np.stack(played["obs"])
            np.testing.assert_array_equal(mine["observation"].numpy(), played_obs[:-1])
            np.testing.assert_array_equal(mine["next_observation"].numpy(), played_obs[1:])
            np.testing.assert_array_equal(mine["action"].numpy(), played["action"])
            np.testing.assert_allclose(mine["reward"].numpy(), played["reward"], rtol=1e-6)
            assert mine["terminated"].tolist() == [False] * (len(mine) - 1) + [played["terminated"]]
            assert mine["truncated"].tolist() == [False] * (len(mine) - 1) + [played["truncated"]]
            flags.add((played["terminated"], played["truncated"]))
    assert any(term for term, _ in flags) and any(trunc for _, trunc in flags)   # both kinds of ends

    open_before = len(buffer)
    buffer.truncate_episodes(["cartpole"])   # cuts the open episodes ...
    buffer.truncate_episodes(["cartpole"])   # ... and again: nothing open, no KeyError (the seed raised)
    buffer.truncate_one_episode(env_ids[-1])
    assert len(buffer) > open_before


# -- units, modes, sampling ---------------------------------------------------------------------


def add_tagged_episodes(buffer: DataBuffer, lengths: list[int]) -> None:
    """One unvectorized env per length: an episode of that many transitions each, in order."""
    for k, steps in enumerate(lengths):
        worker = TaggedWorker(k)
        env_ret = worker.reset()
        for t in range(steps + 1):
            response = policy(env_ret)
            buffer.add_transition(worker.env_id, env_ret, response, truncated=t == steps)
            env_ret = worker.step(response.action)


def test_the_episode_unit_counts_episodes_and_reads_them_whole_in_insertion_order():
    buffer = ReplayBuffer({"capacity": 100, "storage": {"unit": "episode"}, "sampler": {"type": "batch"}},
                          seed=0, num_train_workers=2)
    add_tagged_episodes(buffer, [3, 5, 2])
    assert len(buffer) == 3 and buffer.store is not None and len(buffer.store) == 10

    first = buffer[0]
    assert first.batch_size == (3,)
    assert_tagged_transitions(first)
    ragged = buffer[[2, -2]]
    assert ragged.batch_size == (2, 5)
    np.testing.assert_array_equal(ragged["mask"].sum(1).numpy(), [2, 5])
    assert ragged["observation"][0, :, 0].tolist() == [200.0] * 5   # padded with the last step
    assert_tagged_transitions(ragged[1])
    assert buffer.get({"storage_idx": 0, "indices": [1]})["observation"][0, 0, 0].item() == 100

    batches = buffer.sample(batch_size=2)
    assert [b.batch_size[0] for b in batches] == [1, 1]
    assert len(buffer) == 3                       # a ReplayBuffer keeps its data
    with pytest.raises(ValueError, match="not enough data in the buffer for a batch of 4: it holds 3 episodes"):
        buffer.sample(batch_size=4)


def test_uniform_sampling_is_seeded_and_split_into_one_batch_per_train_worker():
    def sampled(seed: int) -> list:
        buffer = ReplayBuffer({"capacity": 100}, seed=seed, num_train_workers=3)
        add_tagged_episodes(buffer, [4, 6])
        batches = buffer.sample(batch_size=10, drop_last=True)
        assert [b.batch_size[0] for b in batches] == [3, 3, 3]
        padded = buffer.sample(batch_size=10, drop_last=False)
        assert [b.batch_size[0] for b in padded] == [4, 4, 4]
        for batch in batches + padded:
            assert_tagged_transitions(batch)
        with pytest.raises(ValueError, match="not enough data in the buffer for a batch of 11"):
            buffer.sample(batch_size=11)
        return [b["index"].tolist() for b in batches]

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2)


def test_fixed_mode_refuses_to_overflow_and_accepts_again_once_sampled():
    buffer = RolloutBuffer({"capacity": 10, "storage": {"mode": "fixed"}}, seed=0)
    add_tagged_episodes(buffer, [4, 6])
    with pytest.raises(BufferFullError, match="10 of 10 transitions stored") as error:
        add_tagged_episodes(buffer, [1])
    assert isinstance(error.value, RuntimeError)
    assert len(buffer) == 10
    assert sum(b.batch_size[0] for b in buffer.sample()) == 10
    add_tagged_episodes(buffer, [7])
    assert len(buffer) == 7


def test_circular_mode_keeps_the_newest_transitions_within_the_capacity():
    buffer = ReplayBuffer({"capacity": 12}, seed=0)
    add_tagged_episodes(buffer, [4] * 6)
    assert 12 <= len(buffer) <= 16
    assert buffer.store.episodes().column("env_id").to_pylist()[-1] == "w5"
    add_tagged_episodes(buffer, [20])            # longer than the capacity: its last 12 transitions
    assert buffer[-1]["observation"][1].item() == 19 and buffer[-12]["observation"][1].item() == 8


def test_clear_drops_episodes_in_progress_but_a_rollout_buffers_sample_keeps_them():
    buffer = RolloutBuffer({"capacity": 100}, seed=0)
    add_tagged_episodes(buffer, [3])
    worker = TaggedWorker(7)
    env_ret = worker.reset()
    for _ in range(2):                           # an episode in progress on env w7
        response = policy(env_ret)
        buffer.add_transition("w7", env_ret, response)
        env_ret = worker.step(response.action)
    buffer.sample()
    assert len(buffer) == 0
    buffer.truncate_one_episode(env_ret)         # still open after the sample: 1 transition
    assert len(buffer) == 1

    buffer.add_transition("w7", env_ret, policy(env_ret))
    buffer.add_data_async("w8", TaggedWorker(8).reset())
    buffer.clear()
    buffer.truncate_episodes(["w7"])
    assert len(buffer) == 0
    with pytest.raises(ValueError, match="no EnvRet waiting"):
        buffer.add_data_async("w8", PolicyResponse("w8", action=np.int64(0)))


def test_add_episode_takes_the_seed_format_as_given_and_splits_vector_envs():
    buffer = ReplayBuffer({"capacity": 100, "storage": {"unit": "episode"}}, seed=0)
    T, n = 4, 2
    obs = np.arange(T + 1, dtype=np.float32)[:, None, None] + np.array([0, 100], np.float32)[None, :, None]
    next_obs = obs[1:].copy()
    next_obs[1, 1] = -1.0                        # env 1 ended after step 1 and reset: kept as sent, not cut
    episode = {"observation": obs[:-1], "next_observation": next_obs,
               "reward": np.ones((T, n), np.float32), "action": np.zeros((T, n), np.int64)}
    buffer.add_episode(episode, num_envs=n)
    table = buffer.store.episodes()
    assert table.column("env_id").to_pylist() == ["add_episode/0", "add_episode/1"]
    assert table.column("length").to_pylist() == [4, 4]
    np.testing.assert_array_equal(buffer[1]["next_observation"][:, 0].numpy(), [101, -1, 103, 104])
    np.testing.assert_array_equal(buffer[1]["observation"][:, 0].numpy(), [100, 101, 102, 103])
    with pytest.raises(ValueError, match=r"field 'reward' has shape \(4,\), expected \[T, 2, ...\]"):
        buffer.add_episode({**episode, "reward": np.ones(T, np.float32)}, num_envs=n)
    assert buffer.size() == 2


def test_indices_address_all_items_oldest_first_and_reject_what_is_out_of_range():
    buffer = ReplayBuffer({"capacity": 100}, seed=0)
    assert len(buffer) == 0 and buffer.get_all().batch_size == (0,)
    with pytest.raises(IndexError):
        buffer[0]
    add_tagged_episodes(buffer, [2, 3])
    steps = buffer[np.array([0, 1, 2, -1])]["step"].tolist()
    assert steps == [0, 1, 0, 2]
    assert buffer[torch.tensor([4])]["observation"][0, 0].item() == 100
    assert buffer.get(slice(1, 3))["step"].tolist() == [1, 0]
    assert buffer[0, [0]]["step"].tolist() == [0]
    with pytest.raises(IndexError, match="index 5 out of range for a buffer of 5 transitions"):
        buffer[[1, 5]]
    with pytest.raises(TypeError):
        buffer.get(1.5)


def test_custom_hooks_run_with_the_seeds_signatures():
    calls = []

    def postprocess(episode_buffer):
        calls.append(sorted(episode_buffer))
        obs = np.stack(episode_buffer["observation"])
        return {"observation": obs[:-1], "next_observation": obs[1:],
                "reward": np.asarray(episode_buffer["last_reward"][1:], np.float32),
                "action": np.stack(episode_buffer["action"][:-1]), "advantage": np.ones(len(obs) - 1, np.float32)}

    buffer = ReplayBuffer({"capacity": 100}, obs_preprocessor=lambda o: o * 2, postprocess_fn=postprocess, seed=0)
    add_tagged_episodes(buffer, [3])
    assert calls == [["action", "info", "last_reward", "last_terminated", "last_truncated", "observation", "value"]]
    batch = buffer[:]
    np.testing.assert_array_equal(batch["observation"][:, 1].numpy(), [0, 2, 4])
    np.testing.assert_array_equal(batch["next_observation"][:, 1].numpy(), [2, 4, 6])
    assert batch["advantage"].tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="custom obs_preprocessor"):
        ReplayBuffer({"capacity": 10}, obs_preprocessor=lambda o: o, preprocess_fn=lambda *a: {})


def test_print_timing_summary_logs_the_store_calls_at_debug(caplog):
    buffer = ReplayBuffer({"capacity": 100}, seed=0)
    add_tagged_episodes(buffer, [3, 2])
    buffer.sample(batch_size=4)
    with caplog.at_level(logging.DEBUG, logger="arrowbuf.compat.data_buffer"):
        buffer.print_timing_summary(reset=True)
    text = caplog.text
    assert "add_episode  count=2" in text and "sample       count=1" in text and "truncate" in text
    assert buffer.timing_raw == {}


# -- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, message", [
    ({"type": "ReplayBuffer", "capacity": 10, "storage": {"untis": "episode"}},
     "unknown key 'storage.untis' (value 'episode') (did you mean 'storage.unit'?)"),
    ({"type": "ReplayBuffer", "capacity": 10, "sampler_type": "all"}, "unknown key 'sampler_type'"),
    ({"type": "ReplayBuffer", "capacity": 10, "storage": {"mode": "circuler"}},
     "'storage.mode': got 'circuler', expected one of 'circular', 'fixed'"),
    ({"type": "ReplayBuffer", "capacity": 0}, "'capacity': got 0, expected an int >= 1"),
    ({"type": "ReplayBuffer", "capacity": "1000"}, "'capacity': got '1000', expected an int >= 1"),
    ({"type": "ReplayBuffer"}, "'capacity' is required"),
    ({"type": "ReservoirBuffer", "capacity": 10},
     "'type': got 'ReservoirBuffer', expected one of 'ReplayBuffer', 'RolloutBuffer'"),
    ({"type": "ReplayBuffer", "capacity": 10, "sampler": {"type": "prioritized"}},
     "'sampler.type': got 'prioritized', expected one of 'uniform', 'batch', 'all'"),
    ({"type": "ReplayBuffer", "capacity": 10, "auto_truncate_episode": "yes"},
     "'auto_truncate_episode': got 'yes', expected true or false"),
    ({"type": "ReplayBuffer", "capacity": 10, "storage": {"num_shards": 2}},
     "'storage.num_shards': got 2, expected 1 or nothing with storage.type='unified'"),
    ({"type": "ReplayBuffer", "capacity": 10, "storage": {"type": "sharded", "num_shards": 2, "device": "cuda"}},
     "'storage.device': got 'cuda', expected 'cpu' with storage.type='sharded'"),
    ({"type": "ReplayBuffer", "capacity": 10, "storage": {"device": "tpu"}}, "'storage.device': got 'tpu'"),
])
def test_config_errors_name_the_key_the_value_and_what_is_expected(config, message):
    with pytest.raises(ValueError) as error:
        DataBuffer(config)
    assert message in str(error.value)


def test_configs_come_as_dicts_or_objects_and_get_the_seeds_defaults():
    as_object = SimpleNamespace(type="RolloutBuffer", capacity=64, sampler=None,
                                storage=SimpleNamespace(mode="fixed", unit="episode"), node_affinity_env=True)
    settings = parse_config(as_object)
    assert (settings.sampler, settings.mode, settings.unit, settings.storage_type) == ("all", "fixed", "episode",
                                                                                        "unified")
    assert parse_config({"type": "ReplayBuffer", "capacity": 5}).sampler == "uniform"
    with pytest.raises(ValueError, match="'type': got 'RolloutBuffer', expected 'ReplayBuffer' for a ReplayBuffer"):
        ReplayBuffer({"type": "RolloutBuffer", "capacity": 5})


# -- types ---------------------------------------------------------------------------------------


def test_env_ret_flattens_extra_fields_and_converts_into_copies():
    env_ret = EnvRet("e", torch.ones(2, dtype=torch.bfloat16), last_reward=torch.tensor(1.5),
                     _extra={"critic_obs": torch.zeros(3)})
    assert EnvRet.fields() == ("observation", "last_reward", "last_terminated", "last_truncated", "info")
    assert sorted(env_ret.to_dict()) == ["critic_obs", "info", "last_reward", "last_terminated", "last_truncated",
                                         "observation"]
    as_numpy = env_ret.numpy()
    assert isinstance(as_numpy.observation, np.ndarray) and as_numpy.observation.dtype == np.uint16   # bf16 bits
    assert torch.equal(torch.from_numpy(as_numpy.observation.view(np.int16)).view(torch.bfloat16), env_ret.observation)
    assert isinstance(as_numpy._extra["critic_obs"], np.ndarray)
    assert isinstance(env_ret.observation, torch.Tensor)      # the original is unchanged
    assert env_ret.cpu() is not env_ret
    with pytest.raises(KeyError, match="'observation'"):
        EnvRet("e", 0, _extra={"observation": 1}).to_dict()
    assert ab_types.EnvRet is EnvRet


def test_policy_response_and_batched_data_keep_the_seeds_behaviour():
    response = PolicyResponse("e", action=torch.tensor([1, 2]), log_prob=0.5).mark_policy_sent()
    assert sorted(response.to_dict()) == ["action", "log_prob"]
    assert response.numpy() is response and isinstance(response.action, np.ndarray)   # in place, as the seed
    time.sleep(0.001)
    assert response.compute_sent_latency() > 0

    batched = BatchedData(["a", "b", "a"], [1, 2, 3])
    assert len(batched) == 3 and batched.ids() == ("a", "b", "a") and batched["a"] == 1
    assert list(batched.items()) == [("a", 1), ("b", 2), ("a", 3)]
    assert not batched.is_future
    assert BatchedData.from_dict({"x": 9}).values() == (9,)
    with pytest.raises(ValueError, match="2 ids but 1 values"):
        BatchedData(["a", "b"], [1])
    with pytest.raises(KeyError):
        batched["zzz"]


# -- Ray -------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_session")
def test_a_sharded_config_samples_exact_batches_from_ray_shards_of_unequal_size():
    buffer = ReplayBuffer({"capacity": 50, "storage": {"type": "sharded", "num_shards": 2}}, seed=0,
                          num_train_workers=2)
    assert buffer.backend == "ray"
    add_tagged_episodes(buffer, [3, 8])          # one env per shard (least loaded first)
    assert len(buffer) == 11
    per_shard = buffer.get_all()
    assert sorted(len(part) for part in per_shard.values()) == [3, 8]
    batches = [resolve(b) for b in buffer.sample(batch_size=7)]   # the seed dropped 7 % 2, needed equal shards
    assert [b.batch_size[0] for b in batches] == [3, 3]
    assert sum(len(resolve(b)) for b in buffer.sample(batch_size=7, drop_last=False)) == 8
    for batch in batches:
        assert_tagged_transitions(batch)
    assert_tagged_transitions(buffer[:])
    buffer.store.close()


def test_multi_agent_returns_store_per_agent_rewards_and_end_when_any_agent_is_done():
    from arrowbuf.compat import MultiAgentEnvRet, MultiAgentPolicyResponse

    # The fake's records after the done one carry rewards: not a next-step reset; read as next-step here.
    buffer = ReplayBuffer({"capacity": 100, "auto_truncate_episode": True}, seed=0, autoreset_mode="next_step")
    agents = ("a", "b")
    for t in range(4):
        env_ret = MultiAgentEnvRet("ma-0", {k: np.full(2, t, np.float32) for k in agents},
                                   last_reward={k: np.float32(t + i) for i, k in enumerate(agents)},
                                   last_terminated={"a": False, "b": t == 2}, last_truncated={k: False for k in agents})
        buffer.add_transition("ma-0", env_ret, MultiAgentPolicyResponse("ma-0", action={k: np.int64(t) for k in agents}))
    batch = buffer[:]
    assert len(buffer) == 2 and batch["reward", "b"].tolist() == [2.0, 3.0]
    assert batch["terminated", "b"].tolist() == [False, True] and batch["next_observation", "a"][:, 0].tolist() == [1, 2]
    assert ab_types.MultiAgentEnvRet is MultiAgentEnvRet


def test_make_example_samples_actions_from_gymnasium_spaces():
    from arrowbuf.compat import MultiAgentPolicyResponse

    space = gym.spaces.Box(-1, 1, (3,), np.float32)
    response = PolicyResponse.make_example(space, env_id="e-0", log_prob=0.0)
    assert space.contains(response.action) and response.to_dict().keys() == {"action", "log_prob"}
    multi = MultiAgentPolicyResponse.make_example({"a": space, "b": gym.spaces.Discrete(4)}, env_id="e-0")
    assert isinstance(multi, MultiAgentPolicyResponse) and 0 <= multi.action["b"] < 4


def test_build_data_buffer_takes_the_seeds_registry_names():
    from arrowbuf.compat import build_data_buffer

    assert isinstance(build_data_buffer("RolloutBuffer", {"type": "RolloutBuffer", "capacity": 10}), RolloutBuffer)
    assert isinstance(build_data_buffer("DataBuffer", {"type": "ReplayBuffer", "capacity": 10}), ReplayBuffer)
    assert isinstance(build_data_buffer(ReplayBuffer, {"capacity": 10}), ReplayBuffer)
    with pytest.raises(ValueError, match="buffer_cls: unknown buffer class 'ReservoirBuffer'"):
        build_data_buffer("ReservoirBuffer", {"type": "ReplayBuffer", "capacity": 10})
