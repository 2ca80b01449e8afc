"""`ExperienceStore`: the public store, a facade over one `Backend`.

The facade checks every argument once, reads and checks episodes against the
schema, keeps the named writers, and hands the work to its backend
(`arrowbuf.backend.Backend`): a `arrowbuf.local.LocalBackend` (one `ShardEngine`
in this process) or a `arrowbuf.ray.router.RayBackend` (shard actors, each
running the same engine), made by `arrowbuf.opening`. Both keep one contract
(`tests/test_contract.py` runs it on each); where Ray differs (asynchronous
writers, per-shard rate limiters, sizes as last reported) the docstrings say so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf._checks import (check_bool, check_choice, check_device, check_env_id, check_episode_id, check_gae_args,
                              check_index_batches, check_int, check_metadata, check_name, check_path,
                              check_priorities, check_progress, check_sample_args, check_shard, check_storage_device,
                              check_timeout, check_worker_nodes, check_workers, to_numpy)
from arrowbuf._stats import store_html
from arrowbuf import torchrl_layout as trl
from arrowbuf._writers import WriterRegistry
from arrowbuf.backend import Backend
from arrowbuf.engine import ShardEngine
from arrowbuf.episode_batch import read_episodes
from arrowbuf.episode_read import read_episode
from arrowbuf.episodes import StepWriter
from arrowbuf.errors import CapacityError, EmptyStoreError, describe
from arrowbuf.groups import rank_split
from arrowbuf.opening import AS_SAVED, Opened, attach_backend, check_settings, load_backend, new_backend, reduce_store
from arrowbuf.ragged import check_pad, pad_batch
from arrowbuf.rate_limiters import RateLimiter
from arrowbuf.ray.options import RayOptions
from arrowbuf.samplers import PrioritizedSampler, WithoutReplacementSampler
from arrowbuf.schema import Schema
from arrowbuf.versions import (attach_versions, check_fresh_iter, epochs_fresh, evict_older, keyword_schema,
                               sample_fresh)

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict


class ExperienceStore:
    """A replay / rollout store of whole episodes, sampled into TensorDicts.

    Rows follow RLDS: one row per step, observations stored once; the ``next``
    observation of step t is row t+1 of the same episode. ``len(store)`` counts
    transitions: steps that have a next observation.

    Args:
        capacity: transitions held, the unit rollouts are sized by (``num_envs x T``); the arena
            keeps the rows beyond them that final observations take (`arrowbuf.placement`).
        seed: seed of the store's `numpy.random.Generator`; sampling is reproducible.
        sampler: a `Sampler` (`UniformSampler` by default, `PrioritizedSampler`, ...).
        rate_limiter: `MinSize`, `SampleToInsertRatio`; unlimited by default (on Ray,
            per shard).
        schema: a `Schema` or a mapping name -> `Field`; None: inferred from the first write.
        mode: "circular" evicts the oldest episodes when full; "fixed" raises `CapacityError`.
        backend: "local" (in-process) or "ray" (sharded Ray actors, `RayOptions`).
        num_shards, name, ray_options: a Ray store's shards (``capacity`` is their
            total), name (for `attach`; default random) and `RayOptions`.
        track_reuse: count samples per step, for `stats` (~5-10% of a small-row sample).
        durable: Ray only: True (``~/.cache/arrowbuf/<name>``) or a directory for the
            shards' episode logs, from which a dead shard is rebuilt (`arrowbuf.durable`).
        storage_device: a torch device keeping the columns as tensors (`arrowbuf.arena`;
            local only); None: numpy in host memory.

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
        self._backend: Backend = new_backend(self, schema, num_shards, name, ray_options, durable, storage_device)

    def _configure(self, seed: Any, sampler: Any, mode: Any, backend: Any, rate_limiter: Any,
                   track_reuse: Any) -> None:
        """Check and keep the settings both backends share."""
        self.seed, self.sampler, self.mode, self.backend, self.rate_limiter, self.track_reuse = check_settings(
            seed, sampler, mode, backend, rate_limiter, track_reuse)
        self.created_at = time.time()              # wall clock, recorded in exports and checkpoints
        self._writers = WriterRegistry()           # writers by name: `save` stores their open episodes

    @classmethod
    def _opened(cls, opened: Opened) -> "ExperienceStore":
        """A store around a running backend (attached, or loaded from a checkpoint)."""
        store = cls.__new__(cls)
        store.capacity = opened.capacity
        store._configure(opened.seed, opened.sampler, opened.mode, opened.backend.kind, opened.rate_limiter,
                         opened.track_reuse)
        store.created_at = opened.created_at
        store._backend = opened.backend
        with opened.typed_errors():   # writers of a loaded checkpoint, held until claimed by name
            store._writers.restore(opened.writers, store._backend.sink, store.storage_device)
        return store

    @classmethod
    def attach(cls, name: str, seed: int | None = None, ray_options: RayOptions | None = None) -> "ExperienceStore":
        """The running Ray store ``name`` (in ``RayOptions.namespace``), from any process of the
        cluster; ``seed`` and ``ray_options`` are this handle's. Raises ValueError (no store of
        that name runs) or ShardError (a shard is not running, or no Ray cluster is connected)."""
        return cls._opened(attach_backend(name, seed, ray_options))

    # -- shape of the store ---------------------------------------------------------

    @property
    def engine(self) -> ShardEngine:
        """The shard engine of a local store (AttributeError on Ray: they live in its actors)."""
        engine = self._backend.engine
        if engine is None:
            raise AttributeError(f"a {self.backend} store has no in-process engine; its engines live in its shards")
        return engine

    @property
    def storage_device(self) -> Any:
        """The torch device holding the columns, or None for numpy columns in host memory."""
        return self._backend.storage_device

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
        return self._backend.name

    @property
    def num_episodes(self) -> int:
        """Episodes stored (on Ray: asked of the shards, exact as `__len__`)."""
        return self._backend.size()[1]

    def __len__(self) -> int:
        """Transitions stored.

        On Ray it asks every shard (one round trip): every write acknowledged before
        it counts, whichever process wrote it (a writer's `flush` returns once its
        episodes are acknowledged). `cached_size` is the figure that never waits.
        """
        return self._backend.size()[0]

    @property
    def cached_size(self) -> tuple[int, int]:
        """(transitions, episodes) without waiting for the shards: on Ray, the sizes they
        last reported (with every write's acknowledgement and every sample, and from a
        background request every ``RayOptions.size_refresh`` seconds), so writes made
        by other processes show within about that interval. Exact on the local backend.
        """
        return self._backend.size(exact=False)

    def __repr__(self) -> str:
        transitions, episodes = self._backend.size(exact=False)
        where = f"backend='ray', name={self.name!r}, num_shards={self.num_shards}, " if self.backend == "ray" else ""
        return (f"ExperienceStore({where}capacity={self.capacity}, transitions={transitions}, "
                f"episodes={episodes}, mode={self.mode!r}, sampler={self.sampler!r}, "
                f"schema={self.schema!r})")

    # -- writing ----------------------------------------------------------------------

    def add_episode(self, episode: Any, env_id: str = "default",
                    metadata: Mapping[str, Any] | None = None, *, timeout: float | None = None,
                    shard: int | None = None, policy_version: Any = None) -> int:
        """Add one whole episode; its id (on Ray a round trip; writers are the asynchronous path).

        Args:
            episode: a dict (nested allowed) of arrays / tensors, a TensorDict or a
                RecordBatch: step fields T rows, observation fields T+1 (with the final
                observation) or T.
            env_id, metadata: kept in the episode table (metadata JSON-serializable).
            timeout: seconds to wait for the rate limiter; None raises at once.
            shard: store it on this shard, whatever its env's route.
            policy_version: the version of the policy that chose its actions (an int, or one per step).

        Raises (changing nothing):
            SchemaError: a wrong field name, dtype, shape or ragged lengths.
            CapacityError: longer than the capacity, or a full ``mode="fixed"`` store.
            RateLimited: the rate limiter refuses it (after ``timeout``); ValueError: a bad argument.
        """
        timeout, env_id, metadata = check_timeout(timeout), check_env_id(env_id), check_metadata(metadata)
        shard = check_shard(shard, self.num_shards)
        read = read_episode(episode, keyword_schema(self.schema, policy_version), env_id, metadata,
                            keep_tensors=self.storage_device is not None)
        checked, schema = attach_versions(self, *read, policy_version)
        if shard is None:
            return self._backend.add(checked, schema, timeout)
        return self._backend.add_many([checked], schema, timeout, shard)[0]

    def add_episodes(self, episodes: Any, *, lengths: Any = None, env_ids: Any = None, metadata: Any = None,
                     timeout: float | None = None, shard: int | None = None, policy_version: Any = None,
                     observations: Sequence[str] | None = None) -> list[int]:
        """Add E episodes given as arrays shaped [E, T, ...] (one check, then views), or as a list of E
        episodes of any lengths (each as `add_episode` takes one); their ids. On Ray, one request a shard.

        ``episodes``: step fields [E, T, ...], observation fields [E, T + 1, ...] or [E, T, ...]; a
        ragged or text field also as E values, one per episode (a list of sequences or of str each);
        ``lengths``: None, or E ints in [1, T] (episode e is its first ``lengths[e]`` steps);
        ``env_ids``: one for all or one per episode; ``metadata``: one mapping (or None) per episode;
        ``policy_version``: one int or one per episode; ``observations``: the observation fields' names
        when this first write infers the schema (default: the T + 1 fields named like observations);
        ``timeout`` (per episode) and ``shard`` as in `add_episode`, which says what it raises. Nothing is stored when a check refuses the batch;
        episodes refused by a full fixed store or the limiter are counted in the error.
        """
        timeout = check_timeout(timeout)
        shard = check_shard(shard, self.num_shards)
        checked, schema = attach_versions(self, *read_episodes(episodes, keyword_schema(self.schema, policy_version),
                                                               lengths, env_ids, metadata,
                                                               keep_tensors=self.storage_device is not None,
                                                               observations=observations),
                                          policy_version, per_episode=True)
        longest = max(e.num_rows - int(e.has_final) for e in checked)
        if longest > self.capacity // self.num_shards:
            raise CapacityError(f"an episode of {longest} transitions is longer than a shard's capacity of "
                                f"{self.capacity // self.num_shards} transitions; nothing was stored")
        return self._backend.add_many(checked, schema, timeout, shard)

    def writer(self, num_envs: int | None = None, autoreset_mode: Any = None, env_ids: Sequence[str] | None = None,
               *, env: Any = None, timeout: float | None = None, name: str | None = None) -> StepWriter:
        """A `StepWriter` for ``num_envs`` vectorized envs in ``autoreset_mode``, or for ``env`` (a gymnasium
        vector env: mode read; none given: "next_step", checked, `arrowbuf.autoreset`); ``timeout``: a sealed
        episode's wait for the rate limiter; ``name`` (default ``writer-<k>``) names it in checkpoints. On Ray it
        pickles into tasks and actors. ValueError: a bad argument, a writer of this name open, or restored
        with another num_envs, mode or env_ids."""
        name, timeout = check_name(name), check_timeout(timeout)
        return self._writers.open(self._backend.sink, num_envs, autoreset_mode, env_ids, timeout, name,
                                  self.storage_device, env)

    @property
    def writers(self) -> dict[str, StepWriter]:
        """Writers by name: those still referenced, and restored ones not yet claimed."""
        return self._writers.live()

    def pin_env(self, env_id: str, shard: int) -> None:
        """Route the `add_episode` episodes of ``env_id`` to ``shard`` unless it was routed
        already (ValueError for a bad env id or shard)."""
        check_env_id(env_id)
        shard = check_shard(shard, self.num_shards)
        if shard is None:
            raise ValueError(f"shard must be an int in [0, {self.num_shards}), got None")
        self._backend.pin(env_id, shard)

    def flush(self) -> None:
        """Wait until every write so far is stored (Ray: this process's writers' queued
        episodes too; ``len`` is exact after it) and raise the first error."""
        self._writers.flush()
        self._backend.flush()

    def evict(self, *, min_version: int) -> int:
        """Free the oldest episodes of steps all older than ``min_version`` (FIFO); `arrowbuf.versions`."""
        return evict_older(self._backend, min_version)

    def clear(self) -> None:
        """Remove every episode (after storing those this process's writers sealed)."""
        self._writers.flush()
        self._backend.clear()

    def close(self) -> None:
        """Release the backend (a Ray store ends its shard actors, and their data)."""
        self._backend.close()

    # -- sampling -----------------------------------------------------------------------

    def sample(self, batch_size: int | None = None, *, n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
               device: torch.device | str | None = None, pin_memory: bool = False,
               timeout: float | None = None, num_workers: int | None = None,
               worker_nodes: Sequence[str] | None = None, keys: list | None = None,
               min_version: int | None = None, layout: str = "arrowbuf", pad: dict | None = None
               ) -> TensorDict | list[TensorDict]:
        """Sample transitions with the store's sampler.

        Args:
            batch_size: transitions (or windows, or episodes) to draw.
            n_step, gamma: n-step returns: ``"reward"`` sums the next n rewards discounted
                by gamma, ``("next", obs)`` follows them (``"discount"``, ``"n_steps"``).
            frame_stack: observation fields hold the last k frames, oldest first.
            device, pin_memory: where the tensors go; gather into pinned memory.
            timeout: seconds to wait for the rate limiter; None raises at once.
            num_workers, worker_nodes: a list of that many disjoint equal batches; on
                Ray, each worker draws from the shards on its node.
            keys, layout: only these fields (and "index", "episode_id", "step"); "torchrl": `arrowbuf.torchrl_layout`.
            pad: {ragged field: pad value}: that field as a padded ``[B, L_max]`` tensor plus
                ``<field>_length`` ``[B]``, instead of a jagged nested tensor (`arrowbuf.ragged`).

        Returns a TensorDict [batch_size] (or [batch_size, L]): the fields at t, ``("next",
        obs)``, ``"index"``, ``"episode_id"``, ``"step"``, the sampler's ``"weight"`` /
        ``"mask"``; its memory is reused only once nothing refers to it. Raises ValueError
        (a bad argument), TypeError (no ``batch_size``: a store has no default one, as a
        TorchRL ReplayBuffer has), EmptyStoreError, RateLimited (after ``timeout``).
        """
        if batch_size is None:
            raise trl.no_batch_size()
        batch_size = check_int("batch_size", batch_size, 1)
        # The schema matters only for n_step > 1 (and is 4 calls deep): not read otherwise.
        args = check_sample_args(n_step, gamma, frame_stack, self.schema if n_step != 1 else None)
        device = check_device(device)
        timeout, layout = check_timeout(timeout), trl.check_layout(layout)
        pin_memory = check_bool("pin_memory", pin_memory)
        num_workers = check_workers(batch_size, num_workers)
        check_worker_nodes(self.backend, num_workers, worker_nodes)
        pad = check_pad(pad, self.schema)
        if num_workers is not None and isinstance(self.sampler, WithoutReplacementSampler) \
                and not self.sampler.drop_last:
            raise ValueError("num_workers needs full batches; WithoutReplacementSampler(drop_last=False) "
                             "returns a short one at each epoch's end: use drop_last=True")
        try:   # not a context manager: entering and leaving one cost ~1 us of a W1 sample
            batch = self._backend.sample(batch_size, args, device, pin_memory, timeout, num_workers, worker_nodes,
                                         keys) if min_version is None else \
                sample_fresh(self._backend, min_version, batch_size, args, device, pin_memory, timeout, num_workers,
                             worker_nodes, keys)
        except EmptyStoreError as err:   # an empty store names the writers' open steps
            explained = self._writers.explain(err)
            if explained is err:
                raise
            raise explained from None
        if pad is not None:
            batch = [pad_batch(b, pad) for b in batch] if isinstance(batch, list) else pad_batch(batch, pad)
        return batch if layout == "arrowbuf" else trl.as_layout(batch, self.schema, layout)   # schema: 3 calls deep

    def sample_iter(self, batch_size: int, prefetch: int = 4, batches_per_request: int | None = None, *,
                    n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
                    device: torch.device | str | None = None, min_version: int | None = None,
                    keys: list | None = None, pad: dict | None = None) -> Iterator[TensorDict]:
        """Endless batches, as `sample` gives them (ValueError for a bad argument; ``min_version``, ``keys``,
        ``pad`` as in `sample`).

        On Ray, ``prefetch`` index requests stay in flight when the shards draw
        (prioritized, rate-limited samplers), and ``batches_per_request`` batches are
        drawn and gathered together when this process draws (default: as fit in
        ``arrowbuf.ray.block_reads.READ_BYTES``, at most 16; see `arrowbuf.ray.reader`).
        """
        batch_size = check_int("batch_size", batch_size, 1)
        prefetch = check_int("prefetch", prefetch, 1)
        if batches_per_request is not None:
            batches_per_request = check_int("batches_per_request", batches_per_request, 1)
        args = check_sample_args(n_step, gamma, frame_stack, self.schema)
        min_version = check_fresh_iter(self, min_version)
        pad = check_pad(pad, self.schema)
        batches = self._backend.sample_iter(batch_size, args, check_device(device), prefetch, batches_per_request,
                                            min_version, keys)
        return batches if pad is None else (pad_batch(batch, pad) for batch in batches)

    def iter_batches(self, batch_size: int, shuffle: bool = True, drop_last: bool = False, *,
                     epochs: int = 1, device: torch.device | str | None = None, keys: list | None = None,
                     min_version: int | None = None, layout: str = "arrowbuf", pad: dict | None = None,
                     world_size: int | None = None, rank: int | None = None, balance: str | None = None
                     ) -> Iterator[TensorDict]:
        """Every stored transition once per epoch (on-policy PPO epochs), in batches (``pad`` as in `sample`).

        With ``world_size``, ``batch_size`` is the global batch and this process gets rank
        ``rank``'s share of each: every rank sees the same global batches (same seed, same
        contents), each row goes to one rank, a `GroupSampler`'s groups stay whole, and
        ``balance`` (a ragged field) balances its tokens over the ranks (`arrowbuf.groups`).
        Without ``rank`` (a driver that ships the shares to its workers) each global batch is
        a list of every rank's share, split once: share r is what ``rank=r`` gets (or empty).

        Each epoch has a fresh random order; transitions evicted meanwhile are skipped,
        those added join the next epoch. With ``shuffle=False`` a local batch of
        contiguous rows is a view of the arena. ValueError for a bad argument; ``min_version`` as in `sample`.

        Example:
            >>> import numpy as np, arrowbuf as ab
            >>> store = ab.ExperienceStore(100, seed=0)
            >>> _ = store.add_episode({"obs": np.zeros((11, 2)), "action": np.zeros(10),
            ...                        "terminated": np.arange(10) == 9})
            >>> [len(b) for b in store.iter_batches(4, epochs=2)]
            [4, 4, 2, 4, 4, 2]
        """
        batch_size, epochs = check_int("batch_size", batch_size, 1), check_int("epochs", epochs, 1)
        shuffle, drop_last = check_bool("shuffle", shuffle), check_bool("drop_last", drop_last)
        device, layout = check_device(device), trl.check_layout(layout)
        pad, split = check_pad(pad, self.schema), rank_split(world_size, rank, balance, self)
        if split is not None and min_version is not None:
            raise ValueError("world_size with min_version is not supported yet: split the fresh steps yourself")
        rest = (shuffle, drop_last, device, keys) + ((None, split) if split is not None else ())
        first = self._backend.iter_batches(batch_size, *rest) if min_version is None \
            else epochs_fresh(self._backend, min_version, batch_size, shuffle, drop_last, epochs, device, keys)
        if epochs > 1 and min_version is None:
            first = self._epochs(first, epochs, batch_size, *rest)
        if pad is not None:   # a list: every rank's share (no rank given)
            first = ([pad_batch(b, pad) for b in batch] if isinstance(batch, list) else pad_batch(batch, pad)
                     for batch in first)
        return trl.each_as_layout(first, self, layout)

    def _epochs(self, first: Iterator[TensorDict], epochs: int, *args: Any) -> Iterator[TensorDict]:
        yield from first
        for _ in range(epochs - 1):
            yield from self._backend.iter_batches(*args)

    def gather(self, index: Any, *, device: torch.device | str | None = None) -> TensorDict:
        """The transitions of ``index`` (a batch's ``"index"``) in that order, not counted as
        a sample (ValueError: not a 1-D array of ints; KeyError: some are not live)."""
        array, _ = to_numpy(index, "index")
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"index must be a 1-D array of ints, got {describe(array)}")
        return self._backend.gather(array.astype(np.int64), check_device(device))

    def gather_refs(self, indices: Sequence[Any], *, extras: Sequence[Mapping[str, Any]] | None = None,
                    next_keys: str = "nested") -> list:
        """Ray only: refs of batches the shards gather into Ray's object store, one per array
        of ``indices`` (1-D or 2-D) with its ``extras``; ``next_keys``: "nested" or "flat".
        Raises ValueError (a bad argument, a local store) or KeyError (indices not live).
        """
        check_choice("next_keys", next_keys, ("nested", "flat"))
        batches, fields = check_index_batches(indices, extras)
        return self._backend.gather_refs(batches, fields, next_keys == "flat")

    def live_ranges(self) -> list[tuple[int, int]]:
        """[first, stop) of the live indices of each shard (a shard's indices are contiguous)."""
        return self._backend.live_ranges()

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first index, transitions) of every live episode, shard by shard, oldest first."""
        return self._backend.episode_spans()

    def update_priorities(self, index: Any, priority: Any, *, wait: bool = True) -> int | None:
        """Set sampled transitions' priorities (`PrioritizedSampler`); how many were live.

        ``wait=False`` on Ray returns None at once: applied before this process's next
        sample, its error raised by the next call (`arrowbuf.ray.priorities`).

        Raises ValueError (nothing sent): not prioritized, or mismatched / negative input.
        """
        sampler = self.sampler
        if not isinstance(sampler, PrioritizedSampler):
            raise ValueError(f"update_priorities needs a PrioritizedSampler; this store uses {sampler!r}")
        wait = check_bool("wait", wait)
        index, priority = check_priorities(index, priority, sampler.alpha, sampler.eps, self.capacity)
        return self._backend.update_priorities(index, priority, wait)

    def compute_gae(self, gamma: float = 0.99, lam: float = 0.95, *, value_key: str = "value",
                    bootstrap_value: Callable[[TensorDict], Any] | None = None) -> int:
        """Write generalized advantages of every stored transition as ``"advantage"`` and
        ``"value_target"`` (derived float32 fields); the number of transitions written.

        Episodes cut after their final observation bootstrap from ``bootstrap_value``
        (final observations [n] -> n values); see `arrowbuf.advantages`. ValueError
        (nothing changed) for a bad argument or a missing field.
        """
        gamma, lam = check_gae_args(gamma, lam, value_key, bootstrap_value, self.schema)
        return self._backend.compute_gae(gamma, lam, value_key, bootstrap_value)

    # -- views and statistics ------------------------------------------------------------

    def episodes(self, include_open: bool = False) -> pa.Table:
        """The episode table (one row per played episode, oldest first). ``include_open`` adds
        the episodes that go on (``open`` True; length and return over their written steps;
        ``episode_id`` -1 until a piece of one is sealed; docs/guide.md). ValueError if
        ``include_open`` is not a bool."""
        if not isinstance(include_open, bool):
            raise ValueError(f"include_open must be a bool, got {include_open!r}")
        return self._backend.episodes(include_open)

    def episode(self, episode_id: int) -> pa.RecordBatch:
        """One episode's rows, zero-copy (KeyError if not live, ValueError if not an int)."""
        return self._backend.episode(check_episode_id(episode_id))

    def to_arrow(self) -> pa.Table:
        """Every stored row, oldest episode first, as zero-copy chunks of the arena; a played
        episode a writer cut into pieces reads as one run of its rows, each step once (copied)."""
        return self._backend.to_arrow()

    def stats(self) -> dict:
        """Sizes, inserts and samples, limiter state, ``"reuse"``, ``"priorities"`` (Ray: per shard)."""
        return self._backend.stats()

    def _repr_html_(self) -> str:
        """The schema and `stats` as HTML tables, for notebooks."""
        return store_html(f"{type(self).__name__} ({self.backend}, {self.mode}, sampler {self.sampler!r})",
                          self.schema, self.stats())

    # -- persistence ------------------------------------------------------------------------

    def to_parquet(self, path: str | Path, compression: str = "zstd", rows_per_file: int | None = None,
                   progress: bool | None = None, *, overwrite: bool = False) -> Path:
        """Export the live episodes as a Parquet directory (`arrowbuf.parquet`); ``path``.
        Raises ValueError (no schema yet, a bad argument), FileExistsError (without ``overwrite``)."""
        from arrowbuf.parquet import export_store

        return export_store(self, self._backend.export_steps, check_path("path", path), compression=compression,
                            rows_per_file=rows_per_file, progress=progress, overwrite=overwrite)

    @classmethod
    def from_parquet(cls, path: str | Path, capacity: int | None = None, episode_filter: Any = None,
                     progress: bool | None = None, **store_kwargs: Any) -> Any:
        """A local store of a `to_parquet` export's newest episodes that fit ``capacity``,
        those ``episode_filter`` selects (an Expression or a callable over the episode
        table); see `arrowbuf.parquet_load`.

        Raises FormatError (a missing, corrupted or newer export) or CapacityError.
        """
        from arrowbuf.parquet_load import load_store

        return load_store(cls, check_path("path", path), capacity, episode_filter, check_progress(progress),
                          **store_kwargs)

    def save(self, path: str | Path, progress: bool | None = None) -> Path:
        """Checkpoint the store (rows, sampler, limiter, generator, writers' open episodes)
        into directory ``path``, writing only what changed (`arrowbuf.checkpoint`); FileExistsError
        when ``path`` is a file or holds a foreign manifest.json, ValueError for a bad ``progress``."""
        path, progress = check_path("path", path), check_progress(progress)
        info = {"capacity": self.capacity, "mode": self.mode, "seed": self.seed, "track_reuse": self.track_reuse,
                "created_at": self.created_at}
        if self.storage_device is not None:   # rows are saved from host copies; the device is restored
            info["storage_device"] = str(self.storage_device)
        return self._backend.save(path, info, lambda: {name: w.state_dict() for name, w in self.writers.items()},
                                  progress)

    @classmethod
    def load(cls, path: str | Path, progress: bool | None = None, *, num_shards: int | None = None,
             name: str | None = None, ray_options: RayOptions | None = None,
             storage_device: Any = AS_SAVED) -> Any:
        """The store saved in ``path``, sampling as the saved one would have (writers in
        `writers`); a Ray checkpoint loads over ``num_shards`` Ray shards (default: as saved).

        Raises FormatError (naming the file: missing, incomplete, truncated, newer) or
        ValueError (Ray arguments for a local checkpoint).
        """
        return cls._opened(load_backend(check_path("path", path), check_progress(progress), num_shards, name,
                                        ray_options, storage_device))

    def to_ray_dataset(self) -> Any:
        """Ray only: the rows as a `ray.data.Dataset` built by the shards (`arrowbuf.ray.persist`)."""
        self.flush()
        return self._backend.to_ray_dataset()

    @classmethod
    def from_ray_dataset(cls, dataset: Any, capacity: int, **store_kwargs: Any) -> Any:
        """A new store of a `to_ray_dataset` dataset's episodes (FormatError: another layout)."""
        from arrowbuf.ray.persist import episodes_of_dataset

        schema, episodes = episodes_of_dataset(dataset)
        store = cls(capacity, schema=schema, **store_kwargs)
        store._backend.import_episodes(episodes)
        return store

    def __reduce__(self) -> tuple:   # a Ray store arrives attached in Ray tasks and actors
        return reduce_store(self, self._backend)
    # TorchRL's replay-buffer verbs (`arrowbuf.torchrl_layout`; each refusal names arrowbuf's own verb)
    add, extend, update_priority, dumps, loads = trl.add, trl.extend, trl.update_priority, trl.dumps, trl.loads
    __getitem__, __iter__, state_dict, load_state_dict = trl.getitem, trl.iterate, trl.state_dict, trl.load_state_dict
    update_tensordict_priority = trl.update_tensordict_priority
