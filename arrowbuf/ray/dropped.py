"""`DroppedWriters`: the deliveries of writers dropped without `flush` or `close`.

A writer dropped without `flush` or `close` cuts its open episodes into its sink
(`arrowbuf.ray.sink.RaySink.dropped`), which delivers them on a daemon thread of its own: a
finalizer never waits for a shard. What that delivery fails to store is logged as an error
when it happens, and raised by the next `flush`, `save` or `close` of the store that made
the writer (its router `wait`s here).

A process that ends with writers neither flushed nor closed (a script's last line) ships
their steps when it exits (`ship_at_exit`: an ``atexit`` hook, which runs before Ray's own
shutdown hook), as their delivery timer would have. Later, when the interpreter clears
the writers, no thread can start any more: a dropped writer's finalizer then logs what
it could not deliver instead of waiting for ever on a thread that never runs.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import Any

logger = logging.getLogger("arrowbuf.ray.sink")   # the logger named in docs/ray.md, as before this module


class DroppedWriters:
    """Deliveries of the sinks of writers dropped without `flush` or `close`, each on its own
    daemon thread (`RaySink.dropped`): their router waits for them (`wait`) and raises the
    first error one met (which was logged when it happened)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def start(self, sink: Any) -> None:
        """Deliver ``sink``'s episodes (a `arrowbuf.ray.sink.RaySink`: its `close`) on a thread of its own."""
        if sys.is_finalizing():   # a thread started now never runs, and Ray has shut down
            logger.warning("an arrowbuf writer of store %r was still open when the interpreter exited: its steps "
                           "were shipped at exit as open episodes, not ended as flush() ends them; flush() or "
                           "close() writers before the process ends", sink.store_name)
            return
        thread = threading.Thread(target=self._deliver, args=(sink,), name="arrowbuf-dropped-writer", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _deliver(self, sink: Any) -> None:
        queued = sink.queued
        try:
            sink.close()
        except Exception as err:   # logged now, raised by the store's next flush: never dropped
            logger.error("an arrowbuf writer of store %r was dropped without flush() or close(), and storing its "
                         "%d open or queued episodes failed: %s", sink.store_name, queued, err)
            with self._lock:
                self._errors.append(err)

    def wait(self) -> None:
        """Wait until every dropped writer's steps are delivered; raise the first error met."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


_exiting: "weakref.WeakSet[Any]" = weakref.WeakSet()   # the sinks of this process, for `_ship_all`
_hooked = False


def ship_at_exit(sink: Any) -> None:
    """Ship ``sink``'s staged and queued steps (`arrowbuf.ray.sink.RaySink.ship_open`) if it is
    still open when this process exits. The hook is registered with the first sink, made after
    ``ray.init``, so it runs before Ray's shutdown hook (``atexit`` runs the newest first)."""
    global _hooked
    _exiting.add(sink)
    if not _hooked:
        _hooked = True
        atexit.register(_ship_all)


def _ship_all() -> None:
    for sink in list(_exiting):
        sink.ship_if_open()
