"""PPO epochs: every stored transition once per epoch, each epoch a fresh permutation."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab


def rollout_store(episodes: int = 6, steps: int = 7) -> ab.ExperienceStore:
    store = ab.ExperienceStore(1000, seed=3)
    for k in range(episodes):
        store.add_episode({"obs": np.full((steps + 1, 2), k, np.float32), "action": np.arange(steps),
                           "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
                           "truncated": np.zeros(steps, bool)})
    return store


@pytest.mark.parametrize("drop_last", [False, True])
def test_each_epoch_visits_every_transition_exactly_once(drop_last):
    store = rollout_store()
    batches = list(store.iter_batches(8, epochs=4, drop_last=drop_last))
    per_epoch = len(store) // 8 if drop_last else -(-len(store) // 8)
    assert len(batches) == 4 * per_epoch
    for epoch in range(4):
        index = np.concatenate([b["index"].numpy() for b in batches[epoch * per_epoch:(epoch + 1) * per_epoch]])
        if drop_last:
            assert len(set(index.tolist())) == len(index) == per_epoch * 8
        else:
            assert sorted(index.tolist()) == list(range(len(store)))


def test_each_epoch_draws_a_fresh_permutation():
    store = rollout_store()
    batches = list(store.iter_batches(len(store), epochs=3))
    orders = [b["index"].tolist() for b in batches]
    assert len({tuple(o) for o in orders}) == 3


def test_unshuffled_epochs_repeat_insertion_order():
    store = rollout_store()
    batches = list(store.iter_batches(10, shuffle=False, epochs=2))
    index = np.concatenate([b["index"].numpy() for b in batches])
    assert index.tolist() == list(range(len(store))) * 2


def test_a_bad_epochs_argument_draws_nothing():
    store = rollout_store()
    state = store.engine.state_dict()["rng"]
    with pytest.raises(ValueError, match="epochs must be an int >= 1, got 0"):
        store.iter_batches(8, epochs=0)
    assert store.engine.state_dict()["rng"] == state


def column_bounds(store: ab.ExperienceStore, name: str) -> tuple[int, int]:
    """[first, stop) byte addresses of an arena column (numpy or torch arena)."""
    shard = store.engine.shard
    column = shard.tensor_rows(name, 0, shard.capacity)
    return column.data_ptr(), column.data_ptr() + column.stride(0) * column.element_size() * len(column)


@pytest.mark.parametrize("storage_device", [None, "cpu"])
def test_unshuffled_batches_of_contiguous_rows_are_views_that_alias_the_arena(storage_device):
    store = ab.ExperienceStore(20, seed=0, storage_device=storage_device)   # transitions: full after one episode
    steps = 20
    store.add_episode({"obs": np.arange(2 * (steps + 1), dtype=np.float32).reshape(steps + 1, 2),
                       "action": np.arange(steps), "reward": np.ones(steps, np.float32),
                       "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool)})
    batches = list(store.iter_batches(5, shuffle=False))
    assert [b["index"].tolist() for b in batches] == [list(range(k, k + 5)) for k in range(0, 20, 5)]
    for k, batch in enumerate(batches):
        for key, name, row in (("action", "action", 5 * k), ("obs", "obs", 5 * k), (("next", "obs"), "obs", 5 * k + 1)):
            first, stop = column_bounds(store, name)
            tensor = batch[key]
            assert first <= tensor.data_ptr() < stop, key   # inside the arena: no copy
            # (a packed field's view strides over its records: `arrowbuf.packing`)
            assert tensor.data_ptr() == first + row * tensor.stride(0) * tensor.element_size(), key
        assert batch["action"].tolist() == list(range(5 * k, 5 * k + 5))
        np.testing.assert_array_equal(batch["next", "obs"].numpy(), batch["obs"].numpy() + 2)
    # They alias the store: the ring overwriting those rows changes them.
    kept = batches[0]
    store.add_episode({"obs": np.full((21, 2), -1, np.float32), "action": np.full(20, -7),   # evicts it all
                       "reward": np.ones(20, np.float32), "terminated": np.arange(20) == 19,
                       "truncated": np.zeros(20, bool)})
    assert kept["action"].tolist() == [-7] * 5 and kept["obs"].tolist() == [[-1.0, -1.0]] * 5


@pytest.mark.parametrize("storage_device", [None, "cpu"])
def test_unshuffled_batches_across_episode_ends_and_shuffled_ones_are_copies(storage_device):
    store = ab.ExperienceStore(100, seed=0, storage_device=storage_device)
    for k in range(3):
        store.add_episode({"obs": np.full((5, 2), k, np.float32), "action": np.arange(4) + 10 * k,
                           "terminated": np.arange(4) == 3})
    first, stop = column_bounds(store, "action")
    across = next(iter(store.iter_batches(6, shuffle=False)))   # rows 0-3 and 5-6: the final obs row between
    assert across["action"].tolist() == [0, 1, 2, 3, 10, 11]
    assert not first <= across["action"].data_ptr() < stop
    for batch in store.iter_batches(4, shuffle=True):
        assert not first <= batch["action"].data_ptr() < stop
    views = list(store.iter_batches(4, shuffle=False, keys=["action"]))
    assert [b["action"].tolist() for b in views] == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
    assert set(views[0].keys()) == {"action", "index", "episode_id", "step"}
    assert all(first <= b["action"].data_ptr() < stop for b in views)
