"""`OwnedLock`: a reentrant lock that knows whether the calling thread holds it (each
`ShardEngine`'s lock, `arrowbuf.engine`)."""

from __future__ import annotations

import threading
from typing import Callable


class OwnedLock:
    """A reentrant lock that records which thread holds it: `held_here` tells a caller that may
    run inside one of this thread's calls (a writer's finalizer, `arrowbuf.inplace`) not to wait
    for it, and `defer` runs its work once that call lets the lock go. Usable with
    `threading.Condition` (it releases and restores every level in `wait`)."""

    __slots__ = ("_lock", "_owner", "_depth", "_deferred")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None   # written only by the thread that holds `_lock`
        self._depth = 0
        self._deferred: list[Callable[[], None]] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    __enter__ = acquire

    def release(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()
        while self._deferred and not self._depth:   # the outermost release: deferred work, outside the lock
            try:
                work = self._deferred.pop(0)
            except IndexError:   # another thread took the last one
                return
            work()

    def defer(self, work: Callable[[], None]) -> None:
        """Run ``work`` (which takes the lock itself) when the lock is next released by its
        outermost holder: for work that must not run inside the holder's call."""
        self._deferred.append(work)

    def __exit__(self, *exc: object) -> None:
        self.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock (another thread only ever sees its own id here
        while it holds it)."""
        return self._owner == threading.get_ident()

    # `threading.Condition` uses these when the lock has them: `wait` gives up every level.
    _is_owned = held_here

    def _release_save(self) -> int:
        depth, self._depth, self._owner = self._depth, 0, None
        for _ in range(depth):
            self._lock.release()
        return depth

    def _acquire_restore(self, depth: int) -> None:
        for _ in range(depth):
            self._lock.acquire()
        self._owner, self._depth = threading.get_ident(), depth
