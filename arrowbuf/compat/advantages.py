"""`compute_gae`: the seed's GAE signature (``[T, num_envs]`` tensors), computed by `arrowbuf.advantages`.

The seed's ``default_compute_gae`` treated every done as terminal (a truncation
bootstrapped only if the caller folded ``gamma * bootstrap_value`` into its
reward) and its loop-free ``default_gae_no_loop`` is wrong. Here ``terminated``,
``truncated`` and ``bootstrap_values`` may be given separately.
"""

from __future__ import annotations

from typing import Any

import torch

from arrowbuf.advantages import gae_steps


def _as_tensor(value: Any, name: str, shape: torch.Size | None) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.ndim != 2 or (shape is not None and tensor.shape != shape):
        raise ValueError(f"{name} must be a [T, num_envs] tensor{f' of shape {tuple(shape)}' if shape else ''}, "
                         f"got shape {tuple(tensor.shape)}")
    return tensor


def compute_gae(rewards: Any, values: Any, next_values: Any, dones: Any, gamma: float, lam: float,
                normalize_adv: bool = True, *, terminated: Any = None, truncated: Any = None,
                bootstrap_values: Any = None, next_observation_valid: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a ``[T, num_envs]`` rollout, as the seed's ``default_compute_gae``.

    Args:
        rewards, values, next_values: ``[T, num_envs]``.
        dones: ``[T, num_envs]`` bools: an episode ended after step t (terminated or
            truncated); the recursion stops there.
        gamma, lam: discount and GAE lambda.
        normalize_adv: standardize the advantages (returns are computed first).
        terminated: which dones were terminal (default: all of them, as the seed).
        truncated: which dones were truncations; with ``bootstrap_values`` their
            next value is the bootstrap value (of the final observation).
        bootstrap_values: ``[T, num_envs]`` values of final observations.
        next_observation_valid: ``[T, num_envs]`` bools, the compat store's column: where
            False (a same-step reset without a final observation) a step that did not
            terminate bootstraps from its own value, RSL-RL's ``reward += gamma *
            V(obs_t) * time_out``, whatever ``next_values`` / ``bootstrap_values`` say.

    Returns:
        ``(advantages, returns)``, ``[T, num_envs]`` tensors.

    Raises:
        ValueError: tensors of other shapes.
    """
    rewards = _as_tensor(rewards, "rewards", None).float() if not torch.is_floating_point(torch.as_tensor(rewards)) \
        else _as_tensor(rewards, "rewards", None)
    shape = rewards.shape
    values = _as_tensor(values, "values", shape)
    next_values = _as_tensor(next_values, "next_values", shape)
    dones = _as_tensor(dones, "dones", shape).bool()
    terminal = dones if terminated is None else _as_tensor(terminated, "terminated", shape).bool()
    if bootstrap_values is not None:
        cut = _as_tensor(truncated, "truncated", shape).bool() if truncated is not None else dones & ~terminal
        next_values = torch.where(cut & ~terminal, _as_tensor(bootstrap_values, "bootstrap_values", shape),
                                  next_values)
    if next_observation_valid is not None:
        blind = ~_as_tensor(next_observation_valid, "next_observation_valid", shape).bool() & ~terminal
        next_values = torch.where(blind, values, next_values)
    ends = dones.clone()
    ends[-1] = True
    flat = [x.transpose(0, 1).reshape(-1) for x in (rewards, values, next_values, terminal, ends)]
    adv, ret = gae_steps(*flat, gamma=gamma, lam=lam)
    adv = adv.reshape(shape[1], shape[0]).transpose(0, 1)
    ret = ret.reshape(shape[1], shape[0]).transpose(0, 1)
    if normalize_adv:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    return adv, ret
