"""The gather: arena rows -> one contiguous buffer -> torch tensors -> a TensorDict.

Each sample does one ``np.take`` per column straight into its slice of a single
freshly allocated byte buffer (pinned when asked for, so a GPU copy is one
asynchronous transfer), and the tensors of the TensorDict are views of that buffer.
The gather is the only copy between the arena and the trainer.

The plan (which arena column goes to which key, shifted by one row for ``next``
observations) is built once per schema, not per sample: converting columns one by
one on every call costs as much as the gather itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from tensordict import TensorDict

_ALIGN = 64  # bytes; keeps every view aligned for any dtype and for vector loads


@dataclass(frozen=True)
class _Entry:
    key: tuple[str, ...]
    column: np.ndarray          # the arena column, shape (capacity, *shape)
    shift: int                  # 0: row t; 1: row t+1 (next observation)
    torch_dtype: torch.dtype
    row_bytes: int


def _make_td(source: dict, batch_size: torch.Size, device: torch.device | None) -> TensorDict:
    # The tensors are built here with the right shapes, so TensorDict's per-key
    # validation (~13 us a batch, as much as the whole gather) is skipped.
    new_unsafe = getattr(TensorDict, "_new_unsafe", None)
    if new_unsafe is not None:
        return new_unsafe(source, batch_size=batch_size, device=device)
    return TensorDict(source, batch_size=batch_size, device=device)


def nest(flat: Mapping[tuple[str, ...], torch.Tensor]) -> dict:
    """{("next", "obs"): t} -> {"next": {"obs": t}}."""
    root: dict = {}
    for key, value in flat.items():
        node = root
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return root


class Gather:
    """Copies selected arena rows into one buffer and wraps it as a TensorDict.

    Args:
        columns: key -> (arena column, shift, torch dtype); the key is a tuple
            (nested TensorDict path), the shift 1 reads the next row.
    """

    def __init__(self, columns: Mapping[tuple[str, ...], tuple[np.ndarray, int, torch.dtype]]) -> None:
        self._entries = [
            _Entry(key, column, shift, torch_dtype, column.itemsize * int(np.prod(column.shape[1:], dtype=np.int64)))
            for key, (column, shift, torch_dtype) in columns.items()
        ]
        self._layouts: dict[int, tuple[int, list[int]]] = {}

    def _layout(self, n: int) -> tuple[int, list[int]]:
        layout = self._layouts.get(n)
        if layout is None:
            offsets, total = [], 0
            for entry in self._entries:
                offsets.append(total)
                total += -(-n * entry.row_bytes // _ALIGN) * _ALIGN
            layout = self._layouts[n] = (max(total, 1), offsets)
        return layout

    def __call__(self, rows: np.ndarray, extra: Mapping[tuple[str, ...], torch.Tensor] | None = None,
                 device: torch.device | str | None = None, pin_memory: bool = False) -> TensorDict:
        """Gather ``rows`` (int64 arena rows) into a TensorDict of batch size [len(rows)].

        Args:
            rows: arena rows of the transitions, shape [n].
            extra: tensors added as they are (index, weights, masks).
            device: where the tensors go; a CUDA device copies the gathered buffer in
                one non-blocking transfer from pinned memory.
            pin_memory: gather into pinned host memory (implied by a CUDA device).
        """
        flat_rows = rows.reshape(-1)
        n = flat_rows.size
        batch_shape = tuple(rows.shape)
        total, offsets = self._layout(n)
        device = torch.device(device) if device is not None else None
        pin = pin_memory or (device is not None and device.type == "cuda")
        flat = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        flat_np = flat.numpy()
        next_rows = flat_rows + 1 if any(e.shift for e in self._entries) else flat_rows
        for entry, offset in zip(self._entries, offsets):
            column = entry.column
            out = flat_np[offset:offset + n * entry.row_bytes].view(column.dtype).reshape((n, *column.shape[1:]))
            np.take(column, next_rows if entry.shift else flat_rows, axis=0, out=out, mode="clip")
        if device is not None and device.type != "cpu":
            flat = flat.to(device, non_blocking=True)
        tensors = {}
        for entry, offset in zip(self._entries, offsets):
            shape = batch_shape + tuple(entry.column.shape[1:])
            tensors[entry.key] = flat[offset:offset + n * entry.row_bytes].view(entry.torch_dtype).view(shape)
        if extra:
            for key, value in extra.items():
                tensors[key] = value.to(device) if device is not None else value
        return _make_td(nest(tensors), torch.Size(batch_shape), device if device is not None and device.type != "cpu" else None)
