"""The seed's pre- and post-processing hooks, with its signatures.

``DataBuffer(config, obs_preprocessor=..., preprocess_fn=..., postprocess_fn=...)``
takes the same callables as RLightning's buffer; these are the defaults.

- ``obs_preprocessor(obs)`` / ``reward_preprocessor(reward)``: applied by the
  default env-ret hook.
- ``env_ret_preprocess_fn(transition_dict, env_ret, obs_preprocessor, reward_preprocessor)``
  and ``policy_resp_preprocess_fn(transition_dict, policy_resp)`` fill one step
  record; ``preprocess_fn(transition_dict, env_ret, policy_resp, obs_preprocessor,
  reward_preprocessor, env_ret_preprocess_fn, policy_resp_preprocess_fn)`` calls them.
- ``postprocess_fn(episode_buffer)``: a dict of per-step lists (T+1 records, as
  torch tensors on the storage device) -> a dict of T-row tensors, stored as
  returned. Only a custom one is called; without one the buffer stores the same
  transitions with the observation kept once (`arrowbuf.compat.segments`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def is_env_ret(value: Any) -> bool:
    """An EnvRet (arrowbuf's or RLightning's: anything with its fields and ``to_dict``)."""
    return all(hasattr(value, name) for name in ("env_id", "observation", "last_reward", "to_dict"))


def is_policy_resp(value: Any) -> bool:
    """A PolicyResponse (arrowbuf's or RLightning's): ``env_id`` and ``to_dict``, not an EnvRet."""
    return hasattr(value, "env_id") and hasattr(value, "to_dict") and not is_env_ret(value)


def default_obs_preprocessor(observation: Any) -> Any:
    return observation


def default_reward_preprocessor(reward: Any) -> Any:
    return reward


def default_env_ret_preprocess_fn(transition_dict: dict, env_ret: Any, obs_preprocessor: Callable,
                                  reward_preprocessor: Callable) -> dict:
    """Put an EnvRet's fields (and ``_extra`` keys) into the step record."""
    if not is_env_ret(env_ret):
        raise TypeError(f"env_ret must be an EnvRet, got {type(env_ret).__name__}")
    fields = env_ret.to_dict()
    fields["observation"] = obs_preprocessor(env_ret.observation)
    fields["last_reward"] = reward_preprocessor(env_ret.last_reward)
    transition_dict.update(fields)
    return transition_dict


def default_policy_resp_preprocess_fn(transition_dict: dict, policy_resp: Any) -> dict:
    """Put a PolicyResponse's fields into the step record (over the EnvRet's on a clash, as the seed)."""
    if not is_policy_resp(policy_resp):
        raise TypeError(f"policy_resp must be a PolicyResponse, got {type(policy_resp).__name__}")
    transition_dict.update(policy_resp.to_dict())
    return transition_dict


def default_preprocess_fn(transition_dict: dict, env_ret: Any = None, policy_resp: Any = None,
                          obs_preprocessor: Callable = default_obs_preprocessor,
                          reward_preprocessor: Callable = default_reward_preprocessor,
                          env_ret_preprocess_fn: Callable = default_env_ret_preprocess_fn,
                          policy_resp_preprocess_fn: Callable = default_policy_resp_preprocess_fn) -> dict:
    """One step record from an EnvRet and/or a PolicyResponse.

    Raises:
        ValueError: neither is given, or their env ids differ.
        TypeError: not an EnvRet / PolicyResponse (from the default inner hooks).
    """
    if env_ret is None and policy_resp is None:
        raise ValueError("at least one of env_ret or policy_resp must be given")
    # getattr: a value of the wrong type is named by its hook's TypeError below, not an AttributeError here.
    if env_ret is not None and policy_resp is not None \
            and getattr(env_ret, "env_id", None) != getattr(policy_resp, "env_id", None) \
            and hasattr(env_ret, "env_id") and hasattr(policy_resp, "env_id"):
        raise ValueError(f"env_ret and policy_resp are for different envs: {env_ret.env_id!r} and "
                         f"{policy_resp.env_id!r}")
    if env_ret is not None:
        transition_dict = env_ret_preprocess_fn(transition_dict, env_ret, obs_preprocessor, reward_preprocessor)
    if policy_resp is not None:
        transition_dict = policy_resp_preprocess_fn(transition_dict, policy_resp)
    return transition_dict


def _stack(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {key: _stack([value[key] for value in values]) for key in values[0]}
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values, dim=0)
    return torch.tensor(values)


def _rows(value: Any, rows: slice) -> Any:
    if isinstance(value, dict):
        return {key: _rows(v, rows) for key, v in value.items()}
    return value[rows]


def default_postprocess_fn(episode_buffer: dict[str, list[Any]]) -> dict[str, Any]:
    """The seed's default: per-step lists (T+1 records, torch) -> T-row tensors:
    ``observation`` / ``next_observation``, ``last_X`` -> ``X``, other keys without
    the last step, ``*info*`` keys dropped. Nested observations are stacked leaf by leaf."""
    out: dict[str, Any] = {}
    for key, values in episode_buffer.items():
        if "info" in key:
            continue
        stacked = _stack(list(values))
        if key.startswith("last_"):
            out[key[len("last_"):]] = _rows(stacked, slice(1, None))
        elif key == "observation":
            out["observation"] = _rows(stacked, slice(None, -1))
            out["next_observation"] = _rows(stacked, slice(1, None))
        else:
            out[key] = _rows(stacked, slice(None, -1))
    return out


@dataclass(frozen=True)
class Hooks:
    """The six hooks of a DataBuffer, defaults filled in (`resolve_hooks`)."""

    obs_preprocessor: Callable
    reward_preprocessor: Callable
    env_ret_preprocess_fn: Callable
    policy_resp_preprocess_fn: Callable
    preprocess_fn: Callable
    postprocess_fn: Callable | None   # None: no hook, the buffer's own path (the same transitions as the default)

    def preprocess(self, record: dict, env_ret: Any, policy_resp: Any) -> dict:
        """One step record, through ``preprocess_fn`` with the seed's arguments."""
        return self.preprocess_fn(record, env_ret, policy_resp, self.obs_preprocessor, self.reward_preprocessor,
                                  self.env_ret_preprocess_fn, self.policy_resp_preprocess_fn)


def resolve_hooks(obs_preprocessor: Callable | None, reward_preprocessor: Callable | None,
                  env_ret_preprocess_fn: Callable | None, policy_resp_preprocess_fn: Callable | None,
                  preprocess_fn: Callable | None, postprocess_fn: Callable | None) -> Hooks:
    """The hooks with defaults for None, checked as the seed checks them.

    Raises:
        ValueError: a custom inner hook that a custom outer one would bypass (a
            default passed explicitly is not custom).
    """
    defaults = (default_obs_preprocessor, default_reward_preprocessor, default_env_ret_preprocess_fn,
                default_policy_resp_preprocess_fn, default_preprocess_fn)
    given = (obs_preprocessor, reward_preprocessor, env_ret_preprocess_fn, policy_resp_preprocess_fn, preprocess_fn)
    obs_pre, reward_pre, env_ret_fn, policy_fn, pre_fn = (None if hook is default else hook
                                                          for hook, default in zip(given, defaults))
    if (obs_pre is not None or reward_pre is not None) and (env_ret_fn is not None or pre_fn is not None):
        raise ValueError("a custom obs_preprocessor / reward_preprocessor is only called by the default "
                         "env_ret_preprocess_fn and preprocess_fn; apply it inside your custom "
                         f"{'env_ret_preprocess_fn' if env_ret_fn is not None else 'preprocess_fn'} instead")
    if pre_fn is not None and (env_ret_fn is not None or policy_fn is not None):
        raise ValueError("a custom env_ret_preprocess_fn / policy_resp_preprocess_fn is only called by the "
                         "default preprocess_fn; handle it inside your custom preprocess_fn instead")
    return Hooks(*(hook or default for hook, default in zip((obs_pre, reward_pre, env_ret_fn, policy_fn, pre_fn),
                                                           defaults)), postprocess_fn)
