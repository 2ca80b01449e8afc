"""`RaySink`: a writer's route to the shards of a Ray store.

A sink routes each sealed episode to a shard (an env sticks to the first shard
it was sent to: on the writer's node when there is one, else the least
loaded), batches small episodes into one request per shard, and keeps at most
``RayOptions.max_in_flight`` requests unanswered per shard.

Delivery: a timer thread per sink (started at its first episode, stopped by
`close`, and gone with the sink) sends episodes that have waited
``RayOptions.delivery_latency`` and collects the answers, so finished episodes
reach their shard without `flush`, and a dead shard is known within about that
latency. Errors are never dropped: one that the timer meets (a refused episode,
a dead shard) is raised by the writer's next call on the sink (`write`,
`commit`, `flush`, `close`). A `ShardError` names how many of the writer's
episodes were lost, and how many still wait.

A sink pickles into Ray tasks and actors; the copy starts with nothing queued
or in flight: the errors of this process's requests surface here.

A closed sink (its writer's `close`) refuses every later write (`check_open`). A
writer dropped without `flush` or `close` cuts its open episodes into its sink,
which delivers them on a thread of its own (`dropped`): a finalizer never waits
for a shard. What that delivery fails to store is logged as an error, and raised
by the next `flush`, `save` or `close` of the store that made the writer
(`arrowbuf.ray.dropped.DroppedWriters`).

In the process that started the shards, an episode of an eighth of a block or
more is put once and lent to its shard, which seals that object as its block
(`_outgoing`, `arrowbuf.ray.blocks`); elsewhere episodes travel as arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Any

import numpy as np

from arrowbuf.errors import ArrowbufError, CapacityError, ShardError
from arrowbuf.ray.apart import refuse_durable_apart
from arrowbuf.ray.blocks import block_columns
from arrowbuf.ray.bundles import bundled
from arrowbuf.ray.dropped import DroppedWriters, ship_at_exit
from arrowbuf.ray.handles import ShardHandles, SizeCache
from arrowbuf.ray.options import ray_module
from arrowbuf.ray.shares import unfit
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode

logger = logging.getLogger(__name__)


def _owned(episode: Episode) -> Episode:
    """An episode that owns its columns (a writer reuses its staging rows for the next episode)."""
    if episode.owned:
        return episode
    return dataclasses.replace(episode, columns={n: a.copy() for n, a in episode.columns.items()}, owned=True)


def _nbytes(episode: Episode) -> int:
    return sum(column.nbytes for column in episode.columns.values())


def _deliver(sink_ref: weakref.ref, stop: threading.Event, period: float) -> None:
    """The timer thread: every ``period`` seconds, send what is due and collect answers."""
    while not stop.wait(period):
        sink = sink_ref()
        if sink is None:
            return
        sink.tick()
        del sink   # hold the sink only while ticking: it may be garbage collected


class RaySink:
    """Sends a writer's sealed episodes to the shards (see the module docstring).

    Args:
        shards: the store's shard handles.
        sizes: the store's size cache (acknowledgements update it).
        schema: the store's schema, if known.
        timeout: seconds a shard waits for its rate limiter to take an episode.
        capacity: rows of the smallest shard: the longest episode any shard takes
            (a writer refuses an episode at the step it outgrows it).
        dropped: where the delivery of a dropped writer's sink reports (its router's).
        balance_keys: route each new key to a shard with the fewest keys of this sink (then
            the least loaded): a step writer's envs split evenly over the shards, so that a
            store of ``num_envs x T`` holds a rollout (each env writes T transitions).
    """

    def __init__(self, shards: ShardHandles, sizes: SizeCache, schema: Schema | None,
                 timeout: float | None = None, capacity: int | None = None,
                 dropped: DroppedWriters | None = None, balance_keys: bool = False) -> None:
        self.capacity = capacity
        self.balance_keys = balance_keys   # a step writer's sink: its envs spread evenly (`_route`)
        self.closed = False   # by `close`: its writer was closed, and later writes are refused
        self._shards = shards
        self._sizes = sizes
        self._loads = sizes.transitions.astype(np.float64)   # rows routed to each shard, for routing
        self._schema = schema
        self.timeout = timeout   # of each write (`retime`: a claimed restored writer's own)
        self._routes: dict[str, int] = {}
        self._node: str | None = None
        self._start_local()
        self._dropped = dropped
        self._new_writer()

    def retime(self, timeout: float | None) -> None:
        """Each later write waits at most ``timeout`` (a claimed restored writer's)."""
        self.timeout = timeout

    def _start_local(self) -> None:
        """State that stays in this process (not pickled)."""
        self._batches: dict[int, list[Episode]] = {}
        self._waiting_bytes = 0
        self._oldest: float | None = None                 # when the oldest waiting episode was queued
        self._in_flight: dict[int, deque] = {}            # shard -> (ref, episodes) oldest first
        self._error: BaseException | None = None          # met by the timer, raised by the next call
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._lends: bool | None = None   # this process started the shards (`_outgoing`): asked once
        self._open: weakref.ref | None = None             # its writer's `PieceCutter`: the timer ships open steps
        self._closes: dict[int, list[str]] = {}           # shard -> envs whose open pieces' episode ended
        self._dropped: DroppedWriters | None = None       # its router's: set in the process that made it
        ship_at_exit(self)

    def __getstate__(self) -> dict:
        local = ("_batches", "_waiting_bytes", "_oldest", "_in_flight", "_error", "_lock", "_stop", "_timer",
                 "_lends", "_open", "_closes", "_dropped")
        return {k: v for k, v in self.__dict__.items() if k not in local}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._loads = self._loads.copy()   # read-only when it came through the object store
        self._start_local()
        self._new_writer()   # each unpickled copy writes on its own

    def _new_writer(self) -> None:
        """A fresh writer id and batch count: (id, number) names each write for durable shards;
        and a fresh owner of the open pieces it ships (`open_state`)."""
        self._writer, self._batch_number = uuid.uuid4().hex, 0
        self._owner = self._writer

    def open_state(self) -> dict[str, Any]:
        """What a writer's state keeps of its sink: the owner its shards note its open pieces
        under (`arrowbuf.ray.tails`, by owner and env), and the shard of each env, where
        those pieces are."""
        with self._lock:
            return {"owner": self._owner, "routes": {key: int(shard) for key, shard in self._routes.items()}}

    def load_open_state(self, state: dict[str, Any]) -> None:
        """Continue the open episodes of the writer whose `open_state` this is: its pieces,
        on the same shards, under the same owner, so that the episode's last piece (or a
        close) ends them. Only the owner is taken over, not the writer id that names
        write requests: a durable shard must not take this sink's writes for the earlier
        writer's retries."""
        with self._lock:
            self._owner = state["owner"]
            for key, shard in state["routes"].items():
                if int(shard) < self._shards.num_shards:   # a checkpoint may load over fewer shards
                    self._routes[key] = int(shard)

    # -- the EpisodeSink protocol (arrowbuf.backend) ------------------------------------

    @property
    def schema(self) -> Schema | None:
        return self._schema

    def set_schema(self, schema: Schema) -> None:
        if self._shards.durable:
            refuse_durable_apart(schema)
        if self._schema is None:
            self._schema = schema

    def forget_schema(self) -> None:
        """Drop the schema (after the first write was refused everywhere)."""
        self._schema = None

    @property
    def store_name(self) -> str:
        return self._shards.name

    def check_open(self) -> None:
        """Raises `ArrowbufError` when the sink is closed: its writer's ``close`` ended it."""
        if self.closed:
            raise ArrowbufError(f"this writer of store {self._shards.name!r} was closed (close(), or the end of its "
                                "with block): it stores nothing more; open a new one with store.writer(...)")

    def write(self, episode: Episode, route_key: str | None = None) -> None:
        """Queue an episode for the shard of ``route_key`` (default: its env_id).

        Its errors (earlier ones included) are raised by `commit` and `flush`: a
        writer seals several episodes per call, and each must be queued. Only a
        closed sink refuses at once (`check_open`).
        """
        self.check_open()
        with self._lock:
            shard = self._route(episode.env_id if route_key is None else route_key)
            size = _nbytes(episode)
            if size < self._shards.options.write_batch_bytes:
                episode = _owned(episode)   # it waits for its batch: it must own its data
                self._waiting_bytes += size
            self._batches.setdefault(shard, []).append(episode)
            self._loads[shard] += episode.num_rows
            if self._oldest is None:
                self._oldest = time.monotonic()
            self._start_timer()

    def attach_open(self, shipping: Any) -> None:
        """Ship a writer's completed open steps as pieces on the delivery timer, through its
        ``shipping`` (an `arrowbuf.piece_cutting.PieceCutter`, held weakly: its writer owns it)."""
        self._open = weakref.ref(shipping)

    def wake(self) -> None:
        """Start the delivery timer if it is not running (a writer staged open steps)."""
        with self._lock:
            self._start_timer()

    def close_open(self, env_ids: list[str]) -> None:
        """The episodes of ``env_ids`` ended with their last shipped piece: tell their shards
        with the next request (`arrowbuf.ray.tails`)."""
        with self._lock:
            for env_id in env_ids:
                self._closes.setdefault(self._route(env_id), []).append(env_id)

    def commit(self) -> None:
        """End of a writer call: send what is ready (big episodes, or enough small ones)."""
        with self._lock:
            self._raise_pending()
            if self._batches:   # else the timer collects the answers (a writer commits at every step)
                self._reap(block=False)
                self._send(self._waiting_bytes >= self._shards.options.write_batch_bytes, wait=True)

    def flush(self) -> None:
        """Send everything, wait until the shards stored it, raise the first error
        (an error the timer met before is raised after the sending, with any new one
        as its context)."""
        with self._lock:
            earlier, self._error = self._error, None
            try:
                self._send(True, wait=True)
                self._reap(block=True)
            finally:
                if earlier is not None:
                    raise earlier

    def close(self) -> None:
        """`flush`, then stop the timer thread; later writes are refused (`check_open`)."""
        try:
            self.flush()
        finally:
            self.closed = True
            self._stop_timer()

    def ship_open(self) -> None:
        """Send its writer's staged steps as pieces now (as the timer would), and everything
        queued; wait until the shards stored them (a checkpoint is taken next)."""
        shipping = self._open() if self._open is not None else None
        if shipping is not None:
            shipping.ship_all()
        self.flush()

    def ship_if_open(self) -> None:
        """At this process's exit (`arrowbuf.ray.dropped.ship_at_exit`): `ship_open`, unless its
        writer or store was closed; a failure, or an error its timer met before, is logged (an
        exit hook cannot raise)."""
        if self.closed or self._shards.closed:
            return
        try:
            self.ship_open()
        except Exception as err:
            logger.error("an arrowbuf writer of store %r was still open when this process exited, and storing "
                         "its %d staged or queued episodes failed: %s", self.store_name, self.queued, err)

    def dropped(self) -> None:
        """Its writer was dropped without `flush` or `close` (and cut its open episodes into
        this sink): deliver what is queued on a thread of its own (`DroppedWriters`), since a
        finalizer must not wait for shards. Nothing to do for a closed store."""
        if self.closed or self._shards.closed or not (self._batches or self._closes or self.unacknowledged):
            return
        if self._dropped is not None:
            self._dropped.start(self)
            return
        DroppedWriters().start(self)   # a copy in another process: logged only

    def write_now(self, episode: Episode, route_key: str, timeout: float | None) -> int:
        """Send one episode alone and wait for its shard's answer: its id (`add_episode`).

        ``timeout``: seconds the shard waits for its rate limiter to take it.
        """
        with self._lock:
            self._raise_pending()
            shard = self._route(route_key)
            sent, lent = self._outgoing([episode])
            ref = self._shards.call(shard, "add_episodes", sent, self._schema.to_json(), timeout, self._next_batch(),
                                    lent)
            self._loads[shard] += episode.num_rows
            result = self._shards.get({shard: ref})
            if shard not in result:
                raise ShardError(f"shard {shard} of store {self._shards.name!r} died before storing the episode; "
                                 "it is lost")
            ids, reading = result[shard]
            self._acknowledged(shard, reading)
            if not ids:
                raise ShardError(f"shard {shard} of store {self._shards.name!r} restarted and had stored this "
                                 "episode before it did, but no longer knows its id")
            return ids[0]

    def write_many_now(self, episodes: list[Episode], route_keys: list[str], timeout: float | None,
                       shard: int | None = None, capacities: np.ndarray | None = None) -> list[int]:
        """Send episodes at once, one request per shard (``shard``, or each key's route), and wait
        for the answers: their ids, in order (`add_episodes`). ``capacities``: each shard's
        capacity where the caller knows it (its share, `arrowbuf.ray.shares`), checked first.

        Raises:
            CapacityError: an episode longer than its shard's capacity in ``capacities``
                (nothing sent).
            ShardError: a shard died before answering (its episodes are lost).
            The first refusal of a shard (the others' episodes are stored).
        """
        with self._lock:
            self._raise_pending()
            schema_json = self._schema.to_json()
            groups: dict[int, list[int]] = {}
            for k, key in enumerate(route_keys):
                # Counted as routed: a new key after it sees this call's earlier episodes (the
                # first call of E new envs spreads them, as E `write_now` calls would).
                s = shard if shard is not None else self._route(key)
                self._loads[s] += episodes[k].num_rows
                groups.setdefault(s, []).append(k)
            if capacities is not None:
                self._check_fit(episodes, groups, capacities)
            # One put for the lent episodes of every shard: a put costs per object as well as per byte.
            sent, lent = self._outgoing(episodes)
            refs = {}
            for s, members in groups.items():
                lent_here = [lent[k] for k in members] if lent is not None else []
                here = [sent[k] for k in members]
                refs[s] = self._shards.call(s, "add_episodes", here if any(lent_here) else bundled(here), schema_json,
                                            timeout, self._next_batch(), lent_here if any(lent_here) else None)
            results = self._shards.get(refs)
            ids = [0] * len(episodes)
            for s, members in groups.items():
                if s not in results:
                    raise ShardError(f"shard {s} of store {self._shards.name!r} died before storing "
                                     f"{len(members)} episodes; they are lost")
                stored, reading = results[s]
                self._acknowledged(s, reading)
                if len(stored) != len(members):
                    raise ShardError(f"shard {s} of store {self._shards.name!r} restarted and had stored "
                                     f"{len(members)} episodes before it did, but no longer knows their ids")
                for k, episode_id in zip(members, stored):
                    ids[k] = episode_id
            return ids

    def _check_fit(self, episodes: list[Episode], groups: dict[int, list[int]], capacities: np.ndarray) -> None:
        """Raise CapacityError, the loads of ``groups`` taken back, where an episode does not fit
        its shard's share (`arrowbuf.ray.shares.unfit`): no shard stores any (one that refused
        would leave the others' stored)."""
        reason = unfit(episodes, groups, capacities, self._schema)
        if reason is not None:
            for t, routed in groups.items():
                self._loads[t] -= sum(episodes[k].num_rows for k in routed)
            raise CapacityError(f"{reason}; nothing was stored: route it to another shard (pin_env), raise the "
                                "capacity or cut the episode")

    def pin(self, key: str, shard: int) -> None:
        """Route ``key``'s episodes to ``shard`` unless it already has a route."""
        with self._lock:
            self._routes.setdefault(key, shard)

    def reset_loads(self) -> None:
        """Route by the shards' last reported sizes again (after a clear)."""
        with self._lock:
            self._loads = self._sizes.transitions.astype(np.float64)

    @property
    def queued(self) -> int:
        """Episodes not yet sent."""
        return sum(len(episodes) for episodes in self._batches.values())

    @property
    def unacknowledged(self) -> int:
        """Episodes sent whose shard has not answered yet."""
        return sum(count for queue in self._in_flight.values() for _, count in queue)

    # -- delivery ----------------------------------------------------------------------

    def tick(self) -> None:
        """The timer's work: ship the writer's open steps and send episodes that waited
        ``delivery_latency``, collect answers."""
        latency = self._shards.options.delivery_latency
        shipping = self._open() if self._open is not None and self._error is None else None
        shipped = 0
        if shipping is not None:   # the writer's lock, then this sink's (the order of its `add`)
            try:
                shipped = shipping.cut_due(latency)
            except Exception as err:   # kept for the writer's next call, never dropped
                with self._lock:
                    self._error = err
                return
        with self._lock:
            if self._error is not None:
                return
            try:
                self._reap(block=False)
                due = self._oldest is not None and time.monotonic() - self._oldest >= latency
                if due or shipped:
                    self._send(True, wait=False)
            except Exception as err:   # kept for the writer's next call, never dropped
                self._error = err

    def _start_timer(self) -> None:
        if self._timer is None or not self._timer.is_alive():
            self._stop = threading.Event()
            self._timer = threading.Thread(target=_deliver, name="arrowbuf-sink",
                                           args=(weakref.ref(self), self._stop,
                                                 self._shards.options.delivery_latency / 2), daemon=True)
            self._timer.start()

    def _stop_timer(self) -> None:
        self._stop.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join()
        self._timer = None

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- routing, sending, answers ---------------------------------------------------------

    def _route(self, key: str) -> int:
        """The shard of ``key``; it may be a dead one (then sending raises, naming the episodes)."""
        shards = self._shards
        shard = self._routes.get(key)
        if shard is None or (shard in shards.dead and shards.options.allow_partial):   # a dead shard's envs move
            candidates = [s for s in range(shards.num_shards) if s not in shards.dead] or list(range(shards.num_shards))
            if shards.options.node_affinity:
                if self._node is None:
                    self._node = ray_module().get_runtime_context().get_node_id()
                local = [s for s in candidates if shards.nodes[s] == self._node]
                candidates = local or candidates
            keys = np.bincount(np.fromiter(self._routes.values(), np.int64, len(self._routes)),
                               minlength=shards.num_shards) if self.balance_keys else np.zeros(shards.num_shards)
            shard = min(candidates, key=lambda s: (keys[s], self._loads[s], s))
            self._routes[key] = shard
        return shard

    def _send(self, everything: bool, wait: bool) -> None:
        """Send the waiting batches (all of them, or only the big episodes).

        With ``wait`` a shard with ``max_in_flight`` unanswered requests is waited
        for; without, its batch stays for the next call. A shard found dead keeps
        its batch (rerouted with ``allow_partial``) and raises `ShardError` with
        the number of this writer's episodes that are not stored.
        """
        options = self._shards.options
        schema_json = self._schema.to_json() if self._schema is not None else None
        for shard in list({**self._batches, **self._closes}):
            episodes = self._batches.get(shard, [])
            ready = episodes if everything else [e for e in episodes if not e.owned]
            if not ready and not (everything and shard in self._closes):
                continue
            queue = self._in_flight.setdefault(shard, deque())
            while len(queue) >= options.max_in_flight:
                if not wait:
                    break
                self._settle(shard, *queue.popleft())   # raises an earlier write's error
            if len(queue) >= options.max_in_flight:
                continue
            if shard in self._shards.dead:
                self._requeue_dead(shard)
                continue
            sent, lent = self._outgoing(ready)
            closes = self._closes.pop(shard, None) if everything else None
            ref = self._shards.call(shard, "add_episodes", sent if lent is not None else bundled(sent), schema_json,
                                    self.timeout, self._next_batch(), lent, closes, self._owner)
            queue.append((ref, len(ready)))
            kept = [] if everything else [e for e in episodes if e.owned]
            if kept:
                self._batches[shard] = kept
            else:
                self._batches.pop(shard, None)
            self._waiting_bytes -= sum(_nbytes(e) for e in ready if e.owned)
        if not self._batches:
            self._oldest, self._waiting_bytes = None, 0

    def _next_batch(self) -> tuple[str, int]:
        """(writer, number) naming a new write request: a durable shard stores a retry of it once."""
        self._batch_number += 1
        return self._writer, self._batch_number

    def _outgoing(self, episodes: list[Episode]) -> tuple[list[Episode], list | None]:
        """What a write request carries: the episodes, and per episode None or (ObjectRef,
        part) of its rows, put here in a block's layout (`arrowbuf.ray.blocks.block_columns`),
        the episode then sent without its columns; the shard reads the rows from that object
        and seals them as the episode's block, without copying them (None: no episode lent).
        The lent episodes of one call are put as one object, a list of their rows (part:
        the index in it), when there are several (`write_many_now` calls it once for the
        requests to every shard): a put costs per object as well as per byte (4 W2 episodes,
        10.6 MB each: one put of the 4 took 0.67-0.77x the time of 4 puts, 2 shared cores;
        8 W2 episodes for 2 shards: one put 9.2 ms, two puts of 4 11.4 ms), and the object is
        freed once none of their blocks is left, on any shard.

        An episode is lent when it fills at least an eighth of a block (smaller ones are
        merged into blocks by their shard) and this process started the shard actors:
        Ray frees an object when its owner dies, and shard actors die with the process
        that started them, so its objects outlive the blocks made of them. Writers in
        other processes send their rows as call arguments, and their shard copies them.
        """
        if self._lends is None:
            self._lends = self._shards.started_here()
        threshold = self._shards.options.block_bytes // 8
        large = [_nbytes(e) >= threshold for e in episodes]
        if not self._lends or self._schema is None or not any(large):
            return episodes, None
        sent, rows = [], []
        for episode, lends in zip(episodes, large):
            columns = block_columns(episode, self._schema) if lends else None
            rows.append(columns)
            sent.append(episode if columns is None else dataclasses.replace(episode, columns={}, owned=True))
        lent_rows = [columns for columns in rows if columns is not None]
        if not lent_rows:
            return episodes, None
        # The one copy of their rows on their way to the shard.
        if len(lent_rows) == 1:
            ref, parts = ray_module().put(lent_rows[0]), iter([None])
        else:
            ref, parts = ray_module().put(lent_rows), iter(range(len(lent_rows)))
        return sent, [None if columns is None else (ref, next(parts)) for columns in rows]

    def _requeue_dead(self, shard: int) -> None:
        """Episodes queued for a dead shard: rerouted (``allow_partial``), else an error naming them."""
        if not self._shards.options.allow_partial or len(self._shards.dead) == self._shards.num_shards:
            raise ShardError(f"shard {shard} of store {self._shards.name!r} is dead: {self.queued} episodes of "
                             "this writer are queued and not stored (RayOptions(allow_partial=True) sends "
                             "them to the other shards)")
        self._closes.pop(shard, None)   # its open pieces are lost with it
        for episode in self._batches.pop(shard, []):
            self._batches.setdefault(self._route(episode.env_id), []).append(episode)

    def _reap(self, block: bool) -> None:
        ray = ray_module()
        for shard, queue in self._in_flight.items():
            while queue:
                if not block and not ray.wait([queue[0][0]], timeout=0)[0]:
                    break
                self._settle(shard, *queue.popleft())

    def _settle(self, shard: int, ref: Any, count: int) -> None:
        try:
            result = self._shards.get({shard: ref})
        except ShardError:
            raise self._lost(shard, count) from None
        if shard not in result:   # dead, and allow_partial: the write is lost, and that is an error
            raise self._lost(shard, count)
        _, reading = result[shard]
        self._acknowledged(shard, reading)

    def _lost(self, shard: int, count: int) -> ShardError:
        others = sum(c for queue in self._in_flight.values() for _, c in queue)
        return ShardError(f"shard {shard} of store {self._shards.name!r} died before storing a write of this "
                          f"writer: {count} episodes are lost; {others} more are unacknowledged and "
                          f"{self.queued} queued (later episodes of its envs go to the other shards with "
                          "RayOptions(allow_partial=True))")

    def _acknowledged(self, shard: int, reading: tuple) -> None:
        self._sizes.note(shard, reading)
        self._loads[shard] = max(self._loads[shard], reading[1])

    def __del__(self) -> None:
        try:
            if not (self._batches or any(self._in_flight.values())):
                self._stop.set()
                return
        except AttributeError:   # a partly built sink
            return
        queued, sent = self.queued, self.unacknowledged
        try:
            self.close()
        except Exception as err:   # nothing can raise here: say what became of the episodes
            logger.error("an arrowbuf writer of store %r went away with %d queued and %d unacknowledged episodes, "
                         "and storing them failed: %s", self._shards.name, queued, sent, err)
