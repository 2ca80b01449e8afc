"""Reused gather outputs: pre-faulted buffers whose TensorDict of views is built once.

A fresh multi-GB output per sample page-faults on every call (0.12-2 s per 5,120-row
VLA batch on this machine, DESIGN.md section 5), and wrapping a small batch as a
TensorDict costs about as much as gathering it. A `SlotPool` keeps, per batch
layout, a few `Slot`\\ s: one buffer each, faulted in by its first gather, and the
TensorDict of views of it handed out on every sample that reuses the slot.

A slot is reused only when nothing outside it refers to its memory, so a batch
the trainer kept is never overwritten. `Slot.claim` counts, against the counts
taken when the slot was built:

- references to the TensorDict, to its nested TensorDicts and to its tensors (a
  kept batch, a kept ``batch["next"]`` or ``batch["obs"]``, a ``.numpy()`` of one);
- users of each tensor's C++ object (autograd keeps inputs it saved for backward;
  torch 2.13 then also adds a Python reference, which this does not rely on);
- users of the buffer's one torch storage (any slice, view, ``detach()`` or
  ``.numpy()`` of a slice made from the batch holds it).

A TensorDict that came back changed (a key added, replaced or deleted, a new batch
size) is rebuilt from the slot's tensors before reuse, so the next batch has the
layout's keys only.

A slot may hold several batches gathered together (``SlotSpec.parts``: a Ray
reader's `sample_iter` gathers the batches of one draw at once, one take per field
for all of them): each is a TensorDict of its own over its share of the buffer,
built once like the others, and the slot is reused only once nothing refers to
any of them (so a batch kept keeps the batches gathered with it from being
overwritten, and their memory from being reused).

Pinned slots (``pinned=True``: page-locked host memory from torch's pinned
allocator, for ``pin_memory=True`` and CUDA samples of a host arena) follow the same
rule, plus one that no reference count shows: a non-blocking copy to the GPU may
still be reading the slot after the call returns, so such a copy marks the slot
`Slot.in_flight` with its CUDA event, and the slot is reused only once the event
has completed. Pinning is a parameter of the slot: without CUDA a "pinned" slot is
ordinary memory, and the pooling logic runs (and is tested) all the same.
"""

from __future__ import annotations

import functools
import mmap
import threading
from collections import OrderedDict
from dataclasses import dataclass
from operator import is_
from sys import getrefcount
from typing import TYPE_CHECKING, Any, Callable, Hashable

import numpy as np

from arrowbuf._lazy_torch import dtype as torch_dtype

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

#: Slots kept per layout. A training loop holds one batch while drawing the next
#: (two slots); prefetching queues and kept batches need a few more. Past this, a
#: sample gathers into a fresh buffer that is not kept.
MAX_SLOTS = 4
#: Bytes the pool keeps in all: reaching it drops the least recently used layouts'
#: slots (a slot still in use lives on with its batch); a slot that would not fit
#: even alone is a fresh, unkept buffer.
MAX_BYTES = 8 << 30
#: Pooled buffers ask for transparent huge pages (madvise), fresh ones refuse them.
#: Measured here (2 shared cores, THP "madvise", kernel 6.18; one np.take of 1,280
#: rows x 75 KB = 96 MB from a 5,120-row arena, two interleaved runs): creating a
#: slot (mapping + first gather, which faults it in) took 25-660 ms (medians 39 and
#: 58) with huge pages and 86-405 ms (medians 149 and 209) without; gathering into
#: the warm slot took the same either way (medians 19-21 ms, min 9-15 ms). So huge
#: pages make the one-time faulting of a pooled slot ~3x cheaper, with rare
#: compaction stalls that a kept slot pays once. A fresh buffer pays them on every
#: sample (0.12-2 s per 770 MB batch, DESIGN.md section 5): 4 KB pages, stable.
#: W1 slots (~48 KB) are below the 2 MB huge-page size: the advice cannot apply.
HUGEPAGES = True



@functools.lru_cache(maxsize=None)
def torch_internals() -> tuple[Callable[[int], int], Callable[[Any], int], Callable[[torch.Tensor], int],
                               Callable[[TensorDict], dict]]:
    """The private torch and tensordict names the pool reads, all of them here: the only
    private names of other packages arrowbuf reads (`tests/test_layers.py` checks that
    none is read elsewhere; a torch or tensordict release that renames one fails
    `tests/test_gather_pool.py`). Public APIs do not count C++ users, and
    reading a TensorDict's entries publicly costs more than the gather it guards.

    Returns:
        ``storage_use_count(handle)``: users of a storage's C++ object
        (``torch._C._storage_Use_Count``); ``storage_handle(storage)``: the handle it
        takes (``UntypedStorage._cdata``); ``tensor_use_count(tensor)``: users of a
        tensor's C++ object (``Tensor._use_count``); ``entries(td)``: a TensorDict's own
        dict of entries (``_tensordict``), the one O(1) way to see an entry replaced;
        ``jagged(values, offsets, max_seqlen, min_seqlen)``: a jagged nested tensor built by
        ``torch.nested._internal.nested_tensor.NestedTensor`` (its lengths recorded in the
        ``_metadata_cache`` as torch records them), used only where a probe, at the first jagged
        tensor, of rows of 1 and 2 values gives what the public ``nested_tensor_from_jagged`` gives:
        offsets, values and the padded tensor, whose width is the recorded longest row; otherwise
        the public function.
    """
    import torch

    return (torch._C._storage_Use_Count, lambda storage: storage._cdata, torch.Tensor._use_count,
            lambda td: td._tensordict, _jagged)


_jagged_made: list = []   # `_jagged_constructor`'s choice, made at the first jagged tensor


def _jagged(values: Any, offsets: Any, max_seqlen: int, min_seqlen: int) -> Any:
    # Chosen at the first call, not when the pool asks for the internals: a process that never
    # builds a jagged tensor never runs the probe (torch logs a warning at its first one).
    if not _jagged_made:
        _jagged_made.append(_jagged_constructor())
    return _jagged_made[0](values, offsets, max_seqlen, min_seqlen)


def _public_jagged(values: Any, offsets: Any, max_seqlen: int, min_seqlen: int) -> Any:
    import torch

    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, min_seqlen=min_seqlen,
                                                  max_seqlen=max_seqlen)


def _jagged_constructor() -> Callable[[Any, Any, int, int], Any]:
    """`torch_internals`' ``jagged`` (documented there)."""
    import torch

    try:
        from torch.nested._internal.nested_tensor import NestedTensor

        def private(values: Any, offsets: Any, max_seqlen: int, min_seqlen: int) -> Any:
            # The lengths ride in the sizes of empty tensors (torch's own `_store_val_in_tensor`).
            return NestedTensor(values, offsets, _metadata_cache={"max_seqlen": torch.zeros(max_seqlen, 0),
                                                                  "min_seqlen": torch.zeros(min_seqlen, 0)})

        values, offsets = torch.arange(3.0), torch.tensor([0, 1, 3])
        probe, public = private(values, offsets, 2, 1), _public_jagged(values, offsets, 2, 1)
        # (padding reads the recorded longest row)
        same = probe.offsets().tolist() == [0, 1, 3] and torch.equal(probe.values(), public.values()) \
            and torch.equal(probe.to_padded_tensor(-1.0), public.to_padded_tensor(-1.0))
        return private if same else _public_jagged
    except Exception:   # noqa: BLE001  any failure of a private API: the public function instead
        return _public_jagged


@dataclass(frozen=True)
class SlotSpec:
    """What a slot holds: one buffer, numpy views to gather into, tensors to hand out.

    Attributes:
        nbytes: size of the buffer (>= 1).
        outs: (numpy dtype, shape, byte offset[, byte strides]) of each numpy view
            written by a sample; views past the leaves are scratch (packed records).
        leaves: (key path, dtype name, byte offset, byte size, shape) of each
            tensor of the TensorDict, views of the same bytes as ``outs``; the
            dtype as its name (`arrowbuf._lazy_torch.dtype`), so that a spec is made
            and shipped where torch is not imported (a Ray shard's payloads).
        batch_size: the TensorDict's batch size (of all ``parts`` together).
        parts: TensorDicts the leaves are split into along their first (batch)
            axis, each of ``batch_size[0] // parts`` items and the same keys; with
            more than one, `Slot.claim` returns them as a tuple.
    """

    nbytes: int
    outs: tuple[tuple[np.dtype, tuple[int, ...], int], ...]
    leaves: tuple[tuple[tuple[str, ...], str, int, int, tuple[int, ...]], ...]
    batch_size: tuple[int, ...]
    parts: int = 1


def leaf_views(flat: torch.Tensor, leaves: tuple) -> list[torch.Tensor]:
    """Each leaf of a `SlotSpec` (or `Payload` spec) as a view of the byte tensor ``flat``."""
    return [flat[offset:offset + size].view(torch_dtype(dtype)).view(shape) for _, dtype, offset, size, shape in leaves]


def part_leaves(leaves: tuple, parts: int) -> list[tuple]:
    """The leaves of a `SlotSpec` split into ``parts`` equal shares along their first
    axis: the leaves of each part, in part order (C-contiguous leaves: each share is
    a contiguous range of the leaf's bytes)."""
    split = []
    for k in range(parts):
        split.append(tuple((key, dtype, offset + k * (size // parts), size // parts, (shape[0] // parts, *shape[1:]))
                           for key, dtype, offset, size, shape in leaves))
    return split


def out_views(buffer: np.ndarray, outs: tuple) -> list[np.ndarray]:
    """The numpy views of `SlotSpec.outs` over ``buffer`` (a 4th item: byte strides)."""
    return [np.ndarray(shape, dtype, buffer, offset, *strides) for dtype, shape, offset, *strides in outs]


def make_td(source: dict, batch_size: torch.Size, device: torch.device | None = None) -> TensorDict:
    """A TensorDict of a nested dict of tensors already shaped for ``batch_size``."""
    # TensorDict's per-key validation (~13 us a batch, as much as the whole gather)
    # is skipped: the tensors were built with the right shapes.
    td_class = tensordict_class()
    new_unsafe = getattr(td_class, "_new_unsafe", None)
    if new_unsafe is not None:
        return new_unsafe(source, batch_size=batch_size, device=device)
    return td_class(source, batch_size=batch_size, device=device)


def joined(batch: TensorDict, values: dict) -> TensorDict:
    """A TensorDict of ``batch``'s entries and ``values`` (a nested dict, shaped for its batch)
    beside or over them, ``batch`` unchanged: built without TensorDict's per-key checks, which
    took ~15 us for one nested tensor (`make_td`)."""
    source = dict(batch.items())
    for name, value in values.items():
        if isinstance(value, dict):
            inner = source.get(name)
            value = joined(inner, value) if inner is not None else make_td(value, batch.batch_size, batch.device)
        source[name] = value
    return make_td(source, batch.batch_size, batch.device)


_td_class: Any = None


def tensordict_class() -> type[TensorDict]:
    """`tensordict.TensorDict`, imported on first use: a process that never builds one (a
    Ray shard actor) does not pay for importing tensordict (~1.5 CPU s, torch._dynamo)."""
    global _td_class
    if _td_class is None:
        from tensordict import TensorDict

        _td_class = TensorDict
    return _td_class


def nest(flat: dict[tuple[str, ...], torch.Tensor]) -> dict:
    """{("next", "obs"): t} -> {"next": {"obs": t}}."""
    root: dict = {}
    for key, value in flat.items():
        node = root
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return root


def allocate(nbytes: int, hugepages: bool) -> np.ndarray:
    """``nbytes`` of page-aligned anonymous memory, with transparent huge pages
    asked for or refused (not left to the system's default)."""
    # Private: a shared anonymous mapping is shmem, which huge-page advice does not reach.
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if hugepages else "MADV_NOHUGEPAGE", None)
    if advice is not None:   # Linux only
        region.madvise(advice)
    return np.frombuffer(region, np.uint8, count=nbytes)


class Slot:
    """One gather buffer, the numpy views a sample writes and the TensorDict it returns
    (a tuple of them for a slot of several ``parts``).

    Args:
        spec: the layout.
        hugepages: ask for transparent huge pages for the buffer.
        pinned: page-locked memory (torch's pinned allocator) when CUDA is available.
    """

    def __init__(self, spec: SlotSpec, hugepages: bool, pinned: bool = False) -> None:
        import torch

        self._storage_use_count, storage_handle, self._tensor_use_count, self._entries, _ = torch_internals()
        # The byte tensor all leaves view: kept so that the storage's use count
        # taken below stays the count of an unused slot.
        if pinned:
            self._flat = torch.empty(spec.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            buffer = self._flat.numpy()
        else:
            buffer = allocate(spec.nbytes, hugepages)
            self._flat = torch.from_numpy(buffer)
        self._event: Any = None   # the CUDA event of a non-blocking copy still reading the slot
        self.nbytes = spec.nbytes
        self.outs = out_views(buffer, spec.outs)
        self.parts = spec.parts
        # The tensors of every part, part after part (one part: the leaves themselves).
        self._tensors = [tensor for leaves in part_leaves(spec.leaves, spec.parts)
                         for tensor in leaf_views(self._flat, leaves)]
        self._paths = [path for path, *_ in spec.leaves]
        self._batch_size = torch.Size([spec.batch_size[0] // spec.parts, *spec.batch_size[1:]])
        self._build()
        # Counts of an unused slot, taken once: a TensorDict rebuilt later has the
        # same structure, hence the same counts when nobody else holds it.
        self._storage = self._flat.untyped_storage()
        self._storage_cdata = storage_handle(self._storage)
        self._storage_uses = self._storage_use_count(self._storage_cdata)
        self._root_refs = list(map(getrefcount, self._roots))
        self._counts = self._refcounts()

    def _build(self) -> None:
        """(Re)build the TensorDict of each part of the slot's tensors and the lists that check them."""
        n = len(self._paths)
        self._roots = [make_td(nest(dict(zip(self._paths, self._tensors[k * n:(k + 1) * n]))), self._batch_size)
                       for k in range(self.parts)]
        # Per TensorDict: (its entries dict, their keys, their values, its attributes,
        # it), what `_intact` compares; the values are compared by identity, which is
        # unambiguous as the slot keeps every value alive.
        self._containers = []
        self._objects = []   # every value of every TensorDict: nested TensorDicts and tensors
        pending = list(self._roots)
        while pending:
            container = pending.pop()
            # tensordict keeps a TensorDict's entries in a plain dict (`torch_internals`):
            # the only O(1) way to see that a returned batch had an entry replaced.
            children = self._entries(container)
            values = list(children.values())
            self._containers.append((children, list(children), values, dict(vars(container)), container))
            self._objects += values
            pending += [value for value in values if isinstance(value, tensordict_class())]

    def _refcounts(self) -> list[int]:
        """Python references to each value, then C++ users of each tensor."""
        return [*map(getrefcount, self._objects), *map(self._tensor_use_count, self._tensors)]

    def _intact(self) -> bool:
        """Whether the TensorDict still has the layout's entries and attributes."""
        for children, keys, values, attributes, container in self._containers:
            # `is` per value (not ==, which compares tensors elementwise); the
            # lengths first, as map stops at the shorter.
            if len(children) != len(values) or not all(map(is_, children.values(), values)) \
                    or list(children) != keys or vars(container) != attributes:
                return False
        return True

    def in_flight(self, event: Any) -> None:
        """A copy out of the slot runs until ``event`` (anything with ``query()``, a
        ``torch.cuda.Event``) completes: the slot is not reused before."""
        self._event = event

    def copy_to(self, device: torch.device) -> torch.Tensor:
        """The slot's bytes on ``device``, in one non-blocking copy; a CUDA copy keeps the
        slot `in_flight` until it is done."""
        flat = self._flat.to(device, non_blocking=True)
        if device.type == "cuda":
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.in_flight(event)
        return flat

    def claim(self) -> TensorDict | tuple[TensorDict, ...] | None:
        """The slot's TensorDict (a new tuple of its parts' for several parts), to refill,
        or None while anything else refers to its memory."""
        if self._event is not None:
            if not self._event.query():
                return None
            self._event = None
        if list(map(getrefcount, self._roots)) != self._root_refs:
            return None
        if not self._intact():
            self._build()
        if self._storage_use_count(self._storage_cdata) != self._storage_uses:
            return None
        return self.handed() if self._refcounts() == self._counts else None

    def handed(self) -> TensorDict | tuple[TensorDict, ...]:
        """What a claim hands out: the TensorDict, or a new tuple of the parts' (new, so
        that the claimant's tuple counts as a reference to each part)."""
        return self._roots[0] if self.parts == 1 else tuple(self._roots)


class SlotPool:
    """Slots per layout key, reused once their batches are gone.

    ``claim`` is safe across threads: a slot is handed to one caller at a time,
    since the caller's reference to its TensorDict marks it in use.

    Example:
        >>> pool = SlotPool()
        >>> spec = SlotSpec(4, ((np.dtype("float32"), (1,), 0),), ((("x",), "float32", 0, 4, (1,)),), (1,))
        >>> outs, td = pool.claim("k", spec)
        >>> outs[0][:] = 1.5
        >>> td["x"].tolist()
        [1.5]
        >>> del td
        >>> pool.claim("k", spec)[1]["x"].data_ptr() == outs[0].ctypes.data   # the same slot again
        True
    """

    def __init__(self, max_slots: int = MAX_SLOTS, max_bytes: int = MAX_BYTES) -> None:
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self._slots: OrderedDict[Hashable, list[Slot]] = OrderedDict()   # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    def claim(self, key: Hashable, spec: SlotSpec) -> tuple[list[np.ndarray], TensorDict | tuple[TensorDict, ...]]:
        """(numpy views to fill, the TensorDict of them) of a free slot of ``key``'s layout;
        a new slot when none is free (kept while the bounds allow).

        ``key`` is hashed on every claim: pass an object hashed by identity (the
        gather passes its layout), not a tuple of shapes and dtypes (~1 us a hash).
        """
        slot, td = self.claim_slot(key, spec)
        return slot.outs, td

    def claim_slot(self, key: Hashable, spec: SlotSpec, pinned: bool = False
                   ) -> tuple[Slot, TensorDict | tuple[TensorDict, ...]]:
        """`claim`, returning the slot itself (to copy it out: `Slot.copy_to`); ``pinned``
        slots are kept apart from pageable ones of the same layout."""
        if pinned:
            key = ("pinned", key)
        with self._lock:
            slots = self._slots.get(key)
            if slots is None:
                slots = self._slots[key] = []
            self._slots.move_to_end(key)
            for slot in slots:
                td = slot.claim()
                if td is not None:
                    return slot, td
            keep = len(slots) < self.max_slots and self._make_room(spec.nbytes, key)
            slot = Slot(spec, hugepages=HUGEPAGES and keep, pinned=pinned)
            if keep:
                slots.append(slot)
                self._bytes += slot.nbytes
            return slot, slot.handed()

    def _make_room(self, nbytes: int, key: Hashable) -> bool:
        """Drop least recently used layouts (other than ``key``) until ``nbytes`` more fit."""
        for other in list(self._slots):
            if self._bytes + nbytes <= self.max_bytes:
                break
            if other != key:
                self._bytes -= sum(slot.nbytes for slot in self._slots.pop(other))
        return self._bytes + nbytes <= self.max_bytes
