"""Reading a DataBuffer by index and sampling it: index arithmetic, the seed's samplers, the worker split.

Indices count the stored transitions (episodes with ``storage.unit="episode"``),
oldest first, over all shards together, or over one shard with ``(shard,
indices)``. Samplers draw positions with an explicit `numpy.random.Generator`;
`Reader.read` gathers them through the store's public index reads (`ExperienceStore.live_ranges`,
`episode_spans`, `gather`, `gather_refs`; indices are a batch's ``"index"`` values).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from arrowbuf import tensors
from arrowbuf.ray.options import ray_module
from arrowbuf.store import ExperienceStore

logger = logging.getLogger(__name__)


def to_seed_keys(batch: TensorDict) -> TensorDict:
    """``("next", k)`` -> ``next_k`` (``next_observation``), the seed's key for next observations."""
    if "next" in batch.keys():
        for key in list(batch["next"].keys()):
            batch.rename_key_(("next", key), f"next_{key}")
        del batch["next"]
    return batch


def positions(item: Any, count: int, unit: str) -> tuple[np.ndarray, bool]:
    """Indices into ``count`` items as an int64 array, and whether ``item`` was a scalar.

    Raises:
        IndexError: an index out of range (negative ones count from the end).
        TypeError: not an int, slice, or array / list / tensor of ints or bools.
    """
    if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
        index = int(item) + count if item < 0 else int(item)
        if not 0 <= index < count:
            raise IndexError(f"{unit} index {item} out of range for a buffer of {count} {unit}s")
        return np.array([index], np.int64), True
    if isinstance(item, slice):
        return np.arange(*item.indices(count), dtype=np.int64), False
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    array = np.asarray(item)
    if array.dtype == bool:
        if array.shape != (count,):
            raise IndexError(f"boolean index of shape {array.shape} for a buffer of {count} {unit}s")
        return np.flatnonzero(array), False
    if array.size == 0:
        return np.zeros(0, np.int64), False
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{unit} indices must be ints, a slice, or an array / list / tensor of ints; "
                        f"got {type(item).__name__} of dtype {array.dtype}")
    array = array.reshape(-1).astype(np.int64)
    array = np.where(array < 0, array + count, array)
    bad = array[(array < 0) | (array >= count)]
    if len(bad):
        raise IndexError(f"{unit} index {int(bad[0])} out of range for a buffer of {count} {unit}s")
    return array, False


def empty_batch(schema: Any, device: Any) -> TensorDict:
    """A batch of no transitions with every field of ``schema`` (what a draw of nothing returns,
    `arrowbuf.tensors.empty_batch`), in the seed's keys: observation fields also as ``next_<name>``."""
    return to_seed_keys(tensors.empty_batch(schema, device))


class Reader:
    """Index reads of a store (either backend), through its public index API.

    Args:
        store: the compat layer's store; reads flush it first, so they see every write.
        unit: "transition" or "episode".
        device: device of returned batches (None: CPU).
        capacity: transitions a shard holds, as the seed's ring of ``capacity`` rows does
            (None: all the store keeps). The store evicts whole episodes and keeps a final
            observation row per episode, so it may keep a few more: only the newest
            ``capacity`` transitions of each shard are addressed (in episode unit, the
            newest episodes that fit), as the seed's ring overwrites its oldest rows.
    """

    def __init__(self, store: ExperienceStore, unit: str, device: Any, capacity: int | None = None) -> None:
        self.store = store
        self.unit = unit
        self.device = device
        self.capacity = capacity

    def space(self, shards: Any = None) -> Any:
        """What indices address: per-shard live index ranges (transition unit) or the episode table,
        restricted to ``shards`` (an int or a collection; None: all)."""
        if isinstance(shards, (int, np.integer)):
            shards = (int(shards),)
        if self.unit == "episode":
            self.store.flush()
            shard, first, length = self.store.episode_spans()
            if self.capacity is not None:
                shard, first, length = self._newest_episodes(shard, first, length)
            if shards is not None:
                keep = np.isin(shard, list(shards))
                shard, first, length = shard[keep], first[keep], length[keep]
            return shard, first, length
        self.store.flush()
        ranges = self.store.live_ranges()
        if self.capacity is not None:
            ranges = [(max(a, b - self.capacity), b) for a, b in ranges]
        if shards is not None:
            for s in shards:
                if not 0 <= s < len(ranges):
                    raise IndexError(f"storage index {s} out of range for {len(ranges)} shard(s)")
            ranges = [(a, b) if s in shards else (a, a) for s, (a, b) in enumerate(ranges)]
        return ranges

    def _newest_episodes(self, shard: np.ndarray, first: np.ndarray,
                         length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The newest episodes of each shard whose transitions add up to at most the capacity."""
        keep = np.zeros(len(shard), bool)
        for s in np.unique(shard):
            mine = np.flatnonzero(shard == s)            # oldest first
            newest_first = np.cumsum(length[mine][::-1])
            keep[mine[::-1][newest_first <= self.capacity]] = True
        return shard[keep], first[keep], length[keep]

    @staticmethod
    def count(space: Any) -> int:
        if isinstance(space, tuple):
            return len(space[0])
        return int(sum(b - a for a, b in space))

    @staticmethod
    def locate(where: np.ndarray, space: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(shard, store index, mask) of the items at positions ``where`` of ``space``: indices
        [n] for transitions, [n, T_max] for episodes (the last step repeated past an
        episode's end, where ``mask`` is False)."""
        if isinstance(space, tuple):
            shards, first, length = (column[where] for column in space)
            span = int(length.max()) if len(length) else 0
            steps = np.arange(span, dtype=np.int64)
            index = first[:, None] + np.minimum(steps[None, :], length[:, None] - 1)
            return shards, index, steps[None, :] < length[:, None]
        sizes = np.array([b - a for a, b in space], np.int64)
        bounds = np.cumsum(sizes)
        shards = np.searchsorted(bounds, where, side="right")
        return shards, np.array([a for a, _ in space], np.int64)[shards] + where - (bounds - sizes)[shards], None

    def read(self, where: np.ndarray, space: Any) -> TensorDict:
        """The items at positions ``where`` of ``space``, in that order, as one TensorDict."""
        device = self.device
        if not len(where):
            return empty_batch(self.store.schema, device)
        shards, index, mask = self.locate(where, space)
        # Episodes are gathered time-major, [T, n] columns handed over as [n, T] views: the trainer's
        # permute to [T, episodes] (RSL-RL's update_dataset) then flattens them without a copy.
        axis = 0 if mask is None else 1
        parts, order = [], []
        for shard in np.unique(shards):
            chosen = np.flatnonzero(shards == shard)
            rows = index[chosen]
            if mask is None:
                parts.append(self.store.gather(rows, device=device))
            else:
                parts.append(self.store.gather(rows.T.reshape(-1), device=device).reshape(rows.shape[::-1]))
            order.append(chosen)
        batch = parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)
        if len(parts) > 1:
            back = torch.from_numpy(np.argsort(np.concatenate(order), kind="stable"))
            batch = batch[back] if mask is None else batch[:, back]
        if mask is not None:
            batch = batch.permute(1, 0)
            mask = torch.from_numpy(np.ascontiguousarray(mask.T)).permute(1, 0)
            batch["mask"] = mask.to(batch.device) if batch.device is not None else mask
        return to_seed_keys(batch)

    def refs(self, requests: list[tuple[np.ndarray, Any]]) -> list[Any]:
        """Ray: ObjectRefs of the batches `read` would give for each (positions, space), gathered
        and kept in the object store by the shards (`ExperienceStore.gather_refs`), on the CPU."""
        located = [self.locate(where, space) for where, space in requests]
        wanted = [k for k, (where, _) in enumerate(requests) if len(where)]
        extras = [{"mask": located[k][2]} if located[k][2] is not None else {} for k in wanted]
        refs = self.store.gather_refs([located[k][1] for k in wanted], extras=extras, next_keys="flat") if wanted else []
        out = [None] * len(requests)
        for k, ref in zip(wanted, refs):
            out[k] = ref
        for k in set(range(len(requests))) - set(wanted):   # no rows: every field, empty (nothing to keep off here)
            out[k] = ray_module().put(empty_batch(self.store.schema, None))
        return out


def select(rng: np.random.Generator, sampler: str, batch_size: int | None, count: int, shuffle: bool) -> np.ndarray:
    """Positions drawn by the seed's sampler: ``uniform`` (with replacement), ``batch``
    (without), ``all`` (every item, shuffled if ``shuffle``).

    Raises:
        ValueError: no batch_size for 'uniform' / 'batch', an empty buffer, or a
            'batch' larger than ``count``.
    """
    if sampler == "all":
        if batch_size is not None and batch_size != count:
            logger.warning("sampler 'all' returns all %d stored items; batch_size=%d is ignored", count, batch_size)
        return rng.permutation(count) if shuffle else np.arange(count)
    if batch_size is None:
        raise ValueError(f"sampler {sampler!r} needs a batch_size (got None); only sampler 'all' samples "
                         "everything without one")
    if sampler == "uniform":
        if count == 0:
            raise ValueError("cannot sample: the buffer is empty")
        return rng.integers(0, count, size=batch_size)
    if batch_size > count:
        raise ValueError(f"sampler 'batch' draws without replacement: batch_size {batch_size} is more than "
                         f"the {count} stored items")
    return rng.choice(count, size=batch_size, replace=False)


def split(indices: np.ndarray, workers: int, drop_last: bool) -> list[np.ndarray]:
    """The seed's split over train workers: worker k gets indices k, k+W, ...

    ``drop_last`` trims to a multiple of ``workers``; otherwise the first indices
    are repeated to fill the last round.

    Raises:
        ValueError: fewer indices than workers with ``drop_last``.
    """
    n = len(indices)
    if drop_last:
        per_worker = n // workers
        if per_worker == 0 and n:
            raise ValueError(f"a batch of {n} items cannot be split over {workers} train workers with "
                             "drop_last=True; sample more or pass drop_last=False")
        indices = indices[:per_worker * workers]
    else:
        indices = np.resize(indices, math.ceil(n / workers) * workers) if n else indices
    return [indices[k::workers] for k in range(workers)]
