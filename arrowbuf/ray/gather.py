"""`BlockGather`: ordered items of several sealed blocks -> one pooled buffer -> a TensorDict.

A reader orders the items of one or several batches (`arrowbuf.ray.block_reads.BlockReads`):
their blocks, their block-local rows in block order, and where each batch
position lies in that order. For each batch, `BlockGather` fills one pooled
output (a `SlotPool` slot, as a local store's samples: a batch is reused only
once nothing refers to it any more, and steady sampling neither faults fresh
memory nor rebuilds a TensorDict), and the ordering reads its items into it
(`BlockReads.fill`) as the batch's layout says:

- where the batch's order is the block order (one block, or an unshuffled epoch
  chunk), each field is taken straight from its blocks into the output: the
  gather is the only copy between the object store and the trainer's tensors;
- otherwise each field is read block by block into a scratch array (once for all
  the ordered batches) and taken from it into the output in the drawn order: a
  take per touched block and one per batch, where scattering each block's items
  to their places costs a take and a scatter per block and batch;
- except fields of large rows of plain items (`arrowbuf.ray.block_reads.ROWWISE_BYTES`:
  pixels), copied from their blocks straight into the output row by row: each of
  their bytes is copied once, as in the embedded store;
- and small per-step fields (action, reward, flags: `arrowbuf.packing`), read
  together as one record a row: each block's records are packed once, on first
  use (`BlockReads.records_of`), the ordered items' records read block by block, and
  each batch takes its records into its slot and copies every field out of them.
  A random read of small rows costs a cache miss per row and column; packed, one
  per row for all of them, as in the embedded store's arena.

`BlockGather.batches` gathers several ordered batches (`sample_iter`'s draw) at
once into one slot of as many parts (`arrowbuf._pool.SlotSpec.parts`): one claim,
and the steps above once, for all of them; each part is a TensorDict of its own.

Batches are planned by `arrowbuf.layout` (the planner `arrowbuf.tensors.Gather`
uses too): fields in schema order (an observation field also as ``("next", ...)``),
then the extras (index, episode_id, step, and weights, masks, n-step targets), then
the packed records' region; an extra named like a field replaces it; ``keys``
selects fields as `arrowbuf.layout.check_keys` says. What is read how (through the
scratch, straight from the blocks, in records) is this module's (`BlockGather._layout`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from arrowbuf._pool import SlotPool
from arrowbuf.layout import ROLES, FieldPlan, Layout, Layouts, check_keys, field_key, plan_layout
from arrowbuf.packing import pack_layout
from arrowbuf.ray.apart import ApartGather
from arrowbuf.ray.block_reads import ROWWISE_BYTES, BlockReads
from arrowbuf.schema import Schema

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict


#: Bytes of one pooled buffer into which `sample_iter` gathers several batches of a
#: draw together (`BlockGather.batches`): one claim of a pooled
#: slot, and one take per field, for all of them, where a batch at a time costs a
#: claim, a take per field and a copy per extra each. Measured per W1 batch (200k
#: rows, 256 items, a ~56 KB slot; 2 shards, 2 shared cores under other load, medians
#: of 9 interleaved rounds of 2,000 batches): 36.2 us a batch at a time, 28.3 us
#: sixteen together (the embedded store's sample: 30.1 us). A batch the trainer keeps
#: keeps the buffer of the batches gathered with it (never overwritten, never
#: reused): this bounds what one kept batch holds. W2's 1.35 MB batches (38 lent
#: blocks, 2 shards, medians of 10 interleaved rounds against the embedded store):
#: one at a time (1 MiB) 0.72-0.73x the embedded store's rate, two together (3 MiB)
#: 0.75x, three (4 MiB) 0.76x, six (8 MiB, past the 2 MiB L2) 0.62x.
GROUP_BYTES = 4 << 20


class BlockGather:
    """Gathers items of many blocks into one pooled TensorDict (see the module docstring).

    Args:
        schema: the store's schema (the blocks' columns are its fields).
        rowwise_bytes: bytes of a row from which a field of plain items is copied
            from the blocks straight into the output (`arrowbuf.ray.block_reads.ROWWISE_BYTES`).
    """

    def __init__(self, schema: Schema, rowwise_bytes: int = ROWWISE_BYTES) -> None:
        self.rowwise_bytes = rowwise_bytes
        self.fields = schema.fields
        self.entries = []   # every pooled field (`arrowbuf.layout.FieldPlan`), its source the field's name
        # Ragged and text fields have no fixed row: added to each batch apart (`arrowbuf.ray.apart`; None: none).
        self.apart = ApartGather(schema) if any(f.ragged or f.text for f in schema.fields.values()) else None
        for name, f in schema.fields.items():
            if f.ragged or f.text:
                continue
            key = field_key(name)
            roles = [(key, "obs" if f.observation else "step")]
            if f.observation:
                roles.append((("next", *key), "next"))
            self.entries += [FieldPlan(k, name, ROLES.index(role), np.dtype(f.numpy_dtype), tuple(f.shape),
                                       f.dtype) for k, role in roles]
        self._layouts = Layouts(self._layout)
        # The layouts found for the items of the last ordering (`BlockReads`), by (batch size, keys): its
        # later batches (same extras) take them again; a new ordering starts afresh.
        self._known: tuple[Any, dict] = (None, {})
        self._pool = SlotPool()
        self._parted: dict[tuple, Layout] = {}   # (a layout, parts) -> its layout of that many batches

    def check_keys(self, keys: Any) -> frozenset | None:
        """``keys`` checked as `arrowbuf.layout.check_keys` does (None: every field)."""
        return check_keys(keys, [entry.key for entry in self.entries] + list(self.apart.fields if self.apart else ()))

    def __call__(self, ordered: BlockReads, start: int, stop: int, keys: frozenset | None,
                 device: torch.device | None = None) -> TensorDict:
        """The batch of ordered items ``[start, stop)`` (in batch order): every selected
        field, then the extras.

        Args:
            ordered: the items, block by block (`arrowbuf.ray.block_reads`).
            start, stop: the batch's range of batch positions.
            keys: `check_keys` of the fields to gather.
            device: where the batch goes (gathered on the CPU, then moved in one copy).
        """
        layout = self._layout_of(ordered, stop - start, keys)
        outs, batch = self._pool.claim(layout, layout.slot)
        ordered.fill(layout, outs, start, stop)
        if device is not None and device.type != "cpu":
            batch = batch.to(device, non_blocking=True)
        return batch if self.apart is None else self.apart.add(batch, ordered, start, stop, keys, device)

    def batches(self, ordered: BlockReads, start: int, stop: int, batch_size: int, keys: frozenset | None,
                device: torch.device | None = None) -> tuple[TensorDict, ...]:
        """The batches of ``batch_size`` ordered items in ``[start, stop)`` (a multiple of
        it), gathered together into one pooled slot of that many parts (`SlotSpec.parts`):
        one take per field (and one claim) for all of them. The slot is reused only
        once none of them is referred to: a batch kept keeps the others' memory too."""
        parts = (stop - start) // batch_size
        if parts == 1:
            return (self(ordered, start, stop, keys, device),)
        whole = self._layout_of(ordered, stop - start, keys)
        layout = self._parted.get((whole, parts))
        if layout is None:
            slot = dataclasses.replace(whole.slot, parts=parts)
            layout = self._parted[(whole, parts)] = dataclasses.replace(whole, slot=slot)
        outs, batches = self._pool.claim(layout, layout.slot)
        ordered.fill(layout, outs, start, stop)
        if device is not None and device.type != "cpu":
            batches = tuple(batch.to(device, non_blocking=True) for batch in batches)
        if self.apart is None:
            return batches
        return tuple(self.apart.add(batch, ordered, start + k * batch_size, start + (k + 1) * batch_size, keys, device)
                     for k, batch in enumerate(batches))

    def sizes(self, ordered: BlockReads, count: int) -> tuple[int, int]:
        """(bytes a batch of ``count`` ordered items puts through the scratch arrays (its
        fields other than the large rows copied straight from the blocks), bytes of its
        pooled buffer), of every field."""
        layout = self._layout_of(ordered, count, None)
        return layout.fill[1], layout.slot.nbytes

    def _layout_of(self, ordered: BlockReads, count: int, keys: frozenset | None) -> Layout:
        # Row shapes by role of a batch of ``count`` items: (step, obs, next), a frame axis on the last two.
        step, frames = (count, *ordered.item), (ordered.frames,) if ordered.frames > 1 else ()
        shapes = (step, (*step, *frames), (*step, *frames))
        of, known = self._known
        if of is None or of() is not ordered:
            self._known = (weakref.ref(ordered), known := {})
        layout = known.get((count, keys))
        if layout is None:
            layout = known[(count, keys)] = self._layouts.find(shapes, keys, ordered.extra)
        return layout

    def _layout(self, shapes: tuple, keys: frozenset | None, every_extra: tuple) -> Layout:
        def pack(chosen: list[FieldPlan]) -> dict[int, tuple]:
            # Small step fields of this layout, packed into records (`arrowbuf.packing`; observations are not).
            record_bytes, offsets = pack_layout({f.source: self.fields[f.source] for f in chosen if f.role == 0})
            group = (record_bytes, tuple(offsets.items()))   # `BlockReads.records_of`'s key
            return {i: (group, record_bytes, offsets[f.source]) for i, f in enumerate(chosen)
                    if f.role == 0 and f.source in offsets}

        def hows(layout: Layout) -> tuple[tuple[str, ...], int]:
            # How each field is read: "packed" in records, "rowwise" row by row from the blocks
            # (large rows of plain items: one row per item, a 1-D batch of rows), "take"
            # through the scratch; and the bytes read through the scratch (out of block order).
            how, ordered = [], sum(int(np.prod(layout.slot.outs[region][1], dtype=np.int64))
                                  for _, _, region in layout.records)
            for i, ((source, role), (_, _, _, size, shape)) in enumerate(zip(layout.plan, layout.slot.leaves)):
                if i in layout.packed:
                    how.append("packed")
                elif role >= 0 and len(shapes[role]) == 1 and size >= self.rowwise_bytes * max(shape[0], 1) \
                        and self.fields[source].codec is None:   # encoded rows are decoded by a take
                    how.append("rowwise")
                else:
                    how.append("take")
                    ordered += size if role >= 0 else 0
            return tuple(how), ordered

        return plan_layout(self.entries, shapes, keys, every_extra, pack, hows)
