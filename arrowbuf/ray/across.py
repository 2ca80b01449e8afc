"""Reads of a Ray reader that cross blocks: an episode's pieces read as one, wherever they were sealed.

A Ray shard seals each piece of an episode (`arrowbuf.piece_cutting`) into whichever block is
open then, so the pieces of one episode often lie in different blocks. A reader's view places
its blocks one after the other (*virtual* rows, `arrowbuf.ray.views`), and its look-ups
(`arrowbuf.indexing.look_ahead`: n-step returns, frame stacks; a sampler's non-strict
sequence windows) go across an episode's held pieces in those rows, exactly as a local store's
go across its arena's. Two things here make that readable from blocks:

- `ViewRows`: a column of the view's blocks read at any virtual rows, block by block
  (an n-step window's rewards, its last step's flags);
- `JoinedItems`: the items whose rows lie in more than one block (a step near a piece's end
  whose n-step bootstrap is the next piece's, a frame stack that reaches back into the
  previous piece, a window that goes on into the next) get their rows copied, once per
  read, into one block of this process's own (`joined_block`), and are read from it as
  any item from its block. Only those items' rows are copied, the only copy besides the
  gather; every other item is read from its block in place.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pyarrow as pa

from arrowbuf.ray.apart import stored_concat


def blocks_of(bases: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The block of each virtual row (``bases``: each block's first virtual row)."""
    if len(bases) == 1:
        return np.zeros(rows.shape, np.int64)
    return np.searchsorted(bases, rows, side="right") - 1


class ViewRows:
    """Columns of a view's blocks, read at virtual rows: ``read(name)[rows]`` is the rows of
    column ``name``, each from its block. The items (the first axis of ``rows``) are in block
    order: items ``starts[i]:starts[i + 1]`` were drawn in block ``touched[i]``, which holds
    most of what they read (one take each); a row outside it (a look-up that goes on into a
    piece sealed elsewhere) is read from its own block. ``fetch(b)`` returns block ``b``'s
    columns (fetched on first use, as `arrowbuf.ray.cache.BlockCache` serves them)."""

    def __init__(self, bases: np.ndarray, fetch: Callable[[int], dict], touched: list[int], starts: list[int]) -> None:
        self.bases = bases
        self.fetch = fetch
        self.segments = list(zip(touched, starts[:-1], starts[1:]))
        self.dtypes: dict[str, np.dtype] = {}   # of each column read so far

    def read(self, name: str) -> "_Column | None":
        """Column ``name`` (None: the blocks have no such field)."""
        return _Column(self, name) if name in self.fetch(self.segments[0][0] if self.segments else 0) else None

    def take(self, name: str, rows: np.ndarray) -> np.ndarray:
        out = None
        for b, lo, hi in self.segments:
            column = self.fetch(b)[name]
            local = rows[lo:hi] - self.bases[b]
            if out is None:
                out = np.empty((*rows.shape, *column.shape[1:]), column.dtype)
            column.take(local, axis=0, out=out[lo:hi], mode="clip")
            outside = (local < 0) | (local >= len(column))
            if outside.any():
                out[lo:hi][outside] = self.anywhere(name, rows[lo:hi][outside])
        self.dtypes[name] = out.dtype
        return out

    def anywhere(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Column ``name`` at 1-D virtual ``rows`` of any blocks."""
        block = blocks_of(self.bases, rows)
        out = None
        for b in np.unique(block).tolist():
            mine = block == b
            part = self.fetch(b)[name].take(rows[mine] - self.bases[b], axis=0)
            if out is None:
                out = np.empty((len(rows), *part.shape[1:]), part.dtype)
            out[mine] = part
        return out


class _Column:
    """One column of a `ViewRows` (what `arrowbuf.indexing.look_ahead` indexes)."""

    def __init__(self, rows: ViewRows, name: str) -> None:
        self.rows, self.name = rows, name

    @property
    def dtype(self) -> np.dtype:
        """The column's dtype (known once it was read: `look_ahead` reads before it asks)."""
        return self.rows.dtypes[self.name]

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        return self.rows.take(self.name, np.asarray(rows))


def crossing(bases: np.ndarray, roles: tuple[np.ndarray, ...], first_row: np.ndarray, num_rows: np.ndarray
             ) -> np.ndarray | None:
    """Which items (the first axis of every role's virtual rows) have rows in more than one
    block; None when none has (or there is one block). Item k's first step lies in the entry
    (piece) of rows ``[first_row[k], first_row[k] + num_rows[k])``, all in one block: only an
    item that reads rows outside it may cross."""
    if len(bases) == 1:
        return None
    n = len(first_row)
    lo, hi = first_row[:, None], (first_row + num_rows)[:, None]
    out = np.zeros(n, bool)
    for rows in roles:
        flat = rows.reshape(n, -1)
        out |= ((flat < lo) | (flat >= hi)).any(axis=1)
    if not out.any():
        return None
    leave = np.flatnonzero(out)
    home = blocks_of(bases, first_row.take(leave))
    across = np.zeros(n, bool)
    for rows in roles:
        across[leave] |= (blocks_of(bases, rows.reshape(n, -1)[leave]) != home[:, None]).any(axis=1)
    return across if across.any() else None


def joined_block(bases: np.ndarray, fetch: Callable[[int], dict], rows: np.ndarray) -> dict:
    """The virtual ``rows`` (sorted, unique) of every field, copied from their blocks into one
    block of this process's own: its row k is virtual row ``rows[k]``."""
    block = blocks_of(bases, rows)
    touched, starts = np.unique(block, return_index=True)
    ends = np.append(starts[1:], len(rows)).tolist()
    sources = [(fetch(b), rows[lo:hi] - bases[b]) for b, lo, hi in zip(touched.tolist(), starts.tolist(), ends)]
    names = [name for name in sources[0][0] if isinstance(name, str)]   # fields, not what a block derived
    return {name: _joined([_taken(columns[name], local) for columns, local in sources]) for name in names}


def _taken(column: Any, rows: np.ndarray) -> Any:
    """Rows of a block's column as stored (numpy, encoded, ragged rows; a text field's dictionary array)."""
    if isinstance(column, pa.Array):
        return column.take(pa.array(rows))
    return column[rows]


def _joined(parts: list[Any]) -> Any:
    """Rows of one field taken from several blocks, as one column (a text field's blocks have
    dictionaries of their own: decoded and encoded again)."""
    if isinstance(parts[0], pa.DictionaryArray):
        strings = pa.concat_arrays([p.dictionary_decode() for p in parts])
        return strings.dictionary_encode()
    return stored_concat(parts)


class JoinedItems:
    """The items of one part of a read whose rows cross blocks (see the module docstring).

    Args:
        across: which items cross (drawn order).
        roles: each role's virtual rows (drawn order).
        bases, fetch: the view's blocks, as `ViewRows` takes them.
    """

    def __init__(self, across: np.ndarray, roles: tuple[np.ndarray, ...], bases: np.ndarray,
                 fetch: Callable[[int], dict]) -> None:
        self.across = across
        self.rows = np.unique(np.concatenate([rows[across].reshape(-1) for rows in roles]))
        self.columns = joined_block(bases, fetch, self.rows)

    def local(self, rows: np.ndarray, local: np.ndarray) -> np.ndarray:
        """``local`` (a role's block-local rows, drawn order) with the crossing items' rows
        made rows of the joined block (``rows``: that role's virtual rows)."""
        local[self.across] = np.searchsorted(self.rows, rows[self.across])
        return local
