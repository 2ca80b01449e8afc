"""Ray stores a test module shares: one per configuration, emptied for each test that asks.

Each Ray store starts a process per shard (0.6-0.7 s of CPU each, importing Ray: the
largest cost of the suite), so tests that need an empty store of the same configuration,
and nothing a fresh store has beyond that (ids or serials from 0, a schema not yet fixed,
`add_episode` routes never taken, counters such as ``stats()["samples"]`` at 0), take it
from a module-scoped `SharedStores` (the ``ray_stores`` fixture of ``conftest.py``).
"""

from __future__ import annotations

import gc

import arrowbuf as ab


class SharedStores:
    """The Ray stores of one test module: started at first use, closed by `close`."""

    def __init__(self) -> None:
        self.started: dict[str, ab.ExperienceStore] = {}

    def get(self, **kwargs) -> ab.ExperienceStore:
        """An empty ``ExperienceStore(backend="ray", **kwargs)``: the one an earlier test of the
        module started with these arguments, emptied (`empty`), else a new one."""
        key = repr(sorted(kwargs.items()))   # samplers' and RayOptions' reprs name their settings
        store = self.started.get(key)
        if store is None:
            store = self.started[key] = ab.ExperienceStore(backend="ray", **kwargs)
        else:
            empty(store)
        return store

    def close(self) -> None:
        for store in self.started.values():
            store.close()


def empty(store: ab.ExperienceStore) -> None:
    """Empty ``store`` for the next test: the episodes that writers earlier tests dropped
    without closing cut and deliver are stored first (`flush` waits for them), then cleared."""
    gc.collect()   # a dropped writer delivers from its finalizer
    store.flush()
    store.clear()
    assert len(store) == 0 and store.episodes(include_open=True).num_rows == 0, "the shared store was not emptied"
