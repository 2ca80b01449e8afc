"""The shard engine composes shard, sampler and limiter counts: it calls the parts, they never call it."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.engine import ShardEngine
from arrowbuf.episode_read import read_episode
from arrowbuf.errors import RateLimited


class RecordingSampler(ab.UniformSampler):
    """Uniform, and records what the engine tells it."""

    tracks_rows = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def on_add(self, first_row: int, length: int) -> None:
        self.calls.append(("add", first_row, length))

    def on_evict(self, first_rows: np.ndarray, num_rows: np.ndarray) -> None:
        self.calls.append(("evict", first_rows.tolist(), num_rows.tolist()))


def episode(steps: int, value: float = 0.0):
    return read_episode({"obs": np.full((steps + 1, 2), value, np.float32), "action": np.zeros(steps, np.int64),
                         "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
                         "truncated": np.zeros(steps, bool)}, None)


def make_engine(capacity: int = 10, **kwargs) -> ShardEngine:
    kwargs.setdefault("sampler", ab.UniformSampler())
    kwargs.setdefault("rate_limiter", ab.RateLimiter())
    return ShardEngine(capacity, seed=0, **kwargs)


def test_the_engine_tells_the_sampler_of_evictions_before_the_rows_it_added():
    sampler = RecordingSampler()
    engine = make_engine(sampler=sampler)
    for _ in range(4):
        checked, schema = episode(3)   # 3 transitions (4 rows) each: the fourth is 2 past the capacity of 10
        engine.add(checked, schema)
    # the first episode's oldest 2 transitions go (rows 0-1), then the ring grows for the new rows
    assert sampler.calls == [("add", 0, 3), ("add", 4, 3), ("add", 8, 3), ("evict", [0], [2]), ("add", 12, 3)]


def test_clearing_the_engine_tells_the_sampler_every_live_span():
    sampler = RecordingSampler()
    engine = make_engine(sampler=sampler)
    for _ in range(2):
        engine.add(*episode(2))
    engine.clear()
    assert sampler.calls[-1] == ("evict", [0, 3], [3, 3])
    assert len(engine) == 0


def test_the_engine_keeps_the_limiter_counts_and_the_limiter_keeps_none():
    limiter = ab.SampleToInsertRatio(samples_per_insert=1.0, min_size=3, error_buffer=2.0)
    engine = make_engine(capacity=100, rate_limiter=limiter)
    engine.add(*episode(3))
    engine.sample(4)
    assert (engine.counts.inserts, engine.counts.samples) == (3, 4)
    assert not hasattr(limiter, "inserts") and not hasattr(limiter, "samples")
    with pytest.raises(RateLimited, match="too far ahead"):
        engine.sample(4)
    assert engine.counts.samples == 4, "a refused sample is not counted"


def test_an_engine_state_round_trips_into_a_new_engine_that_samples_the_same():
    engine = make_engine(capacity=50, sampler=ab.PrioritizedSampler())
    for k in range(4):
        engine.add(*episode(5, float(k)))
    batch = engine.sample(8)
    engine.update_priorities(batch["index"].numpy(), np.arange(8, dtype=np.float64))
    state = engine.state_dict()
    arena = {name: column.copy() for name, column in engine.shard.arena.items()}
    copy = make_engine(capacity=50, sampler=ab.PrioritizedSampler())

    def fill(shard):
        for name, column in arena.items():
            shard.arena[name][:] = column

    copy.load_state_dict(state, fill)
    assert copy.counts == engine.counts
    a, b = engine.sample(16), copy.sample(16)
    assert (a["index"] == b["index"]).all() and (a["weight"] == b["weight"]).all()


def test_gather_returns_the_live_indices_only_and_is_not_counted_by_the_rate_limiter():
    engine = make_engine(capacity=8)
    engine.add(*episode(3, 1.0))   # indices 0..2, rows 0..3
    engine.add(*episode(3, 2.0))   # indices 3..5, rows 4..7
    engine.add(*episode(3, 3.0))   # evicts the first: indices 6..8
    batch = engine.gather(np.array([7, 0, 3], np.int64))
    assert batch["index"].tolist() == [7, 3]
    assert batch["obs"][:, 0].tolist() == [3.0, 2.0]
    assert engine.counts.samples == 0


def test_the_engine_lock_knows_its_owner_and_a_condition_wait_gives_up_every_level():
    import threading

    from arrowbuf._owned_lock import OwnedLock

    lock = OwnedLock()
    changed = threading.Condition(lock)
    seen: list[bool] = []
    assert not lock.held_here()
    with lock, lock:   # held twice: a wait must release both levels, then restore them
        assert lock.held_here()
        other = threading.Thread(target=lambda: seen.append(lock.held_here()) or _notify(changed))
        other.start()
        assert changed.wait(timeout=30)   # the other thread could take the lock: it was given up
        assert lock.held_here()
        other.join()
    assert seen == [False] and not lock.held_here()
    assert lock.acquire(blocking=False)
    lock.release()


def _notify(changed) -> None:
    with changed:
        changed.notify_all()
