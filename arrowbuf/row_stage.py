"""`RowStage`: a staging writer's steps of a ragged or text field, one row per (env, step).

A writer that stages its steps (a Ray writer, a ``mode="fixed"`` or rate-limited store's)
keeps each field as an array ``[envs, steps, *shape]`` and cuts an episode's rows out of it
(`arrowbuf.episodes.StepWriter`). A ragged or text field has no fixed row, so its stage is a
`RowStage`: an object array ``[envs, steps]`` of rows (each step's own copy of its sequence,
or its ``str``), indexed and assigned as the numpy stages are, whose cut (``stage[env, :n]``)
is the episode's column in the form the store takes (`arrowbuf.ragged.RaggedRows`, or an
object array of ``str``). A writer's state keeps no staged rows of it: a checkpoint ships or
flushes them first (a non-empty one raises `SchemaError`, naming the field and the fix).

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
        if isinstance(value, RowStage):
            self.cells[key] = value.cells
            return
        where = np.arange(self.cells.size).reshape(self.cells.shape)[key].reshape(-1).tolist()
        if not where:
            return
        rows = self._rows(value)
        if len(rows) == 1:
            rows = rows * len(where)
        if len(rows) != len(where):
            raise SchemaError(f"field {self.name!r}: {len(rows)} rows for {len(where)} steps")
        flat = self.cells.reshape(-1)
        for at, row in zip(where, rows):
            flat[at] = row

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

    def copy(self) -> np.ndarray:
        """What a writer's state keeps of these cells: nothing while they are empty.

        Raises:
            SchemaError: cells hold steps (a state is taken after its writer shipped or flushed them).
        """
        if self.cells.size:
            raise SchemaError(f"ragged or text field {self.name!r}: a writer's state cannot keep its staged steps "
                              f"({self.cells.shape[1]} steps of {self.cells.shape[0]} envs); flush() the store's "
                              "writers before save()")
        return np.zeros(self.cells.shape, np.int8)
