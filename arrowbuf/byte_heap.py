"""`ByteHeap`: variable-length byte rows kept in chunks, for columns whose rows vary in size.

An encoded image is a few KB to tens of KB, never the same twice. The heap appends
each row's bytes at the end of its current chunk (4 MiB, or one chunk of its own for
a larger row) and names it by an address: ``chunk << 32 | offset``. A row that is
overwritten is *released*: its chunk's live byte count drops, and a chunk with no
live bytes left (and not the one being filled) is freed. A ring overwrites its
rows oldest first, so its oldest chunks empty and go: the heap's memory follows the
bytes held, not the most it ever held. When rows that are kept for long pin chunks
whose other rows are gone (``allocated > 1.5 x live`` + two chunks), the column
that owns the heap copies its rows into new chunks (`needs_compaction`).

Chunks are ``np.empty`` arrays: the kernel faults a chunk's pages in as rows are
written into it, so the chunk being filled costs only its written part.

Example:
    >>> heap = ByteHeap()
    >>> addr, size = heap.append([b"abc", b"de"])
    >>> bytes(heap.view(int(addr[1]), int(size[1]))), heap.live
    (b'de', 5)
    >>> heap.release(addr[:1], size[:1]); heap.live
    2
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Bytes of a chunk (a row larger than this gets a chunk of its own).
CHUNK_BYTES = 4 << 20
_SHIFT = 32


class ByteHeap:
    """Rows of bytes in chunks: `append`, `view`, `release`; ``live`` and ``allocated`` bytes."""

    def __init__(self, chunk_bytes: int | None = None) -> None:
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else CHUNK_BYTES
        self._chunks: dict[int, np.ndarray] = {}
        self._live: dict[int, int] = {}
        self._current = -1          # the chunk being filled
        self._used = 0              # bytes of it written
        self._next = 0              # the id of the next chunk
        self.live = 0               # bytes of the rows not released
        self.allocated = 0          # bytes of the chunks held

    def append(self, rows: Sequence[bytes | memoryview]) -> tuple[np.ndarray, np.ndarray]:
        """Copy ``rows`` in; returns (address, size) of each, int64 arrays."""
        addr = np.zeros(len(rows), np.int64)
        size = np.zeros(len(rows), np.int64)
        for i, data in enumerate(rows):
            n = len(data)
            size[i] = n
            if not n:
                continue
            if self._current < 0 or self._used + n > len(self._chunks[self._current]):
                self._new_chunk(n)
            chunk, at = self._current, self._used
            self._chunks[chunk][at:at + n] = np.frombuffer(data, np.uint8)
            self._used += n
            self._live[chunk] += n
            addr[i] = chunk << _SHIFT | at
        self.live += int(size.sum())
        return addr, size

    def _new_chunk(self, need: int) -> None:
        if self._current >= 0 and self._live[self._current] == 0:
            self._free(self._current)
        chunk = self._next
        self._next += 1
        self._chunks[chunk] = np.empty(max(self.chunk_bytes, need), np.uint8)
        self._live[chunk] = 0
        self.allocated += len(self._chunks[chunk])
        self._current, self._used = chunk, 0

    def _free(self, chunk: int) -> None:
        self.allocated -= len(self._chunks.pop(chunk))
        del self._live[chunk]

    def view(self, addr: int, size: int) -> np.ndarray:
        """The bytes of the row at ``addr`` (a view: valid until the row is released)."""
        at = addr & 0xFFFFFFFF
        return self._chunks[addr >> _SHIFT][at:at + size]

    def release(self, addr: np.ndarray, size: np.ndarray) -> None:
        """The rows at ``addr`` (of ``size`` bytes; size 0: no row) are no longer held."""
        held = size > 0
        if not held.any():
            return
        chunks, total = np.unique(addr[held] >> _SHIFT, return_inverse=True)
        freed = np.bincount(total, weights=size[held]).astype(np.int64)
        for chunk, n in zip(chunks.tolist(), freed.tolist()):
            self._live[chunk] -= n
            if self._live[chunk] == 0 and chunk != self._current:
                self._free(chunk)
        self.live -= int(freed.sum())

    def needs_compaction(self) -> bool:
        """Whether chunks pinned by a few live rows hold much more than the live bytes."""
        return self.allocated > 1.5 * self.live + 2 * self.chunk_bytes

    def clear(self) -> None:
        """Drop every chunk."""
        self.__init__(self.chunk_bytes)
