"""Per-env-worker staging of step records, vectorized over sub-envs.

A `Stage` holds the records of one env worker as flat numpy columns
``[rows, num_envs, ...]`` (one write per record and field, as arrowbuf's native
writer stages), so that episodes of any set of sub-envs are read as views
``column[start:stop, i]``: nothing loops over sub-envs to append a record or to
find which ones ended.

Values become arrays by the seed's ``to_device`` rules: torch tensors as they are
(bfloat16 kept), numpy arrays as they are except that **numpy uint16 carries
bfloat16** (RLightning's ``to_numpy`` sends bf16 as uint16 views), and Python
scalars as torch's defaults (float32, int64, bool).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from arrowbuf.fields import as_array
from arrowbuf.schema import flatten

#: Records a fresh `Stage` has room for unless told (`Stage` grows by doubling when full).
FIRST_ROWS = 32

_PY_SCALARS = {bool: (np.bool_, "bool"), int: (np.int64, "int64"), float: (np.float32, "float32")}


def to_column(value: Any, name: str) -> tuple[np.ndarray, str, bool]:
    """``(array, dtype name, loose)`` of one value; ``loose``: a Python scalar (its dtype may be refined).

    Raises:
        ValueError: a value of an unsupported type or dtype, naming the field.
    """
    scalar = _PY_SCALARS.get(type(value))
    if scalar is not None:
        return np.asarray(value, scalar[0]), scalar[1], True
    if isinstance(value, np.ndarray) and value.dtype == np.uint16:
        return value, "bfloat16", False        # the seed's to_device: uint16 carries bf16
    try:
        array, dtype = as_array(value, name)
    except Exception as err:   # SchemaError or numpy's own, re-raised with the field named
        raise ValueError(f"field {name!r}: cannot store a value of type {type(value).__name__}: {err}") from None
    return array, dtype, False


def to_tensor(array: np.ndarray, dtype: str, contiguous: bool = True) -> torch.Tensor:
    """A torch view of a staged column (bfloat16 from its uint16 bits); a contiguous copy
    with ``contiguous`` (what hooks get, as the seed's stacked lists), else a strided view
    (what goes to the store, which copies it once into its arena)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array) if contiguous else array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def to_device(data: Any, device: Any) -> Any:
    """The seed's ``to_device``: nested numpy arrays -> torch on ``device`` (uint16 -> bfloat16)."""
    if isinstance(data, Mapping):
        return {key: to_device(value, device) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(value, device) for value in data)
    if isinstance(data, np.ndarray):
        if data.dtype == np.uint16:
            return to_tensor(data, "bfloat16").to(device)
        return torch.from_numpy(np.ascontiguousarray(data)).to(device)
    if isinstance(data, torch.Tensor):
        return data.to(device)
    return data


class Stage:
    """Records of one env worker of ``num_envs`` sub-envs (1: not vectorized).

    Attributes:
        rows: records written so far (row numbers keep counting after compaction).
        starts: per sub-env, the row its open episode starts at.
        dtypes: flat field -> dtype name.
    """

    def __init__(self, env_id: str, num_envs: int, vector: bool, reuse: "Stage | None" = None,
                 same_step_seen: bool = False, first_rows: int = FIRST_ROWS) -> None:
        self.env_id = env_id
        self.num_envs = num_envs
        self.vector = vector      # records lead with num_envs (else one unbatched env)
        self.columns: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, str] = {}
        self._loose: set[str] = set()   # fields so far only given as Python scalars
        self.base = 0                   # row number of columns[...][0]
        self.rows = 0
        self.starts = np.zeros(num_envs, np.int64)
        # Per sub-env, the row of a done record whose reading (next- or same-step) waits for the
        # sub-env's next record (-1: none); and whether this worker has shown same-step resets.
        self.pending = np.full(num_envs, -1, np.int64)
        self.same_step_seen = same_step_seen
        self.infos: list[dict[str, Any]] = []   # per row: the record's *info* values, as sent (for hooks)
        # A finished stage of the same env whose columns fields of the same dtype and shape take over.
        self._reusable = dict(reuse.columns) if reuse is not None else {}
        self._first_rows = first_rows   # rows fresh columns start with (they grow when full)

    # -- episode boundaries (read by `arrowbuf.compat.segments.Segmenter`) --------------------

    def start_at(self, envs: np.ndarray, row: int) -> None:
        """The open episodes of sub-envs ``envs`` (indices or a mask) start at record ``row``."""
        self.starts[envs] = row

    def defer(self, envs: np.ndarray, row: int) -> None:
        """The done record ``row`` of ``envs`` waits for their next record to be read."""
        self.pending[envs] = row

    def settle(self, envs: np.ndarray) -> None:
        """The boundaries waiting for ``envs`` were read."""
        self.pending[envs] = -1

    def saw_same_step(self) -> None:
        """This worker's env resets inside the step that ends an episode."""
        self.same_step_seen = True

    def write(self, record: Mapping[str, Any], infos: dict[str, Any] | None = None) -> int:
        """Stage one record (a flat dict); returns its row number.

        Raises:
            ValueError: fields other than the first record's, or a value of
                another dtype or shape than that field's earlier ones.
        """
        arrays = {name: to_column(value, name) for name, value in record.items()}
        if self.columns and arrays.keys() != self.columns.keys():
            missing = sorted(self.columns.keys() - arrays.keys())
            extra = sorted(arrays.keys() - self.columns.keys())
            raise ValueError(f"env {self.env_id!r}: a step record has other fields than the first one of this "
                             f"episode (missing {missing}, extra {extra}); every step must send the same fields")
        for name, (array, dtype, loose) in arrays.items():
            self._check(name, array, dtype, loose)
        self._make_room()
        row = self.rows - self.base
        for name, (array, _, _) in arrays.items():
            self.columns[name][row] = array if self.vector else array[None]
        self.infos.append(infos or {})
        self.rows += 1
        return self.rows - 1

    def _shape_of(self, array: np.ndarray) -> tuple[int, ...]:
        if not self.vector:
            return array.shape
        if array.ndim == 0:
            return ()
        return array.shape[1:]

    def _check(self, name: str, array: np.ndarray, dtype: str, loose: bool) -> None:
        if self.vector and array.ndim and array.shape[0] != self.num_envs:
            raise ValueError(f"env {self.env_id!r}: field {name!r} has shape {array.shape}, expected "
                             f"({self.num_envs}, ...) for an env worker of num_envs={self.num_envs}")
        shape = self._shape_of(array)
        column = self.columns.get(name)
        if column is None or (name in self._loose and not loose):
            self._allocate(name, array, dtype, shape, column)
            if loose:
                self._loose.add(name)
            else:
                self._loose.discard(name)
            return
        if loose:
            return   # a Python scalar is cast to the field's dtype (e.g. a reset's dummy reward 0.0)
        if dtype != self.dtypes[name] or shape != column.shape[2:]:
            raise ValueError(f"env {self.env_id!r}: field {name!r} got {dtype}{list(shape)}, expected "
                             f"{self.dtypes[name]}{list(column.shape[2:])} as in its earlier steps")

    def _allocate(self, name: str, array: np.ndarray, dtype: str, shape: tuple, old: np.ndarray | None) -> None:
        if old is not None:
            capacity = old.shape[0]
        elif self.columns:   # every column has the same rows
            capacity = next(iter(self.columns.values())).shape[0]
        else:
            capacity = next(iter(self._reusable.values())).shape[0] if self._reusable else self._first_rows
        spare = self._reusable.pop(name, None)
        if spare is not None and old is None and spare.dtype == array.dtype and spare.shape == (
                capacity, self.num_envs, *shape):
            column = spare   # stale rows are never read: only rows written since are
        else:
            column = np.zeros((capacity, self.num_envs, *shape), array.dtype)
        if old is not None:
            column[:] = old.reshape(old.shape + (1,) * (column.ndim - old.ndim))
        self.columns[name] = column
        self.dtypes[name] = dtype

    def _make_room(self) -> None:
        """Drop rows no open episode needs; grow when still full."""
        if not self.columns:
            return
        size = next(iter(self.columns.values())).shape[0]
        if self.rows - self.base < size:
            return
        keep_from = int(min(self.starts.min(initial=self.rows), self.rows))
        drop = keep_from - self.base
        kept = self.rows - keep_from
        grow = 2 * size if kept >= size // 2 else size
        self._reusable = {}   # other sizes now
        for name, column in self.columns.items():
            fresh = np.zeros((grow, *column.shape[1:]), column.dtype) if grow != size else column
            fresh[:kept] = column[drop:drop + kept]
            self.columns[name] = fresh
        del self.infos[:drop]
        self.base = keep_from

    def unwrite(self) -> None:
        """Forget the last record written (it was refused)."""
        self.rows -= 1
        self.infos.pop()

    def rows_of(self, name: str, start: int, stop: int, env: int) -> np.ndarray:
        """Field ``name`` of sub-env ``env`` over rows [start, stop) (a view)."""
        return self.columns[name][start - self.base:stop - self.base, env]

    def row(self, name: str, row: int) -> np.ndarray:
        """Field ``name`` of every sub-env at ``row``: ``[num_envs, ...]`` (a view)."""
        return self.columns[name][row - self.base]


def split_record(record: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A step record -> (its fields but ``*info*`` keys, flattened to dotted names; its ``*info*`` values)."""
    return (flatten({key: value for key, value in record.items() if "info" not in key}),
            {key: value for key, value in record.items() if "info" in key})
