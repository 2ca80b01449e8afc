"""A staged writer's open episodes shipped in pieces: a Ray writer's completed steps travel
before their episode ends.

A `arrowbuf.episodes.StepWriter` over a sink that takes open pieces (a Ray store's
`arrowbuf.ray.sink.RaySink`: ``attach_open``) cuts the completed steps of each open
episode into a *piece* on the sink's delivery timer, once the oldest of them has waited
``delivery_latency`` (`OpenShipping.due`), and when an env's staged steps reach a quarter
of a shard (`cut_rows`: no episode is too long for the store, as locally). A piece is an
`arrowbuf.shard.Episode` with ``first_step`` (the step of its first row in the episode)
and ``open=True``: its steps, and the observation after its last step (the next one's
first row, sent again with the next piece: one duplicated observation row a piece, as a
local region's). The env's staging then starts over at row 0, so a writer stages at most
the steps of one delivery interval (or a quarter of a shard) per env, not an episode.

The episode's last piece (its end, or `flush`) goes as before, with its ``first_step``
and ``open=False``; a `flush` that finds an env with no step since its last piece tells
the sink to close that episode (`RaySink.close_open`). The shard keeps the open pieces
apart in its counts (`arrowbuf.ray.tails`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from arrowbuf.arena import owned_copy
from arrowbuf.shard import Episode


def cut_rows(capacity: int | None) -> int | None:
    """Staged steps of one env at which its piece is cut at once: a quarter of a shard
    (at least 1), so that a piece evicts at most a quarter of its ring; None: no limit."""
    return None if capacity is None else max(1, capacity // 4 - 1)


class OpenShipping:
    """A writer's clock for its open steps (when the oldest unshipped one was staged)."""

    def __init__(self, wake: Any) -> None:
        self.since: float | None = None
        self.wake = wake   # starts the sink's delivery timer

    def staged(self) -> None:
        """A step was staged: start the clock (and the sink's timer) if it is not running."""
        if self.since is None:
            self.since = time.monotonic()
            self.wake()

    def due(self, latency: float) -> bool:
        return self.since is not None and time.monotonic() - self.since >= latency


def attach(writer: Any) -> OpenShipping | None:
    """The clock of a staged ``writer`` whose sink takes open pieces (registered with it), else None."""
    if writer._inplace is not None or not hasattr(writer._sink, "attach_open"):
        return None
    writer._sink.attach_open(writer)
    return OpenShipping(writer._sink.wake)


def cut_due(writer: Any, latency: float) -> int:
    """The sink's timer: ship the completed steps of every open episode of ``writer`` as
    pieces once the oldest has waited ``latency`` seconds; the pieces written."""
    with writer._lock:
        if writer._pending or writer._ships is None or not writer._ships.due(latency):
            return 0
        writer._ships.since = None
        return cut(writer, np.flatnonzero((writer._pos > 0) & ~writer._refused))


def cut(writer: Any, envs: np.ndarray) -> int:
    """Ship the staged steps of ``envs`` (each with at least one) as open pieces to the
    writer's sink, and start their staging over; returns the pieces written.
    The caller holds the writer's lock."""
    schema = writer._sink.schema
    stage, pos, first = writer._stage, writer._pos, writer._first_step
    for i in envs.tolist():
        steps = int(pos[i])
        for name, last in writer._last_next.items():   # the observation after the last step
            stage[name][i, steps] = last[i]
        columns = {name: owned_copy(stage[name][i, :steps + (1 if f.observation else 0)])
                   for name, f in schema.input_fields.items()}
        writer._sink.write(Episode(columns, steps, True, writer.env_ids[i], owned=True,
                                   first_step=int(first[i]), open=True))
        first[i] += steps
        pos[i] = 0
    return len(envs)
