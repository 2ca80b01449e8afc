"""The torch arena: a shard whose columns are torch tensors on one device.

``ExperienceStore(..., storage_device="cuda")`` keeps every column as a tensor on
that device, so that rollouts collected on the GPU (IsaacLab-style: thousands of
envs stepping on the device) stay there: a write ``copy_``\\ s the episode's tensors
into their rows, and a sample is one ``index_select`` per column into an output on
the same device. Only the sampler's row indices (and the small index / episode id /
step arrays every batch carries) cross from the host, once per sample.

The same code runs on a CPU torch device (``storage_device="cpu"``), which is how
the tests cover it on machines without a GPU; there the outputs come from the
pooled, pre-faulted slots of `arrowbuf._pool` as the numpy arena's do.

What reads the arena from the host (Arrow views, Parquet export, checkpoints,
`compute_gae`, n-step look-ups, prioritized weights) gets host copies of the rows
it reads (`TorchShard.host_rows`, `TorchShard.reader`); on the CPU device they
are zero-copy views, as with the numpy arena. bfloat16 columns stay bfloat16 on
the device and leave it as their ``uint16`` bits, the form the rest of arrowbuf
uses on the host.

Example:
    >>> import torch, arrowbuf as ab
    >>> store = ab.ExperienceStore(100, seed=0, storage_device="cpu")
    >>> _ = store.add_episode({"obs": torch.zeros(5, 3, dtype=torch.bfloat16), "action": torch.zeros(4),
    ...                        "terminated": torch.tensor([False, False, False, True])})
    >>> batch = store.sample(8)
    >>> batch["obs"].dtype, batch["obs"].device.type
    (torch.bfloat16, 'cpu')
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch

from arrowbuf._bounds import check_arena
from arrowbuf._checks import tensor_to_numpy
from arrowbuf._pool import SlotPool, SlotSpec, leaf_views
from arrowbuf.errors import ResourceError, SchemaError
from arrowbuf.placement import arena_rows
from arrowbuf.fields import Field
from arrowbuf.ragged import refuse_apart
from arrowbuf.schema import Schema
from arrowbuf.stage_arrays import host_tensor
from arrowbuf.shard import Shard
from arrowbuf.tensors import Gather, make_tensordict, pinned

if TYPE_CHECKING:
    from tensordict import TensorDict

_log = logging.getLogger(__name__)


def check_device_memory(schema: Schema, capacity: int, device: torch.device) -> None:
    """Refuse a CUDA arena that does not fit in the device's free memory (a CPU one is
    checked against host memory by `arrowbuf._bounds.check_arena`).

    Raises:
        ResourceError: naming the bytes needed and free on the device.
    """
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    rows = arena_rows(capacity, lazy=False)   # a CUDA arena is allocated at once: all its rows
    needed = rows * schema.field_bytes
    if needed > free:
        fit = free // max(schema.field_bytes, 1)   # rows that fit; the largest capacity whose arena does
        most = max(0, (fit - 64) * 8 // 9)
        while arena_rows(most + 1, lazy=False) <= fit:
            most += 1
        while most and arena_rows(most, lazy=False) > fit:
            most -= 1
        raise ResourceError(f"storage_device={str(device)!r}: capacity={capacity:,} transitions take {rows:,} rows "
                            f"of {schema.field_bytes:,} bytes, which need {needed / 2**30:,.2f} GiB, but the device "
                            f"has {free / 2**30:,.2f} GiB free; use capacity <= {most:,}")


class TorchShard(Shard):
    """A `Shard` whose columns are torch tensors on ``device``.

    Args:
        schema, capacity, mode, shard, num_shards: as for `Shard`.
        device: where the columns live (a checked ``cpu`` or ``cuda`` torch.device).

    Raises:
        ResourceError: the arena does not fit in the device's (or the host's) memory.
    """

    host_columns = False

    def __init__(self, schema: Schema, capacity: int, mode: str = "circular", shard: int = 0,
                 num_shards: int = 1, *, device: torch.device, whole_pieces: bool = False) -> None:
        refuse_apart(schema, "a store with a storage_device", "leave storage_device=None")
        encoded = [name for name, f in schema.fields.items() if f.codec is not None]
        if encoded:
            raise SchemaError(f"fields {encoded} are encoded (codec=); a store with a storage_device keeps raw "
                              "tensors. Leave storage_device=None (rows encoded in host memory) and sample with "
                              "device='cuda' to move batches to the GPU")
        if device.type == "cuda":
            check_device_memory(schema, capacity, device)
        else:
            check_arena(schema, capacity)
        self.device = device
        self._full_logged = False   # the warning of a full arena that cannot grow: once
        super().__init__(schema, capacity, mode, shard, num_shards, whole_pieces)

    @property
    def lazy_rows(self) -> bool:
        """A CPU tensor's pages are faulted in by the first write (numpy allocates it); a CUDA one's are not."""
        return self.device.type != "cuda"

    def grow_arena(self, rows: int) -> int:
        """Columns of ``rows`` rows replace the arena's, their rows copied on the device (a CUDA
        arena, allocated at once, starts at an eighth over the capacity and grows as its pieces
        need: `arrowbuf.placement.Ring`). Gives the rows after: the same when the device has no
        room for the larger columns beside the current ones (then the oldest go early; logged once)."""
        old = self.rows
        needed = rows * self.schema.field_bytes   # the larger columns, while the current ones live
        if self.device.type == "cuda" and needed > torch.cuda.mem_get_info(self.device)[0]:
            return self._cannot_grow(needed)
        self.rows = rows
        try:
            grown = {}
            for name, spec in self.schema.fields.items():
                column = self.new_column(spec, zero=False)
                column[:old].copy_(self.arena[name])
                grown[name] = column
        except torch.cuda.OutOfMemoryError:
            self.rows = old
            return self._cannot_grow(needed)
        self.arena = grown
        self.rows_grown(old)
        self.gatherer = self.make_gatherer(self.gather_columns())
        return rows

    def _cannot_grow(self, needed: int) -> int:
        """The rows kept (the device has no room for ``needed`` bytes of larger columns), logged once."""
        if not self._full_logged:
            self._full_logged = True
            _log.warning("arrowbuf: the %s arena of %s rows is full and the device has no %.2f GiB free to "
                         "grow it; the oldest steps go before the capacity (%s transitions) is reached",
                         self.device, f"{self.rows:,}", needed / 2**30, f"{self.capacity:,}")
        return self.rows

    def new_column(self, spec: Field, zero: bool) -> torch.Tensor:
        if self.device.type == "cpu":
            # numpy's allocator asks for transparent huge pages for large arrays, torch's does
            # not: random gathers of a WBC rollout (98,304 of 102,400 rows of 286 float32)
            # measured 30-32 ms from a numpy-allocated column, 40-48 ms from torch.empty's.
            return host_tensor(super().new_column(spec, zero), spec)
        make = torch.zeros if zero else torch.empty
        return make((self.rows, *spec.shape), dtype=spec.torch_dtype, device=self.device)

    def new_packed(self, fields: Any) -> tuple[None, dict]:
        """None: a device arena keeps every field as its own tensor (``index_select`` per
        column; row packing answers host cache misses, `arrowbuf.packing`)."""
        return None, {}

    def make_gatherer(self, columns: dict) -> Gather:
        return TorchGather(columns, self.device)

    def write_rows(self, name: str, start: int, data: Any) -> None:
        """``copy_`` an episode's column in: a tensor as it is (any device; cast to the
        column's dtype), a numpy array through a CPU view of it."""
        if not isinstance(data, torch.Tensor):
            data = host_tensor(data, self.schema.fields[name])
        self.arena[name][start:start + len(data)].copy_(data)

    def zero_rows(self, name: str, start: int, stop: int) -> None:
        self.arena[name][start:stop].zero_()

    def scatter(self, name: str, rows: np.ndarray, values: Any) -> None:
        """Write a step's ``values`` (a tensor on any device, or numpy; bfloat16 numpy as
        its uint16 bits) at arena ``rows``, on the arena's device."""
        column = self.arena[name]
        if not len(rows):
            return
        if not isinstance(values, torch.Tensor):
            values = host_tensor(np.ascontiguousarray(values), self.schema.fields[name])
        index = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(self.device)
        column.index_copy_(0, index, values.to(self.device, column.dtype).reshape(len(rows), *column.shape[1:]))

    def zero_at(self, name: str, rows: np.ndarray) -> None:
        index = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(self.device)
        self.arena[name].index_fill_(0, index, 0)

    def put_rows(self, name: str, rows: np.ndarray, values: np.ndarray) -> None:
        index = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(self.device)
        column = self.arena[name]
        column.index_copy_(0, index, host_tensor(values, self.schema.fields[name]).to(self.device, column.dtype))

    def host_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` in host memory: a copy from a CUDA device, a view on the CPU."""
        return tensor_to_numpy(self.arena[name][start:stop])

    def reader(self, name: str) -> "DeviceReader":
        return DeviceReader(self.arena[name], self.schema.fields[name].numpy_dtype)

    def tensor_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.arena[name][start:stop]

    def extra_tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)


class DeviceReader:
    """Reads of a device column by host row indices: ``reader[rows]`` gathers on the
    device and returns the rows in host memory (numpy, bfloat16 as uint16 bits)."""

    def __init__(self, column: torch.Tensor, dtype: np.dtype) -> None:
        self.column = column
        self.dtype = dtype   # of the host arrays it returns

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        index = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(self.column.device)
        return tensor_to_numpy(self.column[index])


class TorchGather(Gather):
    """`Gather` out of torch columns on ``device``: one ``index_select`` per column
    into one output buffer on that device, wrapped as a TensorDict of views.

    On the CPU the buffer comes from a `SlotPool` (reused once nothing refers to its
    batch, as the numpy arena's); on a CUDA device it is a fresh tensor from torch's
    caching allocator, which hands back freed device blocks without faulting pages.
    """

    def __init__(self, columns: Mapping[tuple[str, ...], tuple[torch.Tensor, str, torch.dtype]],
                 device: torch.device) -> None:
        super().__init__(columns)
        self.device = device
        self._slots = SlotPool()

    def __call__(self, rows: np.ndarray, extra: Mapping[str, np.ndarray] | None = None,
                 device: torch.device | str | None = None, pin_memory: bool = False, *,
                 obs_rows: np.ndarray | None = None, next_rows: np.ndarray | None = None,
                 keys: frozenset | None = None) -> TensorDict:
        """Gather on the arena's device; a ``device`` elsewhere gets one copy of the result.

        Args: as for `Gather.__call__`; ``device`` None keeps the batch on the arena's device.
        """
        extra = extra or {}
        key, layout, by_role = self.layout_of(rows, extra, obs_rows, next_rows, keys)
        spec = layout.slot
        if self.device.type == "cpu":
            # One byte view of the whole slot: the leaves are views of it.
            outs, batch = self._slots.claim(key, SlotSpec(spec.nbytes, ((np.dtype(np.uint8), (spec.nbytes,), 0),),
                                                          spec.leaves, spec.batch_size))
            flat = torch.from_numpy(outs[0])
        else:
            flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device)
            batch = None
        views = leaf_views(flat, spec.leaves)
        index: dict[int, torch.Tensor] = {}
        for (source, role), view in zip(layout.plan, views):
            if role < 0:
                view.copy_(torch.from_numpy(np.ascontiguousarray(extra[source])))
                continue
            if role not in index:
                rows_of_role = torch.from_numpy(np.ascontiguousarray(by_role[role], np.int64).reshape(-1))
                index[role] = rows_of_role.to(self.device)
            torch.index_select(source, 0, index[role], out=view.view(-1, *source.shape[1:]))
        if batch is None:
            batch = make_tensordict(dict(zip((leaf[0] for leaf in spec.leaves), views)), tuple(spec.batch_size),
                                    self.device)
        target = torch.device(device) if device is not None else None
        if target is not None and target != self.device and not (target.type == "cpu" == self.device.type):
            return batch.to(target)   # tensordict syncs a device -> host copy before returning
        if pinned(pin_memory, target) and self.device.type == "cpu":
            return batch.pin_memory()
        return batch
