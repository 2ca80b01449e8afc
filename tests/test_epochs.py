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
