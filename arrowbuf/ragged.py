"""Ragged fields: a sequence per step (``ab.Field("int32", (None,))``), stored without padding.

A ragged field's step holds a sequence of any length: token ids (``(None,)``), or rows of
``k`` values each (``(None, k)``). Rows travel as `RaggedRows`, Arrow's list layout: the
values of every row one after another (``[total, *tail]``) and ``offsets`` (``[n + 1]``,
row i is ``values[offsets[i]:offsets[i + 1]]``). In a shard a `RaggedColumn` keeps each
row's values in a `ByteHeap` (16 bytes a row of address and size, never padded), and a
gather copies the batch's values once into one buffer that a jagged ``torch.nested``
tensor wraps (``batch[key].offsets()`` is ``cu_seqlens``).

Input forms, read by `ragged_rows`: a list (or tuple) of arrays or tensors of one dtype,
one per row; a jagged nested tensor; an Arrow list array; a dense array ``[n, L, *tail]``
(every row of length L).

Example:
    >>> rows = ragged_rows([np.array([1, 2, 3]), np.array([], np.int64), np.array([4])], "tokens")
    >>> rows.lengths.tolist(), rows[np.array([2, 0])].values.tolist()
    ([3, 0, 1], [4, 1, 2, 3])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf import _lazy_torch
from arrowbuf._pool import joined, nest, torch_internals
from arrowbuf.byte_heap import HeapColumn
from arrowbuf.errors import SchemaError, describe


class RaggedRows:
    """Rows of a ragged field: ``values`` ``[total, *tail]`` and ``offsets`` (int64, ``[n + 1]``)."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        self.values, self.offsets = values, np.asarray(offsets, np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def tail(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def shape(self) -> tuple:
        """``(rows, None, *tail)``: a ragged field's shape, its rows first."""
        return (len(self), None, *self.tail)

    @property
    def ndim(self) -> int:
        return 2 + len(self.tail)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def size(self) -> int:
        return self.values.size

    @property
    def nbytes(self) -> int:
        """Bytes of the values and offsets (what a Ray block or request carries)."""
        return self.values.nbytes + self.offsets.nbytes

    def __getitem__(self, key: Any) -> "RaggedRows":
        """The rows ``key`` names (a slice, an index array, a bool mask) as new rows (a copy of their values)."""
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1:
                return RaggedRows(self.values[self.offsets[start]:self.offsets[max(start, stop)]],
                                  self.offsets[start:max(start, stop) + 1] - self.offsets[start])
            key = np.arange(start, stop, step)
        key = np.asarray(key)
        rows = np.flatnonzero(key) if key.dtype == bool else key.reshape(-1).astype(np.int64)
        starts, lengths = self.offsets[rows], self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
        return RaggedRows(self.values[index], offsets)

    def copy(self) -> "RaggedRows":
        """These rows owning copies of their values and offsets."""
        return RaggedRows(self.values.copy(), self.offsets.copy())

    def rows(self) -> list[np.ndarray]:
        """Each row's values (views)."""
        bounds = self.offsets.tolist()
        return [self.values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def astype(self, dtype: np.dtype) -> "RaggedRows":
        return self if self.values.dtype == dtype else RaggedRows(self.values.astype(dtype), self.offsets)

    def to_arrow(self, value_type: pa.DataType | None = None) -> pa.Array:
        """An Arrow ``large_list`` array (of fixed-size lists for a tail ``(k,)``) over these values."""
        flat = np.ascontiguousarray(self.values).reshape(-1)
        values = pa.array(flat, value_type) if value_type is not None or flat.dtype == bool else \
            pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), flat.size, [None, pa.py_buffer(flat)])
        if self.tail:
            values = pa.FixedSizeListArray.from_arrays(values, int(np.prod(self.tail)))
        return pa.LargeListArray.from_arrays(pa.array(self.offsets), values)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise SchemaError(f"ragged rows (lengths {self.lengths[:8].tolist()}...) have no dense form; pad them "
                          "(sample(..., pad={key: value})) or read them as rows")


def ragged_rows(value: Any, name: str, tail: tuple[int, ...] | None = None) -> RaggedRows:
    """``value`` (a list of arrays or tensors, a jagged nested tensor, an Arrow list array, a
    dense ``[n, L, *tail]`` array, or `RaggedRows`) as ragged rows.

    Raises:
        SchemaError: naming the field, for rows of different dtypes or tails, or a value of no
            ragged form (a row that is a scalar, a 2-D list for a ``(None,)`` field...).
    """
    if isinstance(value, RaggedRows):
        rows = value
    elif isinstance(value, (pa.Array, pa.ChunkedArray)):
        rows = _from_arrow(value, name)
    elif _lazy_torch.is_tensor(value) and value.is_nested:
        values, offsets = value.values(), value.offsets()
        rows = RaggedRows(_host(values, name), offsets.detach().cpu().numpy())
    elif isinstance(value, (list, tuple)):
        parts = [_host(part, name) for part in value]
        if any(p.ndim == 0 for p in parts):
            raise SchemaError(f"field {name!r}: a ragged field's rows are sequences (1-D or more), got "
                              f"{describe(value)} with a scalar row")
        if len({p.dtype for p in parts if len(p)}) > 1 or len({p.shape[1:] for p in parts if len(p)}) > 1:
            raise SchemaError(f"field {name!r}: rows of dtypes {sorted({p.dtype.name for p in parts})} and tails "
                              f"{sorted({p.shape[1:] for p in parts})}; a ragged field's rows share one dtype "
                              "and per-item shape")
        filled = [p for p in parts if len(p)]
        if filled:   # an empty Python list reads as float64: it takes the other rows' dtype and tail
            parts = [p if len(p) else np.zeros((0, *filled[0].shape[1:]), filled[0].dtype) for p in parts]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        dtype = parts[0].dtype if parts else np.dtype(np.int64)
        values = np.concatenate(parts) if parts else np.zeros((0, *(tail or ())), dtype)
        rows = RaggedRows(values, offsets)
    else:
        array = _host(value, name)
        if array.ndim < 2:
            raise SchemaError(f"field {name!r}: got {describe(value)}; a ragged field's rows are a list of "
                              "sequences (one per step or env), a jagged nested tensor or an [n, L, ...] array")
        rows = RaggedRows(array.reshape(-1, *array.shape[2:]), np.arange(len(array) + 1, dtype=np.int64) * array.shape[1])
    if tail is not None and rows.tail != tuple(tail):
        raise SchemaError(f"field {name!r}: ragged rows of items {rows.tail}; the field's items are {tuple(tail)} "
                          f"(its shape is (None, {', '.join(map(str, tail))}{',' if len(tail) == 1 else ''}))"
                          if tail else f"field {name!r}: ragged rows of items {rows.tail} (a row of more than one "
                          "dimension); the field is (None,): each row is a 1-D sequence")
    return rows


def value_bytes(data: Any, name: str, tail: tuple[int, ...] | None = None) -> int:
    """Bytes of the values of ragged rows ``data`` (`RaggedRows` or any form `ragged_rows` reads):
    what they take of a field's ``max_bytes``."""
    rows = data if isinstance(data, RaggedRows) else ragged_rows(data, name, tail)
    return int(rows.offsets[-1] - rows.offsets[0]) * rows.values[:1].nbytes


def _host(value: Any, name: str) -> np.ndarray:
    """One row (or a nested tensor's values) as host numpy; bfloat16 as its uint16 bits.

    Raises:
        SchemaError: naming the field, for a value numpy cannot read or a tensor with no data here.
    """
    if _lazy_torch.is_tensor(value):
        import torch

        try:
            tensor = value.detach().cpu()
        except (NotImplementedError, RuntimeError) as err:
            raise SchemaError(f"field {name!r}: a tensor on {value.device} whose data cannot be read here "
                              f"({type(err).__name__})") from None
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 \
            else tensor.numpy()
    try:
        return np.asarray(value)
    except ValueError as err:
        raise SchemaError(f"field {name!r}: a row of no one shape ({describe(value)}: {err})") from None


def _from_arrow(column: pa.Array | pa.ChunkedArray, name: str) -> RaggedRows:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise SchemaError(f"field {name!r} is ragged: a list column, got {column.type}")
    if column.null_count:
        raise SchemaError(f"field {name!r} has {column.null_count} nulls; arrowbuf columns have none")
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values
    tail: tuple[int, ...] = ()
    if pa.types.is_fixed_size_list(values.type):
        tail = (values.type.list_size,)
        values = values.flatten()
    flat = values.to_numpy(zero_copy_only=False)
    flat = flat.reshape(-1, *tail) if tail else flat
    return RaggedRows(flat[offsets[0]:offsets[-1]] if len(offsets) else flat[:0], offsets - offsets[0])


class RaggedColumn(HeapColumn):
    """``rows`` rows of a ragged field of ``dtype`` items shaped ``tail``, values in a heap
    (``mapped``: rows stored elsewhere, read-only, `arrowbuf.byte_heap.HeapColumn`: a dataset's)."""

    def __init__(self, rows: int, dtype: np.dtype, tail: tuple[int, ...],
                 mapped: tuple[np.ndarray, Any] | None = None, name: str = "") -> None:
        super().__init__(rows, mapped, name)
        self.dtype, self.tail = np.dtype(dtype), tuple(tail)
        self.bytes_word = "bytes of values"
        self.item_bytes = self.dtype.itemsize * int(np.prod(tail, dtype=np.int64))
        self.shape = (rows, None, *self.tail)
        self.ndim = len(self.shape)

    def __setitem__(self, key: Any, value: Any) -> None:
        """Store ``value`` (ragged rows; 0: empty rows) as the rows ``key``."""
        rows = self.rows_of(key)
        if np.isscalar(value) and value == 0:
            self.store(rows, [b""] * len(rows))
            return
        given = ragged_rows(value, self.name or "?", self.tail).astype(self.dtype)
        if len(given) != len(rows):
            raise ValueError(f"{len(given)} ragged rows for {len(rows)} rows of field {self.name!r}")
        values = np.ascontiguousarray(given.values).reshape(-1).view(np.uint8)
        bounds = (given.offsets * self.item_bytes).tolist()
        self.store(rows, [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])])

    def __getitem__(self, key: Any) -> RaggedRows:
        """The rows ``key`` (a copy of their values)."""
        return self.gather(self.rows_of(key))

    def bytes_of(self, data: Any) -> int:
        """The bytes ragged rows ``data`` take of the field's ``max_bytes`` (`value_bytes`)."""
        return value_bytes(data, self.name, self.tail)

    def gather(self, rows: np.ndarray) -> RaggedRows:
        """Rows ``rows`` (flat int64), their values copied once into one array."""
        data, offsets = self.packed(rows)
        return RaggedRows(data.view(self.dtype).reshape(-1, *self.tail), offsets // self.item_bytes)

    def batch_value(self, rows: np.ndarray, tensor_dtype: str) -> Any:
        """Rows ``rows`` as a batch holds them: a jagged nested tensor (`nested`)."""
        return nested(self.gather(rows), tensor_dtype)


def nested(rows: RaggedRows, tensor_dtype: str) -> Any:
    """A jagged ``torch.nested`` tensor over ``rows``' values (no copy; bfloat16 from its bits)."""
    import torch

    values = torch.from_numpy(rows.values)
    if tensor_dtype == "bfloat16":
        values = values.view(torch.bfloat16)
    lengths = rows.lengths
    return jagged(values, torch.from_numpy(rows.offsets), int(lengths.max(initial=0)), int(lengths.min(initial=0)))


def jagged(values: Any, offsets: Any, max_seqlen: int, min_seqlen: int) -> Any:
    """The jagged nested tensor of ``values`` (``[total, *tail]``) and ``offsets`` (int64 ``[n + 1]``),
    no copy, with its longest and shortest row recorded (what attention kernels read).

    Built by torch's ``NestedTensor`` constructor where a probe finds it gives what the public
    ``torch.nested.nested_tensor_from_jagged`` gives (`arrowbuf._pool.torch_internals`: the one
    place that reads torch's private names): the public function reaches it through a dispatch
    that took ~60 us of its ~85 here, as long as gathering 100 rows of tokens.
    """
    return torch_internals()[4](values, offsets, max_seqlen, min_seqlen)


def padded(rows: RaggedRows, pad: Any) -> tuple[np.ndarray, np.ndarray]:
    """(``[n, L_max, *tail]`` of ``rows`` padded with ``pad``, their lengths ``[n]``)."""
    lengths = rows.lengths
    out = np.full((len(rows), int(lengths.max(initial=0)), *rows.tail), pad, rows.dtype)
    bounds, values = rows.offsets.tolist(), rows.values
    # A fill, then a slice copy a row: 3.5x faster than one fancy-indexed scatter for 256 rows; joining
    # each row's bytes with its gap's of pad (every byte written once) measured no faster in a sample.
    for i in range(len(rows)):
        out[i, :bounds[i + 1] - bounds[i]] = values[bounds[i]:bounds[i + 1]]
    return out, lengths


def check_pad(pad: Any, schema: Any) -> dict[tuple[str, ...], Any] | None:
    """``sample(..., pad=)`` checked before anything is drawn: {ragged field key: pad value}.

    Raises:
        ValueError: ``pad`` is not a mapping, names a field that is not ragged (or no field),
            or gives a value that is not a number of the field's dtype (`_pad_value`).
    """
    if pad is None:
        return None
    if not isinstance(pad, dict):
        raise ValueError(f"pad must be a dict {{ragged field: pad value}}, got {pad!r}")
    ragged = [name for name, f in schema.fields.items() if f.ragged] if schema is not None else []
    checked = {}
    for name, value in pad.items():
        if name not in ragged:
            raise ValueError(f"pad: {name!r} is not a ragged field; the ragged fields are {ragged}")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"pad: the value for {name!r} must be a number, got {value!r}")
        checked[tuple(name.split("."))] = _pad_value(name, value, schema.fields[name].dtype)
    return checked


def _pad_value(name: str, value: Any, dtype: str) -> Any:
    """``value`` as the field's dtype, checked to be that number: the pad is filled with numpy's
    unsafe cast, which made 0.5 a 0 of an int field, NaN an arbitrary int, and 2**70 an OverflowError
    after the batch was drawn.

    Raises:
        ValueError: a value the field's dtype cannot hold exactly (an int field: not a whole number in
            its range; a float field: a finite number beyond its range, which would become inf).
    """
    kind = np.dtype(dtype).kind if dtype != "bfloat16" else "f"
    if kind in "iub":
        info = np.iinfo(dtype) if kind != "b" else None
        whole = isinstance(value, (int, np.integer)) or (np.isfinite(value) and float(value).is_integer())
        low, high = (0, 1) if info is None else (info.min, info.max)
        if not whole or not low <= int(value) <= high:
            raise ValueError(f"pad: the value for {name!r} must be a whole number in [{low}, {high}] (the field is "
                             f"{dtype}), got {value!r}")
        return int(value)
    if dtype != "bfloat16" and np.isfinite(value):
        with np.errstate(over="ignore"):
            if not np.isfinite(np.dtype(dtype).type(value)):
                raise ValueError(f"pad: the value for {name!r} overflows the field's {dtype} (largest "
                                 f"{np.finfo(dtype).max}), got {value!r}")
    return value


def pad_batch(batch: Any, pad: dict[tuple[str, ...], Any] | None) -> Any:
    """``batch`` with each ragged key of ``pad`` as a padded ``[B, L_max, ...]`` tensor (``L_max``:
    the batch's longest row) and ``<key>_length`` ``[B]`` beside it (`padded`)."""
    if not pad:
        return batch
    import torch

    dense = {}
    for key, value in pad.items():
        tensor = batch.get(key, None)
        if tensor is None:   # left out by keys=
            continue
        rows = RaggedRows(tensor.values().cpu().numpy(), tensor.offsets().cpu().numpy())
        values, lengths = padded(rows, value)
        dense_tensor = torch.from_numpy(values).to(tensor.device)
        dense[key] = dense_tensor.view(tensor.dtype) if dense_tensor.dtype != tensor.dtype else dense_tensor
        dense[(*key[:-1], key[-1] + "_length")] = torch.from_numpy(lengths).to(tensor.device)
    return joined(batch, nest(dense))   # a new TensorDict: the padded tensors in place of the jagged ones


def refuse_apart(schema: Any, where: str, fix: str) -> None:
    """Raise `SchemaError` when ``schema`` has ragged or text fields, which ``where`` does not take yet.

    Raises:
        SchemaError: naming those fields, where, and ``fix``.
    """
    apart = [name for name, f in schema.fields.items() if f.ragged or f.text] if schema is not None else []
    if apart:
        raise SchemaError(f"ragged or text fields {apart}: {where} does not take them yet; {fix}")
