"""Text fields (``ab.Field("string")``): a language instruction or a task name per step.

A `TextColumn` keeps each row as an int32 code into the column's dictionary of the strings
it has seen (code 0 is ``""``, what a row never written holds): an instruction repeated for
every step of an episode is stored once, plus 4 bytes a step. The dictionary only grows; it
suits instructions, task names and other strings that repeat, not free text unique to every
step. Rows are written as ``str`` (a list with one per step or per env, or an array or Arrow
array of them), read back as numpy object arrays of ``str``, exported as Arrow strings (a
store's `to_arrow` gives a dictionary array: the codes and the strings once), and sampled
as a tensordict ``NonTensorStack`` of ``str``.

Example:
    >>> column = TextColumn(4)
    >>> column[np.array([0, 2])] = ["pick the cup", "pick the cup"]
    >>> column[np.arange(4)].tolist(), len(column.strings)
    (['pick the cup', '', 'pick the cup', ''], 2)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf.errors import SchemaError, describe


def text_values(value: Any, name: str) -> np.ndarray | None:
    """``value`` as a numpy object array of ``str`` when it holds strings (a list or tuple of
    ``str``, a numpy string array, an Arrow string or dictionary array); None otherwise.

    Raises:
        SchemaError: naming the field, for a list that mixes strings with other values, or a
            string that is not valid Unicode text (`_utf8`).
    """
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        kind = value.type.value_type if pa.types.is_dictionary(value.type) else value.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return None
        if value.null_count:
            raise SchemaError(f"field {name!r} has {value.null_count} nulls; arrowbuf columns have none")
        return np.array(value.to_pylist(), dtype=object)
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "U":
            return _utf8(value.astype(object), name)
        if value.dtype == object and value.size and all(isinstance(v, str) for v in value.reshape(-1).tolist()):
            return _utf8(value, name)
        return None
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, str) for v in value):
        if not all(isinstance(v, str) for v in value):
            raise SchemaError(f"field {name!r}: {describe(value)} mixes strings with other values; a text "
                              "field takes one str per step (or per env)")
        array = np.empty(len(value), object)
        array[:] = value
        return _utf8(array, name)
    return None


def _utf8(strings: np.ndarray, name: str) -> np.ndarray:
    """``strings``, checked to be valid Unicode text: a lone surrogate (``"\\ud800"``, as a bad
    ``surrogateescape`` decode leaves) has no UTF-8 bytes, so Arrow, exports and Ray blocks could
    never read the column again once its dictionary held one.

    Raises:
        SchemaError: naming the field and the first such string.
    """
    flat = strings.reshape(-1).tolist()
    try:
        "".join(flat).encode("utf-8")   # one pass; Python never pairs surrogates across strings
    except UnicodeEncodeError:
        bad = next(text for text in flat if not _encodes(text))
        raise SchemaError(f"field {name!r}: {bad!r} is not valid Unicode text (it holds a lone surrogate, which "
                          "UTF-8 cannot encode); expected str values that encode as UTF-8 (decode bytes with "
                          "errors='replace' rather than 'surrogateescape')") from None
    return strings


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class TextColumn:
    """``rows`` rows of a text field: int32 codes into ``strings`` (code 0: ``""``)."""

    def __init__(self, rows: int, name: str = "") -> None:
        self.codes = np.zeros(rows, np.int32)   # pages faulted in as rows are written
        self.strings: list[str] = [""]
        self._code_of: dict[str, int] = {"": 0}
        self._table: np.ndarray | None = None   # strings as an object array, for reads
        self._arrow_strings: pa.Array | None = None   # strings as an Arrow array, for `stored`
        self.shape, self.ndim, self.dtype = (rows,), 1, np.dtype(object)
        self.name = name   # the field's, for errors

    def __len__(self) -> int:
        return len(self.codes)

    def code(self, values: np.ndarray) -> np.ndarray:
        """The codes of ``values`` (strings), new strings added to the dictionary."""
        if not len(values):
            return np.zeros(0, np.int32)
        distinct, inverse = np.unique(values, return_inverse=True)
        codes = np.empty(len(distinct), np.int32)
        for i, text in enumerate(distinct.tolist()):
            found = self._code_of.get(text)
            if found is None:
                found = self._code_of[text] = len(self.strings)
                self.strings.append(text)
            codes[i] = found
        return codes[inverse.reshape(-1)]

    def fill(self, strings: np.ndarray, index: np.ndarray) -> None:
        """Every row at once: row i holds ``strings[index[i]]`` (strings checked by the caller)."""
        self.codes[:] = self.code(strings)[index]

    def __setitem__(self, key: Any, value: Any) -> None:
        """Store ``value`` (strings: one per row of ``key``, or one for all; 0: ``""``) at ``key``."""
        if np.isscalar(value) and not isinstance(value, str) and value == 0:
            self.codes[key] = 0
            return
        values = text_values([value] if isinstance(value, str) else value, self.name or "?")
        if values is None:
            raise SchemaError(f"field {self.name!r} is text: got {describe(value)}; expected str values")
        self.codes[key] = self.code(values.reshape(-1))

    def __getitem__(self, key: Any) -> np.ndarray:
        """The rows ``key`` as a numpy object array of ``str``."""
        if self._table is None or len(self._table) != len(self.strings):   # the dictionary grew
            self._table = np.array(self.strings + [None], dtype=object)[:-1]   # (1-D even for list-like strings)
        return self._table[self.codes[key]]

    def stored(self, start: int, stop: int) -> pa.Array:
        """Rows ``[start, stop)`` as an Arrow dictionary array: their codes (a copy) and the strings."""
        if self._arrow_strings is None or len(self._arrow_strings) != len(self.strings):   # strings only grow
            self._arrow_strings = pa.array(self.strings, pa.large_string())
        return pa.DictionaryArray.from_arrays(pa.array(self.codes[start:stop]), self._arrow_strings)

    def batch_value(self, rows: np.ndarray, tensor_dtype: str = "string") -> Any:
        """Rows ``rows`` as a batch holds them: a tensordict ``NonTensorStack`` of ``str``."""
        from tensordict import NonTensorStack

        return NonTensorStack.from_list(self[rows].tolist())

    @property
    def nbytes(self) -> int:
        """Bytes of the column: 4 a row of the arena (a row's page is faulted in by its first
        write), and each string once."""
        return self.codes.nbytes + sum(len(s.encode()) for s in self.strings)
