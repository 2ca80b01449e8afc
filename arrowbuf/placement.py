"""Where a shard's new rows go, and which of its oldest steps make room: pure plans over
the shard's state, applied by the `Shard` (the one owner of its ring and its table).

A store's ``capacity`` counts *transitions*, the unit users size by (``num_envs x T``).
The arena keeps more rows than that (`arena_rows`): an episode's final observation and
an open region's repeated first row take a row without being a transition. Two rules
place every write (an episode, or a writer's region):

- **count**: a write of n transitions first evicts the oldest transitions past
  ``capacity - n`` (`oldest_transitions`): whole pieces from the table's head, then the
  front of the next one; a Ray shard, whose sealed blocks hold whole episodes, evicts
  whole pieces only. The open tails of writers go last (their steps are the newest).
- **rows**: the new rows go at the ring's head if those rows hold nothing live;
  otherwise the ring *grows* (`Plan.ring`): the rows past it were never written, so
  they cost no memory until then (numpy and torch-on-CPU columns are faulted in by
  the first write). Only a ring that reached the arena's rows evicts by rows (every
  piece it overlaps and all before, the old FIFO), which a write of non-zero-length
  pieces never needs: ``2 x capacity`` rows hold ``capacity`` one-step episodes.
  A CUDA arena, allocated at once, starts smaller and *grows* first (`Ring.grow_arena`,
  the shard's: its columns copied into larger ones, up to the rows a lazy arena keeps),
  so it evicts by rows only once it has as many rows as a lazy one, or when the device
  has no memory left for the larger columns (logged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from arrowbuf.errors import CapacityError
from arrowbuf.regions import MIN_REGION, OpenRegions, region_rows

#: Rows beyond twice the capacity: regions that writers hold open (their unused rows)
#: and holes between pieces; see `arena_rows`.
HEADROOM = 0.5


def arena_rows(capacity: int, lazy: bool = True) -> int:
    """Rows of the arena of a shard of ``capacity`` transitions.

    ``lazy`` (columns whose pages are faulted in by the first write: numpy, torch on the
    CPU): ``2.5 x capacity`` + 64, of which a ring uses what its episodes need (one more
    row per piece, at most one per transition). A CUDA arena is allocated at once: it
    keeps an eighth more rows, and a ring of shorter pieces evicts early (`Plan`).
    """
    if lazy:
        return 2 * capacity + int(HEADROOM * capacity) + 64
    return capacity + capacity // 8 + 64


@dataclass(frozen=True)
class Plan:
    """A write's place and what it evicts first, in the order the shard applies them.

    Attributes:
        start: first row of the new rows.
        pieces: oldest live pieces evicted whole.
        trim: transitions then cut off the front of the oldest piece left.
        open_trim: transitions cut off the writers' open tails (sealed ones were too few).
        ring: the ring's rows after the write (more than before: it grew).
        jumped: a detour: the rows went past the ring's old end (the ring grew) because the
            rows at the head are still live; the head stays, for the next write to try again.
    """

    start: int
    pieces: int
    trim: int
    open_trim: int
    ring: int
    jumped: bool = False


class FreeRows:
    """The free runs of a ring's rows, as ``[start, stop)`` spans in the order they were
    freed (the oldest rows first), merged with their neighbours when they touch."""

    def __init__(self) -> None:
        self.spans: dict[int, int] = {}   # start -> stop
        self.ends: dict[int, int] = {}    # stop -> start

    def reset(self, starts: np.ndarray, stops: np.ndarray) -> None:
        self.spans, self.ends = {}, {}
        for a, b in zip(starts.tolist(), stops.tolist()):
            self.free(a, b)

    def free(self, a: int, b: int) -> None:
        """Rows ``[a, b)`` hold nothing any more."""
        if b <= a:
            return
        stop = self.spans.pop(b, None)
        if stop is not None:
            del self.ends[stop]
            b = stop
        start = self.ends.pop(a, None)
        if start is not None:
            del self.spans[start]
            a = start
        self.spans[a] = b
        self.ends[b] = a

    def find(self, rows: int) -> int | None:
        """The first row of the first span (oldest freed first) of at least ``rows`` rows."""
        for a, b in self.spans.items():
            if b - a >= rows:
                return a
        return None

    def largest(self) -> int:
        return max((b - a for a, b in self.spans.items()), default=0)

    def take_within(self, a: int, rows: int) -> None:
        """Rows ``[a, a + rows)``, inside one free span, are used (its rows before and after stay free)."""
        start = next(s for s, e in self.spans.items() if s <= a and a + rows <= e)
        stop = self.spans.pop(start)
        del self.ends[stop]
        self.free(start, a)
        self.free(a + rows, stop)

    def take(self, a: int, rows: int) -> None:
        """Rows ``[a, a + rows)`` of the span starting at ``a`` are used."""
        b = self.spans.pop(a)
        del self.ends[b]
        if b > a + rows:
            self.spans[a + rows] = b
            self.ends[b] = a + rows


class Ring:
    """Where a shard's rows go: its ring (head, length, order), the writers' open regions,
    and the one eviction routine (`evict_oldest`). Only the ring writes these.

    Args:
        table: the shard's episode table (the ring evicts from it; the shard appends).
        capacity: transitions held.
        rows: rows of the arena (`arena_rows`); the ring starts at ``capacity`` rows (or
            ``rows`` when fewer) and grows as its pieces need.
        mode: "circular" evicts the oldest; "fixed" refuses with `CapacityError`.
        rewards: the sum of the rewards in arena rows ``[a, b)`` (a trimmed piece's return drops them).
        whole_pieces: evict whole pieces only (a Ray shard's sealed blocks hold whole episodes).
        write_pos: the row after the newest piece.
        grow_arena: a non-lazy arena's (CUDA): asked for a number of rows, gives the arena's rows
            after it grew (the same when it could not); None: the arena keeps `arena_rows` rows.
    """

    def __init__(self, table: Any, capacity: int, rows: int, mode: str,
                 rewards: Callable[[int, int], float] | None = None, whole_pieces: bool = False,
                 write_pos: int = 0, released: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 grow_arena: Callable[[int], int] | None = None) -> None:
        self.table = table
        self.grow_arena = grow_arena
        self._grow_refused = False   # the device had no room to grow: not asked again until `clear`
        self.released = released   # told (first row, rows) of each span evicted: its columns' bytes go back
        self.capacity = capacity
        self.rows = rows
        self.mode = mode
        self.rewards = rewards
        self.whole_pieces = whole_pieces
        self.ring = min(capacity, rows)
        self.write_pos = write_pos
        # Whether the live pieces lie in the ring in table order, one arc from the oldest
        # to the head (then a write is placed in O(evicted): `plan_rows`).
        self.ordered = True
        # Once not `ordered` (writers' regions, or a detour past the ring's end), rows are
        # taken from the free runs that evictions leave, wherever they lie in the ring.
        self.free = FreeRows()
        self.regions = OpenRegions()
        self.listener: Any = None   # the sampler told of evicted rows (`listen`)

    def __len__(self) -> int:
        """Transitions held: sealed, and open tails'."""
        return self.table.num_transitions

    def listen(self, sampler: Any) -> None:
        """Tell ``sampler`` (one that tracks rows, or None) of every row evicted from now on."""
        self.listener = sampler

    def plan(self, rows: int, transitions: int) -> Plan:
        """Where ``rows`` new rows holding ``transitions`` go, and what they evict first
        (`arrowbuf.placement`); nothing changes.

        Raises:
            CapacityError: a full ``mode="fixed"`` store (``capacity`` transitions held,
                or rows it cannot place without evicting).
        """
        excess = len(self) + transitions - self.capacity
        popped, trim, left = oldest_transitions(self.table.col("length"), excess, self.whole_pieces)
        if excess > 0 and self.mode == "fixed":
            raise CapacityError(
                f"store is full: {len(self):,} transitions held of its capacity={self.capacity:,}, and "
                f"mode='fixed' refuses to evict; the {transitions} transition(s) were not written. Sample or "
                "clear() the store, raise the capacity, or use mode='circular'", retryable=True)
        if not self.ordered:   # rows from the free runs once the count's evictions freed theirs (`apply`)
            return Plan(-1, popped, trim, left, self.ring)
        start, ring, pieces, jumped = plan_rows(self, rows, popped, trim)
        if pieces > popped and self._more_rows(rows):   # the arena was full: it grew instead
            start, ring, pieces, jumped = plan_rows(self, rows, popped, trim)
        if pieces > popped and self.mode == "fixed":
            raise CapacityError(
                f"store is full: its {self.rows:,} rows hold {len(self):,} transitions in "
                f"{len(self.table):,} pieces, and mode='fixed' refuses to evict; the {transitions} transition(s) "
                "were not written", retryable=True)
        return Plan(start, pieces, trim if pieces == popped else 0, left, ring, jumped)

    def plan_block(self, rows: int, transitions: int) -> Plan | None:
        """`plan` for one run of ``rows`` rows holding many episodes' ``transitions`` (`arrowbuf.block_add`),
        or None (nothing changes) where their episodes written one by one could differ: a ring whose
        live pieces are not in order, a block past the capacity or the arena's rows (one-row episodes
        without a transition) or a full fixed store (evicting or refusing part-way), or rows the run
        takes that would evict more than the count does."""
        excess = len(self) + transitions - self.capacity
        if not self.ordered or transitions > self.capacity or rows > self.rows or (excess > 0 and self.mode == "fixed"):
            return None
        popped, trim, left = oldest_transitions(self.table.col("length"), excess, self.whole_pieces)
        if left:
            return None
        start, ring, pieces, jumped = plan_rows(self, rows, popped, trim)
        return Plan(start, pieces, trim, 0, ring, jumped) if pieces == popped else None

    def apply(self, plan: Plan, rows: int) -> int:
        """Evict what ``plan`` says, then take ``rows`` rows; their first row.

        Raises:
            CapacityError: a ``mode="fixed"`` store with no free run of ``rows`` rows left,
                or open regions that leave none (nothing is placed).
        """
        self._evict(plan.pieces, plan.trim, plan.open_trim)
        if self.ordered:
            self.ring = plan.ring
            self.write_pos = plan.start + rows
            if plan.jumped:   # a detour past the ring's end: from now on, the free runs
                self._unorder()
                self.free.take_within(plan.start, rows)
            return plan.start
        start = self.free.find(rows)
        if start is None and self.ring >= self.rows:
            self._more_rows(rows)
        if start is None and self.ring < self.rows:   # grow: rows past the ring were never written
            grown = min(self.rows, max(self.ring + rows, self.ring + self.ring // 64))
            self.free.free(self.ring, grown)
            self.ring = grown
            start = self.free.find(rows)
        while start is None and len(self.table) and self.mode == "circular":
            self._evict(1, 0, 0)   # the arena is full: the oldest go early, until rows are free
            start = self.free.find(rows)
        if start is None:
            raise CapacityError(f"a store of capacity {self.capacity:,} ({self.rows:,} rows) has no {rows} free "
                                f"rows left beside its open regions and {len(self)} transitions; raise the capacity",
                                retryable=self.mode == "fixed")
        self.free.take(start, rows)
        self.write_pos = start + rows
        return start

    def _evict(self, pieces: int, trim: int, open_trim: int) -> None:
        if pieces or trim:
            self.evict_oldest(pieces, trim)
        if open_trim:
            starts, stops = self.regions.trim_oldest(open_trim)
            for a, b in zip(starts, stops):
                if not self.ordered:
                    self.free.free(int(a), int(b))
            if self.released is not None and len(starts):   # their bytes go back too
                self.released(starts, stops - starts)

    def free_oldest(self, fraction: float) -> bool:
        """Evict for a field's byte budget (`arrowbuf.byte_heap.bind_heap_columns`): the oldest
        sealed piece, else about ``fraction`` of the open tails' transitions (at least one) off
        their fronts, as the count's eviction cuts them; False when nothing is left to evict
        (each open tail keeps the observation its next step starts from)."""
        if len(self.table):
            self.evict_oldest(1)
            return True
        regions = self.regions
        held = int(regions.length[regions.held].sum())
        if not held:
            return False
        self._evict(0, 0, max(1, min(held, int(np.ceil(held * fraction)))))
        return True

    def pinned_rows(self) -> np.ndarray:
        """The rows no eviction frees: each open tail's last observation, its next step's start."""
        regions = self.regions
        return (regions.start + regions.length)[regions.held]

    def _more_rows(self, rows: int) -> bool:
        """A full arena that can grow (`grow_arena`) takes room for ``rows`` more rows past the
        ring, an eighth more at least, up to the rows a lazy arena keeps; whether it grew."""
        most = arena_rows(self.capacity)
        return self.rows < most and self._grow_to(min(most, max(self.ring + rows, self.rows + self.rows // 8)))

    def _grow_to(self, rows: int) -> bool:
        """Ask `grow_arena` for ``rows`` rows (more than now); whether the arena grew. (A sampler
        that keeps per-row state grows it when a write lands past it: `PrioritizedSampler`.)"""
        if self.grow_arena is None or rows <= self.rows or self._grow_refused:
            return False
        grown = self.grow_arena(rows)
        if grown <= self.rows:
            self._grow_refused = True
            return False
        self.rows = grown
        return True

    def _unorder(self) -> None:
        """Take rows from the free runs from now on: the runs between the live pieces and
        the writers' regions."""
        self.ordered = False
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute the free runs from the live pieces and the writers' held regions (a
        restored writer's regions, a loaded state)."""
        table, regions = self.table, self.regions
        held = np.flatnonzero(regions.held)
        starts = np.concatenate([table.col("first_row"), regions.start[held]])
        stops = np.concatenate([table.col("first_row") + table.col("num_rows"), regions.end[held]])
        order = np.argsort(starts, kind="stable")
        starts, stops = starts[order], stops[order]
        reach = np.maximum.accumulate(stops) if len(stops) else stops
        gaps_a = np.concatenate([[0], reach]).astype(np.int64)
        gaps_b = np.concatenate([starts, [self.ring]]).astype(np.int64)
        keep = gaps_b > gaps_a
        self.free.reset(gaps_a[keep], gaps_b[keep])

    def drop_regions(self, slots: np.ndarray, used_to: np.ndarray) -> None:
        """The regions of ``slots`` are full: their rows from ``used_to`` on are free."""
        regions = self.regions
        if not self.ordered:
            for a, b in zip(used_to.tolist(), regions.end[slots].tolist()):
                self.free.free(a, b)
        regions.drop(slots)

    def adopt_regions(self) -> None:
        """Regions were restored where a saved writer held them: free runs exclude them."""
        if self.ordered:
            self._unorder()
        else:
            self.rebuild()

    def release(self, base: int, n: int) -> None:
        """The writer of region slots ``[base, base + n)`` is gone: their rows are free."""
        regions = self.regions
        held = base + np.flatnonzero(regions.held[base:base + n])
        if not self.ordered:
            for a, b in zip(regions.start[held].tolist(), regions.end[held].tolist()):
                self.free.free(a, b)
        regions.release(base, n)

    def admit(self, transitions: int) -> None:
        """Room for ``transitions`` more (a writer's step): the oldest past the capacity go.

        Raises:
            CapacityError: a full ``mode="fixed"`` store; nothing changed.
        """
        if transitions > self.capacity:
            raise CapacityError(f"a step of {transitions} envs is {transitions} transitions, more than the store's "
                                f"capacity={self.capacity:,}; raise the capacity (it counts transitions) or use "
                                "fewer envs per writer")
        if len(self) + transitions > self.capacity:
            plan = self.plan(0, transitions)
            self._evict(plan.pieces, plan.trim, plan.open_trim)

    def resize(self, capacity: int) -> int:
        """Hold ``capacity`` transitions from now on (a Ray shard's share of its store,
        `arrowbuf.ray.shares`), at most what the arena's rows were made for; a smaller one
        evicts the oldest transitions past it now, so that the shards together never hold
        more than their store's capacity. A ``mode="fixed"`` ring never evicts: it shrinks
        no lower than what it holds. Returns the capacity taken.

        Raises:
            ValueError: a capacity below 0.
        """
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 transitions, got {capacity}")
        if self.mode == "fixed":
            capacity = max(capacity, len(self))
        self.capacity = capacity
        excess = len(self) - capacity
        if excess > 0:
            popped, trim, left = oldest_transitions(self.table.col("length"), excess, self.whole_pieces)
            self._evict(popped, trim, left)
        return capacity

    def evict_oldest(self, pieces: int, trim: int = 0) -> None:
        """The one eviction routine: drop the ``pieces`` oldest live pieces, then ``trim``
        transitions off the front of the oldest left (its first step moves on); the
        listening sampler is told of the rows freed."""
        table = self.table
        first, rows = table.col("first_row")[:pieces].copy(), table.col("num_rows")[:pieces].copy()
        if trim:
            first = np.append(first, table.col("first_row")[pieces])
            rows = np.append(rows, trim)
        table.pop_oldest(pieces)
        if trim:
            a = int(first[-1])
            table.trim_oldest(trim, self.rewards(a, a + trim) if self.rewards is not None else 0.0)
        if not self.ordered:
            for a, n in zip(first.tolist(), rows.tolist()):
                self.free.free(a, a + n)
        if self.released is not None:
            self.released(first, rows)
        if self.listener is not None:
            self.listener.on_evict(first, rows)

    def reserve_regions(self, slots: np.ndarray, min_rows: int = MIN_REGION, transitions: int = 0) -> None:
        """Regions of at least ``min_rows`` rows for writer ``slots`` (`arrowbuf.regions`),
        reserved at the ring's head in blocks (one `plan` a block), for a step of ``transitions``.

        Raises:
            CapacityError: the arena cannot hold every env's region at once.
        """
        if not len(slots):
            return
        regions, ring = self.regions, self.ring
        used = int(self.table.col("num_rows").sum()) + int((regions.end - regions.start)[regions.held].sum())
        size = max(region_rows(ring, used, max(len(slots), regions.count), regions.count), min_rows)
        if min_rows > self.rows or MIN_REGION * len(slots) > self.rows:
            raise CapacityError(f"a store of capacity {self.capacity:,} cannot hold the open episodes of "
                                f"{len(slots)} envs ({min_rows - 1} steps); raise the capacity")
        if self.ordered:
            self._unorder()
        pending = np.asarray(slots, np.int64)
        while len(pending):
            # As many regions as the largest free run takes (at least one: `apply` grows the ring).
            count = min(len(pending), max(1, self.free.largest() // size))
            start = self.apply(self.plan(count * size, transitions), count * size)
            block, pending = pending[:count], pending[count:]
            regions.hold(block, start, size)

    def clear(self) -> None:
        """Nothing is held: the head goes back to row 0; the ring keeps the rows it grew
        to (their pages are faulted in already)."""
        self.regions.clear()
        self._grow_refused = False
        self.write_pos = 0
        self.ordered = True
        self.free.reset(np.zeros(0, np.int64), np.zeros(0, np.int64))

    def state(self) -> dict[str, Any]:
        return {"write_pos": self.write_pos, "ordered": self.ordered, "ring": self.ring, "rows": self.rows}

    def load(self, state: dict[str, Any]) -> None:
        """Restore `state` (the table is loaded: the ring covers its pieces).

        Raises:
            ValueError: a write position or ring outside the arena.
        """
        ring = int(state.get("ring", self.ring))
        saved_rows = int(state.get("rows", self.rows))
        if saved_rows <= arena_rows(self.capacity):
            # a grown CUDA arena's: as many rows again (its sampler's tree and reuse counts have them)
            self._grow_to(saved_rows)
        if not 0 <= int(state["write_pos"]) <= max(ring, self.capacity) <= self.rows:
            raise ValueError(f"shard state has write_pos {state['write_pos']} and ring {ring} outside "
                             f"0 <= write_pos <= ring <= {self.rows} (the arena's rows)")
        self.write_pos = int(state["write_pos"])
        ends = self.table.col("first_row") + self.table.col("num_rows")
        self.ring = max(ring, self.write_pos, int(ends.max(initial=0)))
        self.ordered = bool(state.get("ordered", True))
        if not self.ordered:
            self.rebuild()


def oldest_transitions(lengths: np.ndarray, count: int, whole: bool) -> tuple[int, int, int]:
    """(pieces evicted whole, transitions trimmed off the next piece, transitions left over)
    to evict the ``count`` oldest transitions of pieces of ``lengths`` (oldest first).
    ``whole``: a piece goes whole or not at all (the last one may take more than ``count``)."""
    popped, n = 0, len(lengths)
    while count > 0 and popped < n:
        length = int(lengths[popped])
        if length <= count or whole:
            count -= length
            popped += 1
        else:
            return popped, count, 0
    return popped, 0, max(count, 0)


def plan_rows(shard: Any, rows: int, popped: int, trim: int) -> tuple[int, int, int, bool]:
    """(start, ring, pieces evicted, jumped) for ``rows`` new rows of ``shard``
    while its live pieces lie in the ring in table order (one arc from the oldest to the
    head) and no writer holds a region, once its ``popped`` oldest pieces are gone and
    ``trim`` rows cut off the next: O(1) but for the pieces evicted."""
    ring, head, table = shard.ring, shard.write_pos, shard.table
    n = len(table)
    if popped >= n:   # nothing stays
        if head + rows <= ring:
            return head, ring, popped, False
        return (0, ring, popped, False) if rows <= ring else (0, rows, popped, False)
    first = table.col("first_row")
    oldest = int(first[popped]) + trim
    if oldest < head:   # the live arc does not wrap: free rows after the head and before the oldest
        if head + rows <= ring:
            return head, ring, popped, False
        if rows <= oldest:
            return 0, ring, popped, False
        if head + rows <= shard.rows:
            return head, head + rows, popped, False
    elif head + rows <= oldest:   # it wraps: free rows between the head and the oldest
        return head, ring, popped, False
    if ring + rows <= shard.rows:
        return ring, ring + rows, popped, True
    # The arena is full: evict by rows (the old FIFO over the arc).
    start, evicted = plan_write(_trimmed(first, popped, trim), head, ring, rows)
    return start, ring, popped + evicted, False


def _trimmed(first: np.ndarray, popped: int, trim: int) -> np.ndarray:
    """First rows of the pieces left once ``popped`` are gone and ``trim`` rows cut off the next."""
    left = first[popped:].copy()
    left[:1] += trim
    return left


def plan_write(first_rows: np.ndarray, write_pos: int, capacity: int, rows: int) -> tuple[int, int]:
    """Where the next episode of ``rows`` rows goes in a ring of ``capacity`` rows whose live
    episodes lie in table order, and how many oldest episodes it evicts (by rows).

    Args:
        first_rows: first arena row of each live episode, oldest first.
        write_pos: the row after the newest episode.
        capacity: rows in the ring.
        rows: rows of the new episode (at most ``capacity``).

    Returns:
        (start, evicted): the new episode occupies ``[start, start + rows)``; the
        ``evicted`` oldest episodes must go first.
    """
    n = len(first_rows)
    evicted = 0
    if write_pos + rows <= capacity:
        start = write_pos
    else:
        # Skip to row 0. Episodes still in the tail are from the previous lap, hence
        # the oldest ones: FIFO order evicts them before anything at the front.
        start = 0
        while evicted < n and first_rows[evicted] >= write_pos:
            evicted += 1
    while evicted < n and start <= first_rows[evicted] < start + rows:
        evicted += 1
    return start, evicted
