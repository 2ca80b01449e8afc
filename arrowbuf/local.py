"""The embedded backend: one `ShardEngine` in this process.

`ExperienceStore` holds a backend and talks to it through the members of
`arrowbuf.backend.Backend`; the Ray backend (`arrowbuf.ray.router`) offers the
same ones over shard actors. Arguments arrive checked by the facade.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf.engine import ShardEngine
from arrowbuf.errors import ArrowbufError, refused_in_batch
from arrowbuf.sample_args import SampleArgs
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode
from arrowbuf.tensors import empty_batch
from arrowbuf.versions import VERSION, VERSION_FIELD, ensure_version_column

if TYPE_CHECKING:
    from tensordict import TensorDict


class EngineSink:
    """Sends a writer's sealed episodes straight into an engine (synchronous)."""

    def __init__(self, engine: ShardEngine, timeout: float | None) -> None:
        self._engine = engine
        self.timeout = timeout   # of each write (`retime`: a claimed restored writer's own)

    def retime(self, timeout: float | None) -> None:
        """Each later write waits at most ``timeout`` (a claimed restored writer's)."""
        self.timeout = timeout

    @property
    def schema(self) -> Schema | None:
        return self._engine.schema

    @property
    def capacity(self) -> int:
        return self._engine.capacity

    def set_schema(self, schema: Schema) -> None:
        self._engine.set_schema(schema)

    @property
    def inplace_engine(self) -> ShardEngine | None:
        """The engine a writer writes its steps into in place (`arrowbuf.inplace`): this
        one, unless a rate limiter or ``mode="fixed"`` may refuse a write (then writers
        stage episodes and retry them)."""
        engine = self._engine
        return engine if engine.mode == "circular" and not engine.limited else None

    def add_version_column(self) -> None:
        """Give the store the ``policy_version`` column (0 in every row written before)."""
        ensure_version_column(self._engine, self._engine.schema.extended({VERSION: VERSION_FIELD}))

    def write(self, episode: Episode) -> None:
        self._engine.add(episode, timeout=self.timeout)

    def commit(self) -> None:
        """Writes are synchronous: nothing to send."""

    def flush(self) -> None:
        """Writes are synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""

    def dropped(self) -> None:
        """Writes are synchronous: a dropped writer's are done (`write_dropped`)."""

    def write_dropped(self, work: Callable[[], None]) -> None:
        """Run ``work``, a dropped writer's last writes, which never wait for the rate limiter
        (refused at once: `ShardEngine._wait`): now, or, where this thread holds the engine's
        lock (GC ran inside one of its store calls), when that call lets it go."""
        self.timeout = None
        lock = self._engine.lock
        if lock.held_here():
            lock.defer(work)
        else:
            work()


class LocalBackend:
    """An in-process store: one engine, one shard."""

    kind = "local"
    num_shards = 1
    name = None   # only a Ray store has a name
    engine: ShardEngine

    def __init__(self, engine: ShardEngine) -> None:
        self.engine = engine

    @property
    def schema(self) -> Schema | None:
        return self.engine.schema

    @property
    def storage_device(self) -> Any:
        """The torch device of a torch arena (`arrowbuf.arena`), or None."""
        return self.engine.storage_device

    def size(self, exact: bool = True) -> tuple[int, int]:
        """(transitions, episodes)."""
        _, transitions, episodes = self.engine.size()
        return transitions, episodes

    def set_schema(self, schema: Schema) -> None:
        self.engine.set_schema(schema)

    def add(self, episode: Episode, schema: Schema | None, timeout: float | None) -> int:
        return self.engine.add(episode, schema, timeout)

    def add_many(self, episodes: list, schema: Schema | None, timeout: float | None, shard: int | None) -> list[int]:
        """Store checked episodes in order (``shard`` is None or 0: there is one); their ids.

        One refused episode (a full fixed-mode store, the rate limiter) does not take the
        rest with it, as on a Ray shard: the others are stored, then the first error is
        raised saying how many were refused.
        """
        engine = self.engine
        ids = engine.add_block(episodes, schema)
        if ids is not None:
            return ids
        ids, refused = [], []
        for episode in episodes:
            try:
                ids.append(engine.add(episode, schema, timeout))
            except (ArrowbufError, ValueError) as err:
                refused.append(err)
        if refused:
            raise refused_in_batch(refused, len(episodes), "the store")
        return ids

    def pin(self, env_id: str, shard: int) -> None:
        """One shard: every env's episodes go to it."""

    def sink(self, timeout: float | None, env_ids: Sequence[str]) -> EngineSink:
        return EngineSink(self.engine, timeout)

    def import_episodes(self, episodes: Iterable[Episode]) -> int:
        """Store checked episodes of an import (counted, never refused by the rate limiter); how many."""
        count = 0
        for count, episode in enumerate(episodes, 1):
            self.engine.add(episode, limited=False)
        return count

    def sample(self, batch_size: int, args: SampleArgs, device: Any, pin_memory: bool, timeout: float | None,
               num_workers: int | None, worker_nodes: Sequence[str] | None,
               keys: Any = None, min_version: int | None = None) -> TensorDict | list[TensorDict]:
        if num_workers is not None:
            self._refuse_jagged_split(keys)
        batch = self.engine.sample(batch_size, args, device, pin_memory, timeout, keys, min_version)
        if num_workers is None:
            return batch
        return list(batch.split(batch_size // num_workers, dim=0))

    def _refuse_jagged_split(self, keys: Any) -> None:
        """Raise ValueError, before anything is drawn, when a ``num_workers`` sample would hold a
        ragged field: its jagged tensor cannot be split along the batch (torch raised a RuntimeError
        after the draw was counted)."""
        schema = self.engine.schema
        wanted = self.engine.check_keys(keys)
        ragged = [name for name, f in (schema.fields.items() if schema is not None else ())
                  if f.ragged and (wanted is None or tuple(name.split(".")) in wanted)]
        if ragged:
            raise ValueError(f"num_workers: the ragged fields {ragged} are jagged tensors, which cannot be split "
                             "into the workers' batches yet; sample each worker's batch on its own "
                             "(sample(batch_size // num_workers)), or leave them out with keys=")

    def sample_iter(self, batch_size: int, args: SampleArgs, device: Any, prefetch: int,
                    batches_per_request: int | None, min_version: int | None = None,
                    keys: Any = None) -> Iterator[TensorDict]:
        """Endless samples (of ``policy_version >= min_version`` when given): in-process there
        is no round trip to hide, so no prefetch."""
        self.engine.check_keys(keys)   # now, not at the first batch
        return (self.engine.sample(batch_size, args, device, keys=keys, min_version=min_version)
                for _ in itertools.count())

    def iter_batches(self, batch_size: int, shuffle: bool, drop_last: bool, device: Any,
                     keys: Any = None, min_version: int | None = None, split: Any = None) -> Iterator[TensorDict]:
        keys = self.engine.check_keys(keys)   # before the epoch's order is drawn
        # In order, a batch of contiguous rows is a view of the arena (no gather).
        chunks = self.engine.epoch(batch_size, shuffle, drop_last, min_version)   # drawn now: errors raised here
        return self._epoch(chunks, device, keys, views=not shuffle and min_version is None, split=split)

    def _epoch(self, chunks: list[np.ndarray], device: Any, keys: Any, views: bool,
               split: Any = None) -> Iterator[TensorDict]:
        """`ShardEngine.gather` each chunk of indices (an epoch), skipping those evicted meanwhile;
        ``split(engine, indices)``: this rank's share of each (`arrowbuf.groups.rank_share`), or
        every rank's, a list of shares (`arrowbuf.groups.rank_shares`; empty ones included),
        gathered together (`ShardEngine.gather_each`)."""
        for indices in chunks:
            if split is not None:
                indices = split(self.engine, indices)
            if isinstance(indices, list):
                shares = self.engine.gather_each(indices, device, keys, views)
                if any(share.batch_size[0] for share in shares):
                    yield shares
                continue
            batch = self.engine.gather(indices, device, keys, views)
            if batch is not None and batch.batch_size[0]:
                yield batch

    def evict(self, min_version: int) -> int:
        return self.engine.evict(min_version)

    def gather(self, index: np.ndarray, device: Any) -> TensorDict:
        """The live transitions of ``index`` (indices), in that order."""
        batch = self.engine.gather(index, device)
        found = 0 if batch is None else batch.batch_size[0]
        if found != len(index):
            raise KeyError(f"{len(index) - found} of the {len(index)} indices are not live "
                           "(evicted, cleared, or never written)")
        return batch if batch is not None else empty_batch(None, device)   # no schema yet: nothing to gather

    def gather_refs(self, indices: list[np.ndarray], extras: list[dict], flat_next: bool) -> list:
        """Refs of batches in Ray's object store: a Ray store's (its shards put them there)."""
        raise ValueError("gather_refs needs backend='ray': it leaves each batch in Ray's object store, put there "
                         "by the shards; a local store's gather(index) returns the batch in this process")

    def live_ranges(self) -> list[tuple[int, int]]:
        return [self.engine.live_range()]

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first index, transitions) of every live episode, shard by shard, oldest first."""
        first, length = self.engine.episode_spans()
        return np.zeros(len(first), np.int64), first, length

    def update_priorities(self, index: np.ndarray, priority: np.ndarray, wait: bool = True) -> int:
        return self.engine.update_priorities(index, priority)   # in-process: applied at once either way

    def compute_gae(self, gamma: float, lam: float, value_key: str, bootstrap_value: Any) -> int:
        return self.engine.compute_gae(gamma, lam, value_key, bootstrap_value)

    def episodes(self, include_open: bool = False) -> pa.Table:
        return self.engine.episodes(include_open)

    def episode(self, episode_id: int) -> pa.RecordBatch:
        return self.engine.episode(episode_id)

    def to_arrow(self) -> pa.Table:
        return self.engine.to_arrow()

    def clear(self) -> None:
        self.engine.clear()

    def stats(self) -> dict:
        return self.engine.stats()

    def export_steps(self, steps_dir: Path, schema: pa.Schema, **options: Any) -> tuple[pa.Table, list]:
        """Write the rows into ``steps_dir`` as Parquet parts: (episode table, file entries)."""
        from arrowbuf.parquet import export_shard

        return export_shard(self.engine.shard, self.engine.lock, steps_dir, schema, **options)

    def save(self, path: str | Path, info: Mapping[str, Any], writer_states: Callable[[], dict],
             progress: bool | None) -> Path:
        """Checkpoint the engine and the writers' open episodes (`arrowbuf.checkpoint`)."""
        from arrowbuf.checkpoint import save_engine

        return save_engine(self.engine, path, info, writer_states, progress)

    def to_ray_dataset(self) -> Any:
        raise ValueError("to_ray_dataset needs backend='ray'; a local store exports with to_parquet(), "
                         "which ray.data.read_parquet() reads")

    def flush(self) -> None:
        """Writes are synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release: the arena goes with the store object."""
