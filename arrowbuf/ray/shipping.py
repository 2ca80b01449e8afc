"""Batches for train workers that stay in Ray's object store: the driver holds only their refs.

`gather_refs` asks the shards for the rows of each worker's batch; each shard
gathers its part into one buffer and returns it as the result of the call, so
it lands in the object store and the caller gets an ObjectRef, never the data.
A batch whose rows all live on one shard is that shard's answer, wrapped as a
`ShippedBatch`. A batch drawn from several shards is put together by a small
Ray task (`assemble_task`) on the node of the shard that gives it most rows:
its arguments are the shards' refs, so the parts move between object stores,
not through the driver. The caller waits only for a row count per call (small),
so a shard's error is raised to it, before any worker resolves a ref.

A `ShippedBatch` pickles as a function call that rebuilds a TensorDict: the
value of the ref *is* a TensorDict. ``ray.get(ref)`` (or `resolve`), or Ray
resolving the ref as the argument of a task or actor call (RLightning's
``policy.update_dataset.remote(ref)``), gives it directly. Its tensors are
views of the object store's read-only memory (no copy): ``clone()`` before
writing in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from arrowbuf._lazy_torch import is_tensor
from arrowbuf.fields import dtype_itemsize
from arrowbuf.ragged import RaggedRows
from arrowbuf.ray.apart import stored_concat
from arrowbuf.ray.handles import ShardHandles
from arrowbuf.ray.options import INDEX_SHIFT, LOCAL_MASK, ray_module
from arrowbuf.tensors import Payload, apart_value, make_tensordict

if TYPE_CHECKING:
    from tensordict import TensorDict

# How a batch is finished: (batch shape, extra fields, next keys flat: ("next", k) -> "next_k").
Finish = tuple[tuple[int, ...], dict, bool]


class ShippedBatch:
    """A gathered batch that unpickles as a TensorDict (see the module docstring).

    Args:
        payload: the rows, batch dim first, in the batch's order.
        finish: (batch shape, extra fields as numpy arrays of that leading shape,
            whether ``next`` fields become ``next_<name>`` keys).
    """

    def __init__(self, payload: Payload, finish: Finish) -> None:
        self.payload = payload
        self.finish = finish

    def __reduce__(self) -> tuple:
        payload = self.payload
        flat = payload.flat.numpy() if is_tensor(payload.flat) else payload.flat
        return rebuild_batch, (flat, payload.spec, *self.finish, payload.apart)


def rebuild_batch(flat: np.ndarray, spec: tuple, batch_shape: tuple[int, ...], extra: Mapping[str, np.ndarray],
                  flat_next: bool, apart: dict | None = None) -> TensorDict:
    """The TensorDict of a `ShippedBatch`: views of ``flat`` shaped to ``batch_shape``, with the
    ragged and text fields of ``apart`` (`arrowbuf.tensors.Payload.apart`; 1-D batches only)."""
    import torch

    rows = int(np.prod(batch_shape))
    tensors = {}
    for key, tensor in Payload(flat, spec, (rows,)).tensors().items():
        if flat_next and key[0] == "next" and len(key) > 1:
            key = (f"next_{key[1]}", *key[2:])
        tensors[key] = tensor.view(*batch_shape, *tensor.shape[1:])
    for name, value in extra.items():
        tensors[(name,)] = torch.from_numpy(np.array(value))
    batch = make_tensordict(tensors, batch_shape)
    for key, (rows, tensor_dtype) in (apart or {}).items():
        batch.set(key, apart_value(rows, tensor_dtype))
    return batch


def merge_payloads(parts: Sequence[Payload], positions: Sequence[np.ndarray]) -> Payload:
    """One payload whose row ``positions[k][i]`` is row i of ``parts[k]`` (positions cover 0..n-1)."""
    total = sum(len(p) for p in positions)
    leaves, offset = [], 0
    for key, dtype, _, size, shape in parts[0].spec:
        row_bytes = size // shape[0] if shape[0] else dtype_itemsize(dtype) * int(np.prod(shape[1:]))
        leaves.append((key, dtype, offset, row_bytes * total, (total, *shape[1:])))
        offset += -(-row_bytes * total // 64) * 64   # 64-byte aligned, as gathers lay them out
    flat = np.empty(max(offset, 1), np.uint8)
    for part, where in zip(parts, positions):
        source = part.flat.numpy() if is_tensor(part.flat) else part.flat
        for (_, _, src, size, shape), (_, _, dst, out_size, _) in zip(part.spec, leaves):
            rows = shape[0]
            if rows:
                flat[dst:dst + out_size].reshape(total, -1)[where] = source[src:src + size].reshape(rows, -1)
    return Payload(flat, tuple(leaves), (total,), merge_apart(parts, positions))


def merge_apart(parts: Sequence[Payload], positions: Sequence[np.ndarray]) -> dict:
    """The parts' ragged and text rows (`Payload.apart`) in one batch, row ``positions[k][i]`` being
    row i of ``parts[k]``'s (its values copied once more, in batch order)."""
    if not parts or not parts[0].apart:
        return {}
    batch_order = np.argsort(np.concatenate(positions), kind="stable")
    merged = {}
    for key, (_, tensor_dtype) in parts[0].apart.items():
        rows = [part.apart[key][0] for part in parts]
        joined = stored_concat(rows) if isinstance(rows[0], RaggedRows) else np.concatenate(rows)
        merged[key] = (joined[batch_order], tensor_dtype)
    return merged


def assemble_task(positions: list[np.ndarray], finish: Finish, *parts: Payload) -> tuple[int, ShippedBatch]:
    """The body of the Ray task that puts a batch together from several shards' parts."""
    payload = merge_payloads(parts, positions)
    return payload.batch_shape[0], ShippedBatch(payload, finish)


def gather_refs(shards: ShardHandles, indices: Sequence[np.ndarray], extras: Sequence[dict],
                flat_next: bool) -> list:
    """One ObjectRef per index array: its transitions as a TensorDict of the array's shape.

    Args:
        shards: the store's shard handles.
        indices: int64 arrays (1-D, or 2-D for [n, L] batches) of store indices
            (``shard << 48 | local index``), each non-empty.
        extras: per batch, extra fields (numpy arrays shaped like its indices).
        flat_next: ``("next", k)`` keys become ``"next_k"`` (RLightning's names).

    Raises:
        KeyError: some indices are not live (evicted, cleared, never written, or of
            no shard); nothing is left for the workers to resolve then.
        ShardError: a shard is dead.
    """
    ray = ray_module()
    calls = []   # per batch: (finish, [(shard, positions, status ref, data ref)])
    for index, extra in zip(indices, extras):
        flat = index.reshape(-1)
        owner = flat >> INDEX_SHIFT
        shard_ids = np.unique(owner)
        bad = shard_ids[(shard_ids < 0) | (shard_ids >= shards.num_shards)]
        if len(bad):
            raise KeyError(f"indices of shard {int(bad[0])} are not live: the store has {shards.num_shards} shards")
        finish: Finish = (tuple(index.shape), dict(extra), flat_next)
        whole = len(shard_ids) == 1   # one shard finishes the batch itself, else a task assembles the parts
        parts = []
        for shard in shard_ids.tolist():
            where = np.flatnonzero(owner == shard)
            status, data = _handle(shards, shard).gather_ref.options(num_returns=2).remote(
                flat[where] & LOCAL_MASK, finish if whole else None)
            parts.append((shard, where, status, data))
        calls.append((finish, parts))
    refs, assembling = [], []
    for finish, parts in calls:   # every shard works while the first answers are read
        _check_counts(shards, parts)
        if len(parts) == 1:
            refs.append(parts[0][3])
            continue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        main = max(parts, key=lambda p: len(p[1]))[0]
        task = ray.remote(assemble_task).options(
            num_cpus=0, num_returns=2,
            scheduling_strategy=NodeAffinitySchedulingStrategy(shards.nodes[main], soft=True))
        status, data = task.remote([p[1] for p in parts], finish, *[p[3] for p in parts])
        assembling.append(status)
        refs.append(data)
    ray.get(assembling)   # an assembling task's error surfaces here, not in a worker
    return refs


def _handle(shards: ShardHandles, shard: int) -> Any:
    """The actor handle of a live ``shard`` (`ShardHandles.call`'s checks)."""
    shards.check_open()
    if shard in shards.dead:   # its rows are gone, allow_partial or not
        raise shards.dead_error()
    return shards.handles[shard]


def _check_counts(shards: ShardHandles, parts: list) -> None:
    """Wait for the shards' row counts of one batch; raise if some indices were not live."""
    wanted = found = 0
    for shard, where, status, _ in parts:
        result = shards.get({shard: status})
        wanted += len(where)
        found += result.get(shard, 0)
    if found != wanted:
        raise KeyError(f"{wanted - found} of the {wanted} indices of a batch are not live "
                       "(evicted, cleared, or never written)")


def resolve(batch: Any) -> TensorDict:
    """The TensorDict of a batch ref (`gather_refs`, `DataBuffer.sample` on Ray); a TensorDict as is.

    Raises:
        TypeError: neither an ObjectRef nor a TensorDict.
    """
    from tensordict import TensorDict   # here, not at the top: shard actors import this module

    if isinstance(batch, TensorDict):
        return batch
    ray = ray_module()
    if isinstance(batch, ray.ObjectRef):
        return ray.get(batch)
    raise TypeError(f"resolve takes an ObjectRef of a batch or a TensorDict, got {type(batch).__name__}")
