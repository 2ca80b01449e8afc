"""Mixtures: exact per-source counts, uniform rows inside each source, schedules, priorities, Ray."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import arrowbuf as ab
from arrowbuf.errors import EmptyStoreError


def _store(seed: int, episodes: int, T: int = 10, **kwargs) -> ab.ExperienceStore:
    rng = np.random.default_rng(seed)
    store = ab.ExperienceStore(capacity=episodes * (T + 1), seed=seed, **kwargs)
    for _ in range(episodes):
        store.add_episode({"obs": rng.standard_normal((T + 1, 2)).astype(np.float32),
                           "action": rng.integers(0, 3, T).astype(np.int64),
                           "reward": rng.standard_normal(T).astype(np.float32),
                           "terminated": np.arange(T) == T - 1, "truncated": np.zeros(T, bool)})
    return store


def expected_counts(weights: list[float], batch_size: int) -> list[int]:
    """round(w * B) per source (half up), the remainder to the largest weight, written apart
    from the library's split (largest first; a negative remainder spills to the next largest)."""
    total = math.fsum(weights)
    shares = [w / total for w in weights]
    counts = [math.floor(s * batch_size + 0.5) for s in shares]
    remainder = batch_size - sum(counts)
    for k in sorted(range(len(shares)), key=lambda i: (-shares[i], i)):
        take = max(remainder, -counts[k])
        counts[k] += take
        remainder -= take
    return counts


SOURCES = {name: _store(seed, episodes) for seed, (name, episodes) in enumerate([("a", 3), ("b", 5), ("c", 2), ("d", 4)])}


@settings(max_examples=80, deadline=None)
@given(weights=st.lists(st.floats(0, 1), min_size=1, max_size=4).filter(lambda w: sum(w) > 1e-6),
       batch_size=st.integers(1, 300))
def test_every_batch_holds_exactly_round_w_b_rows_of_each_source(weights, batch_size):
    names = list(SOURCES)[:len(weights)]
    mixture = ab.Mixture({n: SOURCES[n] for n in names}, weights=dict(zip(names, weights)), seed=0)
    batch = mixture.sample(batch_size)
    expected = expected_counts(weights, batch_size)
    assert batch.batch_size == (batch_size,)
    assert batch["source"].dtype == torch.int64
    assert torch.bincount(batch["source"], minlength=len(names)).tolist() == expected
    assert mixture.counts(batch_size) == dict(zip(names, expected))
    for k, name in enumerate(names):   # each row is its source's transition
        rows = batch["source"] == k
        if bool(rows.any()):
            own = SOURCES[name].gather(batch["index"][rows])
            assert torch.equal(own["obs"], batch["obs"][rows]) and torch.equal(own["next", "obs"],
                                                                                batch["next", "obs"][rows])


def test_rows_inside_each_source_are_uniform():
    small, large = _store(10, 4), _store(11, 9)
    mixture = ab.Mixture({"demos": small, "online": large}, weights={"demos": 0.25, "online": 0.75}, seed=0)
    counts = {0: np.zeros(len(small), np.int64), 1: np.zeros(len(large), np.int64)}
    for _ in range(400):
        batch = mixture.sample(64)
        for k in (0, 1):
            index = batch["index"][batch["source"] == k].numpy()
            counts[k] += np.bincount(index, minlength=len(counts[k]))
    assert counts[0].sum() == 400 * 16 and counts[1].sum() == 400 * 48
    for k in (0, 1):
        assert chisquare(counts[k]).pvalue > 1e-3, counts[k]


def test_an_annealed_schedule_is_followed_exactly():
    mixture = ab.Mixture({"demos": _store(0, 3), "online": _store(1, 3)}, weights={"demos": 1.0, "online": 0.0})
    for step in range(41):
        demo = max(0.0, 0.5 - step / 80)                 # 0.5 -> 0 over 40 steps
        mixture.set_weights({"demos": demo, "online": 1 - demo})
        batch = mixture.sample(100)
        assert torch.bincount(batch["source"], minlength=2).tolist() == expected_counts([demo, 1 - demo], 100)


def test_a_dataset_and_a_store_mix(tmp_path):
    demos = ab.open_dataset(_store(3, 4).to_parquet(tmp_path / "demos"), seed=0)
    online = _store(4, 6)
    mixture = ab.Mixture({"demos": demos, "online": online}, weights={"demos": 0.25, "online": 0.75})
    batch = mixture.sample(256, n_step=3, gamma=0.9)
    assert torch.bincount(batch["source"]).tolist() == [64, 192]
    assert {"n_steps", "discount"} <= set(batch.keys())
    stream = mixture.sample_iter(32)
    assert [torch.bincount(next(stream)["source"]).tolist() for _ in range(2)] == [[8, 24], [8, 24]]
    mixture.set_weights({"demos": 0.5, "online": 0.5})
    assert torch.bincount(next(stream)["source"]).tolist() == [16, 16]


def test_sample_iter_takes_keys_as_sample_does_on_every_kind_of_source(tmp_path):
    """``keys=`` reached each source's ``sample_iter``, which took no such argument (TypeError); a bad
    key is refused when the stream is made, not at its first batch."""
    demos = ab.open_dataset(_store(3, 4).to_parquet(tmp_path / "demos"), seed=0)
    online = _store(4, 6)
    mixture = ab.Mixture({"demos": demos, "online": online}, weights={"demos": 0.5, "online": 0.5})
    batch = next(mixture.sample_iter(16, keys=["obs", "reward"]))
    assert set(batch.keys()) == {"obs", "reward", "index", "episode_id", "step", "source"}
    for source in (demos, online):
        assert set(next(source.sample_iter(8, keys=["action"])).keys()) == {"action", "index", "episode_id", "step"}
        with pytest.raises(ValueError, match="nope"):
            source.sample_iter(8, keys=["nope"])
    with pytest.raises(ValueError, match="batch_size"):
        demos.sample_iter(0)   # checked when called: its generator checked at the first batch


def test_the_pooled_path_gives_each_sources_own_draws_and_never_overwrites_a_kept_batch(tmp_path):
    export = _store(3, 4).to_parquet(tmp_path / "demos")
    demos, online = ab.open_dataset(export, seed=0), _store(4, 6)
    twins = ab.open_dataset(export, seed=0), _store(4, 6)   # the same sources, sampled one by one
    mixture = ab.Mixture({"demos": demos, "online": online}, weights={"demos": 0.25, "online": 0.75})
    kept = [mixture.sample(40) for _ in range(6)]          # no arguments: one pooled slot per batch
    assert len({batch["obs"].data_ptr() for batch in kept}) == 6
    for batch in kept:                                      # checked after all were drawn
        parts = [twins[0].sample(10), twins[1].sample(30)]
        assert batch["source"].tolist() == [0] * 10 + [1] * 30
        for key in parts[0].keys(include_nested=True, leaves_only=True):
            assert torch.equal(batch[key], torch.cat([parts[0][key], parts[1][key]])), key
    assert online.stats()["samples"] == 6 * 30
    a, b = _store(5, 3), _store(6, 3)
    pair = ab.Mixture({"a": a, "b": b}, weights={"a": 0.5, "b": 0.5})
    assert "policy_version" not in pair.sample(8).keys()
    for store in (a, b):   # a new column: each shard's gather changes, the pooled plan is rebuilt
        store.add_episode({"obs": np.zeros((4, 2), np.float32), "action": np.zeros(3, np.int64),
                           "reward": np.zeros(3, np.float32), "terminated": np.arange(3) == 2,
                           "truncated": np.zeros(3, bool)}, policy_version=7)
    batch = pair.sample(300)
    assert batch["policy_version"].max().item() == 7 and batch["source"].tolist() == [0] * 150 + [1] * 150
    assert torch.equal(batch["policy_version"] == 7, batch["episode_id"] == 3)


def test_a_datasets_share_drawn_ahead_is_the_draws_of_its_own_samples_in_turn(tmp_path):
    from arrowbuf import _mixed

    export = _store(3, 4).to_parquet(tmp_path / "demos")
    demos, twin = ab.open_dataset(export, seed=2), ab.open_dataset(export, seed=2)
    online, online_twin = _store(4, 6), _store(4, 6)
    mixture = ab.Mixture({"online": online, "demos": demos}, weights={"online": 0.5, "demos": 0.5})
    for n in range(2 * _mixed.AHEAD + 3):   # past two refills of the drawn-ahead share
        batch = mixture.sample(14)
        expected = [online_twin.sample(7), twin.sample(7)]
        for key in expected[0].keys(include_nested=True, leaves_only=True):
            assert torch.equal(batch[key], torch.cat([expected[0][key], expected[1][key]])), (n, key)
        if n == 5:   # a write to the online store between batches: its share draws from it at once
            for store in (online, online_twin):
                store.add_episode({"obs": np.full((4, 2), 9, np.float32), "action": np.zeros(3, np.int64),
                                   "reward": np.zeros(3, np.float32), "terminated": np.arange(3) == 2,
                                   "truncated": np.zeros(3, bool)})
    assert mixture._plans[14].parts[1].ahead == _mixed.AHEAD and mixture._plans[14].parts[0].ahead == 1


def test_priorities_of_a_prioritized_source_are_updated_through_the_mixture(tmp_path):
    demos = ab.open_dataset(_store(5, 4).to_parquet(tmp_path / "demos"), seed=0)
    online = _store(6, 6, sampler=ab.PrioritizedSampler(alpha=1.0, beta=1.0))
    mixture = ab.Mixture({"demos": demos, "online": online}, weights={"demos": 0.5, "online": 0.5}, seed=0)
    batch = mixture.sample(64)
    assert torch.equal(batch["weight"][batch["source"] == 0], torch.ones(32))   # a uniform source's weight
    favourite = int(batch["index"][batch["source"] == 1][0])
    priority = torch.where(batch["source"] == 1, 1e-6, 5.0)
    priority[(batch["source"] == 1) & (batch["index"] == favourite)] = 1e6   # every copy of it
    assert mixture.update_priorities(batch, priority) == {"online": 32}
    later = mixture.sample(200)
    assert (later["index"][later["source"] == 1] == favourite).float().mean() > 0.9
    with pytest.raises(ValueError, match="one value per row"):
        mixture.update_priorities(batch, torch.ones(3))


def test_bad_weights_and_sources_are_refused_and_change_nothing():
    mixture = ab.Mixture({"a": _store(0, 2), "b": _store(1, 2)}, weights={"a": 1, "b": 3})
    for weights in ({"a": 1}, {"a": 1, "b": 1, "c": 1}, {"a": -1, "b": 1}, {"a": 0, "b": 0},
                    {"a": float("nan"), "b": 1}, {"a": True, "b": 1}, [0.5, 0.5]):
        with pytest.raises(ValueError, match="weights"):
            mixture.set_weights(weights)
    assert mixture.weights == {"a": 0.25, "b": 0.75}
    with pytest.raises(ValueError, match="sources"):
        ab.Mixture({}, weights={})
    with pytest.raises(ValueError, match="sample"):
        ab.Mixture({"a": object()}, weights={"a": 1})
    with pytest.raises(ValueError, match="batch_size"):
        mixture.sample(0)
    mixture.sample(1)   # a pooled plan for batch size 1 now exists: True and 1.0 hash as 1 and must not find it
    for bad in (True, 1.0, np.float64(1)):
        with pytest.raises(ValueError, match="batch_size"):
            mixture.sample(bad)
    other = ab.ExperienceStore(capacity=100)
    other.add_episode({"obs": np.zeros((4, 2), np.float32), "extra": np.zeros(3, np.int8),
                       "terminated": np.array([False, False, True])})
    with pytest.raises(ValueError, match="different keys"):
        ab.Mixture({"a": _store(0, 2), "x": other}, weights={"a": 1, "x": 1}).sample(8)
    empty = ab.ExperienceStore(capacity=100)
    with pytest.raises(EmptyStoreError):
        ab.Mixture({"a": _store(0, 2), "e": empty}, weights={"a": 1, "e": 1}).sample(8)
    assert torch.bincount(ab.Mixture({"a": _store(0, 2), "e": empty}, weights={"a": 1, "e": 0}).sample(8)["source"]
                          ).tolist() == [8]


@pytest.mark.usefixtures("ray_session")
def test_a_ray_store_mixes_with_a_dataset(tmp_path):
    demos = ab.open_dataset(_store(7, 4).to_parquet(tmp_path / "demos"), seed=0)
    online = ab.ExperienceStore(capacity=2_000, backend="ray", num_shards=1, seed=0)
    try:
        rng = np.random.default_rng(0)
        for _ in range(6):
            online.add_episode({"obs": rng.standard_normal((11, 2)).astype(np.float32),
                                "action": rng.integers(0, 3, 10).astype(np.int64),
                                "reward": np.ones(10, np.float32), "terminated": np.arange(10) == 9,
                                "truncated": np.zeros(10, bool)})
        online.flush()
        mixture = ab.Mixture({"demos": demos, "online": online}, weights={"demos": 0.25, "online": 0.75})
        assert torch.bincount(mixture.sample(64)["source"]).tolist() == [16, 48]
        stream = mixture.sample_iter(40)
        for _ in range(3):
            batch = next(stream)
            assert torch.bincount(batch["source"]).tolist() == [10, 30]
            rows = batch["source"] == 1
            assert torch.equal(online.gather(batch["index"][rows])["obs"], batch["obs"][rows])
    finally:
        online.close()
