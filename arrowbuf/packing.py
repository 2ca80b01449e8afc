"""Row-packed small fields: the per-step scalars and short vectors of a row in one record.

A uniform sample of small rows is bound by cache misses, not by bytes: 256 rows
drawn from a million touch 256 random cache lines *per column*. The per-step fields
that are not observations (action, reward, flags, log-probs, values) are a few
bytes each, so the numpy arena keeps them side by side in one row-major byte
block (``[capacity, row_bytes]``), and a gather reads all of them with one ``take``
of whole records (one or two cache lines a row instead of one a column), then
copies each field out of the gathered records into its own contiguous output.

Measured here (W1: a 1M-row arena, batches of 256; action f32[6], reward f32 and
two flags packed into 32 bytes; `tools/bench.py --only W1`): arrowbuf's sample went
from 0.79x to 0.98x the numpy ideal with packing alone (5 rounds, a loaded
machine), 1.08x with the engine's plain uniform path too (docs/performance.md's full run).

Observations stay columnar: their next value is the adjacent row of the same
column (a take that hits the cache lines the first one loaded), frame stacking
and n-step look-ups read them by row, and they are what Arrow views, Parquet
export and inspection read zero-copy. Each packed field is a strided numpy view of
the block (`column_view`), so the rest of arrowbuf reads and writes it as any
column; Arrow conversions copy it (`arrowbuf.fields.numpy_to_arrow` makes it
contiguous), which costs little for fields this small.

Example:
    >>> from arrowbuf.fields import Field
    >>> row_bytes, offsets = pack_layout({"obs": Field("float32", (3,), observation=True),
    ...                                   "terminated": Field("bool"), "action": Field("float32", (2,))})
    >>> row_bytes, offsets
    (12, {'action': 0, 'terminated': 8})
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

#: Fields of at most this many bytes a row are packed (W1's action is 24 bytes).
#: Larger ones fill a cache line or more by themselves and gain nothing.
PACK_MAX_ROW_BYTES = 64


def pack_layout(fields: Mapping[str, object]) -> tuple[int, dict[str, int]]:
    """(record bytes, byte offset of each packed field) of a schema's fields;
    ``(0, {})`` when fewer than two fields qualify (one take either way).

    Fields go largest item first, so each offset is a multiple of its field's
    item size (item sizes are powers of two), and the record is padded to a
    multiple of the largest: every field view is aligned, and its strides are
    multiples of its item size, which torch needs to view it (`torch.from_numpy`).
    """
    small = [(name, f) for name, f in fields.items()
             if not f.observation and f.row_bytes <= PACK_MAX_ROW_BYTES and f.row_bytes and f.codec is None and not f.text]
    if len(small) < 2:
        return 0, {}
    small.sort(key=lambda item: -item[1].numpy_dtype.itemsize)   # stable: schema order within a size
    offsets, total = {}, 0
    for name, f in small:
        offsets[name] = total
        total += f.row_bytes
    align = small[0][1].numpy_dtype.itemsize
    return -(-total // align) * align, offsets


def item_dtype(dtype: np.dtype, shape: tuple[int, ...]) -> np.dtype:
    """The type whose one item is a whole row of a field: ``dtype`` for a scalar, else
    opaque bytes (``V{row bytes}``). numpy copies a strided ``float32[6]`` row by row,
    element by element: 17.6 us for 1,000 rows here, 3.9 us as 24-byte items (2.3
    vs 0.9 us for the 256 rows of a W1 batch)."""
    dtype = np.dtype(dtype)
    return dtype if not shape else np.dtype(f"V{dtype.itemsize * int(np.prod(shape, dtype=np.int64))}")


def record_outs(outs: list, region: int, shape: tuple[int, ...], record_bytes: int,
                members: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Lay a batch's gathered records out in a gather slot (`arrowbuf._pool.SlotSpec.outs`).

    Appends to ``outs`` the records' region (uint8 ``[*shape, record_bytes]`` at byte
    ``region``, past the slot's leaves: no tensor views it), then for each packed
    field (``members``: its out position, its byte offset in a record) a strided view
    of it in the records and an alias of its out, both as one opaque item per row
    (`item_dtype`). Returns the (alias, view) out positions: copying each view into
    its alias fills the field's output.
    """
    outs.append((np.dtype(np.uint8), (*shape, record_bytes), region))
    strides = record_strides(shape, record_bytes)
    copies = []
    for position, offset in members:
        dtype, out_shape, at = outs[position][:3]
        item = item_dtype(dtype, out_shape[len(shape):])
        outs.append((item, tuple(shape), region + offset, strides))
        outs.append((item, tuple(shape), at))
        copies.append((len(outs) - 1, len(outs) - 2))
    return copies


def field_strides(record_strides: tuple[int, ...], dtype: np.dtype, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Byte strides of a field of ``shape`` inside records laid out with ``record_strides``
    (the strides of the record axes): the record axes', then the field's own, C order."""
    inner, stride = [], np.dtype(dtype).itemsize
    for size in reversed(shape):
        inner.append(stride)
        stride *= size
    return tuple(record_strides) + tuple(reversed(inner))


def record_strides(shape: tuple[int, ...], record_bytes: int) -> tuple[int, ...]:
    """Byte strides of the record axes of a C-contiguous ``[*shape, record_bytes]`` block."""
    strides, stride = [], record_bytes
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))


def column_view(block: np.ndarray, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The field at byte ``offset`` of every record of ``block`` (a C-contiguous
    ``[..., record_bytes]`` uint8 array) as a strided view of shape ``block.shape[:-1] + shape``.

    Built from strides, not by ``reshape``, which would copy silently where it
    cannot view.
    """
    return np.ndarray(block.shape[:-1] + tuple(shape), dtype, block, offset,
                      field_strides(block.strides[:-1], dtype, shape))
