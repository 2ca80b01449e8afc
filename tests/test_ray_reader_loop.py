"""The Ray reader owns its draw-order-gather loop (issue 24): the store hands it a request,
a traced batch crosses few module boundaries (`support.hops`) and never comes back into the
router, and a plain ``sample`` is handed out of the same loop's draws ahead. Draws the shards
make (PER, rate limiters) run the same loop (issue 36)."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab

from support.hops import crossings

pytestmark = pytest.mark.usefixtures("ray_session")

ROUTER = "arrowbuf.ray.router"


def back_into_router(seen: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The calls of ``seen`` into the router from the parts it drives (not from the store facade)."""
    return [c for c in seen if c[1] == ROUTER and c[0].startswith("arrowbuf.ray.")]


def filled_store(num_shards: int = 2, **options) -> ab.ExperienceStore:
    store = ab.ExperienceStore(4000, backend="ray", num_shards=num_shards, seed=0, **options)
    rng = np.random.default_rng(0)
    for e in range(12):
        steps = 40 + e
        store.add_episode({"obs": rng.random((steps + 1, 4), np.float32), "action": rng.random((steps, 2), np.float32),
                           "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1},
                          env_id=f"env-{e}")
    store.flush()
    return store


@pytest.fixture(scope="module")
def uniform_store():
    """A uniform 2-shard `filled_store`, shared by the tests that do not close it (each shard starts a process).
    Its reader polls the shards' manifests once an hour, not every 0.1 s: a poll due in the middle of a
    traced batch added its hops to it (22 where the loop takes 15), so the hop count hung on timing
    (the file alone, or after test_ray_writers, failed)."""
    store = filled_store(ray_options=ab.RayOptions(seal_latency=3600.0))
    yield store
    store.close()


def test_the_first_batch_of_a_ray_sample_iter_stays_in_the_reader_and_its_parts(uniform_store):
    store = uniform_store
    # A fresh batch shape (no other test draws 24 from this store): its layout is planned in this
    # batch, still never through the router.
    cold = crossings(lambda: next(store.sample_iter(24)))
    assert back_into_router(cold) == [], cold
    # The first batch of an iterator once the layouts are known: draw, order, gather.
    iterator = store.sample_iter(24)
    warm = crossings(lambda: next(iterator))
    assert [c for c in warm if c[1] == ROUTER] == [], warm
    assert len(warm) <= 15, warm
    assert {callee for _, callee, _ in warm} <= {
        "arrowbuf.ray.handles", "arrowbuf.samplers", "arrowbuf.table", "arrowbuf.indexing", "arrowbuf.ray.block_reads",
        "arrowbuf.ray.cache", "arrowbuf.ray.gather", "arrowbuf.layout", "arrowbuf._pool", "arrowbuf.ray.reader"}, warm
    # A plain sample takes the same loop.
    store.sample(24)
    plain = crossings(lambda: store.sample(24))
    assert back_into_router(plain) == [], plain


def test_the_first_batch_of_a_prioritized_sample_iter_runs_the_readers_loop_in_few_hops():
    # The shards draw (PER): 2 shards, 4 index requests in flight. Its loop lived apart
    # (ray/draws.py), passing back and forth between it, the reader and the handles:
    # 55 hops for this batch, against 14 for a uniform one.
    store = filled_store(sampler=ab.PrioritizedSampler(alpha=0.6, beta=0.4))
    try:
        next(store.sample_iter(24))   # this batch shape's layout is planned once
        store.flush()                 # and the views are current: no manifest comes with the answers
        iterator = store.sample_iter(24)
        warm = crossings(lambda: next(iterator))
        assert len(warm) <= 25, warm
        assert {callee for _, callee, _ in warm} <= {
            "arrowbuf.ray.handles", "arrowbuf.samplers", "arrowbuf.table", "arrowbuf.indexing", "arrowbuf.ray.block_reads",
            "arrowbuf.ray.cache", "arrowbuf.ray.gather", "arrowbuf.layout", "arrowbuf._pool"}, warm
        # The prefetched requests go out in one call, not one per request and shard.
        assert [c[2] for c in warm if c[1] == "arrowbuf.ray.handles"] == ["live", "call_each", "get", "note_all"], warm
        batch = next(iterator)
        assert batch["weight"].max() == 1 and len(batch) == 24
    finally:
        store.close()


def test_plain_samples_are_handed_out_of_draws_ahead_and_counted_when_handed_out(uniform_store):
    store = uniform_store
    samples = store.stats()["samples"]   # another test's samples
    draws = []
    for _ in range(40):
        draws += [c for c in crossings(lambda: store.sample(16)) if c[1:] == ("arrowbuf.samplers", "sample")]
    # The first draw of a request is one batch, the next ones several (`READ_BYTES`).
    assert 2 <= len(draws) <= 5, len(draws)
    assert store.stats()["samples"] - samples == 40 * 16   # handed out, not drawn ahead
    # Requests of other keys or sizes get their own loops, each batch its own keys.
    for _ in range(3):
        assert set(store.sample(16, keys=["obs"]).keys()) == {"obs", "index", "episode_id", "step"}
        assert store.sample(8)["action"].shape == (8, 2)
        assert "action" in store.sample(16).keys()
    # A write of this process drops the draws ahead: the very next batch is drawn again,
    # and the new episode holds about half the rows (1 in 2**16 batches holds none of it).
    store.sample(16)
    store.add_episode({"obs": np.full((601, 4), -1, np.float32), "action": np.zeros((600, 2), np.float32),
                       "reward": np.ones(600, np.float32), "terminated": np.arange(600) == 599}, env_id="new")
    assert (store.sample(16)["obs"] == -1).any()
