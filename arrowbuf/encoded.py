"""`EncodedColumn`: a field stored encoded (``codec=``), read as the rows it encodes.

The column keeps each row's bytes in a `ByteHeap` and, per arena row, their address
and size (16 bytes a row). To the rest of the shard it reads and writes like the
numpy column of its decoded rows: ``column[rows] = values`` encodes (`codecs.map_rows`:
in parallel), ``column[rows]`` decodes, and `take` decodes rows straight into a
buffer, as ``np.take`` fills it for a raw column. A gather decodes all its encoded
fields together (`BatchDecodes`: one pass of the codec pool), each distinct row once
(`decode_into`: an observation that is also a next observation, or in several frame
stacks, is decoded once and copied). Rows keep their
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

import bisect
import itertools
from typing import Any, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf.byte_heap import HeapColumn
from arrowbuf.codecs import Codec, encode_rows, map_rows
from arrowbuf.errors import FormatError


class Request(NamedTuple):
    """Rows of an encoded source to decode into ``out``: ``source`` an `EncodedColumn` or
    `EncodedRows` (its ``codec``, ``name`` and ``blobs``), ``rows`` int64 rows of it, in range,
    and ``out`` a C-contiguous ``[len(rows), *row shape]`` buffer."""

    source: Any
    rows: np.ndarray
    out: np.ndarray


def decode_into(requests: Sequence[Request]) -> None:
    """Decode the rows of ``requests`` in one pass of the codec pool (`map_rows`), each distinct
    row of a source once: it is decoded into the first place that asks for it and copied, by the
    same task, to the others (a next observation that is another transition's observation, the
    frames that overlapping frame stacks share).

    Raises:
        FormatError: naming the field and the row whose bytes do not decode to a row.
    """
    by_source: dict[int, list[Request]] = {}
    for request in requests:
        by_source.setdefault(id(request.source), []).append(request)
    groups = [_Distinct(same) for same in by_source.values()]
    if len(groups) == 1:
        work, count, nbytes = groups[0].work, groups[0].count, groups[0].nbytes
    else:
        starts = list(itertools.accumulate((g.count for g in groups), initial=0))
        count, nbytes = starts.pop(), sum(g.nbytes for g in groups)

        def work(unit: int) -> None:
            k = bisect.bisect_right(starts, unit) - 1
            groups[k].work(unit - starts[k])

    map_rows(work, count, nbytes)


class _Distinct:
    """The distinct rows that requests of one source ask for, and where each goes: `work`
    decodes the ``j``-th into its first place and copies it to the rest."""

    def __init__(self, requests: list[Request]) -> None:
        source, outs = requests[0].source, [r.out for r in requests]
        flat = requests[0].rows if len(requests) == 1 else np.concatenate([r.rows for r in requests])
        unique, inverse = np.unique(flat, return_inverse=True)
        # Places (positions in ``flat``) grouped by the row they hold, in row order.
        self.order = np.argsort(inverse, kind="stable").tolist()
        self.cuts = np.concatenate([[0], np.cumsum(np.bincount(inverse))]).tolist() \
            if len(unique) < len(flat) else None   # None: each row has one place
        self.unique, self.blobs = unique, source.blobs(unique)
        self.codec, self.name, self.outs = source.codec, source.name, outs
        self.starts = list(itertools.accumulate((len(o) for o in outs), initial=0))[:-1]
        self.count, self.nbytes = len(unique), len(unique) * source.codec.row_bytes

    def _place(self, position: int) -> np.ndarray:
        if len(self.outs) == 1:
            return self.outs[0][position]
        k = bisect.bisect_right(self.starts, position) - 1
        return self.outs[k][position - self.starts[k]]

    def work(self, j: int) -> None:
        places = [self.order[j]] if self.cuts is None else self.order[self.cuts[j]:self.cuts[j + 1]]
        first, blob = self._place(places[0]), self.blobs[j]
        if len(blob):
            try:
                self.codec.decode(blob, first)
            except FormatError as err:
                raise FormatError(f"{f'field {self.name!r}, ' if self.name else ''}row {int(self.unique[j])} "
                                  f"(encoded by {self.codec.spec!r}): {err}") from None
        else:
            first[...] = 0
        for position in places[1:]:
            self._place(position)[...] = first


def _flat(length: int, indices: Any, mode: str) -> np.ndarray:
    """``indices`` (any shape) as flat int64 rows of a column of ``length`` rows, as ``np.take``
    reads them in ``mode`` "clip" or "raise" (negative: from the end)."""
    flat = np.asarray(indices).reshape(-1).astype(np.int64, copy=False)
    if mode == "clip":
        return np.clip(flat, 0, length - 1)
    if flat.size and (flat.min() < -length or flat.max() >= length):
        raise IndexError(f"row index out of range for a column of {length} rows")
    return np.where(flat < 0, flat + length, flat)


def _take_into(length: int, indices: Any, out: np.ndarray | None, mode: str, row_shape: tuple, dtype: np.dtype,
               fill: Any) -> np.ndarray:
    """``np.take``'s contract for a column of ``length`` rows whose ``fill(flat rows, out rows)``
    decodes rows: indices of any shape, ``out`` of ``indices.shape + row_shape``, "clip" or "raise"."""
    flat = _flat(length, indices, mode)
    if out is None:
        out = np.empty((*np.shape(indices), *row_shape), dtype)
    target = out if out.flags.c_contiguous else np.empty(out.shape, dtype)
    fill(flat, target.reshape(len(flat), *row_shape))
    if target is not out:
        out[...] = target
    return out


class DecodedField(NamedTuple):
    """An encoded field of a batch layout: its view ``outs[position]`` holds rows
    ``by_role[role] + shift`` of ``column`` (an `EncodedColumn`, or a video field's column),
    clipped to its rows as ``np.take``'s "clip" mode (a default next observation: the step
    rows, shift 1)."""

    position: int
    column: Any
    role: int
    shift: int


class BatchDecodes:
    """The encoded fields of one batch layout, decoded together (`decode_into`): one pass of the
    codec pool for all of them, each distinct row of a column once, whichever fields read it (an
    observation and its next observation; overlapping frame stacks). The gather
    (`arrowbuf.tensors.Gather`) makes one per layout and calls it per batch. A column with a
    ``decode_requests`` (a dataset's video field, `arrowbuf.video.VideoColumn`) decodes its
    own requests: those that name the same one (the video fields of one dataset) in one call.

    Args:
        fields: each encoded field of the layout (`DecodedField`).
    """

    def __init__(self, fields: Sequence["DecodedField"]) -> None:
        self.fields = tuple(fields)
        self.decoders = tuple(getattr(f.column, "decode_requests", None) for f in self.fields)

    def __call__(self, by_role: tuple, outs: list[np.ndarray]) -> None:
        """Decode every field's rows (``by_role``: rows by role index) into its view of ``outs``."""
        requests, copies, own = [], [], {}
        for (position, column, role, shift), decoder in zip(self.fields, self.decoders):
            rows, out = by_role[role], outs[position]
            flat = _flat(len(column), rows + shift if shift else rows, "clip")
            target = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
            request = Request(column, flat, target.reshape(len(flat), *column.row_shape))
            if decoder is None:
                requests.append(request)
            else:
                own.setdefault(decoder, []).append(request)
            if target is not out:
                copies.append((out, target))
        if requests:
            decode_into(requests)
        for decoder, mine in own.items():
            decoder(mine)
        for out, target in copies:
            out[...] = target


class EncodedColumn(HeapColumn):
    """``rows`` rows of a field encoded by ``codec``, read and written as numpy rows of ``dtype``.

    Args:
        codec: the field's codec (`arrowbuf.codecs.parse_codec`).
        rows: rows of the arena.
        dtype: the numpy dtype of a decoded row (uint16 for bfloat16).
        mapped: rows stored elsewhere, read-only (`arrowbuf.byte_heap.HeapColumn`): a dataset's.
    """

    def __init__(self, codec: Codec, rows: int, dtype: np.dtype, mapped: tuple[np.ndarray, Any] | None = None,
                 name: str = "") -> None:
        super().__init__(rows, mapped, name)
        self.codec = codec
        self.bytes_word = "bytes encoded"
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
        self.store(rows, self._blobs(np.broadcast_to(values, (len(rows), *self.row_shape))))

    def _blobs(self, values: np.ndarray) -> list:
        """Rows ``values`` (of this column's dtype) as stored: each encoded, an all-zero row as no bytes."""
        zero = ~values.reshape(len(values), -1).any(axis=1)
        encoded = encode_rows(self.codec, values)
        return [b"" if z else data for z, data in zip(zero.tolist(), encoded)]

    def encode(self, values: Any) -> "EncodedRows":
        """Rows ``values`` encoded as this column stores them (`EncodedRows`, which a write of
        them stores as they are): for a write whose bytes are checked before it is made (the
        field's ``max_bytes``: `arrowbuf.shard.Shard.check_fits`, `arrowbuf.inplace`)."""
        values = np.asarray(values)
        values = values.astype(self.dtype, copy=False).reshape(len(values), *self.row_shape)
        return EncodedRows.of_blobs(self._blobs(values), self.codec)

    def bytes_of(self, data: Any) -> int:
        """The bytes rows ``data`` take of the field's ``max_bytes`` once stored (encoded)."""
        rows = data if isinstance(data, EncodedRows) and data.codec.spec == self.codec.spec else self.encode(data)
        return int(rows.sizes().sum())

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
            decode_into([Request(self, flat, rows)])

        return _take_into(len(self), indices, out, mode, self.row_shape, self.dtype, fill)

    def encoded(self, start: int, stop: int) -> pa.Array:
        """Rows ``[start, stop)`` as stored: an Arrow ``binary`` array of their bytes (a copy)."""
        return self.encoded_at(np.arange(start, stop, dtype=np.int64))

    def encoded_at(self, rows: np.ndarray) -> pa.Array:
        """Rows ``rows`` as stored, an Arrow ``binary`` array (a copy)."""
        values, offsets = self.packed(rows)   # 64-bit offsets: a run of rows may pass 2 GiB
        return pa.Array.from_buffers(pa.large_binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(values)])


class EncodedRows:
    """Rows encoded by ``codec``: an Arrow ``binary`` array (an import, a checkpoint, an episode
    read back). An `EncodedColumn` of the same codec stores the bytes as they are; anything
    else reads them decoded (``np.asarray(rows)``: numpy's ``__array__``)."""

    name = ""   # no field's: rows outside a store (`decode_into` names the field of a column's rows)

    def __init__(self, array: pa.Array | pa.ChunkedArray, codec: Codec) -> None:
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        self.array, self.codec = array, codec
        self._rows: list | None = None
        self.dtype = np.dtype(np.uint16 if codec.dtype == "bfloat16" else codec.dtype)

    @classmethod
    def of_blobs(cls, blobs: Sequence, codec: Codec) -> "EncodedRows":
        """Rows whose bytes are ``blobs`` (encoded by ``codec``), copied into one Arrow array."""
        offsets = np.zeros(len(blobs) + 1, np.int64)
        np.cumsum([len(b) for b in blobs], out=offsets[1:])
        values = pa.py_buffer(b"".join(blobs))
        rows = cls(pa.Array.from_buffers(pa.large_binary(), len(blobs), [None, pa.py_buffer(offsets), values]), codec)
        rows._rows = list(blobs)   # the same bytes: a store of them takes these, not views of the array
        return rows

    def __len__(self) -> int:
        return len(self.array)

    def sizes(self) -> np.ndarray:
        """Each row's bytes (int64)."""
        return np.fromiter(map(len, self.rows()), np.int64, len(self))

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

    def blobs(self, rows: np.ndarray) -> list:
        """The bytes of each of ``rows`` (views of the array's buffer)."""
        held = self.rows()
        return [held[i] for i in rows.tolist()]

    def __getstate__(self) -> dict:
        return {"array": self.array, "codec": self.codec, "dtype": self.dtype, "_rows": None}

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def copy(self) -> "EncodedRows":
        """The same rows in buffers of their own (a view of a store's rows may be overwritten)."""
        if not len(self.array):
            return EncodedRows(pa.array([], pa.large_binary()), self.codec)
        array = self.array if pa.types.is_large_binary(self.array.type) else self.array.cast(pa.large_binary())
        offsets = np.frombuffer(array.buffers()[1], np.int64)[array.offset:array.offset + len(array) + 1]
        data = array.buffers()[2]
        values = np.frombuffer(data, np.uint8)[offsets[0]:offsets[-1]] if data is not None else np.zeros(0, np.uint8)
        own = pa.Array.from_buffers(pa.large_binary(), len(array),
                                    [None, pa.py_buffer(offsets - offsets[0]), pa.py_buffer(values.copy())])
        return EncodedRows(own, self.codec)

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
            decode_into([Request(self, flat, rows)])

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
