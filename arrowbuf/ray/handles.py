"""The handles of a Ray store's shard actors, and the sizes the shards last reported.

`ShardHandles` sends calls (each in its concurrency group, see `actor`), turns a
dead actor into `ShardError` (or skips it with ``allow_partial``), hands an error a
shard raised to the caller as it was raised (`unwrapped`: the arrowbuf error, its
message first, not Ray's wrapper) and pickles into any process. `SizeCache` keeps
each shard's last reported size: writes' acknowledgements and samples carry one,
and a background request refreshes it, so that `len(store)` never waits on a shard.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from arrowbuf.errors import ShardError
from arrowbuf.ray.options import RayOptions, ray_module

# With a rate limiter, shard actors are threaded: calls that may wait for it run
# in their own concurrency group of one thread each, so a sample waiting for
# inserts never holds the thread an insert needs (and the reverse), and writes
# keep their order; other calls run in the default group and never wait.
# Without one nothing waits, and shards stay single-threaded (one call at a
# time, no thread hand-off per call).
GROUPS = {"add_episodes": "write", "select": "sample"}
CONCURRENCY_GROUPS = {"write": 1, "sample": 1}
DEFAULT_CONCURRENCY = 4


def unwrapped(err: BaseException) -> BaseException:
    """The error a shard actor (or a task) raised, out of Ray's ``RayTaskError`` ``err``: the
    same type with its own message (``str``), where Ray's wrapper says the remote traceback
    first (13 lines for a rate limiter's `RateLimited`); that traceback is kept as its
    ``__cause__``. Any other error is returned as it is."""
    import ray   # only called where Ray runs

    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else None
    if not isinstance(cause, Exception):
        return err
    cause.__cause__ = err
    return cause


@dataclass
class ShardHandles:
    """Handles of a store's shard actors and what is known of them (picklable)."""

    name: str
    handles: list
    nodes: list[str]
    options: RayOptions
    threaded: bool = False                  # started with the concurrency groups above
    dead: set[int] = field(default_factory=set)
    closed: bool = False
    # Ray worker id of the process that started the actors: they die with it, so an
    # object it puts lives as long as they do (its writers lend their episodes as blocks).
    owner: str | None = None
    durable: bool = False                   # the shards hold durable directories (locked until `close`)

    def started_here(self) -> bool:
        """Whether this process started the shard actors (it owns them)."""
        return self.owner is not None and self.owner == ray_module().get_runtime_context().get_worker_id()

    @property
    def num_shards(self) -> int:
        return len(self.handles)

    def call(self, shard: int, method: str, *args: Any) -> Any:
        """Send ``method(*args)`` to ``shard``: its ObjectRef.

        Raises:
            ShardError: the store is closed, or the shard is known dead (without ``allow_partial``).
        """
        self.check_open()
        if shard in self.dead and not self.options.allow_partial:
            raise self.dead_error()
        remote = getattr(self.handles[shard], method)
        group = GROUPS.get(method) if self.threaded else None
        return (remote.options(concurrency_group=group) if group else remote).remote(*args)

    def call_each(self, method: str, calls: list[Mapping[int, tuple]]) -> list[dict[int, Any]]:
        """`call` ``method`` with each ``{shard: args}`` of ``calls``, in order: their ObjectRefs."""
        return [{shard: self.call(shard, method, *args) for shard, args in each.items()} for each in calls]

    def get(self, refs: Mapping[int, Any]) -> dict[int, Any]:
        """Results of ``{shard: ref}``; a dead shard raises `ShardError` (or is skipped if allowed)."""
        import ray   # refs exist only where Ray runs: no install hint (ray_module) on this per-call path

        results = {}
        pending = list(refs.items())
        try:
            while pending:
                shard, ref = pending.pop(0)
                try:
                    results[shard] = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self.dead.add(shard)
                    if not self.options.allow_partial:
                        raise ShardError(f"shard {shard} of store {self.name!r} is dead: {err}") from None
                except ray.exceptions.RayTaskError as err:
                    raise unwrapped(err) from err
        finally:
            # The first error is raised; the other shards' answers are taken too, else Ray
            # prints each error it holds as an "Unhandled error" once its ref is dropped.
            for _, ref in pending:
                try:
                    ray.get(ref)
                except Exception:   # noqa: BLE001 - the first error is the one raised
                    pass
        return results

    def live(self) -> list[int]:
        """Shards to use: all of them, or the survivors with ``allow_partial``
        (else a dead one raises `ShardError` at every call, not only the first)."""
        self.check_open()
        if self.dead and not self.options.allow_partial:
            raise self.dead_error()
        return [s for s in range(len(self.handles)) if s not in self.dead]

    def check_open(self) -> None:
        """Raises `ShardError` when the store is closed, or Ray was shut down (never starting it again)."""
        if self.closed:
            raise ShardError(f"store {self.name!r} is closed (its shard actors are gone)")
        import ray   # handles exist only where Ray runs: no install hint (ray_module) on this per-call path

        if not ray.is_initialized():
            raise ShardError(f"Ray was shut down (ray.shutdown()) before store {self.name!r} was closed: its shard "
                             "actors ended with the cluster, and with them its data. arrowbuf does not start Ray "
                             "again; close stores (store.close()) before ray.shutdown()")

    def dead_error(self) -> ShardError:
        dead = sorted(self.dead)
        return ShardError(f"shard{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} of store {self.name!r} "
                          f"{'are' if len(dead) > 1 else 'is'} dead; RayOptions(allow_partial=True) serves from the "
                          "others")

    def broadcast(self, method: str, *args: Any) -> dict[int, Any]:
        return self.get({s: self.call(s, method, *args) for s in self.live()})


class SizeCache:
    """(mass, transitions, episodes) of every shard, as the shards last reported them.

    Each report carries the shard's clock at the time it was read (under the
    engine's lock), so a late answer never overwrites a newer one. `poll`
    collects a background size request if it has come back and sends the next
    one once the last reading is older than ``RayOptions.size_refresh``; it
    never waits.
    """

    def __init__(self, shards: ShardHandles) -> None:
        self._shards = shards
        n = shards.num_shards
        self.masses = np.zeros(n)
        self.transitions = np.zeros(n, np.int64)
        self.episodes = np.zeros(n, np.int64)
        self._stamps = np.full(n, -np.inf)
        self._pending: dict[int, Any] = {}
        self._asked = -np.inf
        self._lock = threading.RLock()

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "_pending": {}}   # refs of this process's requests stay here
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        for name in ("masses", "transitions", "episodes", "_stamps"):
            setattr(self, name, getattr(self, name).copy())   # read-only when it came through the object store

    def note(self, shard: int, reading: tuple[float, int, int, float]) -> None:
        """Keep a shard's reading (mass, transitions, episodes, shard clock) unless a newer one is kept."""
        mass, transitions, episodes, stamp = reading
        with self._lock:   # writers' timer threads note their acknowledgements too
            if stamp < self._stamps[shard]:
                return
            self.masses[shard], self.transitions[shard], self.episodes[shard] = mass, transitions, episodes
            self._stamps[shard] = stamp

    def note_all(self, readings: Mapping[int, tuple[float, int, int, float]]) -> None:
        """`note` each ``{shard: reading}``."""
        for shard, reading in readings.items():
            self.note(shard, reading)

    def refresh(self) -> None:
        """Ask every live shard now and wait for the answers."""
        with self._lock:
            self._pending = {}
            for shard, reading in self._shards.broadcast("size").items():
                self.note(shard, reading)
            self._asked = time.monotonic()

    def poll(self) -> None:
        """Collect the background request's answers that came; send another if they are stale."""
        ray = ray_module()
        with self._lock:
            if self._pending:
                ready, _ = ray.wait(list(self._pending.values()), num_returns=len(self._pending), timeout=0)
                if len(ready) == len(self._pending):
                    pending, self._pending = self._pending, {}
                    for shard, reading in self._shards.get(pending).items():
                        self.note(shard, reading)
            if not self._pending and time.monotonic() - self._asked >= self._shards.options.size_refresh:
                self._pending = {s: self._shards.call(s, "size") for s in self._shards.live()}
                self._asked = time.monotonic()

    def totals(self) -> tuple[int, int]:
        """(transitions, episodes) of the live shards, as last reported."""
        live = self._shards.live()
        with self._lock:
            return int(self.transitions[live].sum()), int(self.episodes[live].sum())
