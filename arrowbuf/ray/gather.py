"""`BlockGather`: rows of several sealed blocks -> one pooled buffer -> a TensorDict.

A reader's batch draws items from several blocks (of one or several shards).
Each field is gathered block by block, one ``np.take`` per (field, block). The
batch keeps the order the sampler drew its items in (as a local store's does, so
any slice of a uniform batch is itself uniform): where one block's items lie next
to each other in that order, the take goes straight into their slice of the
output and the gather is the only copy between the object store and the
trainer's tensors; where they are spread (several blocks, drawn in random
order), the take's rows are scattered to their places, one more copy of them. The output comes from a `SlotPool`, as a local store's
samples do: a batch is reused only once nothing refers to it any more, and
steady sampling neither faults fresh memory nor rebuilds a TensorDict.

`by_block` orders a selection's items by block (and says where each block's
items are); `same_width` pads episode batches of several shards to one width.

The layout follows `arrowbuf.tensors.Gather`: fields in schema order (an
observation field also as ``("next", ...)``), then the extras (index,
episode_id, step, and weights, masks, n-step targets); an extra named like a
field replaces it; ``keys`` selects fields as `Gather.check_keys` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from tensordict import TensorDict

from arrowbuf._pool import SlotPool, SlotSpec
from arrowbuf.samplers import Selection
from arrowbuf.schema import Schema
from arrowbuf.tensors import Gather

_ALIGN = 64
_ROLES = ("step", "obs", "next")


@dataclass
class Group:
    """Items of a batch, all from one block: ``[lo, hi)``, or the positions ``dest``.

    ``rows`` holds the block's rows by role (step, observation, next observation),
    each of the items' shape (observation rows with a trailing frame axis).
    """

    columns: Mapping[str, np.ndarray]
    lo: int
    hi: int
    rows: tuple[np.ndarray, np.ndarray, np.ndarray]
    dest: np.ndarray | None = None      # the items' places in the batch, when not [lo, hi)


def _key(name: str) -> tuple[str, ...]:
    return tuple(name.split("."))


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


class BlockGather:
    """Gathers items of many blocks into one pooled TensorDict (see the module docstring).

    Args:
        schema: the store's schema (the blocks' columns are its fields).
    """

    def __init__(self, schema: Schema) -> None:
        self.entries = []   # (key, field name, role index, numpy dtype, row shape, torch dtype)
        checks = {}
        for name, f in schema.fields.items():
            key = _key(name)
            dtype = np.dtype(f.numpy_dtype)
            roles = [(key, "obs" if f.observation else "step")]
            if f.observation:
                roles.append((("next", *key), "next"))
            for k, role in roles:
                self.entries.append((k, name, _ROLES.index(role), dtype, tuple(f.shape), f.torch_dtype))
                checks[k] = (np.empty((0, *f.shape), dtype), role, f.torch_dtype)
        self._checks = Gather(checks)   # its key rules, without an arena
        self._layouts: dict[tuple, tuple] = {}
        self._pool = SlotPool()

    def check_keys(self, keys: Any) -> frozenset | None:
        """``keys`` checked as `arrowbuf.tensors.Gather.check_keys` does (None: every field)."""
        return self._checks.check_keys(keys)

    def __call__(self, groups: list[Group], extra: Mapping[str, np.ndarray], shapes: tuple,
                 keys: frozenset | None, device: torch.device | None = None) -> TensorDict:
        """The batch: every group's rows of every selected field, then the extras.

        Args:
            groups: the items by block, covering the batch in order.
            extra: per-item arrays of the whole batch (index, episode_id, step, ...).
            shapes: the batch's row shapes by role (step, observation, next observation).
            keys: `check_keys` of the fields to gather.
            device: where the batch goes (gathered on the CPU, then moved in one copy).
        """
        key = (shapes, keys, *[(name, value.dtype, value.shape) for name, value in extra.items()])
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._layout(shapes, keys, key[2:])
        plan, spec = layout
        outs, batch = self._pool.claim(key, spec)
        for (source, role), out in zip(plan, outs):
            if role < 0:
                np.copyto(out, extra[source])
                continue
            for group in groups:
                if group.dest is None:
                    group.columns[source].take(group.rows[role], axis=0, out=out[group.lo:group.hi], mode="clip")
                else:
                    out[group.dest] = group.columns[source].take(group.rows[role], axis=0, mode="clip")
        if device is not None and device.type != "cpu":
            return batch.to(device, non_blocking=True)
        return batch

    def _layout(self, shapes: tuple, keys: frozenset | None, extras: tuple) -> tuple[tuple, SlotSpec]:
        fields = {entry[0] for entry in self.entries}
        extras = [(name, dtype, shape) for name, dtype, shape in extras
                  if keys is None or _key(name) not in fields or _key(name) in keys]
        replaced = {_key(name) for name, _, _ in extras}
        plan, outs, leaves, total = [], [], [], 0

        def place(source: Any, role: int, key: tuple, dtype: np.dtype, torch_dtype: torch.dtype,
                  shape: tuple) -> None:
            nonlocal total
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            plan.append((source, role))
            outs.append((dtype, shape, total))
            leaves.append((key, torch_dtype, total, size, shape))
            total += -(-size // _ALIGN) * _ALIGN

        for key, name, role, dtype, row_shape, torch_dtype in self.entries:
            if key in replaced or (keys is not None and key not in keys):
                continue
            place(name, role, key, dtype, torch_dtype, tuple(shapes[role]) + row_shape)
        for name, dtype, shape in extras:
            place(name, -1, _key(name), dtype, _torch_dtype(dtype), tuple(shape))
        return tuple(plan), SlotSpec(max(total, 1), tuple(outs), tuple(leaves), torch.Size(shapes[0]))


def by_block(bases: np.ndarray, selection: Selection
             ) -> tuple[Selection, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The selection with its items ordered by block (``bases``: first row of each block):
    (selection, block of each item, the blocks touched, where each one's items start and, last,
    stop, and ``order``: the drawn position of each reordered item, None when none moved)."""
    rows = selection.rows
    if len(bases) == 1:
        return selection, np.zeros(len(rows), np.int64), np.zeros(1, np.int64), np.array([0, len(rows)]), None
    block = np.searchsorted(bases, rows if rows.ndim == 1 else rows[:, 0], side="right") - 1
    if len(block) < 2 or (block[1:] >= block[:-1]).all():   # already in order (uniform draws, epochs)
        order = None
    else:
        order = np.argsort(block, kind="stable")
        block = block.take(order)
    selection = selection if order is None else Selection(rows.take(order, axis=0), selection.indices.take(order, axis=0),
                          selection.pos.take(order, axis=0),
                          {k: v.take(order, axis=0) for k, v in selection.extra.items()},
                          None if selection.step is None else selection.step.take(order, axis=0))
    counts = np.bincount(block, minlength=len(bases))
    touched = np.flatnonzero(counts)
    starts = np.zeros(len(touched) + 1, np.int64)
    np.cumsum(counts.take(touched), out=starts[1:])
    return selection, block, touched, starts, order


def same_width(parts: list[tuple[Any, Selection]]) -> list[tuple[Any, Selection]]:
    """Episode batches of several shards padded to one width (the last step repeated, masked out)."""
    widths = {s.rows.shape[1] for _, s in parts if s.rows.ndim == 2}
    if len(widths) <= 1:
        return parts
    width = max(widths)
    padded = []
    for view, s in parts:
        pad = width - s.rows.shape[1]
        if pad:
            edge = lambda a: np.pad(a, ((0, 0), (0, pad)), mode="edge")
            extra = {k: (np.pad(v, ((0, 0), (0, pad))) if k == "mask" else edge(v)) for k, v in s.extra.items()}
            s = Selection(edge(s.rows), edge(s.indices), edge(np.ascontiguousarray(s.pos)), extra,
                          None if s.step is None else edge(s.step))
        padded.append((view, s))
    return padded

