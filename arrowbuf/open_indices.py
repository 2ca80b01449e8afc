"""Indices of open steps that keep naming their step: a kept ``index`` never names another.

An open tail's completed steps (`EpisodeTable.publish_open`) are sampleable at once, and
drawn as integers after the sealed indices; but those numbers are renumbered by every
write (a piece sealed first takes them), so a number handed out would later name another
step. What users get for an open step is a *token* instead: ``TOKEN + (uid << 32) +
offset``, where ``uid`` numbers the open tail (the run of steps that one region of a
writer holds, `arrowbuf.regions`) for as long as it lives, and when it is sealed into a
piece (which keeps its rows and so its steps), and ``offset`` is the step's place in it.
`TailIndices.resolve` turns tokens (and indices) back into what the table samples today:
a sealed piece's index, the open tail's current provisional one, or -1 once the step is
no longer held. So `gather` returns the kept step or drops it, and `update_priorities`
never reaches another step.

A tail is known again from one write to the next by its first row and first step (its
region does not move while it is open); a piece sealed since the last publish takes the
uid of the tail with its first row and first step (matched in one vector step at the
next publish, or when a token is resolved: not one look-up per seal).
"""

from __future__ import annotations

import numpy as np

#: Tokens lie above every index a shard can hand out (2**62: indices count transitions).
TOKEN = 1 << 62
_OFFSET_BITS = 32
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


class TailIndices:
    """Uids of an episode table's open tails and of the pieces they became, and the
    translation between tokens and the table's indices (`arrowbuf.table.EpisodeTable` owns one;
    a loaded table's starts with the uids of its pieces that were tails, ``sealed``, and the next uid)."""

    def __init__(self, sealed: dict[int, int] | None = None, next_uid: int = 0) -> None:
        self.next_uid = next_uid
        # The tails of the last publish: first rows (sorted), their first steps and uids.
        self._rows = np.zeros(0, np.int64)
        self._steps = np.zeros(0, np.int64)
        self._uids = np.zeros(0, np.int64)
        self._published_rows = np.zeros(0, np.int64)
        self._published_steps = np.zeros(0, np.int64)
        self._published_uids = np.zeros(0, np.int64)
        self.sealed: dict[int, int] = sealed or {}   # uid -> serial of the piece it became

    @property
    def any(self) -> bool:
        """Whether the last publish had tails (a piece sealed now may be one of them)."""
        return len(self._rows) > 0

    def publish(self, first_row: np.ndarray, first_step: np.ndarray) -> np.ndarray:
        """The uids of the tails published now (those of the last publish keep theirs)."""
        if (len(first_row) == len(self._published_rows) and np.array_equal(first_row, self._published_rows)
                and np.array_equal(first_step, self._published_steps)):
            return self._published_uids
        at, same = self._find(first_row, first_step)
        fresh = ~same
        uids = np.where(same, self._uids.take(at, mode="clip") if len(self._uids) else 0, 0)
        uids[fresh] = self.next_uid + np.arange(int(fresh.sum()))
        self.next_uid += int(fresh.sum())
        order = np.argsort(first_row, kind="stable")
        self._rows, self._steps, self._uids = first_row[order], first_step[order], uids[order]
        self._published_rows, self._published_steps = first_row.copy(), first_step.copy()
        self._published_uids = uids
        return uids

    def seal(self, first_row: np.ndarray, first_step: np.ndarray, serials: np.ndarray) -> np.ndarray:
        """The uids of pieces sealed (entries ``serials``) from the tails of the last publish
        at their ``first_row`` and ``first_step`` (-1: none, a piece that was no tail)."""
        at, same = self._find(first_row, first_step)
        uids = np.where(same, self._uids.take(at, mode="clip") if len(self._uids) else -1, -1)
        for uid, serial in zip(uids[same].tolist(), serials[same].tolist()):
            self.sealed[uid] = serial
        return uids

    def _find(self, first_row: np.ndarray, first_step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not len(self._rows):
            return np.zeros(len(first_row), np.int64), np.zeros(len(first_row), bool)
        at = np.minimum(np.searchsorted(self._rows, first_row), len(self._rows) - 1)
        return at, (self._rows[at] == first_row) & (self._steps[at] == first_step)

    def forget_before(self, serial: int) -> None:
        """Pieces before entry ``serial`` are gone (evicted): their uids name nothing now."""
        if len(self.sealed) > 64 and min(self.sealed.values()) < serial:
            self.sealed = {u: s for u, s in self.sealed.items() if s >= serial}

    def forget(self, uid: int) -> None:
        """The piece of tail ``uid`` lost its front (`EpisodeTable.trim_oldest`): its tokens
        would now name later steps, so they name nothing."""
        self.sealed.pop(uid, None)

    def clear(self) -> None:
        """Every tail and piece is gone (`EpisodeTable.clear`); uids keep counting."""
        self.sealed.clear()
        self._rows = self._steps = self._uids = np.zeros(0, np.int64)
        self._published_rows = self._published_steps = self._published_uids = np.zeros(0, np.int64)


def tokens(indices: np.ndarray, first_index: np.ndarray, uid: np.ndarray) -> np.ndarray:
    """Tokens of provisional ``indices`` of tails whose first provisional index and uid are given."""
    return TOKEN + (uid.astype(np.int64) << _OFFSET_BITS) + (indices - first_index)


def split(token: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uid, offset) of tokens."""
    rest = token - TOKEN
    return rest >> _OFFSET_BITS, rest & _OFFSET_MASK
