"""The kinds of host column a shard's arena holds, how each is made and read as stored.

- a fixed-shape field: a numpy array of ``rows`` rows, aligned (`arena_column`);
- an encoded field (``codec=``): `arrowbuf.encoded.EncodedColumn`, stored as `EncodedRows`;
- a ragged field (``(None, ...)``): `arrowbuf.ragged.RaggedColumn`, stored as `RaggedRows`;
- a text field (``"string"``): `arrowbuf.text.TextColumn`, stored as an Arrow dictionary array.

The encoded and ragged kinds are heap columns (`arrowbuf.byte_heap.HeapColumn`). A torch arena keeps
its own (`arrowbuf.arena`); a dataset maps its columns from its cache (`arrowbuf.dataset`), its
encoded and ragged fields as the same kinds over a mapped file (`mapped_column`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from arrowbuf.byte_heap import HeapColumn
from arrowbuf.encoded import EncodedColumn, EncodedRows
from arrowbuf.ragged import RaggedColumn
from arrowbuf.text import TextColumn

#: Alignment of arena columns: a gather copies each row between equally aligned
#: addresses (pooled outputs start on 64-byte lines). Rows of a multiple of 64 bytes
#: copied 16 bytes out of line (numpy puts a large array 16 bytes past a page) took
#: 25-40% longer here: VLA's 147 KB pixel rows, 10.0 vs 7.9 ms per 640 rows (p25).
COLUMN_ALIGN = 64


def arena_column(shape: tuple[int, ...], dtype: np.dtype, zero: bool = False) -> np.ndarray:
    """An uninitialized (or zeroed) array starting on a `COLUMN_ALIGN` boundary; its
    pages are faulted in by the first write, as ``np.empty``'s and ``np.zeros``' are."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (np.zeros if zero else np.empty)(nbytes + COLUMN_ALIGN, np.uint8)
    start = -raw.ctypes.data % COLUMN_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def host_column(spec: Any, rows: int, zero: bool) -> Any:
    """A column of ``rows`` rows for field ``spec``, of its kind (zeroed when ``zero``: heap
    columns' rows start empty)."""
    if spec.codec is not None:
        return EncodedColumn(spec.encoder, rows, spec.numpy_dtype)
    if spec.ragged:
        return RaggedColumn(rows, spec.numpy_dtype, spec.shape[1:])
    if spec.text:
        return TextColumn(rows)
    return arena_column((rows, *spec.shape), spec.numpy_dtype, zero=zero)


#: The kinds whose rows are not a numpy column's (`stored_rows` reads them as stored).
APART = (HeapColumn, TextColumn)


def mapped_column(spec: Any, name: str, refs: np.ndarray, heap: Any) -> Any:
    """The read-only column of an encoded or ragged field ``name`` whose rows lie in ``heap`` at
    ``refs`` (each row's offset and size): a dataset cache's (`arrowbuf._dataset_heaps`), of its kind."""
    mapped = (refs, heap)
    if spec.codec is not None:
        return EncodedColumn(spec.encoder, len(refs), spec.numpy_dtype, mapped, name)
    return RaggedColumn(len(refs), spec.numpy_dtype, spec.shape[1:], mapped, name)


def stored_rows(column: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of a column of `APART` as stored, what exports, checkpoints and Ray
    blocks hold: an encoded column's bytes (`EncodedRows`), a ragged column's values and offsets
    (`arrowbuf.ragged.RaggedRows`), a text column's codes and strings (a dictionary array); copies."""
    if type(column) is TextColumn:
        return column.stored(start, stop)
    if type(column) is EncodedColumn:
        return EncodedRows(column.encoded(start, stop), column.codec)
    return column[start:stop]
