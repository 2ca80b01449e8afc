"""`BlockReader`: a process's view of a Ray store's sealed blocks, sampled and gathered here.

Each shard publishes a manifest (`arrowbuf.ray.blocks`): its blocks, oldest
first, and its first live episode. The reader keeps a `ShardView` of each
(`arrowbuf.ray.views`: its blocks and episode table, with the shard's own indices).

- Uniform, sequence, episode and freshness sampling draw here, from the views, and gather from the blocks: no
  actor call per batch. The store hands the reader a `SampleRequest`; a `DrawLoop` draws several batches of it
  at once, orders them (`arrowbuf.ray.block_reads`), gathers them a group at a time into one pooled slot
  (`arrowbuf.ray.gather`) and hands them out one by one: `sample_iter` runs one loop (`BlockReader.batches`),
  and a plain ``sample`` is handed out of the loop of its request (`BlockReader.sample`). The draws are
  counted when a batch is handed out, and the counts reach the shards with the next manifest poll.
- Prioritized sampling, rate-limited stores, without-replacement epochs and ``track_reuse`` draw in the shards
  (`select`: indices only, a small call), a batch split across them by the mass they last reported; the same
  `DrawLoop` keeps ``prefetch`` such requests in flight, and orders and gathers the answers here.

Freshness: one manifest request per shard is kept in flight; a sample collects it when it has come back
(``ray.wait``, never blocking) and sends the next once ``RayOptions.seal_latency`` has passed since the last.
Rows written elsewhere are thus seen about one to two latency bounds after they reach their shard. `sync`
waits for every shard's manifest (after sealing its open episodes): the first sample, ``store.flush()`` and an
epoch start with it, and a sample after this process's own `add_episode` syncs that shard, so a process reads
its own writes. A dead shard is found by its failed manifest request.

A shard that restarts (a durable one) publishes its blocks again as new objects: blocks of its old process are
lost with it (Ray's ``OwnerDiedError``). A sample, draw or gather that meets one forgets that shard's view,
reads its manifest again (waiting for the restarted shard) and retries (`LOST_RETRIES` times); a shard that
stays down raises `ShardError` from that manifest request.

Blocks are fetched on first use (`ray.get`: zero-copy on the node, one transfer from another node) into an LRU
cache bounded by ``RayOptions.reader_cache_bytes`` (blocks of the current batch are never dropped;
`arrowbuf.ray.cache`). ``RayOptions.copy_blocks`` copies each fetched block into this process's memory, as a
block fetched from another node is: it tests that path on one node, and frees shared memory.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from arrowbuf.errors import EmptyStoreError, ShardError
from arrowbuf.ray.block_reads import MAX_READ_BATCHES, READ_BYTES, BlockReads, order_reads
from arrowbuf.ray.blocks import Manifest
from arrowbuf.ray.cache import BlockCache
from arrowbuf.freshness import FreshnessSampler
from arrowbuf.ray.fresh import fresh_draw, nothing_fresh
from arrowbuf.ray.fresh import newest as fresh_newest
from arrowbuf.ray.gather import GROUP_BYTES, BlockGather
from arrowbuf.ray.handles import ShardHandles, SizeCache
from arrowbuf.ray.options import ray_module
from arrowbuf.ray.views import ShardView, joined_view, shard_view
from arrowbuf.sample_args import PLAIN, SampleArgs
from arrowbuf.samplers import PrioritizedSampler, Sampler, Selection, select_indices
from arrowbuf.schema import Schema

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict
#: Requests of plain samples whose draws ahead a reader keeps (`BlockReader.sample`).
PLAIN_LOOPS = 4
LOST_RETRIES = 3   # fresh manifests read after meeting lost blocks, before giving up


def _locked(method: Callable) -> Callable:
    """Run ``method`` under the reader's lock: a store handle may be shared by threads
    (a trainer sampling while another thread writes)."""
    @functools.wraps(method)
    def run(self: "BlockReader", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return run


def _retry_lost(method: Callable) -> Callable:
    """Run ``method`` again after a lost block (its shard's process died): the shards whose
    blocks were lost are read again first (`BlockReader._forget_lost`)."""
    @functools.wraps(method)
    def run(self: "BlockReader", *args: Any, **kwargs: Any) -> Any:
        for attempt in range(LOST_RETRIES + 1):
            try:
                return method(self, *args, **kwargs)
            except Exception as err:   # Ray's error type looked up only then: no call per batch
                if not isinstance(err, ray_module().exceptions.ObjectLostError):
                    raise
                if attempt == LOST_RETRIES:
                    raise ShardError(f"blocks of store {self.shards.name!r} were lost again after {LOST_RETRIES} "
                                     f"fresh manifests (their shard's process keeps dying?): {err}") from None
                args, kwargs = self._forget_lost(err, method.__name__, args, kwargs)
        raise AssertionError("unreachable")
    return run


def _scaled(selection: Selection, scale: float) -> Selection:
    """A prioritized selection whose weights are multiplied by ``scale``."""
    extra = {**selection.extra, "weight": selection.extra["weight"] * scale}
    return Selection(selection.rows, selection.indices, selection.pos, extra, selection.step)


class BlockReader:
    """This process's views of a store's shards (see the module docstring).

    Args:
        shards: the store's shard handles.
        sizes: the store's size cache (manifest answers carry readings).
        sampler: the store's sampler (each view binds a copy).
        rng: the generator that draws here (the router's).
        schema: returns the store's schema (None while unknown), asked only while the
            reader knows none: the store hands it every schema it learns (`set_schema`).
    """

    def __init__(self, shards: ShardHandles, sizes: SizeCache, sampler: Sampler, rng: np.random.Generator,
                 schema: Callable[[], Schema | None]) -> None:
        self.shards = shards
        self.schema = schema
        self._schema: Schema | None = None   # the store's, as it last said (`set_schema`)
        self.sizes = sizes
        self.sampler = sampler
        self.rng = rng
        options = shards.options
        self.cache = BlockCache(options.reader_cache_bytes, options.copy_blocks)
        self.views: dict[int, ShardView] = {}
        self._chunks: dict[Any, dict] = {}     # episode chunks of listed blocks, by `BlockInfo.key`
        self._pending: dict[int, Any] = {}     # shard -> manifest request in flight
        self._sent: dict[int, float] = {}
        self._drawn = np.zeros(shards.num_shards, np.int64)   # draws not yet reported to each shard
        self._stale: set[int] = set()          # shards this process wrote to since their last sync
        self._polled = -np.inf
        self._gather: tuple[Schema, BlockGather] | None = None   # and the schema it gathers
        self._joined_view: tuple | None = None   # (the views it joins, the joined view)
        self._scratch: dict = {}   # ordered field arrays of `gather` (used under the lock)
        self._loops: dict[SampleRequest, DrawLoop] = {}   # plain samples' draws ahead, oldest request first
        # Counts changes of the views and writes of this process: batches drawn ahead
        # (`DrawLoop`) are dropped when it moved since their draw.
        self.generation = 0
        self._lock = threading.RLock()

    # -- manifests -----------------------------------------------------------------

    @_locked
    def wrote(self, shard: int) -> None:
        """This process stored episodes on ``shard``: sync it before the next sample."""
        self._stale.add(shard)
        self.generation += 1

    @_locked
    def reset(self) -> None:
        """Forget every view and block (after `clear`, at `close`)."""
        self.views.clear()
        for loop in self._loops.values():
            loop.drop_pending()
        self._loops.clear()
        self.generation += 1
        self._joined_view = None
        self._chunks.clear()
        self._pending.clear()
        self.cache.clear()

    @_locked
    def apply(self, shard: int, manifest: Manifest) -> None:
        """Take a manifest that came with an answer (the index path)."""
        self._apply({shard: (manifest, None)}, {shard: None})

    @_locked
    def check_keys(self, keys: Any) -> frozenset | None:
        """``keys`` checked against the store's fields (see `BlockGather.check_keys`)."""
        return self._gatherer().check_keys(keys)

    @_locked
    def set_schema(self, schema: Schema | None) -> None:
        """The store's schema is now ``schema`` (compute_gae adds fields; None: forgotten)."""
        self._schema = schema

    def _gatherer(self) -> BlockGather:
        schema = self._schema
        if schema is None:   # none known here yet: the store looks (a shard may have one by now)
            schema = self._schema = self.schema()
        if self._gather is None or self._gather[0] is not schema:   # compute_gae adds fields
            if schema is None:
                raise EmptyStoreError(f"cannot sample: store {self.shards.name!r} holds no episode yet")
            self._gather = (schema, BlockGather(schema))
        return self._gather[1]

    def _known(self, shard: int) -> tuple[str | None, int]:
        view = self.views.get(shard)
        return (view.manifest.token, view.manifest.version) if view is not None else (None, -1)

    def _ask(self, shard: int, seal: bool) -> Any:
        drawn, self._drawn[shard] = int(self._drawn[shard]), 0
        self._sent[shard] = time.monotonic()
        return self.shards.call(shard, "manifest", *self._known(shard), drawn, seal)

    def _poll(self) -> None:
        """Collect manifest answers that came back, ask again where due; never waits."""
        now = time.monotonic()
        latency = self.shards.options.seal_latency
        if now - self._polled < latency / 8:
            return
        self._polled = now
        for shard in self.shards.live():
            if shard not in self._pending and now - self._sent.get(shard, -np.inf) >= latency:
                self._pending[shard] = self._ask(shard, False)
        if self._pending:   # a request to an actor known dead fails at once: collected here
            ready, _ = ray_module().wait(list(self._pending.values()), num_returns=len(self._pending), timeout=0)
            ready = set(ready)
            done = {s: ref for s, ref in self._pending.items() if ref in ready}
            for shard in done:
                del self._pending[shard]
            self._apply(self.shards.get(done), done)

    @_locked
    def sync(self, shards: list[int] | None = None, seal: bool = True) -> None:
        """Ask ``shards`` (default: every live one) for their manifest and wait (they seal first)."""
        shards = self.shards.live() if shards is None else shards
        for shard in shards:
            self._pending.pop(shard, None)
            self._stale.discard(shard)
        refs = {s: self._ask(s, seal) for s in shards}
        self._apply(self.shards.get(refs), refs)

    @_locked
    def report(self) -> None:
        """Send the draws counted here to their shards now (before `stats`)."""
        if self._drawn.any():
            self.sync([s for s in self.shards.live() if self._drawn[s]], seal=False)

    def _apply(self, answers: dict[int, Any], asked: dict[int, Any]) -> None:
        for shard in asked:
            if shard not in answers:   # dead (allow_partial): its blocks are no longer served
                self.views.pop(shard, None)
                self.generation += 1
        for shard, (manifest, reading) in answers.items():
            if reading is not None:
                self.sizes.note(shard, reading)
            if manifest is not None:
                self._install(shard, manifest)
        listed = {b.key for view in self.views.values() for b in view.manifest.blocks}
        self.cache.retain(listed)
        for key in [k for k in self._chunks if k not in listed]:
            del self._chunks[key]

    def _install(self, shard: int, manifest: Manifest) -> None:
        token, version = self._known(shard)
        if manifest.token == token and manifest.version <= version:
            return   # an older answer than the view's
        blocks = manifest.blocks
        # A chunk comes inline (a lent block's one episode) or as an object of its own.
        missing = [b for b in blocks if b.key not in self._chunks]
        fetched = iter(ray_module().get([b.episodes for b in missing if not isinstance(b.episodes, dict)]))
        for block in missing:
            self._chunks[block.key] = block.episodes if isinstance(block.episodes, dict) else next(fetched)
        self.views[shard] = shard_view(shard, manifest, self._chunks, self.sampler, self.shards.num_shards)
        self.generation += 1

    def _joined(self, shards: list[int]) -> ShardView:
        """One view of the views of ``shards``: their transitions numbered one after the
        other, so one draw is a draw over all of them in proportion to their mass."""
        views = [self.views[s] for s in shards]
        if len(views) == 1:
            return views[0]
        if self._joined_view is not None and len(self._joined_view[0]) == len(views) \
                and all(a is b for a, b in zip(self._joined_view[0], views)):
            return self._joined_view[1]
        joined = joined_view(views, self.sampler)
        self._joined_view = (views, joined)
        return joined

    def _forget_lost(self, err: Exception, method: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """After ``err`` (a lost block): drop the views of the shards it names (every view
        if it names none), read their manifests again (a shard that stays down raises
        `ShardError` here), and return the call's arguments for the retry (a gather's
        parts are located again in the new views)."""
        text = str(err)
        named = {shard for shard, view in self.views.items()
                 if any(b.ref.hex() in text or (not isinstance(b.episodes, dict) and b.episodes.hex() in text)
                        for b in view.manifest.blocks)}
        shards = sorted(named or self.views)
        for shard in shards:
            self.views.pop(shard, None)
            self._pending.pop(shard, None)
        self._joined_view = None
        self.generation += 1
        listed = {b.key for view in self.views.values() for b in view.manifest.blocks}
        self.cache.retain(listed)
        for key in [k for k in self._chunks if k not in listed]:
            del self._chunks[key]
        self.sync([s for s in shards if s in self.shards.live()])
        if method != "gather":
            return args, kwargs
        parts = []
        for view, selection in args[0]:
            fresh = self.views.get(view.shard)
            part = self.select_in(fresh, selection.indices, selection.extra) if fresh is not None else None
            if part is None:
                raise ShardError(f"shard {view.shard} of store {self.shards.name!r} restarted without rows this "
                                 "batch was drawn from; draw it again") from None
            parts.append(part)
        return (parts, *args[1:]), kwargs

    # -- sampling ------------------------------------------------------------------

    @_locked
    def draws_here(self) -> bool:
        """Whether samples are drawn here (else each shard draws its indices)."""
        if not self.views:
            self.sync()
        return all(view.manifest.draws_here for view in self.views.values())

    def _views_of(self, shards: list[int]) -> list[ShardView]:
        """Current views of live ``shards``: synced first where this process wrote, or none is known."""
        self._poll()
        stale = [s for s in shards if s in self._stale or s not in self.views]
        if stale:
            self.sync(stale)
        return [self.views[s] for s in shards if s in self.views]

    def _live(self, shards: tuple[int, ...] | None) -> list[int]:
        """The live shards among ``shards`` (all live ones when None, or when none of them is)."""
        live = self.shards.live()
        return live if shards is None else [s for s in live if s in shards] or live

    @_locked
    @_retry_lost
    def sample(self, request: SampleRequest) -> TensorDict:
        """One batch of ``request``, handed out of the batches drawn ahead for the same
        request (`DrawLoop`), as `batches` hands them out.

        Manifest answers that came back are collected first, so batches drawn ahead
        of a change of the views (or of a write of this process) are dropped and drawn
        again: a sample sees what one drawn on the spot would. The loops of the last
        `PLAIN_LOOPS` requests are kept; a new request's first draw is one batch.
        """
        loop = self._loops.pop(request, None)
        if loop is None:
            loop = DrawLoop(self, request)
            if len(self._loops) >= PLAIN_LOOPS:
                self._loops.pop(next(iter(self._loops))).drop_pending()
        self._loops[request] = loop   # the most recent last
        if not loop.by_shards:   # the shards' answers carry the manifests their draws need
            self._poll()
        return loop.next()

    def batches(self, request: SampleRequest) -> Iterator[TensorDict]:
        """Endless batches of ``request`` (a store's `sample_iter`), drawn and ordered
        ``request.batches`` at a time (`DrawLoop`)."""
        loop = DrawLoop(self, request)
        try:
            while True:
                yield self._next_of(loop)
        finally:
            loop.drop_pending()

    @_locked
    @_retry_lost
    def _next_of(self, loop: DrawLoop) -> TensorDict:
        """The next batch of ``loop`` (drawn again after a lost block: `_retry_lost`)."""
        return loop.next()

    def _draw(self, batch_size: int, batches: int, args: SampleArgs, shards: list[int], scratch: dict,
              min_version: int | None = None) -> BlockReads:
        """``batches`` batches of ``batch_size`` items drawn at once over ``shards`` in
        proportion to their mass (each batch an independent draw), ordered with ``scratch``;
        of steps of version >= ``min_version`` only, when given, and weighted by freshness
        for a `FreshnessSampler` (`arrowbuf.ray.fresh`: when none may be drawn, the shards
        are synced once before `EmptyStoreError`; every shard for a `FreshnessSampler`)."""
        weighted = isinstance(self.sampler, FreshnessSampler)
        # Lags count from the newest version of every shard, not only of these: their views first.
        newest = fresh_newest(self._views_of(self.shards.live())) if weighted else None
        views = self._views_of(shards)
        if sum(v.mass for v in views) <= 0:   # nothing sealed yet may only mean: not sealed yet
            self.sync(shards)
            views = [self.views[s] for s in shards if s in self.views]
            if sum(v.mass for v in views) <= 0:
                raise EmptyStoreError(f"cannot sample: the {len(shards)} shards of {self.shards.name!r} hold "
                                      "0 transitions")
        view = self._joined([v.shard for v in views if v.mass > 0])
        count = batch_size * batches
        if min_version is None and not weighted:
            selection = view.sampler.sample(self.rng, count, view.table)
        else:
            selection = fresh_draw(self.rng, count, view, min_version, self.cache, newest)
            if selection is None:   # fresher steps may be stored and not yet seen: look once
                self.sync(None if weighted else shards)
                views = [self.views[s] for s in shards if s in self.views and self.views[s].mass > 0]
                view = self._joined([v.shard for v in views]) if views else None
                newest = fresh_newest(list(self.views.values()) if weighted else views)
                selection = None if view is None else fresh_draw(self.rng, count, view, min_version, self.cache,
                                                                 newest)
                if selection is None:
                    raise nothing_fresh(self.sampler, min_version, newest)
        shards_count = len(self._drawn)
        if view.shards is None:
            drawn = np.zeros((batches, shards_count), np.int64)
            drawn[:, view.shard] = batch_size
        else:   # each batch's items of each shard
            pos = selection.pos if selection.pos.ndim == 1 else selection.pos[:, 0]
            cells = view.shards.take(pos)
            if batches > 1:
                cells += np.arange(count) // batch_size * shards_count
            drawn = np.bincount(cells, minlength=batches * shards_count).reshape(batches, shards_count)
        return order_reads([(view, selection)], self.cache, args, None, scratch, drawn)

    def _drawn_by_shards(self, request: SampleRequest, pending: deque, scratch: dict) -> BlockReads:
        """One batch of ``request`` drawn by the shards, ordered with ``scratch``: the oldest of
        the index requests in flight in ``pending``, which keeps ``request.prefetch`` more."""
        pending.extend(self._ask_shards(request, request.prefetch + 1 - len(pending)))
        parts, _ = self._collect(pending.popleft(), request)
        ordered = order_reads(parts, self.cache, request.args, self._mixed(parts), scratch,
                              weights_over_max=isinstance(self.sampler, PrioritizedSampler))
        return ordered

    def _ask_shards(self, request: SampleRequest, count: int, batch_size: int | None = None) -> list[tuple]:
        """``count`` requests of ``batch_size`` items (default: the request's), each split across the live
        shards (of ``request.shards``) by the mass they last reported, sent: (refs, population, items) of each."""
        live = self.shards.live()
        if (self.sizes.masses[live] <= 0).any():
            # A shard seen empty gets no draws, hence no answers that would update its
            # size: ask again, so a shard that filled since is not skipped forever.
            self.sizes.refresh()
            live = self.shards.live()
        if request.shards is not None:
            live = [s for s in live if s in request.shards] or live
        masses = self.sizes.masses[live]
        if masses.sum() <= 0:
            raise EmptyStoreError(f"cannot sample: the {self.shards.num_shards} shards of {self.shards.name!r} hold "
                                  "0 transitions")
        population = None
        if isinstance(self.sampler, PrioritizedSampler):   # of these shards, for the weights (w = (N p / M)^-beta)
            population = (int(self.sizes.transitions[live].sum()), float(masses.sum()))
        items = request.batch_size if batch_size is None else batch_size
        splits = [self.rng.multinomial(items, masses / masses.sum()).tolist() for _ in range(count)]
        calls = [{shard: (int(n), request.args, population, request.timeout, *self._known(shard))
                  for shard, n in zip(live, split) if n} for split in splits]
        return [(refs, population, items) for refs in self.shards.call_each("select", calls)]

    def _collect(self, asked: tuple, request: SampleRequest) -> tuple[list, tuple | None]:
        """The parts (view, selection) of the answers to ``asked`` and its population.

        Items of a shard that died answering (allow_partial), or whose rows this reader
        cannot find any more (evicted meanwhile), are drawn again from the survivors;
        prioritized weights of the first answers are rescaled to the redraw's population.
        """
        refs, population, items = asked
        answers = self.shards.get(refs)
        self.sizes.note_all({shard: answer[3] for shard, answer in answers.items()})
        parts = []
        for shard in refs:
            if shard not in answers:
                continue
            indices, extra, manifest, _ = answers[shard]
            if manifest is not None:
                self.apply(shard, manifest)
            part = self.select(shard, indices, extra)
            if part is not None:
                parts.append(part)
        missing = items - sum(len(selection.rows) for _, selection in parts)
        if missing:
            if not self.shards.live():
                raise ShardError(f"no shard of {self.shards.name!r} is alive")
            more, population_new = self._collect(self._ask_shards(request, 1, missing)[0], request)
            if population is not None and population_new is not None:
                (n_old, m_old), (n_new, m_new) = population, population_new
                scale = ((n_old / m_old) / (n_new / m_new)) ** self.sampler.beta
                parts = [(view, _scaled(selection, scale)) for view, selection in parts]
            parts += more
        return parts, population

    def _mixed(self, parts: list) -> list[np.ndarray] | None:
        """Batch positions that shuffle the parts several shards drew (None for one part):
        any slice of the batch is then a sample of every shard, as a local batch is."""
        if len(parts) < 2:
            return None
        sizes = [len(selection.rows) for _, selection in parts]
        return np.split(self.rng.permutation(sum(sizes)), np.cumsum(sizes)[:-1])

    @_locked
    def select(self, shard: int, indices: np.ndarray, extra: dict) -> tuple[ShardView, Selection] | None:
        """The selection of ``shard``'s indices (drawn by the shard), or None if this view lacks one."""
        view = self.views.get(shard)
        return self.select_in(view, indices, extra) if view is not None else None

    @staticmethod
    def select_in(view: ShardView, indices: np.ndarray, extra: dict) -> tuple[ShardView, Selection] | None:
        """The selection of indices in ``view``, or None if it lacks one of them."""
        if not view.table.is_live(indices).all() or not (len(indices) or len(view.table)):   # an empty table: none live
            return None
        return view, select_indices(view.table, indices, extra)   # steps within the episode, as a shard's

    @_locked
    @_retry_lost
    def gather(self, parts: list[tuple[ShardView, Selection]], args: SampleArgs, keys: Any,
               device: torch.device | None, places: list[np.ndarray] | None = None) -> TensorDict:
        """One batch of every part's items (gathered block by block: `arrowbuf.ray.gather`).

        A part's items keep the order they were drawn in; ``places`` puts the items of
        each part at those batch positions (an epoch's chunk order, or a shuffle of the
        parts drawn by several shards); without it the parts follow each other.
        """
        gather = self._gatherer()
        keys = gather.check_keys(keys)
        ordered = order_reads(parts, self.cache, args, places, self._scratch)
        return gather(ordered, 0, ordered.size, keys, device)

    @_locked   # `poll` and `_install` change the views
    def stats(self) -> dict:
        cache = self.cache
        return {"cached_blocks": len(cache.entries), "cached_bytes": cache.nbytes, "cache_limit": cache.limit,
                "fetches": cache.fetches, "copy_blocks": cache.copy,
                "blocks": sum(len(v.manifest.blocks) for v in self.views.values())}


@dataclass(frozen=True)
class SampleRequest:
    """What a store asks its reader for: batches of ``batch_size`` items with ``args``'s
    look-ups, fields ``keys`` (checked; None: all), on ``device``, drawn over ``shards``
    (None: every live one), ``batches`` batches drawn and ordered at once (None: as many
    as `READ_BYTES` hold, at most `MAX_READ_BATCHES`), of steps of ``policy_version >=
    min_version`` only when given (`arrowbuf.ray.fresh`). Where the shards draw, ``prefetch``
    index requests stay in flight, and a draw waits at most ``timeout`` for a rate limiter."""

    batch_size: int
    args: SampleArgs = PLAIN
    keys: frozenset | None = None
    device: torch.device | None = None
    shards: tuple[int, ...] | None = None
    batches: int | None = None
    min_version: int | None = None
    prefetch: int = 0
    timeout: float | None = None


class DrawLoop:
    """The draw-order-gather loop of one request: batches drawn and ordered together,
    gathered ``group`` at a time into one pooled slot (`BlockGather.batches`), handed
    out one by one; drawn again once the reader's views change (or this process
    writes). A batch counts as the shards' samples when it is handed out, not when it
    is drawn. Where the shards draw (`by_shards`), each batch is one index request
    answered by them, ``request.prefetch`` more kept in flight, ordered and gathered
    alike (the shards count it when they draw). Called under the reader's lock.
    """

    def __init__(self, reader: BlockReader, request: SampleRequest) -> None:
        self.reader = reader
        self.request = request
        self.batches = request.batches   # per draw; found from the first draw's sizes when None
        self.group = 1                   # batches gathered together (`GROUP_BYTES`)
        self.scratch: dict = {}          # this loop's ordered field arrays, reused draw after draw
        self.ordered: BlockReads | None = None
        self.generation = -1             # the reader's, at the draw of `ordered`
        self.step = 0                    # batches in `ordered`
        self.next_batch = 0              # the next of them to hand out
        self.ready: deque = deque()      # gathered, not yet handed out
        self.by_shards = not reader.draws_here()
        self.pending: deque = deque()    # index requests to the shards in flight (`by_shards`)
        if self.by_shards:
            self.batches = 1

    def drop_pending(self) -> None:
        """Take the answers of the index requests in flight (the loop is dropped): errors are taken, not left to Ray."""
        while self.pending:
            try:
                self.reader.shards.get(self.pending.popleft()[0])
            except Exception:   # noqa: BLE001 - nobody waits for these draws any more
                pass

    def next(self) -> TensorDict:
        reader, request, size = self.reader, self.request, self.request.batch_size
        while True:
            current = self.ordered is not None and reader.generation == self.generation
            if current and self.ready:
                batch = self.ready.popleft()
                if self.ordered.drawn is not None:
                    reader._drawn += self.ordered.drawn[self.next_batch]
                self.next_batch += 1
                return batch
            if current and self.next_batch < self.step:
                stop = min(self.next_batch + self.group, self.step)
                self.ready.extend(reader._gatherer().batches(self.ordered, self.next_batch * size, stop * size, size,
                                                             request.keys, request.device))
                continue
            self.ready.clear()
            step = self.batches or 1   # the first draw of an unknown size is one batch
            self.ordered = None
            if self.by_shards:
                ordered = reader._drawn_by_shards(request, self.pending, self.scratch)
            else:
                ordered = reader._draw(size, step, request.args, reader._live(request.shards), self.scratch,
                                      request.min_version)
            self.ordered, self.generation, self.step, self.next_batch = ordered, reader.generation, step, 0
            if self.batches is None:   # how many fit in READ_BYTES, and in GROUP_BYTES together
                ordered_bytes, out_bytes = reader._gatherer().sizes(ordered, size)
                self.batches = max(1, min(MAX_READ_BATCHES, READ_BYTES // max(ordered_bytes, 1)))
                self.group = max(1, min(self.batches, GROUP_BYTES // max(out_bytes, 1)))
