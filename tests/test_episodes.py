"""Episode assembly: reading whole episodes, and the vectorized step writer."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import arrowbuf as ab
from arrowbuf.episode_read import read_episode
from arrowbuf.episodes import StepWriter

from support.compare import assert_same_snapshot, column_numpy, snapshot
from support.envs import EpisodeLog, FakeVectorRollout, make_cartpole
from support.episodes import make_episode, tagged_obs
from support.ring import RingModel, assert_store_matches


MODES = ["next_step", "same_step", "disabled"]
GYM_MODES = {"next_step": gym.vector.AutoresetMode.NEXT_STEP, "same_step": gym.vector.AutoresetMode.SAME_STEP,
             "disabled": gym.vector.AutoresetMode.DISABLED}


# -- whole episodes ------------------------------------------------------------------------


def test_read_episode_infers_the_schema_and_the_final_observation():
    episode, schema = read_episode(make_episode(0, 4), None)
    assert schema.observation_names == ("obs",)
    assert episode.num_steps == 4 and episode.has_final
    assert schema.fields["reward"] == ab.Field("float64")


def test_read_episode_accepts_torch_tensors_and_tensordicts():
    data = {k: torch.from_numpy(v) for k, v in make_episode(2, 3).items()}
    for given_data in (data, TensorDict(data, batch_size=[])):
        episode, schema = read_episode(given_data, None)
        np.testing.assert_array_equal(episode.columns["obs"], tagged_obs(2, np.arange(4)))
        assert schema.fields["terminated"].dtype == "bool"


def test_read_episode_refuses_what_is_not_an_episode():
    with pytest.raises(ab.SchemaError, match="dict, TensorDict or pyarrow.RecordBatch"):
        read_episode([1, 2, 3], None)


def test_read_episode_of_an_arrow_batch_restores_roles_and_the_final_row():
    store = ab.ExperienceStore(capacity=20)
    store.add_episode(make_episode(3, 4))
    episode, schema = read_episode(store.episode(0), None)
    assert schema == store.schema
    assert episode.has_final and episode.num_steps == 4
    assert len(episode.columns["action"]) == 4 and len(episode.columns["obs"]) == 5


# -- the step writer on synthetic envs --------------------------------------------------------


def staged_writer(store: ab.ExperienceStore, num_envs: int, mode: str) -> StepWriter:
    """A writer that stages episodes and writes each whole when it ends, as a Ray store's
    writer does (a local store's `store.writer` writes steps in place: tests/test_inplace.py)."""
    return StepWriter(store._backend.sink(None, None), num_envs, mode, in_place=False)


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(MODES), capacity=st.integers(7, 40),
       lengths=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=3),
       num_steps=st.integers(1, 30), flush=st.booleans())
def test_writer_seals_every_episode_in_order_in_any_autoreset_mode(mode, capacity, lengths, num_steps, flush):
    store = ab.ExperienceStore(capacity=capacity, seed=0)
    writer = staged_writer(store, len(lengths), mode)
    rollout = FakeVectorRollout(lengths, mode)
    for _ in range(num_steps):
        writer.add(**rollout.step_arrays())
    if flush:
        writer.flush()
        rollout.flush()
        assert writer.open_steps.tolist() == [0] * len(lengths)
    model = RingModel(capacity)
    for episode in rollout.sealed:
        model.add(episode)
    assert writer.episodes_written == len(rollout.sealed)
    assert_store_matches(store, model)


def test_writer_grows_its_staging_for_long_episodes():
    store = ab.ExperienceStore(capacity=1000, seed=0)
    writer = staged_writer(store, 2, "disabled")
    rollout = FakeVectorRollout([[150], [70, 90]], "disabled")
    for _ in range(170):
        writer.add(**rollout.step_arrays())
    writer.flush()
    rollout.flush()
    model = RingModel(1000)
    for episode in rollout.sealed:
        model.add(episode)
    assert store.episodes().column("length").to_pylist() == [70, 150, 90, 20, 10]
    assert_store_matches(store, model, epoch_batch=64)


def test_writer_episodes_carry_extra_fields_and_env_ids():
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="disabled", env_ids=["left", "right"])
    for t in range(3):
        writer.add(obs=np.full((2, 1), t, np.float32), action=np.array([t, -t]), reward=np.ones(2, np.float32),
                   terminated=np.array([t == 2, False]), truncated=np.zeros(2, bool),
                   next_obs=np.full((2, 1), t + 1, np.float32), log_prob=np.array([0.5, -0.5]) * t)
    writer.flush()
    table = store.episodes()
    assert table.column("env_id").to_pylist() == ["left", "right"]
    assert table.column("terminated").to_pylist() == [True, False]
    right = store.episode(1)
    np.testing.assert_array_equal(column_numpy(right.column("log_prob")), [0.0, -0.5, -1.0, 0.0])
    np.testing.assert_array_equal(column_numpy(right.column("obs"))[:, 0], [0, 1, 2, 3])


def test_flush_cuts_open_episodes_with_the_last_next_obs_as_final():
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=3, autoreset_mode="next_step")
    rollout = FakeVectorRollout([[2], [5], [9]], "next_step")
    for _ in range(4):
        writer.add(**rollout.step_arrays())
    # env 0 ended at step 2 and reset at step 3; step 4 is its new episode's first step.
    assert writer.open_steps.tolist() == [1, 4, 4]
    assert writer.flush() == 3
    assert writer.flush() == 0
    table = store.episodes()
    assert table.column("env_id").to_pylist() == ["env-0", "env-0", "env-1", "env-2"]
    assert table.column("length").to_pylist() == [2, 1, 4, 4]
    assert table.column("terminated").to_pylist() == [True, False, False, False]
    assert table.column("truncated").to_pylist() == [False] * 4
    np.testing.assert_array_equal(column_numpy(store.episode(3).column("obs")), tagged_obs(2, np.arange(5)))


def test_same_step_mode_accepts_a_dense_final_obs_array():
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="same_step")
    writer.add(obs=np.array([[0.0], [10.0]]), action=np.zeros(2, np.int64), reward=np.ones(2),
               terminated=np.array([True, False]), truncated=np.zeros(2, bool),
               next_obs=np.array([[-1.0], [11.0]]), final_obs=np.array([[1.0], [99.0]]))
    np.testing.assert_array_equal(column_numpy(store.episode(0).column("obs")), [[0.0], [1.0]])


def test_same_step_mode_without_final_obs_raises_and_records_nothing():
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=1, autoreset_mode="same_step")
    step = dict(obs=np.zeros((1, 1)), action=np.zeros(1, np.int64), reward=np.ones(1),
                truncated=np.zeros(1, bool), next_obs=np.ones((1, 1)))
    writer.add(terminated=np.zeros(1, bool), **step)
    with pytest.raises(ValueError, match="final_obs"):
        writer.add(terminated=np.ones(1, bool), **step)
    assert writer.open_steps.tolist() == [1]
    assert store.num_episodes == 0


def test_writer_with_an_explicit_nested_schema_samples_nested_observations():
    schema = ab.Schema({"obs": {"pos": ab.Field("float64", (2,), True), "id": ab.Field("int64", (), True)},
                        "action": ab.Field("int64"), "reward": ab.Field("float64"),
                        "terminated": ab.Field("bool"), "truncated": ab.Field("bool")})
    store = ab.ExperienceStore(capacity=100, seed=0, schema=schema)
    writer = store.writer(num_envs=1, autoreset_mode="disabled")
    for t in range(4):
        writer.add(obs={"pos": tagged_obs(5, [t]), "id": np.array([t])}, action=np.array([t]),
                   reward=np.ones(1), terminated=np.array([t == 3]), truncated=np.zeros(1, bool),
                   next_obs={"pos": tagged_obs(5, [t + 1]), "id": np.array([t + 1])})
    batch = store.sample(32)
    np.testing.assert_array_equal(batch["next", "obs", "id"].numpy(), batch["obs", "id"].numpy() + 1)
    np.testing.assert_array_equal(batch["next", "obs", "pos"].numpy()[:, 1], batch["step"].numpy() + 1)


def test_writer_infers_a_schema_from_dict_observations():
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    for t in range(3):
        writer.add(obs={"pos": np.full((2, 2), t, np.float32), "id": np.full(2, t)}, action=np.zeros(2, np.int64),
                   reward=np.ones(2), terminated=np.full(2, t == 2), truncated=np.zeros(2, bool),
                   next_obs={"pos": np.full((2, 2), t + 1, np.float32), "id": np.full(2, t + 1)})
    assert store.schema.observation_names == ("obs.pos", "obs.id")
    batch = store.sample(16)
    np.testing.assert_array_equal(batch["next", "obs", "id"].numpy(), batch["step"].numpy() + 1)


# -- writer errors ---------------------------------------------------------------------------


def good_step(num_envs: int = 2, t: int = 0, done: bool = False) -> dict:
    return dict(obs=np.full((num_envs, 3), t, np.float32), action=np.zeros(num_envs, np.int64),
                reward=np.ones(num_envs), terminated=np.full(num_envs, done), truncated=np.zeros(num_envs, bool),
                next_obs=np.full((num_envs, 3), t + 1, np.float32))


BAD_STEPS = {
    "obs leading dim": (dict(obs=np.zeros((3, 3), np.float32)), ["'obs'", "3", "2 envs"]),
    "action leading dim": (dict(action=np.zeros(1, np.int64)), ["'action'", "1", "2 envs"]),
    "next_obs leading dim": (dict(next_obs=np.zeros((1, 3), np.float32)), ["'obs'", "leading dim 1"]),
    "obs shape": (dict(obs=np.zeros((2, 4), np.float32)), ["'obs'", "(4,)", "(3,)"]),
    "action dtype": (dict(action=np.zeros(2, np.float32)), ["'action'", "float32", "int64"]),
    "unknown field": (dict(log_prob=np.zeros(2)), ["log_prob"]),
    "dict obs for array obs": (dict(obs={"a": np.zeros((2, 3), np.float32)}), ["obs.a"]),
    "next_obs dtype": (dict(next_obs=np.zeros((2, 3), np.float64)), ["next_obs", "'obs'", "float64", "float32"]),
    "tensor obs shape": (dict(obs=torch.zeros(2, 4)), ["'obs'", "(4,)", "(3,)"]),
    "flags per step": (dict(terminated=np.zeros((2, 2), bool)), ["'terminated'", "(2,)"]),
}


@pytest.mark.parametrize("change, words", BAD_STEPS.values(), ids=list(BAD_STEPS))
def test_a_bad_writer_step_raises_schema_error_and_records_nothing(change, words):
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    writer.add(**good_step(t=0))
    writer.add(**good_step(t=1))
    before, open_before = snapshot(store), writer.open_steps
    with pytest.raises(ab.SchemaError) as info:
        writer.add(**{**good_step(t=2, done=True), **change})
    for word in words:
        assert word in str(info.value)
    assert_same_snapshot(before, snapshot(store))
    assert writer.open_steps.tolist() == open_before.tolist()
    writer.add(**good_step(t=2, done=True))   # the staged steps are intact
    assert store.episodes().column("length").to_pylist() == [3, 3]
    np.testing.assert_array_equal(column_numpy(store.episode(0).column("obs"))[:, 0], [0, 1, 2, 3])


def test_steps_that_are_not_exact_numpy_arrays_are_read_and_stored_as_any_step_is():
    # After the first step the writer takes exact numpy steps by a fast path; anything
    # else (a tensor, a list, a dtype that casts without loss) goes the general way.
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    writer.add(**good_step(t=0))
    writer.add(**{**good_step(t=1), "obs": torch.full((2, 3), 1.0), "reward": [1.0, 1.0],
                  "action": np.array([5, 6], np.int32)})
    writer.add(**{**good_step(t=2), "terminated": torch.ones(2, dtype=torch.bool)})
    assert store.episodes().column("length").to_pylist() == [3, 3]
    rows = store.episode(1)
    np.testing.assert_array_equal(column_numpy(rows.column("obs"))[:, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(column_numpy(rows.column("action"))[:3], [0, 6, 0])
    assert rows.schema.field("action").type == pa.int64()


def test_a_failed_first_writer_step_leaves_the_store_without_a_schema():
    store = ab.ExperienceStore(capacity=100, seed=0)
    writer = store.writer(num_envs=1, autoreset_mode="disabled")
    unbatched = dict(good_step(num_envs=1), obs=np.zeros(3, np.float32), next_obs=np.ones(3, np.float32))
    with pytest.raises(ab.SchemaError, match="'obs'"):
        writer.add(**unbatched)
    assert store.schema is None
    writer.add(**good_step(num_envs=1, done=True))   # the corrected step is accepted
    assert store.schema.fields["obs"] == ab.Field("float32", (3,), True)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_envs=0), ["num_envs", "0"]), (dict(num_envs=2.0), ["num_envs", "2.0"]),
    (dict(num_envs=True), ["num_envs", "True"]),
    (dict(num_envs=2, autoreset_mode="reset"), ["autoreset_mode", "'reset'"]),
    (dict(num_envs=2, env_ids=["a"]), ["env_ids", "['a']"]),
])
def test_writer_arguments_are_checked(kwargs, words):
    store = ab.ExperienceStore(capacity=10)
    with pytest.raises(ValueError) as info:
        store.writer(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_episodes_a_full_fixed_store_refuses_are_kept_and_pushed_later():
    store = ab.ExperienceStore(capacity=8, seed=0, mode="fixed")
    writer = store.writer(num_envs=1, autoreset_mode="disabled")
    rollout = FakeVectorRollout([[3]], "disabled")
    for _ in range(6):
        writer.add(**rollout.step_arrays())   # two episodes of 4 rows: the second fills the arena
    assert store.num_episodes == 2
    for _ in range(3):
        writer.add(**rollout.step_arrays())   # the third is refused and kept
    assert writer.pending == 1
    before = snapshot(store)
    step = rollout.step_arrays()
    with pytest.raises(ab.CapacityError, match="mode='fixed'"):
        writer.add(**step)                    # still refused: nothing recorded
    assert_same_snapshot(before, snapshot(store))
    assert writer.open_steps.tolist() == [0] and writer.pending == 1
    store.clear()
    writer.add(**step)                        # the kept episode goes first, then the step
    assert writer.pending == 0
    assert store.episodes().column("episode_id").to_pylist() == [2]
    np.testing.assert_array_equal(column_numpy(store.episode(2).column("obs")), tagged_obs(2, np.arange(4)))
    assert writer.open_steps.tolist() == [1]


def test_an_episode_that_outgrows_the_capacity_is_refused_at_that_step_and_does_not_wedge_the_writer():
    store = ab.ExperienceStore(capacity=4, seed=0)   # transitions
    writer = staged_writer(store, 1, "disabled")
    rollout = FakeVectorRollout([[6, 2]], "disabled")
    for _ in range(3):
        writer.add(**rollout.step_arrays())   # 3 steps: 3 transitions, fits
    writer.add(**rollout.step_arrays())       # 4 steps: 4 transitions, still fits
    with pytest.raises(ab.CapacityError, match=r"'env-0' \(env 0\) at step 5.*more transitions than the store's "
                                               r"capacity of 4,"):
        writer.add(**rollout.step_arrays())   # 5 transitions: can never fit, refused now, not when sealed
    assert writer.pending == 0 and writer.open_steps.tolist() == [0]
    writer.add(**rollout.step_arrays())       # the refused episode's last step: skipped, not an episode
    assert store.num_episodes == 0
    for _ in range(2):
        writer.add(**rollout.step_arrays())   # the next episode (2 steps) is recorded and stored
    assert store.episodes().column("length").to_pylist() == [2]
    np.testing.assert_array_equal(column_numpy(store.episode(0).column("obs")), tagged_obs(1, np.arange(3)))


def test_a_refused_episode_leaves_the_writers_other_envs_recording():
    store = ab.ExperienceStore(capacity=2, seed=0)   # transitions
    writer = staged_writer(store, 2, "disabled")
    rollout = FakeVectorRollout([[9], [2, 1]], "disabled")
    for _ in range(2):
        writer.add(**rollout.step_arrays())   # env 1 ends a 2-step episode (2 transitions)
    with pytest.raises(ab.CapacityError, match=r"'env-0' \(env 0\) at step 3") as caught:
        writer.add(**rollout.step_arrays())   # env 0 outgrows 2 transitions; env 1 plays a 1-step episode
    assert "'env-1'" not in str(caught.value)
    assert writer.episodes_written == 2                       # env 1's episodes of 2 and 1 steps
    episodes = store.episodes()   # the second evicted the first's oldest transition: its step 1 stays
    assert episodes.column("length").to_pylist() == [1, 1] and episodes.column("first_step").to_pylist() == [1, 0]
    writer.add(**rollout.step_arrays())       # env 0's refused episode goes on: skipped
    assert writer.open_steps.tolist() == [0, 1]
    assert store.episodes().column("env_id").to_pylist() == ["env-1", "env-1"]


def test_flush_ends_the_skipping_of_a_refused_episode():
    store = ab.ExperienceStore(capacity=2, seed=0)   # transitions: a third step outgrows it
    writer = staged_writer(store, 1, "disabled")
    rollout = FakeVectorRollout([[9]], "disabled")
    writer.add(**rollout.step_arrays())
    writer.add(**rollout.step_arrays())
    with pytest.raises(ab.CapacityError, match="at step 3"):
        writer.add(**rollout.step_arrays())
    writer.add(**rollout.step_arrays())
    assert writer.open_steps.tolist() == [0], "the refused episode is skipped"
    assert writer.flush() == 0
    writer.add(**rollout.step_arrays())   # after a cut, steps start a new episode again
    assert writer.open_steps.tolist() == [1]


# -- the step writer on a real gymnasium vector env ----------------------------------------


def run_cartpole(mode: str, num_envs: int = 3, steps: int = 120) -> tuple[ab.ExperienceStore, list[EpisodeLog]]:
    envs = make_cartpole(num_envs, GYM_MODES[mode])
    envs.action_space.seed(0)
    store = ab.ExperienceStore(capacity=10_000, seed=0)
    writer = store.writer(num_envs=num_envs, autoreset_mode=mode)
    obs, _ = envs.reset(seed=0)
    for _ in range(steps):
        action = envs.action_space.sample()
        next_obs, reward, terminated, truncated, info = envs.step(action)
        writer.add(obs=obs, action=action, reward=reward, terminated=terminated, truncated=truncated,
                   next_obs=next_obs, final_obs=info.get("final_obs"))
        obs = next_obs
        if mode == "disabled" and (terminated | truncated).any():
            obs, _ = envs.reset(options={"reset_mask": terminated | truncated})
    logs = list(envs.envs)
    ended = sum(len(log.finished) for log in logs)
    assert store.num_episodes == ended
    writer.flush()
    envs.close()
    return store, logs


def assert_episode_matches_log(store: ab.ExperienceStore, episode_id: int, log: dict) -> None:
    rows = store.episode(episode_id)
    steps = len(log["reward"])
    np.testing.assert_array_equal(column_numpy(rows.column("obs")), np.stack(log["obs"]))
    np.testing.assert_array_equal(column_numpy(rows.column("action"))[:steps], log["action"])
    np.testing.assert_array_equal(column_numpy(rows.column("reward"))[:steps], log["reward"])


@pytest.mark.parametrize("mode", MODES)
def test_writer_records_cartpole_episodes_exactly_as_the_envs_played_them(mode):
    store, logs = run_cartpole(mode)
    table = store.episodes()
    assert table.column("has_final").to_pylist() == [True] * table.num_rows
    for e, log in enumerate(logs):
        mine = table.filter(pc.equal(table.column("env_id"), f"env-{e}"))
        ids = mine.column("episode_id").to_pylist()
        cut = [log.current] if log.current is not None and log.current["reward"] else []
        played = log.finished + cut
        assert len(played) >= 2, "the rollout should end several episodes per env"
        assert mine.column("length").to_pylist() == [len(p["reward"]) for p in played]
        np.testing.assert_allclose(mine.column("return").to_numpy(), [sum(p["reward"]) for p in played],
                                   rtol=1e-12)
        assert mine.column("terminated").to_pylist() == [p["terminated"] for p in played]
        assert mine.column("truncated").to_pylist() == [p["truncated"] for p in played]
        for episode_id, p in zip(ids, played):
            assert_episode_matches_log(store, episode_id, p)
    assert any(t for t in table.column("truncated").to_pylist())
    assert any(t for t in table.column("terminated").to_pylist())


def test_a_refused_episode_stays_skipped_across_a_writer_state_round_trip():
    store = ab.ExperienceStore(capacity=2, seed=0)   # transitions: a third step outgrows it
    writer = staged_writer(store, 1, "disabled")
    rollout = FakeVectorRollout([[9]], "disabled")
    for _ in range(2):
        writer.add(**rollout.step_arrays())
    with pytest.raises(ab.CapacityError):
        writer.add(**rollout.step_arrays())
    restored = staged_writer(store, 1, "disabled")
    restored.load_state_dict(writer.state_dict())
    restored.add(**rollout.step_arrays())
    assert restored.open_steps.tolist() == [0]
