"""`DataBuffer`: RLightning's buffer API and config on top of `ExperienceStore`.

Code written for ``rlightning.buffer.DataBuffer`` runs unchanged::

    buffer = DataBuffer(cfg.buffer)                  # dict or object; "ReplayBuffer" | "RolloutBuffer"
    buffer.init(env_meta_list, env_ids)
    buffer.add_batched_transition(env_rets, policy_resps, truncations)   # SyncRLEngine
    buffer.add_batched_data_async(env_rets); buffer.add_batched_data_async(policy_resps, truncations)
    batches = buffer.sample(batch_size)              # one batch per train worker (ObjectRefs on Ray)

Semantics kept from the seed
----------------------------
- Records and segments: `arrowbuf.compat.segments` (where a segment ends, what
  each autoreset style stores, what a custom ``postprocess_fn`` receives).
- Vectorized env workers (``num_envs`` > 1 in ``init(env_meta_list)``; fields
  lead with ``num_envs``) give one episode per sub-env, env id ``"<env_id>/<i>"``.
- Async pairing: an EnvRet waits for its PolicyResponse; the pair is one record.
  A truncation ends the records paired so far (a waiting EnvRet opens the next segment).
- ``capacity`` counts transitions per storage shard; ``storage.mode="fixed"``
  refuses to overflow (`BufferFullError`, a RuntimeError as in the seed),
  ``"circular"`` drops the oldest episodes. ``storage.unit="episode"`` makes
  `size`, ``len`` and indices count episodes.
- Placement (`arrowbuf.compat.placement`): ``DataBuffer(config, cluster=...)``
  takes RLightning's cluster section; `sample` returns one batch per train worker
  (with remote storage an ObjectRef put by the shards, `arrowbuf.compat.resolve`).
- Samplers (`arrowbuf.compat.reading`): ``uniform``, ``batch``, ``all``; worker k
  gets indices k, k+W, ... ``ReplayBuffer`` keeps its data; ``RolloutBuffer``
  clears it after sampling.

The differences from the seed that remain are listed in
docs/migrating-from-rlightning.md.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from arrowbuf._checks import check_bool, is_int
from arrowbuf.compat.config import BufferSettings, parse_config
from arrowbuf.compat.ingest import Ingest, parse_env_meta, truncation_list
from arrowbuf.compat.placement import Placement, check_env_nodes, driver_node, resolve_placement
from arrowbuf.compat.processing import resolve_hooks
from arrowbuf.compat.reading import Reader, positions, select, split
from arrowbuf.compat.segments import Segmenter
from arrowbuf.compat.sink import BufferFullError, StoreSink
from arrowbuf.compat.staging import FIRST_ROWS
from arrowbuf.compat.timing import Timers
from arrowbuf.store import ExperienceStore

logger = logging.getLogger(__name__)

__all__ = ["BufferFullError", "DataBuffer"]


def _locked(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: DataBuffer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class DataBuffer:
    """RLightning's data buffer (config, methods, semantics) on an `ExperienceStore`.

    Args:
        config: the RLightning buffer config: a dict or any object with attributes
            (``type``, ``capacity``, ``sampler.type``, ``auto_truncate_episode``,
            ``storage.{mode,type,unit,device,num_shards}``, ``node_affinity_*``).
        obs_preprocessor, reward_preprocessor, env_ret_preprocess_fn,
            policy_resp_preprocess_fn, preprocess_fn, postprocess_fn: the seed's
            hooks (`arrowbuf.compat.processing`); None for the default.
        seed: seed of the sampling generator (and of the store).
        cluster: RLightning's ``cluster`` section, as is (``remote_storage``,
            ``buffer_worker_num``, ``train_worker_num``); None reads
            ``RLIGHTNING_REMOTE_STORAGE`` and RLightning's resource manager
            (`arrowbuf.compat.placement`).
        num_train_workers: batches `sample` returns (default: from the cluster, else 1).
        backend: "local" or "ray" to override the placement's.
        num_shards: shards of a sharded store (``storage.num_shards`` wins).
        ray_options: `arrowbuf.RayOptions` for a Ray store.
        autoreset_mode: "auto" (default: read from the records), "next_step" or "same_step"
            (`arrowbuf.compat.segments`).
        component_distribution: RLightning's node -> component ids map for node
            affinity (default: the resource manager's, else all on this node).

    Raises:
        ValueError: a bad config or argument (named), or conflicting hooks (as the seed).
    """

    buffer_type: str | None = None   # set by ReplayBuffer / RolloutBuffer

    def __new__(cls, config: Any = None, *args: Any, **kwargs: Any) -> DataBuffer:
        # DataBuffer(config) builds the config's type: a ReplayBuffer or a RolloutBuffer.
        if cls is DataBuffer:
            cls = BUFFERS[parse_config(config).type]
        return super().__new__(cls)

    def __init__(self, config: Any, obs_preprocessor: Callable | None = None,
                 reward_preprocessor: Callable | None = None, env_ret_preprocess_fn: Callable | None = None,
                 policy_resp_preprocess_fn: Callable | None = None, preprocess_fn: Callable | None = None,
                 postprocess_fn: Callable | None = None, *, seed: int | None = None, cluster: Any = None,
                 num_train_workers: int | None = None, backend: str | None = None, num_shards: int | None = None,
                 ray_options: Any = None, autoreset_mode: str = "auto",
                 component_distribution: Mapping[str, Any] | None = None) -> None:
        self.settings: BufferSettings = parse_config(config, self.buffer_type)
        self.config = copy.deepcopy(config)
        hooks = resolve_hooks(obs_preprocessor, reward_preprocessor, env_ret_preprocess_fn, policy_resp_preprocess_fn,
                              preprocess_fn, postprocess_fn)
        self.placement: Placement = resolve_placement(
            self.settings, cluster, num_train_workers=num_train_workers, backend=backend, num_shards=num_shards,
            component_distribution=component_distribution, driver_node=driver_node())
        self.backend, self.num_shards = self.placement.backend, self.placement.num_shards
        self.num_train_workers = self.placement.num_train_workers
        self._rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self._timers = Timers()
        self._sink = StoreSink(self.settings, self.placement, seed, ray_options, self._timers)
        self._num_envs: dict[str, int] = {}
        self.env_ids: list[str] = []
        segmenter = Segmenter(self.settings.auto_truncate_episode, self._num_envs_of, autoreset_mode,
                              hooks.postprocess_fn, self.settings.device, hooks.obs_preprocessor, self._stage_rows)
        self._ingest = Ingest(hooks, segmenter, self._sink, self._timers)

    def init(self, env_meta_list: Sequence[Any] | None = None, env_ids: Sequence[str] | None = None) -> None:
        """Declare the env workers: ``env_meta_list`` gives each one's ``num_envs``.

        Items of ``env_meta_list`` are `EnvMeta` objects or dicts with ``env_id``
        and ``num_envs`` (None or 1: not vectorized). Optional: without it every
        env is taken as not vectorized.

        Raises:
            ValueError: an entry without an env_id or with a bad num_envs.
        """
        with self._lock:
            num_envs = parse_env_meta(env_meta_list)
            ids = list(env_ids) if env_ids is not None else list(num_envs)
            check_env_nodes(self.placement, ids)
            self._num_envs = num_envs
            self.env_ids = ids

    def _num_envs_of(self, env_id: str) -> int:
        return self._num_envs.get(env_id, 1)

    def _stage_rows(self, env_id: str) -> int:
        """Records a fresh staging of ``env_id`` has room for before it grows (doubling, each
        time a copy of what it holds)."""
        return FIRST_ROWS

    # -- the store -------------------------------------------------------------------------

    @property
    def store(self) -> ExperienceStore | None:
        """The underlying `ExperienceStore` (created at the first stored episode), or None."""
        return self._sink.store

    def print_timing_summary(self, reset: bool = False) -> None:
        """Log (at DEBUG) count / total / average seconds of the store calls.

        Timers: ``add_episode`` (sealing into the store), ``truncate`` (assembling
        and sealing), ``sample``, ``get`` (index reads), ``clear``.
        """
        with self._lock:
            logger.debug("DataBuffer timing summary (%s, %d shard(s)):", self.backend, self.num_shards)
            for name, stats in sorted(self._timers.raw.items()):
                logger.debug("  %-12s count=%-6d total=%.6fs avg=%.6fs", name, stats["count"], stats["total"],
                             stats["avg"])
            if reset:
                self._timers.reset()

    @property
    def timing_raw(self) -> dict[str, dict[str, float]]:
        """The seed's timers: name -> {count, total, avg} seconds."""
        return self._timers.raw

    # -- sizes -------------------------------------------------------------------------------

    @_locked
    def size(self) -> int:
        """Stored transitions, or episodes with ``storage.unit="episode"`` (in-progress ones excluded);
        at most ``capacity`` transitions per shard, as in the seed (`arrowbuf.compat.reading.Reader`)."""
        store = self._sink.store
        if store is None:
            return 0
        if self.settings.mode != "circular" or len(store) <= self.settings.capacity:   # nothing past the capacity:
            return store.num_episodes if self.settings.unit == "episode" else len(store)   # the cheap counts
        reader = self._reader()
        return reader.count(reader.space())

    def __len__(self) -> int:
        return self.size()

    def __repr__(self) -> str:
        s = self.settings
        return (f"{type(self).__name__}(type={s.type!r}, capacity={s.capacity}, sampler={s.sampler!r}, "
                f"unit={s.unit!r}, mode={s.mode!r}, backend={self.backend!r}, num_shards={self.num_shards}, "
                f"size={self.size()}, open_envs={len(self._ingest.segmenter.open_envs())})")

    # -- ingestion -----------------------------------------------------------------------------

    @_locked
    def add_transition(self, env_id: str, env_ret: Any, policy_resp: Any, truncated: bool = False) -> None:
        """Add one step (an EnvRet and its PolicyResponse) of env ``env_id``.

        With ``truncated`` the env's episode ends here (this step's observation is
        its final one). ``env_ret`` / ``policy_resp`` may be Ray ObjectRefs.

        Raises:
            ValueError: mismatched env ids, or (at a truncation) records that do
                not stack into an episode or do not match the stored schema.
            BufferFullError: a full fixed-mode buffer.
        """
        self._ingest.add_pair(env_id, env_ret, policy_resp, truncated)

    @_locked
    def add_batched_transition(self, batched_env_ret: Any, batched_policy_resp: Any,
                               truncations: Any = None) -> DataBuffer:
        """`add_transition` for every (id, EnvRet), (id, PolicyResponse) pair; returns self.

        Raises:
            ValueError: different lengths or ids, or truncations of another length.
            TypeError: truncations that are not None, a bool or a list of bools.
        """
        if len(batched_env_ret) != len(batched_policy_resp):
            raise ValueError(f"batched_env_ret has {len(batched_env_ret)} items but batched_policy_resp has "
                             f"{len(batched_policy_resp)}; expected as many")
        if tuple(batched_env_ret.ids()) != tuple(batched_policy_resp.ids()):
            raise ValueError(f"batched_env_ret and batched_policy_resp have different env ids: "
                             f"{batched_env_ret.ids()} and {batched_policy_resp.ids()}")
        flags = truncation_list(truncations, len(batched_env_ret))
        for env_id, env_ret, policy_resp, truncated in zip(batched_env_ret.ids(), batched_env_ret.values(),
                                                            batched_policy_resp.values(), flags):
            self.add_transition(env_id, env_ret, policy_resp, truncated)
        return self

    @_locked
    def add_data_async(self, env_id: str, data: Any, truncated: bool = False) -> None:
        """Add an EnvRet or a PolicyResponse of env ``env_id`` (async rollouts pair them here).

        An EnvRet waits for its PolicyResponse; together they are one step. With
        ``truncated`` the env's episode ends after this call (a waiting EnvRet is
        kept for the next episode).

        Raises:
            ValueError: a PolicyResponse with no EnvRet waiting for it (the seed
                silently merged it into an already stored step), or mismatched ids.
            TypeError: neither an EnvRet nor a PolicyResponse.
        """
        self._ingest.add_async(env_id, data, truncated)

    @_locked
    def add_batched_data_async(self, batched_data: Any, truncations: Any = None) -> None:
        """`add_data_async` for every (id, value) of a `BatchedData`.

        Raises:
            ValueError, TypeError: as `add_data_async`; truncations of another length or type.
        """
        flags = truncation_list(truncations, len(batched_data))
        for (env_id, data), truncated in zip(batched_data.items(), flags):
            self.add_data_async(env_id, data, truncated)

    @_locked
    def add_episode(self, episode: Any, num_envs: int = 1) -> None:
        """Add a finished episode (no pre- or post-processing, as in the seed).

        ``episode`` is a dict (nested dicts allowed), a TensorDict or a Ray
        ObjectRef of one, in the seed's format (``observation`` and
        ``next_observation`` with T rows each, ``reward``, ``terminated``, ...):
        every key is stored as given (T rows each). arrowbuf's format
        (observation fields with T+1 rows) is taken too. With ``num_envs`` > 1 the
        values are ``[T, num_envs, ...]`` and make ``num_envs`` episodes.

        Raises:
            ValueError: values that are not ``[T, num_envs, ...]``, or that do not
                match the stored schema (`arrowbuf.SchemaError`).
            BufferFullError: a full fixed-mode buffer.
        """
        self._ingest.add_episode(episode, num_envs)

    # -- finishing episodes -----------------------------------------------------------------------

    @_locked
    def truncate_one_episode(self, item: Any) -> None:
        """End the open episode of an env (an env_id, ``"<env_id>/<i>"`` for one sub-env, or
        an object with ``env_id``) and store it. Nothing open: nothing happens.

        Raises:
            TypeError: ``item`` has no env id.
            ValueError: records that do not stack or do not match the stored schema
                (the episode is dropped).
            BufferFullError: a full fixed-mode buffer.
        """
        self._ingest.truncate([item])

    @_locked
    def truncate_episodes(self, items: Sequence[Any]) -> None:
        """`truncate_one_episode` for each item (env ids or objects with ``env_id``).

        Raises:
            TypeError: an item without an env id (checked before any is truncated), or a single
                str (read as a list, each of its characters would be an env id with nothing open).
        """
        if isinstance(items, str) or not isinstance(items, Iterable):
            raise TypeError(f"truncate_episodes takes a list of env ids (or objects with env_id), got "
                            f"{items!r}; for one env use truncate_one_episode({items!r})")
        self._ingest.truncate(items)

    @_locked
    def __getitem__(self, item: Any) -> TensorDict:
        """Items by index: an int, slice, array / list / tensor of ints, or ``(shard, indices)``.

        Indices count the stored transitions (episodes with ``storage.unit=
        "episode"``), oldest first, over all shards together; ``(shard, indices)``
        addresses one shard. An int gives one item (batch size [] for a
        transition, [T] for an episode), anything else a batch.

        Raises:
            IndexError: an index out of range; TypeError: an index of another type.
        """
        shard = None
        if isinstance(item, tuple) and len(item) == 2:
            shard, item = item
            if not is_int(shard):
                raise TypeError(f"storage index must be an int, got {shard!r}")
            shard = int(shard)
        unit = self.settings.unit
        reader = self._reader()
        if reader is None:
            positions(item, 0, unit)   # raises for ints; empty selections read as an empty batch
            return TensorDict({}, batch_size=[0])
        with self._timers.timed("get"):
            space = reader.space(shard)
            where, scalar = positions(item, reader.count(space), unit)
            batch = reader.read(where, space)
        return batch[0] if scalar else batch

    def _reader(self) -> Reader | None:
        if self._sink.store is None:
            return None
        device = self.settings.device if self.settings.device != "cpu" else None
        circular = self.settings.mode == "circular"
        return Reader(self._sink.store, self.settings.unit, device, self.settings.capacity if circular else None)

    def get(self, item: Any) -> TensorDict:
        """``{"storage_idx": s, "indices": idx}`` -> ``self[s, idx]``; an index or indices -> ``self[item]``.

        Raises:
            TypeError: anything else.
        """
        if isinstance(item, Mapping):
            return self[item["storage_idx"], item["indices"]]
        if isinstance(item, (int, np.integer, slice, Sequence, np.ndarray, torch.Tensor)) and not isinstance(item, str):
            return self[item]
        raise TypeError(f"get takes a dict with 'storage_idx' and 'indices', or indices; got {type(item).__name__}")

    @_locked
    def get_all(self) -> TensorDict | dict[int, TensorDict]:
        """Everything stored: one TensorDict, or ``{shard: TensorDict}`` with several shards."""
        if self.num_shards > 1 and self._sink.store is not None:
            return {shard: self[shard, :] for shard in range(self.num_shards)}
        return self[:]

    # -- sampling -----------------------------------------------------------------------------------

    @_locked
    def sample(self, batch_size: int | None = None, shuffle: bool = True, drop_last: bool = True) -> list[Any]:
        """Sample with the config's sampler; one batch per train worker.

        ReplayBuffer keeps its data; RolloutBuffer clears what it stored (episodes
        in progress stay). See the module docstring for the samplers and the split.

        Returns:
            Local storage: TensorDicts. Remote (Ray) storage: as the seed, one
            ``ray.ObjectRef`` per train worker, put in the object store by the shards
            (`ExperienceStore.gather_refs`): this process never holds the rows. A ref
            passed to a train worker's task or actor call (``policy.update_dataset.remote(ref)``)
            arrives there as the TensorDict; elsewhere `arrowbuf.compat.resolve` (or
            ``ray.get``) gives it. Its tensors are read-only views of the object store,
            on the CPU (the worker moves them to its device).

        Raises:
            ValueError: ``batch_size`` larger than the stored items (except for
                sampler 'all'), missing for 'uniform' / 'batch', not an int >= 1,
                or too small for the train workers with ``drop_last``; ``shuffle`` or
                ``drop_last`` not a bool.
        """
        if batch_size is not None and not is_int(batch_size, 1):
            raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
        shuffle, drop_last = check_bool("shuffle", shuffle), check_bool("drop_last", drop_last)
        with self._timers.timed("sample"):
            total = self.size()
            self._check_batch(batch_size, total)
            reader = self._reader()
            if reader is None:
                select(self._rng, self.settings.sampler, batch_size, 0, shuffle)   # the sampler's own errors
                return [TensorDict({}, batch_size=[0]) for _ in range(self.num_train_workers)]
            requests: list = [None] * self.num_train_workers
            for shards, workers in self._worker_groups():
                space = reader.space(shards)
                size = None if batch_size is None else batch_size * len(workers) // self.num_train_workers
                indices = select(self._rng, self.settings.sampler, size, reader.count(space), shuffle)
                for worker, part in zip(workers, split(indices, len(workers), drop_last)):
                    requests[worker] = (part, space)
            if self.backend == "ray":
                batches = reader.refs(requests)
            else:
                batches = [reader.read(part, space) for part, space in requests]
        self._after_sample()
        return batches

    def _worker_groups(self) -> list[tuple[tuple[int, ...] | None, list[int]]]:
        """(shards, train workers drawing from them): all shards for all workers, or
        per node with ``node_affinity_train``."""
        table = self.placement.worker_shards
        if table is None:
            return [(None, list(range(self.num_train_workers)))]
        groups: dict[tuple[int, ...], list[int]] = {}
        for worker, shards in enumerate(table):
            groups.setdefault(shards, []).append(worker)
        return list(groups.items())

    def _check_batch(self, batch_size: int | None, total: int) -> None:
        if batch_size is not None and batch_size > total:
            raise ValueError(f"not enough data in the buffer for a batch of {batch_size}: it holds {total} "
                             f"{self.settings.unit}s; collect more or lower the batch size")

    def _after_sample(self) -> None:
        """ReplayBuffer: nothing (data is kept)."""

    # -- clearing -----------------------------------------------------------------------------------

    @_locked
    def clear(self) -> None:
        """Drop everything: stored data, episodes in progress and EnvRets waiting for a response."""
        with self._timers.timed("clear"):
            size_before = self.size()
            self._sink.clear()
            open_envs, waiting = self._ingest.clear()
        logger.debug("buffer cleared: %d %ss stored, %d open episodes and %d waiting EnvRets dropped",
                     size_before, self.settings.unit, open_envs, waiting)

    @property
    def dropped_env_rets(self) -> int:
        """Async EnvRets replaced before their PolicyResponse came (each logged as a warning)."""
        return self._ingest.dropped_env_rets


class ReplayBuffer(DataBuffer):
    """A DataBuffer for off-policy training: sampling keeps the data (config ``type`` may be omitted)."""

    buffer_type = "ReplayBuffer"


class RolloutBuffer(DataBuffer):
    """A DataBuffer for on-policy training: sampling clears what was stored."""

    buffer_type = "RolloutBuffer"

    def _check_batch(self, batch_size: int | None, total: int) -> None:
        if batch_size is None or self.settings.sampler == "all":
            return
        if batch_size > total:
            super()._check_batch(batch_size, total)
        if batch_size < total:
            logger.warning("batch_size %d is smaller than the %d stored %ss: a RolloutBuffer discards the rest "
                           "after sampling (pass batch_size=None or use sampler 'all' to use all data)",
                           batch_size, total, self.settings.unit)

    def _after_sample(self) -> None:
        self._sink.clear()

    def _stage_rows(self, env_id: str) -> int:
        """A rollout's records, so that the first one is staged without growing (a VLA rollout's
        staging grew 32 -> 256 rows of 4.8 MB, copying 224): the capacity (the rollout's
        transitions, as the seed sizes it) over the declared envs, and the final record; at most
        `MAX_STAGE_ROWS`. Rows never written are never touched, so a larger capacity costs none."""
        envs = sum(self._num_envs.values()) or self._num_envs_of(env_id)
        rows = self.settings.capacity * self.num_shards // envs + 1
        return int(min(max(rows, super()._stage_rows(env_id)), MAX_STAGE_ROWS))


#: The most records a RolloutBuffer's fresh staging starts with room for (`RolloutBuffer._stage_rows`).
MAX_STAGE_ROWS = 1024

#: The config's ``type`` -> its class.
BUFFERS = {"ReplayBuffer": ReplayBuffer, "RolloutBuffer": RolloutBuffer}
