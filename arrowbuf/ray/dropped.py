"""`DroppedWriters`: the deliveries of writers dropped without `flush` or `close`.

A writer dropped without `flush` or `close` cuts its open episodes into its sink
(`arrowbuf.ray.sink.RaySink.dropped`), which delivers them on a daemon thread of its own: a
finalizer never waits for a shard. What that delivery fails to store is logged as an error
when it happens, and raised by the next `flush`, `save` or `close` of the store that made
the writer (its router `wait`s here).
"""

from __future__ import annotations

import logging
import threading
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
