"""arrowbuf.advantages and arrowbuf.compat.compute_gae match a per-step loop reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arrowbuf.compat import compute_gae
from arrowbuf.advantages import gae_steps


def loop_gae(rewards, values, next_values, terminated, ends, gamma, lam):
    """The textbook backward loop, one step at a time."""
    advantages = np.zeros(len(rewards))
    running = 0.0
    for t in reversed(range(len(rewards))):
        if ends[t]:
            running = 0.0
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminated[t]) - values[t]
        running = delta + gamma * lam * (1.0 - terminated[t]) * running
        advantages[t] = running
    return advantages, advantages + values


@st.composite
def rollouts(draw):
    n = draw(st.integers(1, 60))
    floats = st.floats(-10, 10, allow_nan=False, width=32)
    arrays = [np.array(draw(st.lists(floats, min_size=n, max_size=n)), np.float64) for _ in range(3)]
    terminated = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    ends = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))) | terminated
    ends[-1] = True
    gamma = draw(st.floats(0, 1))
    lam = draw(st.floats(0, 1))
    return (*arrays, terminated, ends, gamma, lam)


@settings(max_examples=200, deadline=None)
@given(rollouts())
def test_gae_matches_a_per_step_loop_over_any_segments(rollout):
    advantages, targets = gae_steps(*rollout[:5], gamma=rollout[5], lam=rollout[6])
    expected_adv, expected_targets = loop_gae(*rollout)
    np.testing.assert_allclose(advantages, expected_adv, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(targets, expected_targets, rtol=1e-9, atol=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_compute_gae_bootstraps_truncations_and_matches_the_loop_per_env(steps, envs, seed):
    rng = np.random.default_rng(seed)
    rewards, values, next_values, bootstrap = (torch.from_numpy(rng.normal(size=(steps, envs))) for _ in range(4))
    terminated = torch.from_numpy(rng.random((steps, envs)) < 0.2)
    truncated = torch.from_numpy(rng.random((steps, envs)) < 0.2) & ~terminated
    dones = terminated | truncated
    advantages, returns = compute_gae(rewards, values, next_values, dones, 0.9, 0.8, normalize_adv=False,
                                      terminated=terminated, truncated=truncated, bootstrap_values=bootstrap)
    for env in range(envs):
        nv = torch.where(truncated[:, env], bootstrap[:, env], next_values[:, env]).numpy()
        ends = dones[:, env].numpy().copy()
        ends[-1] = True
        expected, expected_returns = loop_gae(rewards[:, env].numpy(), values[:, env].numpy(), nv,
                                              terminated[:, env].numpy().astype(float), ends, 0.9, 0.8)
        np.testing.assert_allclose(advantages[:, env].numpy(), expected, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(returns[:, env].numpy(), expected_returns, rtol=1e-9, atol=1e-9)


def test_compute_gae_without_flags_is_the_seeds_default_and_normalizes():
    rewards = torch.ones(4, 2)
    dones = torch.tensor([[False, False], [True, False], [False, False], [False, False]])
    advantages, returns = compute_gae(rewards, torch.zeros(4, 2), torch.zeros(4, 2), dones, 1.0, 1.0,
                                      normalize_adv=False)
    assert advantages[:, 0].tolist() == [2.0, 1.0, 2.0, 1.0] and advantages[:, 1].tolist() == [4.0, 3.0, 2.0, 1.0]
    normalized, _ = compute_gae(rewards, torch.zeros(4, 2), torch.zeros(4, 2), dones, 1.0, 1.0)
    assert abs(normalized.mean().item()) < 1e-6


def test_gae_names_a_bad_argument():
    with pytest.raises(ValueError, match=r"values must be a 1-D array of 3 steps, got shape \(2,\)"):
        gae_steps(np.zeros(3), np.zeros(2), np.zeros(3), np.zeros(3, bool), np.ones(3, bool))
    with pytest.raises(ValueError, match="ends: the last step must end a segment"):
        gae_steps(np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2, bool), np.zeros(2, bool))
    with pytest.raises(ValueError, match="gamma must be a number in"):
        gae_steps(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1, bool), np.ones(1, bool), gamma=1.5)
    with pytest.raises(ValueError, match=r"dones must be a \[T, num_envs\] tensor of shape \(3, 2\)"):
        compute_gae(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3), 0.9, 0.9)
