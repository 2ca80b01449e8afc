"""`arrowbuf.direct`: the plain uniform sample written straight into its pooled batch
gives what the generic path gives, from the same draws."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab
import arrowbuf.engine as engine_module

from support.compare import assert_same_batches
from support.episodes import make_episode


def twin_stores() -> tuple[ab.ExperienceStore, ab.ExperienceStore]:
    """Two stores of the same seed and rows; the second takes the generic path (reuse
    tracking needs the selection, which the direct path never builds)."""
    pair = []
    for track_reuse in (False, True):
        store = ab.ExperienceStore(60, seed=11, track_reuse=track_reuse)
        for tag, (steps, has_final) in enumerate([(5, True), (9, False), (12, True), (7, True), (30, True)]):
            store.add_episode(make_episode(tag, steps, has_final))   # 64 rows > 60: the ring evicts
        pair.append(store)
    return pair[0], pair[1]


@pytest.fixture
def direct_calls(monkeypatch):
    calls = []
    original = engine_module.sample_plain_uniform

    def counting(*args, **kwargs):
        calls.append(args[2])
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample_plain_uniform", counting)
    return calls


def test_direct_and_generic_samples_are_the_same_batches(direct_calls):
    direct, generic = twin_stores()
    for batch_size, keys in [(1, None), (7, None), (64, None), (64, ["obs"]), (5, ["action", ("next", "obs")]),
                             (300, None)]:
        assert_same_batches(direct.sample(batch_size, keys=keys), generic.sample(batch_size, keys=keys))
    assert direct_calls == [1, 7, 64, 64, 5, 300]   # the direct path ran for the first store only
    assert direct.engine.counts.samples == generic.engine.counts.samples == 441


def test_a_batch_kept_from_the_direct_path_is_not_overwritten(direct_calls):
    store, _ = twin_stores()
    kept = store.sample(32)
    snapshot = {key: kept.get(key).clone() for key in kept.keys(True, True)}
    for _ in range(5):
        later = store.sample(32)
        assert later.get("obs").data_ptr() != kept.get("obs").data_ptr()
    for key, value in snapshot.items():
        assert np.array_equal(kept.get(key).numpy(), value.numpy()), key
    assert len(direct_calls) == 6


def test_samples_that_need_the_generic_path_do_not_take_the_direct_one(direct_calls):
    store, _ = twin_stores()
    store.sample(8, n_step=3)
    store.sample(8, frame_stack=2)
    store.sample(8, pin_memory=True)
    store.sample(8, device="cpu")   # a device given: the generic path's placement
    assert direct_calls == []
    limited = ab.ExperienceStore(60, seed=1, rate_limiter=ab.MinSize(1))
    limited.add_episode(make_episode(0, 5))
    limited.sample(4)
    assert direct_calls == []


@pytest.mark.parametrize("versions, bound, one_run", [
    ([0, 1, 2, 3, 4], 2, True),          # rising versions: the fresh steps are one run of indices
    ([3, 0, 4, 1, 5], 3, False),         # fresh episodes between stale ones: several runs
    ([0, [0, 1, 1, 2, 2, 2, 3], 3, 1, 4], 2, False),   # a bump inside an episode, then a stale one
])
def test_fresh_samples_are_the_same_batches_on_both_paths_whether_the_fresh_steps_are_one_run_or_not(
        direct_calls, versions, bound, one_run):
    from arrowbuf.versions import fresh_spans

    pair = []
    for track_reuse in (False, True):   # the second store takes the generic path (`twin_stores`)
        store = ab.ExperienceStore(200, seed=3, track_reuse=track_reuse)
        for tag, version in enumerate(versions):
            episode = make_episode(tag, 7, True)
            store.add_episode({**episode, "policy_version": np.broadcast_to(np.asarray(version), (7,)).copy()})
        pair.append(store)
    direct, generic = pair
    assert (fresh_spans(direct.engine.direct()[0], bound).first >= 0) == one_run
    drawn = []
    for batch_size in (1, 9, 64):
        batch = direct.sample(batch_size, min_version=bound)
        assert_same_batches(batch, generic.sample(batch_size, min_version=bound))
        assert bool((batch["policy_version"] >= bound).all())
        drawn.append(batch["index"].numpy())
    assert direct_calls == [1, 9, 64]
    expected = np.flatnonzero(np.concatenate(
        [np.broadcast_to(np.asarray(v), (7,)) for v in versions]) >= bound)   # one index per step, from 0
    assert set(np.concatenate(drawn).tolist()) <= set(expected.tolist())
