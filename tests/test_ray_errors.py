"""An error a shard actor raises reaches the caller as that arrowbuf (or Python) error, its
own message first: not Ray's ``RayTaskError`` wrapper, whose message is the remote
traceback (issue 36). The traceback stays below it, as its ``__cause__``."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab

pytestmark = pytest.mark.usefixtures("ray_session")


def episode(steps: int) -> dict:
    return {"obs": np.zeros((steps + 1, 2), np.float32), "action": np.zeros(steps, np.int64),
            "terminated": np.arange(steps) == steps - 1}


def assert_unwrapped(info: pytest.ExceptionInfo, kind: type, message: str, method: str) -> None:
    """``info`` holds exactly ``kind`` whose one-line message starts with ``message``, and the
    remote traceback of the actor's ``method`` below it."""
    import ray

    err = info.value
    assert type(err) is kind, type(err).__mro__
    assert str(err).startswith(message) and "\n" not in str(err), str(err)
    assert isinstance(err.__cause__, ray.exceptions.RayTaskError)
    assert f"ShardServer.{method}" in str(err.__cause__)


def test_a_rate_limiters_refusal_in_a_shard_reaches_the_caller_as_rate_limited_with_its_message():
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, rate_limiter=ab.MinSize(100))
    try:
        store.add_episode(episode(5))
        with pytest.raises(ab.RateLimited) as info:
            store.sample(4, timeout=0.1)
        assert_unwrapped(info, ab.RateLimited, "Cannot sample 4 transitions yet: the store holds 5 transitions, "
                         "MinSize needs 100", "select")
    finally:
        store.close()


def test_an_episode_a_shard_cannot_hold_is_refused_with_capacity_error_and_the_store_is_unchanged():
    store = ab.ExperienceStore(100, backend="ray", num_shards=2)
    try:
        store.add_episode(episode(5))
        with pytest.raises(ab.CapacityError) as info:
            store.add_episode(episode(80))
        assert_unwrapped(info, ab.CapacityError, "episode of 80 steps holds 80 transitions, "
                         "more than the shard capacity of 50 transitions", "add_episodes")
        assert info.value.retryable is False   # the error's own attributes come with it
        assert len(store) == 5 and store.num_episodes == 1
    finally:
        store.close()


def test_an_unknown_episode_id_is_a_key_error_naming_it_as_on_a_local_store():
    store = ab.ExperienceStore(100, backend="ray", num_shards=1)
    try:
        store.add_episode(episode(5))
        with pytest.raises(KeyError) as info:
            store.episode(12345)
        assert_unwrapped(info, KeyError, "'episode 12345 is not in the store", "episode")
        local = ab.ExperienceStore(100)
        local.add_episode(episode(5))
        with pytest.raises(KeyError) as here:
            local.episode(12345)
        assert str(info.value) == str(here.value)
    finally:
        store.close()
