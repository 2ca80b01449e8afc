"""Open regions: where the step writers of a local store write steps in place.

Each env of a step writer owns at most one *region*: a contiguous run of arena rows
reserved at the ring's head (`arrowbuf.placement.Ring.reserve_regions`). Its episode's rows are written straight
into it, one step at a time (`arrowbuf.inplace`): step t's fields into the row of
observation t, and the step's next observation into the following row, which is
observation t + 1. The steps written so far form the env's *open tail*; the
episode table publishes it (`EpisodeTable.publish_open`), so every completed step
is sampleable at once.

A piece is sealed into the episode table when its episode ends, when the writer
is flushed, or when the region is full: the episode then continues in a new
region, whose first row repeats the last observation of the full one (one
duplicated observation row per region). Pieces of one episode are linked by their
env and ``first_step`` (the step their first row has in the episode), and each records
the piece it continues (the table's ``prev_piece``; after a gap, the piece before it, so
the episode keeps its id): samples read the pieces still held, where their steps meet, as
one episode (`arrowbuf.indexing.PieceChains`).

Regions and the final observations of pieces take rows that are not transitions:
the arena keeps rows for them beyond the capacity, and a reservation whose rows are
still live grows the ring instead of evicting (`arrowbuf.placement`). Eviction takes
the oldest transitions, as few as the capacity needs: the front of the oldest piece,
and only past every sealed one the fronts of open tails (`OpenRegions.trim_oldest`).
`clear` takes every open region: its written steps are dropped and its env continues
its episode in a new region from its next step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Largest region (rows) a writer reserves for one env at a time.
MAX_REGION = 4096
#: Smallest region: one transition (its observation row and the next observation's).
MIN_REGION = 2


class OpenRegions:
    """The regions of every writer env of one shard, as numpy arrays by slot.

    A writer takes a block of consecutive slots (`allocate`), one per env, and keeps
    its per-env state here, where the shard can take a region away (`take`).
    """

    def __init__(self) -> None:
        self.size = 0
        self.start = np.zeros(0, np.int64)    # first row of the open piece (its observation 0)
        self.end = np.zeros(0, np.int64)      # row after the region
        self.length = np.zeros(0, np.int64)   # completed transitions of the open piece
        self.first_step = np.zeros(0, np.int64)   # step of the piece's first row in its episode
        self.prev = np.zeros(0, np.int64)     # serial of the sealed piece the open one continues; -1: none
        self.env = np.zeros(0, np.int32)      # env code in the episode table
        self.alive = np.zeros(0, bool)        # slot held by a writer
        self.held = np.zeros(0, bool)         # slot holds a region
        self.count = 0                        # slots alive
        # Bumped by every change but `wrote`'s: `published` then knows when only lengths changed.
        self.version = 0
        self._published: tuple = (-1, np.zeros(0, np.int64), ())   # (version, slots, tails) of its last call

    def allocate(self, envs: np.ndarray) -> int:
        """A block of ``len(envs)`` slots for a writer's envs (codes ``envs``); its first slot.
        Slots released by writers that are gone are reused (a new writer per rollout
        does not grow the arrays)."""
        n = len(envs)
        base = self._free_block(n)
        if base + n > self.size:
            for name in ("start", "end", "length", "first_step", "prev", "env", "alive", "held"):
                array = getattr(self, name)
                grown = np.zeros(base + n, array.dtype)
                grown[:self.size] = array[:base + n]
                setattr(self, name, grown)
            self.size = base + n
        block = slice(base, base + n)
        self.env[block] = envs
        self.alive[block] = True
        self.held[block] = False
        self.length[block] = self.first_step[block] = 0
        self.prev[block] = -1
        self.count += n
        self.version += 1
        return base

    def _free_block(self, n: int) -> int:
        """The first slot of the first run of ``n`` dead slots (a run at the end may be
        short: the arrays grow past it)."""
        dead = np.cumsum(np.concatenate([[0], ~self.alive, np.ones(n, bool)]), dtype=np.int64)
        runs = dead[n:] - dead[:-n]   # dead slots in the window of n from each slot
        return int(np.flatnonzero(runs == n)[0])

    def release(self, base: int, n: int) -> None:
        """The writer of slots ``[base, base + n)`` is done: its regions go (unwritten rows stay dead)."""
        self.alive[base:base + n] = False
        self.held[base:base + n] = False
        self.length[base:base + n] = 0
        self.count -= n
        self.version += 1

    def restore(self, slots: slice, first_step: np.ndarray, saved: dict | None) -> None:
        """Slots ``slots`` start again from a saved writer state: empty open pieces at steps
        ``first_step``, in the regions ``saved`` names (``held``, ``start``, ``end``, ``prev``:
        checked by the caller against the store's rows), else in none."""
        self.version += 1
        self.length[slots] = 0
        self.first_step[slots] = first_step
        self.prev[slots] = -1
        self.held[slots] = False
        if saved is not None:
            self.start[slots], self.end[slots], self.held[slots] = saved["start"], saved["end"], saved["held"]
            self.prev[slots] = np.where(saved["held"], saved["prev"], -1)

    def wrote(self, slots: np.ndarray | slice, steps: int | np.ndarray = 1) -> None:
        """The open pieces of ``slots`` gained ``steps`` completed transitions each."""
        self.length[slots] += steps

    def sealed(self, slots: np.ndarray, continued: np.ndarray | None) -> None:
        """The open pieces of ``slots`` were sealed. ``continued``: their serials in the
        episode table, where each episode goes on in a new region (its next piece continues
        the sealed one); None: the episodes ended, and each env's next one starts right
        after, in the same region."""
        self.version += 1
        if continued is not None:
            self.first_step[slots] += self.length[slots]
            self.prev[slots] = continued
        else:
            self.first_step[slots] = 0
            self.prev[slots] = -1
            self.start[slots] += self.length[slots] + 1
        self.length[slots] = 0

    def restart(self, slots: slice) -> None:
        """The envs of ``slots`` start new episodes (a writer's `flush`): nothing continues."""
        self.version += 1
        self.first_step[slots] = 0
        self.prev[slots] = -1

    def drop(self, slots: np.ndarray) -> None:
        """The regions of ``slots`` are full: the slots hold none until they reserve another."""
        self.version += len(slots) > 0
        self.held[slots] = False

    def take(self, slots: np.ndarray) -> None:
        """Take the regions of ``slots``: their written steps are dropped, and each env's
        episode continues, from its next step, in a new region."""
        # Written steps dropped: a gap (`piece_chains` links no gap); ``prev`` stays, for the episode's id.
        self.version += 1
        self.first_step[slots] += self.length[slots]
        self.length[slots] = 0
        self.held[slots] = False

    def hold(self, slots: np.ndarray, start: int, each: int) -> None:
        """Regions of ``each`` rows from row ``start`` for ``slots``, back to back (their open pieces
        start empty there)."""
        self.version += 1
        self.start[slots] = start + each * np.arange(len(slots), dtype=np.int64)
        self.end[slots] = self.start[slots] + each
        self.held[slots] = True

    def trim_oldest(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Cut ``count`` transitions off the fronts of the open tails, the longest first (their
        fronts are the oldest steps): each cut tail continues after a gap. Returns the rows
        freed, as (starts, stops)."""
        slots = np.flatnonzero(self.held & (self.length > 0))
        lengths = self.length[slots]
        order = np.argsort(-lengths, kind="stable")
        # Lower the longest tails to a common level: the fewest levels that free ``count``.
        cut = np.zeros(len(slots), np.int64)
        left = min(count, int(lengths.sum()))
        sorted_lengths = lengths[order]
        while left > 0:
            top = sorted_lengths - cut[order]
            level = int(top.max())
            at_top = np.flatnonzero(top == level)
            lower = int(top[top < level].max(initial=0))
            take = min(left, len(at_top) * (level - lower))
            each, extra = divmod(take, len(at_top))
            step = np.full(len(at_top), each, np.int64)
            step[:extra] += 1
            cut[order[at_top]] += step
            left -= take
        slots, cut = slots[cut > 0], cut[cut > 0]
        self.version += 1
        freed = self.start[slots].copy()
        self.start[slots] += cut
        self.length[slots] -= cut
        self.first_step[slots] += cut   # a gap (`piece_chains` links none); ``prev`` stays, for the episode's id
        return freed, self.start[slots].copy()

    def clear(self) -> None:
        """Take every region (`ExperienceStore.clear`): open episodes continue in new ones."""
        self.take(np.flatnonzero(self.held))

    def published(self) -> tuple[Any, ...]:
        """(first row, length, first step, env code, piece continued) of the open tails with a
        completed step, and whether they are the last call's tails, in its order, only longer."""
        slots = np.flatnonzero(self.held & (self.length > 0))
        version, last, tails = self._published
        if version == self.version and np.array_equal(slots, last):
            return tails[0], self.length[slots], *tails[1:], True
        tails = (self.start[slots], self.first_step[slots], self.env[slots], self.prev[slots])
        self._published = (self.version, slots, tails)
        return tails[0], self.length[slots], *tails[1:], False


def region_rows(capacity: int, used: int, wanting: int, writers_envs: int) -> int:
    """Rows of the next region, within [`MIN_REGION`, `MAX_REGION`]:

    - into an empty ring (a fresh or cleared store, ``used == 0``), an even share of
      its rows, at most a quarter of the ring: a rollout of T steps by N envs then fits
      in N x (T + 1) rows, one piece an episode (the on-policy case: fill, sample, clear);
    - else a generation (one region per writer env) of 1/k of the ring, with
      k = sqrt(2 x capacity / envs) in [4, 64]. Regions reserved together fill together,
      so pieces seal in ring order give or take a generation, and the rows they free
      merge into runs a region fits in (`arrowbuf.placement.FreeRows`); each region also
      repeats one observation row. k balances the two costs, 2/k and k x envs / capacity
      (ring rows beyond the capacity: 1.05-1.15 x for 1-64 envs streaming,
      tests/test_capacity.py).
    """
    envs = max(writers_envs, 1)
    generations = min(64, max(4, round(math.sqrt(2 * capacity / envs))))
    share = capacity // (generations * envs)
    free = min(capacity // max(wanting, 1), capacity // 4) if used == 0 else 0
    return int(min(MAX_REGION, max(MIN_REGION, share, free)))
