"""Generalized advantage estimation over ragged episodes, without a per-step Python loop.

Episodes are laid end to end in flat per-step arrays. The backward recursion
``A_t = delta_t + gamma * lam * A_{t+1}`` runs once per step index, over every
episode that has that step at once: the Python loop has as many iterations as
the longest episode, not as there are steps (4,096 episodes of 24 steps: 24
iterations of vector work).

Example:
    >>> import numpy as np
    >>> adv, target = gae(np.ones(3), np.zeros(3), np.array([0.0]), np.array([3]), gamma=1.0, lam=1.0)
    >>> adv.tolist(), target.tolist()
    ([3.0, 2.0, 1.0], [3.0, 2.0, 1.0])
"""

from __future__ import annotations

import numpy as np


def gae(reward: np.ndarray, value: np.ndarray, last_value: np.ndarray, lengths: np.ndarray,
        gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and value targets (``advantage + value``) of episodes laid end to end.

    Args:
        reward: [N] rewards, episode after episode (N = ``lengths.sum()``).
        value: [N] value estimates of the states the steps act on.
        last_value: [E] the value after each episode's last step: 0 where the
            episode terminated, the value of its final observation where it was
            cut (truncated, or the end of a rollout).
        lengths: [E] steps of each episode (>= 0).
        gamma: discount.
        lam: GAE's lambda.

    Returns:
        (advantage, value_target), both [N] float64.
    """
    lengths = np.asarray(lengths, np.int64)
    reward = np.asarray(reward, np.float64)
    value = np.asarray(value, np.float64)
    starts = np.cumsum(lengths) - lengths
    next_value = np.empty_like(value)
    next_value[:-1] = value[1:]
    ends = starts + lengths - 1
    has_steps = lengths > 0
    next_value[ends[has_steps]] = np.asarray(last_value, np.float64)[has_steps]
    delta = reward + gamma * next_value - value
    advantage = np.empty_like(delta)
    # Longest episodes first: at step index s, the episodes that have it are a prefix.
    order = np.argsort(-lengths, kind="stable")
    sorted_starts, sorted_lengths = starts[order], lengths[order]
    carry = np.zeros(len(lengths))
    decay = gamma * lam
    for s in range(int(sorted_lengths[0]) - 1 if len(lengths) else -1, -1, -1):
        k = int(np.searchsorted(-sorted_lengths, -s, side="left"))   # episodes longer than s
        rows = sorted_starts[:k] + s
        carry[:k] = delta[rows] + decay * carry[:k]
        advantage[rows] = carry[:k]
    return advantage, advantage + value
