"""`FreshnessSampler` on Ray stores of several shards: readers draw it from their views (no
actor call per sample), each step weighted by its lag behind the newest version of *every*
shard, none past ``max_lag``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import arrowbuf as ab
from arrowbuf import RayOptions
from arrowbuf.errors import EmptyStoreError

from support.episodes import versioned_episode as _episode

pytestmark = pytest.mark.usefixtures("ray_session")

SHARDS = 3
HALF_LIFE, MAX_LAG = 1.0, 3
OPTIONS = RayOptions(block_bytes=8_000, seal_latency=0.05)   # long episodes are lent as blocks of their own


def _write(store: ab.ExperienceStore, shard: int, versions, key: int) -> None:
    store.add_episode(_episode(versions, key), env_id=f"env-{shard}")


def _held(store: ab.ExperienceStore) -> tuple[np.ndarray, np.ndarray]:
    """(version, shard) of every live step, read back by index."""
    live = store.gather(np.concatenate([np.arange(a, b) for a, b in store.live_ranges()]))
    return live["policy_version"].numpy(), live["episode_id"].numpy() % store.num_shards


def _expected(versions: np.ndarray, shards: np.ndarray, total: int, half_life: float = HALF_LIFE,
              max_lag: int | None = MAX_LAG, min_version: int = 0) -> np.ndarray:
    """Expected draws per (version, shard) cell (``version * SHARDS + shard``): its steps times
    0.5 ** (lag / half_life), the lag counted from the newest version of all shards."""
    lag = versions.max() - versions
    weight = 0.5 ** (lag / half_life) * (versions >= min_version)
    if max_lag is not None:
        weight = weight * (lag <= max_lag)
    cells = np.bincount(versions * SHARDS + shards, weights=weight)
    return cells / cells.sum() * total


@pytest.fixture(scope="module")
def store():
    store = ab.ExperienceStore(capacity=3_000, backend="ray", num_shards=SHARDS, seed=0, ray_options=OPTIONS,
                               sampler=ab.FreshnessSampler(HALF_LIFE, MAX_LAG))
    for shard in range(SHARDS):
        store.pin_env(f"env-{shard}", shard)
    yield store
    store.close()


def _mixes(store: ab.ExperienceStore) -> None:
    """Three shards of different version mixes: old only, middle, and the newest."""
    store.clear()
    for key, (shard, versions) in enumerate([
            (0, [0] * 30), (0, [1] * 25), (0, [2] * 20),                  # all past max_lag but version 2
            (1, [2] * 15), (1, [3] * 40), (1, [3] * 10 + [4] * 12),       # one bumped mid-episode
            (2, [4] * 18), (2, [5] * 9), (2, [5, 4, 5, 5, 3, 5]), (2, [5] * 50)]):   # out of order; lent
        _write(store, shard, versions, key)
    store.flush()


def test_draws_weigh_every_shards_steps_by_their_lag_behind_the_newest_version_of_all(store):
    _mixes(store)
    versions, shards = _held(store)
    drawn = [store.sample(1_000) for _ in range(20)]
    cells = np.concatenate([(b["policy_version"] * SHARDS + b["episode_id"] % SHARDS).numpy() for b in drawn])
    expected = _expected(versions, shards, len(cells))
    counts = np.bincount(cells, minlength=len(expected))
    assert (counts[expected == 0] == 0).all()   # past max_lag (all of shard 0 but version 2): never drawn
    kept = expected > 0
    assert kept.sum() == 7   # (2, 0), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2), (5, 2)
    assert chisquare(counts[kept], expected[kept]).pvalue > 1e-3
    again = store.gather(drawn[0]["index"])   # real rows, as stored
    assert torch.equal(again["obs"], drawn[0]["obs"])
    assert torch.equal(again["policy_version"], drawn[0]["policy_version"])


def test_min_version_cuts_below_and_steps_of_one_version_are_equally_likely(store):
    _mixes(store)
    versions, shards = _held(store)
    batches = [store.sample(1_000, min_version=4) for _ in range(10)]
    cells = np.concatenate([(b["policy_version"] * SHARDS + b["episode_id"] % SHARDS).numpy() for b in batches])
    expected = _expected(versions, shards, len(cells), min_version=4)
    counts = np.bincount(cells, minlength=len(expected))
    assert (counts[expected == 0] == 0).all() and chisquare(counts[expected > 0], expected[expected > 0]).pvalue > 1e-3
    # Within version 5 (of shard 2's four episodes) every step is equally likely.
    obs = torch.cat([b["obs"][b["policy_version"] == 5] for b in batches]).numpy().astype(np.int64)
    codes = obs[:, 0] * 100 + obs[:, 1]
    steps = [7 * 100 + t for t in range(9)] + [800, 802, 803, 805] + [9 * 100 + t for t in range(50)]
    assert sorted(set(codes.tolist())) == steps
    assert chisquare(np.bincount(codes, minlength=1_000)[steps]).pvalue > 1e-3


def test_draws_need_no_call_to_the_shards(store, monkeypatch):
    _mixes(store)
    store.sample(8)   # views of every shard are in hand
    calls = []
    shards = store._backend.shards
    call = shards.call

    def counted(shard: int, method: str, *args, **kwargs):
        calls.append(method)
        return call(shard, method, *args, **kwargs)

    monkeypatch.setattr(shards, "call", counted)
    for _ in range(50):
        store.sample(64)
    assert set(calls) <= {"manifest"}   # the reader's polls, at most one per shard and seal_latency


@settings(max_examples=8, deadline=None)
@given(episodes=st.lists(st.tuples(st.integers(0, SHARDS - 1), st.integers(1, 40), st.integers(0, 9),
                                   st.integers(0, 3)), min_size=1, max_size=10),
       min_version=st.one_of(st.none(), st.integers(0, 10)))
def test_no_step_drawn_lags_the_newest_version_of_all_shards_by_more_than_max_lag(store, episodes, min_version):
    store.clear()
    for key, (shard, steps, version, bump) in enumerate(episodes):   # a suffix of steps may be newer
        versions = np.full(steps, version)
        versions[steps // 2:] += bump
        _write(store, shard, versions, key)
    versions, _ = _held(store)
    newest = int(versions.max())
    if min_version is not None and min_version > newest:
        with pytest.raises(EmptyStoreError, match=f"newest version held is {newest}"):
            store.sample(16, min_version=min_version)
        return
    batch = store.sample(512, min_version=min_version)
    drawn = batch["policy_version"].numpy()
    assert (newest - drawn <= MAX_LAG).all() and (drawn >= (min_version or 0)).all()
    again = store.gather(batch["index"])
    assert torch.equal(again["obs"], batch["obs"])


def test_sample_iter_draws_by_freshness_and_follows_a_newer_version_when_it_comes(store):
    _mixes(store)
    versions, shards = _held(store)
    stream = store.sample_iter(500, batches_per_request=4)
    cells = np.concatenate([(b["policy_version"] * SHARDS + b["episode_id"] % SHARDS).numpy()
                            for b in (next(stream) for _ in range(20))])
    expected = _expected(versions, shards, len(cells))
    counts = np.bincount(cells, minlength=len(expected))
    assert (counts[expected == 0] == 0).all() and chisquare(counts[expected > 0], expected[expected > 0]).pvalue > 1e-3
    fresh = store.sample_iter(64, min_version=5)
    assert next(fresh)["policy_version"].unique().tolist() == [5]
    _write(store, 0, [9] * 20, 99)   # shard 0 now holds the newest version: 5 lags by 4, past max_lag
    assert next(stream)["policy_version"].unique().tolist() == [9]
    assert next(fresh)["policy_version"].unique().tolist() == [9]


def test_an_empty_store_or_a_bound_past_every_step_raises_empty_store_error(store):
    store.clear()
    with pytest.raises(EmptyStoreError):
        store.sample(4)
    with pytest.raises(EmptyStoreError):
        next(store.sample_iter(4))
    _write(store, 1, [2] * 5, 1)
    _write(store, 2, [6] * 5, 2)
    with pytest.raises(EmptyStoreError, match="newest version held is 6"):
        store.sample(4, min_version=7)
    with pytest.raises(EmptyStoreError, match="newest version held is 6"):
        next(store.sample_iter(4, min_version=7))
    assert store.sample(64)["policy_version"].unique().tolist() == [6]   # 2 lags by 4


def test_shards_that_draw_alone_are_refused_with_several_and_taken_with_one():
    with pytest.raises(ValueError, match="rate_limiter=MinSize"):
        ab.ExperienceStore(capacity=100, backend="ray", num_shards=2, sampler=ab.FreshnessSampler(),
                           rate_limiter=ab.MinSize(1))
    with pytest.raises(ValueError, match="track_reuse=True"):
        ab.ExperienceStore(capacity=100, backend="ray", num_shards=2, sampler=ab.FreshnessSampler(), track_reuse=True)
    one = ab.ExperienceStore(capacity=100, backend="ray", num_shards=1, sampler=ab.FreshnessSampler(1.0, 0),
                             rate_limiter=ab.MinSize(1))
    try:
        one.add_episode(_episode([0] * 5))
        one.add_episode(_episode([1] * 5))
        assert one.sample(32)["policy_version"].unique().tolist() == [1]   # drawn by its shard
    finally:
        one.close()


def test_a_draw_from_some_shards_counts_lags_from_the_newest_version_of_every_shard(store):
    from arrowbuf.ray.reader import SampleRequest   # a worker's draw from its node's shards

    _mixes(store)
    store.sample(8)   # views of every shard are in hand
    reader = store._backend._reader
    drawn = reader.sample(SampleRequest(512, shards=(0,)))
    assert drawn["policy_version"].unique().tolist() == [2]   # 0 and 1 lag the newest (5, of shard 2) by 4+
    assert set((drawn["episode_id"] % SHARDS).tolist()) == {0}
    store.clear()
    _write(store, 0, [0] * 10, 1)
    _write(store, 2, [4] * 10, 2)
    with pytest.raises(EmptyStoreError, match="newest version held \\(4\\) by at most max_lag=3"):
        reader.sample(SampleRequest(16, shards=(0,)))
