"""`RayBackend`: what ``ExperienceStore(backend="ray")`` holds; it routes, splits and assembles.

The backend holds the handles of one named actor per shard (`ShardServer`,
each running a `ShardEngine`; started or found by `arrowbuf.ray.start`) and
the sizes they last reported. It implements the `arrowbuf.backend.Backend`
protocol, as `arrowbuf.local.LocalBackend` does:

- writes: `add` sends one episode and waits for its shard's answer, which
  carries its id (a round trip); writers (`sink`) are the asynchronous, batched
  path (`arrowbuf.ray.sink`);
- samples are drawn and gathered in this process by a `BlockReader`
  (`arrowbuf.ray.reader`), from the sealed blocks the shards publish in the
  object store: uniform, sequence and episode draws with no actor call;
  prioritized, rate-limited and stateful samplers ask the shards for indices
  (split in proportion to their priority mass, or transitions), and
  `sample_iter` keeps those requests in flight;
- epochs (`iter_batches`) shuffle the indices of every shard together and
  gather them from the blocks;
- reads by index (`gather`, `live_ranges`, `episode_spans`) use indices
  ``shard << 48 | local index``, the values of a batch's ``"index"``.

Sizes (`size`, hence ``len(store)``) come from a `SizeCache`: writes'
acknowledgements and samples update it, and a background request refreshes it
every ``RayOptions.size_refresh`` seconds, so reading it never waits. It is
stale by at most that interval plus a round trip for changes made elsewhere;
`flush` waits for this process's writes and refreshes it, so ``len`` right
after `flush` is exact.
"""

from __future__ import annotations

import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from arrowbuf._bounds import check_batch
from arrowbuf.errors import ShardError
from arrowbuf.ray.apart import refuse_durable_apart
from arrowbuf.ray.fresh import check_fresh_sampler, fresh_indices
from arrowbuf.ray.fresh import newest as fresh_newest
from arrowbuf.ray.gae import compute_gae
from arrowbuf.ray.handles import ShardHandles, SizeCache
from arrowbuf.ray.options import INDEX_SHIFT, LOCAL_MASK, RayOptions, ray_module
from arrowbuf.ray.persist import save_ray_store, to_ray_dataset
from arrowbuf.ray.priorities import PriorityUpdates
from arrowbuf.ray.ranks import rank_indices
from arrowbuf.ray.reader import BlockReader, SampleRequest
from arrowbuf.ray.shares import CapacityShares
from arrowbuf.ray.shipping import gather_refs, merge_payloads
from arrowbuf.ray.dropped import DroppedWriters
from arrowbuf.ray.sink import RaySink
from arrowbuf.ray.start import find_shards, release_durable
from arrowbuf.ray.views import held_in
from arrowbuf.sample_args import PLAIN, SampleArgs
from arrowbuf.groups import GroupSampler
from arrowbuf.samplers import Sampler, epoch_batches
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode
from arrowbuf.table import EpisodeTable
from arrowbuf.versions import no_fresh
from arrowbuf.tensors import Payload, empty_batch, pinned

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict


class RayBackend:
    """A store's shards in Ray actors (see the module docstring).

    Args:
        shards: handles of the running shard actors (`start_shards`, `attach`).
        capacity: rows of all shards together.
        sampler: the store's sampler (each shard runs its own copy).
        seed: seed of the router's generator (splits and epochs).
        schema: the store's schema, if known.
        schema_fixed: the schema was given (or found on the shards), not
            inferred from this process's first write.
    """

    kind = "ray"
    engine = None           # the engines live in the shard actors
    storage_device = None   # columns stay in the shards' host memory

    def __init__(self, shards: ShardHandles, *, capacity: int, sampler: Sampler, seed: int | None,
                 schema: Schema | None, schema_fixed: bool) -> None:
        self.shards = shards
        self.capacity = capacity   # transitions of all shards together: the sum of their shares
        self.sampler = sampler
        self._rng = np.random.default_rng(seed)
        self._schema = schema
        self._schema_fixed = schema_fixed
        self._sizes = SizeCache(shards)
        self._sizes.refresh()
        self._sink = RaySink(shards, self._sizes, schema)   # add_episode's route (and imports)
        self._writer_sinks: weakref.WeakSet[RaySink] = weakref.WeakSet()   # this process's writers' (`save`)
        self._dropped = DroppedWriters()   # deliveries of writers dropped without flush or close
        # This process's view of the shards' sealed blocks: draws and gathers here.
        self._reader = BlockReader(shards, self._sizes, sampler, self._rng, lambda: self.schema)
        self._reader.set_schema(schema)   # and every change of it: the reader never asks back while it knows one
        self._updates = PriorityUpdates(shards, self._sizes)
        # Each shard's share of the capacity follows the envs of this process's writers; only the
        # process that started the shards moves them (`arrowbuf.ray.shares`), and only when they
        # share one node or ignore nodes: with `node_affinity`, writers send an env to a shard of
        # their own node, which only their first write knows.
        affine = shards.options.node_affinity and len(set(shards.nodes)) > 1
        self._shares = CapacityShares(shards, self._sizes, capacity) if shards.started_here() and not affine else None
        self._added = 0   # episodes sent by `add` without an env id: their routing keys

    @classmethod
    def attach(cls, name: str, seed: int | None = None, options: RayOptions | None = None
               ) -> tuple["RayBackend", dict]:
        """The backend of the running store ``name`` and the configuration of its shard 0
        (capacity is the total over the shards).

        Raises:
            ValueError: no store of that name is running.
            ShardError: one of its shards is not running.
        """
        shards, config = find_shards(name, options or RayOptions())
        schema = Schema.from_json(config["schema"]) if config["schema"] is not None else None
        backend = cls(shards, capacity=config["capacity"], sampler=config["sampler"], seed=seed, schema=schema,
                      schema_fixed=schema is not None)
        return backend, config

    @staticmethod
    def new_name() -> str:
        return f"store-{uuid.uuid4().hex[:8]}"

    # -- shape ----------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.shards.name

    @property
    def num_shards(self) -> int:
        return self.shards.num_shards

    @property
    def options(self) -> RayOptions:
        return self.shards.options

    @property
    def schema(self) -> Schema | None:
        """The schema; asks the shards while none is known here."""
        if self._schema is None:
            found = [s for s in self.shards.broadcast("schema_json").values() if s is not None]
            if found:
                self._schema = Schema.from_json(found[0])
                self._sink.set_schema(self._schema)
                self._reader.set_schema(self._schema)
        return self._schema

    def set_schema(self, schema: Schema) -> None:
        if self.shards.durable:
            refuse_durable_apart(schema)
        if self._schema is None:
            self._schema = schema
            self._sink.set_schema(schema)
            self._reader.set_schema(schema)

    def size(self, exact: bool = True) -> tuple[int, int]:
        """(transitions, episodes): asked of every shard now (one round trip), so every write
        acknowledged before it counts, whichever process made it; ``exact=False``: as last
        reported (never waits; see the module docstring)."""
        if exact:
            self._sizes.refresh()
        else:
            self._sizes.poll()
        return self._sizes.totals()

    def shard_sizes(self) -> np.ndarray:
        """Sampling mass of each shard as last reported (0 for dead ones)."""
        return self._sizes.masses.copy()

    # -- writing --------------------------------------------------------------------

    def add(self, episode: Episode, schema: Schema | None, timeout: float | None) -> int:
        """Send one episode to its env's shard and wait for its id.

        Episodes of a named env stay on one shard; those without an env id
        (``"default"``) go to the least loaded shard.
        """
        known = self._schema is not None
        self.set_schema(schema)
        self._added += 1
        key = episode.env_id if episode.env_id != "default" else f"episode-{self._added}"
        try:
            episode_id = self._sink.write_now(episode, key, timeout)
            self._reader.wrote(episode_id % self.num_shards)   # read your own writes
            return episode_id
        except BaseException:
            if not known:
                self._forget_unstored_schema()
            raise

    def add_many(self, episodes: list[Episode], schema: Schema | None, timeout: float | None,
                 shard: int | None) -> list[int]:
        """`add` for several episodes (all to ``shard`` unless None), one request per shard."""
        known = self._schema is not None
        self.set_schema(schema)
        self._added += 1
        keys = [e.env_id if e.env_id != "default" else f"episode-{self._added}-{k}" for k, e in enumerate(episodes)]
        try:
            shares = self._shares.known() if self._shares is not None else None
            ids = self._sink.write_many_now(episodes, keys, timeout, shard, shares)
            for written in {i % self.num_shards for i in ids}:
                self._reader.wrote(written)   # read your own writes, as `add`
            return ids
        except BaseException:
            if not known:
                self._forget_unstored_schema()
            raise

    def _forget_unstored_schema(self) -> None:
        """After a refused first write: a schema that no shard stores is dropped, as a
        local store's failed first write sets none."""
        if self._schema_fixed:
            return
        try:
            stored = any(s is not None for s in self.shards.broadcast("schema_json").values())
        except ShardError:
            return
        if not stored:
            self._schema = None
            self._sink.forget_schema()
            self._reader.set_schema(None)

    def sink(self, timeout: float | None, env_ids: Sequence[str] | None) -> RaySink:
        """A writer's sink: asynchronous, batched, delivered within ``RayOptions.delivery_latency``.
        In the process that started the shards, its ``env_ids`` are routed now and the shards'
        capacity shares follow them (`arrowbuf.ray.shares.CapacityShares.open`)."""
        sink = RaySink(self.shards, self._sizes, self.schema, timeout, self.capacity // self.num_shards, self._dropped,
                       balance_keys=True)
        self._writer_sinks.add(sink)
        if self._shares is not None and env_ids is not None:   # not a reshard's sink: routed as it goes
            self._shares.open(sink, list(env_ids))
        return sink

    def import_episodes(self, episodes: Iterable[Episode]) -> int:
        """Store checked episodes of an import (spread over the shards); how many."""
        count = 0
        for count, episode in enumerate(episodes, 1):
            self._sink.write(episode, route_key=f"import-{count}")
            self._sink.commit()
        self._sink.flush()
        self._sizes.refresh()
        return count

    def flush(self) -> None:
        """Wait for this backend's writes, have every shard seal its open episodes, and
        refresh the sizes and this process's manifests (``len`` is exact after it, and
        every episode stored so far is sampled here; priority updates left in flight are answered).
        This process's writers ship their staged steps first, as pieces: ``len`` counts every step
        they wrote, as a local store's does."""
        for sink in list(self._writer_sinks):
            sink.ship_open()
        self._sink.flush()
        self._dropped.wait()
        if self._shares is not None:
            self._shares.settle()
        self._updates.collect(block=True)
        self._sizes.refresh()
        self._reader.sync()

    def close(self) -> None:
        """End the shard actors (their data is gone)."""
        if self.shards.closed:
            return
        if not ray_module().is_initialized():   # ray.shutdown() ended the actors: nothing to release
            self.shards.close()
            return
        try:
            self._sink.close()
            self._dropped.wait()
            self._updates.collect(block=True)   # their errors are raised, the actors ended all the same
        finally:
            self._reader.reset()   # this process's references to the blocks
            ray = ray_module()
            if self.shards.durable:   # their directories' locks go now, not when the processes are gone
                release_durable(self.shards)
            for handle in self.shards.handles:
                ray.kill(handle)
            self.shards.close()

    def evict(self, min_version: int) -> int:
        """Free, on every shard, the oldest episodes whose steps are all older than ``min_version``
        (`arrowbuf.versions.evict_stale`, FIFO per shard); how many. This process's next sample
        reads the shards' new manifests first."""
        count = 0
        for shard, (freed, reading) in self.shards.broadcast("evict", min_version).items():
            self._sizes.note(shard, reading)
            count += freed
            if freed:
                self._reader.wrote(shard)
        return count

    def clear(self) -> None:
        """Empty every shard; new envs are routed by the shards' new sizes (known envs keep their shard)."""
        for shard, reading in self.shards.broadcast("clear").items():
            self._sizes.note(shard, reading)
        self._sink.reset_loads()
        self._reader.reset()

    def pin(self, env_id: str, shard: int) -> None:
        """Send `add` episodes of ``env_id`` to ``shard``, unless the env already has a shard."""
        self._sink.pin(env_id, shard)

    # -- sampling ----------------------------------------------------------------------

    def _check_keys(self, keys: Any) -> Any:
        """``keys`` checked before anything is drawn (nothing to check them against before the first write)."""
        return self._reader.check_keys(keys) if keys is not None and self.schema is not None else keys

    def sample(self, batch_size: int, args: SampleArgs, device: torch.device | None, pin_memory: bool,
               timeout: float | None, num_workers: int | None, worker_nodes: Sequence[str] | None,
               keys: Any = None, min_version: int | None = None) -> TensorDict | list[TensorDict]:
        """Sample across shards, split in proportion to their transitions (or priority mass).

        Uniform, sequence and episode draws happen here, from the shards' sealed
        blocks, handed out of the reader's draws ahead of the same request
        (`arrowbuf.ray.reader.BlockReader.sample`); other samplers (and rate-limited
        stores) ask each shard for its indices. Either way the rows are gathered here, from the blocks, into one
        reused buffer (writable tensors, as a local store's). A batch keeps its
        items' drawn order (a slice is a sample of the whole store); with
        ``num_workers`` each worker's batch is drawn on its own; with ``worker_nodes``, from the shards on its
        node (all shards when its node has none). ``min_version``: steps of ``policy_version`` >= it
        only, drawn here too (`arrowbuf.ray.fresh`).

        Raises:
            ResourceError: the batch cannot be allocated here (before any shard draws).
            ValueError: ``keys`` names no field (nothing is drawn).
        """
        self.shards.check_open()   # a closed store says so, before any shard (dead or not) is asked
        if self.schema is not None:   # this process gathers the whole batch: it must fit here
            check_batch(self.schema, self.sampler, None, batch_size, args.frame_stack)
        keys = self._check_keys(keys)
        if keys is not None and not isinstance(keys, frozenset):   # no schema yet: EmptyStoreError
            keys = self._reader.check_keys(keys)
        if min_version is not None:
            check_fresh_sampler(self.sampler, self._reader.draws_here())
        self._updates.collect(block=False)   # an update left in flight that failed is raised here
        if num_workers is None:
            return self._draw(batch_size, args, timeout, keys, device, pin_memory, None, min_version)
        per_worker = batch_size // num_workers
        nodes = worker_nodes if worker_nodes is not None else [None] * num_workers
        return [self._draw(per_worker, args, timeout, keys, device, pin_memory,
                           None if node is None else [s for s, n in enumerate(self.shards.nodes) if n == node],
                           min_version)
                for node in nodes]

    def _draw(self, batch_size: int, args: SampleArgs, timeout: float | None, keys: Any, device: Any,
              pin_memory: bool, shards: Sequence[int] | None = None, min_version: int | None = None) -> TensorDict:
        on_cpu = device is None or device.type == "cpu"
        request = SampleRequest(batch_size, args, keys, device, None if shards is None else tuple(shards),
                                min_version=min_version, timeout=None if self._reader.draws_here() else timeout)
        batch = self._reader.sample(request)   # out of the draws ahead of this request (none where shards draw)
        # Gathered into a reused buffer; pinned memory is asked for by copying it there.
        return batch.pin_memory() if on_cpu and pinned(pin_memory, device) else batch

    def sample_iter(self, batch_size: int, args: SampleArgs, device: torch.device | None, prefetch: int,
                    batches_per_request: int | None, min_version: int | None = None,
                    keys: Any = None) -> Iterator[TensorDict]:
        """Endless batches. Draws made here need no round trip: ``batches_per_request``
        batches (default: as many as `READ_BYTES` hold, at most `MAX_READ_BATCHES`) are drawn
        and ordered at once; draws made by the shards keep ``prefetch`` index requests
        in flight. ``min_version``: as in `sample` (drawn here)."""
        if min_version is not None:
            check_fresh_sampler(self.sampler, self._reader.draws_here())
        return self._reader.batches(SampleRequest(batch_size, args, self._check_keys(keys), device, None,
                                                  batches_per_request, min_version, prefetch))

    def iter_batches(self, batch_size: int, shuffle: bool, drop_last: bool, device: torch.device | None,
                     keys: Any = None, min_version: int | None = None, split: Any = None) -> Iterator[TensorDict]:
        """Every live transition of every shard once (of ``policy_version >= min_version`` only,
        when given), the shards' indices shuffled together, gathered here from the blocks of
        every shard's manifest at the epoch's start (the shards seal their open episodes first).

        ``split``: this rank's share of each global batch only (`arrowbuf.ray.ranks`).

        Raises:
            EmptyStoreError: no transition of ``min_version`` (naming the newest version held).
        """
        keys = self._check_keys(keys)
        if isinstance(self.sampler, GroupSampler) and min_version is None:   # one shard (`new_backend`)
            return self._group_epoch(batch_size, shuffle, drop_last, keys, device)
        self._reader.sync()
        views = dict(self._reader.views)   # this epoch's snapshot: its blocks stay readable
        if min_version is None:
            parts = [np.arange(*view.table.live_range(), dtype=np.int64) for _, view in sorted(views.items())]
        else:
            parts = [fresh_indices(view, min_version, self._reader.cache) for _, view in sorted(views.items())]
            if not sum(len(p) for p in parts):
                raise no_fresh(min_version, fresh_newest(list(views.values())))
        index = np.concatenate([part + (shard << INDEX_SHIFT) for shard, part in zip(sorted(views), parts)]
                               or [np.zeros(0, np.int64)])
        return self._epoch(epoch_batches(self._rng, index, batch_size, shuffle, drop_last), views, keys, device, split)

    def _group_epoch(self, batch_size: int, shuffle: bool, drop_last: bool, keys: Any, device: Any
                     ) -> Iterator[TensorDict]:
        """A `GroupSampler`'s epoch, ordered by the shard's sampler as a local store's (complete groups,
        each whole, ``batch_size`` a multiple of the group size: ValueError raised here), gathered here."""
        epochs = self.shards.broadcast("epoch", batch_size, shuffle, drop_last)
        self._reader.sync()   # after the shard sealed the rows its epoch names
        chunks = [chunk + (shard << INDEX_SHIFT) for shard, each in epochs.items() for chunk in each]
        return self._epoch(chunks, dict(self._reader.views), keys, device)

    def _epoch(self, chunks: list[np.ndarray], views: dict, keys: Any, device: Any,
               split: Any = None) -> Iterator[TensorDict]:
        """Each chunk of the store's indices gathered from ``views`` as one batch: rows they no longer
        hold (evicted between a shard's drawing of a `GroupSampler` epoch and the sync after it)
        skipped and the rest kept, as a local store's epoch skips rows evicted meanwhile; no empty
        batch. ``split``: this rank's share of each (`arrowbuf.ray.ranks`)."""
        for chunk in chunks:
            chunk = chunk[held_in(views, chunk)]
            if split is not None and len(chunk):
                chunk = rank_indices(chunk, views, self._reader.cache, split)
            if not len(chunk):   # every row gone, or to other ranks (as a local store, no empty batch)
                continue
            shards = chunk >> INDEX_SHIFT
            located = [(self._reader.select_in(views[s], chunk[shards == s] & LOCAL_MASK, {}),
                        np.flatnonzero(shards == s)) for s in np.unique(shards).tolist()]
            yield self._reader.gather([part for part, _ in located], PLAIN, keys, device,
                                      places=[where for _, where in located])

    def _gather_parts(self, index: np.ndarray) -> list[tuple[Payload, np.ndarray]]:
        """The live transitions of ``index``: (payload, positions in ``index``) of each shard that has some."""
        shards = index >> INDEX_SHIFT
        refs = {int(s): self.shards.call(int(s), "gather", index[shards == s] & LOCAL_MASK)
                for s in np.unique(shards) if 0 <= s < self.num_shards}
        return [(p, np.flatnonzero(shards == s)) for s, p in self.shards.get(refs).items() if p is not None]

    # -- reads by index --------------------------------------------------------------

    def gather(self, index: np.ndarray, device: torch.device | None) -> TensorDict:
        """The live transitions of ``index``, in that order (writable tensors).

        Raises:
            KeyError: some indices are not live (evicted, cleared, never written, or
                of a shard that does not exist).
        """
        parts = self._gather_parts(index)
        found = sum(p.batch_shape[0] for p, _ in parts)
        if found != len(index):
            raise KeyError(f"{len(index) - found} of the {len(index)} indices are not live "
                           "(evicted, cleared, or never written)")
        if not parts:   # nothing asked for: every field, empty, as the local store's gather
            return empty_batch(self.schema, device)
        # Into one new buffer (the parts are views of Ray's read-only shared memory: the caller may
        # write in place), ragged and text rows with them, in the order of ``index``.
        return merge_payloads([p for p, _ in parts], [where for _, where in parts]).to_tensordict(device)

    def gather_refs(self, indices: list[np.ndarray], extras: list[dict], flat_next: bool) -> list:
        """One ObjectRef per index array, of its transitions as a TensorDict; the data never
        comes to this process (`arrowbuf.ray.shipping.gather_refs`).

        Raises:
            ValueError: a 2-D index array of a store with ragged or text fields (one row per item only).
        """
        schema = self.schema
        apart = [n for n, f in schema.fields.items() if f.ragged or f.text] if schema is not None else []
        if apart and any(np.ndim(index) != 1 for index in indices):
            raise ValueError(f"gather_refs: ragged and text fields {apart} are gathered one row per item; give 1-D "
                             "index arrays (a [n, L] batch of sequences has no place for them)")
        return gather_refs(self.shards, indices, extras, flat_next)

    def live_ranges(self) -> list[tuple[int, int]]:
        """[first, stop) of each shard's live indices (``shard << 48 | local index``); empty for a dead shard."""
        ranges = self.shards.broadcast("live_range")
        return [((s << INDEX_SHIFT) + ranges[s][0], (s << INDEX_SHIFT) + ranges[s][1]) if s in ranges
                else (s << INDEX_SHIFT, s << INDEX_SHIFT) for s in range(self.num_shards)]

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first index, transitions) of every live episode, shard by shard, oldest first."""
        spans = self.shards.broadcast("episode_spans")
        shard = [np.full(len(spans[s][0]), s, np.int64) for s in sorted(spans)]
        first = [(np.int64(s) << INDEX_SHIFT) + spans[s][0].astype(np.int64) for s in sorted(spans)]
        length = [spans[s][1].astype(np.int64) for s in sorted(spans)]
        empty = [np.zeros(0, np.int64)]
        return np.concatenate(shard or empty), np.concatenate(first or empty), np.concatenate(length or empty)

    def update_priorities(self, index: np.ndarray, priority: np.ndarray, wait: bool = True) -> int | None:
        """New priorities for ``index``: how many were live, or None when left in flight
        (``wait=False``; `arrowbuf.ray.priorities`)."""
        return self._updates.send(index, priority, wait)

    def compute_gae(self, gamma: float, lam: float, value_key: str, bootstrap_value: Any) -> int:
        """GAE on every shard, ``bootstrap_value`` called in this process (`arrowbuf.ray.gae`)."""
        written, schema = compute_gae(self.shards, gamma, lam, value_key, bootstrap_value, self.schema)
        if schema is not None:
            self._schema = schema   # now with the derived fields
            self._reader.set_schema(schema)
        self._reader.sync(seal=False)   # the shards sealed their blocks again, with the new columns
        return written

    # -- views ----------------------------------------------------------------------

    def episodes(self, include_open: bool = False) -> pa.Table:
        # Open episodes' shipped pieces are stored as pieces, marked open by their shard (`arrowbuf.ray.tails`).
        tables = [store_indices(table, shard)
                  for shard, table in self.shards.broadcast("episodes", include_open).items()]
        return joined_episodes(tables) if tables else EpisodeTable().to_arrow()

    def episode(self, episode_id: int) -> pa.RecordBatch:
        shard = episode_id % self.num_shards
        return self.shards.get({shard: self.shards.call(shard, "episode", episode_id)})[shard]

    def to_arrow(self) -> pa.Table:
        tables = [t for t in self.shards.broadcast("to_arrow").values() if t.num_columns]
        return pa.concat_tables(tables) if tables else pa.table({})

    def stats(self) -> dict:
        self._reader.report()   # draws made here count as the shards' samples
        per_shard = list(self.shards.broadcast("stats").values())
        totals = {k: sum(s[k] for s in per_shard) for k in ("transitions", "episodes", "inserts", "samples")}
        return {**totals, "capacity": sum(s["capacity"] for s in per_shard), "num_shards": self.num_shards,
                "dead_shards": sorted(self.shards.dead), "shards": per_shard, "reader": self._reader.stats()}

    # -- persistence (every shard writes its own files, in parallel) ----------------------

    def export_steps(self, steps_dir: Path, schema: pa.Schema, **options: Any) -> tuple[pa.Table, list]:
        options = {k: v for k, v in options.items() if k in ("compression", "rows_per_file")}
        results = self.shards.broadcast("export_steps", str(steps_dir), schema, options)
        # Shard by shard, in the order of the files: an import reads them in that order.
        tables = [results[s][0] for s in sorted(results) if results[s][0].num_rows]
        entries = [entry for s in sorted(results) for entry in results[s][1]]
        return (joined_episodes(tables) if tables else EpisodeTable().to_arrow()), entries

    def save(self, path: str | Path, info: Mapping[str, Any], writer_states: Callable[[], dict],
             progress: bool | None) -> Path:
        """Every shard saves its own generation directory (`save_ray_store`), with its open
        pieces; this process's writers ship their staged steps first (`RaySink.ship_open`),
        and shard 0's checkpoint keeps their states (``writer_states()``): where their open
        episodes go on."""
        self.flush()   # this process's writers ship their staged steps first
        return save_ray_store(self.shards, Path(path), dict(info), writer_states())

    def to_ray_dataset(self) -> Any:
        return to_ray_dataset(self.shards)


def store_indices(table: pa.Table, shard: int) -> pa.Table:
    """A shard's episode table with its ``first_index`` in the store's indices (``shard << 48 | local``:
    what `gather`, `episode_spans` and a batch's ``"index"`` use), as a local store's table gives them."""
    if not shard or "first_index" not in table.column_names:
        return table
    at = table.column_names.index("first_index")
    return table.set_column(at, "first_index", pc.add(table.column("first_index"),
                                                      pa.scalar(shard << INDEX_SHIFT, pa.int64())))


def joined_episodes(tables: list[pa.Table]) -> pa.Table:
    """The shards' episode tables as one: a shard that holds pieces lists ``first_step``
    (`arrowbuf.played.episodes_arrow`), one that holds none does not; its episodes start at step 0."""
    joined = pa.concat_tables(tables, promote_options="permissive")
    if "first_step" in joined.column_names and joined.column("first_step").null_count:
        at = joined.column_names.index("first_step")
        joined = joined.set_column(at, "first_step", pc.fill_null(joined.column("first_step"), 0))
    return joined
