"""The Ray backend on a real local Ray cluster (started once per session in conftest)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from scipy.stats import chisquare

import arrowbuf as ab
from arrowbuf import RayOptions
from arrowbuf.ray.options import INDEX_SHIFT, NAMESPACE

from support.actors import kill_and_wait


pytestmark = pytest.mark.usefixtures("ray_session")


def encoded_episode(key: int, steps: int) -> dict:
    """obs[t] = (key, 0, 0, t): every row names its episode and step (the runners' layout)."""
    zeros = np.zeros(steps + 1, np.float32)
    obs = np.stack([np.full(steps + 1, key, np.float32), zeros, zeros, np.arange(steps + 1, dtype=np.float32)],
                   axis=1)
    return {"obs": obs, "action": np.zeros(steps, np.int64), "reward": np.ones(steps, np.float32),
            "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool)}


@ray.remote
class EnvRunner:
    """Drives a writer handle in another process; obs = (runner, env, episode number, step)."""

    def __init__(self, writer, runner: int) -> None:
        self.writer = writer
        self.runner = runner

    def run(self, steps: int, seed: int) -> list[tuple[int, int, int, int]]:
        rng = np.random.default_rng(seed)
        n = self.writer.num_envs
        episode_no = np.zeros(n, np.int64)
        t = np.zeros(n, np.int64)
        finished = []
        skip = np.zeros(n, bool)
        for _ in range(steps):
            obs = np.stack([np.full(n, self.runner), np.arange(n), episode_no, t], axis=1).astype(np.float32)
            done = rng.random(n) < 0.15
            next_obs = obs.copy()
            next_obs[:, 3] += 1
            self.writer.add(obs=obs, action=np.zeros(n, np.int64), reward=np.ones(n, np.float32),
                            terminated=done, truncated=np.zeros(n, bool), next_obs=next_obs)
            for env in np.flatnonzero(done & ~skip):
                finished.append((self.runner, int(env), int(episode_no[env]), int(t[env]) + 1))
            # next_step autoreset: the step after a done only resets that env.
            t = np.where(skip, 0, t + 1)
            episode_no = np.where(skip, episode_no + 1, episode_no)
            skip = done & ~skip
        self.writer.flush()
        return finished


@pytest.fixture(scope="module")
def two_shard_store():
    store = ab.ExperienceStore(20_000, backend="ray", num_shards=2, seed=0)
    yield store
    store.close()


def test_writers_in_two_actors_store_every_episode_exactly_once(two_shard_store):
    store = two_shard_store
    store.clear()
    writer = store.writer(num_envs=4, autoreset_mode="next_step")   # its runners' reset steps carry rewards
    runners = [EnvRunner.remote(writer, r) for r in range(2)]
    finished = sum(ray.get([runner.run.remote(150, seed) for seed, runner in enumerate(runners)]), [])
    store.flush()   # sizes written from other processes are exact after it

    rows = store.to_arrow()
    obs = rows.column("obs").combine_chunks().to_numpy_ndarray()
    last = obs[rows.column("is_last").to_numpy()]
    keys = [tuple(int(v) for v in row[:3]) for row in last]
    assert len(keys) == len(set(keys)), "an episode is stored twice"
    stored_lengths = {k: int(row[3]) for k, row in zip(keys, last)}
    # Episodes that ended in the env are all there, with their length (final obs step).
    for runner, env, number, length in finished:
        assert stored_lengths[(runner, env, number)] == length
    assert store.num_episodes == len(keys)
    table = store.episodes()
    assert sorted(set(table.column("shard").to_pylist())) == [0, 1]

    batch = store.sample(512)
    now, nxt = batch["obs"].numpy(), batch["next", "obs"].numpy()
    np.testing.assert_array_equal(nxt[:, :3], now[:, :3])
    np.testing.assert_array_equal(nxt[:, 3], now[:, 3] + 1)


def test_sampling_from_unequal_shards_follows_their_sizes():
    store = ab.ExperienceStore(30_000, backend="ray", num_shards=3, seed=1, track_reuse=True)
    try:
        # Routes stick to the shard an env first landed on: "big" fills shard 0.
        for i in range(60):
            store.add_episode(encoded_episode(i, 20), env_id="big")
            if i % 10 == 0:
                store.add_episode(encoded_episode(1000 + i, 20), env_id="small-a")
                store.add_episode(encoded_episode(2000 + i, 20), env_id="small-b")
        store.flush()
        sizes = np.array([s["transitions"] for s in store.stats()["shards"]])
        assert sizes[0] == 10 * sizes[1] == 10 * sizes[2]
        counts = np.zeros(3)
        for _ in range(40):
            shard = store.sample(256)["index"].numpy() >> INDEX_SHIFT
            counts += np.bincount(shard, minlength=3)
        assert chisquare(counts, counts.sum() * sizes / sizes.sum()).pvalue > 1e-3
        reuse = [s["reuse"] for s in store.stats()["shards"]]
        assert all(r is not None and r["max"] >= 1 for r in reuse), reuse
    finally:
        store.close()


def test_iter_batches_walks_every_transition_of_every_shard_once(two_shard_store):
    store = two_shard_store
    store.clear()
    for i in range(12):
        store.add_episode(encoded_episode(i, 7 + i), env_id=f"env-{i % 4}")
    store.flush()
    seen = np.concatenate([b["obs"].numpy()[:, [0, 3]] for b in store.iter_batches(50, shuffle=True)])
    expected = {(i, t) for i in range(12) for t in range(7 + i)}
    assert sorted(map(tuple, seen.astype(int).tolist())) == sorted(expected)
    assert len(store) == len(expected)


def test_prioritized_sharded_store_updates_the_right_shard():
    store = ab.ExperienceStore(10_000, backend="ray", num_shards=2, seed=3,
                               sampler=ab.PrioritizedSampler(alpha=1.0, beta=1.0))
    try:
        for i in range(8):
            store.add_episode(encoded_episode(i, 25), env_id=f"env-{i % 2}")
        store.flush()
        batch = store.sample(64)
        assert float(batch["weight"].max()) == pytest.approx(1.0)
        assert store.update_priorities(batch["index"], np.full(64, 5.0)) == 64
    finally:
        store.close()


def test_num_workers_gets_disjoint_equal_batches(two_shard_store):
    store = two_shard_store
    store.clear()
    store.add_episode(encoded_episode(0, 40), env_id="a")
    store.add_episode(encoded_episode(1, 40), env_id="b")
    store.flush()
    parts = store.sample(64, num_workers=4)
    assert [p.batch_size[0] for p in parts] == [16] * 4
    with pytest.raises(ValueError, match="num_workers"):
        store.sample(63, num_workers=4)


def test_a_schema_mismatch_inside_a_shard_surfaces_in_the_writer_process(two_shard_store):
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    try:
        first, second = store.writer(num_envs=1), store.writer(num_envs=1)

        @ray.remote
        def write(writer, dtype):
            obs = np.zeros((1, 3), dtype)
            writer.add(obs=obs, action=np.zeros(1, np.int64), reward=np.ones(1, np.float32),
                       terminated=np.ones(1, bool), truncated=np.zeros(1, bool), next_obs=obs)
            writer.flush()
            return "ok"

        assert ray.get(write.remote(first, np.float32)) == "ok"
        with pytest.raises(ab.SchemaError, match="shard 0 stores"):
            ray.get(write.remote(second, np.float64))
    finally:
        store.close()


def shard_actor(store, shard: int):
    """A shard's actor, by the name the store gives it."""
    return ray.get_actor(f"{store.name}:{shard}", namespace=NAMESPACE)


def test_a_killed_shard_raises_shard_error_and_survivors_serve_with_allow_partial():
    store = ab.ExperienceStore(4_000, backend="ray", num_shards=2, seed=0,
                               ray_options=RayOptions(allow_partial=False))
    partial = ab.ExperienceStore.attach(store.name, ray_options=RayOptions(allow_partial=True))
    writes = ab.ExperienceStore.attach(store.name, ray_options=RayOptions(allow_partial=True))
    try:
        store.add_episode(encoded_episode(0, 30), env_id="a")
        store.add_episode(encoded_episode(1, 30), env_id="b")
        store.flush()
        partial.flush()
        assert len(partial) == 60   # sizes known, so its next request still asks shard 1
        writes.add_episode(encoded_episode(7, 5), env_id="x")   # routes x -> shard 0, y -> shard 1
        writes.add_episode(encoded_episode(8, 5), env_id="y")
        kill_and_wait(shard_actor(store, 1))
        with pytest.raises(ab.ShardError, match="shard 1 of store .* is dead"):
            store.flush()   # asks every shard for its size
        for _ in range(2):   # every call, not only the first, until the store is closed
            with pytest.raises(ab.ShardError, match="shard 1"):
                len(store)
            with pytest.raises(ab.ShardError, match="shard 1 of store .* is dead"):
                store.sample(8)
        # A reader finds a dead shard at its next manifest poll (within about
        # RayOptions.seal_latency); until then it may still serve the rows it holds
        # of that shard's sealed blocks, which stay valid.
        deadline = time.monotonic() + 30
        while partial.stats()["dead_shards"] != [1]:
            assert partial.sample(32).batch_size == (32,) and time.monotonic() < deadline
        samples = partial.stats()["samples"]
        batch = partial.sample(32)
        assert batch.batch_size == (32,) and (batch["index"].numpy() >> INDEX_SHIFT == 0).all()
        assert partial.stats()["samples"] == samples + 32   # drawn here, counted by the survivor
        assert len(partial) == 35
        # A write the dead shard took is reported, not dropped; the env moves on.
        with pytest.raises(ab.ShardError, match="died before storing"):
            writes.add_episode(encoded_episode(2, 10), env_id="y")
        assert writes.add_episode(encoded_episode(3, 10), env_id="y") % 2 == 0   # shard 0's ids are even
        partial.flush()
        assert len(partial) == 45
    finally:
        store.close()
    store.close()   # twice is fine
    with pytest.raises(ab.ShardError, match="is closed"):
        len(store)


def test_a_refused_episode_in_a_batched_write_keeps_the_others_and_says_so():
    store = ab.ExperienceStore(100, backend="ray", num_shards=1, seed=0, mode="fixed",
                               ray_options=RayOptions(delivery_latency=60.0))   # one batch at flush
    try:
        for key in range(6):
            store.add_episode(encoded_episode(key, 10), env_id="a")   # 60 of the 100 transitions
        writer = store.writer(num_envs=1, autoreset_mode="disabled")
        obs = np.zeros((1, 4), np.float32)
        for _ in range(5):   # 5 x 10 transitions: the shard has room for 4
            for t in range(10):
                writer.add(obs=obs, action=np.zeros(1, np.int64), reward=np.ones(1, np.float32),
                           terminated=np.array([t == 9]), truncated=np.zeros(1, bool), next_obs=obs)
        with pytest.raises(ab.CapacityError, match="refused 1 of the 5 episodes"):
            writer.flush()
        store.flush()
        assert len(store) == 100 and store.num_episodes == 10
    finally:
        store.close()


def test_a_refused_first_write_leaves_no_schema_behind():
    store = ab.ExperienceStore(100, backend="ray", num_shards=2, seed=0)   # 50 rows a shard
    try:
        with pytest.raises(ab.CapacityError):
            store.add_episode(encoded_episode(0, 79))
        assert store.schema is None   # as in a local store: a refused first episode sets nothing
        store.add_episode({"obs": np.zeros((5, 7), np.float32), "action": np.zeros(4, np.int64),
                           "terminated": np.zeros(4, bool)})
        store.flush()
        assert store.schema.fields["obs"].shape == (7,) and len(store) == 4
    finally:
        store.close()


def test_ray_entry_points_check_their_arguments(two_shard_store):
    store = two_shard_store
    store.add_episode(encoded_episode(9, 5), env_id="a")
    for kwargs, match in (({"env_id": 5}, "env_id"), ({"metadata": [1]}, "metadata"),
                          ({"metadata": {"a": object()}}, "JSON"), ({"timeout": float("nan")}, "timeout")):
        with pytest.raises(ValueError, match=match):
            store.add_episode(encoded_episode(9, 5), **kwargs)
    for kwargs, match in (({"timeout": -1}, "timeout"), ({"pin_memory": "yes"}, "pin_memory"),
                          ({"device": "gpu"}, "device")):
        with pytest.raises(ValueError, match=match):
            store.sample(4, **kwargs)
    with pytest.raises(ValueError, match="device"):
        store.sample_iter(4, device=3.5)
    with pytest.raises(ValueError, match="nope"):
        store.sample_iter(4, keys=["nope"])
    assert set(next(store.sample_iter(4, keys=["reward"])).keys()) == {"reward", "index", "episode_id", "step"}
    with pytest.raises(ValueError, match="device"):
        store.iter_batches(4, device="gpu")
    with pytest.raises(ValueError, match="timeout"):
        store.writer(2, timeout=float("nan"))
    with pytest.raises(ValueError, match="max_in_flight"):
        RayOptions(max_in_flight=0)
    with pytest.raises(ValueError, match="nodes"):
        RayOptions(nodes="node-a")
    with pytest.raises(ValueError, match="WithoutReplacementSampler"):
        ab.ExperienceStore(100, backend="ray", num_shards=2, sampler=ab.WithoutReplacementSampler())


def test_shards_that_cannot_start_time_out_with_a_clear_error():
    with pytest.raises(ab.ShardError, match="did not start within 2"):
        ab.ExperienceStore(100, backend="ray", num_shards=1, ray_options=RayOptions(num_cpus=100, start_timeout=2))


def test_a_store_is_reattached_by_name_from_another_process(two_shard_store):
    store = two_shard_store
    store.clear()
    store.add_episode(encoded_episode(5, 9), env_id="a")
    store.flush()

    @ray.remote
    def size_elsewhere(name):
        return len(ab.ExperienceStore.attach(name))

    assert ray.get(size_elsewhere.remote(store.name)) == 9
    with pytest.raises(ValueError, match="no arrowbuf store named"):
        ab.ExperienceStore.attach("no-such-store")


NODE_AFFINITY_SCRIPT = textwrap.dedent("""
    import numpy as np, ray
    from ray.cluster_utils import Cluster
    import arrowbuf as ab
    from arrowbuf import RayOptions

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    node_b = cluster.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=cluster.address, include_dashboard=False, logging_level="ERROR")
    cluster.wait_for_nodes()
    ids = {n["Resources"].get("node_a") and "a" or "b": n["NodeID"] for n in ray.nodes() if n["Alive"]}
    store = ab.ExperienceStore(1000, backend="ray", num_shards=2,
                               ray_options=RayOptions(nodes=[ids["a"], ids["b"]]))
    writer = store.writer(num_envs=2, autoreset_mode="next_step")

    @ray.remote(resources={"node_b": 0.1})
    def run(writer):
        obs = np.zeros((2, 3), np.float32)
        for _ in range(3):
            writer.add(obs=obs, action=np.zeros(2), reward=np.ones(2), terminated=np.ones(2, bool),
                       truncated=np.zeros(2, bool), next_obs=obs)
        writer.flush()
        return ray.get_runtime_context().get_node_id()

    assert ray.get(run.remote(writer)) == ids["b"]
    shards = store.episodes().column("shard").to_pylist()
    print("SHARDS", sorted(set(shards)), len(shards))
    store.close()
    ray.shutdown()
    cluster.shutdown()
""")


def test_a_writer_on_node_b_writes_to_node_b_shard(tmp_path):
    script = tmp_path / "affinity.py"
    script.write_text(NODE_AFFINITY_SCRIPT)
    marker = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    before = marker.read_text() if marker.exists() else None
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    finally:
        # The simulated cluster leaves its address behind; a later plain ray.init()
        # would try to join that dead cluster.
        if before is None:
            marker.unlink(missing_ok=True)
        else:
            marker.write_text(before)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SHARDS [1] 4" in done.stdout   # 3 steps, next_step autoreset: 2 envs x 2 episodes


def stored_obs(store) -> list[tuple]:
    obs = store.to_arrow().column("obs").combine_chunks().to_numpy_ndarray()
    return sorted(map(tuple, obs.tolist()))


@pytest.fixture(scope="module")
def prioritized_ray_store():
    store = ab.ExperienceStore(4_000, backend="ray", num_shards=2, seed=0, sampler=ab.PrioritizedSampler())
    for i in range(16):
        store.add_episode(encoded_episode(i, 8 + i), env_id=f"env-{i % 4}")
    batch = store.sample(64)
    store.update_priorities(batch["index"], np.linspace(0.1, 5, 64))
    yield store
    store.close()


def test_a_sharded_store_exports_every_shard_to_one_parquet_directory(prioritized_ray_store, tmp_path):
    store = prioritized_ray_store
    store.to_parquet(tmp_path / "export")
    parts = sorted(p.name for p in (tmp_path / "export" / "steps").iterdir())
    assert {int(p.split("-")[1]) for p in parts} == {0, 1}, parts   # each shard wrote its own files
    local = ab.ExperienceStore.from_parquet(tmp_path / "export")
    assert stored_obs(local) == stored_obs(store)
    assert local.num_episodes == store.num_episodes == 16


def test_a_two_shard_checkpoint_loads_into_two_or_three_shards(prioritized_ray_store, tmp_path):
    store = prioritized_ray_store
    store.save(tmp_path / "ckpt")
    same = ab.ExperienceStore.load(tmp_path / "ckpt")
    resharded = ab.ExperienceStore.load(tmp_path / "ckpt", num_shards=3)
    try:
        assert isinstance(same.sampler, ab.PrioritizedSampler)
        assert stored_obs(same) == stored_obs(resharded) == stored_obs(store)
        assert resharded.num_shards == 3 and resharded.num_episodes == 16
        assert all(s["transitions"] > 0 for s in resharded.stats()["shards"])
        # Same shard count: priorities come back, so the sum trees match.
        masses = sorted(s["priorities"]["counts"] for s in same.stats()["shards"])
        assert masses == sorted(s["priorities"]["counts"] for s in store.stats()["shards"])
    finally:
        same.close()
        resharded.close()


# Ray Data's own DataContext warns about its deprecated settings when it starts.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")
def test_ray_data_round_trips_a_sharded_store(prioritized_ray_store):
    store = prioritized_ray_store
    dataset = store.to_ray_dataset()
    assert dataset.count() == store.to_arrow().num_rows
    back = ab.ExperienceStore.from_ray_dataset(dataset, capacity=4_000)
    assert stored_obs(back) == stored_obs(store)
    assert len(back) == len(store) and back.num_episodes == 16
    batch = back.sample(128)
    np.testing.assert_array_equal(batch["next", "obs"][:, 3].numpy(), batch["obs"][:, 3].numpy() + 1)


def test_episodes_without_an_env_id_spread_over_the_shards(two_shard_store):
    store = two_shard_store
    store.clear()
    for i in range(10):
        store.add_episode(encoded_episode(i, 10))
    sizes = [s["transitions"] for s in store.stats()["shards"]]
    assert sizes == [50, 50]


def test_one_add_episodes_call_spreads_new_envs_over_the_shards_and_keeps_each_env_on_its_shard(two_shard_store):
    # The batch's routes were all chosen against the loads before the call: every new
    # env of a first add_episodes went to the same (least loaded) shard.
    store = two_shard_store
    store.clear()
    batch = {name: np.stack([encoded_episode(200 + k, 10)[name] for k in range(4)])
             for name in encoded_episode(0, 10)}
    env_ids = [f"batch-env-{k}" for k in range(4)]
    first = store.add_episodes(batch, env_ids=env_ids)
    assert sorted(i % 2 for i in first) == [0, 0, 1, 1]   # an episode id's shard is id % num_shards
    again = store.add_episodes(batch, env_ids=env_ids)
    assert [i % 2 for i in again] == [i % 2 for i in first]
    unnamed = store.add_episodes(batch)
    assert sorted(i % 2 for i in unnamed) == [0, 0, 1, 1]
    assert [s["transitions"] for s in store.stats()["shards"]] == [60, 60]


def test_a_shard_that_was_empty_is_sampled_once_it_fills(two_shard_store):
    store = two_shard_store
    store.clear()
    store.add_episode(encoded_episode(1, 20), env_id="first")     # lands on one shard
    store.sample(32)                                              # the other shard is seen empty
    for i in range(10):
        store.add_episode(encoded_episode(100 + i, 20), env_id="second")
    shards = np.unique(store.sample(512)["index"].numpy() >> INDEX_SHIFT)
    assert shards.tolist() == [0, 1]


def test_a_bad_priority_update_changes_no_shard(prioritized_ray_store):
    store = prioritized_ray_store
    batch = store.sample(64)
    before = store.stats()["shards"]
    priority = np.ones(64)
    priority[-1] = np.nan
    with pytest.raises(ValueError, match="priority must be finite"):
        store.update_priorities(batch["index"], priority)
    after = store.stats()["shards"]
    assert [s["priorities"] for s in after] == [s["priorities"] for s in before]


def test_train_workers_draw_from_the_shards_on_their_node(two_shard_store):
    store = two_shard_store
    store.clear()
    for i in range(8):
        store.add_episode(encoded_episode(i, 20), env_id=f"env-{i % 2}")
    shards = store._backend.shards   # no public way to pretend shards live on two nodes
    nodes = shards.nodes
    shards.nodes = ["node-a", "node-b"]   # one shard per (pretend) node
    try:
        parts = store.sample(96, num_workers=3, worker_nodes=["node-b", "node-a", "node-b"])
    finally:
        shards.nodes = nodes
    shards = [np.unique(p["index"].numpy() >> INDEX_SHIFT).tolist() for p in parts]
    assert shards == [[1], [0], [1]]
    assert [p.batch_size[0] for p in parts] == [32, 32, 32]
    with pytest.raises(ValueError, match="worker_nodes"):
        store.sample(96, num_workers=3, worker_nodes=["node-a"])
