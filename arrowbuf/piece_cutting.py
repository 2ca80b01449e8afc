"""A staged writer's open episodes shipped in pieces: a Ray writer's completed steps travel
before their episode ends.

A `arrowbuf.episodes.StepWriter` over a sink that takes open pieces (a Ray store's
`arrowbuf.ray.sink.RaySink`: ``attach_open``) has a `PieceCutter`, which cuts the
completed steps of each open episode into a *piece* on the sink's delivery timer, once the
oldest of them has waited ``delivery_latency`` (`PieceCutter.cut_due`), and when an env's
staged steps reach a quarter of a shard (`cut_rows`: no episode is too long for the store,
as locally). The writer hands its pieces over (`StepWriter.take_open_pieces`): each an
`arrowbuf.shard.Episode` with ``first_step`` (the step of its first row in the episode)
and ``open=True``, its steps and the observation after its last step (the next one's
first row, sent again with the next piece: one duplicated observation row a piece, as a
local region's). The env's staging then starts over at row 0, so a writer stages at most
the steps of one delivery interval (or a quarter of a shard) per env, not an episode.

The episode's last piece (its end, or `flush`) goes as before, with its ``first_step``
and ``open=False``; a `flush` that finds an env with no step since its last piece tells
the sink to close that episode (`RaySink.close_open`). The shard keeps the open pieces
apart in its counts (`arrowbuf.ray.tails`). A checkpoint ships every staged step first
(`ship_all`), so its shards hold all of them and its writer states only where they go on.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from arrowbuf.shard import Episode


def cut_rows(capacity: int | None) -> int | None:
    """Staged steps of one env at which its piece is cut at once: a quarter of a shard
    (at least 1), so that a piece evicts at most a quarter of its ring; None: no limit."""
    return None if capacity is None else max(1, capacity // 4 - 1)


class PieceCutter:
    """Ships a writer's open steps to its sink as pieces, and keeps their clock (when the
    oldest unshipped one was staged). The sink's timer holds it weakly (`cut_due`); it
    holds the writer weakly: the writer owns it.

    Args:
        writer: the `arrowbuf.episodes.StepWriter` whose staging it cuts.
        sink: the writer's sink (one with ``attach_open``, ``wake`` and ``write``).
    """

    def __init__(self, writer: Any, sink: Any) -> None:
        self._writer = weakref.ref(writer)
        self._sink = sink
        self.since: float | None = None
        sink.attach_open(self)

    @classmethod
    def attach(cls, writer: Any, sink: Any) -> PieceCutter | None:
        """The shipping of ``writer``'s open steps, registered with ``sink``; None when the
        sink takes no open pieces (a local store's: its writers write in place)."""
        return cls(writer, sink) if hasattr(sink, "attach_open") else None

    def staged(self) -> None:
        """A step was staged: start the clock (and the sink's timer) if it is not running."""
        if self.since is None:
            self.since = time.monotonic()
            self._sink.wake()

    def reset(self) -> None:
        """Nothing is staged any more (the writer cut every open episode)."""
        self.since = None

    def cut_full(self, writer: Any) -> int:
        """Ship the open episodes of ``writer`` whose staged steps reached `cut_rows`; the
        pieces written. The caller holds ``writer.lock``."""
        limit = cut_rows(self._sink.capacity)
        return 0 if limit is None else self._write(writer.take_open_pieces(limit))

    def cut_due(self, latency: float) -> int:
        """The sink's timer: ship the completed steps of every open episode as pieces once
        the oldest has waited ``latency`` seconds; the pieces written. Not while the writer
        keeps episodes the store refused (they go first, with the writer's next call)."""
        writer = self._writer()
        if writer is None:
            return 0
        with writer.lock:   # the pieces reach the sink before the writer's next step or end
            if writer.pending or self.since is None or time.monotonic() - self.since < latency:
                return 0
            self.since = None
            return self._write(writer.take_open_pieces())

    def ship_all(self) -> int:
        """Ship the completed steps of every open episode now, whatever their age (a checkpoint
        is taken next: its shards then hold every step); the pieces written."""
        writer = self._writer()
        if writer is None:
            return 0
        with writer.lock:
            if writer.pending:   # kept episodes go first, with the writer's next call
                return 0
            self.since = None
            return self._write(writer.take_open_pieces())

    def _write(self, pieces: list[Episode]) -> int:
        for piece in pieces:
            self._sink.write(piece)
        return len(pieces)
