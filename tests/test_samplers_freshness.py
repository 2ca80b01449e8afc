"""`FreshnessSampler`: draws weighted by 0.5 ** (lag / half_life), uniform within a version."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import arrowbuf as ab
from arrowbuf.errors import EmptyStoreError

from support.episodes import versioned_episode as _episode


def _drawn(store: ab.ExperienceStore, draws: int = 40, **kwargs) -> np.ndarray:
    return np.concatenate([store.sample(500, **kwargs)["policy_version"].numpy() for _ in range(draws)])


def _expected(steps_per_version: np.ndarray, half_life: float, max_lag: int | None, total: int) -> np.ndarray:
    """Expected draws per version: steps times 0.5 ** (lag / half_life), 0 past max_lag."""
    lag = len(steps_per_version) - 1 - np.arange(len(steps_per_version))
    weight = steps_per_version * 0.5 ** (lag / half_life)
    if max_lag is not None:
        weight[lag > max_lag] = 0
    return weight / weight.sum() * total


@pytest.mark.parametrize("half_life, max_lag", [(1.0, None), (2.5, None), (1.5, 3)])
def test_versions_are_drawn_in_proportion_to_steps_times_their_freshness(half_life, max_lag):
    store = ab.ExperienceStore(capacity=2_000, sampler=ab.FreshnessSampler(half_life, max_lag), seed=0)
    steps = np.zeros(7, np.int64)
    rng = np.random.default_rng(1)
    for version in range(6):
        T = int(rng.integers(5, 30))
        store.add_episode(_episode(np.full(T, version), version))
        steps[version] += T
    store.add_episode(_episode([5] * 4 + [6] * 6 + [5] * 2, 9))   # versions changing inside an episode
    steps[5] += 6
    steps[6] += 6
    drawn = _drawn(store)
    counts = np.bincount(drawn, minlength=7)
    expected = _expected(steps, half_life, max_lag, len(drawn))
    assert (counts[expected == 0] == 0).all()                          # past max_lag: never drawn
    kept = expected > 0
    assert chisquare(counts[kept], expected[kept]).pvalue > 1e-3


def test_steps_of_one_version_are_equally_likely_and_min_version_cuts_below():
    store = ab.ExperienceStore(capacity=2_000, sampler=ab.FreshnessSampler(half_life=1.0), seed=2)
    store.add_episode(_episode([3] * 10, 1))
    store.add_episode(_episode([2, 3, 3, 2, 3], 2))   # out of order: its version-3 steps join the rest
    store.add_episode(_episode([1] * 8, 3))
    obs = np.concatenate([store.sample(400, min_version=3)["obs"].numpy() for _ in range(30)]).astype(np.int64)
    cells = [(1, t) for t in range(10)] + [(2, 1), (2, 2), (2, 4)]
    codes = obs[:, 0] * 100 + obs[:, 1]
    assert sorted(set(codes.tolist())) == [k * 100 + t for k, t in cells]
    assert chisquare(np.bincount(codes, minlength=300)[[k * 100 + t for k, t in cells]]).pvalue > 1e-3
    with pytest.raises(EmptyStoreError, match="newest version held is 3"):
        store.sample(4, min_version=4)
    iterated = next(store.sample_iter(64, min_version=3))
    assert iterated["policy_version"].unique().tolist() == [3]


def test_weights_follow_the_newest_version_as_it_moves_and_as_stale_episodes_are_evicted():
    store = ab.ExperienceStore(capacity=2_000, sampler=ab.FreshnessSampler(half_life=1.0, max_lag=1), seed=3)
    store.add_episode(_episode([0] * 20))
    store.add_episode(_episode([1] * 20))
    assert set(_drawn(store, 4).tolist()) == {0, 1}
    store.add_episode(_episode([2] * 20))   # version 0 now lags by 2: past max_lag
    assert set(_drawn(store, 4).tolist()) == {1, 2}
    assert store.evict(min_version=2) == 2
    assert set(_drawn(store, 4).tolist()) == {2}


def test_a_store_without_versions_draws_uniformly_and_bad_arguments_are_refused(tmp_path):
    store = ab.ExperienceStore(capacity=200, sampler=ab.FreshnessSampler(half_life=3.0, max_lag=2), seed=0)
    store.add_episode({k: v for k, v in _episode([0] * 6, 4).items() if k != "policy_version"})
    store.add_episode({k: v for k, v in _episode([0] * 6, 5).items() if k != "policy_version"})
    obs = np.concatenate([store.sample(300)["obs"].numpy() for _ in range(20)]).astype(np.int64)
    assert chisquare(np.bincount((obs[:, 0] - 4) * 6 + obs[:, 1], minlength=12)).pvalue > 1e-3
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert repr(loaded.sampler) == repr(store.sampler) == "FreshnessSampler(half_life=3.0, max_lag=2)"
    for half_life, max_lag in ((0, None), (-1.0, None), ("1", None), (True, None), (1.0, -1), (1.0, 1.5)):
        with pytest.raises(ValueError, match="half_life" if max_lag is None else "max_lag"):
            ab.FreshnessSampler(half_life, max_lag)
    empty = ab.ExperienceStore(capacity=10, sampler=ab.FreshnessSampler())
    with pytest.raises(EmptyStoreError):
        empty.sample(1)
