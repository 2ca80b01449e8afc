"""Index arithmetic at sample time: n-step returns and frame stacks.

Both read the rows already stored (nothing is duplicated in storage): an n-step
return sums rewards of rows t..t+k-1 and bootstraps from the observation of row
t+k; a frame stack reads observation rows t-k+1..t, repeating the episode's first
frame where the episode is younger than the stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class NStep:
    """An n-step look-ahead for a batch: rows of the bootstrap observation and the targets."""

    next_rows: np.ndarray     # row of the observation k steps ahead
    reward: np.ndarray        # sum_{i<k} gamma^i r_{t+i}
    discount: np.ndarray      # gamma^k
    steps: np.ndarray         # k: n, or fewer at the episode end
    last_rows: np.ndarray     # row t+k-1 (its terminated / truncated flags end the window)


def n_step(rows: np.ndarray, last_row: np.ndarray, reward: np.ndarray, n: int, gamma: float) -> NStep:
    """n-step discounted rewards for transitions at ``rows``.

    Args:
        rows: arena rows of the transitions, any shape.
        last_row: the last transition row of each one's episode (same shape).
        reward: the arena's reward column.
        n: look-ahead (>= 1); windows stop at the episode's last transition.
        gamma: discount.
    """
    steps = np.minimum(n, last_row - rows + 1)
    offsets = np.arange(n, dtype=np.int64)
    window = np.minimum(rows[..., None] + offsets, last_row[..., None])
    weights = np.where(offsets < steps[..., None], gamma ** offsets, 0.0)
    total = (reward[window].astype(np.float64) * weights).sum(axis=-1)
    dtype = reward.dtype if np.issubdtype(reward.dtype, np.floating) else np.float32
    return NStep(rows + steps, total.astype(dtype), (gamma ** steps).astype(dtype), steps, rows + steps - 1)


def frame_rows(rows: np.ndarray, first_row: np.ndarray, frames: int) -> np.ndarray:
    """Observation rows t-frames+1..t (oldest first) clamped to the episode's first row.

    Returns an array of shape ``rows.shape + (frames,)``.
    """
    back = np.arange(frames - 1, -1, -1, dtype=np.int64)
    return np.maximum(rows[..., None] - back, first_row[..., None])
