"""`ShardServer`: the body of one shard actor, a `ShardEngine` and what a shard keeps around it.

`arrowbuf.ray.start` starts one actor per shard (``ray.remote(ShardServer)``;
threaded, with the concurrency groups of `arrowbuf.ray.handles`, when the store
has a rate limiter). Around its engine (recovered from a `DurableShard`'s directory
when the store is durable, which logs every write before the answer) a shard keeps:

- a `BlockRing` (`arrowbuf.ray.blocks`): its rows sealed into immutable blocks of
  the object store, whose manifest readers poll and gather from without an actor
  call per batch;
- `UnfilledRows` (`arrowbuf.ray.lent`): lent episodes placed without their rows,
  copied into the arena before any method reads it (`_arena`);
- `OpenPieces` (`arrowbuf.ray.tails`): its stored pieces of episodes still open,
  counted as transitions, not episodes.

Every method calls the engine's public API and these parts'; answers that change or
reveal the shard's size carry a reading of it (mass, transitions, episodes, the
shard's clock) for the caller's `SizeCache`. Rows read by index leave as a `Payload`
(or a `ShippedBatch` left in the object store for a train worker), which the caller
reads from Ray's object store without a copy; samples drawn here (PER, rate limiters,
reuse tracking) leave as indices, which the caller's reader gathers from the blocks.

Rate limiters apply per shard: each shard judges its own inserts and samples
(as Reverb does for a table served by several servers), and a call that must
wait for the limiter waits here, in its concurrency group's thread.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf._dirlock import private_directory
from arrowbuf._version_spans import VERSION
from arrowbuf.durable import DurableShard
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import ArrowbufError, SchemaError, refused_in_batch
from arrowbuf.freshness import FreshnessSampler
from arrowbuf.rate_limiters import RateLimiter, limits
from arrowbuf.ray.blocks import BlockRing, Manifest, block_fits, check_object_store, lent_episode
from arrowbuf.ray.lent import UnfilledRows
from arrowbuf.ray.options import INDEX_SHIFT, ray_module
from arrowbuf.ray.persist import plain_rows
from arrowbuf.ray.shares import store_full
from arrowbuf.ray.shipping import ShippedBatch
from arrowbuf.ray.tails import OPEN_PIECES, OpenPieces
from arrowbuf.sample_args import SampleArgs
from arrowbuf.samplers import EpisodeSampler, SequenceSampler, UniformSampler
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode
from arrowbuf.tensors import Payload

Reading = tuple[float, int, int, float]   # (sampling mass, transitions, episodes, shard clock)
LOCK_WAIT = 5.0   # seconds a shard waits for its durable directory's lock (a killed predecessor's)
#: Stateless samplers: readers draw them (a FreshnessSampler from its views' version bounds).
READER_SAMPLERS = (UniformSampler, SequenceSampler, EpisodeSampler, FreshnessSampler)


def _restarted() -> bool:
    """Whether Ray restarted this shard actor (`RayOptions.max_restarts`), rather than made it
    (False outside an actor: a shard served in this process)."""
    ray = ray_module()
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    with warnings.catch_warnings():   # Ray's own property reads its deprecated actor_id
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


class ShardServer:
    """One shard of a Ray store.

    Args:
        capacity: rows of this shard.
        shard: its number; ``num_shards`` the store's shard count.
        seed: seed of its engine's generator.
        sampler: its own copy of the store's sampler.
        rate_limiter: its own copy of the store's limiter (counts are per shard).
        schema_json: the store's schema, if known.
        mode: "circular" or "fixed".
        load_from: a checkpoint directory of this shard to start from.
        track_reuse: count how often each row is sampled.
        durable: this shard's durable directory (`arrowbuf.durable`): it starts from
            the last checkpoint there plus its episode log, and logs every write
            before answering; None keeps episodes in memory only.
        durable_sync: flush the log to disk before answering a write.
        blocks: (block bytes, seal latency) of the blocks this shard publishes
            (`arrowbuf.ray.blocks`).
        holder: what names this shard in its durable directory's lock file (its
            store and driver), for the error another opener gets.
        room: the store's capacity: the most this shard's share may grow to
            (`set_capacity`, `arrowbuf.ray.shares`); its arena is made for it. Default: ``capacity``.
    """

    def __init__(self, capacity: int, shard: int, num_shards: int, seed: int, sampler: Any,
                 rate_limiter: RateLimiter, schema_json: str | None, mode: str, load_from: str | None = None,
                 track_reuse: bool = False, durable: str | None = None, durable_sync: bool = True,
                 blocks: tuple[int, float] = (64 << 20, 0.1), holder: str | None = None,
                 room: int | None = None) -> None:
        self.open_pieces = OpenPieces()   # stored pieces of episodes still open (`arrowbuf.ray.tails`)

        def make_engine() -> ShardEngine:
            if load_from is not None:
                from arrowbuf.checkpoint import load_engine

                loaded = load_engine(load_from, progress=False, shard=shard, num_shards=num_shards,
                                     whole_pieces=True, room=room)
                # Its open pieces, checked against its episode table (a durable shard's log goes on from them).
                self.open_pieces.restore(loaded.info, loaded.engine.table, str(loaded.manifest))
                return loaded.engine
            # Whole pieces: a sealed block holds whole episodes (`arrowbuf.ray.blocks`), so a
            # piece is evicted whole, never its front.
            return ShardEngine(capacity, sampler=sampler, rate_limiter=rate_limiter, mode=mode, seed=seed,
                               track_reuse=track_reuse, shard=shard, num_shards=num_shards, whole_pieces=True,
                               room=room)

        if durable is not None:   # created private (`arrowbuf._dirlock`); one the user made is left as it is
            private_directory(Path(durable).parent, tighten=False)
        # A restarted shard may start while its killed predecessor's process is still going away.
        self.durable = DurableShard(durable, shard, num_shards, durable_sync, lock_wait=LOCK_WAIT,
                                    holder=holder) if durable is not None else None
        self.engine = self.durable.recover(make_engine, self.open_pieces, _restarted()) if self.durable is not None \
            else make_engine()
        engine = self.engine
        self._sampler_spec = type(engine.sampler)(**engine.sampler.config())   # unbound copies, for `attach`
        self._limiter_spec = type(engine.rate_limiter)(**engine.rate_limiter.config())
        self.shard = shard
        self.num_shards = num_shards
        # The store's capacity: what the object store is checked for.
        self.store_capacity = room if room is not None else capacity * num_shards
        self.index_base = shard << INDEX_SHIFT
        if schema_json is not None:
            engine.set_schema(Schema.from_json(schema_json))
        # Readers draw from the blocks themselves unless the draw needs this shard:
        # a limiter judges every sample, and per-row state lives here.
        draws_here = type(engine.sampler) in READER_SAMPLERS and not limits(engine.rate_limiter) \
            and not engine.track_reuse
        self.blocks = BlockRing(*blocks, draws_here=draws_here)
        with engine.lock:
            self.blocks.resume(engine)
        # Lent episodes whose rows are only in their writers' objects so far (`arrowbuf.ray.lent`):
        # every method that reads the arena goes through `_arena`, which copies them in first. A
        # threaded shard (a limiter's, `limits`) copies at once: its reads run beside its writes,
        # and one could place an episode between another's fill and its read.
        self.unfilled = UnfilledRows()
        self._fills_later = not limits(rate_limiter)

    def _arena(self) -> ShardEngine:
        """The engine, with every live row in its arena."""
        return self.unfilled.fill(self.engine)

    def release(self) -> None:
        """Close the durable log and release its directory's lock (the store is closing: the
        next store to open the directory must not wait for this process to be gone)."""
        if self.durable is not None:
            self.durable.close()
            self.durable.failed("the store was closed")

    def ping(self) -> str:
        """This actor's node id (also proves it started)."""
        return ray_module().get_runtime_context().get_node_id()

    def config(self) -> dict:
        engine = self.engine
        return {"shard": self.shard, "num_shards": self.num_shards, "capacity": engine.capacity, "room": engine.room,
                "mode": engine.mode, "sampler": self._sampler_spec, "rate_limiter": self._limiter_spec,
                "seed": engine.seed, "track_reuse": engine.track_reuse,
                "schema": engine.schema.to_json() if engine.schema is not None else None}

    def schema_json(self) -> str | None:
        schema = self.engine.schema
        return schema.to_json() if schema is not None else None

    def size(self) -> Reading:
        """(sampling mass, transitions, episodes, this shard's clock), read together; the
        pieces of open episodes count as transitions, not as episodes."""
        with self.engine.lock:
            mass, transitions, _ = self.engine.size()
            return mass, transitions, self._played(), time.monotonic()

    def _played(self) -> int:
        """Played episodes whose end is stored (under the engine's lock): pieces, and the
        episodes that go on, are not counted (`arrowbuf.ray.tails`)."""
        table = self.engine.table
        return table.num_played(self.open_pieces.mask(table))

    def add_episodes(self, episodes: list[Episode], schema_json: str, timeout: float | None = None,
                     batch: tuple[str, int] | None = None, lent: list | None = None,
                     closes: list[str] | None = None, owner: str | None = None) -> tuple[list[int], Reading]:
        """Store ``episodes`` in order; their ids and the shard's size after them.

        ``batch`` = (writer id, batch number) names a writer's write: a durable
        shard answers a retry of a write it already logged (Ray retries calls
        that a restart interrupted) without storing it again. ``lent``: per
        episode None, or (ObjectRef, part) of its rows in a block's layout
        (`arrowbuf.ray.blocks.block_columns`; the episode was sent without its
        columns): the object itself (part None) or item ``part`` of the list the
        writer put for several episodes at once; put by a writer that lives as long as this shard: the rows are
        read from it without a copy, and it becomes the episode's block; they
        are copied into the arena only when this shard reads its arena
        (`arrowbuf.ray.lent`). ``closes``: envs whose open episode ended with
        its last stored piece; ``owner``: whose open pieces these are (default:
        the writer id; a restored writer continues the pieces of the one its
        state was taken from, `RaySink.load_open_state`).

        Raises:
            SchemaError: this shard stores another schema.
            CapacityError, RateLimited, ...: the first refused episode's error,
                saying how many of the batch were refused (the others are stored).
        """
        if owner is None:
            owner = batch[0] if batch is not None else None
        if closes:   # after this request's episodes: its writer's episodes of these envs ended
            try:
                return self._add_episodes(episodes, schema_json, timeout, batch, lent, owner, closes)
            finally:
                with self.engine.lock:
                    self.open_pieces.close(owner, closes)
        return self._add_episodes(episodes, schema_json, timeout, batch, lent, owner)

    def _add_episodes(self, episodes: list[Episode], schema_json: str, timeout: float | None,
                      batch: tuple[str, int] | None, lent: list | None, owner: str | None,
                      closes: list[str] | None = None) -> tuple[list[int], Reading]:
        if self.durable is not None and self.durable.seen(batch):   # a retry: answered as the first time
            return self.durable.logged_ids(batch) or [], self.size()
        schema = Schema.from_json(schema_json)
        if self.engine.schema is None:
            check_object_store(self.store_capacity, schema)
        if self.engine.schema is not None and self.engine.schema.input_fields != schema.input_fields:
            # Derived fields (compute_gae's) are the shard's own: writers need not know them.
            raise SchemaError(f"shard {self.shard} stores {self.engine.schema}, but the writer sent episodes "
                              f"of {schema}")
        objects = [None] * len(episodes)   # per episode: (ref, part, its rows in a block's layout) or None
        if lent is not None:
            refs = list({entry[0]: None for entry in lent if entry is not None})   # several episodes may share one
            values = dict(zip(refs, ray_module().get(refs)))
            objects = [None if entry is None else (entry[0], entry[1], values[entry[0]] if entry[1] is None
                                                   else values[entry[0]][entry[1]]) for entry in lent]
            episodes = [e if o is None else lent_episode(e, o[2], schema) for e, o in zip(episodes, objects)]
        ids, refused, added = [], [], []
        engine = self.engine
        with engine.lock:   # one run of the ring where they form one (`arrowbuf.block_add`): whole episodes
            blocked = engine.add_block(episodes, schema) if lent is None else None
            for k, episode in enumerate(episodes if blocked is not None else ()):
                self.open_pieces.stored(owner, episode, engine.table.episodes_added - len(blocked) + k)
        if blocked is not None:
            ids, added, episodes = blocked, list(zip(blocked, episodes)), []
        for episode, lent_rows in zip(episodes, objects):   # one refused episode must not take the rest with it
            try:
                # Placed, lent and kept unfilled in one hold of the lock: no other thread
                # (a threaded shard's seal, gather) sees it placed without its rows known.
                with engine.lock:
                    # Not lent when of another layout than the shard's (derived fields).
                    lends = lent_rows is not None and block_fits(
                        lent_rows[2], episode.num_rows, engine.schema if engine.schema is not None else schema)
                    later = lends and self._fills_later
                    episode = dataclasses.replace(episode, prev_piece=self.open_pieces.previous(owner, episode))
                    ids.append(engine.add(episode, schema, timeout, rows=not later))
                    if lends:
                        ref, part, columns = lent_rows
                        self.blocks.lend(engine.table.episodes_added - 1, ref,
                                         sum(data.nbytes for data in columns.values()), part,
                                         columns.get(VERSION))
                    if later:
                        self.unfilled.add(ids[-1], episode)
                    self.open_pieces.stored(owner, episode, engine.table.episodes_added - 1)
                added.append((ids[-1], episode))
            except (ArrowbufError, ValueError) as err:
                refused.append(store_full(err, self.shard, self.num_shards, len(engine), engine.capacity,
                                          self.store_capacity, engine.shard.transitions_of(episode)
                                          if engine.shard is not None else episode.num_steps))
        if self.durable is not None:   # logged (and flushed) before the answer, with the pieces' links
            self.durable.commit(self.engine, added, batch, owner, closes)
        if added:
            with engine.lock:
                self.unfilled.forget_evicted(engine.table)
                self.blocks.added(engine, sum(c.nbytes for _, e in added for c in e.columns.values()))
        if refused:
            raise refused_in_batch(refused, len(episodes), f"shard {self.shard}")
        return ids, self.size()

    def manifest(self, token: str | None, version: int, drawn: int = 0, seal: bool = False
                 ) -> tuple[Manifest | None, Reading]:
        """This shard's block manifest, None when the caller's (``token``, ``version``) is current.

        ``drawn``: items a reader drew from this shard's blocks since its last
        request (counted as samples). ``seal``: seal the open episodes first
        (else they are sealed once they waited ``seal_latency``). A request
        that seals is one its caller waits for (`flush`, reading its own writes):
        it never compacts blocks (a copy of the ring, 0.2-0.4 s for W2's, that
        made a W2 writer's `flush` wait); the polls of readers, which do not
        wait for their answers, do.
        """
        engine = self.engine
        with engine.lock:
            if drawn:
                engine.count_samples(drawn)
            if engine.shard is not None and (seal or self.blocks.due()):
                self.blocks.seal(engine)
            if engine.shard is not None and not seal and self.blocks.compaction_due():
                self.blocks.compact(engine)   # copied blocks only: their rows are in the arena
            manifest = self.blocks.manifest(engine)
            known = manifest.token == token and manifest.version == version
            return (None if known else manifest), self.size()

    def select(self, n: int, args: SampleArgs, population: tuple[int, float] | None, timeout: float | None,
               token: str | None, version: int) -> tuple[np.ndarray, dict, Manifest | None, Reading]:
        """Draw ``n`` items here (the limiter and sampler state are here): (indices, extras such
        as weights and masks, the manifest if the caller's is not current, size).

        Drawn rows that are not sealed yet are sealed before the answer, so the
        manifest sent with it holds every drawn index.
        """
        # A sampler that reads values (a GroupSampler's keys) reads them from the arena: lent rows copied in first.
        engine = self._arena() if self.engine.sampler.reads_values else self.engine
        selection = engine.select(n, args, population, timeout)
        with engine.lock:
            manifest = self.blocks.manifest(engine)
            if selection.indices.size and int(selection.indices.max()) >= manifest.stop_index:
                self.blocks.seal(engine)
                manifest = self.blocks.manifest(engine)
            known = manifest.token == token and manifest.version == version
            return selection.indices, selection.extra, (None if known else manifest), self.size()

    def epoch(self, batch_size: int, shuffle: bool, drop_last: bool) -> list[np.ndarray]:
        """`iter_batches`' order as this shard's sampler draws it (a `GroupSampler`'s: complete groups
        only, each whole), in local indices; the rows it names are sealed before the answer, so the
        manifest a reader fetches next holds them."""
        engine = self._arena()   # a group's key is read from its rows
        chunks = engine.epoch(batch_size, shuffle, drop_last)
        with engine.lock:
            self.blocks.seal(engine)
        return chunks

    def live_range(self) -> tuple[int, int]:
        return self.engine.live_range()

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray]:
        return self.engine.episode_spans()

    def gather(self, indices: np.ndarray) -> Payload | None:
        """The live ones of ``indices``, in that order (None when none is live)."""
        return self._arena().gather_payload(indices, self.index_base)

    def gather_ref(self, indices: np.ndarray, finish: tuple | None) -> tuple[int, Any]:
        """Rows of local ``indices`` for a train worker, as two results (`arrowbuf.ray.shipping`):
        how many were live (the caller waits for this alone) and the rows, which stay in the
        object store: a `ShippedBatch` finished with ``finish``, or with None a `Payload` for an
        assembling task. The rows are None unless every index was live."""
        payload = self._arena().gather_payload(indices, self.index_base)
        rows = 0 if payload is None else payload.batch_shape[0]
        if rows != len(indices):
            return rows, None
        return rows, (payload if finish is None else ShippedBatch(payload, finish))

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> tuple[int, Reading]:
        """How many of ``indices`` were live, and the shard's size (its mass changed)."""
        return self.engine.update_priorities(indices, priorities), self.size()

    def gae_final_observations(self, value_key: str) -> tuple[np.ndarray, Any]:
        """`compute_gae`, first step: (episode ids, final observations) of the episodes that
        bootstrap from their final observation (`ShardEngine.final_observations`)."""
        return self._arena().final_observations(value_key)

    def compute_gae(self, gamma: float, lam: float, value_key: str, ids: np.ndarray,
                    values: np.ndarray) -> tuple[int, str | None]:
        """`compute_gae`, second step, with the values of those final observations: the
        transitions written and the shard's schema (now with the derived fields)."""
        count = self._arena().compute_gae(gamma, lam, value_key, None, (ids, values))
        with self.engine.lock:   # readers' blocks must hold the new columns
            if self.engine.shard is not None:
                self.blocks.republish(self._arena())
        return count, self.schema_json()

    def episodes(self, include_open: bool = False) -> pa.Table:
        """One row per played episode whose end is stored; with ``include_open``, the open ones too (``open``)."""
        with self.engine.lock:
            return self.engine.episodes(include_open, self.open_pieces.mask)

    def episode(self, episode_id: int) -> pa.RecordBatch:
        return self._arena().episode(episode_id)

    def to_arrow(self) -> pa.Table:
        return self._arena().to_arrow()

    def evict(self, min_version: int) -> tuple[int, Reading]:
        """Free the oldest episodes whose steps are all older than ``min_version``
        (`arrowbuf.versions.evict_stale`): how many, and the shard's size. Lent rows are copied
        in first: the versions are read from the arena."""
        engine = self._arena()
        with engine.lock:
            count = engine.evict(min_version)
            if count:
                self.unfilled.forget_evicted(engine.table)
                self.blocks.evicted(engine)
        return count, self.size()

    def set_capacity(self, capacity: int) -> tuple[int, Reading]:
        """This shard's share of its store's capacity from now on (`arrowbuf.ray.shares`): a
        smaller one evicts its oldest episodes now (whole, as every eviction here); the
        capacity taken and the shard's size (a durable shard keeps it in its directory: restarted,
        it starts from it). A share that cannot be kept on disk (OSError, raised) is not taken:
        the shard goes back to the share its store knows (what a smaller one evicted stays gone)."""
        engine = self.engine
        with engine.lock:
            before = engine.capacity
            taken = engine.set_capacity(capacity)
            self.unfilled.forget_evicted(engine.table)
            if engine.shard is not None:
                self.blocks.evicted(engine)
            if self.durable is not None:
                try:
                    self.durable.remember_share(taken)
                except OSError:
                    engine.set_capacity(before)
                    try:   # the file may hold the new share already (a failed directory fsync after it moved)
                        self.durable.remember_share(before)
                    except OSError:
                        pass
                    raise
        return taken, self.size()

    def clear(self) -> Reading:
        with self.engine.lock:
            self.engine.clear()
            self.blocks.clear()
            self.unfilled.clear()
            self.open_pieces.clear()
        if self.durable is not None:   # a restart must not bring the episodes back
            self.durable.cleared(self.engine)
        return self.size()

    def stats(self) -> dict:
        stats = self.engine.stats()
        with self.engine.lock:   # open episodes' pieces count as transitions only, as in `size`
            stats["episodes"] = self._played()
        return {**stats, "shard": self.shard, "node_id": self.ping()}

    def export_steps(self, steps_dir: str, schema: pa.Schema, options: dict) -> tuple[pa.Table, list]:
        """Write this shard's rows as Parquet parts into ``steps_dir`` (a shared directory)."""
        if self.engine.shard is None:
            return self.engine.episodes(), []
        from arrowbuf.parquet import export_shard

        return export_shard(self._arena().shard, self.engine.lock, Path(steps_dir), schema,
                            shard_index=self.shard, progress=False, **options)

    def save(self, path: str, base: str | None = None, writers: dict | None = None) -> str:
        """Checkpoint this shard into ``path``, incrementally from its save in ``base``, with
        its open pieces and ``writers`` (writer states by name: the saving process's)."""
        from arrowbuf.checkpoint import save_engine

        engine = self._arena()
        info = {"capacity": engine.capacity, "room": engine.room, "mode": engine.mode, "seed": engine.seed,
                "track_reuse": engine.track_reuse, "created_at": 0.0}
        with engine.lock:
            pieces = self.open_pieces.state(engine.table)
        save_engine(engine, path, {**info, OPEN_PIECES: pieces}, lambda: dict(writers or {}), progress=False,
                    base=base)
        if self.durable is not None:   # its own checkpoint (with its open pieces), then the log is compacted
            self.durable.checkpoint(engine, {**info, OPEN_PIECES: pieces})
        return path

    def plain_rows(self) -> pa.Table:
        """This shard's rows in the Ray Data layout (`arrowbuf.ray.persist`)."""
        return plain_rows(self._arena())
