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

from arrowbuf.byte_heap import HeapColumn
from arrowbuf.codecs import Codec, encode_rows, map_rows
from arrowbuf.errors import FormatError


def decode_rows(codec: Codec, blobs: list, rows: np.ndarray, names: np.ndarray, field: str = "") -> None:
    """Decode ``blobs`` (a row's bytes each; empty: a zero row) into ``rows`` (one per blob) on
    the codec pool.

    Raises:
        FormatError: naming ``field`` and the row (``names[i]``) whose bytes do not decode to a row.
    """
    decode = codec.decode

    def work(i: int) -> None:
        if len(blobs[i]):
            try:
                decode(blobs[i], rows[i])
            except FormatError as err:
                raise FormatError(f"{f'field {field!r}, ' if field else ''}row {int(names[i])} (encoded by "
                                  f"{codec.spec!r}): {err}") from None
        else:
            rows[i] = 0

    map_rows(work, len(blobs), len(blobs) * codec.row_bytes)


def _take_into(length: int, indices: Any, out: np.ndarray | None, mode: str, row_shape: tuple, dtype: np.dtype,
               fill: Any) -> np.ndarray:
    """``np.take``'s contract for a column of ``length`` rows whose ``fill(flat rows, out rows)``
    decodes rows: indices of any shape, ``out`` of ``indices.shape + row_shape``, "clip" or "raise"."""
    indices = np.asarray(indices)
    flat = indices.reshape(-1).astype(np.int64, copy=False)
    if mode == "clip":
        flat = np.clip(flat, 0, length - 1)
    elif flat.size and (flat.min() < -length or flat.max() >= length):
        raise IndexError(f"row index out of range for a column of {length} rows")
    else:
        flat = np.where(flat < 0, flat + length, flat)
    if out is None:
        out = np.empty((*indices.shape, *row_shape), dtype)
    target = out if out.flags.c_contiguous else np.empty(out.shape, dtype)
    fill(flat, target.reshape(len(flat), *row_shape))
    if target is not out:
        out[...] = target
    return out


class EncodedColumn(HeapColumn):
    """``rows`` rows of a field encoded by ``codec``, read and written as numpy rows of ``dtype``.

    Args:
        codec: the field's codec (`arrowbuf.codecs.parse_codec`).
        rows: rows of the arena.
        dtype: the numpy dtype of a decoded row (uint16 for bfloat16).
        mapped: rows stored elsewhere, read-only (`arrowbuf.byte_heap.HeapColumn`): a dataset's.
    """

    def __init__(self, codec: Codec, rows: int, dtype: np.dtype, mapped: tuple[np.ndarray, Any] | None = None) -> None:
        super().__init__(rows, mapped)
        self.codec = codec
        self.row_shape = tuple(codec.shape)
        self.dtype = np.dtype(dtype)
        self.shape = (rows, *self.row_shape)
        self.ndim = len(self.shape)

    # -- writing ----------------------------------------------------------------------

    def __setitem__(self, key: Any, value: Any) -> None:
        """Encode ``value`` (rows, or one row or scalar for every row of ``key``) into the rows ``key``."""
        rows = self.rows_of(key)
        if isinstance(value, EncodedRows) and value.codec.spec == self.codec.spec:
            self.put_encoded(rows, value)
            return
        if np.isscalar(value) and value == 0:
            self.store(rows, [b""] * len(rows))
            return
        values = np.asarray(value)
        if values.dtype != self.dtype:
            values = values.astype(self.dtype)
        values = np.broadcast_to(values, (len(rows), *self.row_shape))
        zero = ~values.reshape(len(rows), -1).any(axis=1)
        encoded = encode_rows(self.codec, values)
        self.store(rows, [b"" if z else data for z, data in zip(zero.tolist(), encoded)])

    @property
    def lossy(self) -> bool:
        """Whether a row reads back other than written (`encodes_to` tells a row written again)."""
        return not self.codec.lossless

    def encodes_to(self, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Whether each of ``values`` (host rows) encodes to the bytes held at its row of ``rows``:
        the row written again (a lossy codec's encoder gives the same bytes for the same row)."""
        values = np.asarray(values, self.dtype)
        if not len(values):
            return np.zeros(0, bool)
        encoded = encode_rows(self.codec, values)
        zero = ~values.reshape(len(values), -1).any(axis=1)
        return np.array([bytes(held) == (b"" if z else data) for held, data, z in
                         zip(self.blobs(np.asarray(rows, np.int64)), encoded, zero.tolist())], bool)

    def put_encoded(self, rows: np.ndarray, value: "EncodedRows") -> None:
        """Store rows already encoded by this column's codec (an import, a checkpoint) as they are."""
        self.store(self.rows_of(rows), value.rows())

    # -- reading ----------------------------------------------------------------------

    def __getitem__(self, key: Any) -> np.ndarray:
        """The decoded rows ``key`` (an int: one row)."""
        if isinstance(key, (int, np.integer)):
            return self.__getitem__(np.array([key]))[0]
        rows = self.rows_of(key)
        out = np.empty((len(rows), *self.row_shape), self.dtype)
        self.take(rows, 0, out)
        return out

    def take(self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "raise") -> np.ndarray:
        """Decode rows ``indices`` (any shape) into ``out`` (``indices.shape + row shape``), as ``np.take``.

        Raises:
            FormatError: a row's bytes do not decode to a row of this field (damaged data).
        """
        def fill(flat: np.ndarray, rows: np.ndarray) -> None:
            decode_rows(self.codec, self.blobs(flat), rows, flat, self.name)

        return _take_into(len(self), indices, out, mode, self.row_shape, self.dtype, fill)

    def shifted(self, by: int) -> "Shifted":
        """This column read ``by`` rows on (what ``column[1:]`` is to a numpy column's take)."""
        return Shifted(self, by)

    def encoded(self, start: int, stop: int) -> pa.Array:
        """Rows ``[start, stop)`` as stored: an Arrow ``binary`` array of their bytes (a copy)."""
        return self.encoded_at(np.arange(start, stop, dtype=np.int64))

    def encoded_at(self, rows: np.ndarray) -> pa.Array:
        """Rows ``rows`` as stored, an Arrow ``binary`` array (a copy)."""
        values, offsets = self.packed(rows)   # 64-bit offsets: a run of rows may pass 2 GiB
        return pa.Array.from_buffers(pa.large_binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(values)])


class Shifted:
    """A column that decodes its rows (an `EncodedColumn`, a `arrowbuf.video.VideoColumn`)
    read ``by`` rows on: ``take(rows)`` decodes rows ``rows + by``."""

    def __init__(self, column: Any, by: int) -> None:
        self.column, self.by = column, by

    def take(self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "raise") -> np.ndarray:
        return self.column.take(np.asarray(indices) + self.by, axis, out, mode)


class EncodedRows:
    """Rows encoded by ``codec``: an Arrow ``binary`` array (an import, a checkpoint, an episode
    read back). An `EncodedColumn` of the same codec stores the bytes as they are; anything
    else reads them decoded (``np.asarray(rows)``: numpy's ``__array__``)."""

    def __init__(self, array: pa.Array | pa.ChunkedArray, codec: Codec) -> None:
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        self.array, self.codec = array, codec
        self._rows: list | None = None
        self.dtype = np.dtype(np.uint16 if codec.dtype == "bfloat16" else codec.dtype)

    def __len__(self) -> int:
        return len(self.array)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.array), *self.codec.shape)

    @property
    def ndim(self) -> int:
        return 1 + len(self.codec.shape)

    def __getitem__(self, key: Any) -> "EncodedRows":
        if isinstance(key, slice):
            return EncodedRows(self.array[key], self.codec)
        key = np.asarray(key).reshape(-1)
        return EncodedRows(self.array.take(pa.array(np.flatnonzero(key) if key.dtype == bool else key)), self.codec)

    def rows(self) -> list:
        """Each row's bytes (views of the array's buffer; made once)."""
        if self._rows is not None:
            return self._rows
        array = self.array if pa.types.is_large_binary(self.array.type) else self.array.cast(pa.large_binary())
        offsets = np.frombuffer(array.buffers()[1], np.int64)[array.offset:array.offset + len(array) + 1]
        data = array.buffers()[2]
        values = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        self._rows = [values[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        return self._rows

    def __getstate__(self) -> dict:
        return {"array": self.array, "codec": self.codec, "dtype": self.dtype, "_rows": None}

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def check(self, field: str) -> None:
        """`Codec.check` every row (rows written elsewhere, before they are stored).

        Raises:
            FormatError: naming ``field`` and the first row that is not one of its codec.
        """
        for i, blob in enumerate(self.rows()):
            if len(blob):
                try:
                    self.codec.check(blob)
                except FormatError as err:
                    raise FormatError(f"field {field!r}, row {i}: {err} (encoded by {self.codec.spec!r})") from None

    def take(self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "raise") -> np.ndarray:
        """Decode rows ``indices`` into ``out``, as `EncodedColumn.take` (a Ray block's column).

        Raises:
            FormatError: a row's bytes do not decode (naming it).
        """
        def fill(flat: np.ndarray, rows: np.ndarray) -> None:
            blobs = self.rows()
            decode_rows(self.codec, [blobs[i] for i in flat.tolist()], rows, flat)

        return _take_into(len(self), indices, out, mode, self.codec.shape, self.dtype, fill)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The decoded rows.

        Raises:
            FormatError: a row that does not decode (naming it).
        """
        out = self.take(np.arange(len(self)))
        return out if dtype is None else out.astype(dtype, copy=False)

    @staticmethod
    def concat(parts: list["EncodedRows"]) -> "EncodedRows":
        """The rows of ``parts`` (of one codec) one after another."""
        return parts[0] if len(parts) == 1 else EncodedRows(pa.concat_arrays([p.array for p in parts]), parts[0].codec)
