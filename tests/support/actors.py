"""Waiting for a killed Ray actor to be gone."""

from __future__ import annotations

import time


def kill_and_wait(handle, seconds: float = 60.0) -> None:
    """ray.kill returns before the actor is gone: wait until calls to it fail."""
    import ray

    ray.kill(handle)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ping.remote(), timeout=seconds)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor still answers {seconds} s after ray.kill")
