"""Policy versions: fresh-only draws, the newest version named, FIFO eviction of stale episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import arrowbuf as ab
from arrowbuf.errors import EmptyStoreError


def _episode(T: int, version, rng=None) -> dict:
    rng = rng or np.random.default_rng(0)
    versions = np.broadcast_to(np.asarray(version, np.int64), (T,)).copy()
    return {"obs": rng.standard_normal((T + 1, 2)).astype(np.float32), "action": np.arange(T, dtype=np.int64),
            "reward": np.ones(T, np.float32), "terminated": np.arange(T) == T - 1, "truncated": np.zeros(T, bool),
            "policy_version": versions}


# An interleaving: ("write", T, version bump), ("evict", offset below the newest), ("sample", offset).
OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("evict"), st.integers(0, 3)),
    st.tuples(st.just("sample"), st.integers(0, 3))), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, capacity=st.integers(20, 80))
def test_no_sampled_step_is_older_than_the_bound(ops, capacity):
    store = ab.ExperienceStore(capacity=capacity, seed=0)
    engine = store.engine
    version = 0
    for op in ops:
        if op[0] == "write":
            T, bump = op[1], op[2]
            versions = version + np.sort(np.random.default_rng(T).integers(0, bump + 1, T))   # bumps mid-episode too
            store.add_episode(_episode(min(T, capacity - 1), versions[:min(T, capacity - 1)]))
            version = int(versions[-1])
            continue
        if not len(store):
            continue
        newest = max(newest_step_version(store, i) for i in store.episodes().column("episode_id").to_pylist())
        bound = max(0, newest - op[1])
        if op[0] == "evict":
            ids = store.episodes().column("episode_id").to_pylist()
            newest_of = [newest_step_version(store, i) for i in ids]
            freed = engine.evict(bound)
            assert store.episodes().column("episode_id").to_pylist() == ids[freed:]    # FIFO, no holes
            assert all(v < bound for v in newest_of[:freed])                           # only stale ones
            assert freed == len(ids) or newest_of[freed] >= bound                      # up to a fresh one
        else:
            batch = engine.sample(64, min_version=bound)
            assert bool((batch["policy_version"] >= bound).all())
            again = store.gather(batch["index"])   # real stored rows, versions as stored
            assert torch.equal(again["policy_version"], batch["policy_version"])


def newest_step_version(store: ab.ExperienceStore, episode_id: int) -> int:
    """The newest version among an episode's steps (-1 for none)."""
    rows = store.episode(episode_id)
    steps = rows.num_rows - int(rows.schema.metadata[b"arrowbuf.has_final"] == b"1")
    return int(rows.column("policy_version").to_numpy()[:steps].max(initial=-1))


def test_fresh_draws_are_uniform_over_the_qualifying_steps():
    store = ab.ExperienceStore(capacity=1_000, seed=1)
    for version in range(6):
        store.add_episode(_episode(20, version))
    counts = np.zeros(len(store), np.int64)
    for _ in range(300):
        index = store.engine.sample(64, min_version=4)["index"].numpy()
        counts += np.bincount(index, minlength=len(store))
    assert counts[:80].sum() == 0          # versions 0..3: never drawn
    assert chisquare(counts[80:]).pvalue > 1e-3


def test_too_fresh_a_bound_names_the_newest_version_held_and_rare_fresh_steps_are_still_found():
    store = ab.ExperienceStore(capacity=10_000, seed=2)
    for _ in range(50):
        store.add_episode(_episode(100, 3))
    store.add_episode(_episode(2, [3, 7]))   # 1 step of version 7 among 5,002: past rejection, listed
    with pytest.raises(EmptyStoreError, match="newest version held is 7"):
        store.engine.sample(8, min_version=8)
    assert store.engine.sample(16, min_version=7)["policy_version"].tolist() == [7] * 16
    seq = ab.ExperienceStore(capacity=1_000, sampler=ab.SequenceSampler(seq_len=2))
    seq.add_episode(_episode(10, 1))
    with pytest.raises(ValueError, match="UniformSampler"):
        seq.engine.sample(4, min_version=1)


def test_evicting_older_episodes_frees_them_for_the_sampler_and_new_writes():
    store = ab.ExperienceStore(capacity=200, seed=3, sampler=ab.PrioritizedSampler())
    for version in (0, 0, 1, 2, 1):
        store.add_episode(_episode(10, version))
    assert store.engine.evict(2) == 3       # stops at version 2 (the version-1 episode after it stays)
    assert store.episodes().column("episode_id").to_pylist() == [3, 4]
    assert len(store) == 20
    assert set(store.sample(256)["index"].tolist()) <= set(range(30, 50))   # the sum tree forgot the freed rows
    store.add_episode(_episode(10, 3))
    assert len(store) == 30


def test_a_dataset_exported_with_versions_samples_fresh_steps(tmp_path):
    store = ab.ExperienceStore(capacity=1_000, seed=4)
    for version in range(5):
        store.add_episode(_episode(10, version))
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"), seed=0)
    assert dataset.sample(64, min_version=3)["policy_version"].min().item() == 3
    assert sorted(torch.cat([b["policy_version"] for b in dataset.iter_batches(7, min_version=4)]).tolist()) == [4] * 10
    with pytest.raises(EmptyStoreError, match="newest version held is 4"):
        dataset.sample(4, min_version=5)


def _full(T: int) -> dict:
    """`_episode` without its policy_version field."""
    episode = _episode(T, 0)
    del episode["policy_version"]
    return episode


def _plain(T: int) -> dict:
    return {"obs": np.zeros((T + 1, 2), np.float32), "action": np.arange(T, dtype=np.int64),
            "terminated": np.arange(T) == T - 1}


def test_the_store_keywords_store_sample_export_and_checkpoint_versions(tmp_path):
    store = ab.ExperienceStore(capacity=1_000, seed=5)
    store.add_episode(_plain(5))                                   # no version: 0
    store.add_episode(_plain(5), policy_version=2)
    store.add_episode(_plain(4), policy_version=np.array([2, 3, 3, 4]))   # one per step
    store.add_episodes({"obs": np.zeros((2, 6, 2), np.float32), "action": np.zeros((2, 5), np.int64),
                        "terminated": np.zeros((2, 5), bool)}, policy_version=[5, 6])
    store.add_episode(_plain(3))                                   # no version again: 0
    versions = store.to_arrow().column("policy_version").to_numpy()
    assert versions[:6].tolist() == [0] * 6 and versions[6:11].tolist() == [2] * 5
    assert store.sample(64, min_version=5)["policy_version"].unique().tolist() == [5, 6]
    epoch = torch.cat([b["policy_version"] for b in store.iter_batches(4, min_version=4, epochs=2)])
    assert sorted(epoch.tolist()) == sorted([4] * 2 + [5] * 10 + [6] * 10)
    with pytest.raises(EmptyStoreError, match="newest version held is 6"):
        store.sample(4, min_version=7)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert torch.equal(loaded.gather(np.arange(len(store)))["policy_version"],
                       store.gather(np.arange(len(store)))["policy_version"])
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"), seed=0)   # the offline round trip
    assert dataset.sample(32, min_version=6)["policy_version"].unique().tolist() == [6]
    assert store.evict(min_version=3) == 2 and store.num_episodes == 4           # FIFO, up to the mixed one
    assert len(store) == 4 + 10 + 3


def test_bad_versions_and_ray_stores_are_refused_and_leave_the_store_unchanged():
    store = ab.ExperienceStore(capacity=1_000)
    store.add_episode(_plain(3), policy_version=1)
    for bad in (-1, 1.5, True, [1, 2], "3"):
        with pytest.raises(ValueError, match="policy_version"):
            store.add_episode(_plain(3), policy_version=bad)
    with pytest.raises(ValueError, match="policy_version"):
        store.add_episode({**_plain(3), "policy_version": np.ones(3, np.int64)}, policy_version=1)
    with pytest.raises(ValueError, match="one per episode"):
        store.add_episodes({"obs": np.zeros((2, 4, 2), np.float32), "action": np.zeros((2, 3), np.int64),
                            "terminated": np.zeros((2, 3), bool)}, policy_version=[1, 2, 3])
    assert store.num_episodes == 1
    for bad in (-1, 0.5, "x"):
        with pytest.raises(ValueError, match="min_version"):
            store.sample(4, min_version=bad)
        with pytest.raises(ValueError, match="min_version"):
            store.evict(min_version=bad)



def test_a_declared_policy_version_field_of_another_dtype_refuses_the_keyword_naming_it():
    # 1b3f084: "missing ['policy_version']", as if the keyword had not been given.
    schema = {"obs": ab.Field("float32", (2,), observation=True), "action": ab.Field("int64"),
              "terminated": ab.Field("bool"), "policy_version": ab.Field("int32")}
    store = ab.ExperienceStore(capacity=100, schema=schema)
    store.add_episode({**_plain(3), "policy_version": np.full(3, 2, np.int32)})
    before = store.to_arrow()
    with pytest.raises(ValueError, match=r"policy_version=5 fills .* declared as .*int32.*Field\('int64'\)"):
        store.add_episode(_plain(3), policy_version=5)
    assert store.to_arrow().equals(before) and store.num_episodes == 1

@pytest.mark.usefixtures("ray_session")
def test_a_ray_store_stores_versions_from_every_write_path():
    store = ab.ExperienceStore(capacity=1_000, backend="ray", num_shards=1, seed=0)
    late = ab.ExperienceStore(capacity=1_000, backend="ray", num_shards=1)
    try:
        store.add_episode(_full(3), policy_version=1)
        store.add_episodes({"obs": np.zeros((2, 4, 2), np.float32), "action": np.zeros((2, 3), np.int64),
                            "reward": np.ones((2, 3), np.float32), "terminated": np.zeros((2, 3), bool),
                            "truncated": np.zeros((2, 3), bool)}, policy_version=[2, 3])
        store.add_episode(_full(3))                                             # version 0
        writer = store.writer(num_envs=2)   # steps without a version: 0
        obs = np.zeros((2, 2), np.float32)
        for t in range(2):
            writer.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32),
                       terminated=np.full(2, t == 1), truncated=np.zeros(2, bool), next_obs=obs)
        store.flush()
        held = store.to_arrow().column("policy_version").to_numpy()
        assert sorted(set(held.tolist())) == [0, 1, 2, 3]
        assert set(store.sample(64)["policy_version"].tolist()) <= {0, 1, 2, 3}
        fresh = ab.ExperienceStore(capacity=1_000, backend="ray", num_shards=1, seed=0)
        try:   # a writer's versions on a fresh store: a step field of every write
            writer = fresh.writer(num_envs=2)
            for version in (4, 5):
                writer.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32),
                           terminated=np.full(2, version == 5), truncated=np.zeros(2, bool), next_obs=obs,
                           policy_version=version)
            fresh.flush()
            assert fresh.to_arrow().column("policy_version").to_numpy().tolist()[:2] == [4, 5]
        finally:
            fresh.close()
        assert set(store.sample(64, min_version=2)["policy_version"].tolist()) <= {2, 3}   # tests/test_versions_ray.py
        late.add_episode(_full(3))
        with pytest.raises(ValueError, match="first write"):
            late.add_episode(_full(3), policy_version=1)
    finally:
        store.close()
        late.close()


def test_a_writer_step_carries_the_version_of_the_policy_that_chose_its_action():
    store = ab.ExperienceStore(capacity=1_000, seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="next_step")   # its synthetic reset step pays a reward
    obs = np.zeros((2, 2), np.float32)
    for t in range(6):
        version = t // 2                      # the policy is updated every 2 steps
        action = np.full(2, 10 * version + t, np.int64)   # the action encodes the policy that chose it
        writer.add(obs=obs, action=action, reward=np.ones(2, np.float32), terminated=np.full(2, t == 5),
                   truncated=np.zeros(2, bool), next_obs=obs, policy_version=version)   # one int for both envs
    batch = store.gather(np.arange(len(store)))
    assert torch.equal(batch["action"] // 10, batch["policy_version"])   # not one step late
    assert store.sample(32, min_version=2)["action"].unique().tolist() == [24, 25]
    step = dict(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32), terminated=np.zeros(2, bool),
                truncated=np.zeros(2, bool), next_obs=obs)
    writer.add(**step, policy_version=np.array([3, 4]))                   # one per env (a reset step)
    writer.add(**step, policy_version=np.array([3, 4]))
    for bad in (np.array([4, 3]), -1, [1, 2, 3], 2.5):
        with pytest.raises(ValueError, match="policy_version"):
            writer.add(**step, policy_version=bad)
    assert writer.open_steps.tolist() == [1, 1]                           # nothing recorded by them


def test_versions_out_of_order_inside_an_episode_are_drawn_step_by_step():
    store = ab.ExperienceStore(capacity=1_000, seed=5)
    store.add_episode(_episode(6, [0, 5, 1, 6, 6, 2]))   # add_episode takes any per-step order
    store.add_episode(_episode(4, [4, 4, 5, 5]))          # non-decreasing: its suffix qualifies
    store.add_episode(_episode(3, 9))                     # every step qualifies
    expected = [1, 3, 4, 8, 9, 10, 11, 12]
    drawn = np.concatenate([store.sample(64, min_version=5)["index"].numpy() for _ in range(50)])
    assert sorted(set(drawn.tolist())) == expected
    assert chisquare(np.bincount(drawn, minlength=13)[expected]).pvalue > 1e-3
    listed = np.concatenate([b["index"].numpy() for b in store.iter_batches(3, shuffle=False, min_version=5)])
    assert listed.tolist() == expected
    assert store.evict(min_version=7) == 2 and store.sample(8, min_version=5)["index"].unique().tolist() == [10, 11, 12]


def _writer_steps(writer, steps: int, version=None, action: int = 0) -> None:
    obs = np.zeros((2, 2), np.float32)
    for t in range(steps):
        extra = {} if version is None else {"policy_version": version}
        writer.add(obs=obs, action=np.full(2, action, np.int64), reward=np.ones(2, np.float32),
                   terminated=np.full(2, t == steps - 1), truncated=np.zeros(2, bool), next_obs=obs, **extra)


# Each write path, then another, with or without versions: (first, second) writes as
# ("episode" | "writer", version or None).
ORDERS = [(("episode", 1), ("writer", 2)), (("writer", 2), ("episode", 3)), (("writer", 2), ("episode", None)),
          (("episode", 1), ("writer", None)), (("writer", None), ("episode", 1)), (("writer", None), ("writer", 4)),
          (("episode", None), ("writer", 2))]


@pytest.mark.parametrize("mode", ["circular", "fixed"])   # a writer writes in place, or stages episodes
@pytest.mark.parametrize("first, second", ORDERS)
def test_writers_and_add_episode_share_the_version_column_in_any_order(mode, first, second):
    store = ab.ExperienceStore(capacity=1_000, seed=0, mode=mode)
    store.add_episode({**_full(3), "action": np.full(3, 9, np.int64)}, policy_version=1)   # rows the ring held
    store.clear()
    for action, (path, version) in enumerate((first, second)):
        if path == "episode":
            store.add_episode({**_full(3), "action": np.full(3, action, np.int64)}, policy_version=version)
        else:
            _writer_steps(store.writer(num_envs=2, autoreset_mode="disabled"), 3, version, action)
    store.flush()
    batch = store.gather(np.arange(*store.live_ranges()[0]))
    for action, (_, version) in enumerate((first, second)):   # a step without a version has version 0
        assert batch["policy_version"][batch["action"] == action].unique().tolist() == [version or 0]
    assert store.schema.fields["policy_version"].derived   # one column, whichever path made it
    newest = max(v or 0 for _, v in (first, second))
    assert store.sample(16, min_version=newest)["policy_version"].unique().tolist() == [newest]
