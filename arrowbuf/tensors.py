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
    role: str                   # which rows it reads: "step", "obs" or "next" (observation after)
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
        columns: key -> (arena column, role, torch dtype); the key is a tuple
            (nested TensorDict path); the role says which rows the column reads:
            "step" (the transition's row), "obs" (observation rows, which frame
            stacking widens) or "next" (the observation after the transition).
    """

    def __init__(self, columns: Mapping[tuple[str, ...], tuple[np.ndarray, str, torch.dtype]]) -> None:
        self._entries = [
            _Entry(key, column, role, torch_dtype, column.itemsize * int(np.prod(column.shape[1:], dtype=np.int64)))
            for key, (column, role, torch_dtype) in columns.items()
        ]

    def __call__(self, rows: np.ndarray, extra: Mapping[tuple[str, ...], torch.Tensor] | None = None,
                 device: torch.device | str | None = None, pin_memory: bool = False, *,
                 obs_rows: np.ndarray | None = None, next_rows: np.ndarray | None = None) -> TensorDict:
        """Gather arena rows into a TensorDict whose batch shape is ``rows.shape``.

        Args:
            rows: arena rows of the transitions, shape [B] or [B, L].
            extra: tensors added as they are (index, weights, masks); they replace
                gathered keys of the same name.
            device: where the tensors go; a CUDA device copies the gathered buffer in
                one non-blocking transfer from pinned memory.
            pin_memory: gather into pinned host memory (implied by a CUDA device).
            obs_rows: rows of the observation fields, ``rows.shape`` (+ a frame axis);
                default ``rows``.
            next_rows: rows of the next observations, like ``obs_rows``; default
                ``rows + 1``.
        """
        batch_shape = tuple(rows.shape)
        by_role = {"step": rows, "obs": rows if obs_rows is None else obs_rows,
                   "next": rows + 1 if next_rows is None else next_rows}
        skip = set(extra or ())
        entries = [e for e in self._entries if e.key not in skip]
        sizes, offsets, total = [], [], 0
        for entry in entries:
            size = by_role[entry.role].size * entry.row_bytes
            sizes.append(size)
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        device = torch.device(device) if device is not None else None
        pin = pin_memory or (device is not None and device.type == "cuda")
        flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        flat_np = flat.numpy()
        for entry, offset, size in zip(entries, offsets, sizes):
            column = entry.column
            role_rows = by_role[entry.role]
            out = flat_np[offset:offset + size].view(column.dtype).reshape((role_rows.size, *column.shape[1:]))
            np.take(column, role_rows.reshape(-1), axis=0, out=out, mode="clip")
        if device is not None and device.type != "cpu":
            flat = flat.to(device, non_blocking=True)
        tensors = {}
        for entry, offset, size in zip(entries, offsets, sizes):
            shape = tuple(by_role[entry.role].shape) + tuple(entry.column.shape[1:])
            tensors[entry.key] = flat[offset:offset + size].view(entry.torch_dtype).view(shape)
        if extra:
            for key, value in extra.items():
                tensors[key] = value.to(device) if device is not None else value
        return _make_td(nest(tensors), torch.Size(batch_shape), device if device is not None and device.type != "cpu" else None)
