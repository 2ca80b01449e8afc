"""`EncodedColumn`: a field stored encoded (``codec=``), read as the rows it encodes.

The column keeps each row's bytes in a `ByteHeap` and, per arena row, their address
and size (16 bytes a row). To the rest of the shard it reads and writes like the
numpy column of its decoded rows: ``column[rows] = values`` encodes (`codecs.map_rows`:
in parallel), ``column[rows]`` decodes, and `take` decodes a gather's rows straight
into the batch's buffer, as ``np.take`` fills it for a raw column. Rows keep their
bytes as they came: `put_encoded` stores rows already encoded (an import, a
checkpoint: a lossy codec's rows are never decoded and encoded again), and
`encoded` reads them back as an Arrow ``binary`` array.

A row of size 0 is a zero row (never written, or zeroed).

Example:
    >>> from arrowbuf.codecs import parse_codec
    >>> column = EncodedColumn(parse_codec("zstd", "int16", (3,), "x"), 8, np.dtype(np.int16))
    >>> column[2:4] = np.array([[1, 2, 3], [4, 5, 6]], np.int16)
    >>> column[np.array([3, 0])].tolist()
    [[4, 5, 6], [0, 0, 0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf.byte_heap import ByteHeap
from arrowbuf.codecs import Codec, encode_rows, map_rows
from arrowbuf.errors import FormatError


class EncodedColumn:
    """``rows`` rows of a field encoded by ``codec``, read and written as numpy rows of ``dtype``.

    Args:
        codec: the field's codec (`arrowbuf.codecs.parse_codec`).
        rows: rows of the arena.
        dtype: the numpy dtype of a decoded row (uint16 for bfloat16).
    """

    def __init__(self, codec: Codec, rows: int, dtype: np.dtype) -> None:
        self.codec = codec
        self.row_shape = tuple(codec.shape)
        self.dtype = np.dtype(dtype)
        self.shape = (rows, *self.row_shape)
        self.ndim = len(self.shape)
        # np.zeros: pages the kernel gives zeroed on first touch; memory grows with the rows written.
        self.addr = np.zeros(rows, np.int64)
        self.size = np.zeros(rows, np.int64)
        self.heap = ByteHeap()

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: the chunks of encoded rows, and 16 a row of addresses."""
        return self.heap.allocated + self.addr.nbytes + self.size.nbytes

    # -- writing ----------------------------------------------------------------------

    def _rows(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            return np.arange(*key.indices(len(self)), dtype=np.int64)
        rows = np.asarray(key, np.int64).reshape(-1)
        return np.where(rows < 0, rows + len(self), rows)

    def __setitem__(self, key: Any, value: Any) -> None:
        """Encode ``value`` (rows, or one row or scalar for every row of ``key``) into the rows ``key``."""
        rows = self._rows(key)
        if isinstance(value, EncodedRows):
            self.put_encoded(rows, value)
            return
        if np.isscalar(value) and value == 0:
            self._store(rows, [b""] * len(rows))
            return
        values = np.asarray(value)
        if values.dtype != self.dtype:
            values = values.astype(self.dtype)
        values = np.broadcast_to(values, (len(rows), *self.row_shape))
        zero = ~values.reshape(len(rows), -1).any(axis=1)
        encoded = encode_rows(self.codec, values)
        self._store(rows, [b"" if z else data for z, data in zip(zero.tolist(), encoded)])

    def put_encoded(self, rows: np.ndarray, value: "EncodedRows") -> None:
        """Store rows already encoded by this column's codec (an import, a checkpoint) as they are."""
        self._store(self._rows(rows), value.rows())

    def _store(self, rows: np.ndarray, blobs: list) -> None:
        if len(np.unique(rows)) != len(rows):   # the last write of a row wins, as numpy's assignment
            last = {row: i for i, row in enumerate(rows.tolist())}
            keep = sorted(last.values())
            rows, blobs = rows[keep], [blobs[i] for i in keep]
        self.heap.release(self.addr[rows], self.size[rows])
        addr, size = self.heap.append(blobs)
        self.addr[rows], self.size[rows] = addr, size
        if self.heap.needs_compaction():
            self._compact()

    def _compact(self) -> None:
        """Copy the held rows into new chunks, freeing those that few rows pinned."""
        held = np.flatnonzero(self.size)
        blobs = [self.heap.view(a, s).tobytes() for a, s in zip(self.addr[held].tolist(), self.size[held].tolist())]
        self.heap.clear()
        self.addr[held], self.size[held] = self.heap.append(blobs)

    # -- reading ----------------------------------------------------------------------

    def __getitem__(self, key: Any) -> np.ndarray:
        """The decoded rows ``key`` (an int: one row)."""
        if isinstance(key, (int, np.integer)):
            return self.__getitem__(np.array([key]))[0]
        rows = self._rows(key)
        out = np.empty((len(rows), *self.row_shape), self.dtype)
        self.take(rows, 0, out)
        return out

    def take(self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "raise") -> np.ndarray:
        """Decode rows ``indices`` (any shape) into ``out`` (``indices.shape + row shape``), as ``np.take``.

        Raises:
            FormatError: a row's bytes do not decode to a row of this field (damaged data).
        """
        indices = np.asarray(indices)
        flat = indices.reshape(-1).astype(np.int64, copy=False)
        if mode == "clip":
            flat = np.clip(flat, 0, len(self) - 1)
        elif flat.size and (flat.min() < -len(self) or flat.max() >= len(self)):
            raise IndexError(f"row index out of range for a column of {len(self)} rows")
        if out is None:
            out = np.empty((*indices.shape, *self.row_shape), self.dtype)
        target = out if out.flags.c_contiguous else np.empty(out.shape, self.dtype)
        rows = target.reshape(len(flat), *self.row_shape)
        addr, size = self.addr[flat].tolist(), self.size[flat].tolist()
        view, decode = self.heap.view, self.codec.decode

        def work(i: int) -> None:
            if size[i]:
                try:
                    decode(view(addr[i], size[i]), rows[i])
                except FormatError as err:
                    raise FormatError(f"row {int(flat[i])} of an encoded field ({self.codec.spec}): {err}") from None
            else:
                rows[i] = 0

        map_rows(work, len(flat))
        if target is not out:
            out[...] = target
        return out

    def shifted(self, by: int) -> "Shifted":
        """This column read ``by`` rows on (what ``column[1:]`` is to a numpy column's take)."""
        return Shifted(self, by)

    def encoded(self, start: int, stop: int) -> pa.Array:
        """Rows ``[start, stop)`` as stored: an Arrow ``binary`` array of their bytes (a copy)."""
        return self.encoded_at(np.arange(start, stop, dtype=np.int64))

    def encoded_at(self, rows: np.ndarray) -> pa.Array:
        """Rows ``rows`` as stored, an Arrow ``binary`` array (a copy)."""
        size = self.size[rows]
        offsets = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(size, out=offsets[1:])
        values = np.empty(int(offsets[-1]), np.uint8)
        for i, (a, n) in enumerate(zip(self.addr[rows].tolist(), size.tolist())):
            if n:
                values[offsets[i]:offsets[i] + n] = self.heap.view(a, n)
        return pa.Array.from_buffers(pa.binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(values)])


class Shifted:
    """A column that decodes its rows (an `EncodedColumn`, a `arrowbuf.video.VideoColumn`)
    read ``by`` rows on: ``take(rows)`` decodes rows ``rows + by``."""

    def __init__(self, column: Any, by: int) -> None:
        self.column, self.by = column, by

    def take(self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "raise") -> np.ndarray:
        return self.column.take(np.asarray(indices) + self.by, axis, out, mode)


class EncodedRows:
    """Rows already encoded by a field's codec: an Arrow ``binary`` array, written as it is
    into an `EncodedColumn` (an import or a checkpoint of an encoded field)."""

    def __init__(self, array: pa.Array | pa.ChunkedArray) -> None:
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.array),)

    def __getitem__(self, key: Any) -> "EncodedRows":
        if isinstance(key, slice):
            return EncodedRows(self.array[key])
        return EncodedRows(self.array.take(pa.array(np.asarray(key).reshape(-1))))

    def rows(self) -> list:
        """Each row's bytes (views of the array's buffer)."""
        array = self.array.cast(pa.binary()) if not pa.types.is_binary(self.array.type) else self.array
        offsets = np.frombuffer(array.buffers()[1], np.int32)[array.offset:array.offset + len(array) + 1]
        data = array.buffers()[2]
        values = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        return [values[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
