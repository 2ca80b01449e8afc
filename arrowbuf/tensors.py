"""The gather: arena rows -> one contiguous buffer -> torch tensors -> a TensorDict.

Each sample does one ``np.take`` per column straight into its slice of a single
byte buffer, copies the extras (index, episode id, step, weights...) after them,
and the tensors of the TensorDict are views of that buffer. The gather is the only
copy between the arena and the trainer.

On the CPU the buffer and its TensorDict come from a `SlotPool` (``_pool.py``):
buffers faulted in once and reused once nothing refers to them any more, so a
sample neither page-faults a fresh buffer nor builds a TensorDict. Pinned gathers
(``pin_memory=True``, CUDA devices) use pooled pinned slots, reused once their copy
to the GPU is done too. A Ray shard's `Payload` uses a fresh buffer per sample (see
`Gather.payload`).

The plan (which arena column goes to which key, shifted by one row for ``next``
observations) is built once per layout, not per sample: converting columns one by
one on every call costs as much as the gather itself. Where each key lies in the
buffer is planned by `arrowbuf.layout` (the planner the Ray reader's gather uses
too); the bound takes of the arena's columns are this module's (`Layout.fill`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from arrowbuf._lazy_torch import is_tensor
from arrowbuf._pool import SlotPool, joined, leaf_views, make_td, nest, out_views
from arrowbuf.encoded import BatchDecodes, DecodedField, EncodedColumn
from arrowbuf.layout import ALIGN, ROLES, FieldPlan, Layout, Layouts, available_keys, check_keys, plan_layout
from arrowbuf.ragged import RaggedColumn, RaggedRows, nested
from arrowbuf.text import TextColumn
from arrowbuf.video import VideoColumn

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict


def pinned(pin_memory: bool, device: torch.device | None) -> bool:
    """Whether to gather into pinned memory: asked for, or implied by a CUDA target.

    Pinning needs a CUDA driver; without one there is nothing to pin for, and the
    gather goes to ordinary memory.
    """
    import torch

    return (pin_memory or (device is not None and device.type == "cuda")) and torch.cuda.is_available()


class Gather:
    """Copies selected arena rows into one buffer and wraps it as a TensorDict.

    Args:
        columns: key -> (arena column, role, dtype name of its tensors); the key is a tuple
            (nested TensorDict path); the role says which rows the column reads:
            "step" (the transition's row), "obs" (observation rows, which frame
            stacking widens) or "next" (the observation after the transition).
            A fourth item, (block, byte offset), marks a field of a row-packed
            block (`arrowbuf.packing`); None or absent: its own column.

    Example:
        >>> obs = np.arange(10, dtype=np.float32)
        >>> gather = Gather({("obs",): (obs, "obs", "float32"), ("next", "obs"): (obs, "next", "float32")})
        >>> batch = gather(np.array([2, 5]), {"index": np.array([7, 8])}, keys=gather.check_keys(["obs"]))
        >>> sorted(batch.keys()), batch["obs"].tolist()
        (['index', 'obs'], [2.0, 5.0])
    """

    def __init__(self, columns: Mapping[tuple[str, ...], tuple]) -> None:
        # Ragged and text fields (`arrowbuf.ragged`, `arrowbuf.text`) have no fixed row: gathered
        # apart, as jagged nested tensors and NonTensorStacks of str.
        self._apart = {key: (column, tensor_dtype) for key, (column, _, tensor_dtype, *_) in columns.items()
                       if isinstance(column, (RaggedColumn, TextColumn))}
        self.has_apart = bool(self._apart)
        columns = {key: value for key, value in columns.items() if key not in self._apart}
        self._fields = [FieldPlan(key, column, ROLES.index(role), column.dtype, tuple(column.shape[1:]), tensor_dtype)
                        for key, (column, role, tensor_dtype, *_) in columns.items()]
        # (row-packed block, byte offset) of each packed field (`arrowbuf.packing`), by key: a
        # packed field is gathered with its block's records, never by a take of its strided
        # column (``np.take`` copies a non-contiguous source whole first).
        self._packed = {key: packed[0] for key, (_, _, _, *packed) in columns.items() if packed and packed[0]}
        self._layouts = Layouts(self._layout)
        self._plain: dict[tuple, tuple] = {}       # `plain_layout`'s, by batch size and keys
        self._pool = SlotPool()

    def check_keys(self, keys: Iterable[str | tuple[str, ...]] | None) -> frozenset | None:
        """The gathered keys that ``keys`` selects (None: all), checked before anything is
        drawn (`arrowbuf.layout.check_keys`), as `__call__` takes them.

        Raises:
            ValueError: ``keys`` is not a collection of keys, or names a key that
                is not gathered.
        """
        return check_keys(keys, [f.key for f in self._fields] + list(self._apart))

    def available_keys(self) -> list:
        """Every key ``keys`` can name: the fields, their ``("next", ...)``, and the extras always there."""
        return available_keys([f.key for f in self._fields] + list(self._apart))

    def apart_keys(self, keys: frozenset | None) -> list:
        """The ragged and text fields among ``keys`` (`check_keys`; None: all)."""
        return [key for key in self._apart if keys is None or key in keys]

    def __call__(self, rows: np.ndarray, extra: Mapping[str, np.ndarray] | None = None,
                 device: torch.device | str | None = None, pin_memory: bool = False, *,
                 obs_rows: np.ndarray | None = None, next_rows: np.ndarray | None = None,
                 keys: frozenset | None = None, copied: Mapping | None = None) -> TensorDict:
        """Gather arena rows into a TensorDict whose batch shape is ``rows.shape``: `_fixed`'s
        batch, plus each ragged field selected as a jagged nested tensor of its rows' values
        (copied once; ``copied``: by key, a ragged field's rows already copied, `each`) and each
        text field as a NonTensorStack of str, in a TensorDict of its own beside the pooled one.

        Raises:
            ValueError: a ragged or text field selected with rows of more than one dimension (sequences).
        """
        batch = self._fixed(rows, extra, device, pin_memory, obs_rows=obs_rows, next_rows=next_rows, keys=keys)
        if not self.has_apart:
            return batch
        chosen = self.apart_keys(keys)
        if not chosen:
            return batch
        if rows.ndim != 1:   # (they are step fields: n-step and frame stacks read them at the step's row)
            raise ValueError(f"ragged and text fields {['.'.join(k) for k in chosen]} are gathered one row per "
                             "item, not in sequences; leave them out with keys=")
        flat = rows.astype(np.int64, copy=False)
        apart = {}
        for key in chosen:
            column, tensor_dtype = self._apart[key]
            value = nested(copied[key], tensor_dtype) if copied and key in copied else \
                column.batch_value(flat, tensor_dtype)
            apart[key] = value if device is None or not hasattr(value, "to") else value.to(device)
        # A new TensorDict of the pooled tensors (kept from reuse while this batch lives) and the
        # ones apart; the pooled one stays as its slot built it.
        return joined(batch, nest(apart))

    def each(self, parts: list[tuple[np.ndarray, Mapping[str, np.ndarray]]], device: Any = None,
             keys: frozenset | None = None) -> list[TensorDict]:
        """A batch of each of ``parts`` ((1-D rows, extra arrays) each: a driver's shares of one
        global batch, `arrowbuf.engine.ShardEngine.gather_each`), as `__call__` makes them; every
        part's ragged values are copied in one copy, before any part's tensors are built, into one
        buffer whose slices the parts' nested tensors view (a part kept alone keeps the whole
        buffer alive; its tensors' storage, which pickling and sending move, is its own rows).
        Copying each part's half megabyte between the wrapping of the others evicts that
        Python's objects and code from the caches (a 1M-token batch of a 200k-row store
        over 8 parts, split and gathered: 2.7-3.1 ms of CPU time phased, 3.0-3.7 ms not, on a
        loaded 2-core machine); one copy for all parts rather than one a part saved 3-5% more
        of a 1M-row store's split and gather (1.85-1.87 ms against 1.92-1.96, quiet)."""
        ragged = [key for key in self.apart_keys(keys) if isinstance(self._apart[key][0], RaggedColumn)] \
            if self.has_apart else []
        if not ragged or not parts:   # (a torch arena's `TorchGather` has none: a store with a storage_device refuses them)
            return [self(rows, extra, device, keys=keys) for rows, extra in parts]
        flat = [rows.astype(np.int64, copy=False) for rows, _ in parts]
        bounds = np.cumsum([0, *map(len, flat)]).tolist()
        whole = {key: self._apart[key][0].gather(np.concatenate(flat)) for key in ragged}
        copied = [{key: rows[a:b] for key, rows in whole.items()} for a, b in zip(bounds[:-1], bounds[1:])]
        return [self(rows, extra, device, keys=keys, copied=values) for (rows, extra), values in zip(parts, copied)]

    def _fixed(self, rows: np.ndarray, extra: Mapping[str, np.ndarray] | None = None,
               device: torch.device | str | None = None, pin_memory: bool = False, *,
               obs_rows: np.ndarray | None = None, next_rows: np.ndarray | None = None,
               keys: frozenset | None = None) -> TensorDict:
        """Gather arena rows of the fixed-shape fields into a TensorDict whose batch shape is ``rows.shape``.

        On the CPU (unpinned) the TensorDict and its memory are reused by a later
        call once nothing refers to them any more (the batch, its tensors, or any
        view, slice or numpy array of them): keep what you need and it stays.

        Args:
            rows: arena rows of the transitions, shape [B] or [B, L].
            extra: arrays added as they are (index, weights, masks); they replace
                gathered keys of the same name (a dotted name nests).
            device: where the tensors go; a CUDA device copies the gathered buffer in
                one non-blocking transfer from pinned memory.
            pin_memory: gather into pinned host memory (implied by a CUDA device).
            obs_rows: rows of the observation fields, ``rows.shape`` (+ a frame axis);
                default ``rows``.
            next_rows: rows of the next observations, like ``obs_rows``; default
                ``rows + 1``.
            keys: `check_keys` of the keys to gather (None: all fields); an
                extra named like a field comes only with that field.
        """
        if device is not None or pin_memory:
            import torch

            device = torch.device(device) if device is not None else None
            pin = pinned(pin_memory, device)
            if not pin and device is not None and device.type != "cpu":   # an accelerator without pinned memory
                return self.payload(rows, extra, obs_rows=obs_rows, next_rows=next_rows, keys=keys).to_tensordict(device)
        else:
            pin = False
        if extra is None:
            extra = {}
        key, layout, by_role = self._plan(rows, extra, obs_rows, next_rows, keys)
        if not pin:
            slot, batch = self._pool.claim_slot(key, layout.slot)
            _fill(layout, slot.outs, by_role, extra)
            return batch
        # Pinned: a pooled page-locked slot, then (for a CUDA device) one non-blocking
        # copy of all of it, which keeps the slot from reuse until it is done.
        slot, batch = self._pool.claim_slot(key, layout.slot, pinned=True)
        _fill(layout, slot.outs, by_role, extra)
        if device is None or device.type == "cpu":
            return batch
        spec = layout.slot
        tensors = leaf_views(slot.copy_to(device), spec.leaves)
        return make_tensordict(dict(zip((leaf[0] for leaf in spec.leaves), tensors)), tuple(spec.batch_size), device)

    def plain_layout(self, batch_size: int, keys: frozenset | None) -> tuple[Layout, int, int, int]:
        """(layout, out positions of ``index``, ``episode_id``, ``step``) of a plain batch of
        ``batch_size`` transitions: what `__call__` uses for those rows and extras, for a
        caller that writes the extras straight into a claimed slot (`arrowbuf.direct`)."""
        found = self._plain.get((batch_size, keys))
        if found is None:
            extra = {"index": np.zeros(batch_size, np.int64), "episode_id": np.zeros(batch_size, np.int64),
                     "step": np.zeros(batch_size, np.int32)}
            _, layout, _ = self._plan(np.zeros(batch_size, np.intp), extra, None, None, keys)
            at = {source: i for i, (source, role) in enumerate(layout.plan) if role < 0}
            found = self._plain[batch_size, keys] = (layout, at["index"], at["episode_id"], at["step"])
        return found

    def claim(self, layout: Layout) -> tuple[list[np.ndarray], TensorDict]:
        """(numpy views to fill, the TensorDict of them) of a free pooled slot of ``layout``."""
        return self._pool.claim(layout, layout.slot)

    def payload(self, rows: np.ndarray, extra: Mapping[str, np.ndarray] | None = None, *,
                obs_rows: np.ndarray | None = None, next_rows: np.ndarray | None = None,
                keys: frozenset | None = None) -> "Payload":
        """Gather into one fresh byte buffer plus its layout (what a Ray shard sends back).

        Not pooled: a Ray shard's payload is serialized after the call returns, by
        Ray, at a time the shard does not see.
        """
        extra = extra or {}
        _, layout, by_role = self._plan(rows, extra, obs_rows, next_rows, keys)
        spec = layout.slot
        buffer = _aligned_empty(spec.nbytes)
        _fill(layout, out_views(buffer, spec.outs), by_role, extra)
        # The leaves come first: packed records gathered past them are not sent.
        end = max((offset + size for _, _, offset, size, _ in spec.leaves), default=0)
        # Ragged and text rows as stored (`RaggedRows`, str), made batch values where the payload is read.
        apart = {key: (column.gather(rows) if isinstance(column, RaggedColumn) else column[rows], tensor_dtype)
                 for key in self.apart_keys(keys) for column, tensor_dtype in [self._apart[key]]} \
            if self.has_apart and rows.ndim == 1 else {}
        return Payload(buffer[:end], spec.leaves, tuple(spec.batch_size), apart)

    def layout_of(self, rows: np.ndarray, extra: Mapping[str, np.ndarray], obs_rows: np.ndarray | None = None,
                  next_rows: np.ndarray | None = None, keys: frozenset | None = None) -> tuple["Layout", "Layout", tuple]:
        """(layout key, layout, rows by role) of a call, for gathers out of other storage
        (`arrowbuf.arena`): ``layout.plan`` holds (column or extra name, role index:
        0 step, 1 obs, 2 next, -1 extra) for each of ``layout.slot.leaves``, in order."""
        key, layout, by_role = self._plan(rows, extra, obs_rows, next_rows, keys)
        if by_role[2] is None and layout.reads_next:   # `_fill` reads them shifted; other storage needs them
            by_role = (*by_role[:2], rows + 1)
        return key, layout, by_role

    def _plan(self, rows: np.ndarray, extra: Mapping[str, np.ndarray], obs_rows: np.ndarray | None,
              next_rows: np.ndarray | None, keys: frozenset | None) -> tuple[Layout, Layout, tuple]:
        """(layout key, layout, rows by role) of one call; the key is the layout itself."""
        if keys is not None and type(keys) is not frozenset:
            keys = self.check_keys(keys)
        shape = rows.shape
        # Next-observation rows by default (None) are a layout of their own: `_fill` reads them
        # as the rows themselves of the column shifted by one (no ``rows + 1`` to compute).
        layout = self._layouts.find((shape, shape if obs_rows is None else obs_rows.shape,
                                     None if next_rows is None else next_rows.shape), keys, extra)
        if obs_rows is None:
            obs_rows = rows
        return layout, layout, (rows, obs_rows, next_rows)

    def _layout(self, shapes: tuple, keys: frozenset | None, every_extra: tuple) -> Layout:
        def pack(chosen: list[FieldPlan]) -> dict[int, tuple]:
            return {i: (block, block.shape[1], offset) for i, f in enumerate(chosen) if f.key in self._packed
                    for block, offset in [self._packed[f.key]]}

        def takes(layout: Layout) -> tuple:
            # (out position, bound ``take`` of the column, role) per field not packed, then
            # per packed group (its records); a loop over `plan` that tells them apart and
            # looks up ``take`` per entry cost ~1 us of a W1 sample. Default next
            # observations (``next_rows`` None) take the step rows of the column shifted by one.
            # Encoded fields are decoded together, after the takes (`BatchDecodes`; None: none), a
            # dataset's video fields with them (`arrowbuf.video.VideoColumn`: a batch's frames in one pass).
            fields, decoded = [], []
            for i, (source, role) in enumerate(layout.plan):
                if role < 0 or i in layout.packed:
                    continue
                default_next = role == 2 and shapes[2] is None
                if isinstance(source, (EncodedColumn, VideoColumn)):
                    decoded.append(DecodedField(i, source, 0, 1) if default_next else DecodedField(i, source, role, 0))
                else:
                    fields.append((i, source[1:].take, 0) if default_next else (i, source.take, role))
            fields += [(region, block.take, role) for block, role, region in layout.records]
            return tuple(fields), BatchDecodes(decoded) if decoded else None

        return plan_layout(self._fields, shapes, keys, every_extra, pack, takes)


def take_fields(layout: Layout, outs: list[np.ndarray], by_role: tuple) -> None:
    """Take every field's rows (a packed block's records) into its view, decode the encoded
    fields' rows into theirs, and copy each packed field out of its records."""
    takes, decodes = layout.fill
    for i, take, role in takes:
        take(by_role[role], 0, outs[i], "clip")   # positional: numpy parses keywords slower
    if decodes is not None:
        decodes(by_role, outs)
    for i, source in layout.unpack:
        outs[i][...] = outs[source]


def _fill(layout: Layout, outs: list[np.ndarray], by_role: tuple, extra: Mapping[str, np.ndarray]) -> None:
    """`take_fields`, then copy every extra into its own view."""
    take_fields(layout, outs, by_role)
    for i, name in layout.copies:
        # Same dtype and shape (`arrowbuf.layout.matches`): an item assignment, half the cost of np.copyto.
        outs[i][...] = extra[name]


def _aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialized, ``ALIGN``-aligned byte array from numpy's allocator.

    Not ``torch.empty``: for a W2 batch (1.35 MB) torch's CPU allocator page-faults
    on about every other call (fresh pages from the kernel) where numpy's reuses the
    freed block; allocating and filling such a buffer measured 86-89 us with torch,
    69-70 us with numpy (in the whole sample the gain is within noise).
    """
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


@dataclass
class Payload:
    """A gathered batch: one byte buffer and where each key lives in it.

    It pickles as a numpy buffer, which Ray moves through its object store and the
    receiver reads without a copy.
    """

    flat: torch.Tensor | np.ndarray            # uint8 bytes
    spec: tuple[tuple[tuple[str, ...], str, int, int, tuple[int, ...]], ...]   # `SlotSpec.leaves`
    batch_shape: tuple[int, ...]
    # key -> (rows as stored: `RaggedRows` or an object array of str, tensor dtype) of the ragged
    # and text fields, which have no place in ``flat`` (`apart_value` makes them batch values).
    apart: dict = field(default_factory=dict)

    def __getstate__(self) -> dict:
        flat = self.flat.numpy() if is_tensor(self.flat) else self.flat
        return {**self.__dict__, "flat": flat}

    def tensors(self, device: torch.device | None = None) -> dict[tuple[str, ...], torch.Tensor]:
        """Every key's tensor: views of ``flat`` (moved in one copy to a non-CPU ``device``)."""
        flat = self.flat if is_tensor(self.flat) else _as_tensor(self.flat)
        if device is not None and device.type != "cpu":
            flat = flat.to(device, non_blocking=True)
        return dict(zip((key for key, *_ in self.spec), leaf_views(flat, self.spec)))

    def to_tensordict(self, device: torch.device | None = None) -> TensorDict:
        """Wrap as a TensorDict of views of ``flat`` (moved in one copy to a non-CPU ``device``)."""
        on_device = device is not None and device.type != "cpu"
        batch = make_tensordict(self.tensors(device), self.batch_shape, device if on_device else None)
        for key, (rows, tensor_dtype) in self.apart.items():
            value = apart_value(rows, tensor_dtype)
            batch.set(key, value.to(device) if on_device else value)
        return batch


def apart_value(rows: Any, tensor_dtype: str) -> Any:
    """A ragged field's `RaggedRows` as a jagged nested tensor, a text field's str as a ``NonTensorStack``."""
    if isinstance(rows, RaggedRows):
        return nested(rows, tensor_dtype)
    from tensordict import NonTensorStack

    return NonTensorStack.from_list(list(rows))


def _as_tensor(value: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(value) if value.flags.writeable else _readonly_tensor(value)


def make_tensordict(tensors: Mapping[tuple[str, ...], torch.Tensor], batch_shape: tuple[int, ...],
                    device: torch.device | None = None) -> TensorDict:
    """A (nested) TensorDict of ``tensors`` keyed by paths, built without per-key checks."""
    import torch

    return make_td(nest(tensors), torch.Size(batch_shape), device)


def empty_batch(schema: Any, device: torch.device | None = None) -> TensorDict:
    """A gather of no indices: ``schema``'s fields (observations also under ``"next"``; None: no
    schema yet, none), ``index``, ``episode_id`` and ``step``, each with 0 rows (both backends')."""
    import torch
    from tensordict import NonTensorStack

    tensors = {("index",): torch.zeros(0, dtype=torch.int64, device=device),
               ("episode_id",): torch.zeros(0, dtype=torch.int64, device=device),
               ("step",): torch.zeros(0, dtype=torch.int32, device=device)}
    for name, spec in (schema.fields.items() if schema is not None else ()):
        path = tuple(name.split("."))
        if spec.text:
            tensors[path] = NonTensorStack.from_list([])
        elif spec.ragged:
            rows = RaggedRows(np.zeros((0, *spec.shape[1:]), spec.numpy_dtype), np.zeros(1, np.int64))
            tensors[path] = nested(rows, spec.dtype).to(device)
        else:
            tensors[path] = torch.zeros((0, *spec.shape), dtype=spec.torch_dtype, device=device)
        if spec.observation:
            tensors[("next", *path)] = tensors[path]
    return make_tensordict(tensors, (0,), device)


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    # Arrays from Ray's object store are read-only views of shared memory; torch
    # warns because it has no read-only tensors. The store documents that such
    # tensors must not be written in place; copying here would break zero-copy.
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
