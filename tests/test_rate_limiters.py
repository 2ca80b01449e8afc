"""Rate limiters: who may sample or insert when, waiting for other threads, writer back-pressure."""

import threading

import numpy as np
import pytest

import arrowbuf as ab

from support.episodes import EPISODE_SCHEMA, make_episode, tagged_action, tagged_obs, tagged_reward


WAIT = 5.0     # generous: a passing test never waits this long


def limited_store(limiter, capacity=1000):
    return ab.ExperienceStore(capacity=capacity, seed=0, schema=EPISODE_SCHEMA, rate_limiter=limiter)


def add(store, steps=3, **kwargs):
    return store.add_episode(make_episode(0, steps), **kwargs)


class Background:
    """Runs ``call`` in a real thread and keeps its result or error."""

    def __init__(self, call):
        self.result = self.error = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()
        self.started.wait(WAIT)

    def _run(self, call):
        self.started.set()
        try:
            self.result = call()
        except Exception as err:  # noqa: BLE001 - handed to the test thread
            self.error = err

    def is_blocked(self, seconds=0.1):
        """Still running after ``seconds``: waiting, not failed nor done."""
        self.thread.join(seconds)
        return self.thread.is_alive()

    def join(self):
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the background call never returned"
        if self.error is not None:
            raise self.error
        return self.result


def ratio_store(samples_per_insert=1.0, min_size=6, error_buffer=6.0):
    """diff = inserts * spi - samples must stay in [spi*min_size - buffer, spi*min_size + buffer] = [0, 12]."""
    return limited_store(ab.SampleToInsertRatio(samples_per_insert, min_size, error_buffer))


# -- MinSize ---------------------------------------------------------------------------

def test_min_size_refuses_samples_until_the_store_holds_min_size_transitions():
    store = limited_store(ab.MinSize(10))
    for size in (3, 6, 9):
        add(store)
        assert len(store) == size
        with pytest.raises(ab.RateLimited, match=f"holds {size} transitions, MinSize needs 10"):
            store.sample(4)
    add(store)
    assert store.sample(4).batch_size == (4,)


def test_sampling_an_empty_store_waits_for_min_size_when_given_a_timeout():
    store = limited_store(ab.MinSize(5))
    sampler = Background(lambda: store.sample(4, timeout=WAIT))
    assert sampler.is_blocked(), f"sample returned at once: {sampler.error!r}"
    add(store)
    assert sampler.is_blocked(), "3 transitions are still fewer than MinSize(5)"
    add(store)
    assert sampler.join().batch_size == (4,)


def test_min_size_refuses_sampling_an_empty_store_with_rate_limited():
    store = limited_store(ab.MinSize(10))
    with pytest.raises(ab.RateLimited, match="holds 0 transitions, MinSize needs 10"):
        store.sample(4)


def test_a_refused_sample_changes_nothing_and_counts_nothing():
    store = limited_store(ab.MinSize(10))
    add(store)
    with pytest.raises(ab.RateLimited):
        store.sample(4)
    assert store.stats()["samples"] == 0 and store.engine.counts.samples == 0


# -- SampleToInsertRatio -----------------------------------------------------------------

def test_sample_to_insert_ratio_waits_for_min_size_inserted_before_the_first_sample():
    store = ratio_store()
    add(store)
    with pytest.raises(ab.RateLimited, match=r"3 transitions inserted, SampleToInsertRatio needs min_size=6"):
        store.sample(1)
    add(store)
    store.sample(1)


def test_sample_to_insert_ratio_blocks_sampling_when_samples_run_too_far_ahead():
    store = ratio_store()
    add(store)
    add(store)                                  # diff = 6
    store.sample(4)                             # diff = 2
    store.sample(4)                             # diff = -2 (a batch may overshoot the bound)
    with pytest.raises(ab.RateLimited, match=r"samples \(8\) are too far ahead of inserts \(6\)"):
        store.sample(1)
    add(store)                                  # diff = 1
    store.sample(1)


def test_sample_to_insert_ratio_blocks_inserts_when_samples_fall_too_far_behind():
    store = ratio_store()
    for _ in range(5):                          # 15 inserted: diff = 15 > 12 after the fifth
        add(store)
    with pytest.raises(ab.RateLimited, match=r"^Cannot insert 3 transitions: inserts \(15\) are too far ahead of "
                                             r"samples \(0\) .* = 15 must stay <= 12\)\. Sample more, or pass "
                                             r"timeout= to wait for trainers\.$"):
        add(store)
    assert (store.num_episodes, len(store), store.engine.counts.inserts) == (5, 15, 15), "a refused insert changes nothing"
    store.sample(4)                             # diff = 11
    add(store)


def test_a_blocked_sample_waits_until_another_thread_inserts():
    store = ratio_store()
    add(store)
    add(store)
    store.sample(8)                             # diff = -2: sampling is refused
    sampler = Background(lambda: store.sample(2, timeout=WAIT))
    assert sampler.is_blocked(), f"sample did not wait: {sampler.error!r}"
    add(store)
    assert sampler.join().batch_size == (2,)    # a wait that timed out would have raised RateLimited
    assert store.engine.counts.samples == 10


def test_a_blocked_insert_waits_until_another_thread_samples():
    store = ratio_store()
    for _ in range(5):
        add(store)
    writer = Background(lambda: add(store, timeout=WAIT))
    assert writer.is_blocked(), f"insert did not wait: {writer.error!r}"
    assert store.num_episodes == 5
    store.sample(4)
    writer.join()
    assert store.num_episodes == 6 and len(store) == 18


def test_a_wait_that_times_out_raises_rate_limited_and_says_how_long_it_waited():
    store = ratio_store()
    add(store)
    with pytest.raises(ab.RateLimited, match=r"min_size=6 before the first sample\. .* Waited 0\.05 s\.$"):
        store.sample(1, timeout=0.05)
    assert store.engine.counts.samples == 0


def test_stats_show_the_rate_limiter_state():
    store = ratio_store(samples_per_insert=2.0, min_size=3, error_buffer=10.0)
    add(store)
    add(store, steps=4)
    store.sample(5)
    stats = store.stats()
    assert stats["inserts"] == 7 and stats["samples"] == 5
    assert stats["sample_to_insert_ratio"] == pytest.approx(5 / 7)
    assert stats["rate_limiter"] == {"type": "SampleToInsertRatio", "inserts": 7, "samples": 5,
                                     "samples_per_insert": 2.0, "min_size": 3, "error_buffer": 10.0,
                                     "diff": 9.0}
    assert limited_store(ab.MinSize(4)).stats()["rate_limiter"] == {"type": "MinSize", "inserts": 0,
                                                                    "samples": 0, "min_size": 4}


def test_inserts_count_transitions_not_rows():
    store = ratio_store()
    store.add_episode(make_episode(0, 4, has_final=False))   # 4 rows, 3 transitions
    assert store.engine.counts.inserts == 3 == len(store)


# -- the step writer under back-pressure ----------------------------------------------------

def step(w, t, done):
    """One step of a single env playing the episode tagged 7 (step t)."""
    w.add(obs=tagged_obs(7, [t]), action=tagged_action(7, [t]), reward=tagged_reward(7, [t]),
          terminated=np.array([done]), truncated=np.array([False]), next_obs=tagged_obs(7, [t + 1]))


def run_episode(w, steps=3, first=0):
    for t in range(steps):
        step(w, first + t, t == steps - 1)


def test_writer_keeps_an_episode_the_store_refuses_and_pushes_it_before_the_next_step():
    store = ratio_store()
    w = store.writer(num_envs=1, autoreset_mode="disabled")
    for _ in range(5):
        run_episode(w)
    assert (store.num_episodes, w.pending) == (5, 0)
    run_episode(w, first=100)                   # sealed, refused: kept
    assert (store.num_episodes, w.pending) == (5, 1)
    with pytest.raises(ab.RateLimited):
        step(w, 200, False)                     # the kept episode still does not fit: nothing recorded
    assert w.pending == 1 and w.open_steps.tolist() == [0]
    store.sample(4)
    step(w, 300, False)                         # pushes the kept episode, then records the step
    assert (store.num_episodes, w.pending, w.open_steps.tolist()) == (6, 0, [1])
    newest = store.episode(store.episodes()["episode_id"][-1].as_py())
    assert newest["obs"].to_numpy_ndarray()[:, 1].tolist() == [100, 101, 102, 103]


def test_writer_with_a_timeout_waits_for_a_sampler_thread():
    store = ratio_store()
    w = store.writer(num_envs=1, autoreset_mode="disabled", timeout=WAIT)
    for _ in range(5):
        run_episode(w)
    writer = Background(lambda: run_episode(w, first=100))
    assert writer.is_blocked(), f"the writer did not wait: {writer.error!r}"
    store.sample(4)
    writer.join()
    assert (store.num_episodes, w.pending) == (6, 0)


# -- bad arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: ab.MinSize(0), r"min_size must be an int >= 1, got 0"),
    (lambda: ab.MinSize(2.5), r"min_size must be an int >= 1, got 2\.5"),
    (lambda: ab.SampleToInsertRatio(0.0, 10, 1.0), r"samples_per_insert must be .*> 0, got 0\.0"),
    (lambda: ab.SampleToInsertRatio(float("nan"), 10, 1.0), r"samples_per_insert .*got nan"),
    (lambda: ab.SampleToInsertRatio(1.0, 0, 1.0), r"min_size must be an int >= 1, got 0"),
    (lambda: ab.SampleToInsertRatio(1.0, 10, -1.0), r"error_buffer must be .*>= 0, got -1\.0"),
    (lambda: ab.ExperienceStore(capacity=10, rate_limiter="min"), r"rate_limiter must be an arrowbuf RateLimiter"),
])
def test_rate_limiters_reject_bad_arguments_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()
