"""The store behind a DataBuffer: created at the first finished episode, sized and placed
from the config, and the seed's capacity rules applied to every episode written to it."""

from __future__ import annotations

import logging
import math

import numpy as np
from typing import Any

from arrowbuf.compat.config import BufferSettings
from arrowbuf.compat.placement import Placement
from arrowbuf.compat.segments import Piece
from arrowbuf.compat.timing import Timers
from arrowbuf.errors import CapacityError
from arrowbuf.schema import unflatten
from arrowbuf.store import ExperienceStore

logger = logging.getLogger(__name__)


class BufferFullError(CapacityError, RuntimeError):
    """A ``storage.mode="fixed"`` buffer cannot take an episode (a RuntimeError, as the seed raised)."""


class StoreSink:
    """Writes finished episodes into an `ExperienceStore` (local, or Ray shards).

    Args:
        settings: the checked buffer config.
        placement: backend, shards and node affinity.
        seed: the store's seed.
        ray_options: `arrowbuf.RayOptions` for a Ray store.
        timers: where ``add_episode`` calls are timed.
    """

    def __init__(self, settings: BufferSettings, placement: Placement, seed: int | None, ray_options: Any,
                 timers: Timers) -> None:
        self.settings = settings
        self.placement = placement
        self._seed = seed
        self._ray_options = ray_options
        self._timers = timers
        self.store: ExperienceStore | None = None
        self.stored_transitions = 0          # since the last clear (fixed-mode accounting)

    def _ensure_store(self, first_length: int) -> ExperienceStore:
        if self.store is not None:
            return self.store
        capacity = self.settings.capacity
        if self.settings.mode == "fixed":
            rows = 2 * capacity + 2   # never the limit: the compat layer refuses at `capacity` transitions
        else:                          # capacity transitions + a final-observation row per episode + a tail
            rows = capacity + math.ceil(capacity / max(first_length, 1)) + first_length + 1
        placement = self.placement
        if placement.backend == "ray":
            options = self._ray_options
            if options is None and placement.shard_nodes is not None and "driver" not in placement.shard_nodes:
                from arrowbuf.ray.options import RayOptions

                options = RayOptions(nodes=list(placement.shard_nodes))
            store = ExperienceStore(rows * placement.num_shards, backend="ray", num_shards=placement.num_shards,
                                    seed=self._seed, mode=self.settings.mode, ray_options=options)
        else:
            store = ExperienceStore(rows, seed=self._seed, mode=self.settings.mode)
        self.store = store
        return store

    def write(self, pieces: list[Piece]) -> None:
        """Store finished episodes; on Ray, flushed so a shard's error surfaces here.

        Raises:
            BufferFullError: a full fixed-mode buffer (episodes before it are kept).
            SchemaError: an episode that does not match the stored fields.
        """
        wrote = False
        capacity = self.settings.capacity
        for piece in pieces:
            columns, steps = piece.columns, piece.steps
            if steps < 1:
                continue
            store = self._ensure_store(steps)
            if self.settings.mode == "fixed":
                limit = capacity * self.placement.num_shards
                if self.stored_transitions + steps > limit:
                    raise BufferFullError(
                        f"buffer is full (storage.mode='fixed'): {self.stored_transitions} of {limit} transitions "
                        f"stored, the episode of {steps} from env {piece.env_id!r} does not fit; clear() or sample "
                        "a RolloutBuffer first")
            elif steps > capacity:
                logger.warning("episode of %d transitions from env %r is longer than the capacity %d; "
                               "keeping its last %d", steps, piece.env_id, capacity, capacity)
                columns = {name: column[-(capacity + 1):] if len(column) == steps + 1 else column[-capacity:]
                           for name, column in columns.items()}
                steps = capacity
            shard = self.placement.shard_of_env(piece.env_id)
            if shard is not None:
                store.pin_env(piece.env_id, shard)
            with self._timers.timed("add_episode"):
                store.add_episode(unflatten(_with_flags(columns, steps)), env_id=piece.env_id)
            self.stored_transitions += steps
            wrote = True
        if wrote and self.placement.backend == "ray":
            self.store.flush()

    def clear(self) -> None:
        if self.store is not None:
            self.store.clear()
        self.stored_transitions = 0


def _with_flags(columns: dict[str, Any], steps: int) -> dict[str, Any]:
    """``columns`` with False ``terminated`` / ``truncated`` where they are missing: the
    seed's records default ``last_terminated`` and ``last_truncated`` to False, and a
    store refuses inferred episodes without terminal flags."""
    missing = [flag for flag in ("terminated", "truncated")
               if flag not in columns and not any(name.startswith(flag + ".") for name in columns)]
    return {**columns, **{flag: np.zeros(steps, bool) for flag in missing}} if missing else columns
