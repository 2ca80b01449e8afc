"""`ExperienceStore`: the public store, a facade over one backend.

The facade checks every argument once, reads and checks episodes against the
schema, keeps the named writers, and hands the work to its backend: a
`arrowbuf.local.LocalBackend` (one `ShardEngine` in this process) or the Ray
backend (`arrowbuf.ray.router.RayBackend`: shard actors, each running the same
engine). Both backends keep one contract (`tests/test_contract.py` runs it on
each); where Ray differs (asynchronous writers, per-shard rate limiters, sizes
as last reported) the docstrings say so.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict

from arrowbuf._checks import (check_bool, check_choice, check_device, check_env_id, check_episode_id,
                              check_fraction, check_int, check_metadata, check_name, check_priorities,
                              check_sample_args, check_timeout, check_worker_nodes, check_workers, to_numpy)
from arrowbuf._stats import store_html
from arrowbuf._writers import WriterRegistry
from arrowbuf.engine import ShardEngine
from arrowbuf.episodes import StepWriter, read_episode
from arrowbuf.errors import describe
from arrowbuf.local import LocalBackend
from arrowbuf.rate_limiters import RateLimiter
from arrowbuf._store_io import StoreIO
from arrowbuf.ray.options import RayOptions, as_ray_options
from arrowbuf.samplers import (EpisodeSampler, PrioritizedSampler, Sampler, UniformSampler,
                               WithoutReplacementSampler)
from arrowbuf.schema import Schema
from arrowbuf.shard import MODES

BACKENDS = ("local", "ray")


class ExperienceStore(StoreIO):
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
        durable: Ray only: True (``~/.cache/arrowbuf/<name>``) or a directory for the
            shards' episode logs: each shard logs every episode before it answers,
            and Ray restarts a shard that dies, which rebuilds itself from its last
            checkpoint plus the log (`arrowbuf.durable`); False keeps episodes in
            memory only.

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
                 durable: Any = False) -> None:
        self._configure(seed, sampler, mode, backend, rate_limiter, track_reuse)
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
                schema=schema, track_reuse=self.track_reuse))
        else:
            self._backend = self._start_ray(num_shards, schema, name, ray_options, durable)

    def _start_ray(self, num_shards: int, schema: Schema | None, name: Any, ray_options: Any, durable: Any) -> Any:
        """The Ray backend of a new store (see `arrowbuf.ray.router`)."""
        from arrowbuf.durable import durable_directory
        from arrowbuf.ray.router import RayBackend, start_shards

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
            The new episode's id. On Ray the shard assigns it, so the call sends the
            episode and waits for that shard's answer (a round trip, errors raised
            here); writers are the asynchronous, batched path.

        Raises:
            SchemaError: a wrong field name, dtype, shape or ragged lengths.
            CapacityError: longer than the capacity, or a full ``mode="fixed"`` store.
            RateLimited: the rate limiter refuses the insert (after ``timeout``).
            ValueError: a bad ``env_id`` or ``metadata``.
            Nothing is changed when it raises.
        """
        timeout = check_timeout(timeout)
        check_env_id(env_id)
        metadata = check_metadata(metadata)
        checked, schema = read_episode(episode, self.schema, env_id, metadata)
        return self._backend.add(checked, schema, timeout)

    def writer(self, num_envs: int, autoreset_mode: str = "next_step",
               env_ids: Sequence[str] | None = None, *, timeout: float | None = None,
               name: str | None = None) -> StepWriter:
        """A step writer for ``num_envs`` vectorized environments (see `StepWriter`).

        ``timeout`` is how long a sealed episode waits for the rate limiter.
        ``name`` identifies the writer in checkpoints (default ``writer-<k>``):
        `save` stores the open episodes of every writer still referenced, and on a
        loaded store ``writer(..., name=name)`` hands back the restored writer with
        those episodes (see `writers`). ``with store.writer(...) as w:`` closes it.
        A Ray store's writer pickles into Ray tasks and actors (env runners); it
        sends finished episodes within ``RayOptions.delivery_latency`` without
        `flush`, and raises a shard's error (or death, naming the episodes lost)
        at its next call.

        Raises:
            ValueError: a bad argument; a writer of this name is already open; a
                restored writer of this name has another num_envs, mode or env_ids.
        """
        name = check_name(name)
        timeout = check_timeout(timeout)
        num_envs = check_int("num_envs", num_envs, 1)
        claimed = self._writers.claim(name, num_envs, autoreset_mode, env_ids) if name else None
        if claimed is not None:
            writer, sink = claimed
            sink.timeout = timeout
            return writer
        sink = self._backend.sink(timeout, env_ids)
        writer = StepWriter(sink, num_envs, autoreset_mode, env_ids)
        self._writers.add(name or self._writers.new_name(), writer, sink)
        return writer

    def pin_env(self, env_id: str, shard: int) -> None:
        """Send the `add_episode` episodes of ``env_id`` to ``shard`` (e.g. the shard on
        the node where that env runs), unless the env was already routed; on a local
        store (one shard) it changes nothing.

        Raises:
            ValueError: a bad ``env_id``, or ``shard`` not in [0, num_shards).
        """
        check_env_id(env_id)
        if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)) or not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must be an int in [0, {self.num_shards}), got {shard!r}")
        self._backend.pin(env_id, int(shard))

    @property
    def writers(self) -> dict[str, StepWriter]:
        """Writers by name: those still referenced, and after `load` the restored
        ones (held by the store until claimed with ``writer(..., name=name)``)."""
        return self._writers.live()

    def _restore_writers(self, states: Mapping[str, Any]) -> None:
        """Writers of a loaded checkpoint, held until claimed by name."""
        for name, state in states.items():
            writer = self.writer(int(state["num_envs"]), state["autoreset_mode"], state["env_ids"], name=name)
            writer.load_state_dict(state)
            self._writers.hold(name)

    def flush(self) -> None:
        """Wait until every write so far is stored, and raise the first error.

        A local store writes synchronously: nothing to wait for. A Ray store sends
        what this process's writers have queued (their open episodes stay open:
        `StepWriter.flush` cuts them) and waits for the shards' answers; ``len``
        right after it is exact.
        """
        self._flush_writers()
        self._backend.flush()

    def _flush_writers(self) -> None:
        """Send what this process's writers queued and wait for it (no-op locally)."""
        for sink in self._writers.sinks():
            sink.flush()

    def close(self) -> None:
        """Release the backend (a Ray store ends its shard actors; their data is gone)."""
        self._backend.close()

    def clear(self) -> None:
        """Remove every episode. Indices sampled before stay stale forever. Episodes
        this process's writers had sealed are stored first (and removed)."""
        self._flush_writers()
        self._backend.clear()

    # -- sampling ---------------------------------------------------------------------

    def sample(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
               device: torch.device | str | None = None, pin_memory: bool = False,
               timeout: float | None = None, num_workers: int | None = None,
               worker_nodes: Sequence[str] | None = None,
               keys: list | None = None) -> TensorDict | list[TensorDict]:
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
            worker_nodes: with ``num_workers`` on a Ray store, the node id of each
                worker: each draws from the shards on its node.
            keys: gather only these fields (names or key tuples; ``("next", k)``
                only when named), plus ``"index"``, ``"episode_id"``, ``"step"``
                and the sampler's extras; None gathers every field.

        Returns:
            A TensorDict of batch size [batch_size] ([batch_size, L] for sequence
            and episode samplers): every field at t, ``("next", obs)`` for
            observation fields, ``"index"`` (transition indices, for
            `update_priorities`), ``"episode_id"`` and ``"step"``, plus the
            sampler's ``"weight"`` or ``"mask"``. Its memory is reused by a later
            sample once nothing refers to it (the batch, its tensors, or views,
            slices or numpy arrays of them): what you keep is never overwritten.

        Raises:
            ValueError: a bad argument.
            EmptyStoreError: the store holds no transition.
            RateLimited: the rate limiter refuses the sample (after ``timeout``).
        """
        batch_size = check_int("batch_size", batch_size, 1)
        # The schema matters only for n_step > 1 (and is 4 calls deep): not read otherwise.
        args = check_sample_args(n_step, gamma, frame_stack, self.schema if n_step != 1 else None)
        device = check_device(device)
        timeout = check_timeout(timeout)
        pin_memory = check_bool("pin_memory", pin_memory)
        num_workers = check_workers(batch_size, num_workers)
        check_worker_nodes(self.backend, num_workers, worker_nodes)
        if num_workers is not None and isinstance(self.sampler, WithoutReplacementSampler) \
                and not self.sampler.drop_last:
            raise ValueError("num_workers needs full batches; WithoutReplacementSampler(drop_last=False) "
                             "returns a short one at each epoch's end: use drop_last=True")
        return self._backend.sample(batch_size, args, device, pin_memory, timeout, num_workers, worker_nodes, keys)

    def sample_iter(self, batch_size: int, prefetch: int = 4, batches_per_request: int | None = None, *,
                    n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
                    device: torch.device | str | None = None) -> Iterator[TensorDict]:
        """Endless batches, as `sample` would give them. A Ray store keeps ``prefetch``
        requests in flight per shard so that sampling overlaps training.

        Raises:
            ValueError: a bad argument.
        """
        batch_size = check_int("batch_size", batch_size, 1)
        prefetch = check_int("prefetch", prefetch, 1)
        if batches_per_request is not None:
            batches_per_request = check_int("batches_per_request", batches_per_request, 1)
        args = check_sample_args(n_step, gamma, frame_stack, self.schema)
        device = check_device(device)
        return self._backend.sample_iter(batch_size, args, device, prefetch, batches_per_request)

    def iter_batches(self, batch_size: int, shuffle: bool = True, drop_last: bool = False, *,
                     epochs: int = 1, device: torch.device | str | None = None,
                     keys: list | None = None) -> Iterator[TensorDict]:
        """Every stored transition once per epoch (on-policy PPO epochs), in batches.

        Each epoch gathers each transition once, in a fresh random order (from the
        store's generator; the first epoch's order is drawn by this call, each
        later one when it starts). Transitions evicted while an epoch runs are
        skipped, not replaced; those added join the next epoch.

        Args:
            batch_size: transitions per batch.
            shuffle: random order, else insertion order.
            drop_last: drop each epoch's last batch if it is short.
            epochs: passes over the store.
            device: where the tensors go.
            keys: the fields to gather, as in `sample`.

        Raises:
            ValueError: a bad argument.

        Example:
            >>> import numpy as np, arrowbuf as ab
            >>> store = ab.ExperienceStore(100, seed=0)
            >>> _ = store.add_episode({"obs": np.zeros((11, 2)), "action": np.zeros(10),
            ...                        "terminated": np.arange(10) == 9})
            >>> [len(b) for b in store.iter_batches(4, epochs=2)]
            [4, 4, 2, 4, 4, 2]
        """
        batch_size = check_int("batch_size", batch_size, 1)
        shuffle = check_bool("shuffle", shuffle)
        drop_last = check_bool("drop_last", drop_last)
        epochs = check_int("epochs", epochs, 1)
        device = check_device(device)
        first = self._backend.iter_batches(batch_size, shuffle, drop_last, device, keys)
        if epochs == 1:
            return first
        return self._epochs(first, epochs, batch_size, shuffle, drop_last, device, keys)

    def _epochs(self, first: Iterator[TensorDict], epochs: int, *args: Any) -> Iterator[TensorDict]:
        yield from first
        for _ in range(epochs - 1):
            yield from self._backend.iter_batches(*args)

    def gather(self, index: Any, *, device: torch.device | str | None = None) -> TensorDict:
        """The transitions of ``index`` (values of a batch's ``"index"``), in that order.

        Reads by index, as a trainer that keeps indices or the RLightning API
        does; it is not counted as a sample.

        Raises:
            ValueError: ``index`` is not a 1-D array of ints.
            KeyError: some of the indices are not live (evicted, cleared, never written).
        """
        array, _ = to_numpy(index, "index")
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"index must be a 1-D array of ints, got {describe(array)}")
        return self._backend.gather(array.astype(np.int64), check_device(device))

    def live_ranges(self) -> list[tuple[int, int]]:
        """[first, stop) of the live indices of each shard (a shard's indices are contiguous)."""
        return self._backend.live_ranges()

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first index, transitions) of every live episode, shard by shard, oldest first."""
        return self._backend.episode_spans()

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
        sampler = self.sampler
        if not isinstance(sampler, PrioritizedSampler):
            raise ValueError(f"update_priorities needs a PrioritizedSampler; this store uses {sampler!r}")
        index, priority = check_priorities(index, priority, sampler.alpha, sampler.eps, self.capacity)
        return self._backend.update_priorities(index, priority)

    def compute_gae(self, gamma: float = 0.99, lam: float = 0.95, *, value_key: str = "value",
                    bootstrap_value: Callable[[TensorDict], Any] | None = None) -> int:
        """Generalized advantages of every stored transition, written as new columns.

        Writes ``"advantage"`` and ``"value_target"`` (advantage + value; TorchRL's
        names), float32 per step. They extend the schema as *derived* fields: they
        are sampled like any field (``batch["advantage"]``) and exported to
        Parquet; episodes written later need not carry them and hold zeros until
        the next call. Vectorized over all episodes (one vector step per step
        index, not a Python loop over steps).

        What the last transition of an episode bootstraps from:
            - terminated: nothing (the return ends);
            - cut after its final observation (truncated, or cut by a writer's
              ``flush()`` at the end of a rollout): the value of that final
              observation, ``bootstrap_value(final_obs)``, where ``final_obs`` is
              a TensorDict [n] of the observation fields of those n episodes and
              the result holds n values;
            - stored without a final observation: the value of its last stored
              step (that step has no next observation, so it is no transition).

        Args:
            gamma: discount in [0, 1].
            lam: GAE's lambda in [0, 1].
            value_key: the scalar step field holding V(s_t).
            bootstrap_value: the value function for final observations; needed
                only when some episode was cut after its final observation.

        Returns:
            The number of transitions written.

        Raises:
            ValueError: a bad argument, no scalar ``reward`` / ``value_key`` field,
                cut episodes without ``bootstrap_value``, or a callable that does
                not return one finite value per episode. Nothing is changed then.

        Example:
            >>> import numpy as np, arrowbuf as ab
            >>> store = ab.ExperienceStore(100)
            >>> _ = store.add_episode({"obs": np.zeros((3, 2), np.float32), "reward": np.ones(2, np.float32),
            ...                        "value": np.zeros(2, np.float32), "terminated": np.array([False, True]),
            ...                        "truncated": np.zeros(2, bool)})
            >>> store.compute_gae(gamma=1.0, lam=1.0)
            2
            >>> store.episode(0).column("advantage").to_pylist()
            [2.0, 1.0, 0.0]
        """
        gamma, lam = check_fraction("gamma", gamma), check_fraction("lam", lam)
        schema = self.schema
        if not isinstance(value_key, str) or schema is None or value_key not in schema.fields:
            raise ValueError(f"value_key {value_key!r} is not a field of the store; fields: "
                             f"{list(schema.fields) if schema else 'none yet'}")
        if bootstrap_value is not None and not callable(bootstrap_value):
            raise ValueError(f"bootstrap_value must be a callable (final_obs TensorDict -> values) or None, "
                             f"got {describe(bootstrap_value)}")
        return self._backend.compute_gae(gamma, lam, value_key, bootstrap_value)

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
