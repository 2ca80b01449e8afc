"""Each shard's share of a Ray store's capacity follows the writers' envs routed to it.

A store of ``capacity`` transitions holds them over its shards, and a writer's env
sends all its steps to one shard (an episode lives on one shard). With the capacity
split evenly, a store of ``num_envs x T`` could not hold a rollout whenever
``num_envs`` is not a multiple of ``num_shards``: 3 envs on 2 shards send 2T steps
to one shard of 1.5T. So the shares follow the envs:

- **routes**: the writers made in the process that started the shards route their
  envs here when the writer is made (so a copy pickled into a task carries them), by
  key (env id, k), k the first that no open writer uses. A key keeps the shard it was
  first routed to, across writers and ``clear()``: the next rollout's writer, whose
  envs have the same ids (``env-0`` .. by default), sends each env to the shard that
  held its share; writers open at once with the same ids are different envs and
  spread. A new key goes to the shard with the fewest keys, then the least loaded.
- **shares**: the store's capacity split in proportion to the envs of the open
  writers routed to each shard (`apportion`: largest remainders, summing to the
  capacity exactly), sent to the shards when a writer is made or garbage collected
  (a writer closed before counts no more).
  A shard whose share shrinks evicts its oldest episodes at once (the shrinking
  shards are sent theirs first), so the shards never hold more than the store's
  capacity together. The shares stay as they are while the open writers' envs do
  not reach every shard: when no writer is open (the last rollout's steps stay
  held), and for writers of fewer envs than shards (one env cannot fill two shards;
  moving the whole capacity to its shard would empty the others at once).

Writers made in other processes (by an attached store) route as they go and move
no share: the shares of several processes' writers would not add up.

A shard's arena is made for the whole store's capacity (its share may grow to it);
its rows cost memory only once written (`arrowbuf.placement`), so a larger share
costs nothing until it is used.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from arrowbuf.byte_heap import budget_part
from arrowbuf.errors import CapacityError
from arrowbuf.ragged import value_bytes
from arrowbuf.ray.handles import ShardHandles, SizeCache

logger = logging.getLogger(__name__)


def apportion(capacity: int, demand: Sequence[int]) -> np.ndarray:
    """``capacity`` split in proportion to ``demand`` (envs per shard, not all 0): each shard
    gets the floor of its quota, and the transitions left go one each to the largest
    remainders (the lower shard on a tie). The shares sum to ``capacity``, each within
    one of its quota, and a shard of no demand gets 0.

    Example:
        >>> apportion(123, [2, 1]).tolist()
        [82, 41]
        >>> apportion(7, [1, 1]).tolist()
        [4, 3]
    """
    demand = np.asarray(demand, np.int64)
    total = int(demand.sum())
    if total <= 0:
        raise ValueError(f"demand must have a positive sum, got {demand.tolist()}")
    exact = demand * capacity   # quota x total, in integers
    shares = exact // total
    left = capacity - int(shares.sum())
    order = np.lexsort((np.arange(len(demand)), -(exact % total)))   # largest remainder first, then lower shard
    shares[order[:left]] += 1
    return shares


class CapacityShares:
    """The routes of this process's writers' envs and the shards' shares, moved on the shards
    (see the module docstring); held by the router of the process that started the shards.

    Args:
        shards: the store's shard handles.
        sizes: the store's size cache (the shards' answers carry their size).
        capacity: the store's capacity.
    """

    def __init__(self, shards: ShardHandles, sizes: SizeCache, capacity: int) -> None:
        self._shards = shards
        self._sizes = sizes
        self.capacity = capacity
        self.shares = np.full(shards.num_shards, -1, np.int64)   # unknown: the first move sends every share
        self.routes: dict[tuple[str, int], int] = {}  # (env id, k) -> shard, for every writer made here
        self._open: dict[int, tuple] = {}             # open writer (its sink's id) -> (its sink, weakly; its routes)
        self._lock = threading.RLock()                # writers are made, closed and dropped in any thread
        self._unsettled: list[dict] = []              # moves sent without waiting (a finalizer's), for `settle`

    def open(self, sink: Any, env_ids: list[str]) -> None:
        """A new writer's ``sink`` sends its envs by the routes of `route`, and the shares follow
        (moved now; again when it is garbage collected). Its ``capacity`` (the longest episode it
        can store) becomes the smallest share among its envs' shards."""
        writer = id(sink)
        with self._lock:
            routes = self.route(env_ids, self._sizes.transitions, self._shards.live())
            self._open[writer] = (weakref.ref(sink), routes)
        for (env_id, _), shard in routes.items():
            sink.pin(env_id, shard)
        weakref.finalize(sink, _gone, weakref.ref(self), writer)
        self.move(wait=True)

    def route(self, env_ids: Sequence[str], loads: np.ndarray, live: Sequence[int]) -> dict[tuple[str, int], int]:
        """The route of each of ``env_ids``, by key (env id, k): k is the first that no open
        writer uses (writers open at once with the same env ids are different envs). A key
        keeps its earlier shard; a new one goes to the shard of ``live`` with the fewest
        routed keys, then the smallest of ``loads``, then the lowest."""
        with self._lock:
            used = {key for routes in self._writers() for key in routes}
            counts = np.bincount(list(self.routes.values()), minlength=len(self.shares))
            routes = {}
            for env_id in env_ids:
                key = (env_id, 0)
                while key in used or key in routes:
                    key = (env_id, key[1] + 1)
                shard = self.routes.get(key)
                if shard is None or shard not in live:
                    shard = min(live, key=lambda s: (counts[s], loads[s], s))
                    self.routes[key] = shard
                    counts[shard] += 1
                routes[key] = shard
            return routes

    def _writers(self) -> list[dict[tuple[str, int], int]]:
        """The routes of the writers still open (a closed writer's sink is forgotten)."""
        for writer, (sink, _) in list(self._open.items()):
            if sink() is None or sink().closed:
                del self._open[writer]
        return [routes for _, routes in self._open.values()]

    def gone(self, writer: int) -> None:
        """The sink of writer ``writer`` (its id) was garbage collected: the shares follow the
        writers still open, sent without waiting (a finalizer never waits for a shard)."""
        with self._lock:
            if self._open.pop(writer, None) is not None and not self._shards.closed:
                self.move(wait=False)

    def plan(self) -> dict[int, int]:
        """The shards whose share changes, and their new share: the capacity split in
        proportion to the open writers' envs per shard; none unless their envs reach every
        live shard (a writer of fewer envs than shards leaves the shares as they are)."""
        with self._lock:
            routed = [shard for routes in self._writers() for shard in routes.values()]
            demand = np.bincount(routed, minlength=len(self.shares))
            if not all(demand[s] for s in self._shards.live()):
                return {}
            shares = apportion(self.capacity, demand)
            return {s: int(n) for s, n in enumerate(shares.tolist()) if n != self.shares[s]}

    def move(self, wait: bool) -> None:
        """Send the shards whose share changes their new share (`plan`), the shrinking ones
        first, so that the shards never hold more than the capacity together; then tell every
        open writer's sink the longest episode its shards now take. ``wait=False`` (a
        finalizer's) sends both at once and leaves the answers for `settle`: until the shrinking
        shards answer, the shards may hold more than the capacity together."""
        with self._lock:
            plan, live = self.plan(), set(self._shards.live())
            for part in ({s: n for s, n in plan.items() if n < self.shares[s] and s in live},
                         {s: n for s, n in plan.items() if n >= self.shares[s] and s in live}):
                refs = {s: self._shards.call(s, "set_capacity", n) for s, n in part.items()}
                if wait:
                    self._taken(self._shards.get(refs))
                else:
                    self._unsettled.append(refs)
                    self.shares[list(part)] = list(part.values())
            self._tell_sinks()

    def _tell_sinks(self) -> None:
        """Each open writer's sink takes episodes up to the smallest share among its envs' shards
        (a share not known yet, -1: the sink keeps what it has)."""
        for sink, routes in self._open.values():
            shares = self.shares[sorted(set(routes.values()))]
            if sink() is not None and len(shares) and (shares >= 0).all():
                sink().capacity = max(1, int(shares.min()))

    def settle(self) -> None:
        """Wait for the moves sent without waiting; raise the first error met."""
        with self._lock:
            pending, self._unsettled = self._unsettled, []
            for refs in pending:
                self._taken(self._shards.get(refs))
            self._tell_sinks()

    def known(self) -> np.ndarray | None:
        """Each shard's share once the moves sent are answered (`settle`), a copy; None while
        one is not known yet (no move sent)."""
        self.settle()
        with self._lock:
            return self.shares.copy() if (self.shares >= 0).all() else None

    def _taken(self, answers: Mapping[int, tuple[int, Any]]) -> None:
        """The shards' answers to new shares: the share each took (a fixed store's shrinks no
        lower than it holds), and its size."""
        for shard, (share, reading) in answers.items():
            self.shares[shard] = share
            self._sizes.note(shard, reading)


def _gone(shares: "weakref.ref[CapacityShares]", writer: int) -> None:
    """A writer's sink was garbage collected (dropped without `close`): the shares follow the
    writers still open, sent without waiting (a finalizer never waits for a shard; the next
    `flush` raises what they met)."""
    owner = shares()
    if owner is None:
        return
    try:
        owner.gone(writer)
    except Exception as err:   # a finalizer cannot raise: the shares stay as they were
        logger.error("an arrowbuf store could not move its shards' capacity shares after a writer went away: %s", err)


def unfit(episodes: list[Any], groups: Mapping[int, list[int]], capacities: np.ndarray, schema: Any) -> str | None:
    """Why an episode of ``episodes`` (``groups``: shard -> the indices of those routed to it)
    does not fit its shard's share, ``capacities`` (transitions, summing to the store's): more
    transitions than the share, or more values of a ragged field than the share's part of its
    ``max_bytes`` (as each shard bounds it, `arrowbuf.byte_heap.share_budgets`); None when
    every one fits. (An encoded field's bytes are known only once encoded, in the shard.)"""
    total = int(capacities.sum())
    bounded = {name: f.max_bytes for name, f in schema.fields.items() if f.ragged and f.max_bytes is not None} \
        if schema is not None else {}
    for s, members in groups.items():
        for k in members:
            episode = episodes[k]
            if episode.num_rows - int(episode.has_final) > capacities[s]:
                return (f"an episode of {episode.num_rows - int(episode.has_final)} transitions is longer than "
                        f"shard {s}'s share of the store's capacity, {int(capacities[s])} transitions (shares "
                        "follow the open writers' envs)")
            for name, max_bytes in bounded.items():
                data = episode.columns.get(name)
                nbytes, budget = value_bytes(data, name) if data is not None else 0, \
                    budget_part(max_bytes, int(capacities[s]), total)
                if nbytes > budget:
                    return (f"field {name!r}: an episode of {nbytes:,} bytes of values, more than the {budget:,} "
                            f"bytes of max_bytes={max_bytes:,} that shard {s}'s share of the capacity gives it")
    return None


def store_full(err: Exception, shard: int, num_shards: int, held: int, share: int, capacity: int,
               transitions: int) -> Exception:
    """``err`` as the store's users read it: a full ``mode="fixed"`` shard's `CapacityError` (the
    retryable kind) names the store's ``capacity`` and the local store's remedies, beside the shard
    and its ``share`` that refused (``held`` transitions, ``transitions`` not written); any other
    error, or one of a store of one shard (its share is the capacity), as it is."""
    if not (isinstance(err, CapacityError) and err.retryable) or num_shards == 1:
        return err
    return CapacityError(
        f"store is full: shard {shard} of its {num_shards}, where this episode goes, holds {held:,} transitions, "
        f"its share ({share:,}) of the store's capacity={capacity:,}, and mode='fixed' refuses to evict; the "
        f"{transitions} transition(s) were not written. Sample or clear() the store, raise the capacity, or use "
        "mode='circular'", retryable=True)
