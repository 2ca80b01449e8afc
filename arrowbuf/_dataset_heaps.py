"""Encoded, ragged and text fields in a dataset cache: their rows' bytes, never decoded or padded.

An arrowbuf export holds an encoded field (``codec=``) as each row's bytes and a ragged
field in Arrow's list layout; a dataset's cache keeps them so. Each such field has a
file of its own, ``heap-<k>.bytes``: its rows' bytes one after another in row order (an
encoded row's bytes as the source held them; a ragged row's values, item after item).
``rows.arrow`` holds, per row, where they lie in that file (`HEAP_REF`: offset and size,
16 bytes). A PNG field's cache is then about the export's size, where its decoded rows
took 10x more. A text field's file holds each distinct string's UTF-8 bytes once (an
instruction repeated for every step of every episode: once), each row's reference pointing
at its string; a dataset reads them into a `arrowbuf.text.TextColumn` when it opens (`text_column`).

A conversion appends each batch's bytes as its rows stream in (`HeapFiles`: memory stays
bounded, and the disk holds one copy). A dataset maps each file (`MappedHeap`) and reads
the field through the field's own column kind over it (`arrowbuf.columns.mapped_column`):
an `arrowbuf.encoded.EncodedColumn` decodes the rows a batch gathers straight into the
batch (``keys=`` that leave it out decode nothing), an `arrowbuf.ragged.RaggedColumn`
gathers its rows as a jagged nested tensor, as a store's columns do.

An encoded row whose bytes do not decode is a `FormatError` naming the field and the row
(its position in ``dataset.to_arrow()``). A reference that points outside its file (damage
behind the stat the manifest recorded, which only ``verify=True`` finds by hashing) is a
`FormatError` naming the field: a gather never reads past the mapping.

Example:
    >>> import tempfile
    >>> from arrowbuf.ragged import ragged_rows
    >>> schema, directory = Schema({"tokens": Field("int32", (None,))}), Path(tempfile.mkdtemp())
    >>> heaps = heap_fields(schema)
    >>> heaps
    {'tokens': 'heap-0.bytes'}
    >>> with HeapFiles(directory, schema, heaps) as files:
    ...     refs = files.append("tokens", ragged_rows([np.arange(3), np.arange(1)], "tokens"), "example")
    >>> refs.tolist()                                   # each row's (offset, size) in heap-0.bytes
    [[0, 12], [12, 4]]
    >>> data = np.fromfile(directory / "heap-0.bytes", np.uint8)
    >>> column = heap_column(schema.fields["tokens"], "tokens", refs, data, directory / "heap-0.bytes")
    >>> column.gather(np.array([1, 0])).values.tolist()
    [0, 0, 1, 2]
"""

from __future__ import annotations

import re
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Mapping

import numpy as np
import pyarrow as pa

from arrowbuf.columns import mapped_column
from arrowbuf.encoded import EncodedRows
from arrowbuf.errors import FormatError, describe
from arrowbuf.fields import Field
from arrowbuf.ragged import RaggedRows
from arrowbuf.schema import Schema
from arrowbuf.text import TextColumn

#: What ``rows.arrow`` stores per row of an encoded, ragged or text field: (offset, size) of its bytes in the field's file.
HEAP_REF = Field("int64", (2,))
#: Distinct strings of a text field a conversion remembers, to write each once (later ones are written per batch).
TEXT_REMEMBERED = 1 << 16
_FILE = "heap-{}.bytes"
_FILE_NAME = re.compile(r"heap-[0-9]+\.bytes")


def is_heap_file(name: str) -> bool:
    """Whether ``name`` is the name of a heap file (a cache's manifest lists no other files but its own)."""
    return _FILE_NAME.fullmatch(name) is not None


def heap_fields(schema: Schema) -> dict[str, str]:
    """{field: file} of ``schema``'s encoded, ragged and text fields: the files a cache keeps their bytes in."""
    names = [name for name, spec in schema.fields.items() if spec.codec is not None or spec.ragged or spec.text]
    return {name: _FILE.format(k) for k, name in enumerate(names)}


class HeapFiles:
    """The heap files a conversion writes into ``directory``, one per field of ``heaps``
    (`heap_fields`); `append` each batch's rows of a field in row order."""

    def __init__(self, directory: Path, schema: Schema, heaps: Mapping[str, str]) -> None:
        self._specs = {name: schema.fields[name] for name in heaps}
        self._ends = dict.fromkeys(heaps, 0)
        self._written: dict[str, dict[str, tuple[int, int]]] = {name: {} for name in heaps}   # text: each string once
        self._files: dict[str, BinaryIO] = {}
        for name, file in heaps.items():
            self._files[name] = open(directory / file, "wb")

    def append(self, name: str, rows: Any, where: str) -> np.ndarray:
        """Append ``rows`` of field ``name`` (an encoded field's `EncodedRows`, a ragged field's
        `RaggedRows`, as a source gives them) to its file; returns their `HEAP_REF` rows.

        Raises:
            FormatError: rows of another kind than the field's (naming ``where``).
        """
        spec = self._specs[name]
        if spec.text:
            return self._append_text(name, rows, where)
        data, offsets = _encoded_bytes(rows, name, where) if spec.codec is not None else \
            _ragged_bytes(rows, spec, name, where)
        self._files[name].write(data)
        refs = np.empty((len(offsets) - 1, 2), np.int64)
        refs[:, 0] = offsets[:-1] + self._ends[name]
        refs[:, 1] = np.diff(offsets)
        self._ends[name] += int(offsets[-1])
        return refs

    def _append_text(self, name: str, rows: Any, where: str) -> np.ndarray:
        """A text field's rows: each distinct string's UTF-8 bytes written once (the first
        `TEXT_REMEMBERED` of them; an instruction repeated for every step is stored once), every
        row's `HEAP_REF` pointing at them."""
        if not isinstance(rows, np.ndarray) or rows.dtype != object:
            raise FormatError(f"{where}: field {name!r} is text; its rows came as {describe(rows)}, not as str values")
        refs = np.empty((len(rows), 2), np.int64)
        if not len(rows):
            return refs
        distinct, inverse = np.unique(rows, return_inverse=True)
        written, places = self._written[name], np.empty((len(distinct), 2), np.int64)
        for k, text in enumerate(distinct.tolist()):
            place = written.get(text)
            if place is None:
                data = text.encode()
                place = (self._ends[name], len(data))
                self._files[name].write(data)
                self._ends[name] += len(data)
                if len(written) < TEXT_REMEMBERED:
                    written[text] = place
            places[k] = place
        refs[:] = places[inverse.reshape(-1)]
        return refs

    def close(self) -> None:
        for file in self._files.values():
            file.close()

    def __enter__(self) -> "HeapFiles":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _encoded_bytes(rows: Any, name: str, where: str) -> tuple[memoryview | bytes, np.ndarray]:
    """(the bytes of encoded ``rows`` one after another, their offsets from 0): views of the Arrow array."""
    if not isinstance(rows, EncodedRows):
        raise FormatError(f"{where}: field {name!r} is encoded; its rows came as {describe(rows)}, not as their bytes")
    array = rows.array if pa.types.is_large_binary(rows.array.type) else rows.array.cast(pa.large_binary())
    if not len(array):
        return b"", np.zeros(1, np.int64)
    offsets = np.frombuffer(array.buffers()[1], np.int64)[array.offset:array.offset + len(array) + 1]
    data = array.buffers()[2]
    start, stop = int(offsets[0]), int(offsets[-1])
    return (memoryview(data)[start:stop] if data is not None else b""), offsets - start


def _ragged_bytes(rows: Any, spec: Field, name: str, where: str) -> tuple[memoryview, np.ndarray]:
    """(the values of ragged ``rows`` as bytes, each row's byte offset from 0)."""
    if not isinstance(rows, RaggedRows):
        raise FormatError(f"{where}: field {name!r} is ragged; its rows came as {describe(rows)}, not as "
                          "values and offsets")
    first, last = int(rows.offsets[0]), int(rows.offsets[-1])
    values = np.ascontiguousarray(rows.values[first:last], spec.numpy_dtype)
    item = values.dtype.itemsize * int(np.prod(spec.shape[1:], dtype=np.int64))
    return memoryview(values.reshape(-1).view(np.uint8)), (rows.offsets - first) * item


def cache_heaps(manifest: Mapping[str, Any], schema: Schema, path: Path) -> dict[str, str]:
    """{field: file} of the heap files a cache manifest (at ``path``, of ``schema``) records. An
    encoded field without one is stored decoded, as caches before format 4 stored it (and are
    read so).

    Raises:
        FormatError: a bad entry, one of a field that is neither encoded nor ragged, or of a
            file the manifest does not list, a ragged field without one, or one in a cache
            older than format 4.
    """
    heaps = manifest.get("heaps", {})
    if not isinstance(heaps, dict) or (heaps and manifest["format_version"] < 4):
        raise FormatError(f"{path}: manifest entry 'heaps' is {heaps!r}; expected a mapping, in a cache of "
                          "format 4 or later")
    for name, file in heaps.items():
        spec = schema.fields.get(name)
        if spec is None or not (spec.codec is not None or spec.ragged or spec.text):
            raise FormatError(f"{path}: heap file {file!r} of field {name!r}, which is not an encoded, ragged or "
                              f"text field of the cache's schema ({spec!r})")
        if not isinstance(file, str) or not is_heap_file(file) or file not in manifest["files"]:
            raise FormatError(f"{path}: heap file {file!r} of field {name!r} is not a cache file the manifest lists")
    missing = [name for name, spec in schema.fields.items() if (spec.ragged or spec.text) and name not in heaps]
    if missing:
        raise FormatError(f"{path}: ragged or text fields {missing} have no heap file in the manifest")
    return dict(heaps)


class MappedHeap:
    """The bytes of one field's rows: its heap file, mapped read-only (``data``, uint8).

    Read by the field's column as its `arrowbuf.byte_heap.ByteHeap` would be: `view`
    returns a row's bytes, after checking that they lie inside the file and hold whole
    items of ``unit`` bytes (a ragged field's).
    """

    def __init__(self, data: np.ndarray, name: str, file: Path, unit: int = 1) -> None:
        self.data, self.name, self.file, self.unit = data, name, file, unit
        self.live = self.allocated = len(data)

    def view(self, addr: int, size: int) -> np.ndarray:
        """The bytes ``[addr, addr + size)`` (a view of the mapping).

        Raises:
            FormatError: they lie outside the file or cut an item.
        """
        if addr < 0 or size < 0 or addr + size > len(self.data) or size % self.unit:
            raise FormatError(f"{self.file}: field {self.name!r} has a row at bytes {addr}..{addr + size} of this "
                              f"{len(self.data)}-byte file{f' in items of {self.unit} bytes' if self.unit > 1 else ''}; "
                              "the cache is damaged (open the source with verify=True, or delete the cache, to "
                              "convert again)")
        return self.data[addr:addr + size]

    def views(self, addr: np.ndarray, size: np.ndarray) -> list:
        """`view` of each row (``addr``, ``size``: int64 arrays; b"" for a row of size 0), each checked.

        Raises:
            FormatError: a row lies outside the file or cuts an item.
        """
        # ``addr > len - size`` (with ``size >= 0``): ``addr + size`` of damaged refs can wrap past int64
        bad = (size != 0) & ((addr < 0) | (size < 0) | (addr > len(self.data) - size) | (size % self.unit != 0))
        if bad.any():
            at = int(np.argmax(bad))
            self.view(int(addr[at]), int(size[at]))   # raises, naming the row's bytes
        data = self.data
        return [data[a:b] if a < b else b"" for a, b in zip(addr.tolist(), (addr + size).tolist())]


def heap_column(spec: Field, name: str, refs: np.ndarray, data: np.ndarray, file: Path) -> Any:
    """Field ``name``'s read-only column, its rows at ``refs`` (`HEAP_REF` rows) in ``data`` (its
    heap ``file``, mapped): of the field's own kind (`arrowbuf.columns.mapped_column`); a text
    field's strings read into a `arrowbuf.text.TextColumn` (`text_column`)."""
    if spec.text:
        return text_column(name, refs, MappedHeap(data, name, file))
    unit = 1 if spec.codec is not None else spec.numpy_dtype.itemsize * int(np.prod(spec.shape[1:], dtype=np.int64))
    return mapped_column(spec, name, refs, MappedHeap(data, name, file, unit))


def text_column(name: str, refs: np.ndarray, heap: MappedHeap) -> TextColumn:
    """A text field's `TextColumn` (codes in memory, 4 bytes a row; each string once) of the
    rows at ``refs`` in ``heap``: a dataset samples it as a store samples its own.

    Raises:
        FormatError: a reference outside the file, or bytes that are not UTF-8 (naming the row).
    """
    column = TextColumn(len(refs), name)
    if not len(refs):
        return column
    keys = np.ascontiguousarray(refs, np.int64).view(np.dtype((np.void, 16))).reshape(-1)
    distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    strings = np.empty(len(distinct), object)
    for k, row in enumerate(first.tolist()):
        addr, size = (int(v) for v in refs[row])
        try:
            strings[k] = bytes(heap.view(addr, size)).decode()
        except UnicodeDecodeError as err:
            raise FormatError(f"{heap.file}: field {name!r}, row {row}: its bytes are not UTF-8 text ({err}); the "
                              "cache is damaged (open the source with verify=True, or delete the cache)") from None
    column.fill(strings, inverse.reshape(-1))
    return column
