"""One column: dtype names, the `Field` spec, and the conversions and checks of one column's values.

A field's dtype is one of arrowbuf's names (bool, the ints, float16/32/64, bfloat16);
numpy and torch dtypes are accepted and named (`dtype_name`). Values come in as numpy,
torch or Arrow and are read as numpy views (`as_array`, `arrow_to_numpy`), checked
against their field (`check_column`: per-step shape, lossless dtype, exact integers in
float fields), and stored as Arrow arrays over the same memory (`numpy_to_arrow`).

Arrow mapping: scalars are plain primitives, fixed shapes use the
``fixed_shape_tensor`` extension type, bfloat16 is stored as uint16 bits.
Parquet exports encode a column for readers that know no bfloat16 (`export_type`,
`export_array`): bfloat16 widened to float32 (exact, and narrowed back bit for bit
by `narrow_bfloat16`), fixed shapes as the canonical ``arrow.fixed_shape_tensor``.

Example:
    >>> from arrowbuf.fields import Field
    >>> Field("float32", (4,), observation=True).row_bytes
    16
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from arrowbuf import _lazy_torch
from arrowbuf.encoded import EncodedRows
from arrowbuf.errors import SchemaError, describe
from arrowbuf.ragged import RaggedRows, ragged_rows
from arrowbuf.text import text_values

if TYPE_CHECKING:
    import torch

#: dtype name -> numpy storage dtype (the name is also the torch dtype's: `_lazy_torch.dtype`)
_DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(np.uint16),
    "string": np.dtype(object),   # a text field's values (`arrowbuf.text`: stored as codes)
}
# numpy dtype -> name (np.dtype.name runs Python code in numpy 2: ~1.5 us a call)
_NUMPY_NAMES = {np.dtype(name): name for name in _DTYPES if name not in ("bfloat16", "string")}


@dataclass(frozen=True)
class Field:
    """The spec of one column: dtype name, per-step shape, and whether it is an observation.

    Args:
        dtype: one of bool, uint8, int8, int16, int32, int64, float16, float32,
            float64, bfloat16 (a numpy or torch dtype is accepted and named), or
            "string": a text field (shape (), a step field; `arrowbuf.text`).
        shape: the shape of one step's value; () for scalars. ``(None,)`` makes a
            ragged field, a sequence of any length per step (token ids), and
            ``(None, k)`` one of rows of k values (`arrowbuf.ragged`): stored without
            padding, sampled as a jagged ``torch.nested`` tensor.
        observation: True for fields whose next value is read from the next row.
        derived: True for per-step columns the store computes (``advantage``,
            ``value_target`` of `ExperienceStore.compute_gae`): writes may leave
            them out, and they are zero until computed.
        codec: store each row encoded (`arrowbuf.codecs`): ``"jpeg"``/``"jpeg:Q"``
            (lossy; uint8 (H, W, C)), ``"png"``, ``"zstd"``/``"zstd:L"`` (lossless).
            Rows are encoded when written and decoded when sampled; the field reads
            as its decoded rows everywhere, and exports as Arrow ``binary``.
        max_bytes: the most bytes of an encoded or ragged field's rows the store holds
            (over all shards, like ``capacity``): a write evicts the oldest episodes
            until its rows fit. None (the default): only ``capacity`` bounds the store.

    Raises:
        SchemaError: an unknown dtype or codec, a codec the dtype or shape cannot
            take, a shape with negative or non-integer sizes, or an ``observation`` or
            ``derived`` that is not a bool.
    """

    dtype: str
    shape: tuple[int, ...] = ()
    observation: bool = False
    derived: bool = False
    codec: str | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        try:
            given = tuple(self.shape)
            ragged = bool(given) and given[0] is None
            # Ints only: int(2.5) would silently make the field (2,).
            if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in given[ragged:]):
                raise TypeError
            shape = tuple(int(s) for s in given[ragged:])
        except (TypeError, ValueError):
            raise SchemaError(f"shape must be a tuple of ints (the first may be None: a ragged field), "
                              f"got {self.shape!r}") from None
        for flag in ("observation", "derived"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise SchemaError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
            object.__setattr__(self, flag, bool(getattr(self, flag)))
        if any(s < 1 for s in shape):
            raise SchemaError(f"shape must have positive sizes, got {given} (Arrow's fixed-shape tensors need them)")
        if ragged and (self.observation or self.codec is not None or len(shape) > 1):
            raise SchemaError(f"a ragged field (shape {given}) " + (
                "cannot be an observation yet: store the sequence as a step field (a prompt, a response)"
                if self.observation else "cannot have a codec" if self.codec is not None else
                "is (None,) or (None, k): a sequence of values, or of rows of k values"))
        object.__setattr__(self, "shape", (None, *shape) if ragged else shape)
        if self.dtype == "string" and (shape or ragged or self.observation or self.codec is not None
                                       or self.max_bytes is not None):
            raise SchemaError(f"a text field (dtype 'string') holds one str per step: shape (), a step field, no "
                              f"codec or max_bytes; got shape {given}, observation={self.observation}, "
                              f"codec={self.codec!r}, max_bytes={self.max_bytes!r}")
        if self.codec is not None:
            self.encoder   # checked now (names the fix); kept for the column
        if self.max_bytes is not None:
            if self.codec is None and not ragged:
                raise SchemaError(f"max_bytes={self.max_bytes!r} bounds the bytes of an encoded or ragged field's "
                                  "rows; this field is neither (its rows take row_bytes each: bound them by capacity)")
            if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, (int, np.integer)) \
                    or self.max_bytes < 1:
                raise SchemaError(f"max_bytes must be a positive int (bytes), got {self.max_bytes!r}")
            object.__setattr__(self, "max_bytes", int(self.max_bytes))

    @property
    def encoder(self) -> Any:
        """The `arrowbuf.codecs.Codec` of an encoded field (None without ``codec``)."""
        return None if self.codec is None else _encoder(self.codec, self.dtype, self.shape)

    @property
    def text(self) -> bool:
        """Whether a step holds a ``str`` (dtype ``"string"``: `arrowbuf.text`)."""
        return self.dtype == "string"

    @property
    def ragged(self) -> bool:
        """Whether a step holds a sequence of any length (shape ``(None, ...)``)."""
        return bool(self.shape) and self.shape[0] is None

    @property
    def stored_bytes(self) -> int:
        """Bytes an arena row of this field takes up front: `row_bytes`, or an encoded or
        ragged field's 16 of address and size (its bytes come as rows are written)."""
        return 16 if self.codec is not None or self.ragged else self.row_bytes

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of the stored column (uint16 for bfloat16)."""
        return _DTYPES[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of sampled tensors (imports torch)."""
        return _lazy_torch.dtype(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes one step of this field takes (0 for a ragged field: it varies)."""
        if self.ragged:
            return 0
        if self.text:
            return 4   # its code
        return int(self.numpy_dtype.itemsize * np.prod(self.shape, dtype=np.int64))

    def arrow_type(self) -> pa.DataType:
        """The Arrow type of this column (``binary`` for an encoded one: the rows as stored)."""
        if self.codec is not None:
            return pa.large_binary()   # 64-bit offsets: a run of encoded rows may pass 2 GiB
        if self.text:   # each string once, and a code a row
            return pa.dictionary(pa.int32(), pa.large_string())
        value_type = pa.bool_() if self.dtype == "bool" else pa.from_numpy_dtype(self.numpy_dtype)
        if self.ragged:   # Arrow's list layout: values and (64-bit) offsets
            return pa.large_list(pa.list_(value_type, self.shape[1]) if len(self.shape) > 1 else value_type)
        if not self.shape:
            return value_type
        return pa.fixed_shape_tensor(value_type, list(self.shape))


@functools.lru_cache(maxsize=None)
def _encoder(codec: str, dtype: str, shape: tuple[int, ...]) -> Any:
    from arrowbuf.codecs import parse_codec

    return parse_codec(codec, dtype, shape)


def dtype_name(dtype: Any) -> str:
    """The arrowbuf name of a numpy dtype, torch dtype or dtype name.

    Raises:
        SchemaError: the dtype has no arrowbuf equivalent.
    """
    if _lazy_torch.is_dtype(dtype):
        name = _lazy_torch.name_of(dtype)
    elif dtype is str:
        name = "string"
    elif isinstance(dtype, str) and dtype in _DTYPES:
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if name not in _DTYPES:
        raise SchemaError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return name


def dtype_itemsize(name: str) -> int:
    """Bytes per value of a dtype named by arrowbuf (`Field.dtype`) or numpy (`np.dtype.name`)."""
    found = _DTYPES.get(name)
    return (found if found is not None else np.dtype(name)).itemsize


def tensor_on_cpu(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor`` detached and on the CPU.

    Raises:
        SchemaError: naming ``what`` (a field, an argument), when its device holds no
            data to copy (torch's ``meta``) or cannot be read from here.
    """
    try:
        return tensor.detach().cpu()
    except (NotImplementedError, RuntimeError) as err:
        raise SchemaError(f"{what}: a tensor on device {tensor.device} whose data cannot be copied to the CPU "
                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); pass a CPU or "
                          "CUDA tensor or an array") from None


def as_array(value: Any, name: str) -> tuple[np.ndarray, str]:
    """A numpy view (no copy where possible) of one column and its dtype name.

    torch tensors are detached and moved to the CPU; bfloat16 tensors are viewed as
    uint16 bits. Lists and scalars go through `np.asarray`.

    Raises:
        SchemaError: the value cannot be read as an array of a supported dtype.
    """
    if _lazy_torch.is_tensor(value):
        import torch

        if value.is_nested:
            rows = ragged_rows(value, name)
            return rows, _ragged_name(value, rows, name)
        tensor = tensor_on_cpu(value, f"field {name!r}")
        if tensor.dtype == torch.bfloat16:   # a same-size view: strided tensors need no copy
            return tensor.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        dtype = _lazy_torch.name_of(tensor.dtype)
        if dtype not in _DTYPES:
            raise SchemaError(f"field {name!r}: unsupported dtype {tensor.dtype}")
        return tensor.numpy(), dtype
    strings = text_values(value, name)
    if strings is not None:
        return strings, "string"
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_list(value.type) or pa.types.is_large_list(value.type):
            return ragged_rows(value, name), ""
        return arrow_to_numpy(value, name), ""
    if isinstance(value, RaggedRows) or (isinstance(value, (list, tuple)) and _uneven(value)):
        rows = ragged_rows(value, name)
        return rows, _ragged_name(value, rows, name)
    try:
        array = np.asarray(value)
    except ValueError as err:   # nested lists of uneven lengths below the first level
        raise SchemaError(f"field {name!r}: {describe(value)} has no one shape ({str(err).split('. ')[-1]}); a "
                          "ragged field takes one list of sequences per episode (or per writer step)") from None
    dtype = _NUMPY_NAMES.get(array.dtype)
    if dtype is None:
        raise SchemaError(
            f"field {name!r}: unsupported dtype {array.dtype} ({describe(value)}); "
            f"expected one of {sorted(_DTYPES)}"
        )
    return array, dtype


def _ragged_name(value: Any, rows: RaggedRows, name: str) -> str:
    """The dtype name of ragged ``rows`` read from ``value``: "bfloat16" for bfloat16 tensors
    (read as their uint16 bits), else the rows' numpy dtype's.

    Raises:
        SchemaError: naming the field, for rows of bfloat16 tensors beside rows of another
            dtype (their bits would pass for uint16 values).
    """
    given = [row for row in value if len(row)] if isinstance(value, (list, tuple)) else [value]
    bf16 = [_lazy_torch.is_tensor(row) and _lazy_torch.name_of(row.dtype) == "bfloat16" for row in given]
    if any(bf16) and not all(bf16):
        raise SchemaError(f"field {name!r}: rows of bfloat16 tensors beside rows of other dtypes; a ragged field's "
                          "rows share one dtype")
    return "bfloat16" if given and all(bf16) else _NUMPY_NAMES.get(rows.dtype, "")


def _uneven(value: list | tuple) -> bool:
    """Whether ``value`` is a list of sequences of different lengths (ragged rows)."""
    lengths = set()
    for item in value:
        if _lazy_torch.is_tensor(item) or isinstance(item, np.ndarray):
            if item.ndim == 0:
                return False
            lengths.add(item.shape[0])
        elif isinstance(item, (list, tuple)):
            lengths.add(len(item))
        else:
            return False
    return len(lengths) > 1


def arrow_to_numpy(column: pa.Array | pa.ChunkedArray, name: str,
                   shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A numpy array of an Arrow column, rows first (zero-copy for numeric columns).

    Fixed-shape tensors keep their shape; a plain fixed-size list column gets the
    per-row ``shape`` (its list size when None). Booleans are unpacked from bits.

    Raises:
        SchemaError: the column has nulls.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise SchemaError(f"field {name!r} has {column.null_count} nulls; arrowbuf columns have none")
    if isinstance(column.type, pa.FixedShapeTensorType):
        shape = tuple(column.type.shape)
        column = column.storage
    if pa.types.is_fixed_size_list(column.type):
        values = column.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(column), *(shape if shape is not None else (column.type.list_size,)))
    return column.to_numpy(zero_copy_only=False)


def numpy_to_arrow(field: Field, array: np.ndarray) -> pa.Array:
    """An Arrow array over ``array`` (rows of ``field``) without copying it.

    bool columns are the exception: Arrow packs booleans into bits, so they are
    converted (1/8 of a byte per value).
    """
    if field.text:     # strings: a dictionary array as stored, else plain
        return array if isinstance(array, pa.Array) else pa.array(np.asarray(array).tolist(), pa.large_string())
    if field.ragged:   # values and offsets
        return ragged_rows(array, "?").to_arrow(pa.bool_() if field.dtype == "bool" else None)
    if field.codec is not None:   # the rows as stored, or rows to encode
        if isinstance(array, EncodedRows):
            return array.array
        if isinstance(array, pa.Array):
            return array
        from arrowbuf.codecs import encode_rows

        return pa.array(encode_rows(field.encoder, np.asarray(array, field.numpy_dtype)), pa.large_binary())
    flat = np.ascontiguousarray(array).reshape(-1)
    if field.dtype == "bool":
        values = pa.array(flat, pa.bool_())
    else:
        values = pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), flat.size, [None, pa.py_buffer(flat)])
    if not field.shape:
        return values
    storage = pa.FixedSizeListArray.from_arrays(values, int(np.prod(field.shape)))
    return pa.ExtensionArray.from_storage(field.arrow_type(), storage)


def export_type(field: Field) -> pa.DataType:
    """The Arrow type of ``field`` in a Parquet export: its `Field.arrow_type`, with
    bfloat16 widened to float32 (every bf16 value is a float32: its top 16 bits)."""
    if field.text:
        return pa.large_string()
    if field.dtype != "bfloat16" or field.codec is not None or field.ragged:
        return field.arrow_type()
    return pa.fixed_shape_tensor(pa.float32(), list(field.shape)) if field.shape else pa.float32()


def export_array(field: Field, stored: pa.Array) -> pa.Array:
    """Rows of ``field`` as stored (scalars, or a ``fixed_size_list`` of the flattened
    shape; bfloat16 as uint16 bits) in the `export_type` encoding. Zero-copy but for
    bfloat16, whose float32 values are a new array twice its size."""
    if field.text:
        return stored.dictionary_decode().cast(pa.large_string()) if pa.types.is_dictionary(stored.type) \
            else stored.cast(pa.large_string())
    if field.codec is not None or field.ragged:
        return stored
    if field.dtype == "bfloat16":
        bits = (stored.flatten() if field.shape else stored).to_numpy(zero_copy_only=False)
        words = bits.astype(np.uint32)
        widened = pa.array(np.left_shift(words, 16, out=words).view(np.float32), pa.float32())
        stored = pa.FixedSizeListArray.from_arrays(widened, int(np.prod(field.shape))) if field.shape else widened
    if not field.shape:
        return stored
    return pa.ExtensionArray.from_storage(export_type(field), stored)


def narrow_bfloat16(values: np.ndarray, name: str) -> np.ndarray:
    """The uint16 bits of float32 ``values`` that are bfloat16 values (an export's
    widened column): bit-exact, NaN payloads included.

    Raises:
        SchemaError: naming the field and the first value that has no exact bfloat16
            (its low 16 bits are set: the column was not written from bfloat16).
    """
    words = np.ascontiguousarray(values, np.float32).view(np.uint32)
    inexact = np.flatnonzero(words.reshape(-1) & 0xFFFF)
    if inexact.size:
        value = float(values.reshape(-1)[inexact[0]])
        raise SchemaError(f"field {name!r} is bfloat16, but its float32 value {value!r} (element {int(inexact[0])}) "
                          "has no exact bfloat16; an export stores bfloat16 fields as float32 values that are "
                          "bfloat16 exactly")
    return (words >> 16).astype(np.uint16)


def check_column(field: Field, name: str, array: np.ndarray, dtype: str, leading: int = 1) -> None:
    """Check one column's dtype and per-step shape (after ``leading`` batch dimensions).

    Raises:
        SchemaError: naming the field, the value received and what was expected.
    """
    if isinstance(array, EncodedRows):   # rows encoded elsewhere (an import, an episode read back)
        array.check(name)
    if field.ragged or isinstance(array, RaggedRows):
        _check_ragged(field, name, array, dtype, leading)
        return
    if field.text != (dtype == "string"):
        raise SchemaError(f"field {name!r}: got {describe(array)}; " + (
            "a text field takes str values (one per step, or per env)" if field.text else
            f"expected {field.dtype} values, not strings: declare ab.Field('string') for text"))
    if array.ndim < leading:
        raise SchemaError(f"field {name!r}: got {describe(array)}; expected {leading} leading dimension(s) "
                          f"before the per-step shape {field.shape}")
    if tuple(array.shape[leading:]) != field.shape:
        raise SchemaError(f"field {name!r}: per-step shape {tuple(array.shape[leading:])} "
                          f"(from {describe(array)}); expected {field.shape}")
    received = _check_dtype(field, name, array, dtype)
    limit = exact_int_limit(received, field.dtype)
    count = 0 if isinstance(array, EncodedRows) else array.size if isinstance(array, np.ndarray) else array.numel()
    if limit is not None and count:   # numpy or torch
        low, high = int(array.min()), int(array.max())
        if low < -limit or high > limit:
            bad = high if high > limit else low
            raise SchemaError(f"field {name!r}: {received} value {bad} has no exact {field.dtype} (integers are "
                              f"exact up to 2**{limit.bit_length() - 1} = {limit:,} in magnitude); store the "
                              f"field as {received}, or cast it yourself if rounding is acceptable")


def _check_ragged(field: Field, name: str, array: Any, dtype: str, leading: int) -> None:
    if not field.ragged:
        raise SchemaError(f"field {name!r}: got ragged rows (sequences of lengths {array.lengths[:6].tolist()}...); "
                          f"the field is {field.dtype} {field.shape}: give each step the same shape, or declare "
                          f"ab.Field({field.dtype!r}, (None, ...)) for sequences of any length")
    if not isinstance(array, RaggedRows):   # dense [n, L, *tail]: rows of one length
        if array.ndim != leading + len(field.shape) or tuple(array.shape[leading + 1:]) != field.shape[1:]:
            raise SchemaError(f"field {name!r}: got {describe(array)}; a ragged field {field.shape} takes a list "
                              "of sequences (one per step or env), a jagged nested tensor, or an [n, L"
                              f"{''.join(', ' + str(s) for s in field.shape[1:])}] array")
    elif array.tail != field.shape[1:]:
        raise SchemaError(f"field {name!r}: ragged rows of items {array.tail}; the field's items are "
                          f"{field.shape[1:]} (shape {field.shape})")
    _check_dtype(field, name, array, dtype)


def _check_dtype(field: Field, name: str, array: Any, dtype: str) -> str:
    """The name of the dtype ``array`` holds (``dtype`` when given), when it casts to ``field``'s without loss.

    Raises:
        SchemaError: naming the field, the dtype received and the one expected.
    """
    received = dtype or _NUMPY_NAMES.get(array.dtype) or array.dtype.name
    if not dtype_fits(received, field.dtype):
        raise SchemaError(f"field {name!r}: dtype {received}; expected {field.dtype} "
                          "(or a dtype that casts to it without loss)")
    return received


@functools.lru_cache(maxsize=None)
def dtype_fits(received: str, expected: str) -> bool:
    """Whether values of dtype ``received`` can be stored as ``expected`` without loss."""
    if received == expected:
        return True
    if "bfloat16" in (received, expected) or "string" in (received, expected):
        return False
    return bool(np.can_cast(np.dtype(received), np.dtype(expected), "safe"))


@functools.lru_cache(maxsize=None)
def exact_int_limit(received: str, expected: str) -> int | None:
    """The largest magnitude up to which every integer of dtype ``received`` is
    exact in float dtype ``expected``, when some are not (int64 -> float64:
    2**53); None when every value casts exactly, or for other kinds of cast."""
    if received == expected or "bfloat16" in (received, expected) or "string" in (received, expected):
        return None
    source, target = np.dtype(received), np.dtype(expected)
    if source.kind not in "iu" or target.kind != "f":
        return None
    exact_bits = np.finfo(target).nmant + 1
    return 2 ** exact_bits if np.iinfo(source).bits - (source.kind == "i") > exact_bits else None
