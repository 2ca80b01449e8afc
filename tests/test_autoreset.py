"""No step is lost silently: real gymnasium vector envs in each autoreset mode, the writer
told the mode (by the env or by name) or not, every played transition counted."""

from __future__ import annotations

from collections import Counter

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import arrowbuf as ab
from arrowbuf.autoreset import writer_settings

NUM_ENVS = 3


def vector_env(mode: AutoresetMode) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS, autoreset_mode=mode)


def play(envs: gym.vector.SyncVectorEnv, writer: ab.StepWriter, steps: int, pass_final_obs: bool,
         seed: int = 0) -> tuple[Counter, int]:
    """Play ``steps`` vector steps into ``writer`` as a user of that mode would; the transitions
    played, (obs bytes, action), counted as they were played (a next-step reset step is none),
    and the steps that followed an episode's end."""
    mode = envs.metadata["autoreset_mode"]
    obs, _ = envs.reset(seed=seed)
    envs.action_space.seed(seed)
    resetting = np.zeros(NUM_ENVS, bool)
    played: Counter = Counter()
    after_end = 0
    for _ in range(steps):
        after_end += int(resetting.sum())
        action = envs.action_space.sample()
        next_obs, reward, terminated, truncated, info = envs.step(action)
        final_obs = info.get("final_obs") if pass_final_obs else None
        writer.add(obs=obs, action=action, reward=reward.astype(np.float32), terminated=terminated,
                   truncated=truncated, next_obs=next_obs, final_obs=final_obs)
        for i in np.flatnonzero(~resetting if mode == AutoresetMode.NEXT_STEP else np.ones(NUM_ENVS, bool)):
            played[obs[i].tobytes(), int(action[i])] += 1
        done = terminated | truncated
        if mode == AutoresetMode.DISABLED and done.any():
            next_obs, _ = envs.reset(options={"reset_mask": done})
        resetting = done
        obs = next_obs
    return played, after_end


def stored(store: ab.ExperienceStore) -> Counter:
    rows: Counter = Counter()
    for batch in store.iter_batches(4096, shuffle=False):
        for obs, action in zip(batch["obs"].numpy(), batch["action"].tolist()):
            rows[obs.tobytes(), int(action)] += 1
    return rows


def writer_for(store: ab.ExperienceStore, envs: gym.vector.SyncVectorEnv, told: str) -> ab.StepWriter:
    if told == "env":
        return store.writer(env=envs)
    if told == "name":
        return store.writer(NUM_ENVS, envs.metadata["autoreset_mode"].value.replace("Step", "_step").lower())
    return store.writer(NUM_ENVS)


@pytest.mark.parametrize("told", ["env", "name", "no"])
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_every_played_transition_is_stored_or_the_writer_refuses_the_mode_loudly(mode, told):
    envs = vector_env(mode)
    store = ab.ExperienceStore(100_000, seed=0)
    writer = writer_for(store, envs, told)
    pass_final_obs = mode == AutoresetMode.SAME_STEP   # as a same-step user does (info["final_obs"])
    if mode == AutoresetMode.SAME_STEP and told == "no":
        with pytest.raises(ab.AutoresetModeError, match="final_obs.*env=envs.*same_step"):
            play(envs, writer, 150, pass_final_obs)
        assert writer.open_steps.sum() + len(store) > 0 and store.num_episodes == 0   # nothing cut wrongly
        return
    played, after_end = play(envs, writer, 150, pass_final_obs)
    writer.flush()
    assert sum(played.values()) > 140 * NUM_ENVS // 1.5   # the count is of real steps, episodes did end
    assert stored(store) == played
    assert len(store) == sum(played.values())
    if told == "no" and mode == AutoresetMode.NEXT_STEP:
        assert writer.reset_check.dropped == after_end > 0 and writer.reset_check.kept == 0
    if told == "no" and mode == AutoresetMode.DISABLED:
        assert writer.reset_check.kept == after_end > 0 and writer.reset_check.dropped == 0


def test_a_same_step_env_fed_without_its_final_obs_to_an_unconfirmed_writer_is_refused_at_the_next_step():
    envs = vector_env(AutoresetMode.SAME_STEP)
    store = ab.ExperienceStore(100_000)
    writer = store.writer(NUM_ENVS)
    with pytest.raises(ab.AutoresetModeError, match="reward or a done flag.*AutoresetMode.SAME_STEP") as err:
        play(envs, writer, 150, pass_final_obs=False)
    assert "Nothing of this step was recorded" in str(err.value)
    # Every step played before the refused one is held (stored, or open): none was dropped.
    held = sum(store.episodes()["length"].to_pylist()) + int(writer.open_steps.sum())
    assert len(store) == held   # len counts open tails' completed steps too (steps written in place)
    writer.flush()
    assert len(store) == held and writer.reset_check.dropped == 0


def test_writer_reads_num_envs_and_mode_from_a_vector_env_and_refuses_contradictions():
    store = ab.ExperienceStore(100)
    envs = vector_env(AutoresetMode.SAME_STEP)
    writer = store.writer(env=envs)
    assert (writer.num_envs, writer.autoreset_mode, writer.reset_check) == (NUM_ENVS, "same_step", None)
    assert store.writer(NUM_ENVS, AutoresetMode.DISABLED).autoreset_mode == "disabled"
    assert writer_settings(2, None, None) == (2, "next_step", True)
    with pytest.raises(ValueError, match="contradicts the env's"):
        store.writer(env=envs, autoreset_mode="next_step")
    with pytest.raises(ValueError, match="num_envs=2 contradicts env.num_envs=3"):
        store.writer(2, env=envs)
    with pytest.raises(ValueError, match="vector env"):
        store.writer(env=gym.make("CartPole-v1"))
    with pytest.raises(ValueError, match="num_envs.*or env"):
        store.writer()
    with pytest.raises(ValueError, match="autoreset_mode must be one of"):
        store.writer(2, "sometimes")


def test_sampling_while_writers_hold_only_open_episodes_names_them_and_flush():
    # Steps written in place are sampleable at once; a fixed-mode store's writers stage theirs.
    in_place, store = ab.ExperienceStore(1_000), ab.ExperienceStore(1_000, mode="fixed")
    obs = np.zeros((2, 3), np.float32)
    writers = [in_place.writer(2, "next_step"), store.writer(2, "next_step", name="runner")]
    for writer in writers:
        for _ in range(5):
            writer.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32),
                       terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=obs)
    assert len(in_place.sample(4)) == 4 and len(in_place) == 10
    with pytest.raises(ab.EmptyStoreError, match=r"10 steps of open episodes \('runner': 10\).*flush\(\)"):
        store.sample(4)
    writer.flush()
    assert len(store.sample(4)) == 4

