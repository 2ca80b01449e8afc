"""arrowbuf.compat: hooks receive what the seed gives them, and what they return is stored as returned.

The hooks here behave like RLightning's shipped examples: wbc_tracking's
episode post-processing uses torch ops (``torch.stack``, which fails on numpy),
rsl_rl's responses carry ``next_*`` keys that describe the current step, and
remote env / policy workers send numpy with bf16 carried as uint16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arrowbuf as ab
from arrowbuf.compat import BatchedData, EnvRet, PolicyResponse, RolloutBuffer

from support.compat_envs import VecWorker, as_bf16_bits, policy, rsl_rollout


def stack(values):
    """``torch.stack`` (a TypeError on numpy), through nested dicts as VLA ``forward_inputs`` are."""
    if isinstance(values[0], dict):
        return {key: stack([value[key] for value in values]) for key in values[0]}
    return torch.stack(values, dim=0)


def torch_stack_postprocess(episode_buffer):
    """wbc_tracking-style: next_observation by hand, ``last_*`` shifted, everything stacked by torch."""
    episode_buffer["next_observation"] = episode_buffer["observation"][1:] + [episode_buffer["observation"][-1]]
    data = {}
    for key, values in episode_buffer.items():
        if "info" in key:
            continue
        if key.startswith("last_"):
            data[key[len("last_"):]] = stack(values[1:])
        else:
            data[key] = stack(values[:-1])
    return data


def wbc_config() -> dict:
    return {"type": "RolloutBuffer", "capacity": 100_000, "auto_truncate_episode": False,
            "storage": {"type": "unified", "unit": "episode", "device": "cpu"}, "sampler": {"type": "batch"}}


class RemoteWorker(VecWorker):
    """A worker behind ``remote_storage``: its EnvRets arrive as numpy (``EnvRet.numpy()``)."""

    def reset(self):
        return super().reset().numpy()

    def step(self, action):
        return super().step(action).numpy()


def test_the_rsl_engine_on_wbc_config_stores_one_episode_per_sub_env_with_next_keys_as_sent():
    workers = [RemoteWorker(0, num_envs=4, seed=1, min_len=1000, max_len=1000)]   # no resets inside the 8 steps
    buffer = RolloutBuffer(wbc_config(), postprocess_fn=torch_stack_postprocess, seed=0)
    buffer.init([w.meta() for w in workers], [w.env_id for w in workers])
    rsl_rollout(buffer, workers, steps=8)
    assert buffer.size() == 4
    episodes = buffer[:]
    assert episodes.batch_size == (4, 8)
    obs = episodes["observation"]
    torch.testing.assert_close(episodes["next_actor_observations"], obs)          # describes the current step
    torch.testing.assert_close(episodes["next_observation"][:, :-1], obs[:, 1:])
    assert episodes["next_values"].shape == (4, 8) and episodes["reward"].shape == (4, 8)
    np.testing.assert_array_equal(episodes["action"].numpy(), (obs[..., 0] * 10000 + obs[..., 2]).numpy())
    np.testing.assert_array_equal(episodes["reward"].numpy(), episodes["action"].numpy() / 2)
    (batch,) = buffer.sample(batch_size=4)
    assert batch.batch_size == (4, 8) and buffer.size() == 0


def test_remote_numpy_data_reaches_a_torch_hook_as_tensors_with_uint16_carried_bf16_as_bfloat16():
    seen = {}

    def hook(episode_buffer):
        seen.update({key: (type(values[0]), getattr(values[0], "dtype", None)) for key, values in episode_buffer.items()})
        return torch_stack_postprocess(episode_buffer)

    pixels = torch.randn(3, 2, 4, 4)
    buffer = RolloutBuffer({"type": "RolloutBuffer", "capacity": 100}, postprocess_fn=hook, seed=0)
    env_ids = ["remote-0"]
    for t in range(4):
        env_ret = EnvRet("remote-0", np.full(3, t, np.float32), last_reward=np.float32(t)).numpy()
        response = PolicyResponse("remote-0", action=torch.tensor(t),
                                  forward_inputs={"pixel_values": pixels[t % 3].to(torch.bfloat16)}).numpy()
        assert response.forward_inputs["pixel_values"].dtype == np.uint16          # as a remote policy sends it
        buffer.add_batched_transition(BatchedData(env_ids, [env_ret]), BatchedData(env_ids, [response]), [t == 3])
    assert seen["observation"] == (torch.Tensor, torch.float32)
    assert seen["forward_inputs"] == (dict, None)
    batch = buffer[:]
    assert batch["forward_inputs", "pixel_values"].dtype == torch.bfloat16
    torch.testing.assert_close(batch["forward_inputs", "pixel_values"][1], pixels[1].to(torch.bfloat16))
    assert batch["reward"].tolist() == [1.0, 2.0, 3.0]


def test_the_default_hooks_store_uint16_carried_bf16_as_bfloat16():
    pixels = torch.randn(2, 3, 3)
    buffer = RolloutBuffer({"type": "RolloutBuffer", "capacity": 100}, seed=0)
    for t in range(3):
        env_ret = EnvRet("e-0", np.full(2, t, np.float32), last_reward=np.float32(t))
        response = PolicyResponse("e-0", action=np.int64(t), pixel_values=as_bf16_bits(pixels[t % 2]))
        buffer.add_transition("e-0", env_ret, response, truncated=t == 2)
    batch = buffer[:]
    assert batch["pixel_values"].dtype == torch.bfloat16
    torch.testing.assert_close(batch["pixel_values"], pixels.to(torch.bfloat16))


def test_a_hook_that_returns_fields_of_different_lengths_is_refused_naming_them():
    def ragged(episode_buffer):
        return {"observation": torch.stack(episode_buffer["observation"]), "action": torch.stack(episode_buffer["action"][:-1])}

    buffer = RolloutBuffer({"type": "RolloutBuffer", "capacity": 100}, postprocess_fn=ragged, seed=0)
    worker = VecWorker(0, vector=False)
    env_ret = worker.reset()
    buffer.add_transition(worker.env_id, env_ret, policy(env_ret))
    env_ret = worker.step(0)
    buffer.add_transition(worker.env_id, env_ret, policy(env_ret))
    with pytest.raises(ValueError, match="postprocess_fn returned fields of different lengths"):
        buffer.truncate_one_episode(worker.env_id)
    assert len(buffer) == 0


def test_a_hook_may_return_token_lists_and_instructions_which_the_buffer_samples_as_ragged_and_text_fields():
    # A VLA GRPO hook: each step's generated tokens (a list of arrays of varying length) and the
    # episode's instruction (a list of str, one per step).
    def tokens_and_instruction(episode_buffer):
        steps = len(episode_buffer["action"])
        out = {key: torch.stack(value) for key, value in episode_buffer.items() if key != "info"}
        out["tokens"] = [np.arange(t % 4 + 1, dtype=np.int32) + 10 * t for t in range(steps)]
        out["instruction"] = [f"reach goal {int(out['observation'][0, 0])}"] * steps
        return out

    buffer = RolloutBuffer({"type": "RolloutBuffer", "capacity": 100}, postprocess_fn=tokens_and_instruction, seed=0)
    for t in range(4):
        env_ret = EnvRet("e-0", np.full(2, t, np.float32), last_reward=np.float32(t))
        buffer.add_transition("e-0", env_ret, PolicyResponse("e-0", action=np.int64(t)), truncated=t == 3)
    batch = buffer[:]
    assert batch["tokens"].is_nested and list(batch["instruction"]) == ["reach goal 0"] * len(batch["action"])
    offsets, values = batch["tokens"].offsets().tolist(), batch["tokens"].values().tolist()
    for i, step in enumerate(batch["action"].tolist()):
        assert values[offsets[i]:offsets[i + 1]] == [10 * step + k for k in range(step % 4 + 1)]


def test_a_hook_that_returns_a_list_of_values_no_field_takes_is_refused_naming_the_field():
    def with_infos(episode_buffer):
        out = {key: torch.stack(value) for key, value in episode_buffer.items() if key != "info"}
        out["extra"] = [{"k": 1}] * len(episode_buffer["action"])
        return out

    buffer = RolloutBuffer({"type": "RolloutBuffer", "capacity": 100}, postprocess_fn=with_infos, seed=0)
    buffer.add_transition("e-0", EnvRet("e-0", np.zeros(2, np.float32)), PolicyResponse("e-0", action=np.int64(0)))
    with pytest.raises(ab.SchemaError, match="field 'extra'"):
        buffer.add_transition("e-0", EnvRet("e-0", np.ones(2, np.float32), last_reward=np.float32(1)),
                              PolicyResponse("e-0", action=np.int64(1)), truncated=True)
    assert len(buffer) == 0
