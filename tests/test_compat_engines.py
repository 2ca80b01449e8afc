"""arrowbuf.compat driven by RLightning's engines' call sequences, locally and on 2 Ray shards.

Each test replays one engine (SyncRLEngine PPO, AsyncRLEngine with a dataset
thread polling ``size()``, RSLRLEngine on the wbc_tracking config) and checks that
every env step's transition reaches the train workers exactly once, aligned.
The Ray variants use RLightning's cluster section (2 buffer workers, 2 train
workers, ``remote_storage``) with both node affinity flags, on this one node.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from test_compat_hooks import torch_stack_postprocess

from arrowbuf.compat import BatchedData, DataBuffer

from support.compat_envs import VecWorker, policy, rsl_rollout, sync_rollout, transitions, truth, update_dataset


CLUSTER = {"remote_storage": True, "buffer_worker_num": 2, "train_worker_num": 2}
LOCAL = {"remote_storage": False, "train_worker_num": 2}


def config(placement: str, **overrides) -> dict:
    base = {"type": "RolloutBuffer", "capacity": 5_000, "sampler": {"type": "all"}}
    if placement == "ray":
        base.update(storage={"type": "sharded"}, node_affinity_env=True, node_affinity_train=True)
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def make_buffer(placement: str, workers: list[VecWorker], **kwargs) -> DataBuffer:
    cluster = CLUSTER if placement == "ray" else LOCAL
    buffer = DataBuffer(config(placement, **kwargs.pop("overrides", {})), cluster=cluster, seed=0, **kwargs)
    buffer.init([w.meta() for w in workers], [w.env_id for w in workers])
    return buffer


def check_affinity(buffer: DataBuffer) -> None:
    """Env worker k's episodes are on shard k % 2 (both shards on this node)."""
    if buffer.backend != "ray":
        return
    table = buffer.store.episodes()
    for env_id, shard in zip(table.column("env_id").to_pylist(), table.column("shard").to_pylist()):
        assert shard == int(env_id.split("/")[0].rsplit("-", 1)[1]) % 2


def sampled(batches) -> Counter:
    return sum((transitions(batch.reshape(-1) if batch.ndim > 1 else batch) for batch in batches), Counter())


@pytest.fixture(params=["local", "ray"])
def placement(request) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture
def train_workers(placement, request):
    """Two train worker actors on Ray (batches are refs there), None locally."""
    return request.getfixturevalue("fake_train_workers") if placement == "ray" else None


def test_sync_ppo_rollouts_reach_both_train_workers_exactly_once(placement, train_workers):
    workers = [VecWorker(k, num_envs=3, seed=k, min_len=1000, max_len=1000) for k in range(4)]   # no resets in a window
    buffer = make_buffer(placement, workers)
    for _ in range(2):
        before = truth(workers)
        sync_rollout(buffer, workers, steps=5)
        check_affinity(buffer)
        batches = update_dataset(buffer.sample(batch_size=None), train_workers)
        assert len(batches) == 2 and len(buffer) == 0
        assert sampled(batches) == truth(workers) - before
        assert sum(len(batch) for batch in batches) == 4 * 3 * 5
    # a worker whose shard holds nothing gets every field, no rows
    empty = update_dataset(buffer.sample(batch_size=None), train_workers)
    assert [len(b) for b in empty] == [0, 0] and set(empty[0].keys()) == set(batches[0].keys())
    assert empty[0]["observation"].shape == (0, 3)


def test_async_rollouts_sampled_by_a_thread_polling_size_arrive_exactly_once(placement, train_workers):
    workers = [VecWorker(k, num_envs=4, seed=20 + k, autoreset="same_step") for k in range(2)]
    # Locally one train worker: split over two, drop_last would trim an odd batch (the seed's rule);
    # on Ray each worker drains its own shard.
    buffer = make_buffer(placement, workers, overrides={"auto_truncate_episode": True}, autoreset_mode="same_step",
                         num_train_workers=1 if placement == "local" else None)
    ids = [w.env_id for w in workers]
    received: list = []
    done = threading.Event()
    errors: list = []

    def rollout():
        try:
            env_rets = BatchedData(ids, [w.reset() for w in workers])
            for _ in range(16):
                buffer.add_batched_data_async(env_rets)
                responses = BatchedData(ids, [policy(r) for r in env_rets.values()])
                env_rets = BatchedData(ids, [w.step(r.action) for w, r in zip(workers, responses.values())])
                buffer.add_batched_data_async(responses)
            buffer.add_batched_data_async(env_rets)          # the last step's outcome, and a reply to it
            buffer.add_batched_data_async(BatchedData(ids, [policy(r) for r in env_rets.values()]))
        except Exception as err:   # surfaced in the main thread
            errors.append(err)
        finally:
            done.set()

    def dataset():
        try:
            while not done.is_set() or buffer.size() >= 8:
                if buffer.size() >= 8:
                    received.extend(update_dataset(buffer.sample(batch_size=8), train_workers))
                done.wait(0.02)                          # the engine polls every 10-100 ms
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=rollout), threading.Thread(target=dataset)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    buffer.truncate_episodes(ids)                        # the end of the run cuts the open episodes
    received.extend(update_dataset(buffer.sample(batch_size=None), train_workers))
    assert sampled(received) == truth(workers)


def test_rsl_rollouts_in_episode_unit_give_each_train_worker_its_sub_envs_windows(placement, train_workers):
    workers = [VecWorker(k, num_envs=4, seed=k, min_len=1000, max_len=1000) for k in range(2)]
    buffer = make_buffer(placement, workers, postprocess_fn=torch_stack_postprocess,
                         overrides={"sampler": {"type": "batch"}, "storage": {"unit": "episode"}})
    first = None
    for _ in range(2):
        first = rsl_rollout(buffer, workers, steps=6, first=first)
        assert len(buffer) == 8
        check_affinity(buffer)
        batches = update_dataset(buffer.sample(batch_size=8), train_workers)   # num_envs x train workers episodes
        assert [b.batch_size for b in batches] == [(4, 6), (4, 6)] and len(buffer) == 0
        seen = sampled(batches)
        assert sum(seen.values()) == 8 * 6
        assert not seen - truth(workers)                 # each one a real, aligned transition
        if placement == "ray":                            # worker k drew from shard k: env worker k's sub-envs
            for k, batch in enumerate(batches):
                assert set((batch["observation"][:, 0, 0] // 100).tolist()) == {k}
