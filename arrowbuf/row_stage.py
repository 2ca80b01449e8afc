"""`RowStage`: a staging writer's steps of a ragged or text field, one row per (env, step).

A writer that stages its steps (a Ray writer, a ``mode="fixed"`` or rate-limited store's)
keeps each field as an array ``[envs, steps, *shape]`` and cuts an episode's rows out of it
(`arrowbuf.episodes.StepWriter`). A ragged or text field has no fixed row, so its stage is a
`RowStage`: an object array ``[envs, steps]`` of rows (each step's own copy of its sequence,
or its ``str``), indexed and assigned as the numpy stages are, whose cut (``stage[env, :n]``)
is the episode's column in the form the store takes (`arrowbuf.ragged.RaggedRows`, or an
object array of ``str``). A writer's state (a checkpoint's) keeps its rows as arrays and JSON
values (`RowStage.saved`), read back and checked by `RowStage.from_saved`; an in-place
writer's open steps of such a field are saved in the same form (`arrowbuf.inplace`).

Example:
    >>> from arrowbuf.fields import Field
    >>> stage = RowStage((2, 4), Field("int32", (None,)), "tokens")
    >>> stage[np.array([0, 1]), np.array([0, 0])] = [np.array([1, 2]), np.array([3])]
    >>> stage[0, :1].lengths.tolist(), stage[1, :1].values.tolist()
    ([2], [3])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from arrowbuf.errors import SchemaError, describe
from arrowbuf.ragged import RaggedRows, ragged_rows
from arrowbuf.text import text_values


class RowStage:
    """Rows ``shape`` (envs, steps) of field ``spec`` named ``name`` (see the module docstring)."""

    def __init__(self, shape: tuple[int, int], spec: Any, name: str, cells: np.ndarray | None = None) -> None:
        self.spec, self.name = spec, name
        self.tail = tuple(spec.shape[1:]) if spec.ragged else ()
        self.empty = np.zeros((0, *self.tail), spec.numpy_dtype) if spec.ragged else ""
        if cells is None:
            cells = np.empty(shape, object)
            cells.fill(self.empty)
        self.cells = cells

    @property
    def shape(self) -> tuple[int, ...]:
        return self.cells.shape

    def _rows(self, value: Any) -> list:
        """``value`` (a step's rows of this field) as a list of rows, each its own copy."""
        if self.spec.ragged:
            given = ragged_rows(value, self.name, self.tail).astype(self.spec.numpy_dtype)
            return RaggedRows(np.array(given.values, copy=True), given.offsets).rows()
        texts = text_values([value] if isinstance(value, str) else value, self.name)
        if texts is None:
            raise SchemaError(f"field {self.name!r} is text: got {describe(value)}; expected str values")
        return texts.reshape(-1).tolist()

    def __setitem__(self, key: Any, value: Any) -> None:
        """The cells ``key`` names set to ``value``'s rows (one for all, or one each), or to another stage's."""
        if isinstance(value, dict):   # a writer state's (`saved`)
            value = RowStage.from_saved(value, self.spec, self.name)
        if isinstance(value, RowStage):
            self.cells[key] = value.cells
            return
        # the shape of the cells named (a step's: one per env), read off a view that holds nothing
        shape = np.shape(np.broadcast_to(np.empty((), bool), self.cells.shape)[key])
        count = int(np.prod(shape, dtype=np.int64))
        if not count:
            return
        rows = self._rows(value)
        if len(rows) == 1:
            rows = rows * count
        if len(rows) != count:
            raise SchemaError(f"field {self.name!r}: {len(rows)} rows for {count} steps")
        if not shape:   # one cell: its row itself
            self.cells[key] = rows[0]
            return
        cells = np.empty(count, object)
        for at, row in enumerate(rows):   # one by one: an array row assigned by a slice would be broadcast
            cells[at] = row
        self.cells[key] = cells.reshape(shape)

    def __getitem__(self, key: Any) -> Any:
        """An env's steps ``stage[env, :n]``: the episode's column (`RaggedRows`, or ``str`` in an
        object array); a 2-D key: a stage of those cells."""
        cells = self.cells[key]
        if cells.ndim == 2:
            return RowStage(cells.shape, self.spec, self.name, cells)
        if self.spec.ragged:
            return ragged_rows(list(cells), self.name, self.tail).astype(self.spec.numpy_dtype) if len(cells) \
                else RaggedRows(self.empty, np.zeros(1, np.int64))
        return np.array(cells, dtype=object)

    def saved(self) -> dict:
        """These cells as a writer's state keeps them (JSON values and numpy arrays, no objects):
        a ragged field's ``{"lengths": [envs, steps], "values": [total, *tail]}``, a text
        field's ``{"codes": [envs, steps], "strings": [...]}`` (`from_saved` reads them back)."""
        flat = self.cells.reshape(-1).tolist()
        if self.spec.ragged:
            lengths = np.array([len(row) for row in flat], np.int64).reshape(self.cells.shape)
            values = np.concatenate(flat) if flat else self.empty
            return {"lengths": lengths, "values": np.ascontiguousarray(values, self.spec.numpy_dtype)}
        strings = sorted(set(flat))
        code = {text: k for k, text in enumerate(strings)}
        return {"codes": np.array([code[text] for text in flat], np.int64).reshape(self.cells.shape),
                "strings": strings}

    @classmethod
    def from_saved(cls, saved: Any, spec: Any, name: str) -> "RowStage":
        """The stage a writer's state saved (`saved`), checked.

        Raises:
            ValueError: naming the field, for a saved form that is not this field's (lengths that do
                not add up to the values, codes outside the strings, another dtype or item shape).
        """
        stage = cls((0, 0), spec, name)
        key = "lengths" if spec.ragged else "codes"
        grid = saved.get(key) if isinstance(saved, dict) else None
        if not isinstance(grid, np.ndarray) or grid.ndim != 2 or grid.dtype.kind not in "iu" or (grid < 0).any():
            raise ValueError(f"writer state: staged steps of {'ragged' if spec.ragged else 'text'} field {name!r} "
                             f"must be {{{key!r}: an [envs, steps] array of ints >= 0, ...}}, got {describe(saved)}")
        cells = np.empty(grid.shape, object)
        if spec.ragged:
            values = saved.get("values")
            if not isinstance(values, np.ndarray) or values.dtype != spec.numpy_dtype or \
                    values.shape[1:] != stage.tail or len(values) != int(grid.sum()):
                raise ValueError(f"writer state: field {name!r} has {int(grid.sum())} staged values of "
                                 f"{spec.numpy_dtype} items {stage.tail}, got {describe(values)}")
            bounds = np.concatenate([[0], np.cumsum(grid.reshape(-1))]).astype(np.int64).tolist()
            flat = cells.reshape(-1)
            for k in range(grid.size):
                flat[k] = values[bounds[k]:bounds[k + 1]]
        else:
            strings = saved.get("strings")
            if not isinstance(strings, list) or not all(isinstance(t, str) for t in strings) or \
                    (grid.size and int(grid.max()) >= len(strings)):
                raise ValueError(f"writer state: field {name!r} has codes up to {int(grid.max(initial=0))} into its "
                                 f"staged strings, got {describe(strings)}")
            flat = cells.reshape(-1)
            for k, code in enumerate(grid.reshape(-1).tolist()):
                flat[k] = strings[code]
        stage.cells = cells
        return stage
