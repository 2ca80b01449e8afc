"""`ShardEngine`: one shard with its sampler, generator, limiter counters and lock.

The engine is the unit every store serves from: the embedded store holds one,
every Ray shard actor holds one, and so does a dataset (`arrowbuf.dataset`). It
composes the parts and calls them in order; no part calls back into its owner:

- `add` (whole episodes, and the pieces a staged writer delivers) checks that
  the episode fits, waits for the rate limiter, places the episode in the
  `Shard` (whose placement tells the sampler of the rows it evicts:
  `Sampler.on_evict`) and copies its rows, unless the caller fills them later (a
  Ray shard's lent rows), then tells the sampler which rows it added
  (`Sampler.on_add`). A step writer of an embedded circular store without a
  limiter that can refuse bypasses it: it writes in place into the shard's
  regions under the engine's lock, and tells the sampler and the insert count
  itself (`arrowbuf.inplace`);
- a sample waits for the rate limiter; a plain uniform one of a host arena onto
  the CPU (no limiter, n-step, frame stack or reuse tracking) is drawn and gathered straight
  into a pooled batch (`arrowbuf.direct`); any other asks the sampler for a
  `Selection` (of ``min_version``: `arrowbuf.versions`), adds the n-step /
  frame-stack look-ups (`arrowbuf.indexing`) and gathers the rows
  (`arrowbuf.tensors.Gather`).

Limiters are configuration (`arrowbuf.rate_limiters`): the engine keeps the
insert / sample `Counts` they judge. Every method takes the engine's lock (an
`OwnedLock`: it knows whether the calling thread holds it), so an engine may be
shared by threads; arguments are checked by the caller (the store
facade checks them once), except where only the engine can tell (the data).
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pyarrow as pa

from arrowbuf._bounds import check_arena, check_batch
from arrowbuf._owned_lock import OwnedLock
from arrowbuf._stats import reuse_summary, sampler_priorities
from arrowbuf.block_add import add_block
from arrowbuf.advantages import check_gae_fields, cut_episodes, observation_arrays, write_advantages
from arrowbuf.direct import sample_plain_uniform
from arrowbuf.errors import EmptyStoreError, RateLimited, SchemaError
from arrowbuf.rate_limiters import Counts, RateLimiter, limits, scope
from arrowbuf.sample_args import PLAIN, SampleArgs
from arrowbuf.samplers import PrioritizedSampler, Sampler, Selection, UniformSampler, select_indices
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode, Shard
from arrowbuf.shard_arrow import episode_table, played_episode, shard_table
from arrowbuf.table import EpisodeTable
from arrowbuf.tensors import Payload
from arrowbuf.versions import evict_stale, fresh_indices, fresh_selection

if TYPE_CHECKING:
    from tensordict import TensorDict


class ShardEngine:
    """One shard of a store: arena, episode table, sampler, generator, counters, lock.

    Args:
        capacity: transitions held (the arena keeps the rows beyond them that final
            observations take: `arrowbuf.placement`).
        sampler: the shard's own `Sampler` (bound to the shard when it is made).
        rate_limiter: the limiter's configuration; the engine keeps its counts.
        mode: "circular" or "fixed" (see `Shard`).
        seed: seed of the engine's `numpy.random.Generator`.
        schema: the fields; the shard is made at the first write when None.
        track_reuse: count how often each row is sampled.
        shard: this shard's number and ``num_shards`` the store's shard count
            (episode ids are spaced by it; 0 and 1 for the embedded store).
        storage_device: the torch device of a torch arena (`arrowbuf.arena`); None: numpy columns.
        whole_pieces: evict whole pieces only (a Ray shard: see `arrowbuf.placement`).
        room: the largest capacity `set_capacity` may give it (a Ray shard's: its store's
            capacity, `arrowbuf.ray.shares`); default ``capacity``.

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> from arrowbuf.engine import ShardEngine
        >>> from arrowbuf.episode_read import read_episode
        >>> engine = ShardEngine(100, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=0)
        >>> episode, schema = read_episode({"obs": np.zeros((4, 2)), "action": np.zeros(3),
        ...                                 "terminated": np.array([False, False, True])}, None)
        >>> engine.add(episode, schema)
        0
        >>> engine.sample(5)["next", "obs"].shape
        torch.Size([5, 2])
    """

    def __init__(self, capacity: int, *, sampler: Sampler, rate_limiter: RateLimiter, mode: str = "circular",
                 seed: int | None = None, schema: Schema | None = None, track_reuse: bool = False,
                 shard: int = 0, num_shards: int = 1, storage_device: Any = None,
                 whole_pieces: bool = False, room: int | None = None) -> None:
        self.capacity = capacity
        self.room = max(capacity, room or 0)
        self.whole_pieces = whole_pieces
        self.storage_device = storage_device
        self.mode = mode
        self.sampler = sampler
        self.rate_limiter = rate_limiter
        self.track_reuse = track_reuse
        self.seed = seed
        self.shard_index, self.limiter_scope = shard, scope(shard, num_shards)   # limiter messages: store or shard
        self.num_shards = num_shards
        self.counts = Counts()
        self.lock = OwnedLock()
        self._changed = threading.Condition(self.lock)   # wakes callers waiting on the rate limiter
        self._rng = np.random.default_rng(seed)
        self._shard: Shard | None = None
        self._unbound: Shard | None = None   # made for a first write that `add_block` declined: `_make_shard`
        self._empty_table = EpisodeTable()
        self._created = time.monotonic()
        # Checkpoint directory -> token of the save made or loaded here: a save into
        # the same directory again writes only what is new (`arrowbuf.checkpoint`).
        self.checkpoints: dict[str, str] = {}
        # The plain limiter only counts: the waits are skipped for it.
        self._limited = limits(rate_limiter)
        # Plain uniform samples of a numpy arena may take `arrowbuf.direct`'s path.
        self._direct = type(sampler) is UniformSampler and not self._limited
        if schema is not None:
            self._bind(self._make_shard(schema))

    def counted(self, inserts: int = 0, samples: int = 0) -> None:
        """Count transitions written or sampled by a path that writes or draws under this
        engine's lock without its `add` or `sample` (a writer's in-place steps, a mixture)."""
        self.counts.add(inserts, samples)

    def remember_checkpoint(self, path: str, token: str) -> None:
        """``path`` (resolved) holds the checkpoint ``token`` saved or loaded here: a save
        there again writes only what is new (`arrowbuf.checkpoint`)."""
        self.checkpoints[path] = token

    # -- shape ----------------------------------------------------------------------

    @property
    def schema(self) -> Schema | None:
        """The enforced schema, or None before the first write."""
        return self._shard.schema if self._shard is not None else None

    @property
    def limited(self) -> bool:
        """Whether the rate limiter can refuse or hold back a write or a sample."""
        return self._limited

    @property
    def shard(self) -> Shard | None:
        """The shard (None before the first write), for snapshots: read it under `lock`."""
        return self._shard

    @property
    def table(self) -> EpisodeTable:
        """The episode table (an empty one before the first write); read it under `lock`."""
        return self._shard.table if self._shard is not None else self._empty_table

    def __len__(self) -> int:
        """Transitions stored."""
        return len(self._shard) if self._shard is not None else 0

    @property
    def num_episodes(self) -> int:
        """Played episodes whose end is stored (`EpisodeTable.num_played`): pieces are not episodes."""
        return self._shard.table.num_played() if self._shard is not None else 0

    def size(self) -> tuple[float, int, int]:
        """(sampling mass, transitions, episodes), as one consistent reading."""
        with self.lock:
            if self._shard is None:
                return 0.0, 0, 0
            return self.sampler.mass(self._shard.table), len(self._shard), self._shard.table.num_played()

    def set_schema(self, schema: Schema) -> None:
        """Make the shard for ``schema`` now (no-op once there is one)."""
        with self.lock:
            if self._shard is None:
                self._bind(self._make_shard(schema))

    def set_capacity(self, capacity: int) -> int:
        """Hold ``capacity`` transitions from now on, in ``[0, room]``: a smaller one evicts the
        oldest now (`Shard.set_capacity`); the capacity taken (a fixed store's shrinks no lower
        than it holds).

        Raises:
            ValueError: a capacity outside ``[0, room]``.
        """
        with self.lock:
            if not 0 <= capacity <= self.room:
                raise ValueError(f"capacity must be in [0, {self.room}], got {capacity}")
            self.capacity = self._shard.set_capacity(capacity) if self._shard is not None else capacity
            return self.capacity

    def attach(self, shard: Shard) -> None:
        """Serve ``shard`` (a dataset's mapped rows, `arrowbuf.dataset`); the caller tells the sampler of its rows."""
        with self.lock:
            self._bind(shard)

    def _make_shard(self, schema: Schema) -> Shard:
        spare, self._unbound = self._unbound, None
        if spare is not None and spare.schema == schema:   # one arena, never two (a CUDA one is allocated at once)
            return spare
        if self.storage_device is None:   # the torch arena is imported only for one (`arrowbuf._lazy_torch`)
            check_arena(schema, self.capacity)
            return Shard(schema, self.capacity, self.mode, self.shard_index, self.num_shards, self.whole_pieces,
                         room=self.room)
        from arrowbuf.arena import TorchShard
        return TorchShard(schema, self.capacity, self.mode, self.shard_index, self.num_shards,
                          device=self.storage_device, whole_pieces=self.whole_pieces)

    def _bind(self, shard: Shard) -> None:
        self.sampler.bind(shard)
        shard.placement.listen(self.sampler if self.sampler.tracks_rows else None)
        if self.track_reuse:
            shard.track_reuse()
        self._shard = shard

    # -- writing --------------------------------------------------------------------

    def add(self, episode: Episode, schema: Schema | None = None, timeout: float | None = None,
            limited: bool = True, rows: bool = True) -> int:
        """Copy a checked episode into the shard; returns its id.

        Args:
            episode: from `arrowbuf.episodes.read_episode` or a writer.
            schema: the schema the episode was checked against (makes the shard
                at the first write).
            timeout: seconds to wait for the rate limiter (None: raise at once).
            limited: False for imports of saved data: counted, never refused by the rate limiter.
            rows: False places the episode but leaves its rows to the caller (`Shard.add`).

        Raises:
            CapacityError: it does not fit (see `Shard.check_fits`).
            RateLimited: the rate limiter refuses the insert.
            SchemaError: another thread's first write fixed another schema.
            Nothing is changed when it raises.
        """
        with self._changed:
            shard = self._shard if self._shard is not None else self._make_shard(schema)
            episode = shard.encoded(episode)   # bounded encoded fields: bytes checked before anything is evicted
            plan, transitions = shard.check_fits(episode), shard.transitions_of(episode)
            if self._limited and limited:
                limiter, counts = self.rate_limiter, self.counts
                self._wait(lambda: limiter.can_insert(transitions, counts), timeout,
                           lambda: limiter.why_not_insert(transitions, counts, self.limiter_scope))
                if self._shard is not None and shard is not self._shard:
                    # Another thread made the store's first write while this one waited.
                    if self._shard.schema != shard.schema:
                        raise SchemaError(f"episode of {shard.schema} does not match the store's {self.schema}")
                    shard = self._shard
                plan = shard.check_fits(episode)   # other threads may have written while we waited
            if self._shard is None:
                self._bind(shard)
            sampler = self.sampler
            episode_id = shard.add(episode, plan, rows)
            if sampler.tracks_rows:
                sampler.on_add(int(shard.table.col("first_row")[-1]), transitions)
            self.counts.add(inserts=transitions)
            if self._limited:
                self._changed.notify_all()
            return episode_id

    def add_block(self, episodes: list[Episode], schema: Schema | None = None) -> list[int] | None:
        """Copy checked ``episodes`` (one `add_episodes` batch) in as one block (`arrowbuf.block_add`); their ids,
        or None (nothing changed: the caller adds them one by one) where they do not form one, or a limiter judges."""
        if self._limited:
            return None
        with self._changed:
            shard = self._shard if self._shard is not None else self._make_shard(schema)
            ids = add_block(shard, episodes, (lambda: self._bind(shard)) if self._shard is None else None)
            if ids is None and self._shard is None:
                self._unbound = shard   # unchanged: the single adds that follow take it
            elif ids is not None:
                first, lengths = shard.table.col("first_row")[-len(ids):], shard.table.col("length")[-len(ids):]
                for row, length in zip(first.tolist(), lengths.tolist()) if self.sampler.tracks_rows else ():
                    self.sampler.on_add(row, length)
                self.counts.add(inserts=int(lengths.sum()))
            return ids

    def clear(self) -> None:
        """Remove every episode; indices keep counting, so indices sampled before stay stale."""
        with self.lock:
            shard = self._shard
            if shard is None:
                return
            if self.sampler.tracks_rows and len(shard.table):
                self.sampler.on_evict(*shard.evicted_spans(len(shard.table)))
            shard.clear()

    def _wait(self, allowed: Callable[[], bool], timeout: float | None, why: Callable[[], str]) -> None:
        if allowed():
            return
        if timeout is None or not self._changed.wait_for(allowed, None if math.isinf(timeout) else timeout):
            raise RateLimited(why() + (f" Waited {timeout} s." if timeout else ""))

    # -- sampling -------------------------------------------------------------------

    def require_data(self) -> None:
        """Raises `EmptyStoreError` when no transition is stored."""
        shard = self._shard
        if shard is None or not shard.table.num_transitions:
            raise EmptyStoreError(f"cannot sample: the store holds 0 transitions ({self.num_episodes} episodes); "
                                  "add episodes first")
        if not self.sampler.draws_open and not shard.table.sealed_transitions:
            raise EmptyStoreError(f"cannot sample: {self.sampler!r} draws sealed episodes, and the store holds "
                                  f"none yet ({shard.table.num_transitions} steps of open episodes; a writer "
                                  "seals an episode when it ends, at flush(), or in pieces)")

    def sample(self, batch_size: int, args: SampleArgs = PLAIN, device: Any = None, pin_memory: bool = False,
               timeout: float | None = None, keys: Any = None, min_version: int | None = None) -> TensorDict:
        """Draw with the sampler and gather: the store's `sample` on one shard.

        Args:
            batch_size: what the sampler draws (transitions, windows or episodes).
            args: n-step and frame-stack look-ups, checked by the caller.
            device: a checked torch.device or None.
            pin_memory: gather into pinned memory.
            timeout: seconds to wait for the rate limiter.
            keys: the fields to gather (see `check_keys`); None: all.
            min_version: only transitions of ``policy_version`` >= it (`arrowbuf.versions`).

        Raises:
            EmptyStoreError: no transition stored (or none of ``min_version``).
            RateLimited: the limiter refuses the sample.
            ValueError: ``keys`` names no field, or ``min_version`` without a `UniformSampler`.
        """
        with self.lock:   # `_changed`'s lock, without the Condition's Python-level __enter__
            self._wait_to_sample(batch_size, timeout)
            shard = self._shard
            keys = shard.gatherer.check_keys(keys)
            direct = self.direct() if args.plain and device is None and not pin_memory else None
            if direct is not None:
                batch = sample_plain_uniform(shard, self._rng, batch_size, keys, min_version)
                self.counts.add(samples=batch_size)
                return batch
            selection = self._draw(batch_size, args, min_version=min_version)
            batch = self._gather(selection, args, device, pin_memory, keys)
            self._sampled(selection)
            return batch

    def direct(self) -> tuple[Shard, np.random.Generator] | None:
        """(shard, generator) when plain uniform samples go straight into a slot (`arrowbuf.direct`); under `lock`."""
        shard = self._shard
        return (shard, self._rng) if self._direct and shard is not None and shard.reuse is None and shard.host_columns \
            and not shard.gatherer.has_apart else None

    def select(self, batch_size: int, args: SampleArgs = PLAIN, population: tuple[int, float] | None = None,
               timeout: float | None = None) -> Selection:
        """Draw as `sample` does, counted as a sample, without gathering (a Ray reader gathers)."""
        with self._changed:
            self._wait_to_sample(batch_size, timeout)
            selection = self._draw(batch_size, args, population)
            self._sampled(selection)
            return selection

    def count_samples(self, count: int) -> None:
        """Count ``count`` items drawn elsewhere (by a Ray reader) as samples of this shard."""
        with self._changed:
            self.counts.add(samples=count)
            if self._limited:
                self._changed.notify_all()

    def _draw(self, batch_size: int, args: SampleArgs, population: tuple[int, float] | None = None,
              min_version: int | None = None) -> Selection:
        """The sampler's selection (of ``min_version``: `arrowbuf.versions.fresh_selection`),
        once the batch is known to fit in memory (`check_batch`)."""
        sampler, table = self.sampler, self._shard.table
        check_batch(self._shard.schema, sampler, table, batch_size, args.frame_stack)
        if min_version is not None:
            return fresh_selection(self._rng, batch_size, self._shard, min_version, sampler)
        if population is not None and isinstance(sampler, PrioritizedSampler):
            return sampler.sample(self._rng, batch_size, table, population)
        return sampler.sample(self._rng, batch_size, table)

    def _wait_to_sample(self, batch_size: int, timeout: float | None) -> None:
        if self._limited:
            limiter, counts = self.rate_limiter, self.counts
            self._wait(lambda: limiter.can_sample(batch_size, len(self), counts), timeout,
                       lambda: limiter.why_not_sample(batch_size, len(self), counts, self.limiter_scope))
        self.require_data()

    def _sampled(self, selection: Selection) -> None:
        """Count a gathered selection (the limiter's counts, the rows' reuse)."""
        self.counts.add(samples=selection.rows.size)
        shard = self._shard
        if shard.reuse is not None:
            shard.count_samples(selection.rows, selection.extra.get("mask"))
        if self._limited:
            self._changed.notify_all()

    def live_range(self) -> tuple[int, int]:
        """[first, stop) of the live transition indices."""
        with self.lock:
            return self.table.live_range()

    def check_keys(self, keys: Any) -> frozenset | None:
        """``keys`` as `sample` and `gather` take them: see `arrowbuf.tensors.Gather.check_keys`.
        Before the first write (no schema) there is nothing to check them against, nor to gather.

        Raises:
            ValueError: ``keys`` is not a list of keys, or names a key that is not gathered.
        """
        with self.lock:
            return keys if self._shard is None else self._shard.gatherer.check_keys(keys)

    def epoch(self, batch_size: int, shuffle: bool, drop_last: bool,
              min_version: int | None = None) -> list[np.ndarray]:
        """Every live index (of version >= ``min_version``) once, in batches (shuffled, drawn now)."""
        with self.lock:
            indices = (self.table.public_indices(np.arange(*self.table.sample_range(), dtype=np.int64))
                       if min_version is None or self._shard is None else fresh_indices(self._shard, min_version))
            return self.sampler.epoch(self._rng, indices, batch_size, shuffle, drop_last, self.table)

    def evict(self, min_version: int) -> int:
        """Free the oldest episodes older than ``min_version`` (`arrowbuf.versions.evict_stale`); how many."""
        with self._changed:
            count = evict_stale(self._shard, self.sampler, min_version) if self._shard is not None else 0
            self._changed.notify_all()   # a rate limiter may allow inserts now
            return count

    def gather(self, indices: np.ndarray, device: Any = None, keys: Any = None, views: bool = False) -> TensorDict | None:
        """The live ones of transition ``indices`` (1-D), in that order; None before the first write.

        Reads by index, as `iter_batches` does: counted in the rows' reuse, not as a sample for
        the rate limiter. ``views``: contiguous rows come as views of the arena (`Shard.view_batch`).
        """
        with self.lock:
            shard = self._shard
            if shard is None:
                return None
            selection, _ = self._held(indices)
            batch = self._gather(selection, PLAIN, device, False, keys, views)
            if shard.reuse is not None:
                shard.count_samples(selection.rows)
            return batch

    def gather_each(self, shares: list[np.ndarray], device: Any = None, keys: Any = None,
                    views: bool = False) -> list[TensorDict | None]:
        """`gather` of each of ``shares`` (a driver's shares of one global batch,
        `arrowbuf.groups.rank_shares`; None for each before the first write): the look-ups made
        once for all, every share's ragged values copied before any share's tensors are built
        (`arrowbuf.tensors.Gather.each`). Not `gather`'s own path: splitting one share's look-ups
        took a plain 256-row gather from 25 to 41 us."""
        with self.lock:
            shard = self._shard
            if shard is None:
                return [None] * len(shares)
            selection, held = self._held(np.concatenate(shares))
            rows, extra, _, _ = shard.lookups(selection, PLAIN)   # (plain: no frame or n-step rows)
            sizes = [np.count_nonzero(part) for part in np.split(held, np.cumsum([len(s) for s in shares])[:-1])]
            bounds = np.cumsum([0, *sizes]).tolist()
            parts = [(rows[a:b], {name: array[a:b] for name, array in extra.items()}) for a, b in zip(bounds, bounds[1:])]
            viewed = {k for k, (part, _) in enumerate(parts) if views and shard.viewable(part)}   # arena views
            copied = iter(shard.gatherer.each([part for k, part in enumerate(parts) if k not in viewed], device, keys))
            batches = [shard.view_batch(int(part[0]), int(part[-1]) + 1, {n: a.copy() for n, a in part_extra.items()},
                                        keys, device) if k in viewed else next(copied)
                       for k, (part, part_extra) in enumerate(parts)]
            if shard.reuse is not None:
                shard.count_samples(selection.rows)
            return batches

    def _held(self, indices: np.ndarray) -> tuple[Selection, np.ndarray]:
        """(the selection of the live ones of transition ``indices``, which ones they are): what
        a gather by index reads, kept indices of open steps resolved to where those steps are now."""
        table = self._shard.table
        indices = table.resolve(indices)
        held = table.is_sampleable(indices)
        return select_indices(table, indices[held]), held

    def gather_payload(self, indices: np.ndarray, index_base: int = 0) -> Payload | None:
        """`gather` into a `Payload` (what a Ray shard sends); None when none is live."""
        with self.lock:
            if self._shard is None:
                return None
            live = indices[self._shard.table.is_live(indices)]
            if not len(live):
                return None
            rows, extra, _, _ = self._shard.lookups(select_indices(self._shard.table, live), PLAIN, index_base)
            return self._shard.gatherer.payload(rows, extra)

    def _gather(self, selection: Selection, args: SampleArgs, device: Any, pin_memory: bool,
                keys: Any = None, views: bool = False) -> TensorDict:
        rows, extra, obs_rows, next_rows = self._shard.lookups(selection, args)
        if views and self._shard.viewable(rows):   # no copy: views of the arena
            return self._shard.view_batch(int(rows[0]), int(rows[-1]) + 1, extra, keys, device)
        return self._shard.gatherer(rows, extra, device, pin_memory, obs_rows=obs_rows, next_rows=next_rows,
                                  keys=keys)

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> int:
        """Set checked priorities (int64 indices, float64 values >= 0) of live indices; returns how many were live."""
        with self.lock:
            if self._shard is None:
                return 0
            # A kept index of an open step reaches that step (once sealed) or nothing.
            return self.sampler.update(self._shard.table, self._shard.table.resolve(indices), priorities)

    # -- derived columns ----------------------------------------------------------------

    def compute_gae(self, gamma: float, lam: float, value_key: str,
                    bootstrap_value: Callable[[TensorDict], Any] | None,
                    final_values: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """Write ``"advantage"`` and ``"value_target"`` of every live transition
        (`arrowbuf.advantages.write_advantages`, under the lock); returns how many."""
        with self.lock:
            if self._shard is None:
                return 0
            return write_advantages(self._shard, gamma, lam, value_key, bootstrap_value, final_values)

    def final_observations(self, value_key: str) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        """(episode ids, final observations by field: numpy, a shard never imports torch) of the episodes
        that bootstrap from their final observation's value (`arrowbuf.advantages.cut_episodes`); a Ray
        shard's first step of `compute_gae`. Raises ValueError as `compute_gae` does for missing fields."""
        with self.lock:
            if self._shard is None:
                return np.zeros(0, np.int64), None
            check_gae_fields(self._shard, value_key)
            ids, rows = cut_episodes(self._shard)
            return ids, observation_arrays(self._shard, rows)

    # -- views ----------------------------------------------------------------------

    def episodes(self, include_open: bool = False, open_pieces: Callable[[EpisodeTable], np.ndarray] | None = None
                 ) -> pa.Table:
        """The episode table: one row per played episode, oldest first (`EpisodeTable.to_arrow`);
        ``open_pieces(table)``: the mask of stored pieces whose episode goes on (a Ray shard's)."""
        with self.lock:
            return episode_table(self._shard, self.table, include_open, open_pieces and open_pieces(self.table))

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(first index, transitions) of every live episode, oldest first (copies)."""
        with self.lock:
            return self.table.col("first_index").copy(), self.table.col("length").copy()

    def episode(self, episode_id: int) -> pa.RecordBatch:
        """One live episode's rows as a zero-copy RecordBatch.

        Raises:
            KeyError: no live episode has this id.
        """
        with self.lock:
            return played_episode(self._shard, self.table, episode_id)

    def to_arrow(self) -> pa.Table:
        """Every stored row, oldest episode first, as zero-copy chunks of the arena (open tails: copies)."""
        with self.lock:
            return shard_table(self._shard) if self._shard is not None else pa.table({})

    def stats(self) -> dict:
        """Sizes, counts (totals and per second), limiter state, reuse and priorities."""
        with self.lock:
            elapsed = max(time.monotonic() - self._created, 1e-9)
            counts = self.counts
            return {
                "transitions": len(self), "episodes": self.num_episodes, "capacity": self.capacity,
                "inserts": counts.inserts, "samples": counts.samples,
                "inserts_per_s": counts.inserts / elapsed, "samples_per_s": counts.samples / elapsed,
                "sample_to_insert_ratio": counts.samples / counts.inserts if counts.inserts else 0.0,
                "rate_limiter": self.rate_limiter.state(counts),
                "reuse": reuse_summary(self._shard.reuse_counts()) if self._shard is not None else None,
                "priorities": sampler_priorities(self.sampler, self._shard),
            }

    # -- state ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Generator, sampler, limiter counts and shard state (the rows are saved apart).

        Call under `lock` together with the row snapshot it belongs to.
        """
        shard = self._shard
        return {
            "schema": shard.schema.to_json() if shard is not None else None,
            "rng": self._rng.bit_generator.state,
            "sampler": self.sampler.state_dict(),
            "rate_limiter": self.rate_limiter.state_dict(self.counts),
            "shard": shard.state_dict() if shard is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], fill_rows: Callable[[Shard], None] | None = None) -> None:
        """Restore `state_dict` into a new engine built with the saved configuration.

        Args:
            state: a `state_dict`.
            fill_rows: copies the live episodes' rows into the shard's arena at
                their ``first_row`` (called after the shard state is restored).

        Raises:
            ValueError, KeyError, TypeError: a state of another configuration, or
                values outside their domains.
        """
        with self.lock:
            counts = self.rate_limiter.counts_of(state["rate_limiter"])
            if state["schema"] is not None:
                self.set_schema(Schema.from_json(state["schema"]))
                self._shard.load_state_dict(state["shard"])
                if fill_rows is not None:
                    fill_rows(self._shard)
            self.sampler.load_state_dict(state["sampler"])
            self._rng.bit_generator.state = state["rng"]
            self.counts = counts
