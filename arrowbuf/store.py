"""`ExperienceStore`: the public store, a facade over one backend.

The facade checks every argument once, reads and checks episodes against the
schema, keeps the named writers, and hands the work to its backend: a
`arrowbuf.local.LocalBackend` (one `ShardEngine` in this process) or the Ray
backend (`arrowbuf.ray.router.RayBackend`: shard actors, each running the same
engine). Both backends keep one contract (`tests/test_contract.py` runs it on
each); where Ray differs (asynchronous writers, per-shard rate limiters, sizes
as last reported) the docstrings say so.

This module builds the store (settings, backend), and holds its shape, views and
statistics; its other methods come by job from `arrowbuf._store_writing`
(episodes, writers), `arrowbuf._store_sampling` (samples, epochs, priorities,
GAE) and `arrowbuf._store_io` (Parquet, checkpoints, Ray Data).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from arrowbuf._checks import check_bool, check_choice, check_episode_id, check_int, check_name, check_storage_device
from arrowbuf._stats import store_html
from arrowbuf._store_io import StoreIO
from arrowbuf._store_sampling import StoreSampling
from arrowbuf._store_writing import StoreWriting
from arrowbuf._writers import WriterRegistry
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import describe
from arrowbuf.local import LocalBackend
from arrowbuf.rate_limiters import RateLimiter
from arrowbuf.ray.options import RayOptions, as_ray_options
from arrowbuf.samplers import EpisodeSampler, Sampler, UniformSampler, WithoutReplacementSampler
from arrowbuf.schema import Schema
from arrowbuf.shard import MODES

BACKENDS = ("local", "ray")


class ExperienceStore(StoreWriting, StoreSampling, StoreIO):
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
            `SampleToInsertRatio`); unlimited by default. On Ray each shard
            applies its own copy to its own counts.
        schema: an `arrowbuf.Schema` or a mapping name -> `Field`; inferred from
            the first write when None, then enforced.
        mode: "circular" evicts the oldest whole episodes when full; "fixed"
            refuses the write with `CapacityError`.
        backend: "local" (in-process, the default) or "ray" (sharded Ray actors;
            see `arrowbuf.ray` and `RayOptions`).
        num_shards: shards of a Ray store (1 for the local backend); ``capacity``
            is their total.
        name: a Ray store's name, for `attach` from other processes (default: random).
        ray_options: a Ray store's `RayOptions` (placement, writer delivery, ...).
        track_reuse: count how often each stored step is sampled, for the
            ``"reuse"`` entry of `stats` (costs ~5-10% of a small-row sample).
        durable: Ray only: True (``~/.cache/arrowbuf/<name>``, ``name=`` required) or a directory for the
            shards' episode logs: each shard logs every episode before it answers,
            and Ray restarts a shard that dies, which rebuilds itself from its last
            checkpoint plus the log (`arrowbuf.durable`); False keeps episodes in
            memory only.
        storage_device: None (default) keeps the columns as numpy arrays in host
            memory; a torch device ("cuda", "cuda:1", "cpu") keeps them as torch
            tensors there (`arrowbuf.arena`): a write of tensors on that device is a
            ``copy_``, a sample an ``index_select`` on it, and batches stay on it
            unless ``device=`` says otherwise. Local backend only.

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
                 backend: str = "local", rate_limiter: RateLimiter | None = None, num_shards: int = 1,
                 track_reuse: bool = False, name: str | None = None, ray_options: RayOptions | None = None,
                 durable: Any = False, storage_device: Any = None) -> None:
        self._configure(seed, sampler, mode, backend, rate_limiter, track_reuse)
        storage_device = check_storage_device(storage_device, backend)
        num_shards = check_int("num_shards", num_shards, 1)
        self.capacity = check_int("capacity", capacity, num_shards)
        if schema is not None and not isinstance(schema, Schema):
            schema = Schema(schema)
        if backend == "local":
            if num_shards != 1 or name is not None or ray_options is not None:
                raise ValueError(f"num_shards={num_shards!r}, name={name!r} and ray_options={ray_options!r} "
                                 "need backend='ray'; the local backend has one unnamed shard")
            if durable is not False:
                raise ValueError(f"durable={durable!r} needs backend='ray' (durable shard actors); a local store is "
                                 "saved with save()")
            self._backend: Any = LocalBackend(ShardEngine(
                self.capacity, sampler=self.sampler, rate_limiter=self.rate_limiter, mode=mode, seed=self.seed,
                schema=schema, track_reuse=self.track_reuse, storage_device=storage_device))
        else:
            self._backend = self._start_ray(num_shards, schema, name, ray_options, durable)

    def _start_ray(self, num_shards: int, schema: Schema | None, name: Any, ray_options: Any, durable: Any) -> Any:
        """The Ray backend of a new store (see `arrowbuf.ray.router`)."""
        from arrowbuf.durable import durable_directory
        from arrowbuf.ray.router import RayBackend, start_shards

        if durable is True and name is None:   # a random name: a directory nobody finds again, kept forever
            raise ValueError("durable=True keeps the shards' logs in ~/.cache/arrowbuf/<name>: pass name= (so a "
                             "new driver finds the store's directory again) or a directory, durable='some/dir'")
        name = check_name(name) or RayBackend.new_name()
        directory = durable_directory(durable, name)
        ray_options = as_ray_options(ray_options)
        if isinstance(self.sampler, EpisodeSampler) and num_shards > 1:
            raise ValueError("EpisodeSampler returns episodes padded to the longest one, which shards "
                             "cannot agree on; use num_shards=1 or a SequenceSampler")
        if isinstance(self.sampler, WithoutReplacementSampler) and num_shards > 1:
            raise ValueError("WithoutReplacementSampler keeps one epoch per shard, and shards end their epochs at "
                             "different times; use num_shards=1, or iter_batches() for epochs across shards")
        shards = start_shards(name, self.capacity, num_shards, seed=self.seed, sampler=self.sampler,
                              rate_limiter=self.rate_limiter, schema=schema, mode=self.mode,
                              track_reuse=self.track_reuse, options=ray_options, durable=directory)
        return RayBackend(shards, capacity=self.capacity, sampler=self.sampler, seed=self.seed, schema=schema,
                          schema_fixed=schema is not None)

    def _configure(self, seed: Any, sampler: Any, mode: Any, backend: Any, rate_limiter: Any,
                   track_reuse: Any) -> None:
        """Check and keep the settings both backends share."""
        if seed is not None:
            seed = check_int("seed", seed, 0)   # a plain int (it is saved as JSON)
        check_choice("mode", mode, MODES)
        check_choice("backend", backend, BACKENDS)
        sampler = UniformSampler() if sampler is None else sampler
        if not isinstance(sampler, Sampler):
            raise ValueError(f"sampler must be an arrowbuf Sampler (UniformSampler(), PrioritizedSampler(), ...), "
                             f"got {describe(sampler)}")
        rate_limiter = RateLimiter() if rate_limiter is None else rate_limiter
        if not isinstance(rate_limiter, RateLimiter):
            raise ValueError(f"rate_limiter must be an arrowbuf RateLimiter (MinSize, SampleToInsertRatio), "
                             f"got {describe(rate_limiter)}")
        self.track_reuse = check_bool("track_reuse", track_reuse)
        self.seed = seed
        self.mode = mode
        self.backend = backend
        self.sampler = sampler
        self.rate_limiter = rate_limiter
        self.created_at = time.time()              # wall clock, recorded in exports and checkpoints
        self._writers = WriterRegistry()           # writers by name: `save` stores their open episodes

    @classmethod
    def attach(cls, name: str, seed: int | None = None, ray_options: RayOptions | None = None) -> "ExperienceStore":
        """Connect to a running Ray store by its name, from any process of the cluster.

        Args:
            name: the store's ``name``.
            seed: seed of this handle's generator (how it splits batches across shards).
            ray_options: this handle's options (e.g. ``allow_partial``); the shards keep theirs.

        Raises:
            ValueError: no store of that name is running.
            ShardError: one of its shards is not running.
        """
        from arrowbuf.ray.router import RayBackend

        if check_name(name) is None:
            raise ValueError("name must be the name of a running Ray store, got None")
        backend, config = RayBackend.attach(name, seed=seed, options=as_ray_options(ray_options))
        return cls._of_backend(backend, config["capacity"], seed, config["sampler"], config["mode"],
                               config["rate_limiter"], config["track_reuse"], time.time())

    @classmethod
    def _of_backend(cls, backend: Any, capacity: int, seed: int | None, sampler: Sampler, mode: str,
                    rate_limiter: RateLimiter, track_reuse: bool, created_at: float) -> "ExperienceStore":
        """A store around a running backend (attached, or restored from a checkpoint)."""
        store = cls.__new__(cls)
        store.capacity = capacity
        store._configure(seed, sampler, mode, backend.kind, rate_limiter, track_reuse)
        store.created_at = created_at
        store._backend = backend
        return store

    # -- shape of the store ---------------------------------------------------------

    @property
    def engine(self) -> ShardEngine:
        """The shard engine of a local store (for persistence and tools).

        Raises:
            AttributeError: a Ray store, whose engines live in its shard actors.
        """
        engine = getattr(self._backend, "engine", None)
        if engine is None:
            raise AttributeError(f"a {self.backend} store has no in-process engine; its engines live in its shards")
        return engine

    @property
    def storage_device(self) -> Any:
        """The torch device holding the columns, or None for numpy columns in host memory."""
        return getattr(self._backend, "storage_device", None)

    @property
    def schema(self) -> Schema | None:
        """The enforced schema, or None before the first write."""
        return self._backend.schema

    @property
    def num_shards(self) -> int:
        """Shards of the store (1 for the local backend)."""
        return self._backend.num_shards

    @property
    def name(self) -> str | None:
        """A Ray store's name (for `attach`); None for a local store."""
        return getattr(self._backend, "name", None)

    @property
    def num_episodes(self) -> int:
        """Episodes stored (on Ray: as last reported, see `__len__`)."""
        return self._backend.size()[1]

    def __len__(self) -> int:
        """Transitions stored.

        On Ray it never waits for the shards: it sums the sizes they last reported
        (with every write's acknowledgement and every sample, and from a background
        request every ``RayOptions.size_refresh`` seconds), so changes made by other
        processes show within about that interval; after `flush` it is exact.
        """
        return self._backend.size()[0]

    def __repr__(self) -> str:
        transitions, episodes = self._backend.size()
        where = f"backend='ray', name={self.name!r}, num_shards={self.num_shards}, " if self.backend == "ray" else ""
        return (f"ExperienceStore({where}capacity={self.capacity}, transitions={transitions}, "
                f"episodes={episodes}, mode={self.mode!r}, sampler={self.sampler!r}, "
                f"schema={self.schema!r})")

    def __reduce__(self) -> tuple:
        """A Ray store pickles (into a Ray task or actor) as its name: it arrives as a handle
        attached to the same shards (`attach`, its own generator freshly seeded, so that
        handles do not draw the same batches), writers and sizes of its own.

        Raises:
            TypeError: a local store, whose rows live in this process.
        """
        if self.backend != "ray":
            raise TypeError("a local ExperienceStore cannot be pickled (its rows live in this process): make it "
                            "with backend='ray' to pass it to Ray tasks and actors (it arrives attached), or "
                            "save(path) it and ExperienceStore.load(path) it there")
        return type(self).attach, (self.name, None, self._backend.options)

    # -- lifecycle and statistics --------------------------------------------------------

    def close(self) -> None:
        """Release the backend (a Ray store ends its shard actors; their data is gone)."""
        self._backend.close()

    def stats(self) -> dict:
        """Size, episodes, inserts and samples (totals and per second), limiter state.

        ``"reuse"`` is how often the live transitions were sampled (min / mean /
        max) in a store made with ``track_reuse=True``, else None; ``"priorities"``
        the counts of live priorities over log-spaced bins (``edges``, ``counts``)
        in a prioritized store, else None. A Ray store adds ``"shards"``, one entry
        per shard.
        """
        return self._backend.stats()

    def _repr_html_(self) -> str:
        """The schema and `stats` as HTML tables, for notebooks."""
        return store_html(f"{type(self).__name__} ({self.backend}, {self.mode}, sampler {self.sampler!r})",
                          self.schema, self.stats())

    # -- views -------------------------------------------------------------------------

    def episodes(self) -> pa.Table:
        """The episode table (one row per live episode, oldest first)."""
        return self._backend.episodes()

    def episode(self, episode_id: int) -> pa.RecordBatch:
        """One episode's rows as a zero-copy RecordBatch (valid until it is evicted).

        Raises:
            KeyError: no live episode has this id.
            ValueError: ``episode_id`` is not an int.
        """
        return self._backend.episode(check_episode_id(episode_id))

    def to_arrow(self) -> pa.Table:
        """Every stored row, oldest episode first, as zero-copy chunks of the arena."""
        return self._backend.to_arrow()

    # -- TorchRL's replay-buffer verbs (the work: `arrowbuf.torchrl_layout`) ------------------

    def extend(self, td: Any, *, timeout: float | None = None) -> list[int]:
        """Store what a TorchRL collector yields: a TensorDict [T] or [num_envs, T]
        with ``("next", ...)`` keys, cut into episodes at its done flags and
        trajectory ids (vectorized). An episode still running at the batch's end is
        stored at once, cut, and its continuation in the next batch as a further
        episode with the same ``traj_id`` in its metadata: every frame is a
        transition right after the call (`arrowbuf.torchrl_layout`).

        Returns:
            The new episode ids (TorchRL's buffer returns storage indices; arrowbuf's
            transition indices come with samples, as ``"index"``).

        Raises:
            ValueError: ``td`` is not a collector batch.
            SchemaError, CapacityError, RateLimited: as `add_episodes`.
        """
        from arrowbuf.torchrl_layout import episodes_of_collector_batch

        ids: list[int] = []
        for columns, lengths, env_ids, metadata in episodes_of_collector_batch(td, self.schema):
            ids += self.add_episodes(columns, lengths=lengths, env_ids=env_ids, metadata=metadata, timeout=timeout)
        return ids

    def update_priority(self, index: Any, priority: Any) -> int | None:
        """TorchRL's name for `update_priorities` (same arguments; waits for the update)."""
        return self.update_priorities(index, priority)

    def update_tensordict_priority(self, td: Any) -> int | None:
        """Set priorities from a sampled batch a TorchRL loss wrote ``"td_error"`` into.

        Raises:
            ValueError: no ``"index"`` or ``"td_error"`` in ``td``; not a prioritized store.
        """
        from arrowbuf.torchrl_layout import priorities_of

        return self.update_priorities(*priorities_of(td))

    def __getitem__(self, index: Any) -> Any:
        """``store[index]``: the transitions of ``index`` (values of a batch's ``"index"``,
        an int or a 1-D array of them), as `gather`. Not positions: slices are refused.

        Raises:
            TypeError: a slice or another key (names `gather` and `live_ranges`).
            KeyError: indices that are not live.
        """
        from arrowbuf.torchrl_layout import refused_verb

        if isinstance(index, (slice, str, tuple)) or index is None or index is Ellipsis:
            raise refused_verb(f"positional indexing (store[{index!r}])",
                               "store[i] reads transition indices (a batch's 'index', see live_ranges()) "
                               "as store.gather(index) does")
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            return self.gather(np.array([index], np.int64))[0]
        return self.gather(index)

    def __iter__(self) -> Any:
        from arrowbuf.torchrl_layout import refused_verb

        raise refused_verb("iteration", "iterate store.iter_batches(batch_size, epochs=...) for every transition "
                           "once per epoch, or store.sample_iter(batch_size) for endless samples")

    def state_dict(self) -> Any:
        """Refused: a store's state is its rows. `save` / `load` (or TorchRL's `dumps`)."""
        from arrowbuf.torchrl_layout import refused_verb

        raise refused_verb("state_dict()", "checkpoint it into a directory with store.save(path) (or "
                           "store.dumps(path)) and restore with ExperienceStore.load(path)")

    def load_state_dict(self, state_dict: Any) -> None:
        """Refused: see `state_dict`."""
        from arrowbuf.torchrl_layout import refused_verb

        raise refused_verb("load_state_dict()", "restore a checkpoint with store = ExperienceStore.load(path) "
                           "(saved by store.save(path) or store.dumps(path))")

    def dumps(self, path: Any) -> Any:
        """TorchRL's name for `save`: checkpoint the store into directory ``path``."""
        return self.save(path)

    def loads(self, path: Any) -> None:
        """Refused: a store is loaded as a new store, ``ExperienceStore.load(path)``."""
        from arrowbuf.torchrl_layout import refused_verb

        raise refused_verb("loads() in place", f"a checkpoint loads as a new store: "
                           f"store = ExperienceStore.load({str(path)!r})")
