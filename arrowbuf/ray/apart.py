"""Ragged and text fields of a Ray store's sealed blocks: stored as the shard stores them, gathered apart.

A block holds such a field as its shard's column stores it (`arrowbuf.columns.stored_rows`): a
ragged field's rows as `arrowbuf.ragged.RaggedRows` (one values array and offsets), a text field's
as an Arrow dictionary array (int32 codes, and only the strings its rows use: `stored_concat`).
They have no fixed row, so `arrowbuf.ray.gather.BlockGather` leaves them out of its pooled slot
and `ApartGather` adds them to each batch, as the embedded store's gather does (`arrowbuf.tensors`):

- a ragged field as a jagged ``torch.nested`` tensor, its values copied once, straight from
  the blocks into one buffer in batch order (`ragged_batch`);
- a text field as a tensordict ``NonTensorStack`` of ``str`` (each block's codes and strings
  read once into numpy, kept in the block's dict while it is cached).

Each batch position's item is found through the reader's ordering (`arrowbuf.ray.block_reads.BlockReads`):
its ordered position (``inv``), the block piece holding it, and its block-local step row (``rows[0]``).
A durable store's episode log does not take them yet (`refuse_durable_apart`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf.encoded import EncodedRows
from arrowbuf.layout import field_key
from arrowbuf.ragged import RaggedRows, nested, refuse_apart
from arrowbuf.schema import Schema


def refuse_durable_apart(schema: Schema | None) -> None:
    """Raise `SchemaError` for ragged or text fields in a durable store (before anything is written):
    its episode log's records hold fixed-shape columns only."""
    refuse_apart(schema, "a durable Ray store's episode log", "leave durable unset (save() checkpoints keep them)")


def stored_concat(parts: list[Any]) -> Any:
    """Rows of one field as stored, cut from several runs of an arena, as one column of a block:
    numpy rows concatenated, `EncodedRows` and `RaggedRows` joined, a text field's dictionary
    arrays as one whose dictionary holds only the strings its rows use."""
    first = parts[0]
    if isinstance(first, EncodedRows):
        return first if len(parts) == 1 else EncodedRows.concat(parts)
    if isinstance(first, RaggedRows):
        if len(parts) == 1:
            return first
        lengths = np.concatenate([p.lengths for p in parts])
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return RaggedRows(np.concatenate([p.values for p in parts]), offsets)
    if isinstance(first, pa.DictionaryArray):   # the parts share their column's dictionary (it only grows)
        codes = np.concatenate([p.indices.to_numpy(zero_copy_only=False) for p in parts])
        used, inverse = np.unique(codes, return_inverse=True)
        strings = parts[-1].dictionary.take(pa.array(used))
        return pa.DictionaryArray.from_arrays(pa.array(inverse.astype(np.int32).reshape(-1)), strings)
    return first if len(parts) == 1 else np.concatenate(parts)


def own_copy(column: Any) -> Any:
    """A block's column copied into this process's memory (`arrowbuf.ray.cache`'s ``copy_blocks``)."""
    if isinstance(column, EncodedRows):   # unpickled into this process's memory already
        return column
    if isinstance(column, RaggedRows):
        return RaggedRows(column.values.copy(), column.offsets.copy())
    if isinstance(column, pa.Array):   # Arrow buffers: copied by a round trip through its own pickling
        return pa.concat_arrays([column])
    return np.array(column, copy=True)


def _text(columns: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, strings as an object array) of a block's text column, read once and kept in its dict."""
    key = ("text", name)
    found = columns.get(key)
    if found is None:
        column = columns[name]
        strings = np.array(column.dictionary.to_pylist() + [None], dtype=object)[:-1]
        found = columns[key] = (column.indices.to_numpy(zero_copy_only=False), strings)
    return found


def _items(ordered: Any, start: int, stop: int, fields: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the block piece, the block-local step row) of each item at batch positions ``[start, stop)``.

    Raises:
        ValueError: the items are sequences (rows of more than one dimension), naming ``fields``.
    """
    rows = ordered.rows[0]
    if rows.ndim != 1:   # (step fields: n-step and frame stacks read them at the transition's row)
        raise ValueError(f"ragged and text fields {fields} are gathered one row per item, not in sequences; "
                         "leave them out with keys=")
    where = np.arange(start, stop) if ordered.inv is None else ordered.inv[start:stop]
    ends = np.array([hi for _, _, hi in ordered.pieces], np.int64)
    return np.searchsorted(ends, where, side="right"), rows[where]


def ragged_batch(sources: list[RaggedRows], piece: np.ndarray, rows: np.ndarray) -> RaggedRows:
    """Row ``rows[k]`` of ``sources[piece[k]]`` for every item k, their values copied once into one
    array: a concatenate of each row's view (for 256 rows of ~800 tokens, 4-10x faster than one
    fancy-indexed take of every value, whose index arrays cost as much as the copy)."""
    n = len(rows)
    starts, stops = np.zeros(n, np.int64), np.zeros(n, np.int64)
    touched = np.unique(piece).tolist()
    for p in touched:
        mine = piece == p
        bounds = sources[p].offsets
        starts[mine], stops[mine] = bounds[rows[mine]], bounds[rows[mine] + 1]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(stops - starts, out=offsets[1:])
    first = sources[touched[0]].values if touched else np.zeros(0)
    views = [sources[p].values[a:b] for p, a, b in zip(piece.tolist(), starts.tolist(), stops.tolist())]
    values = np.concatenate(views) if views else np.zeros((0, *first.shape[1:]), first.dtype)
    return RaggedRows(values, offsets)


class ApartGather:
    """The ragged and text fields of ``schema``, added to each batch a `BlockGather` gathers."""

    def __init__(self, schema: Schema) -> None:
        self.fields = {field_key(name): (name, spec) for name, spec in schema.fields.items()
                       if spec.ragged or spec.text}

    def chosen(self, keys: frozenset | None) -> list[tuple[str, ...]]:
        """The fields among ``keys`` (None: all)."""
        return [key for key in self.fields if keys is None or key in keys]

    def add(self, batch: Any, ordered: Any, start: int, stop: int, keys: frozenset | None,
            device: Any = None) -> Any:
        """``batch`` (the pooled fixed fields of batch positions ``[start, stop)``) with the chosen
        fields beside them, in a TensorDict of its own (the pooled one stays as it is)."""
        chosen = self.chosen(keys)
        if not chosen:
            return batch
        piece, rows = _items(ordered, start, stop, [self.fields[k][0] for k in chosen])
        out = batch.copy()
        for key in chosen:
            name, spec = self.fields[key]
            if spec.ragged:
                value = nested(ragged_batch([columns[name] for columns, _, _ in ordered.pieces], piece, rows),
                               spec.dtype)
            else:
                texts = np.empty(len(rows), object)
                for p in np.unique(piece).tolist():
                    mine = piece == p
                    codes, strings = _text(ordered.pieces[p][0], name)
                    texts[mine] = strings[codes[rows[mine]]]
                from tensordict import NonTensorStack

                value = NonTensorStack.from_list(texts.tolist())
            out.set(key, value if device is None or device.type == "cpu" else value.to(device))
        return out
