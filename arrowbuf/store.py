"""`ExperienceStore`: the public store, composing schema, shard, sampler and gather."""

from __future__ import annotations

import json
import threading
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict

from arrowbuf.episodes import StepWriter, read_episode
from arrowbuf.errors import EmptyStoreError, describe
from arrowbuf.samplers import UniformSampler, epoch_ranks
from arrowbuf.schema import Schema
from arrowbuf.shard import MODES, Episode, Shard
from arrowbuf.table import EpisodeTable

BACKENDS = ("local",)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class ExperienceStore:
    """A replay / rollout store of whole episodes, sampled into TensorDicts.

    Rows follow RLDS: one row per step, observations stored once; the ``next``
    observation of step t is read from row t+1 of the same episode. ``len(store)``
    counts transitions: steps that have a next observation (an episode given
    without its final observation stores its last step, but that step is not a
    transition).

    Args:
        capacity: rows the store holds (an episode of T steps with its final
            observation takes T+1 rows).
        seed: seed of the store's `numpy.random.Generator`; sampling is reproducible.
        sampler: how `sample` selects transitions; `UniformSampler` by default.
        schema: an `arrowbuf.Schema` or a mapping name -> `Field`; inferred from
            the first write when None, then enforced.
        mode: "circular" evicts the oldest whole episodes when full; "fixed"
            refuses the write with `CapacityError`.
        backend: "local" (in-process).

    Raises:
        ValueError: a bad argument, named with the value received.
        SchemaError: a bad schema.

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=1_000, seed=0)
        >>> T = 10
        >>> _ = store.add_episode({"obs": np.zeros((T + 1, 4), np.float32), "action": np.zeros(T, np.int64),
        ...                        "reward": np.ones(T, np.float32), "terminated": np.arange(T) == T - 1,
        ...                        "truncated": np.zeros(T, bool)})
        >>> batch = store.sample(32)
        >>> batch["next", "obs"].shape, len(store), store.num_episodes
        (torch.Size([32, 4]), 10, 1)
    """

    def __init__(self, capacity: int, *, seed: int | None = None, sampler: Any = None,
                 schema: Schema | Mapping[str, Any] | None = None, mode: str = "circular",
                 backend: str = "local") -> None:
        self.capacity = _check_int("capacity", capacity, 1)
        if seed is not None:
            _check_int("seed", seed, 0)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        sampler = UniformSampler() if sampler is None else sampler
        if not callable(getattr(sampler, "sample", None)):
            raise ValueError(f"sampler must have a sample(rng, n, table) method, got {describe(sampler)}")
        if schema is not None and not isinstance(schema, Schema):
            schema = Schema(schema)
        self.mode = mode
        self.backend = backend
        self.sampler = sampler
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self._shard: Shard | None = None
        self._empty_table = EpisodeTable()
        if schema is not None:
            self._shard = Shard(schema, self.capacity, mode)

    # -- shape of the store ---------------------------------------------------------

    @property
    def schema(self) -> Schema | None:
        """The enforced schema, or None before the first write."""
        return self._shard.schema if self._shard is not None else None

    @property
    def num_episodes(self) -> int:
        return len(self._shard.table) if self._shard is not None else 0

    def __len__(self) -> int:
        return len(self._shard) if self._shard is not None else 0

    @property
    def _table(self) -> EpisodeTable:
        return self._shard.table if self._shard is not None else self._empty_table

    def __repr__(self) -> str:
        return (f"ExperienceStore(capacity={self.capacity}, transitions={len(self)}, "
                f"episodes={self.num_episodes}, mode={self.mode!r}, sampler={self.sampler!r}, "
                f"schema={self.schema!r})")

    # -- writing ----------------------------------------------------------------------

    def add_episode(self, episode: Any, env_id: str = "default",
                    metadata: Mapping[str, Any] | None = None) -> int:
        """Add one whole episode.

        Args:
            episode: a dict (nested dicts allowed) of numpy arrays / torch tensors, a
                TensorDict, or a pyarrow RecordBatch. Step fields have T rows;
                observation fields T+1 rows (with the final observation) or T.
            env_id: the environment it came from, kept in the episode table.
            metadata: JSON-serializable user metadata kept in the episode table.

        Returns:
            The new episode's id.

        Raises:
            SchemaError: a wrong field name, dtype, shape or ragged lengths.
            CapacityError: longer than the capacity, or a full ``mode="fixed"`` store.
            ValueError: a bad ``env_id`` or ``metadata``.
            Nothing is changed when it raises.
        """
        if not isinstance(env_id, str):
            raise ValueError(f"env_id must be a str, got {env_id!r}")
        if metadata is not None:
            if not isinstance(metadata, Mapping):
                raise ValueError(f"metadata must be a dict or None, got {describe(metadata)}")
            try:
                json.dumps(dict(metadata))
            except (TypeError, ValueError) as err:
                raise ValueError(f"metadata must be JSON-serializable: {err}") from None
        with self._lock:
            checked, schema = read_episode(episode, self.schema, env_id, metadata)
            return self._add(checked, schema)

    def _add(self, episode: Episode, schema: Schema | None = None) -> int:
        with self._lock:
            if self._shard is None:
                shard = Shard(schema, self.capacity, self.mode)
                shard.check_fits(episode)
                self._shard = shard
            return self._shard.add(episode)

    def _set_schema(self, schema: Schema) -> None:
        with self._lock:
            if self._shard is None:
                self._shard = Shard(schema, self.capacity, self.mode)

    def writer(self, num_envs: int, autoreset_mode: str = "next_step",
               env_ids: Sequence[str] | None = None) -> StepWriter:
        """A step writer for ``num_envs`` vectorized environments (see `StepWriter`)."""
        return StepWriter(self._add, lambda: self.schema, self._set_schema, num_envs, autoreset_mode, env_ids)

    def clear(self) -> None:
        """Remove every episode. Indices sampled before stay stale forever."""
        with self._lock:
            if self._shard is not None:
                self._shard.clear()

    # -- sampling ---------------------------------------------------------------------

    def sample(self, batch_size: int, *, device: torch.device | str | None = None,
               pin_memory: bool = False) -> TensorDict:
        """Sample transitions with the store's sampler.

        Args:
            batch_size: transitions to draw.
            device: where the tensors go (default: CPU).
            pin_memory: gather into pinned host memory.

        Returns:
            A TensorDict of batch size [batch_size]: every field at t,
            ``("next", obs)`` for observation fields, ``"index"`` (transition ranks,
            for `update_priorities`), ``"episode_id"`` and ``"step"``.

        Raises:
            ValueError: ``batch_size`` is not an int >= 1.
            EmptyStoreError: the store holds no transition.
        """
        batch_size = _check_int("batch_size", batch_size, 1)
        with self._lock:
            self._require_data()
            ranks = self.sampler.sample(self._rng, batch_size, self._shard.table)
            return self._gather(ranks, device, pin_memory)

    def _gather(self, ranks: np.ndarray, device: Any, pin_memory: bool) -> TensorDict:
        rows = self._shard.rows_of(ranks)
        return self._shard.gather(rows, {("index",): torch.from_numpy(ranks)}, device, pin_memory)

    def _require_data(self) -> None:
        if not len(self):
            raise EmptyStoreError(f"cannot sample: the store holds 0 transitions ({self.num_episodes} episodes); "
                                  "add episodes first")

    def iter_batches(self, batch_size: int, shuffle: bool = True, drop_last: bool = False, *,
                     device: torch.device | str | None = None) -> Iterator[TensorDict]:
        """Every stored transition once (an on-policy epoch), in batches.

        Transitions evicted while the epoch runs are skipped, not replaced.

        Args:
            batch_size: transitions per batch.
            shuffle: random order (from the store's generator), else insertion order.
            drop_last: drop the last batch if it is short.
            device: where the tensors go.

        Raises:
            ValueError: ``batch_size`` is not an int >= 1.
        """
        batch_size = _check_int("batch_size", batch_size, 1)
        with self._lock:
            first, stop = self._table.first_live_rank, self._table.next_rank
            chunks = epoch_ranks(self._rng, batch_size, first, stop, shuffle, drop_last)
        for ranks in chunks:
            with self._lock:
                live = ranks[self._table.is_live(ranks)]
                if len(live):
                    batch = self._gather(live, device, False)
            if len(live):
                yield batch

    # -- views -------------------------------------------------------------------------

    def episodes(self) -> pa.Table:
        """The episode table (one row per live episode, oldest first)."""
        with self._lock:
            return self._table.to_arrow()

    def episode(self, episode_id: int) -> pa.RecordBatch:
        """One episode's rows as a zero-copy RecordBatch (valid until it is evicted).

        Raises:
            KeyError: no live episode has this id.
        """
        with self._lock:
            if self._shard is not None:
                position = self._table.position_of(int(episode_id))
                if 0 <= position < len(self._table) and self._table.col("episode_id")[position] == episode_id:
                    return self._shard.episode_view(int(position))
            ids = self._table.col("episode_id")
            live = f"{ids[0]}..{ids[-1]}" if len(ids) else "none"
            raise KeyError(f"episode {episode_id!r} is not in the store (live episode ids: {live})")

    def to_arrow(self) -> pa.Table:
        """Every stored row, oldest episode first, as zero-copy chunks of the arena."""
        with self._lock:
            if self._shard is None:
                return pa.table({})
            return self._shard.to_arrow()

