"""Policy versions on Ray stores: readers draw fresh steps from their views (no actor call per
sample), draws ahead never cross bounds, shards evict stale episodes FIFO."""

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

#: Rows of `_episode` take 30 bytes: an episode of 34+ steps fills an eighth of a block and is
#: lent to its shard as a block of its own (`arrowbuf.ray.blocks`), shorter ones are copied.
LENDS = RayOptions(block_bytes=8_000, seal_latency=0.05)


def _newest_step_version(store: ab.ExperienceStore, episode_id: int) -> int:
    rows = store.episode(episode_id)
    steps = rows.num_rows - int(rows.schema.metadata[b"arrowbuf.has_final"] == b"1")
    return int(rows.column("policy_version").to_numpy()[:steps].max(initial=-1))


# ("write", steps, version bump, bump mid-episode), ("evict", offset below the newest), ("sample", offset),
# ("epoch", offset).
OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(1, 60), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("evict"), st.integers(0, 3)),
    st.tuples(st.just("sample"), st.integers(0, 3)),
    st.tuples(st.just("epoch"), st.integers(0, 3))), min_size=1, max_size=14)


@pytest.fixture(scope="module")
def ray_store():
    store = ab.ExperienceStore(capacity=300, backend="ray", num_shards=2, seed=0, ray_options=LENDS)
    yield store
    store.close()


def test_evict_reads_the_versions_of_a_lent_episode_its_shard_has_not_copied_in_yet(ray_store):
    # A lent episode's rows reach the arena only when the shard reads them: evict(min_version)
    # read the arena rows under it instead, here the newer versions of a cleared episode.
    store = ray_store
    for version, expect_freed in ((5, 0), (0, 1)):
        store.clear()
        store.add_episode(_episode(np.full(48, version), key=1))   # 48 steps: lent (`LENDS`)
        store.add_episode(_episode(np.full(1, 1), key=2))
        assert store.evict(min_version=1) == expect_freed
        assert store.episodes().num_rows == 2 - expect_freed
        store.episode(store.episodes().column("episode_id")[0].as_py())   # read: copied in


@settings(max_examples=10, deadline=None)
@given(ops=OPS)
def test_no_step_sampled_from_a_ray_store_is_older_than_the_bound(ray_store, ops):
    store = ray_store
    store.clear()
    version, key = 0, 0
    for op in ops:
        if op[0] == "write":
            steps, bump, mid = op[1], op[2], op[3]
            versions = np.full(steps, version + bump)
            if mid:   # the policy changed mid-episode: a suffix of newer steps
                versions[: steps // 2] = version
            key += 1
            store.add_episode(_episode(versions, key))
            version = int(versions[-1])
            continue
        if not store.num_episodes:
            continue
        bound = max(0, version - op[1])
        if op[0] == "evict":
            before = store.episodes()
            freed = store.evict(min_version=bound)
            after = store.episodes()
            assert after.num_rows == before.num_rows - freed
            kept = set(after.column("episode_id").to_pylist())
            for shard in range(store.num_shards):
                ids = [i for i in before.column("episode_id").to_pylist() if i % store.num_shards == shard]
                gone = [i for i in ids if i not in kept]
                assert gone == ids[:len(gone)]                                     # FIFO per shard, no holes
                assert all(_newest_step_version(store, i) >= bound for i in ids[len(gone):len(gone) + 1])
            if kept:
                plain = store.sample(64)                                           # this process sees its eviction
                assert set(plain["episode_id"].tolist()) <= kept
            continue
        try:
            if op[0] == "sample":
                batches = [store.sample(32, min_version=bound)]
            else:
                batches = list(store.iter_batches(16, min_version=bound))
        except EmptyStoreError as err:   # only when nothing stored qualifies
            newest = max(_newest_step_version(store, i) for i in store.episodes().column("episode_id").to_pylist())
            assert newest < bound and f"newest version held is {newest}" in str(err)
            continue
        for batch in batches:
            assert bool((batch["policy_version"] >= bound).all())
            again = store.gather(batch["index"])                                  # real rows, as stored
            assert torch.equal(again["policy_version"], batch["policy_version"])
            assert torch.equal(again["obs"], batch["obs"])
        if op[0] == "epoch":   # every qualifying step once
            live = store.gather(np.concatenate([np.arange(a, b) for a, b in store.live_ranges()]))
            indices = torch.cat([b["index"] for b in batches])
            assert len(indices) == len(indices.unique()) == int((live["policy_version"] >= bound).sum())


def test_fresh_draws_on_ray_are_uniform_over_qualifying_steps_of_every_shard(ray_store):
    store = ray_store
    store.clear()
    store.add_episode(_episode([0] * 5, 1))              # too old
    store.add_episode(_episode([1, 1, 2, 2, 2], 2))      # its suffix qualifies (read from its block)
    store.add_episode(_episode([2, 0, 3, 1], 3))         # out of order: steps 0 and 2
    store.add_episode(_episode([4] * 40, 4))             # lent: its bounds came with the lend
    store.add_episode(_episode([5] * 3, 5))
    store.flush()
    drawn = torch.cat([store.sample(256, min_version=2)["obs"] for _ in range(40)]).numpy().astype(np.int64)
    cells = {(k, t) for k, t in drawn.tolist()}
    expected = {(2, 2), (2, 3), (2, 4), (3, 0), (3, 2)} | {(4, t) for t in range(40)} | {(5, t) for t in range(3)}
    assert cells == expected
    codes = drawn[:, 0] * 100 + drawn[:, 1]
    counts = np.bincount(codes, minlength=600)[sorted(k * 100 + t for k, t in expected)]
    assert chisquare(counts).pvalue > 1e-3
    listed = torch.cat([b["obs"] for b in store.iter_batches(7, min_version=2)]).numpy()
    assert sorted(map(tuple, listed.astype(np.int64).tolist())) == sorted(expected)
    with pytest.raises(EmptyStoreError, match="newest version held is 5"):
        store.sample(4, min_version=6)
    with pytest.raises(EmptyStoreError, match="newest version held is 5"):
        store.iter_batches(4, min_version=6)


def test_batches_drawn_ahead_for_one_bound_are_never_handed_out_for_a_newer_one(ray_store):
    store = ray_store
    store.clear()
    for version in range(3):
        store.add_episode(_episode([version] * 20, version))
    for _ in range(5):   # the loop of this request draws batches ahead
        assert int(store.sample(16, min_version=0)["policy_version"].min()) >= 0
    stream = store.sample_iter(16, batches_per_request=8, min_version=1)
    assert int(next(stream)["policy_version"].min()) >= 1
    store.add_episode(_episode([7] * 20, 7))
    for _ in range(5):   # alternating requests: each is served from its own draws
        assert store.sample(16, min_version=7)["policy_version"].unique().tolist() == [7]
        assert int(store.sample(16, min_version=0)["policy_version"].min()) >= 0
        assert int(next(stream)["policy_version"].min()) >= 1
    assert store.evict(min_version=3) == 3
    assert store.sample(64, min_version=0)["policy_version"].unique().tolist() == [7]   # no evicted row
    assert next(stream)["policy_version"].unique().tolist() == [7]
    parts = store.sample(16, min_version=7, num_workers=2)
    assert [p["policy_version"].unique().tolist() for p in parts] == [[7], [7]]


def test_a_writers_versions_are_drawn_and_evicted_on_ray(ray_store):
    store = ray_store
    store.clear()
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    obs = np.zeros((2, 2), np.float32)
    for t in range(8):
        writer.add(obs=obs, action=np.full(2, t, np.int64), reward=np.ones(2, np.float32),
                   terminated=np.full(2, t % 4 == 3), truncated=np.zeros(2, bool), next_obs=obs,
                   policy_version=t // 4)
    store.flush()
    fresh = store.sample(64, min_version=1)
    assert fresh["policy_version"].unique().tolist() == [1] and int(fresh["action"].min()) == 4
    assert store.evict(min_version=1) == 2 and len(store) == 8


def test_ray_stores_refuse_min_version_where_shards_draw_and_leave_the_store_unchanged(ray_store):
    per = ab.ExperienceStore(capacity=1_000, backend="ray", num_shards=1, sampler=ab.PrioritizedSampler())
    plain = ray_store
    plain.clear()
    try:
        per.add_episode(_episode([1, 2]))
        with pytest.raises(ValueError, match="UniformSampler"):
            per.sample(4, min_version=1)
        with pytest.raises(ValueError, match="UniformSampler"):
            per.sample_iter(4, min_version=1)
        plain.add_episode(_episode([1, 2]))
        for bad in (-1, 0.5, "x"):
            for call in (lambda: plain.sample(4, min_version=bad), lambda: plain.evict(min_version=bad),
                         lambda: plain.sample_iter(4, min_version=bad)):
                with pytest.raises(ValueError, match="min_version"):
                    call()
        assert len(plain) == 2 and plain.evict(min_version=1) == 0 and plain.evict(min_version=3) == 1
        assert len(plain) == 0
    finally:
        per.close()


def test_a_ray_store_takes_versions_from_add_episode_and_writers_in_any_order():
    store = ab.ExperienceStore(capacity=1_000, backend="ray", num_shards=2, seed=0)
    try:
        store.add_episode(_episode([1, 1, 1], 0))                   # a policy_version field in the data
        store.add_episode({k: v for k, v in _episode([0] * 3, 1).items() if k != "policy_version"},
                          policy_version=2)                          # the keyword
        obs = np.zeros((2, 2), np.float32)
        for key, version in ((2, None), (3, 3)):                     # a writer's steps without, then with
            writer = store.writer(num_envs=2, autoreset_mode="disabled")
            for t in range(3):
                writer.add(obs=obs, action=np.full(2, key, np.int64), reward=np.ones(2, np.float32),
                           terminated=np.full(2, t == 2), truncated=np.zeros(2, bool), next_obs=obs,
                           **({} if version is None else {"policy_version": version}))
            writer.flush()
        store.add_episode({k: v for k, v in _episode([0] * 3, 4).items() if k != "policy_version"})   # version 0
        store.flush()
        live = store.gather(np.concatenate([np.arange(a, b) for a, b in store.live_ranges()]))
        held = {key: live["policy_version"][live["action"] == key].unique().tolist() for key in range(5)}
        assert held == {0: [1], 1: [2], 2: [0], 3: [3], 4: [0]}
        assert store.sample(32, min_version=3)["action"].unique().tolist() == [3]
    finally:
        store.close()
