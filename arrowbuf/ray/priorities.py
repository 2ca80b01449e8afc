"""`PriorityUpdates`: a Ray store's priority updates, waited for or left in flight.

``update_priorities(..., wait=False)`` sends each shard its part of the update
and returns at once: an off-policy learner then pays no round trip per step
(the actor call's answer is the count of live indices, which it rarely needs).
What is left in flight is still accounted for:

- Order: Ray runs the calls one process makes to an actor in the order it made
  them, so a shard applies an update before any later sample of this process
  draws from it. (A shard with a rate limiter serves calls on several threads:
  there a sample sent right after an update may be served before it.)
- Errors are never dropped: an update's error (a shard that died) is raised by
  this store's next `update_priorities`, `sample`, `flush` or `close` in this
  process, once.
- Bound: at most ``RayOptions.max_in_flight`` updates per shard are unanswered;
  the next one waits for the oldest.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

from arrowbuf.ray.handles import ShardHandles, SizeCache
from arrowbuf.ray.options import INDEX_SHIFT, LOCAL_MASK, ray_module


class PriorityUpdates:
    """The priority updates this process sends to a store's shards (see the module docstring)."""

    def __init__(self, shards: ShardHandles, sizes: SizeCache) -> None:
        self._shards = shards
        self._sizes = sizes
        self._in_flight: dict[int, deque] = {}   # shard -> refs of its unanswered updates, oldest first
        self._lock = threading.RLock()   # a learner thread may update while another samples

    @property
    def pending(self) -> int:
        """Updates sent and not answered yet."""
        return sum(len(queue) for queue in self._in_flight.values())

    def send(self, index: np.ndarray, priority: np.ndarray, wait: bool) -> int | None:
        """Send each shard its indices' new priorities (checked by the caller): with
        ``wait``, how many were live; else None, the update left in flight.

        Raises:
            ShardError: a shard is dead (this update's, or an earlier one's left in flight).
        """
        with self._lock:
            self.collect(block=False)   # an earlier update's error first
            shards = index >> INDEX_SHIFT
            refs = {}
            for shard in np.unique(shards).tolist():
                if not 0 <= shard < self._shards.num_shards:
                    continue   # no such shard: nothing of it is live
                queue = self._in_flight.setdefault(shard, deque())
                while len(queue) >= self._shards.options.max_in_flight:
                    self._settle(shard, queue.popleft())
                mine = shards == shard
                refs[shard] = self._shards.call(shard, "update_priorities", index[mine] & LOCAL_MASK, priority[mine])
            if not wait:
                for shard, ref in refs.items():
                    self._in_flight[shard].append(ref)
                return None
            return sum(self._settle(shard, ref) for shard, ref in refs.items())

    def collect(self, block: bool) -> None:
        """Take the answers of the updates left in flight: those that came back (all of
        them with ``block``), raising the first error met."""
        if not any(self._in_flight.values()):   # the common case, a store nobody updates without waiting
            return
        ray = ray_module()
        with self._lock:
            for shard, queue in self._in_flight.items():
                while queue:
                    if not block and not ray.wait([queue[0]], timeout=0)[0]:
                        break
                    self._settle(shard, queue.popleft())

    def _settle(self, shard: int, ref: Any) -> int:
        """An update's answer: how many of its indices were live (0 from a dead shard, with
        ``allow_partial``: the rows it named are gone with it)."""
        result = self._shards.get({shard: ref})
        if shard not in result:
            return 0
        count, reading = result[shard]
        self._sizes.note(shard, reading)
        return count
