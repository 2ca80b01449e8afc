"""Remote storage: `DataBuffer.sample` returns one ObjectRef per train worker, put by the shards.

As with RLightning's remote storage, the driver hands refs to the train workers
and never holds the rows: the tests spy on ``ray.get`` and on the store's
driver-side gather, and resolve the refs inside Ray actors standing in for
RLightning's train policies (``policy.update_dataset.remote(ref)``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_compat import add_tagged_episodes, assert_tagged_transitions

import arrowbuf as ab
from arrowbuf.compat import ReplayBuffer, RolloutBuffer, resolve

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture
def train_workers(fake_train_workers):
    """The session's two train worker actors (conftest), standing in for RLightning's train policies."""
    return fake_train_workers


@pytest.fixture
def driver_spy(monkeypatch):
    """Every ObjectRef this process passes to ``ray.get``; the store's in-process gather refused."""
    fetched: list = []
    real_get = ray.get

    def spying_get(refs, *args, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, *args, **kwargs)

    def no_gather(*args, **kwargs):
        raise AssertionError("the driver gathered rows itself")

    monkeypatch.setattr(ray, "get", spying_get)
    monkeypatch.setattr(ab.ExperienceStore, "gather", no_gather)
    return fetched


@pytest.mark.parametrize("storage", [{"type": "sharded", "num_shards": 2}, {}], ids=["two-shards", "unified"])
def test_train_workers_resolve_the_refs_of_their_batches_and_the_driver_never_fetches_them(
        storage, train_workers, driver_spy):
    buffer = ReplayBuffer({"capacity": 200, "storage": storage}, seed=0,
                          cluster={"remote_storage": True, "train_worker_num": 2})
    assert buffer.backend == "ray"
    add_tagged_episodes(buffer, [9, 14, 5])     # with two shards every worker's rows come from both
    refs = buffer.sample(batch_size=20)
    assert len(refs) == 2 and all(isinstance(ref, ray.ObjectRef) for ref in refs)
    assert not set(refs) & set(driver_spy)
    ray.get([worker.update_dataset.remote(ref) for worker, ref in zip(train_workers, refs)])
    received = ray.get([worker.dataset.remote() for worker in train_workers])
    for batch, pid in received:
        assert pid != os.getpid() and batch.batch_size == (10,)
        assert_tagged_transitions(batch)          # rows of their own env and step, seed keys included
        assert batch["index"].unique().numel() > 1
    assert not set(refs) & set(driver_spy)
    buffer.store.close()


def test_a_resolved_batch_holds_the_sampled_rows_in_the_sampled_order():
    buffer = ReplayBuffer({"capacity": 200, "storage": {"type": "sharded", "num_shards": 2}}, seed=3,
                          num_train_workers=1)
    add_tagged_episodes(buffer, [6, 7])
    batch = resolve(buffer.sample(batch_size=12)[0])
    again = buffer.store.gather(batch["index"].numpy())   # by index: the same rows, in the same order
    np.testing.assert_array_equal(batch["observation"].numpy(), again["observation"].numpy())
    np.testing.assert_array_equal(batch["next_observation"].numpy(), again["next", "observation"].numpy())
    assert set(np.unique(batch["index"].numpy() >> 48)) == {0, 1}
    buffer.store.close()


def test_episode_unit_refs_resolve_to_padded_episodes_with_their_mask():
    buffer = RolloutBuffer({"capacity": 200, "storage": {"type": "sharded", "num_shards": 2, "unit": "episode"},
                            "sampler": {"type": "batch"}}, seed=0, num_train_workers=2)
    add_tagged_episodes(buffer, [3, 5, 2, 4])
    batches = [resolve(ref) for ref in buffer.sample(batch_size=4)]
    assert len(buffer) == 0                        # a RolloutBuffer clears after sampling
    lengths = sorted(int(n) for batch in batches for n in batch["mask"].sum(1))
    assert lengths == [2, 3, 4, 5] and all(batch.batch_size[0] == 2 for batch in batches)
    for batch in batches:
        assert_tagged_transitions(batch[batch["mask"]])
    buffer.store.close()


def test_native_gather_refs_checks_its_arguments_and_reports_dead_indices():
    store = ab.ExperienceStore(100, backend="ray", num_shards=1, seed=0)
    store.add_episode({"obs": np.zeros((4, 2), np.float32), "action": np.arange(3),
                       "terminated": np.array([False, False, True])})
    index = np.arange(*store.live_ranges()[0]) if store.live_ranges()[0][1] else np.arange(*store.live_ranges()[1])
    assert resolve(store.gather_refs([index])[0])["action"].tolist() == [0, 1, 2]
    with pytest.raises(KeyError, match="not live"):
        store.gather_refs([np.append(index, index[-1] + 50)])
    with pytest.raises(ValueError, match="indices must be a non-empty list"):
        store.gather_refs(index)
    with pytest.raises(ValueError, match=r"indices\[0\] must be a non-empty"):
        store.gather_refs([np.zeros(0, np.int64)])
    with pytest.raises(ValueError, match=r"extras\[0\]\['mask'\] must be named by a str and lead with"):
        store.gather_refs([index], extras=[{"mask": np.ones(2, bool)}])
    with pytest.raises(ValueError, match="next_keys must be one of"):
        store.gather_refs([index], next_keys="dotted")
    with pytest.raises(TypeError, match="resolve takes"):
        resolve([1])
    store.close()
    with pytest.raises(ValueError, match="needs backend='ray'"):
        ab.ExperienceStore(10).gather_refs([index])


def test_a_dead_shard_fails_gather_refs_with_shard_error_before_any_ref_is_handed_out():
    from arrowbuf.ray.options import NAMESPACE

    from support.actors import kill_and_wait

    store = ab.ExperienceStore(100, backend="ray", num_shards=2, seed=0)
    for env in range(2):
        store.add_episode({"obs": np.zeros((4, 2), np.float32), "action": np.arange(3),
                           "terminated": np.array([False, False, True])}, env_id=f"env-{env}")
    index = np.concatenate([np.arange(a, b) for a, b in store.live_ranges()])
    assert len(np.unique(index >> 48)) == 2
    kill_and_wait(ray.get_actor(f"{store.name}:1", namespace=NAMESPACE))
    with pytest.raises(ab.ShardError, match="shard 1 of store"):
        store.gather_refs([index])
    store.close()
