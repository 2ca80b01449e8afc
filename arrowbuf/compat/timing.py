"""Call timers for `DataBuffer.print_timing_summary` (count, total and average seconds per call kind)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timers:
    """Named timers; ``raw`` is the seed's ``timing_raw``: name -> {count, total, avg}."""

    def __init__(self) -> None:
        self.raw: dict[str, dict[str, float]] = {}

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            stats = self.raw.setdefault(name, {"count": 0, "total": 0.0, "avg": 0.0})
            stats["count"] += 1
            stats["total"] += time.perf_counter() - start
            stats["avg"] = stats["total"] / stats["count"]

    def reset(self) -> None:
        self.raw = {}
