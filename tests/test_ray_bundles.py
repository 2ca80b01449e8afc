"""A write request's episodes shipped as one array a field (`arrowbuf.ray.bundles`): what arrives is
what was sent (a Ray store's shard storing them: `test_ray_dataplane.py`)."""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import given, settings, strategies as st

from arrowbuf.ray.bundles import Bundle, bundled
from arrowbuf.shard import Episode


def episode(rng: np.random.Generator, steps: int, final: bool, k: int, **extra) -> Episode:
    columns = {"obs": rng.standard_normal((steps + final, 3)).astype(np.float32),
               "action": rng.integers(0, 9, (steps, 2)), "reward": rng.standard_normal(steps).astype(np.float32),
               "terminated": rng.random(steps) < 0.5}
    return Episode(columns, steps, final, env_id=f"w/{k}", metadata={"k": k} if k % 3 == 0 else None,
                   inserted_at=1_000 + k if k % 2 else None, **extra)


def same(a: Episode, b: Episode) -> bool:
    return (a.columns.keys() == b.columns.keys() and all(
        a.columns[n].dtype == b.columns[n].dtype and np.array_equal(a.columns[n], b.columns[n]) for n in a.columns)
        and (a.num_steps, a.has_final, a.env_id, a.metadata, a.owned, a.inserted_at, a.first_step, a.open,
             a.prev_piece) == (b.num_steps, b.has_final, b.env_id, b.metadata, b.owned, b.inserted_at, b.first_step,
                               b.open, b.prev_piece))


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=2, max_size=12), seed=st.integers(0, 999))
def test_a_bundle_arrives_as_the_episodes_sent(shapes, seed):
    """Each field's rows back to back and each episode's row counts: the episodes cut from them are
    the ones sent, value for value, with their table values, in order."""
    rng = np.random.default_rng(seed)
    episodes = [episode(rng, steps, final, k, owned=bool(k % 2), first_step=k % 4, open=k == 1, prev_piece=k - 5)
                for k, (steps, final) in enumerate(shapes)]
    sent = bundled(episodes)
    assert type(sent) is Bundle
    arrived = pickle.loads(pickle.dumps(sent, protocol=5))
    assert type(arrived) is list and len(arrived) == len(episodes)
    assert all(same(a, b) for a, b in zip(arrived, episodes))


def test_episodes_a_concatenation_would_change_go_as_a_list():
    rng = np.random.default_rng(0)
    a, b = episode(rng, 3, True, 0), episode(rng, 4, True, 1)
    assert type(bundled([a])) is list   # one: nothing to gain
    for change in ({"action": b.columns["action"].astype(np.int32)},        # another dtype
                   {"obs": np.zeros((5, 4), np.float32)},                     # another row shape
                   {"extra": np.zeros(4)}):                                   # another field
        other = Episode({**b.columns, **change}, 4, True)
        assert type(bundled([a, other])) is list
    import torch
    tensors = Episode({**b.columns, "reward": torch.zeros(4)}, 4, True)
    assert type(bundled([a, tensors])) is list
