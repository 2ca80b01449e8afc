"""The gather: arena rows -> one buffer -> tensors of a TensorDict (the only copy)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import arrowbuf as ab
from arrowbuf.tensors import Gather, nest

from support.episodes import make_episode


ALIGN = 64


def arena() -> dict[str, np.ndarray]:
    rows = np.arange(10)
    return {
        "obs": np.stack([rows * 10.0, rows * 10.0 + 1], -1).astype(np.float32),
        "action": (rows * 100).astype(np.int64),
        "flag": rows % 3 == 0,
        "half": rows.astype(np.uint16),   # bfloat16 bits
    }


def make_gather(columns: dict[str, np.ndarray]) -> Gather:
    return Gather({
        ("obs",): (columns["obs"], "obs", "float32"),
        ("next", "obs"): (columns["obs"], "next", "float32"),
        ("action",): (columns["action"], "step", "int64"),
        ("flag",): (columns["flag"], "step", "bool"),
        ("half",): (columns["half"], "step", "bfloat16"),
    })


def gathered_keys(batch) -> list:
    return [k for k in batch.keys(True, True) if k != "index"]


def test_gather_reads_the_rows_and_the_next_observations():
    columns = arena()
    rows = np.array([3, 0, 7, 3])
    batch = make_gather(columns)(rows)
    assert batch.batch_size == torch.Size([4])
    np.testing.assert_array_equal(batch["obs"].numpy(), columns["obs"][rows])
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), columns["obs"][rows + 1])
    np.testing.assert_array_equal(batch["action"].numpy(), columns["action"][rows])
    assert batch["flag"].dtype == torch.bool
    assert batch["flag"].tolist() == columns["flag"][rows].tolist()
    assert batch["half"].dtype == torch.bfloat16
    bits = batch["half"].view(torch.int16).numpy().view(np.uint16)
    assert bits.tolist() == columns["half"][rows].tolist()


def test_gather_keeps_a_two_dimensional_batch_shape():
    columns = arena()
    rows = np.array([[1, 2, 3], [5, 6, 7]])
    batch = make_gather(columns)(rows)
    assert batch.batch_size == torch.Size([2, 3])
    assert batch["obs"].shape == (2, 3, 2)
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), columns["obs"][rows + 1])


def test_gather_uses_explicit_observation_and_next_rows():
    columns = arena()
    rows = np.array([4, 5])
    batch = make_gather(columns)(rows, obs_rows=np.array([[3, 4], [4, 5]]), next_rows=np.array([[6, 7], [8, 9]]))
    assert batch["obs"].shape == (2, 2, 2)
    np.testing.assert_array_equal(batch["obs"].numpy(), columns["obs"][[[3, 4], [4, 5]]])
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), columns["obs"][[[6, 7], [8, 9]]])
    np.testing.assert_array_equal(batch["action"].numpy(), columns["action"][rows])


def test_default_next_rows_gather_what_explicit_next_rows_do():
    # Default next observations are read from the column shifted by one row (no
    # rows + 1 computed): the batch must equal one given next_rows = rows + 1.
    columns = arena()
    gather = make_gather(columns)
    for rows in (np.array([8, 0, 3, 3]), np.array([[1, 2], [7, 8]])):
        extra = {"index": np.arange(rows.size).reshape(rows.shape)}
        shifted, explicit = gather(rows, extra), gather(rows, extra, next_rows=rows + 1)
        assert list(shifted.keys(True, True)) == list(explicit.keys(True, True))
        for key in explicit.keys(True, True):
            assert shifted[key].dtype == explicit[key].dtype
            assert torch.equal(shifted[key], explicit[key]), key
        np.testing.assert_array_equal(shifted["next", "obs"].numpy(), columns["obs"][rows + 1])
        # Storage of another kind (the torch arena) gets the next rows computed.
        _, layout, by_role = gather.layout_of(rows, extra)
        np.testing.assert_array_equal(by_role[2], rows + 1)


def test_extra_arrays_are_added_and_replace_gathered_keys_of_the_same_name():
    columns = arena()
    rows = np.array([1, 2])
    batch = make_gather(columns)(rows, {"index": np.array([11, 12]), "action": np.array([-1, -2]),
                                        "next.mask": np.array([True, False])})
    assert batch["index"].tolist() == [11, 12]
    assert batch["action"].tolist() == [-1, -2]
    assert batch["next", "mask"].tolist() == [True, False]


def test_gathered_tensors_are_copies_not_views_of_the_arena():
    columns = arena()
    batch = make_gather(columns)(np.array([2, 2]))
    batch["action"][0] = 12345
    assert columns["action"][2] == 200
    assert batch["action"][1] == 200
    columns["action"][2] = -7
    assert batch["action"][1] == 200


def test_gathered_tensors_are_views_of_one_gather_buffer():
    payload = make_gather(arena()).payload(np.array([1, 4, 2]))
    batch = payload.to_tensordict()
    flat = torch.as_tensor(payload.flat)
    start, stop = flat.data_ptr(), flat.data_ptr() + flat.nbytes
    for key in gathered_keys(batch):
        tensor = batch.get(key)
        assert start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= stop, key


def test_gathered_tensors_are_aligned_and_do_not_overlap():
    batch = make_gather(arena())(np.array([1, 4, 2]))
    spans = sorted((batch.get(k).data_ptr(), batch.get(k).data_ptr() + batch.get(k).nbytes)
                   for k in gathered_keys(batch))
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - spans[0][0] < 4096   # one small buffer, not scattered allocations


def test_a_payload_pickles_and_unpickles_into_the_same_batch():
    columns = arena()
    payload = make_gather(columns).payload(np.array([0, 3, 8]), {"index": np.array([5, 6, 7])})
    restored = pickle.loads(pickle.dumps(payload)).to_tensordict()
    original = payload.to_tensordict()
    for key in original.keys(True, True):
        assert torch.equal(restored.get(key), original.get(key)), key


def test_nest_builds_nested_dicts_from_key_tuples():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert nest({("obs", "pixels"): a, ("next", "obs", "pixels"): b, ("action",): c}) == {
        "obs": {"pixels": a}, "next": {"obs": {"pixels": b}}, "action": c}


def test_sampled_tensors_of_a_store_share_one_gather_buffer():
    store = ab.ExperienceStore(capacity=100, seed=0)
    store.add_episode(make_episode(1, 9))
    batch = store.sample(16)
    # episode_id and step are computed from the episode table, not gathered.
    keys = [k for k in gathered_keys(batch) if k not in ("episode_id", "step")]
    assert {("next", "obs"), "obs", "action", "reward"} <= set(keys)
    spans = sorted((batch.get(k).data_ptr(), batch.get(k).data_ptr() + batch.get(k).nbytes) for k in keys)
    gaps = [start - stop for (_, stop), (start, _) in zip(spans, spans[1:])]
    assert all(0 <= gap < ALIGN for gap in gaps), "every gathered field should lie in one gather buffer"
    arena_columns = store.engine.shard.arena
    for name, column in arena_columns.items():
        start, stop = column.ctypes.data, column.ctypes.data + column.nbytes
        for k in keys:
            assert not start <= batch.get(k).data_ptr() < stop, f"{k} points into the arena column {name}"


def twin_stores(seed: int) -> list[ab.ExperienceStore]:
    """Two stores with the same seed and episode: they sample the same rows."""
    stores = []
    for _ in range(2):
        store = ab.ExperienceStore(capacity=100, seed=seed)
        store.add_episode(make_episode(2, 9))
        stores.append(store)
    return stores


def test_pin_memory_is_ignored_without_cuda_and_samples_the_same():
    stores = twin_stores(3)
    plain, pinned = stores[0].sample(8), stores[1].sample(8, pin_memory=True)
    assert (plain == pinned).all()
    assert pinned["obs"].is_pinned() == torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_sample_arrives_in_one_copy_with_the_cpu_values():
    stores = twin_stores(4)
    cpu, gpu = stores[0].sample(16), stores[1].sample(16, device="cuda")
    assert gpu.device.type == "cuda" and gpu["obs"].is_cuda and gpu["next", "obs"].is_cuda
    for key in cpu.keys(True, True):
        assert torch.equal(cpu.get(key), gpu.get(key).cpu()), key
