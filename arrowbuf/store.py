"""`ExperienceStore`: the public store, composing schema, shard, sampler and gather."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict

from arrowbuf._bounds import check_arena, check_batch
from arrowbuf._stats import priority_histogram, reuse_summary, store_html
from arrowbuf._writers import WriterRegistry
from arrowbuf.episodes import StepWriter, read_episode
from arrowbuf.errors import EmptyStoreError, RateLimited, SchemaError, describe
from arrowbuf.indexing import frame_rows, n_step
from arrowbuf.rate_limiters import RateLimiter
from arrowbuf.samplers import (PrioritizedSampler, Sampler, Selection, UniformSampler, WithoutReplacementSampler,
                               epoch_batches, select_ranks)
from arrowbuf.schema import Schema
from arrowbuf.shard import MODES, Episode, Shard
from arrowbuf.table import EpisodeTable
from arrowbuf.tensors import Payload, check_device

BACKENDS = ("local", "ray")


class _LocalSink:
    """Sends a writer's sealed episodes straight into an embedded store."""

    def __init__(self, store: "ExperienceStore", timeout: float | None) -> None:
        self._store = store
        self.timeout = timeout   # public: claiming a restored writer sets it

    @property
    def schema(self) -> Schema | None:
        return self._store.schema

    @property
    def capacity(self) -> int:
        return self._store.capacity

    def set_schema(self, schema: Schema) -> None:
        self._store._set_schema(schema)

    def write(self, episode: Episode) -> None:
        self._store._add(episode, timeout=self.timeout)

    def commit(self) -> None:
        """Writes are synchronous: nothing to send."""

    def flush(self) -> None:
        """Writes are synchronous: nothing to wait for."""


def _as_numpy(value: Any, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()   # numpy has no bfloat16
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an array or tensor, got {describe(value)}") from None


def _check_workers(batch_size: int, num_workers: int | None) -> None:
    if num_workers is not None:
        _check_int("num_workers", num_workers, 1)
        if batch_size % num_workers:
            raise ValueError(f"batch_size {batch_size} is not a multiple of num_workers={num_workers}")


def check_timeout(timeout: Any) -> float | None:
    """A rate-limiter wait: None (do not wait) or seconds >= 0, ``math.inf`` for no limit.

    Raises:
        ValueError: anything else (NaN, negative, not a number).
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None (do not wait) or seconds >= 0 (math.inf: no limit), got {timeout!r}")
    # Waits past threading's limit (about 292 years) cannot be timed: they are unlimited.
    return math.inf if timeout > threading.TIMEOUT_MAX else float(timeout)


def _check_write_args(env_id: Any, metadata: Any, timeout: Any) -> float | None:
    """Check `add_episode`'s arguments besides the episode; returns the timeout."""
    timeout = check_timeout(timeout)
    if not isinstance(env_id, str):
        raise ValueError(f"env_id must be a str, got {env_id!r}")
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise ValueError(f"metadata must be a dict or None, got {describe(metadata)}")
        try:
            json.dumps(dict(metadata))
        except (TypeError, ValueError) as err:
            raise ValueError(f"metadata must be JSON-serializable: {err}") from None
    return timeout


def _check_episode_id(episode_id: Any) -> None:
    if isinstance(episode_id, bool) or not isinstance(episode_id, (int, np.integer)):
        raise ValueError(f"episode_id must be an int (an id from episodes()), got {episode_id!r}")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if type(value) is int and value >= minimum:   # the common case, checked first
        return value
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
        sampler: how `sample` selects transitions (a `Sampler`: `UniformSampler`
            by default, `PrioritizedSampler`, `SequenceSampler`, ...); one per store.
        rate_limiter: when sampling and inserting may proceed (`MinSize`,
            `SampleToInsertRatio`); unlimited by default.
        schema: an `arrowbuf.Schema` or a mapping name -> `Field`; inferred from
            the first write when None, then enforced.
        mode: "circular" evicts the oldest whole episodes when full; "fixed"
            refuses the write with `CapacityError`.
        backend: "local" (in-process) or "ray" (sharded Ray actors; see
            `arrowbuf.ray_backend.RayExperienceStore` for its extra arguments).
        num_shards: shards of a Ray store (1 for the local backend).
        track_reuse: count how often each stored step is sampled, for the
            ``"reuse"`` entry of `stats` (costs ~5-10% of a small-row sample).

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

    def __new__(cls, *args: Any, backend: str = "local", **kwargs: Any) -> "ExperienceStore":
        if cls is ExperienceStore and backend == "ray":
            from arrowbuf.ray_backend import RayExperienceStore

            return super().__new__(RayExperienceStore)
        return super().__new__(cls)

    def __init__(self, capacity: int, *, seed: int | None = None, sampler: Any = None,
                 schema: Schema | Mapping[str, Any] | None = None, mode: str = "circular",
                 backend: str = "local", rate_limiter: RateLimiter | None = None, num_shards: int = 1,
                 track_reuse: bool = False) -> None:
        self.capacity = _check_int("capacity", capacity, 1)
        if num_shards != 1:
            raise ValueError(f"num_shards={num_shards!r} needs backend='ray'; the local backend has one shard")
        if seed is not None:
            seed = _check_int("seed", seed, 0)   # a plain int (it is saved as JSON)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        sampler = UniformSampler() if sampler is None else sampler
        if not isinstance(sampler, Sampler):
            raise ValueError(f"sampler must be an arrowbuf Sampler (UniformSampler(), PrioritizedSampler(), ...), "
                             f"got {describe(sampler)}")
        rate_limiter = RateLimiter() if rate_limiter is None else rate_limiter
        if not isinstance(rate_limiter, RateLimiter):
            raise ValueError(f"rate_limiter must be an arrowbuf RateLimiter (MinSize, SampleToInsertRatio), "
                             f"got {describe(rate_limiter)}")
        if schema is not None and not isinstance(schema, Schema):
            schema = Schema(schema)
        self.mode = mode
        self.backend = backend
        self.sampler = sampler
        self.rate_limiter = rate_limiter
        if not isinstance(track_reuse, bool):
            raise ValueError(f"track_reuse must be True or False, got {track_reuse!r}")
        self.track_reuse = track_reuse
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)   # wakes callers waiting on the rate limiter
        self._shard: Shard | None = None
        self._empty_table = EpisodeTable()
        self._shard_position = (0, 1)   # (shard, num_shards): set by a Ray shard actor
        self._created = time.monotonic()
        self.created_at = time.time()              # wall clock, recorded in exports and checkpoints
        self._writers = WriterRegistry()           # writers by name: `save` stores their open episodes
        self._checkpoints: dict[str, str] = {}     # checkpoint dir -> token of the save made or loaded here
        if schema is not None:
            self._shard = self._new_shard(schema)

    @classmethod
    def attach(cls, name: str, seed: int | None = None, ray_options: Any = None) -> "ExperienceStore":
        """Connect to a running Ray store by its name, from any process of the cluster.

        Raises:
            ValueError: no store of that name is running.
        """
        from arrowbuf.ray_backend import RayExperienceStore

        return RayExperienceStore.attach(name, seed=seed, ray_options=ray_options)

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
                    metadata: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> int:
        """Add one whole episode.

        Args:
            episode: a dict (nested dicts allowed) of numpy arrays / torch tensors, a
                TensorDict, or a pyarrow RecordBatch. Step fields have T rows;
                observation fields T+1 rows (with the final observation) or T.
            env_id: the environment it came from, kept in the episode table.
            metadata: JSON-serializable user metadata kept in the episode table.
            timeout: seconds to wait for the rate limiter to allow the insert
                (other threads sampling); None raises at once.

        Returns:
            The new episode's id.

        Raises:
            SchemaError: a wrong field name, dtype, shape or ragged lengths.
            CapacityError: longer than the capacity, or a full ``mode="fixed"`` store.
            RateLimited: the rate limiter refuses the insert (after ``timeout``).
            ValueError: a bad ``env_id`` or ``metadata``.
            Nothing is changed when it raises.
        """
        timeout = _check_write_args(env_id, metadata, timeout)
        with self._lock:
            checked, schema = read_episode(episode, self.schema, env_id, metadata)
            return self._add(checked, schema, timeout)

    def _add(self, episode: Episode, schema: Schema | None = None, timeout: float | None = None) -> int:
        with self._changed:
            shard = self._shard if self._shard is not None else self._make_shard(schema)
            plan = shard.check_fits(episode)
            transitions = shard.transitions_of(episode)
            limiter = self.rate_limiter
            limited = type(limiter) is not RateLimiter   # the plain one only counts
            if limited:
                self._wait(lambda: limiter.can_insert(transitions), timeout,
                           lambda: limiter.why_not_insert(transitions))
                if self._shard is not None and shard is not self._shard:
                    # Another thread made the store's first write while this one waited.
                    if self._shard.schema != shard.schema:
                        raise SchemaError(f"episode of {shard.schema} does not match the store's {self.schema}")
                    shard = self._shard
                plan = shard.check_fits(episode)   # other threads may have written while we waited
            if self._shard is None:
                self._bind(shard)
            episode_id = shard.add(episode, plan)
            limiter.inserts += transitions
            if limited:
                self._changed.notify_all()
            return episode_id

    def _make_shard(self, schema: Schema) -> Shard:
        shard, num_shards = self._shard_position
        check_arena(schema, self.capacity)
        return Shard(schema, self.capacity, self.mode, shard=shard, num_shards=num_shards)

    def _new_shard(self, schema: Schema) -> Shard:
        shard = self._make_shard(schema)
        self._bind(shard)
        return shard

    def _bind(self, shard: Shard) -> None:
        self.sampler.bind(shard)
        if self.track_reuse:
            shard.track_reuse()
        self._shard = shard

    def _set_schema(self, schema: Schema) -> None:
        with self._lock:
            if self._shard is None:
                self._new_shard(schema)

    def _wait(self, allowed: Callable[[], bool], timeout: float | None, why: Callable[[], str]) -> None:
        if allowed():
            return
        if timeout is None or not self._changed.wait_for(allowed, None if math.isinf(timeout) else timeout):
            raise RateLimited(why() + (f" Waited {timeout} s." if timeout else ""))

    def writer(self, num_envs: int, autoreset_mode: str = "next_step",
               env_ids: Sequence[str] | None = None, *, timeout: float | None = None,
               name: str | None = None) -> StepWriter:
        """A step writer for ``num_envs`` vectorized environments (see `StepWriter`).

        ``timeout`` is how long a sealed episode waits for the rate limiter.
        ``name`` identifies the writer in checkpoints (default ``writer-<k>``):
        `save` stores the open episodes of every writer still referenced, and on a
        loaded store ``writer(..., name=name)`` hands back the restored writer with
        those episodes (see `writers`).

        Raises:
            ValueError: a bad argument; a writer of this name is already open; a
                restored writer of this name has another num_envs, mode or env_ids.
        """
        if name is not None and not (isinstance(name, str) and name):
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        timeout = check_timeout(timeout)
        with self._lock:
            claimed = self._writers.claim(name, num_envs, autoreset_mode, env_ids) if name else None
            if claimed is not None:
                writer, sink = claimed
                sink.timeout = timeout
                return writer
            sink = _LocalSink(self, timeout)
            writer = StepWriter(sink, num_envs, autoreset_mode, env_ids)
            self._writers.add(name or self._writers.new_name(), writer, sink)
            return writer

    @property
    def writers(self) -> dict[str, StepWriter]:
        """Writers by name: those still referenced, and after `load` the restored
        ones (held by the store until claimed with ``writer(..., name=name)``)."""
        with self._lock:
            return self._writers.live()

    def clear(self) -> None:
        """Remove every episode. Indices sampled before stay stale forever."""
        with self._lock:
            if self._shard is not None:
                self._shard.clear()

    # -- sampling ---------------------------------------------------------------------

    def sample(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
               device: torch.device | str | None = None, pin_memory: bool = False,
               timeout: float | None = None, num_workers: int | None = None) -> TensorDict | list[TensorDict]:
        """Sample transitions with the store's sampler.

        Args:
            batch_size: transitions (or windows, or episodes) to draw.
            n_step: with n > 1, ``"reward"`` is the discounted sum of the next n
                rewards (fewer at the episode end), ``("next", obs)`` the observation
                after them, ``"terminated"``/``"truncated"`` the flags of the last of
                them, ``"discount"`` gamma^k and ``"n_steps"`` k.
            gamma: discount of the n-step return.
            frame_stack: with k > 1, observation fields (and their ``next``) hold the
                last k frames on a new axis after the batch dims, oldest first, the
                episode's first frame repeated before it starts.
            device: where the tensors go (default: CPU).
            pin_memory: gather into pinned host memory (ignored without CUDA).
            timeout: seconds to wait for the rate limiter; None raises at once.
            num_workers: split the batch into this many disjoint, equal batches
                (one per train worker) and return them as a list.

        Returns:
            A TensorDict of batch size [batch_size] ([batch_size, L] for sequence
            and episode samplers): every field at t, ``("next", obs)`` for
            observation fields, ``"index"`` (transition ranks, for
            `update_priorities`), ``"episode_id"`` and ``"step"``, plus the
            sampler's ``"weight"`` or ``"mask"``.

        Raises:
            ValueError: a bad argument.
            EmptyStoreError: the store holds no transition.
            RateLimited: the rate limiter refuses the sample (after ``timeout``).
        """
        batch_size = _check_int("batch_size", batch_size, 1)
        if n_step != 1 or frame_stack != 1 or gamma != 0.99 or type(n_step) is not int or type(frame_stack) is not int:
            self._check_sample_args(n_step, gamma, frame_stack)
        device = check_device(device)
        timeout = check_timeout(timeout)
        _check_workers(batch_size, num_workers)
        if num_workers is not None and isinstance(self.sampler, WithoutReplacementSampler) \
                and not self.sampler.drop_last:
            raise ValueError("num_workers needs full batches; WithoutReplacementSampler(drop_last=False) "
                             "returns a short one at each epoch's end: use drop_last=True")
        limiter = self.rate_limiter
        limited = type(limiter) is not RateLimiter   # the plain one only counts
        with self._changed:
            if limited:
                self._wait(lambda: limiter.can_sample(batch_size, len(self)), timeout,
                           lambda: limiter.why_not_sample(batch_size, len(self)))
            self._require_data()
            check_batch(self._shard.schema, self.sampler, self._shard.table, batch_size, frame_stack)
            selection = self.sampler.sample(self._rng, batch_size, self._shard.table)
            batch = self._gather(selection, n_step, gamma, frame_stack, device, pin_memory)
            limiter.samples += selection.rows.size
            if limited:
                self._changed.notify_all()
        return self._split_workers(batch, num_workers)

    def _check_sample_args(self, n_step: int, gamma: float, frame_stack: int) -> None:
        _check_int("n_step", n_step, 1)
        _check_int("frame_stack", frame_stack, 1)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
        schema = self.schema
        if n_step > 1 and (schema is None or "reward" not in schema.fields):
            raise ValueError("n_step > 1 needs a 'reward' field; the schema has "
                             f"{list(schema.fields) if schema else 'no fields yet'}")
        if n_step > 1 and schema.fields["reward"].shape != ():
            raise ValueError(f"n_step > 1 needs a scalar 'reward' field; it has shape {schema.fields['reward'].shape}")

    @staticmethod
    def _split_workers(batch: TensorDict, num_workers: int | None) -> TensorDict | list[TensorDict]:
        if num_workers is None:
            return batch
        return list(batch.split(batch.batch_size[0] // num_workers, dim=0))

    def _gather(self, selection: Selection, n: int = 1, gamma: float = 1.0, frames: int = 1,
                device: Any = None, pin_memory: bool = False) -> TensorDict:
        rows, extra, obs_rows, next_rows = self._gather_args(selection, n, gamma, frames)
        batch = self._shard.gather(rows, extra, device, pin_memory, obs_rows=obs_rows, next_rows=next_rows)
        self._count_samples(selection)
        return batch

    def _payload(self, selection: Selection, n: int = 1, gamma: float = 1.0, frames: int = 1,
                 pin_memory: bool = False, index_base: int = 0) -> Payload:
        """Gather a selection (plus n-step / frame-stack look-ups) into a `Payload`."""
        rows, extra, obs_rows, next_rows = self._gather_args(selection, n, gamma, frames, index_base)
        payload = self._shard.gather.payload(rows, extra, pin_memory, obs_rows=obs_rows, next_rows=next_rows)
        self._count_samples(selection)
        return payload

    def _count_samples(self, selection: Selection) -> None:
        """Count a gathered selection's rows when the shard tracks reuse."""
        if self._shard.reuse is not None:
            self._shard.count_samples(selection.rows, selection.extra.get("mask"))

    def _gather_args(self, selection: Selection, n: int, gamma: float, frames: int,
                     index_base: int = 0) -> tuple[np.ndarray, dict, np.ndarray | None, np.ndarray | None]:
        """(rows, extra arrays, observation rows, next-observation rows) of a selection."""
        shard = self._shard
        table = shard.table
        rows, pos = selection.rows, selection.pos
        # episode_id and step come from the episode table, not from per-row columns.
        step = selection.step
        first = table.col("first_row").take(pos) if step is None or n > 1 or frames > 1 else None
        extra = {"index": selection.ranks + index_base if index_base else selection.ranks,
                 "episode_id": table.col("episode_id").take(pos),
                 "step": (rows - first if step is None else step).astype(np.int32), **selection.extra}
        obs_rows = next_rows = None
        if n > 1:
            last = first + table.col("length").take(pos) - 1   # the episode's last transition row
            # Windows stop at their episode's end: past the longest live episode, a
            # longer n changes nothing but the cost.
            ahead = n_step(rows, last, shard.arena["reward"], min(n, table.longest), gamma)
            next_rows = ahead.next_rows
            extra.update(reward=ahead.reward, discount=ahead.discount, n_steps=ahead.steps)
            for flag in ("terminated", "truncated"):
                if flag in shard.schema.fields:
                    extra[flag] = shard.arena[flag][ahead.last_rows]
        if frames > 1:
            obs_rows = frame_rows(rows, first, frames)
            next_rows = frame_rows(rows + 1 if next_rows is None else next_rows, first, frames)
        return rows, extra, obs_rows, next_rows

    def update_priorities(self, index: Any, priority: Any) -> int:
        """Set the priorities of sampled transitions (`PrioritizedSampler` only).

        Args:
            index: a batch's ``"index"`` (tensor or array of ints).
            priority: new priorities (e.g. ``td_error.abs()``), same length, >= 0.

        Returns:
            How many indices were still live; the others (evicted since the sample)
            are ignored, never applied to the rows that replaced them.

        Raises:
            ValueError: not a prioritized store, or mismatched / negative / non-finite input.
        """
        index, priority = self._check_priorities(index, priority)
        with self._lock:
            if self._shard is None:
                return 0
            return self.sampler.update(self._shard.table, index, priority)

    def _check_priorities(self, index: Any, priority: Any) -> tuple[np.ndarray, np.ndarray]:
        """(int64 index, float64 priority) of an `update_priorities` call, or ValueError."""
        if not isinstance(self.sampler, PrioritizedSampler):
            raise ValueError(f"update_priorities needs a PrioritizedSampler; this store uses {self.sampler!r}")
        index = _as_numpy(index, "index").reshape(-1)
        priority = _as_numpy(priority, "priority").reshape(-1)
        if not np.issubdtype(index.dtype, np.integer):
            raise ValueError(f"index must hold integers (a batch's 'index'), got dtype {index.dtype}")
        if not (np.issubdtype(priority.dtype, np.floating) or np.issubdtype(priority.dtype, np.integer)):
            raise ValueError(f"priority must hold real numbers, got dtype {priority.dtype}")
        priority = priority.astype(np.float64)
        if index.shape != priority.shape:
            raise ValueError(f"index has {index.size} entries but priority has {priority.size}; expected equal")
        if not np.all(np.isfinite(priority)) or np.any(priority < 0):
            bad = priority[~(np.isfinite(priority) & (priority >= 0))][:5]
            raise ValueError(f"priority must be finite and >= 0, got {bad.tolist()}")
        # Each leaf at most max/capacity, so that the tree's total stays finite.
        sampler, limit = self.sampler, np.finfo(np.float64).max / self.capacity
        with np.errstate(over="ignore"):
            too_big = (priority + sampler.eps) ** sampler.alpha > limit
        if too_big.any():
            raise ValueError(f"priority {priority[too_big][:5].tolist()} too large: (priority + eps) ** alpha must stay "
                             f"<= {limit:.3g} (float64 max / capacity) for the sum tree's total to be finite")
        return index.astype(np.int64), priority

    def stats(self) -> dict:
        """Size, episodes, inserts and samples (totals and per second), limiter state.

        ``"reuse"`` is how often the live transitions were sampled (min / mean /
        max) in a store made with ``track_reuse=True``, else None; ``"priorities"``
        the counts of live priorities over log-spaced bins (``edges``, ``counts``)
        in a prioritized store, else None.
        """
        with self._lock:
            elapsed = max(time.monotonic() - self._created, 1e-9)
            limiter = self.rate_limiter
            return {
                "transitions": len(self),
                "episodes": self.num_episodes,
                "capacity": self.capacity,
                "inserts": limiter.inserts,
                "samples": limiter.samples,
                "inserts_per_s": limiter.inserts / elapsed,
                "samples_per_s": limiter.samples / elapsed,
                "sample_to_insert_ratio": limiter.samples / limiter.inserts if limiter.inserts else 0.0,
                "rate_limiter": limiter.state(),
                "reuse": reuse_summary(self._shard.reuse_counts()) if self._shard is not None else None,
                "priorities": self._priorities(),
            }

    def _priorities(self) -> dict | None:
        sampler = self.sampler
        if not isinstance(sampler, PrioritizedSampler) or self._shard is None:
            return None
        leaves = sampler.tree.leaves[self._shard.transition_rows()]   # p^alpha
        return priority_histogram(leaves ** (1 / sampler.alpha) if sampler.alpha else leaves)

    def _repr_html_(self) -> str:
        """The schema and `stats` as HTML tables, for notebooks."""
        return store_html(f"{type(self).__name__} ({self.backend}, {self.mode}, sampler {self.sampler!r})",
                          self.schema, self.stats())

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
        device = check_device(device)
        with self._lock:
            ranks = np.arange(*self._table.live_range(), dtype=np.int64)
            chunks = epoch_batches(self._rng, ranks, batch_size, shuffle, drop_last)
        return self._epoch(chunks, device)

    def _epoch(self, chunks: list[np.ndarray], device: Any) -> Iterator[TensorDict]:
        for ranks in chunks:
            with self._lock:
                live = ranks[self._table.is_live(ranks)]
                if len(live):
                    batch = self._gather(select_ranks(self._table, live), device=device)
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
            ValueError: ``episode_id`` is not an int.
        """
        _check_episode_id(episode_id)
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

    # -- persistence (arrowbuf.parquet, arrowbuf.checkpoint) -----------------------------

    def to_parquet(self, path: str | Path, compression: str = "zstd", rows_per_file: int | None = None,
                   progress: bool | None = None, *, overwrite: bool = False) -> Path:
        """Export the live episodes as a Parquet directory any dataframe tool reads.

        ``steps/part-<shard>-<n>.parquet`` hold the rows (oldest episode first,
        whole episodes per file, at most ``rows_per_file`` rows unless one episode
        is longer), ``episodes.parquet`` the episode table, ``_arrowbuf.json`` the
        manifest. The store's lock is held only while the snapshot is taken.
        `arrowbuf.read_parquet` opens the rows as a dataset. Details: `arrowbuf.parquet`.

        Args:
            path: the directory to create (written beside it, then renamed).
            compression: Parquet codec ("zstd", "snappy", "lz4", "none", ...).
            rows_per_file: rows per step file; None for one file.
            progress: a tqdm bar; None shows it when stderr is a terminal.
            overwrite: replace an existing ``path``.

        Returns:
            ``path``.

        Raises:
            ValueError: the store has no schema yet, or a bad argument.
            FileExistsError: ``path`` exists, is not empty, and ``overwrite`` is False.
        """
        from arrowbuf.parquet import export_store

        return export_store(self, path, compression=compression, rows_per_file=rows_per_file,
                            progress=progress, overwrite=overwrite)

    @classmethod
    def from_parquet(cls, path: str | Path, capacity: int | None = None, episode_filter: Any = None,
                     progress: bool | None = None, **store_kwargs: Any) -> "ExperienceStore":
        """A new store holding the episodes of a `to_parquet` export (offline RL).

        Rows are streamed row group by row group, so an export larger than memory
        loads into a smaller ``capacity``: the newest episodes that fit are kept,
        as FIFO eviction would. Episodes keep their final observations, so samples
        hold the same transitions and ``next`` observations as the original; ids
        and indices are kept unless a filter leaves gaps (then they count from 0).

        Args:
            path: the export directory.
            capacity: rows of the new store; None for the exported store's capacity.
            episode_filter: which episodes to load: a `pyarrow.compute.Expression`
                over the episode table (``pc.field("return") > 100``), or a callable
                taking the episode table (a pyarrow.Table) and returning a boolean
                mask over its rows or a list of episode ids.
            progress: a tqdm bar; None shows it when stderr is a terminal.
            **store_kwargs: seed, sampler, rate_limiter, mode (default: the
                exported mode) of the new store.

        Raises:
            FormatError: a missing, incomplete or corrupted export, a file of
                another schema, or a newer format; the message names the file.
            CapacityError: a selected episode is longer than ``capacity``, or a
                ``mode="fixed"`` store cannot hold them all.
        """
        from arrowbuf.parquet_load import load_store

        return load_store(cls, path, capacity, episode_filter, progress, **store_kwargs)

    def _export_shards(self, steps_dir: Path, schema: pa.Schema, **options: Any) -> tuple[pa.Table, list]:
        """Write the rows of every shard into ``steps_dir``: (episode table, file entries)."""
        from arrowbuf.parquet import export_shard

        return export_shard(self._shard, self._lock, steps_dir, schema, **options)

    def save(self, path: str | Path, progress: bool | None = None) -> Path:
        """Checkpoint the store into directory ``path`` (Arrow IPC files and a JSON manifest).

        Saves the live episodes, the episode table, the sampler's and rate
        limiter's state, the generator's state and the open episodes of this
        store's writers. Saving again into the same directory writes only the
        episodes added since and drops files whose episodes were all evicted.
        The lock is held only while the snapshot is taken. Details:
        `arrowbuf.checkpoint`.

        Returns:
            ``path``.

        Raises:
            FileExistsError: ``path`` is a file or holds a foreign manifest.json.
        """
        from arrowbuf.checkpoint import save_store

        return save_store(self, path, progress)

    @classmethod
    def load(cls, path: str | Path, progress: bool | None = None, **ray_options: Any) -> "ExperienceStore":
        """The store saved in ``path``; it samples exactly as the saved one would have.

        Restored writers are in `writers`; ``store.writer(..., name=name)`` claims one.
        A Ray store's checkpoint loads as a Ray store; ``num_shards=`` (and other
        `RayExperienceStore` arguments) can spread it over another number of shards.

        Raises:
            FormatError: a missing or incomplete checkpoint, a truncated file, or a
                newer format version; the message names the file.
        """
        from arrowbuf.checkpoint import load_store
        from arrowbuf.ray_persist import is_ray_checkpoint

        if is_ray_checkpoint(path):
            from arrowbuf.ray_backend import RayExperienceStore

            return RayExperienceStore.load(path, progress, **ray_options)
        if ray_options:
            raise ValueError(f"{sorted(ray_options)} apply to Ray checkpoints only; {path} is a local one")
        return load_store(cls, path, progress)

    @classmethod
    def from_ray_dataset(cls, dataset: Any, capacity: int, **store_kwargs: Any) -> "ExperienceStore":
        """A new store holding the episodes of a `ray.data.Dataset` made by `to_ray_dataset`
        (or any dataset in that row layout; see `arrowbuf.ray_persist`)."""
        from arrowbuf.ray_persist import from_ray_dataset

        return from_ray_dataset(cls, dataset, capacity, **store_kwargs)

