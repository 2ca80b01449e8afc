"""Generalized advantage estimation over flat per-step arrays: `gae`.

Pure functions (numpy or torch in, the same out) for stores and trainers alike.
Steps come as flat arrays in which each *segment* (an episode, or the part of one
that was collected) is contiguous and in time order, and ``ends`` marks the last
step of every segment: the recursion never looks past it.

For step t with ``terminated`` d_t and next value v'_t (the value of the next
observation; for a truncated episode's last step, the value of its final
observation, so truncations bootstrap)::

    delta_t = r_t + gamma * v'_t * (1 - d_t) - v_t
    A_t     = delta_t + gamma * lam * (1 - d_t) * (1 - end_t) * A_{t+1}
    target_t = A_t + v_t

The recursion runs over the padded ``[segments, longest]`` layout, one vectorized
step per time index (no loop over segments or envs).

Example:
    >>> import numpy as np
    >>> from arrowbuf.gae import gae
    >>> adv, target = gae(rewards=np.ones(3), values=np.zeros(3), next_values=np.zeros(3),
    ...                   terminated=np.array([False, False, True]), ends=np.array([False, False, True]),
    ...                   gamma=1.0, lam=1.0)
    >>> adv.tolist()
    [3.0, 2.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["gae", "segment_positions"]


def _numpy(value: Any, name: str, n: int | None) -> np.ndarray:
    array = value.detach().cpu().double().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.ndim != 1 or (n is not None and len(array) != n):
        raise ValueError(f"{name} must be a 1-D array of {n if n is not None else 'N'} steps, got shape {array.shape}")
    return array


def segment_positions(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(segment of each step, position of each step in its segment, number of segments)``.

    Raises:
        ValueError: the last step does not end a segment.
    """
    ends = np.asarray(ends, bool)
    if len(ends) and not ends[-1]:
        raise ValueError("ends: the last step must end a segment (ends[-1] is False)")
    segment = np.zeros(len(ends), np.int64)
    segment[1:] = np.cumsum(ends[:-1])
    starts = np.flatnonzero(np.r_[True, ends[:-1]]) if len(ends) else np.zeros(0, np.int64)
    return segment, np.arange(len(ends)) - starts[segment], len(starts)


def gae(rewards: Any, values: Any, next_values: Any, terminated: Any, ends: Any, gamma: float = 0.99,
        lam: float = 0.95) -> tuple[Any, Any]:
    """Advantages and value targets of flat per-step arrays (see the module docstring).

    Args:
        rewards, values, next_values: float arrays of N steps.
        terminated: bool array: the episode ended in a terminal state (no bootstrap).
        ends: bool array: the last step of each segment (terminated, truncated,
            or the end of the collected steps); ``ends[-1]`` must be True.
        gamma, lam: discount and GAE lambda, in [0, 1].

    Returns:
        ``(advantages, value_targets)``: torch tensors of ``rewards``' dtype and
        device if ``rewards`` is a tensor, else float64 numpy arrays.

    Raises:
        ValueError: arrays of other shapes or lengths, or gamma / lam outside [0, 1].
    """
    for name, value in (("gamma", gamma), ("lam", lam)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    r = _numpy(rewards, "rewards", None).astype(np.float64)
    n = len(r)
    v = _numpy(values, "values", n).astype(np.float64)
    nv = _numpy(next_values, "next_values", n).astype(np.float64)
    done = _numpy(terminated, "terminated", n).astype(bool)
    end = _numpy(ends, "ends", n).astype(bool)
    segment, position, count = segment_positions(end)
    longest = int(position.max()) + 1 if n else 0
    delta = np.zeros((count, longest + 1))
    coeff = np.zeros((count, longest + 1))
    delta[segment, position] = r + gamma * nv * ~done - v
    coeff[segment, position] = gamma * lam * (~done & ~end)
    advantage = np.zeros((count, longest + 1))
    for j in range(longest - 1, -1, -1):
        advantage[:, j] = delta[:, j] + coeff[:, j] * advantage[:, j + 1]
    adv = advantage[segment, position]
    target = adv + v
    if isinstance(rewards, torch.Tensor):
        return (torch.from_numpy(adv).to(rewards.device, rewards.dtype),
                torch.from_numpy(target).to(rewards.device, rewards.dtype))
    return adv, target
