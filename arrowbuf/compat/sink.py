"""The store behind a DataBuffer: created at the first finished episode, sized and placed
from the config, and the seed's capacity rules applied to every episode written to it."""

from __future__ import annotations

import logging

import numpy as np
import torch
from typing import Any

from arrowbuf.compat.config import BufferSettings
from arrowbuf.compat.placement import Placement
from arrowbuf.compat.segments import Piece, Window
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
        rows = self.settings.capacity   # the seed's capacity, in transitions: the store's unit too
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

    def write(self, pieces: list[Piece | Window]) -> None:
        """Store finished episodes (on Ray each write waits for its shard's answer, so a shard's
        error surfaces here; the reads flush first: `arrowbuf.compat.reading.Reader.space`).

        A `Window` (a vector env's rollout window) is stored with one ``add_episodes``
        call when all of it fits; otherwise episode by episode, as its pieces. A circular
        buffer stores the pieces between windows with one ``add_episodes`` each (one run of
        the ring, `arrowbuf.block_add`), and on Ray all of a write's episodes with one (one
        request a shard: a rollout's end is thousands of episodes, each a round trip on its own).

        Raises:
            BufferFullError: a full fixed-mode buffer (episodes before it are kept).
            SchemaError: an episode that does not match the stored fields.
        """
        circular = self.settings.mode == "circular"
        windows = not (circular and self.placement.backend == "ray")   # on Ray: all of them in one request a shard
        singles: list[Piece] = []   # (circular) pieces not yet written, in order
        for piece in pieces:
            if isinstance(piece, Window):
                if piece.steps < 1 or not piece.envs:
                    continue
                if windows and self._fits_whole(piece):
                    self._write_all(singles)   # the pieces before it first: written order is eviction order
                    singles = []
                    self._write_window(piece)
                    continue
                parts = piece.pieces()
            else:
                parts = [piece]
            if circular:
                singles += [part for part in parts if part.steps >= 1]
                continue
            for part in parts:
                self._write_piece(part)
        self._write_all(singles)

    def _fits_whole(self, window: Window) -> bool:
        """Whether every episode of ``window`` is stored as given (no capacity cut, no fixed-mode refusal)."""
        if self.settings.mode == "fixed":
            limit = self.settings.capacity * self.placement.num_shards
            return self.stored_transitions + window.steps * len(window.envs) <= limit
        return window.steps <= self.settings.capacity

    def _write_window(self, window: Window) -> None:
        store = self._ensure_store(window.steps)
        self._pin(store, window.env_ids)
        full = window.envs == list(range(len(window.envs)))
        columns = {name: _env_major(value, None if full else window.envs) for name, value in window.columns.items()}
        count = len(window.envs)
        with self._timers.timed("add_episode"):
            store.add_episodes(unflatten(_with_flags(columns, (count, window.steps))), env_ids=window.env_ids)
        self.stored_transitions += window.steps * count

    def _write_all(self, pieces: list[Piece]) -> None:
        """Store ``pieces`` of a circular buffer with one ``add_episodes`` (each cut to the capacity)."""
        if not pieces:
            return
        store = self._ensure_store(pieces[0].steps)
        episodes = [self._cut(piece) for piece in pieces]
        self._pin(store, [piece.env_id for piece in pieces])
        with self._timers.timed("add_episode"):
            store.add_episodes([unflatten(_with_flags(columns, (steps,))) for columns, steps in episodes],
                               env_ids=[piece.env_id for piece in pieces])
        self.stored_transitions += sum(steps for _, steps in episodes)

    def _pin(self, store: ExperienceStore, env_ids: list[str]) -> None:
        """Route each env to the shard node affinity gives it (`Placement.shard_of_env`: a sub-env
        ``<worker>/<i>`` to its worker's), if any."""
        for env_id in env_ids:
            shard = self.placement.shard_of_env(env_id)
            if shard is not None:
                store.pin_env(env_id, shard)

    def _cut(self, piece: Piece) -> tuple[dict[str, Any], int]:
        """A circular buffer's episode cut to the capacity (the seed's ring keeps its newest rows): (columns, steps)."""
        capacity, columns, steps = self.settings.capacity, piece.columns, piece.steps
        if steps > capacity:
            logger.warning("episode of %d transitions from env %r is longer than the capacity %d; "
                           "keeping its last %d", steps, piece.env_id, capacity, capacity)
            columns = {name: column[-(capacity + 1):] if len(column) == steps + 1 else column[-capacity:]
                       for name, column in columns.items()}
            steps = capacity
        return columns, steps

    def _write_piece(self, piece: Piece) -> None:
        """Store one episode (cut to the capacity, as the seed's ring keeps its newest rows); none of no step."""
        capacity = self.settings.capacity
        columns, steps = piece.columns, piece.steps
        if steps < 1:
            return
        store = self._ensure_store(steps)
        if self.settings.mode == "fixed":
            limit = capacity * self.placement.num_shards
            if self.stored_transitions + steps > limit:
                raise BufferFullError(
                    f"buffer is full (storage.mode='fixed'): {self.stored_transitions} of {limit} transitions "
                    f"stored, the episode of {steps} from env {piece.env_id!r} does not fit; clear() or sample "
                    "a RolloutBuffer first")
        else:
            columns, steps = self._cut(piece)
        self._pin(store, [piece.env_id])
        with self._timers.timed("add_episode"):
            store.add_episode(unflatten(_with_flags(columns, (steps,))), env_id=piece.env_id)
        self.stored_transitions += steps

    def clear(self) -> None:
        if self.store is not None:
            self.store.clear()
        self.stored_transitions = 0


def _with_flags(columns: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """``columns`` with False ``terminated`` / ``truncated`` of ``shape`` ([T], or [E, T] for a
    window) where they are missing: the seed's records default ``last_terminated`` and
    ``last_truncated`` to False, and a store refuses inferred episodes without terminal flags."""
    missing = [flag for flag in ("terminated", "truncated")
               if flag not in columns and not any(name.startswith(flag + ".") for name in columns)]
    return {**columns, **{flag: np.zeros(shape, bool) for flag in missing}} if missing else columns


def _env_major(value: Any, envs: list[int] | None) -> Any:
    """A window column ``[T, num_envs, ...]`` as ``[E, T, ...]`` (a view; with ``envs``, those sub-envs)."""
    if isinstance(value, torch.Tensor):
        value = value if envs is None else value[:, envs]
        return value.transpose(0, 1)
    value = np.asarray(value)
    return np.swapaxes(value if envs is None else value[:, envs], 0, 1)
