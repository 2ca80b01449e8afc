"""`ByteHeap`: variable-length byte rows kept in chunks, for columns whose rows vary in size.

An encoded image is a few KB to tens of KB, never the same twice. The heap appends
each row's bytes at the end of its current chunk (4 MiB, or one chunk of its own for
a larger row) and names it by an address: ``chunk << 32 | offset``. A row that is
overwritten is *released*: its chunk's live byte count drops, and a chunk with no
live bytes left (and not the one being filled) is freed. A ring overwrites its
rows oldest first, so its oldest chunks empty and go: the heap's memory follows the
bytes held, not the most it ever held. When rows that are kept for long pin chunks
whose other rows are gone (``allocated > 1.25 x live`` + two chunks:
`needs_compaction`), the column that owns the heap moves the rows of the sparsest
chunks (`sparse_chunks`) into new ones, a chunk at a time: each is freed as its last
row leaves, so the move holds at most a chunk more than the heap held before it.

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

from typing import Any, Callable, Sequence

import numpy as np

from arrowbuf.errors import CapacityError

#: Bytes of a chunk (a row larger than this gets a chunk of its own).
CHUNK_BYTES = 4 << 20
_SHIFT = 32
#: A heap needs compacting past ``COMPACT_AT x live`` + two chunks allocated (below IMAGES'
#: 1.3 private memory / encoded bytes), and a compaction moves rows until ``COMPACT_TO x live``
#: + a chunk would be left: the gap between them is written before the next one.
COMPACT_AT, COMPACT_TO = 1.25, 1.1


class ByteHeap:
    """Rows of bytes in chunks: `append`, `view`, `release`; ``live`` and ``allocated`` bytes."""

    def __init__(self, chunk_bytes: int | None = None) -> None:
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else CHUNK_BYTES
        self._chunks: dict[int, np.ndarray] = {}
        self._buffers: dict[int, memoryview] = {}   # a memoryview of each chunk (`pieces`)
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
        self._buffers[chunk] = memoryview(self._chunks[chunk])
        self._live[chunk] = 0
        self.allocated += len(self._chunks[chunk])
        self._current, self._used = chunk, 0

    def _free(self, chunk: int) -> None:
        self.allocated -= len(self._chunks.pop(chunk))
        del self._live[chunk], self._buffers[chunk]

    def view(self, addr: int, size: int) -> np.ndarray:
        """The bytes of the row at ``addr`` (a view: valid until the row is released)."""
        at = addr & 0xFFFFFFFF
        return self._chunks[addr >> _SHIFT][at:at + size]

    def views(self, addr: np.ndarray, size: np.ndarray) -> list:
        """`view` of each row (``addr``, ``size``: int64 arrays; b"" for a row of size 0)."""
        # Chunk and bounds split in numpy, then one slice a row: a `view` call a row took 2x as long.
        chunks, start = self._chunks, addr & 0xFFFFFFFF
        return [chunks[c][a:b] if a < b else b"" for c, a, b in
                zip((addr >> _SHIFT).tolist(), start.tolist(), (start + size).tolist())]

    def pieces(self, addr: np.ndarray, size: np.ndarray) -> list[memoryview]:
        """The bytes of each row of ``addr``, ``size`` (int64 arrays) that holds any, as memoryviews
        (valid until the row is released): what `HeapColumn.packed` joins. A memoryview slice
        costs about 2/3 of a numpy view's (~0.18 us a row against ~0.27)."""
        held = size > 0
        if not held.all():
            addr, size = addr[held], size[held]
        buffers, start = self._buffers, addr & 0xFFFFFFFF
        return [buffers[c][a:b] for c, a, b in zip((addr >> _SHIFT).tolist(), start.tolist(), (start + size).tolist())]

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
        return self.allocated > COMPACT_AT * self.live + 2 * self.chunk_bytes

    def sparse_chunks(self) -> list[int]:
        """The chunks whose rows a compaction moves: the sparsest first (the most bytes freed
        for the fewest copied) until moving them would leave ``COMPACT_TO x live`` + a chunk
        allocated; never the chunk being filled."""
        target = COMPACT_TO * self.live + self.chunk_bytes
        allocated, chosen = self.allocated, []
        for chunk in sorted((c for c in self._chunks if c != self._current),
                            key=lambda c: self._live[c] / len(self._chunks[c])):
            if allocated <= target:
                break
            allocated -= len(self._chunks[chunk]) - self._live[chunk]
            chosen.append(chunk)
        return chosen

    def clear(self) -> None:
        """Drop every chunk."""
        self.__init__(self.chunk_bytes)


class HeapColumn:
    """A column of ``rows`` variable-length rows in a `ByteHeap`: each row's address and size
    (16 bytes a row), written by `store`, read by `blobs` and `packed`. Subclasses say what a
    row's bytes are (`arrowbuf.encoded.EncodedColumn`: an encoded row; `arrowbuf.ragged.RaggedColumn`:
    a sequence's values). A row of size 0 holds nothing (never written, zeroed, or evicted).

    ``mapped``: (``refs``, heap) of rows already stored elsewhere, read-only: a dataset cache's
    (`arrowbuf._dataset_heaps`): ``refs`` ``[rows, 2]`` holds each row's (offset, size) in the
    heap, whose ``view`` reads them (`arrowbuf._dataset_heaps.MappedHeap`).
    """

    def __init__(self, rows: int, mapped: tuple[np.ndarray, Any] | None = None, name: str = "") -> None:
        if mapped is None:
            # np.zeros: pages the kernel gives zeroed on first touch; memory grows with the rows written.
            self.addr = np.zeros(rows, np.int64)
            self.size = np.zeros(rows, np.int64)
            self.heap: Any = ByteHeap()
        else:   # read-only rows of a dataset cache: (offset, size) per row, and the mapped file they lie in
            refs, self.heap = mapped
            self.addr, self.size = refs[:, 0], refs[:, 1]
        self.name = name   # the field's, for errors (a shard's: set by `bind_heap_columns`)
        self.budget: int | None = None   # bytes held at most (`bound`)
        self.bytes_word = "bytes"   # what a row's bytes are, for errors ("bytes of values", "bytes encoded")
        self._make_room: Any = None

    def __len__(self) -> int:
        return len(self.addr)

    @property
    def nbytes(self) -> int:
        """Bytes held: the heap's chunks, and 16 a row of addresses."""
        return self.heap.allocated + self.addr.nbytes + self.size.nbytes

    def bound(self, budget: int, make_room: Callable[["HeapColumn", int], None] | None = None) -> None:
        """Hold at most ``budget`` bytes: before rows are stored, ``make_room(self, nbytes)``
        (None: the one given before) evicts the oldest until their ``nbytes`` fit; a smaller
        budget evicts the oldest now until what is held fits."""
        self.budget, self._make_room = budget, make_room or self._make_room
        self._make_room(self, 0)

    def rows_of(self, key: Any) -> np.ndarray:
        """The rows (int64) a key names: a slice, an index or an index array (negative from the end)."""
        if isinstance(key, slice):
            return np.arange(*key.indices(len(self)), dtype=np.int64)
        rows = np.asarray(key, np.int64).reshape(-1)
        return np.where(rows < 0, rows + len(self), rows)

    def store(self, rows: np.ndarray, blobs: Sequence) -> None:
        """Make ``blobs[i]`` (bytes, or any buffer) the bytes of row ``rows[i]``; the last write of
        a row given twice wins, as numpy's assignment."""
        if len(np.unique(rows)) != len(rows):
            last = {row: i for i, row in enumerate(rows.tolist())}
            keep = sorted(last.values())
            rows, blobs = rows[keep], [blobs[i] for i in keep]
        self.heap.release(self.addr[rows], self.size[rows])
        self.size[rows] = 0
        if self.budget is not None:
            self._make_room(self, sum(len(b) for b in blobs))
        addr, size = self.heap.append(blobs)
        self.addr[rows], self.size[rows] = addr, size
        if self.heap.needs_compaction():
            self._compact()

    def release_spans(self, first: np.ndarray, rows: np.ndarray) -> None:
        """The rows of spans ``[first, first + rows)`` hold nothing any more (evicted)."""
        if not len(first):
            return
        ends = np.cumsum(rows)
        index = np.repeat(np.asarray(first, np.int64) - (ends - rows), rows) + np.arange(int(ends[-1]))
        self.heap.release(self.addr[index], self.size[index])
        self.size[index] = 0

    def _compact(self) -> None:
        """Move the rows of the heap's sparsest chunks (`ByteHeap.sparse_chunks`) into new
        chunks, a chunk at a time: each old chunk is freed once its rows are copied out, so
        memory peaks a chunk above what the heap held, never at twice the live bytes."""
        chunks = self.heap.sparse_chunks()
        if not chunks:
            return
        held = np.flatnonzero(self.size)
        chunk_of = self.addr[held] >> _SHIFT
        order = np.argsort(chunk_of, kind="stable")
        held, chunk_of = held[order], chunk_of[order]
        for chunk in chunks:
            lo, hi = np.searchsorted(chunk_of, [chunk, chunk + 1]).tolist()
            rows = held[lo:hi]
            addr, size = self.addr[rows], self.size[rows]
            self.addr[rows] = self.heap.append(self.blobs(rows))[0]   # copies of views of the old chunk
            self.heap.release(addr, size)   # its last rows: the old chunk is freed

    def blobs(self, rows: np.ndarray) -> list:
        """The bytes of each of ``rows`` (views valid until the row is written; b"" for an empty row)."""
        return self.heap.views(self.addr[rows], self.size[rows])

    def packed(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the bytes of ``rows`` one after another, uint8; their byte offsets, int64 [len(rows) + 1])."""
        addr, size = self.addr[rows], self.size[rows]
        # First: a mapped heap checks each row's size before it is allocated.
        blobs = self.heap.pieces(addr, size) if isinstance(self.heap, ByteHeap) else self.heap.views(addr, size)
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(size, out=offsets[1:])
        # One copy, joined in C (a numpy slice assignment a row took 2.5x as long for 256 rows of ~3 KB).
        values = np.frombuffer(bytearray().join(blobs), np.uint8)
        return values, offsets


def check_bounded_mode(fields: dict, mode: str) -> None:
    """Raises ValueError for fields with ``max_bytes`` in a store of ``mode`` other than "circular"
    (checked by each shard, and by a Ray store before it starts its shards)."""
    bounded = [name for name, f in fields.items() if f.max_bytes is not None]
    if bounded and mode != "circular":
        raise ValueError(f"fields {bounded} have max_bytes, which evicts the oldest episodes to stay within it; "
                         f"a mode={mode!r} store never evicts: use mode='circular', or no max_bytes")


def bind_heap_columns(arena: dict, fields: dict, share: tuple[int, int], free_oldest: Callable[[float], bool],
                      mode: str = "circular") -> Callable[[np.ndarray, np.ndarray], None] | None:
    """Set up a shard's heap columns: each named (for its errors) and bounded by its share of
    its field's ``max_bytes`` (`share_budgets`; a write evicts the oldest, ``free_oldest(the
    fraction of the bytes held that must go)``: `arrowbuf.placement.Ring.free_oldest`, until its
    rows fit or nothing is left to evict; the writes check first that they can fit:
    `check_budget`). Returns the hook its ring calls with the spans it evicts (their bytes go
    back: memory follows the rows held); None without heap columns.

    Raises:
        ValueError: ``max_bytes`` in a ``mode="fixed"`` store, which never evicts.
    """
    check_bounded_mode(fields, mode)
    columns = {name: column for name, column in arena.items() if isinstance(column, HeapColumn)}
    if not columns:
        return None

    def make_room(column: HeapColumn, nbytes: int) -> None:
        while column.heap.live + nbytes > column.budget:
            if not free_oldest((column.heap.live + nbytes - column.budget) / max(column.heap.live, 1)):
                break

    for name, column in columns.items():
        column.name = name
    share_budgets(arena, fields, *share, make_room)

    def released(first: np.ndarray, rows: np.ndarray) -> None:
        for column in columns.values():
            column.release_spans(first, rows)

    return released


def check_budget(column: HeapColumn, nbytes: int, pinned: np.ndarray, what: str, max_bytes: int,
                 fix: str = "raise max_bytes or cut the episode") -> None:
    """Raise `CapacityError` when a write of ``nbytes`` into ``column`` (bounded: its field's
    ``max_bytes`` or a shard's part of it) cannot fit in its budget beside the bytes of rows
    ``pinned``, which no eviction frees (`arrowbuf.placement.Ring.pinned_rows`): before anything
    is evicted for it (which made room by evicting everything, then held it over the budget)."""
    held = int(column.size[pinned].sum()) if len(pinned) else 0
    if nbytes + held > column.budget:
        beside = f" beside the {held:,} bytes of the open episodes' last observations" if held else ""
        raise CapacityError(f"field {column.name!r}: {what} {nbytes:,} {column.bytes_word}, more than the "
                            f"{column.budget:,} bytes "
                            f"its max_bytes={max_bytes:,} gives this {'shard' if column.budget != max_bytes else 'store'}"
                            f"{beside}; {fix}")


def share_budgets(arena: dict, fields: dict, capacity: int, total: int,
                  make_room: Callable[[HeapColumn, int], None] | None = None) -> None:
    """Bound each heap column of a field with ``max_bytes`` by the shard's part of it, as its
    ``capacity`` is of the store's ``total`` (a Ray shard's capacity share, `arrowbuf.ray.shares`:
    bytes follow the transitions a shard holds); a smaller budget evicts the oldest now.
    ``make_room``: the eviction of a column not bound yet (`bind_heap_columns`)."""
    for name, column in arena.items():
        if isinstance(column, HeapColumn) and fields[name].max_bytes is not None:
            column.bound(budget_part(fields[name].max_bytes, capacity, total), make_room)


def budget_part(max_bytes: int, capacity: int, total: int) -> int:
    """A shard's part of a field's ``max_bytes``: as its ``capacity`` is of the store's ``total``."""
    return max_bytes * capacity // max(total, 1)
