"""arrowbuf.compat: every env step's transition is stored exactly once, in every autoreset style.

The fake workers (`support.compat_envs.VecWorker`) log each transition they play; the
buffer's contents are compared with that log as multisets, so a lost, doubled or
misaligned transition (wrong reward, next observation or flag) fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from arrowbuf.compat import BatchedData, DataBuffer, ReplayBuffer
from arrowbuf.compat.processing import default_postprocess_fn

from support.compat_envs import VecWorker, losses, policy, rsl_rollout, sync_rollout, transitions, truth


def replay_config(**overrides) -> dict:
    return {"type": "ReplayBuffer", "capacity": 10_000, "auto_truncate_episode": True, **overrides}


STYLES = [("next_step", "final_observation", True), ("same_step", "final_observation", True),
          ("same_step", "final_obs", True), ("next_step", "final_observation", False),
          ("same_step", "final_observation", False), ("same_step", "final_obs", False)]


@pytest.mark.parametrize("hook", [None, default_postprocess_fn], ids=["no_hook", "postprocess_fn"])
@pytest.mark.parametrize("autoreset, final_key, vector", STYLES)
def test_auto_truncation_stores_every_env_step_exactly_once_with_its_reward_and_next_observation(
        autoreset, final_key, vector, hook):
    workers = [VecWorker(k, num_envs=6, autoreset=autoreset, seed=k, vector=vector, final_key=final_key)
               for k in range(2)]
    buffer = ReplayBuffer(replay_config(), seed=0, autoreset_mode=autoreset, postprocess_fn=hook)
    buffer.init([w.meta() for w in workers])
    sync_rollout(buffer, workers, steps=30)
    stored = transitions(buffer[:])
    assert stored == truth(workers)
    assert sum(stored.values()) == len(buffer)


@pytest.mark.parametrize("autoreset", ["next_step", "same_step"])
def test_async_pairing_with_auto_truncation_stores_every_env_step_exactly_once(autoreset):
    workers = [VecWorker(k, num_envs=5, autoreset=autoreset, seed=10 + k) for k in range(2)]
    buffer = ReplayBuffer(replay_config(), seed=0, autoreset_mode=autoreset)
    buffer.init([w.meta() for w in workers])
    first = None
    for _ in range(3):                  # rollouts that share their boundary EnvRet, as the RSL engine does
        first = rsl_rollout(buffer, workers, steps=7, first=first)
    assert transitions(buffer[:]) == truth(workers)


def test_a_same_step_boundary_keeps_the_terminal_observation_and_the_new_episodes_first_step():
    worker = VecWorker(0, num_envs=1, autoreset="same_step", vector=False, max_len=2)
    worker.length[:] = 2
    buffer = ReplayBuffer(replay_config(storage={"unit": "episode"}), seed=0)
    buffer.init([worker.meta()])
    sync_rollout(buffer, [worker], steps=3)     # episode 0: steps 0, 1 (terminal obs t=2); episode 1: step 0
    first, second = buffer[0], buffer[1]
    assert first["next_observation"][:, 2].tolist() == [1.0, 2.0]          # t=2 came from info, not the reset obs
    assert first["action"].tolist() == [0, 1] and first["terminated"].tolist() == [False, True]
    assert second["observation"][0].tolist() == [0.0, 1.0, 0.0] and second["action"][0].item() == 100


def test_without_auto_truncation_a_segment_is_the_rollout_window_and_keeps_every_record_pair():
    workers = [VecWorker(k, num_envs=4, autoreset="next_step", seed=k) for k in range(2)]
    buffer = ReplayBuffer(replay_config(auto_truncate_episode=False, storage={"unit": "episode"}), seed=0)
    buffer.init([w.meta() for w in workers])
    sync_rollout(buffer, workers, steps=9)
    assert buffer.size() == 8 and buffer.store.episodes().column("length").to_pylist() == [9] * 8
    stored = transitions(buffer[:].reshape(-1))
    assert not truth(workers) - stored    # every real transition is there (plus the resets' dummy steps)
    assert sum(stored.values()) == 8 * 9


def test_same_step_mode_keeps_a_done_record_without_its_terminal_observation_and_marks_that_next_obs_unknown():
    worker = VecWorker(0, num_envs=2, autoreset="same_step", final_key=None)   # IsaacLab: info={}
    worker.length[:] = [1, 3]
    buffer = ReplayBuffer(replay_config(), seed=0, autoreset_mode="same_step")
    buffer.init([worker.meta()])
    sync_rollout(buffer, [worker], steps=3)
    assert losses(buffer[:], [worker]) == {"lost": 0, "extra": 0, "wrong_next": 0, "unknown_mid": 0, "unknown": 2}
    stored = buffer[:]
    blind = ~stored["next_observation_valid"]
    # the unknown next observation repeats the step's own (a time-out then bootstraps from V(obs_t))
    assert (stored["next_observation"][blind] == stored["observation"][blind]).all()


def test_vector_flags_of_the_wrong_shape_are_refused_naming_the_field():
    worker = VecWorker(0, num_envs=3)
    buffer = DataBuffer(replay_config(), seed=0)
    buffer.init([worker.meta()])
    env_ret = worker.reset()
    env_ret.last_terminated = np.zeros(2, bool)
    with pytest.raises(ValueError, match=r"field 'last_terminated' has shape \(2,\), expected \(3, ...\)"):
        buffer.add_batched_transition(BatchedData([worker.env_id], [env_ret]),
                                      BatchedData([worker.env_id], [policy(env_ret)]))
