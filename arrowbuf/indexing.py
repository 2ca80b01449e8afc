"""Index arithmetic at sample time: n-step returns, frame stacks, and which episode holds
an index (`arrowbuf.shard.Shard.lookups` applies them to a sampler's selection).

N-step returns and frame stacks read the rows already stored (nothing is duplicated
in storage): an n-step return sums rewards of rows t..t+k-1 and bootstraps from the
observation of row t+k; a frame stack reads observation rows t-k+1..t, repeating the
episode's first frame where the episode is younger than the stack. `PieceChains` does
both across the held pieces of an episode that a step writer cut (and places sequence
windows that cross them). `look_ahead` applies both to a sample's transitions, for the
local store (arena rows) and a Ray reader (rows of its view's blocks) alike. `RunLookup` finds
the episode of each drawn index in O(1), for episode tables that stay unchanged
while they are sampled many times (a Ray reader's views).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from arrowbuf.sample_args import SampleArgs

@dataclass
class NStep:
    """An n-step look-ahead for a batch: rows of the bootstrap observation and the targets."""

    next_rows: np.ndarray     # row of the observation k steps ahead
    reward: np.ndarray        # sum_{i<k} gamma^i r_{t+i}
    discount: np.ndarray      # gamma^k
    steps: np.ndarray         # k: n, or fewer at the episode end
    last_rows: np.ndarray     # row t+k-1 (its terminated / truncated flags end the window)


def n_step(rows: np.ndarray, last_row: np.ndarray, reward: np.ndarray, n: int, gamma: float) -> NStep:
    """n-step discounted rewards for transitions at ``rows``.

    Args:
        rows: arena rows of the transitions, any shape.
        last_row: the last transition row of each one's episode (same shape).
        reward: the arena's reward column.
        n: look-ahead (>= 1); windows stop at the episode's last transition.
        gamma: discount.
    """
    steps = np.minimum(n, last_row - rows + 1)
    offsets = np.arange(n, dtype=np.int64)
    window = np.minimum(rows[..., None] + offsets, last_row[..., None])
    return _discounted(window, steps, reward, gamma, rows + steps, rows + steps - 1)


def _discounted(window: np.ndarray, steps: np.ndarray, reward: np.ndarray, gamma: float,
                next_rows: np.ndarray, last_rows: np.ndarray) -> NStep:
    """The `NStep` of reward rows ``window`` [..., n] of which the first ``steps`` count;
    a reward of per-step shape S (TorchRL's ``[1]``) sums to [..., *S]."""
    offsets = np.arange(window.shape[-1], dtype=np.int64)
    weights = np.where(offsets < steps[..., None], gamma ** offsets, 0.0)
    rewards = reward[window].astype(np.float64)
    weights = weights.reshape(weights.shape + (1,) * (rewards.ndim - weights.ndim))
    total = (rewards * weights).sum(axis=window.ndim - 1)
    dtype = reward.dtype if np.issubdtype(reward.dtype, np.floating) else np.float32
    return NStep(next_rows, total.astype(dtype), (gamma ** steps).astype(dtype), steps, last_rows)


def frame_rows(rows: np.ndarray, first_row: np.ndarray, frames: int) -> np.ndarray:
    """Observation rows t-frames+1..t (oldest first) clamped to the episode's first row.

    Returns an array of shape ``rows.shape + (frames,)``.
    """
    back = np.arange(frames - 1, -1, -1, dtype=np.int64)
    return np.maximum(rows[..., None] - back, first_row[..., None])


@dataclass(frozen=True)
class PieceChains:
    """The pieces of each episode, linked: an episode cut into pieces by a step writer's
    bookkeeping (`arrowbuf.regions`) reads as one episode across the pieces still held.

    Entries are the episode table's positions, sealed then open (`EpisodeTable.ecol`).
    Entry ``i`` holds the observations of steps ``first_step[i] .. first_step[i] + length[i]``
    of its episode at rows ``first_row[i] ..``; ``prev[i]`` / ``next[i]`` is the entry
    holding the steps just before / after it (-1: none live, or a gap: steps that were
    dropped or evicted are not there). Build it with `piece_chains`.
    """

    first_row: np.ndarray
    first_step: np.ndarray
    length: np.ndarray
    prev: np.ndarray
    next: np.ndarray

    def locate(self, pos: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, entries) of episode ``steps`` (any shape), walking from entries ``pos``
        (broadcast) along the chain; a step beyond the held ones is clamped to the nearest
        held observation. A transition step (one with a next observation) lands in the
        entry where it has its step fields (not a piece's final row)."""
        pos = np.broadcast_to(pos, steps.shape).copy()
        s = steps
        while True:   # each element moves one way only, a piece at a time: as many rounds as pieces crossed
            fs = self.first_step[pos]
            end = fs + self.length[pos]
            prev, nxt = self.prev[pos], self.next[pos]
            back = (s < fs) & (prev >= 0)
            ahead = (s >= end) & (nxt >= 0)
            if not (back.any() or ahead.any()):
                break
            pos = np.where(back, prev, np.where(ahead, nxt, pos))
        s = np.clip(s, fs, end)
        return self.first_row[pos] + (s - fs), pos

    def frames(self, pos: np.ndarray, step: np.ndarray, frames: int) -> np.ndarray:
        """Observation rows of steps ``step - frames + 1 .. step`` (oldest first), [..., frames]:
        before the earliest held step of the episode, its frame repeats."""
        back = np.arange(frames - 1, -1, -1, dtype=np.int64)
        fs, length = self.first_step.take(pos), self.length.take(pos)
        want = step[..., None] - back
        # Within its entry (most stacks): clamped to it, as `frame_rows`; the others walk the chain.
        rows = self.first_row.take(pos)[..., None] + (np.clip(want, fs[..., None], (fs + length)[..., None])
                                                       - fs[..., None])
        cross = ((step - frames + 1 < fs) & (self.prev.take(pos) >= 0)) | \
            ((step >= fs + length) & (self.next.take(pos) >= 0))
        if cross.any():
            rows[cross] = self.locate(pos[cross][:, None], want[cross])[0]
        return rows

    def n_step(self, pos: np.ndarray, step: np.ndarray, reward: np.ndarray, n: int, gamma: float) -> NStep:
        """`n_step` of the transitions at episode ``step`` of entries ``pos``, across pieces:
        windows stop at the last held step of the chain (an open tail's last written one)."""
        offsets = np.arange(n, dtype=np.int64)
        fs = self.first_step.take(pos)
        end = fs + self.length.take(pos)
        # Within its entry (most windows), as `n_step`; the windows that go on walk the chain.
        row = self.first_row.take(pos) + (step - fs)
        steps = np.minimum(n, end - step)   # k <= n held steps ahead
        window = np.minimum(row[..., None] + offsets, (row + steps - 1)[..., None])
        target = row + steps
        cross = (step + n >= end) & (self.next.take(pos) >= 0)   # (a piece may lack a final row of its own)
        if cross.any():
            p, s = pos[cross], step[cross]
            target[cross], at = self.locate(p, s + n)
            steps[cross] = k = self.first_step.take(at) + (target[cross] - self.first_row.take(at)) - s
            window[cross] = self.locate(p[:, None], np.minimum(s[:, None] + offsets, (s + k - 1)[:, None]))[0]
        return _discounted(window, steps, reward, gamma, target, window[..., -1])


def look_ahead(table, chains: PieceChains | None, rows: np.ndarray, pos: np.ndarray, step: np.ndarray,
               first: np.ndarray | None, args: SampleArgs, read: Callable[[str], Any]
               ) -> tuple[dict, np.ndarray | None, np.ndarray | None]:
    """The n-step targets and frame-stack rows of transitions at ``rows``, episode ``step`` of
    the table's entries ``pos`` (``first``: their entries' first rows), as a sample reads them.

    One mechanism for every reader: a local store's rows are its arena's, a Ray reader's
    the rows of its view's blocks placed one after the other (`arrowbuf.ray.across`).
    With ``chains`` (the table's `PieceChains`, when an episode is held in pieces) both go
    across an episode's held pieces; otherwise they stay within each entry.

    Args:
        read: column ``name`` indexable by rows (``read(name)[rows]``), None for a field
            the store lacks (``terminated``, ``truncated`` are read where present).

    Returns:
        (the n-step extras: ``reward``, ``discount``, ``n_steps`` and the flags of the
        window's last step; the observation rows, None for ``rows``; the next-observation
        rows, None for ``rows + 1``).
    """
    n, gamma, frames = args.n_step, args.gamma, args.frame_stack
    extra: dict[str, np.ndarray] = {}
    obs_rows = next_rows = None
    if chains is not None:
        step = step.astype(np.int64, copy=False)
    if n > 1:
        if chains is not None:
            ahead = chains.n_step(pos, step, read("reward"), n, gamma)
        else:
            # The last transition row of the episode (an open tail's last written step). Windows
            # stop at their episode's end: past the longest live episode, a longer n changes
            # nothing but the cost.
            last = first + table.ecol("length").take(pos) - 1
            ahead = n_step(rows, last, read("reward"), min(n, table.longest), gamma)
        next_rows = ahead.next_rows
        extra.update(reward=ahead.reward, discount=ahead.discount, n_steps=ahead.steps)
        for flag in ("terminated", "truncated"):
            column = read(flag)
            if column is not None:
                extra[flag] = column[ahead.last_rows]
    if frames > 1 and chains is not None:
        obs_rows = chains.frames(pos, step, frames)
        next_rows = chains.frames(pos, step + (ahead.steps if n > 1 else 1), frames)
    elif frames > 1:
        obs_rows = frame_rows(rows, first, frames)
        next_rows = frame_rows(rows + 1 if next_rows is None else next_rows, first, frames)
    return extra, obs_rows, next_rows


def piece_chains(table) -> PieceChains:
    """The `PieceChains` of an `arrowbuf.table.EpisodeTable`'s sealed and open entries
    (O(entries)). A link is kept only to a live entry added before, of the same env,
    whose steps end where the entry's begin (a damaged table links nothing else)."""
    first_step, length, env = table.ecol("first_step"), table.ecol("length"), table.ecol("env")
    own = np.arange(len(first_step), dtype=np.int64)
    serial = table.ecol("prev_piece")
    prev = serial - (table.episodes_added - len(table))
    ok = (serial >= 0) & (prev >= 0) & (prev < np.minimum(own, len(table)))
    p = np.where(ok, prev, 0)
    ok &= (env[p] == env) & (first_step[p] + length[p] == first_step)
    prev = np.where(ok, prev, -1)
    nxt = np.full(len(own), -1, np.int64)
    nxt[prev[ok]] = own[ok]
    return PieceChains(table.ecol("first_row"), first_step, length, prev, nxt)


@dataclass(frozen=True)
class RunLookup:
    """Which of consecutive runs of integers holds each unit, in O(1) a unit.

    Run ``i`` is ``[first[i], first[i + 1])`` (the last ends at ``stop``): an episode's
    transition indices. A binary search (``np.searchsorted``) costs about log2(runs)
    mispredicted branches a unit: 157 us for 4,096 indices over 198 episodes here,
    half of a Ray reader's draw. Here units are cut into buckets of ``2**shift``,
    no wider than the shortest run but the last, so a bucket holds the start of at
    most one run: a unit lies in the run that holds its bucket's first unit, or in
    the next one. Build it with `run_lookup`.
    """

    start: int            # first unit of the first run
    shift: int            # log2 of the bucket width
    bucket: np.ndarray    # run holding the first unit of each bucket
    bounds: np.ndarray    # first unit of each run but the first, then ``stop`` (no unit reaches it)

    def __call__(self, units: np.ndarray) -> np.ndarray:
        """The run of each unit (units in ``[start, stop)``; others raise IndexError or are wrong)."""
        run = self.bucket.take((units - self.start) >> self.shift)
        run += units >= self.bounds.take(run)
        return run


def run_lookup(first: np.ndarray, stop: int, max_buckets: int) -> RunLookup | None:
    """A `RunLookup` of runs starting at ``first`` (ascending) and ending at ``stop``;
    None when there is no unit, a run but the last is empty, or the shortest run
    needs more than ``max_buckets`` buckets (a binary search is then the cheaper build)."""
    if not len(first) or stop <= first[0]:
        return None
    start, span = int(first[0]), stop - int(first[0])
    shortest = int(np.diff(first).min()) if len(first) > 1 else span
    if shortest < 1:
        return None
    shift = shortest.bit_length() - 1
    buckets = ((span - 1) >> shift) + 1
    if buckets > max_buckets:
        return None
    bucket = np.searchsorted(first, start + (np.arange(buckets, dtype=np.int64) << shift), side="right") - 1
    return RunLookup(start, shift, bucket.astype(np.intp), np.append(first[1:], stop).astype(np.int64))
