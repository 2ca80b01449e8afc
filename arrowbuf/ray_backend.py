"""The Ray backend: shard actors running the embedded store, and the router in front.

Each shard actor holds one embedded `ExperienceStore` (the same shard, sampler and
gather code as the local backend); this module only routes. Data crosses
processes through Ray's object store as numpy buffers: sealed episodes on the way
in, gathered `Payload` buffers on the way out. The receiver reads them without a
copy (they are read-only shared memory), so:

- tensors of a batch that came from a single shard are views of read-only shared
  memory: read them, move them (``.to(device)``), but do not write them in place
  (``clone()`` first); a batch drawn from several shards is concatenated once and
  is writable;
- writes are asynchronous with at most ``max_in_flight`` requests per shard; an
  error inside a shard surfaces at the next call of the writer that sent it, and
  at its `flush`.

Ray is imported only when this module is used (``backend="ray"``).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict

from arrowbuf._bounds import check_batch
from arrowbuf.episodes import StepWriter, _copied, read_episode
from arrowbuf.errors import ArrowbufError, EmptyStoreError, ShardError
from arrowbuf.rate_limiters import RateLimiter
from arrowbuf.samplers import (EpisodeSampler, PrioritizedSampler, WithoutReplacementSampler, epoch_batches,
                               select_ranks)
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode
from arrowbuf.table import EpisodeTable
from arrowbuf._checks import check_episode_id as _check_episode_id
from arrowbuf._checks import check_int as _check_int
from arrowbuf._checks import check_workers as _check_workers
from arrowbuf._checks import check_bool, check_device, check_env_id, check_metadata, check_timeout, tensor_to_numpy
from arrowbuf.durable import DurableShard, durable_directory
from arrowbuf.engine import ShardEngine
from arrowbuf.store import ExperienceStore
from arrowbuf.tensors import Payload, make_tensordict

logger = logging.getLogger(__name__)

NAMESPACE = "arrowbuf"
INDEX_SHIFT = 48                     # index = shard << 48 | rank
RANK_MASK = (1 << INDEX_SHIFT) - 1


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("backend='ray' needs Ray: pip install 'arrowbuf[ray]'") from None
    return ray


@dataclass
class RayOptions:
    """How shard actors are started.

    Attributes:
        num_cpus: CPUs each shard actor reserves (default 0: shards are mostly idle
            between requests and must not starve the env runners of CPUs).
        max_in_flight: unanswered writes per shard and writer before a write waits.
        nodes: node ids to place shards on (round robin, hard affinity); None lets
            Ray spread them.
        node_affinity: writers send an env's episodes to a shard on their own node
            when there is one.
        allow_partial: `len` and `sample` skip dead shards instead of raising
            (every call raises `ShardError` otherwise, until `close`). A request that
            a shard dies answering is drawn again from the survivors; a write it
            took raises `ShardError` at the writer's next call or `flush`.
        write_batch_bytes: episodes smaller than this are copied and sent together
            once this many bytes are waiting (or at `flush`): each Ray call has a
            fixed cost of about a millisecond, so small episodes travel in batches.
        start_timeout: seconds to wait for the shard actors to start (they wait for
            ``num_cpus`` free CPUs) before `ShardError`.
        max_restarts: times Ray restarts a shard actor that died (-1: always); None
            is -1 for a durable store (it recovers its episodes) and 0 otherwise (a
            restarted shard would come back empty). Calls in flight are retried.
        durable_sync: a durable shard flushes its log to disk (``fdatasync``) before it
            answers a write; False leaves the flush to the OS: writes survive a dead
            actor (the kernel holds them) but not a crash of the node, and cost no disk
            wait (the log is disk-bound: ~70-150 MB/s on this machine).
    """

    num_cpus: float = 0.0
    max_in_flight: int = 8
    nodes: Sequence[str] | None = None
    node_affinity: bool = True
    allow_partial: bool = False
    write_batch_bytes: int = 4 << 20
    start_timeout: float = 120.0   # seconds for the shard actors to start (e.g. waiting for CPUs)
    max_restarts: int | None = None   # durable shards
    durable_sync: bool = True         # durable shards

    def __post_init__(self) -> None:
        for name in ("num_cpus", "start_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or (name == "start_timeout" and value == 0):
                raise ValueError(f"RayOptions.{name} must be a number {'> 0' if name == 'start_timeout' else '>= 0'}, "
                                 f"got {value!r}")
        _check_int("RayOptions.max_in_flight", self.max_in_flight, 1)
        _check_int("RayOptions.write_batch_bytes", self.write_batch_bytes, 0)
        if self.max_restarts is not None:   # durable shards
            _check_int("RayOptions.max_restarts", self.max_restarts, -1)
        check_bool("RayOptions.durable_sync", self.durable_sync)   # durable shards
        if self.nodes is not None and (isinstance(self.nodes, str) or not all(isinstance(n, str) for n in self.nodes)):
            raise ValueError(f"RayOptions.nodes must be a list of node ids or None, got {self.nodes!r}")


class ShardServer:
    """The body of a shard actor: one `ShardEngine` holding this shard's episodes."""

    def __init__(self, capacity: int, shard: int, num_shards: int, seed: int, sampler: Any,
                 schema_json: str | None, mode: str, load_from: str | None = None,
                 track_reuse: bool = False, durable: str | None = None, durable_sync: bool = True) -> None:
        def make_engine() -> ShardEngine:
            if load_from is not None:
                from arrowbuf.checkpoint import load_engine

                return load_engine(load_from, progress=False, shard=shard, num_shards=num_shards).engine
            return ShardEngine(capacity, sampler=sampler, rate_limiter=RateLimiter(), mode=mode, seed=seed,
                               track_reuse=track_reuse, shard=shard, num_shards=num_shards)

        # durable shards: the last checkpoint of the durable directory and the log replayed
        self.durable = DurableShard(durable, shard, num_shards, durable_sync) if durable is not None else None
        self.engine = self.durable.recover(make_engine) if self.durable is not None else make_engine()
        sampler = self.engine.sampler
        self._sampler_spec = type(sampler)(**sampler.config())   # unbound, for `attach`
        self.shard = shard
        self.num_shards = num_shards
        self.index_base = shard << INDEX_SHIFT
        if schema_json is not None:
            self.engine.set_schema(Schema.from_json(schema_json))

    def ping(self) -> str:
        """This actor's node id (also proves it started)."""
        return _ray().get_runtime_context().get_node_id()

    def config(self) -> dict:
        return {"shard": self.shard, "num_shards": self.num_shards, "capacity": self.engine.capacity,
                "mode": self.engine.mode, "sampler": self._sampler_spec}

    def schema_json(self) -> str | None:
        schema = self.engine.schema
        return schema.to_json() if schema is not None else None

    def add_episodes(self, episodes: list[Episode], schema_json: str,
                     batch: tuple[str, int] | None = None) -> tuple[float, int, int]:
        """Store a writer's episodes; ``batch`` = (writer id, batch number) makes a retry a no-op."""
        if self.durable is not None and self.durable.seen(batch):   # durable: a retried write, logged already
            return self.size()
        schema = Schema.from_json(schema_json)
        if self.engine.schema is not None and self.engine.schema != schema:
            raise _schema_mismatch(self.shard, self.engine.schema, schema)
        refused, added = [], []
        for episode in episodes:   # one refused episode must not take the rest of the batch with it
            try:
                added.append((self.engine.add(episode, schema), episode))
            except (ArrowbufError, ValueError) as err:
                refused.append(err)
        if self.durable is not None:   # durable: logged and flushed before the answer
            self.durable.commit(self.engine, added, batch)
        if refused:
            err = refused[0]
            err.args = (f"{err.args[0] if err.args else err} [shard {self.shard} refused {len(refused)} of the "
                        f"{len(episodes)} episodes of this write (they are dropped); it stored the others]",
                        *err.args[1:])
            raise err
        return self.size()

    def size(self) -> tuple[float, int, int]:
        """(sampling mass, transitions, episodes)."""
        return self.engine.size()

    def sample(self, n: int, n_step: int, gamma: float, frame_stack: int,
               population: tuple[int, float] | None) -> tuple[Payload, tuple[float, int, int]]:
        payload = self.engine.sample_payload(n, (n_step, gamma, frame_stack), self.index_base, population)
        return payload, self.size()

    def live_range(self) -> tuple[int, int]:
        return self.engine.live_range()

    def gather(self, ranks: np.ndarray) -> Payload | None:
        """The live ones of ``ranks`` (an epoch's share of this shard)."""
        return self.engine.gather_payload(ranks, self.index_base)

    def update_priorities(self, ranks: np.ndarray, priorities: np.ndarray) -> int:
        return self.engine.update_priorities(ranks, priorities)

    def episodes(self) -> pa.Table:
        return self.engine.episodes()

    def episode(self, episode_id: int) -> pa.RecordBatch:
        return self.engine.episode(episode_id)

    def to_arrow(self) -> pa.Table:
        return self.engine.to_arrow()

    def clear(self) -> tuple[float, int, int]:
        self.engine.clear()
        if self.durable is not None:   # durable: a restart must not bring the episodes back
            self.durable.cleared(self.engine)
        return self.size()

    def stats(self) -> dict:
        return {**self.engine.stats(), "shard": self.shard, "node_id": self.ping()}

    def export_steps(self, steps_dir: str, schema: pa.Schema, options: dict) -> tuple[pa.Table, list]:
        """Write this shard's rows as Parquet parts into ``steps_dir`` (a shared directory)."""
        if self.engine.shard is None:
            return self.engine.episodes(), []
        from arrowbuf.parquet import export_shard

        return export_shard(self.engine.shard, self.engine.lock, Path(steps_dir), schema,
                            shard_index=self.shard, progress=False, **options)

    def save(self, path: str, base: str | None = None) -> str:
        """Checkpoint this shard into ``path``, incrementally from its save in ``base``."""
        from arrowbuf.checkpoint import save_engine

        engine = self.engine
        info = {"capacity": engine.capacity, "mode": engine.mode, "seed": engine.seed,
                "track_reuse": engine.track_reuse, "created_at": 0.0}
        save_engine(engine, path, info, progress=False, base=base)
        if self.durable is not None:   # durable: its own checkpoint, then the log is compacted
            self.durable.checkpoint(engine, info)
        return path

    def plain_rows(self) -> pa.Table:
        from arrowbuf.ray_persist import plain_rows

        return plain_rows(self.engine)


def _interleave(parts: list[dict], kept: np.ndarray, starts: np.ndarray, total: int) -> dict:
    """One tensor per key holding every batch's rows: batch j gets ``kept[j, k]`` rows of part k
    (parts in order), its rows starting at ``starts[j]``; part k's rows come batch by batch."""
    within = np.cumsum(kept, axis=1) - kept        # where part k's rows start inside batch j
    combined = {key: torch.empty((total, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
                for key, tensor in parts[0].items()}
    for k, part in enumerate(parts):
        counts = kept[:, k]
        first_of_batch = np.cumsum(counts) - counts
        dest = np.repeat(starts + within[:, k] - first_of_batch, counts) + np.arange(int(counts.sum()))
        on_cpu = next(iter(part.values())).device.type == "cpu"
        dest_tensor = None if on_cpu else torch.from_numpy(dest).to(next(iter(part.values())).device)
        for key, tensor in part.items():
            if on_cpu:   # numpy's row scatter: 6x torch's index_copy_ for image rows
                tensor_to_numpy(combined[key])[dest] = tensor_to_numpy(tensor)
            else:
                combined[key].index_copy_(0, dest_tensor, tensor)
    return combined


def _schema_mismatch(shard: int, have: Schema, got: Schema):
    from arrowbuf.errors import SchemaError

    return SchemaError(f"shard {shard} stores {have}, but the writer sent episodes of {got}")


@dataclass
class _Shards:
    """Handles of a store's shard actors and what the router knows of them (picklable)."""

    name: str
    handles: list
    nodes: list[str]
    options: RayOptions
    dead: set[int] = field(default_factory=set)
    closed: bool = False

    def call(self, shard: int, method: str, *args: Any):
        self._check_open()
        if shard in self.dead and not self.options.allow_partial:
            raise self._dead_error()
        return getattr(self.handles[shard], method).remote(*args)

    def get(self, refs: Mapping[int, Any]) -> dict[int, Any]:
        """Results of ``{shard: ref}``; a dead shard raises `ShardError` (or is skipped if allowed)."""
        ray = _ray()
        results = {}
        for shard, ref in refs.items():
            try:
                results[shard] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self.dead.add(shard)
                if not self.options.allow_partial:
                    raise ShardError(f"shard {shard} of store {self.name!r} is dead: {err}") from None
        return results

    def live(self) -> list[int]:
        """Shards to use: all of them, or the survivors with ``allow_partial``
        (else a dead one raises `ShardError` at every call, not only the first)."""
        self._check_open()
        if self.dead and not self.options.allow_partial:
            raise self._dead_error()
        return [s for s in range(len(self.handles)) if s not in self.dead]

    def _check_open(self) -> None:
        if self.closed:
            raise ShardError(f"store {self.name!r} is closed (its shard actors are gone)")

    def _dead_error(self) -> ShardError:
        dead = sorted(self.dead)
        return ShardError(f"shard{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} of store {self.name!r} "
                          f"{'are' if len(dead) > 1 else 'is'} dead; RayOptions(allow_partial=True) serves from the "
                          "others")

    def broadcast(self, method: str, *args: Any) -> dict[int, Any]:
        return self.get({s: self.call(s, method, *args) for s in self.live()})


class _RaySink:
    """A writer's route to the shards: env -> shard, batched asynchronous writes.

    Episodes sealed during one writer call are sent together, one request per
    shard. At most ``max_in_flight`` requests per shard are unanswered; finished
    requests are checked at every call, so a shard's error surfaces in the
    writer's process at its next call (and at `flush`).
    """

    def __init__(self, shards: _Shards, loads: Sequence[float], schema: Schema | None,
                 capacity: int | None = None) -> None:
        self.capacity = capacity   # rows of the smallest shard: the longest episode any shard takes
        self._shards = shards
        self._loads = np.asarray(loads, np.float64)
        self._schema = schema
        self._routes: dict[str, int] = {}
        self._batches: dict[int, list[Episode]] = {}
        self._waiting_bytes = 0
        self._in_flight: dict[int, deque] = {}
        self._node: str | None = None
        self._writer, self._batch_number = uuid.uuid4().hex, 0   # durable shards: retried writes are recognised

    def __getstate__(self) -> dict:
        # A copy in another process starts with nothing in flight: errors of this
        # process's requests surface here, not there.
        return {**self.__dict__, "_batches": {}, "_waiting_bytes": 0, "_in_flight": {}, "_node": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._loads = self._loads.copy()   # read-only when it came through the object store
        self._writer, self._batch_number = uuid.uuid4().hex, 0   # durable shards: each copy is a writer of its own

    @property
    def schema(self) -> Schema | None:
        return self._schema

    def set_schema(self, schema: Schema) -> None:
        if self._schema is None:
            self._schema = schema

    def route(self, env_id: str) -> int:
        shard = self._routes.get(env_id)
        if shard is None or shard in self._shards.dead:   # a dead shard's envs move (allow_partial)
            candidates = self._shards.live()
            if not candidates:
                raise ShardError(f"every shard of store {self._shards.name!r} is dead")
            if self._shards.options.node_affinity:
                if self._node is None:
                    self._node = _ray().get_runtime_context().get_node_id()
                local = [s for s in candidates if self._shards.nodes[s] == self._node]
                candidates = local or candidates
            shard = min(candidates, key=lambda s: (self._loads[s], s))
            self._routes[env_id] = shard
        return shard

    def write(self, episode: Episode, route_key: str | None = None) -> None:
        """Queue an episode for the shard of ``route_key`` (default: its env_id)."""
        shard = self.route(episode.env_id if route_key is None else route_key)
        size = sum(column.nbytes for column in episode.columns.values())
        if size < self._shards.options.write_batch_bytes:
            # Columns may be views of a writer's staging rows, reused by the env's
            # next episode: an episode that waits for its batch owns its data.
            episode = _copied(episode)
            self._waiting_bytes += size
        self._batches.setdefault(shard, []).append(episode)
        self._loads[shard] += episode.num_rows

    def commit(self, force: bool = False) -> None:
        """Send what is ready (big episodes, or enough small ones); check answers that came back."""
        self._reap(block=False)
        if not force and self._waiting_bytes < self._shards.options.write_batch_bytes:
            ready = {s: [e for e in eps if not e.owned] for s, eps in self._batches.items()}
            self._batches = {s: [e for e in eps if e.owned] for s, eps in self._batches.items()}
        else:
            ready, self._batches, self._waiting_bytes = self._batches, {}, 0
        schema_json = self._schema.to_json() if self._schema is not None else None
        unsent = {shard: episodes for shard, episodes in ready.items() if episodes}
        try:
            for shard, episodes in list(unsent.items()):
                queue = self._in_flight.setdefault(shard, deque())
                while len(queue) >= self._shards.options.max_in_flight:
                    self._settle(shard, queue.popleft())   # raises an earlier write's error
                self._batch_number += 1   # durable shards: (writer, number) names this write in the log
                queue.append(self._shards.call(shard, "add_episodes", episodes, schema_json,
                                               (self._writer, self._batch_number)))
                del unsent[shard]
        finally:
            for shard, episodes in unsent.items():   # an error stopped the loop: keep them for the next call
                self._batches[shard] = [_copied(e) if not e.owned else e for e in episodes] \
                    + self._batches.get(shard, [])
                self._waiting_bytes += sum(c.nbytes for e in episodes for c in e.columns.values())

    def flush(self) -> None:
        self.commit(force=True)
        self._reap(block=True)

    def _reap(self, block: bool) -> None:
        ray = _ray()
        for shard, queue in self._in_flight.items():
            while queue:
                if not block and not ray.wait([queue[0]], timeout=0)[0]:
                    break
                self._settle(shard, queue.popleft())

    def _settle(self, shard: int, ref: Any) -> None:
        result = self._shards.get({shard: ref})
        if shard not in result:   # dead, and allow_partial: the write is lost, and that is an error
            raise ShardError(f"shard {shard} of store {self._shards.name!r} died before storing a write of this "
                             "writer; its episodes are lost (later episodes of its envs go to the other shards)")
        self._loads[shard] = max(self._loads[shard], result[shard][1])

    def __del__(self) -> None:
        try:
            unsent = sum(len(episodes) for episodes in self._batches.values())
            unconfirmed = sum(len(queue) for queue in self._in_flight.values())
        except AttributeError:   # a partly built sink
            return
        if unsent or unconfirmed:
            logger.warning("an arrowbuf writer of store %r went away with %d unsent episodes and %d unconfirmed "
                           "writes: call flush() before a writer (or the task holding it) ends",
                           self._shards.name, unsent, unconfirmed)


class RayExperienceStore(ExperienceStore):
    """An `ExperienceStore` whose episodes live in ``num_shards`` Ray actors.

    Created by ``ExperienceStore(capacity, backend="ray", num_shards=K)``; the same
    API as the local store, plus `flush`, `close`, `sample_iter`, and `attach`.
    ``capacity`` is the total over all shards (each shard holds capacity // K
    rows, the first ones one more for the remainder). `add_episode` is
    asynchronous and returns None; `flush` waits for the writes and raises their
    errors. An episode a shard refuses (schema, capacity) is dropped and its error
    raised, naming how many of that write's episodes were refused; the others are
    stored. A writer that goes away without `flush` logs a warning if it still
    held episodes. A Ray cluster is started (``ray.init()``) if none is running.

    Args:
        capacity, seed, sampler, schema, mode: as for the local store; each shard
            gets its own copy of the sampler and a seed derived from ``seed``.
        num_shards: shard actors to start (>= 1).
        name: the store's name, for `attach` from another process (default: random).
        ray_options: `RayOptions` (CPUs per actor, placement, in-flight writes, ...).
        durable: True or a directory: each shard logs every episode it stores to
            ``<dir>/shard-<k>`` (default dir ``~/.cache/arrowbuf/<name>``) and flushes
            it to disk before answering the write; Ray restarts a dead shard, which
            recovers from its last checkpoint there plus the log (`arrowbuf.durable`).
            The directory must be local to the shard's node or shared.

    Raises:
        ValueError: a bad argument; a rate limiter (not supported across shards yet).

    Example:
        >>> import arrowbuf as ab  # doctest: +SKIP
        >>> store = ab.ExperienceStore(1_000_000, backend="ray", num_shards=4)  # doctest: +SKIP
        >>> w = store.writer(num_envs=8)   # pickles into Ray tasks and actors  # doctest: +SKIP
    """

    def __init__(self, capacity: int, *, seed: int | None = None, sampler: Any = None,
                 schema: Schema | Mapping[str, Any] | None = None, mode: str = "circular",
                 backend: str = "ray", rate_limiter: RateLimiter | None = None, num_shards: int = 2,
                 name: str | None = None, ray_options: RayOptions | None = None, track_reuse: bool = False,
                 durable: bool | str | os.PathLike = False,
                 _shards: _Shards | None = None, _load_from: Sequence[str] | None = None) -> None:
        num_shards = _check_int("num_shards", num_shards, 1)
        capacity = _check_int("capacity", capacity, num_shards)
        if rate_limiter is not None:
            raise ValueError("rate limiters are not supported with backend='ray' yet (they would apply per shard)")
        self.capacity = capacity
        self._configure(seed, sampler, mode, "ray", RateLimiter(), track_reuse)
        self._backend = self
        self._rng = np.random.default_rng(self.seed)
        if isinstance(self.sampler, EpisodeSampler) and num_shards > 1:
            raise ValueError("EpisodeSampler returns episodes padded to the longest one, which shards "
                             "cannot agree on; use num_shards=1 or a SequenceSampler")
        if isinstance(self.sampler, WithoutReplacementSampler) and num_shards > 1:
            raise ValueError("WithoutReplacementSampler keeps one epoch per shard, and shards end their epochs at "
                             "different times; use num_shards=1, or iter_batches() for epochs across shards")
        if schema is not None and not isinstance(schema, Schema):
            schema = Schema(schema)
        self.backend = "ray"
        self.num_shards = num_shards
        self.name = name or f"store-{uuid.uuid4().hex[:8]}"
        self.ray_options = _shards.options if _shards is not None else (ray_options or RayOptions())
        self.durable = durable_directory(durable, self.name)   # durable shards: None, or their parent directory
        self._schema = schema
        self._schema_fixed = schema is not None   # given (or found by attach), not inferred from a write
        self._shards = _shards or self._start(schema, _load_from)
        self._masses = np.zeros(num_shards)
        self._sizes = np.zeros(num_shards, np.int64)
        self._episode_counts = np.zeros(num_shards, np.int64)
        self._sink = _RaySink(self._shards, np.zeros(num_shards), schema)
        self._added = 0   # episodes sent by add_episode: routing keys for episodes without env_id
        self._refresh_sizes()

    def _start(self, schema: Schema | None, load_from: Sequence[str] | None = None) -> _Shards:
        ray = _ray()
        if not ray.is_initialized():
            logger.info("no Ray cluster is running: starting a local one (ray.init())")
            ray.init(logging_level=logging.WARNING)
        options = self.ray_options
        actor = ray.remote(ShardServer)
        restarts = options.max_restarts if options.max_restarts is not None else -1 if self.durable else 0  # durable
        seeds = np.random.SeedSequence(self.seed).generate_state(self.num_shards).tolist()
        handles = []
        for shard in range(self.num_shards):
            placement = {}
            if options.nodes:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                node = options.nodes[shard % len(options.nodes)]
                placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
            capacity = self.capacity // self.num_shards + (shard < self.capacity % self.num_shards)
            handles.append(actor.options(name=f"{self.name}:{shard}", namespace=NAMESPACE,
                                         num_cpus=options.num_cpus, max_restarts=restarts,   # durable
                                         max_task_retries=-1 if restarts else 0, **placement).remote(
                capacity, shard, self.num_shards, seeds[shard], copy.deepcopy(self.sampler),
                schema.to_json() if schema is not None else None, self.mode,
                load_from[shard] if load_from is not None else None, self.track_reuse,
                str(self.durable / f"shard-{shard}") if self.durable else None, options.durable_sync))   # durable
        limit = None if math.isinf(options.start_timeout) else options.start_timeout
        try:
            nodes = ray.get([h.ping.remote() for h in handles], timeout=limit)
        except BaseException as err:   # no half-started store: its named actors would block the name
            for handle in handles:
                ray.kill(handle)
            if isinstance(err, ray.exceptions.GetTimeoutError):
                raise ShardError(f"the {self.num_shards} shard actors of store {self.name!r} did not start within "
                                 f"{options.start_timeout} s; does the cluster have RayOptions.num_cpus="
                                 f"{options.num_cpus} free CPUs for each?") from None
            raise
        return _Shards(self.name, handles, nodes, options)

    @classmethod
    def attach(cls, name: str, seed: int | None = None,
               ray_options: RayOptions | None = None) -> "RayExperienceStore":
        """Connect to a running Ray store by name (from any process of the cluster).

        Raises:
            ValueError: no store of that name is running.
        """
        ray = _ray()
        try:
            first = ray.get_actor(f"{name}:0", namespace=NAMESPACE)
        except ValueError:
            raise ValueError(f"no arrowbuf store named {name!r} is running in namespace {NAMESPACE!r}") from None
        config = ray.get(first.config.remote())
        handles = [first]
        for shard in range(1, config["num_shards"]):
            try:
                handles.append(ray.get_actor(f"{name}:{shard}", namespace=NAMESPACE))
            except ValueError:
                raise ShardError(f"shard {shard} of store {name!r} is not running (dead or closed)") from None
        nodes = ray.get([h.ping.remote() for h in handles])
        shards = _Shards(name, handles, nodes, ray_options or RayOptions())
        schemas = [s for s in ray.get([h.schema_json.remote() for h in handles]) if s is not None]
        total = sum(ray.get([h.config.remote() for h in handles])[s]["capacity"] for s in range(len(handles)))
        store = cls.__new__(cls)
        cls.__init__(store, total, seed=seed, sampler=config["sampler"], mode=config["mode"],
                     num_shards=config["num_shards"], name=name,
                     schema=Schema.from_json(schemas[0]) if schemas else None, _shards=shards)
        return store

    def close(self) -> None:
        """End the shard actors (their data is gone)."""
        if self._shards.closed:
            return
        ray = _ray()
        for handle in self._shards.handles:
            ray.kill(handle)
        self._shards.closed = True

    # -- sizes and schema ----------------------------------------------------------

    def _refresh_sizes(self) -> None:
        for shard, size in self._shards.broadcast("size").items():
            self._note(shard, size)

    def _note(self, shard: int, size: tuple[float, int, int]) -> None:
        self._masses[shard], self._sizes[shard], self._episode_counts[shard] = size

    @property
    def schema(self) -> Schema | None:
        if self._schema is None:
            found = [s for s in self._shards.broadcast("schema_json").values() if s is not None]
            if found:
                self._schema = Schema.from_json(found[0])
                self._sink.set_schema(self._schema)
        return self._schema

    def __len__(self) -> int:
        self.flush()
        self._refresh_sizes()
        return int(self._sizes[self._shards.live()].sum())

    @property
    def num_episodes(self) -> int:
        self.flush()
        self._refresh_sizes()
        return int(self._episode_counts[self._shards.live()].sum())

    def __repr__(self) -> str:
        return (f"RayExperienceStore(name={self.name!r}, capacity={self.capacity}, num_shards={self.num_shards}, "
                f"transitions={len(self)}, sampler={self.sampler!r})")

    # -- writing ---------------------------------------------------------------------

    def add_episode(self, episode: Any, env_id: str = "default", metadata: Mapping[str, Any] | None = None,
                    *, timeout: float | None = None) -> None:
        """Send one episode to its env's shard (asynchronous; see `flush`).

        Raises:
            SchemaError: the episode does not match the schema (checked here).
            Any error of an earlier write to the shards.
        """
        check_timeout(timeout)   # no rate limiter here: the timeout is only checked
        check_env_id(env_id)
        metadata = check_metadata(metadata)
        checked, schema = read_episode(episode, self.schema, env_id, metadata)
        self._sink.set_schema(schema)
        self._schema = self._sink.schema
        # Episodes of a named env stay on one shard; unnamed ones go to the least loaded.
        self._added += 1
        self._sink.write(checked, route_key=None if env_id != "default" else f"episode-{self._added}")
        self._sink.commit()

    def flush(self) -> None:
        """Wait until every `add_episode` so far is stored; raise the first error.

        Reads from this store object (`sample`, `len`, `episodes`, ...) flush first,
        so they see its own writes; writers in other processes flush themselves.
        """
        try:
            self._sink.flush()
        except BaseException:
            self._forget_unstored_schema()
            raise

    def _forget_unstored_schema(self) -> None:
        """After a failed write: a schema that only this process's refused episodes
        set is dropped, as a local store's first failed write sets none."""
        if self._schema is None or self._schema_fixed:
            return
        try:
            stored = any(s is not None for s in self._shards.broadcast("schema_json").values())
        except ShardError:
            return
        if not stored:
            self._schema = self._sink._schema = None

    def writer(self, num_envs: int, autoreset_mode: str = "next_step", env_ids: Sequence[str] | None = None,
               *, timeout: float | None = None) -> StepWriter:
        """A step writer whose handle pickles into Ray tasks and actors (env runners).

        Episodes are assembled in the writer's process and sent to shards in batches.
        """
        check_timeout(timeout)
        if env_ids is None:
            prefix = uuid.uuid4().hex[:6]
            env_ids = [f"{prefix}-{i}" for i in range(_check_int("num_envs", num_envs, 1))]
        self._refresh_sizes()
        return StepWriter(_RaySink(self._shards, self._sizes.astype(np.float64), self.schema,
                                   self.capacity // self.num_shards), num_envs, autoreset_mode, env_ids)

    def clear(self) -> None:
        self.flush()
        for shard, size in self._shards.broadcast("clear").items():
            self._note(shard, size)

    # -- sampling ----------------------------------------------------------------------

    def _split(self, batch_size: int | np.ndarray, batches: int, shards: Sequence[int] | None = None
               ) -> tuple[list[int], np.ndarray]:
        """Live shards (of ``shards``, default all) and, per batch, how many items each
        gives (multinomial by mass); ``batch_size`` may differ per batch (an array)."""
        live = self._shards.live()
        if (self._masses[live] <= 0).any():
            # A shard seen empty gets no draws, hence no answers that would update its
            # size: ask again, so a shard that filled since is not skipped forever.
            self._refresh_sizes()
            live = self._shards.live()
        if shards is not None:
            live = [s for s in live if s in shards] or live
        masses = self._masses[live]
        if masses.sum() <= 0:
            raise EmptyStoreError(f"cannot sample: the {self.num_shards} shards of {self.name!r} hold 0 transitions")
        return live, self._rng.multinomial(batch_size, masses / masses.sum(), size=batches)

    def _request(self, batch_size: int | np.ndarray, sample_args: tuple, batches: int = 1,
                 shards: Sequence[int] | None = None) -> tuple:
        live, counts = self._split(batch_size, batches, shards)
        population = (int(self._sizes[live].sum()), float(self._masses[live].sum()))
        population = population if isinstance(self.sampler, PrioritizedSampler) else None
        refs = {shard: self._shards.call(shard, "sample", int(total), *sample_args, population)
                for shard, total in zip(live, counts.sum(axis=0)) if total}
        return refs, live, counts, population, (sample_args, batches, shards)

    def _collect(self, request: tuple, device: torch.device | None) -> tuple[list[dict], np.ndarray, tuple]:
        """The answers of a request: tensors per answering shard, its rows per batch
        ([batches, answers]) and the per-item shape.

        Draws that fell on a shard that died answering (allow_partial) are drawn
        again from the survivors and appended as more answers: each draw is then
        one from the survivors in proportion to their mass, and the answers that
        came are kept (their samples were counted). Prioritized weights are
        rescaled to the survivors' population.
        """
        refs, live, counts, population, (sample_args, batches, shards) = request
        answers = {}
        for shard, (payload, size) in self._shards.get(refs).items():
            self._note(shard, size)
            answers[shard] = payload
        columns = [i for i, shard in enumerate(live) if shard in answers]
        sources = [answers[live[i]].tensors(device) for i in columns]
        kept = counts[:, columns]
        tail = answers[live[columns[0]]].batch_shape[1:] if columns else None
        missing = counts.sum(axis=1) - kept.sum(axis=1)
        if missing.any():
            if not self._shards.live():
                raise ShardError(f"no shard of {self.name!r} is alive")
            redraw = self._request(missing, sample_args, batches, shards)
            if population is not None:   # w = (N p / M)^-beta: from this population to the redraw's
                (n_old, m_old), (n_new, m_new) = population, redraw[3]
                scale = ((n_old / m_old) / (n_new / m_new)) ** self.sampler.beta
                sources = [{**s, ("weight",): s[("weight",)] * scale} for s in sources]
            more, more_kept, tail = self._collect(redraw, device)
            sources, kept = sources + more, np.hstack([kept, more_kept])
        return sources, kept, tail

    def _assemble(self, request: tuple, device: Any) -> list[TensorDict]:
        """The batches of one request: each takes its share of every shard's answer.

        The shards' rows are interleaved into one buffer per key (one copy per
        request, not per batch), and each batch is a slice of those buffers.
        """
        device = torch.device(device) if device is not None else None
        sources, kept, tail = self._collect(request, device)   # kept: [batches, answers]
        sizes = kept.sum(axis=1)
        starts = np.cumsum(sizes) - sizes
        if len(sources) == 1:
            combined = sources[0]                     # rows already in batch order: no copy
        else:
            combined = _interleave(sources, kept, starts, int(sizes.sum()))
        prioritized = isinstance(self.sampler, PrioritizedSampler)
        batches = []
        for start, size in zip(starts.tolist(), sizes.tolist()):
            tensors = {key: tensor[start:start + size] for key, tensor in combined.items()}
            if prioritized:
                tensors[("weight",)] = tensors[("weight",)] / tensors[("weight",)].max()
            on_device = device if device is not None and device.type != "cpu" else None
            batches.append(make_tensordict(tensors, (size, *tail), on_device))
        return batches

    def sample(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
               device: torch.device | str | None = None, pin_memory: bool = False,
               timeout: float | None = None, num_workers: int | None = None,
               worker_nodes: Sequence[str] | None = None) -> TensorDict | list[TensorDict]:
        """Sample across shards, split in proportion to their transitions (or priority mass).

        Same arguments and result as `ExperienceStore.sample`; ``"index"`` holds
        the shard in its top bits. A batch drawn from several shards is
        concatenated once (writable); one from a single shard is a view of
        read-only shared memory (clone before writing in place).

        Args:
            worker_nodes: with ``num_workers``, the node id of each train worker:
                a worker's batch is drawn from the shards on its node (in
                proportion to their mass), from all shards when its node has
                none; workers that share a node split one draw. The union is a
                proportional sample of the whole store only when every node holds
                data in proportion to its workers.
        """
        batch_size = _check_int("batch_size", batch_size, 1)
        n_step, gamma, frame_stack = self._sample_args(n_step, gamma, frame_stack)
        if self.schema is not None:   # the driver assembles the whole batch: it must fit here
            check_batch(self.schema, self.sampler, None, batch_size, frame_stack)
        _check_workers(batch_size, num_workers)
        device = check_device(device)
        check_timeout(timeout)
        if not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory must be a bool, got {pin_memory!r}")
        if num_workers is not None and isinstance(self.sampler, WithoutReplacementSampler) \
                and not self.sampler.drop_last:
            raise ValueError("num_workers needs full batches; WithoutReplacementSampler(drop_last=False) "
                             "returns a short one at each epoch's end: use drop_last=True")
        if worker_nodes is not None:
            if num_workers is None or len(worker_nodes) != num_workers:
                raise ValueError(f"worker_nodes must list one node id per worker (num_workers={num_workers}), "
                                 f"got {worker_nodes!r}")
        self.flush()
        sample_args = (n_step, gamma, frame_stack)
        if worker_nodes is not None:
            per_worker = batch_size // num_workers
            groups: dict[str, list[int]] = {}
            for worker, node in enumerate(worker_nodes):
                groups.setdefault(node, []).append(worker)
            requests = {node: self._request(per_worker * len(workers), sample_args, 1,
                                            [s for s, n in enumerate(self._shards.nodes) if n == node])
                        for node, workers in groups.items()}
            batches: list[TensorDict] = [None] * num_workers
            for node, workers in groups.items():
                parts = self._assemble(requests[node], device)[0].split(per_worker, dim=0)
                for worker, part in zip(workers, parts):
                    batches[worker] = part
            return batches
        batch, = self._assemble(self._request(batch_size, sample_args), device)
        return batch if num_workers is None else list(batch.split(batch_size // num_workers, dim=0))

    def sample_iter(self, batch_size: int, prefetch: int = 4, batches_per_request: int | None = None, *,
                    n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
                    device: torch.device | str | None = None) -> Iterator[TensorDict]:
        """Endless batches; ``prefetch`` requests stay in flight per shard so sampling overlaps training.

        Each request fetches ``batches_per_request`` batches at once (every one of
        them still mixes the shards in proportion to their mass): an actor call
        and its answer through the object store cost a millisecond or two, a batch
        a few microseconds. By default a request is about 4 MiB (at most 64 batches).
        """
        batch_size = _check_int("batch_size", batch_size, 1)
        prefetch = _check_int("prefetch", prefetch, 1)
        n_step, gamma, frame_stack = self._sample_args(n_step, gamma, frame_stack)
        device = check_device(device)
        self.flush()
        if batches_per_request is None:
            batch_bytes = batch_size * (self.schema.row_bytes if self.schema is not None else 1)
            batches_per_request = max(1, min(64, (4 << 20) // batch_bytes))
        batches_per_request = _check_int("batches_per_request", batches_per_request, 1)
        return self._prefetching(batch_size, prefetch, batches_per_request, (n_step, gamma, frame_stack), device)

    def _prefetching(self, batch_size: int, prefetch: int, batches_per_request: int, sample_args: tuple,
                     device: Any) -> Iterator[TensorDict]:
        pending = deque(self._request(batch_size, sample_args, batches_per_request) for _ in range(prefetch))
        while True:
            request = pending.popleft()
            pending.append(self._request(batch_size, sample_args, batches_per_request))
            yield from self._assemble(request, device)

    def iter_batches(self, batch_size: int, shuffle: bool = True, drop_last: bool = False, *,
                     device: torch.device | str | None = None) -> Iterator[TensorDict]:
        batch_size = _check_int("batch_size", batch_size, 1)
        device = check_device(device)
        self.flush()
        ranges = self._shards.broadcast("live_range")
        index = np.concatenate([(np.int64(s) << INDEX_SHIFT) + np.arange(a, b, dtype=np.int64)
                                for s, (a, b) in ranges.items()] or [np.zeros(0, np.int64)])
        return self._epoch_across_shards(epoch_batches(self._rng, index, batch_size, shuffle, drop_last), device)

    def _epoch_across_shards(self, chunks: list[np.ndarray], device: Any) -> Iterator[TensorDict]:
        for chunk in chunks:
            shards = chunk >> INDEX_SHIFT
            refs = {int(s): self._shards.call(int(s), "gather", chunk[shards == s] & RANK_MASK)
                    for s in np.unique(shards)}
            parts = [p.to_tensordict(torch.device(device) if device else None)
                     for p in self._shards.get(refs).values() if p is not None]
            if parts:
                yield parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def update_priorities(self, index: Any, priority: Any) -> int:
        index, priority = self._check_priorities(index, priority)   # all of it, before any shard applies some
        shards = index >> INDEX_SHIFT
        refs = {int(s): self._shards.call(int(s), "update_priorities", index[shards == s] & RANK_MASK,
                                          priority[shards == s])
                for s in np.unique(shards) if 0 <= s < self.num_shards}
        return int(sum(self._shards.get(refs).values()))

    # -- views ----------------------------------------------------------------------

    def episodes(self) -> pa.Table:
        self.flush()
        tables = list(self._shards.broadcast("episodes").values())
        return pa.concat_tables(tables, promote_options="permissive") if tables else self._table.to_arrow()

    def episode(self, episode_id: int) -> pa.RecordBatch:
        _check_episode_id(episode_id)
        self.flush()
        shard = int(episode_id) % self.num_shards
        return self._shards.get({shard: self._shards.call(shard, "episode", int(episode_id))})[shard]

    def to_arrow(self) -> pa.Table:
        self.flush()
        tables = [t for t in self._shards.broadcast("to_arrow").values() if t.num_columns]
        return pa.concat_tables(tables) if tables else pa.table({})

    def stats(self) -> dict:
        self.flush()
        per_shard = list(self._shards.broadcast("stats").values())
        keys = ("transitions", "episodes", "inserts", "samples")
        totals = {k: sum(s[k] for s in per_shard) for k in keys}
        return {**totals, "capacity": self.capacity, "num_shards": self.num_shards,
                "dead_shards": sorted(self._shards.dead), "shards": per_shard}

    # -- persistence (every shard writes its own files, in parallel) ----------------------

    def export_steps(self, steps_dir: Path, schema: pa.Schema, **options: Any) -> tuple[pa.Table, list]:
        self.flush()
        options = {k: v for k, v in options.items() if k in ("compression", "rows_per_file")}
        results = self._shards.broadcast("export_steps", str(steps_dir), schema, options)
        # Shard by shard, in the order of the files: an import reads them in that order.
        tables = [results[s][0] for s in sorted(results) if results[s][0].num_rows]
        entries = [entry for s in sorted(results) for entry in results[s][1]]
        return (pa.concat_tables(tables) if tables else EpisodeTable().to_arrow()), entries

    def save(self, path: str | Path, progress: bool | None = None) -> Path:
        """Checkpoint every shard into ``path/shard-<k>`` in parallel (incremental per shard).

        ``path`` must be reachable from every node; see `arrowbuf.ray_persist`.
        """
        from arrowbuf.ray_persist import save_ray_store

        return save_ray_store(self, Path(path))

    @classmethod
    def load(cls, path: str | Path, progress: bool | None = None, num_shards: int | None = None,
             **options: Any) -> "RayExperienceStore":
        """A Ray store from `save`, into its saved number of shards or ``num_shards``."""
        from arrowbuf.ray_persist import load_ray_store

        return load_ray_store(Path(path), num_shards, **options)

    def to_ray_dataset(self) -> Any:
        """The stored rows as a `ray.data.Dataset`, built where the shards live
        (``ds.write_parquet(...)`` then exports from all nodes at once)."""
        from arrowbuf.ray_persist import to_ray_dataset

        return to_ray_dataset(self)
