"""`HeapColumn` compaction: rows that pin chunks are moved a chunk at a time, every row keeps its
bytes, and memory stays within bounds counted in bytes (never timed)."""

from __future__ import annotations

import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from arrowbuf.byte_heap import COMPACT_AT, ByteHeap, HeapColumn

CHUNK = 16 << 10


def column_with_chunks(rows: int) -> HeapColumn:
    column = HeapColumn(rows)
    column.heap = ByteHeap(CHUNK)   # small chunks: many of them pinned
    return column


def assert_rows_kept(column: HeapColumn, model: dict[int, bytes]) -> None:
    for row in range(len(column)):
        assert bytes(column.blobs(np.array([row]))[0]) == model.get(row, b""), f"row {row}"
    rows = np.random.default_rng(len(model)).integers(0, len(column), 2 * len(column))   # repeats, empty rows
    values, offsets = column.packed(rows)   # joined from the heap's memoryviews (`ByteHeap.pieces`)
    assert values.tobytes() == b"".join(model.get(row, b"") for row in rows.tolist())
    assert np.diff(offsets).tolist() == [len(model.get(row, b"")) for row in rows.tolist()]
    assert column.heap.live == int(column.size.sum()) == sum(len(b) for b in model.values())


def test_a_store_whose_long_lived_rows_pin_chunks_compacts_a_chunk_at_a_time_and_keeps_every_row():
    # Writes of 8 rows: 7 to a ring of 350 short-lived rows, 1 to a ring of 500 rows that laps 10x
    # slower. Each chunk keeps an eighth of its rows long after the rest are overwritten.
    short, long = 350, 500
    column = column_with_chunks(short + long)
    rng = np.random.default_rng(0)
    model: dict[int, bytes] = {}
    most_allocated = most_over = 0
    tracemalloc.start()
    try:
        for b in range(1200):
            rows = np.r_[(7 * b + np.arange(7)) % short, short + b % long].astype(np.int64)
            blobs = [rng.integers(0, 256, int(n), np.uint8).tobytes() for n in rng.integers(1000, 2000, 8)]
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            column.store(rows, blobs)
            # What a store holds beyond what was there: its rows, the chunk being filled, a chunk
            # being moved into, and index arrays; the copy of every live row it once made would be
            # ~1 MiB here.
            if b >= 10:   # past first calls' one-off allocations (numpy's own)
                most_over = max(most_over, tracemalloc.get_traced_memory()[1] - before)
            model.update(zip(rows.tolist(), blobs))
            heap = column.heap
            most_allocated = max(most_allocated, heap.allocated)
            assert heap.allocated <= COMPACT_AT * heap.live + 2 * CHUNK
    finally:
        tracemalloc.stop()
    assert_rows_kept(column, model)
    live = column.heap.live
    assert live > 60 * CHUNK
    # Without compaction the pinned chunks would hold ~3x the live bytes (the long ring's lap).
    assert most_allocated <= COMPACT_AT * live * 1.05 + 3 * CHUNK
    assert most_over <= 4 * CHUNK


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 63), min_size=1, max_size=12),
                          st.integers(0, 3000)), min_size=1, max_size=60))
def test_compaction_keeps_every_row_s_bytes_whatever_is_written_and_evicted(operations):
    column = column_with_chunks(64)
    model: dict[int, bytes] = {}
    rng = np.random.default_rng(1)
    for evict, rows, size in operations:
        if evict:   # a span of rows evicted
            first, count = min(rows), len(rows)
            count = min(count, 64 - first)
            column.release_spans(np.array([first]), np.array([count]))
            for row in range(first, first + count):
                model.pop(row, None)
        else:
            blobs = [rng.integers(0, 256, int(rng.integers(0, size + 1)), np.uint8).tobytes() for _ in rows]
            column.store(np.array(rows, np.int64), blobs)
            model.update((row, blob) for row, blob in zip(rows, blobs))   # the last write of a row wins
            model = {row: blob for row, blob in model.items() if blob}
            heap = column.heap
            assert heap.allocated <= COMPACT_AT * heap.live + 2 * CHUNK + max(size, CHUNK)
        assert_rows_kept(column, model)
