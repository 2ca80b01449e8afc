"""What the episode table keeps beside its columns, a type each: the index -> episode map
(`IndexMap`), the queue of the longest live episodes (`LongestQueue`) and the pieces an episode
may go on from (`Tips`). Each takes one episode at a time (`arrowbuf.table.EpisodeTable.append`)
or many in order (`EpisodeTable.append_many`: a writer's flush, `add_episodes`) with the same result.
"""

from __future__ import annotations

from collections import deque

import numpy as np

#: Pieces remembered per env after they leave the table: the piece that continues one finds its episode's id.
TIPS_PER_ENV = 64


class IndexMap:
    """index % size -> serial of its episode (mod 2**32), for a table of at most ``capacity``
    live transitions: live indices span at most ``capacity`` <= size values, so live entries
    never collide. The size is a power of two, so that the residue is a bitwise and: numpy's
    int64 ``%`` cost 2.7 us of a 256-index lookup and 190 us of a 98,304-index one here (``&``:
    0.7 and 20 us), for at most 4 more bytes a row."""

    def __init__(self, capacity: int) -> None:
        size = 1 << (capacity - 1).bit_length()
        self.serials = np.zeros(size, np.uint32)
        self.mask = size - 1

    def put(self, first_index: int, length: int, serial: int) -> None:
        """Indices ``[first_index, first_index + length)`` are episode ``serial``'s."""
        start = first_index & self.mask
        if start + length <= len(self.serials):
            self.serials[start:start + length] = serial & 0xFFFFFFFF
        else:
            self.put_runs(first_index, np.array([length]), np.array([serial]))

    def put_runs(self, first_index: int, lengths: np.ndarray, serials: np.ndarray) -> None:
        """Consecutive runs of indices from ``first_index`` on, ``lengths[k]`` of them episode
        ``serials[k]``'s (only the newest map size of them: the older share their slots)."""
        total = int(np.sum(lengths))
        keep = min(total, len(self.serials))
        if keep:
            index = np.arange(first_index + total - keep, first_index + total, dtype=np.int64)
            owners = np.repeat((np.asarray(serials, np.int64) & 0xFFFFFFFF).astype(np.uint32), lengths)
            self.serials[index & self.mask] = owners[total - keep:]

    def serials_of(self, units: np.ndarray) -> np.ndarray:
        """The serials (mod 2**32, uint32) of the episodes holding live indices ``units``. A mask,
        not take(mode="wrap"): numpy wraps by repeated subtraction, which grows with index / size
        (a store that ran long would sample ever slower)."""
        return self.serials.take(units & self.mask)


class LongestQueue:
    """(serial, length) of the live episodes that no younger episode outlasts, in decreasing
    length: its front is the longest live episode, kept in O(1) amortized per append and evict
    (a monotonic queue)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, int]] = deque()

    @property
    def longest(self) -> int:
        return self._queue[0][1] if self._queue else 0

    def push(self, serial: int, length: int) -> None:
        queue = self._queue
        if not queue or queue[-1][1] > length:   # the common case: nothing it outlasts
            queue.append((serial, length))
            return
        while queue and queue[-1][1] <= length:
            queue.pop()
        queue.append((serial, length))

    def push_many(self, serials: np.ndarray, lengths: np.ndarray) -> None:
        """`push` of each, in order: what survives is the older entries longer than all of them,
        then each that is longer than every one after it."""
        if not len(lengths):
            return
        queue, top = self._queue, int(lengths.max())
        while queue and queue[-1][1] <= top:
            queue.pop()
        later = np.append(np.maximum.accumulate(lengths[::-1])[::-1][1:], -1)   # the longest after each
        queue.extend(zip(serials[lengths > later].tolist(), lengths[lengths > later].tolist()))

    def drop_before(self, first_serial: int) -> None:
        """The episodes before serial ``first_serial`` left."""
        while self._queue and self._queue[0][0] < first_serial:
            self._queue.popleft()

    def clear(self) -> None:
        self._queue.clear()


class Tips:
    """env code -> {serial: episode id} of the newest pieces that an episode may go on from (not
    terminated or truncated): the id a continuing piece takes once its previous one left."""

    def __init__(self) -> None:
        self._by_env: dict[int, dict[int, int]] = {}

    def get(self, code: int, prev_piece: int) -> int:
        """The episode id of piece ``prev_piece`` of env ``code``; -1 when not remembered."""
        return self._by_env.get(code, {}).get(prev_piece, -1)

    def note(self, code: int, prev_piece: int, serial: int, episode: int, ended: bool) -> None:
        """The piece ``serial`` of env ``code`` may be continued (unless ``ended``); the one it
        continues no longer will be."""
        tips = self._by_env.setdefault(code, {})
        tips.pop(prev_piece, None)
        if not ended:
            tips[serial] = episode
            if len(tips) > TIPS_PER_ENV:
                del tips[next(iter(tips))]

    def clear(self) -> None:
        self._by_env = {}
