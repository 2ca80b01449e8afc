"""torch stays out of the processes that never make a tensor (`arrowbuf._lazy_torch`): a Ray
shard actor serves writes, uniform draws, gathers shipped as payloads, exports and
checkpoints without importing it (each actor is a new process, and torch was ~0.9 CPU s
of its start; a prioritized draw imports it for its sum tree). A process that writes numpy
steps and episodes, locally or into a Ray store (an env worker), saves, loads and exports
imports neither torch nor tensordict (torch was ~1 CPU s of such a Ray task's 1.3 s). The
dtype names that replace torch dtypes in gather specs give the same tensors as before."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import ray
import torch

import arrowbuf as ab
from arrowbuf import _lazy_torch
from arrowbuf.fields import dtype_itemsize
from arrowbuf.ray.options import NAMESPACE


def test_importing_the_shard_actor_imports_neither_torch_nor_tensordict():
    code = ("import sys, arrowbuf.ray.actor; found = {'torch', 'tensordict'} & set(sys.modules); "
            "assert not found, f'the shard actor imported {sorted(found)}'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _episode(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.normal(size=(n + 1, 3)).astype(np.float32), "action": rng.integers(0, 4, n),
            "reward": rng.normal(size=n).astype(np.float32), "terminated": np.arange(n) == n - 1,
            "truncated": np.zeros(n, bool), "half": rng.normal(size=(n, 2)).astype(np.float32)}


def _torch_in_actors(store: ab.ExperienceStore) -> list[bool]:
    handles = [ray.get_actor(f"{store.name}:{s}", namespace=NAMESPACE) for s in range(store.num_shards)]
    return [ray.get(h.__ray_call__.remote(lambda server: "torch" in sys.modules)) for h in handles]


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_a_ray_shard_serves_writes_draws_gathers_and_exports_without_importing_torch(ray_session, tmp_path, sampler):
    made = ab.PrioritizedSampler(alpha=0.6, beta=0.4) if sampler == "prioritized" else None
    kwargs = {"sampler": made} if made is not None else {}
    store = ab.ExperienceStore(capacity=2_000, backend="ray", num_shards=1, **kwargs)
    try:
        for k in range(6):
            store.add_episode(_episode(40 + 7 * k, k), env_id=f"env{k}")
        with store.writer(num_envs=3) as writer:   # the step writer's path too
            for t in range(30):
                writer.add(obs=np.full((3, 3), t, np.float32), action=np.zeros(3, np.int64),
                           reward=np.ones(3, np.float32), terminated=np.zeros(3, bool),
                           truncated=np.zeros(3, bool), half=np.zeros((3, 2), np.float32),
                           next_obs=np.full((3, 3), t + 1, np.float32))
        store.to_parquet(tmp_path / "export")
        store.save(tmp_path / "checkpoint")
        assert _torch_in_actors(store) == [False]
        batch = store.sample(64)
        assert batch["obs"].dtype == torch.float32 and batch["action"].dtype == torch.int64
        # The batch's rows are the stored ones: the gather specs now carry dtype names.
        rows = store.gather(batch["index"].numpy())
        assert torch.equal(rows["obs"], batch["obs"]) and torch.equal(rows[("next", "obs")], batch[("next", "obs")])
        if made is not None:
            store.update_priorities(batch["index"].numpy(), np.linspace(0.1, 2.0, 64))
            store.sample(32)
        for _ in zip(range(3), store.iter_batches(50)):
            pass
        # A prioritized draw searches its sum tree with numpy where torch is not loaded (`arrowbuf._sumtree`).
        assert _torch_in_actors(store) == [False]
    finally:
        store.close()


def test_dtype_names_name_the_torch_dtypes_and_their_sizes():
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bfloat16",
                 "uint16"):
        found = _lazy_torch.dtype(name)
        assert found is getattr(torch, name)
        assert dtype_itemsize(name) == torch.empty(0, dtype=found).element_size()
    with pytest.raises(TypeError, match="no torch dtype is named 'Tensor'"):
        _lazy_torch.dtype("Tensor")
    assert _lazy_torch.is_tensor(torch.zeros(1)) and not _lazy_torch.is_tensor(np.zeros(1))
    assert _lazy_torch.is_dtype(torch.float32) and not _lazy_torch.is_dtype(np.float32)
    assert ab.Field(torch.bfloat16).dtype == "bfloat16" and ab.Field(torch.bool).torch_dtype is torch.bool
    with pytest.raises(ab.SchemaError, match="unsupported dtype"):
        ab.Field(torch.complex64)


LOCAL_WITHOUT_TORCH = """
import sys, tempfile, numpy as np
import arrowbuf as ab
root = tempfile.mkdtemp()
store = ab.ExperienceStore(1000)
episode = {"obs": np.zeros((11, 3), "float32"), "action": np.zeros(10, np.int64), "reward": np.ones(10, "float32"),
           "terminated": np.arange(10) == 9, "truncated": np.zeros(10, bool)}
store.add_episode(episode)
store.add_episodes({k: np.stack([v, v]) for k, v in episode.items()})
writer = store.writer(2, autoreset_mode="disabled")
for t in range(5):
    writer.add(obs=np.zeros((2, 3), "float32"), action=np.zeros(2, np.int64), reward=np.ones(2, "float32"),
               terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=np.zeros((2, 3), "float32"))
writer.flush()
store.save(root + "/checkpoint")
loaded = ab.ExperienceStore.load(root + "/checkpoint")
store.to_parquet(root + "/export")
imported = ab.ExperienceStore.from_parquet(root + "/export")
assert len(loaded) == len(imported) == len(store) == 40 and store.episodes().num_rows == 5
found = {"torch", "tensordict"} & set(sys.modules)
assert not found, f"writing, saving, loading or exporting imported {sorted(found)}"
assert store.sample(4).batch_size == (4,) and {"torch", "tensordict"} <= set(sys.modules)
print("ok")
"""


def test_a_process_that_writes_saves_loads_and_exports_imports_neither_torch_nor_tensordict():
    # torch costs ~1 CPU s and tensordict ~1.8 more (torch._dynamo): a CLI run, a checkpoint
    # load or a writer that never samples does not pay them; the first sample does.
    done = subprocess.run([sys.executable, "-c", LOCAL_WITHOUT_TORCH], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_ray_writer_process_imports_neither_torch_nor_tensordict(ray_session):
    # Defined here, so that Ray ships the function itself (a worker cannot import this test module),
    # with a runtime env of its own: Ray starts a worker for it, not one that ran another test's torch.
    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"ARROWBUF_TEST_WORKER": "lazy-torch"}})
    def write_without_torch(name: str, one: dict, two: dict) -> list[str]:
        import sys

        import arrowbuf as ab

        store = ab.ExperienceStore.attach(name)
        with store.writer(2, autoreset_mode="disabled") as writer:
            for t in range(5):
                writer.add(obs=np.full((2, 3), t, np.float32), action=np.zeros(2, np.int64),
                           reward=np.ones(2, np.float32), terminated=np.zeros(2, bool), truncated=np.zeros(2, bool),
                           half=np.zeros((2, 2), np.float32), next_obs=np.full((2, 3), t + 1, np.float32))
        store.add_episode(one, env_id="one")
        store.add_episodes(two, env_ids=["two", "three"])
        store.flush()
        return sorted({"torch", "tensordict"} & set(sys.modules))

    store = ab.ExperienceStore(capacity=1_000, backend="ray", num_shards=2)
    one, two = _episode(10, 0), _episode(10, 1)
    try:
        assert ray.get(write_without_torch.remote(store.name, one, {k: np.stack([v, v]) for k, v in two.items()})) == []
        assert len(store) == 2 * 5 + 3 * 10 and store.num_episodes == 5
        stored = store.to_arrow().column("obs").combine_chunks().to_numpy_ndarray()
        # each episode's observations and its final one (the writer's, cut by its close: next_obs 5)
        written = [np.full((2, 3), t, np.float32) for t in range(6)] + [one["obs"], two["obs"], two["obs"]]
        assert sorted(map(tuple, stored.tolist())) == sorted(map(tuple, np.concatenate(written).tolist()))
    finally:
        store.close()


def test_compute_gae_on_ray_bootstraps_cut_episodes_without_torch_in_the_shards(ray_session):
    # The shards sent their final observations as a TensorDict: the first GAE of a store imported
    # torch and tensordict in every shard (~3 s each), even with no episode to bootstrap.
    schema = {"obs": ab.Field("float32", (3,), observation=True), "action": "int64", "reward": "float32",
              "terminated": "bool", "truncated": "bool", "value": "float32"}
    stores = [ab.ExperienceStore(capacity=200, schema=schema, **kwargs)
              for kwargs in ({}, {"backend": "ray", "num_shards": 1})]
    try:
        for store in stores:
            for k in range(4):   # episodes 1 and 3 are truncated: they bootstrap from their final observation
                steps = 5 + k
                store.add_episode({"obs": np.arange((steps + 1) * 3, dtype=np.float32).reshape(-1, 3) + k,
                                   "action": np.zeros(steps, np.int64), "reward": np.ones(steps, np.float32),
                                   "terminated": (np.arange(steps) == steps - 1) & (k % 2 == 0),
                                   "truncated": (np.arange(steps) == steps - 1) & (k % 2 == 1),
                                   "value": np.full(steps, 0.5, np.float32)}, env_id=f"env{k}")
            store.flush()
            assert store.compute_gae(0.9, 0.8, bootstrap_value=lambda obs: obs["obs"].sum(-1)) == 4 * 5 + 6
        local, remote = stores
        assert _torch_in_actors(remote) == [False]
        by_obs = [{tuple(o): a for o, a in zip(s.gather(np.concatenate([np.arange(*r) for r in s.live_ranges()]))["obs"]
                                                .tolist(), s.gather(np.concatenate([np.arange(*r) for r in
                                                                                    s.live_ranges()]))["advantage"]
                                                .tolist())} for s in stores]
        assert by_obs[0] == pytest.approx(by_obs[1])
    finally:
        stores[1].close()
