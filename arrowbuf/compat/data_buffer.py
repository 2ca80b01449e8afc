"""`DataBuffer`: RLightning's buffer API and config on top of `ExperienceStore`.

Code written for ``rlightning.buffer.DataBuffer`` runs unchanged::

    buffer = DataBuffer(cfg.buffer)                  # dict or object; "ReplayBuffer" | "RolloutBuffer"
    buffer.init(env_meta_list, env_ids)
    buffer.add_batched_transition(env_rets, policy_resps, truncations)   # SyncRLEngine
    buffer.add_batched_data_async(env_rets); buffer.add_batched_data_async(policy_resps, truncations)
    batches = buffer.sample(batch_size)              # one TensorDict per train worker

Semantics kept from the seed
----------------------------
- A step record is an EnvRet (o_t, ``last_reward`` = r_{t-1}, ``last_terminated`` /
  ``last_truncated`` of the previous action) merged with its PolicyResponse (a_t,
  ...). A finished segment of T+1 records is T transitions: ``reward[t]``,
  ``terminated[t]``, ``truncated[t]`` come from record t+1's ``last_*``; the last
  record contributes only its observation (the final one); ``*info*`` keys are
  dropped; ``_extra`` keys are per-step fields like policy outputs. Segments end
  at `truncate_one_episode` / `truncate_episodes` / ``truncated=True``, or, with
  ``auto_truncate_episode``, at a record whose ``last_terminated`` or
  ``last_truncated`` is set (that record is the episode's last; the next record
  starts the next episode and its ``last_reward`` is discarded as a dummy).
- Vectorized env workers (``num_envs`` > 1 in ``init(env_meta_list)``; fields
  lead with ``num_envs``) give one episode per sub-env, with env id
  ``"<env_id>/<i>"``; with ``auto_truncate_episode`` each sub-env ends on its own flag.
- Async pairing: an EnvRet waits for its PolicyResponse; the pair is one record.
  A truncation ends the records paired so far (a waiting EnvRet opens the next segment).
- ``capacity`` counts transitions per storage shard; ``storage.mode="fixed"``
  refuses to overflow (`BufferFullError`, a RuntimeError as in the seed),
  ``"circular"`` drops the oldest episodes. ``storage.unit="episode"`` makes
  `size`, ``len`` and indices count episodes.
- Samplers: ``uniform`` (with replacement), ``batch`` (without), ``all`` (every
  item, shuffled if ``shuffle``). `sample` splits the batch over the train
  workers (``drop_last`` trims to a multiple of them, else the first indices are
  repeated; worker k gets indices k, k+W, ...). ``ReplayBuffer`` keeps its data;
  ``RolloutBuffer`` clears it after sampling.

Storage in arrowbuf terms
-------------------------
Each episode is sealed into the store with ``add_episode``: ``observation`` (and
its nested leaves) is an observation field of T+1 rows, stored once; batches carry
it as ``observation`` and ``next_observation`` (read from the next row). Other
fields are step fields. Batches are TensorDicts (the seed returned dicts of
tensors; keys and shapes are the same) plus ``index``, ``episode_id`` and ``step``.
Episode-unit reads are ``[n, T_max]`` with a ``mask`` (False past an episode's
end). Configs with ``storage.type="sharded"`` use a Ray store
(``ExperienceStore(backend="ray", num_shards=storage.num_shards)``).

Differences from the seed (fixes)
---------------------------------
- Config: unknown keys and bad values raise ValueError naming the key, the value
  and what is expected (the seed's pydantic model silently accepted a misspelled key).
- Sharded sampling: any shard sizes (the seed raised unless all were equal);
  the batch is drawn over all shards together, so shards contribute in
  proportion to their contents and exactly ``batch_size`` items come back (the
  seed dropped ``batch_size % num_shards``).
- Errors surface at the call that caused them: schema mismatches, fixed-mode
  overflow, a PolicyResponse with no EnvRet waiting (the seed merged it into an
  old step, corrupting it), vector flags that do not match ``num_envs``, a batch
  too small for the train workers with ``drop_last``. Writes to Ray shards are
  flushed before a call that sealed episodes returns. An EnvRet that replaces an
  unanswered one is logged as a warning (the seed dropped it silently).
- `clear` also drops in-progress episodes and waiting EnvRets (the seed kept
  them). RolloutBuffer's clear after `sample` keeps them, so rollouts running
  across a sample continue; sample-and-clear is atomic (the buffer is thread-safe).
- Truncating an env with nothing open is a no-op (the seed raised KeyError,
  e.g. right after an automatic truncation).
- Sampling is seeded (``seed=``), with a `numpy.random.Generator`; ``uniform``
  without ``batch_size`` raises ValueError (the seed crashed).
- Indices: negative ones count from the end of the stored items (the seed
  offset them by the capacity); episodes are in insertion order (the seed used
  an interval tree's set order); ragged episode reads are padded with a
  ``mask`` (the seed returned a list).
- Memory: observations are stored once (the seed stored obs and next obs); the
  arena is preallocated once and reused after `clear` (the seed freed and
  reallocated every column on each RolloutBuffer sample). The arena holds
  ``capacity`` transitions plus one final-observation row per episode (sized
  from the first episode's length; in fixed mode 2 x capacity rows, touched
  only as they fill).
- `add_episode` accepts the seed's format (``observation`` + ``next_observation``,
  T rows each; any ``k`` + ``next_k`` pair) and cuts the segment where
  ``next_observation[t]`` is not ``observation[t+1]`` (auto-reset boundaries),
  so each transition keeps its own next observation. Episodes go to shards by
  env load, not at random.
- An episode longer than the capacity keeps its last ``capacity`` transitions
  in circular mode (as the seed), with a warning.
- ``node_affinity_env`` / ``node_affinity_train`` are accepted; arrowbuf's Ray
  writers already prefer a shard on their node, and the driver gathers batches.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from arrowbuf.compat import processing as proc
from arrowbuf.compat._access import LocalAccess, RayAccess
from arrowbuf.compat.config import BufferSettings, parse_config
from arrowbuf.compat.episodes import Assembler, Segment, fold_next, split_envs, step_columns, take_sub_env
from arrowbuf.compat.types import _is_future
from arrowbuf.errors import CapacityError
from arrowbuf.schema import flatten, unflatten
from arrowbuf.store import ExperienceStore

logger = logging.getLogger(__name__)

__all__ = ["BufferFullError", "DataBuffer", "ReplayBuffer", "RolloutBuffer", "build_data_buffer"]


class BufferFullError(CapacityError, RuntimeError):
    """A ``storage.mode="fixed"`` buffer cannot take an episode (a RuntimeError, as the seed raised)."""


def _locked(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: DataBuffer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def _resolve(value: Any) -> Any:
    """The value of a Ray ObjectRef (values sent by remote envs / policies), else the value."""
    if _is_future(value):
        import ray

        return ray.get(value)
    return value


def _env_id_of(item: Any) -> str:
    env_id = item if isinstance(item, str) else getattr(item, "env_id", None)
    if not isinstance(env_id, str):
        raise TypeError(f"expected an env_id str or an object with an env_id attribute, got {type(item).__name__}")
    return env_id


def _truncation_list(truncations: Any, count: int) -> list[bool]:
    if truncations is None:
        return [False] * count
    if isinstance(truncations, (bool, np.bool_)):
        return [bool(truncations)] * count
    if isinstance(truncations, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(truncations, str):
        flags = [bool(t) for t in truncations]
        if len(flags) != count:
            raise ValueError(f"truncations has {len(flags)} entries, expected {count} (one per item)")
        return flags
    raise TypeError(f"truncations must be None, a bool or a list of bools, got {type(truncations).__name__}")


def _with_flags(columns: dict[str, Any], steps: int) -> dict[str, Any]:
    """``columns`` with False ``terminated`` / ``truncated`` where they are missing: the
    seed's records default ``last_terminated`` and ``last_truncated`` to False, and a
    store refuses inferred episodes without terminal flags."""
    missing = [flag for flag in ("terminated", "truncated") if flag not in columns]
    return {**columns, **{flag: np.zeros(steps, bool) for flag in missing}} if missing else columns


def _to_seed_keys(batch: TensorDict) -> TensorDict:
    """``("next", k)`` -> ``next_k`` (``next_observation``), the seed's key for next observations."""
    if "next" in batch.keys():
        for key in list(batch["next"].keys()):
            batch.rename_key_(("next", key), f"next_{key}")
        del batch["next"]
    return batch


def _positions(item: Any, count: int, unit: str) -> tuple[np.ndarray, bool]:
    """Indices into ``count`` items as an int64 array, and whether ``item`` was a scalar.

    Raises:
        IndexError: an index out of range (negative ones count from the end).
        TypeError: not an int, slice, or array / list / tensor of ints or bools.
    """
    if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
        index = int(item) + count if item < 0 else int(item)
        if not 0 <= index < count:
            raise IndexError(f"{unit} index {item} out of range for a buffer of {count} {unit}s")
        return np.array([index], np.int64), True
    if isinstance(item, slice):
        return np.arange(*item.indices(count), dtype=np.int64), False
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    array = np.asarray(item)
    if array.dtype == bool:
        if array.shape != (count,):
            raise IndexError(f"boolean index of shape {array.shape} for a buffer of {count} {unit}s")
        return np.flatnonzero(array), False
    if array.size == 0:
        return np.zeros(0, np.int64), False
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{unit} indices must be ints, a slice, or an array / list / tensor of ints; "
                        f"got {type(item).__name__} of dtype {array.dtype}")
    array = array.reshape(-1).astype(np.int64)
    array = np.where(array < 0, array + count, array)
    bad = array[(array < 0) | (array >= count)]
    if len(bad):
        raise IndexError(f"{unit} index {int(bad[0])} out of range for a buffer of {count} {unit}s")
    return array, False


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
        num_train_workers: how many batches `sample` returns (one per train worker).
        backend: "local" or "ray"; default "local", "ray" for sharded storage.
        num_shards: shards of a sharded store when the config has no
            ``storage.num_shards`` (the seed took it from the cluster config).
        ray_options: `arrowbuf.ray_backend.RayOptions` for a Ray store.

    Raises:
        ValueError: a bad config or argument (named), or conflicting hooks (as the seed).
    """

    buffer_type: str | None = None   # set by ReplayBuffer / RolloutBuffer

    def __new__(cls, config: Any = None, *args: Any, **kwargs: Any) -> DataBuffer:
        # DataBuffer(config) builds the config's type: a ReplayBuffer or a RolloutBuffer.
        kind = _BUFFERS[parse_config(config).type] if cls is DataBuffer else cls
        return super().__new__(kind)

    def __init__(self, config: Any, obs_preprocessor: Callable | None = None,
                 reward_preprocessor: Callable | None = None, env_ret_preprocess_fn: Callable | None = None,
                 policy_resp_preprocess_fn: Callable | None = None, preprocess_fn: Callable | None = None,
                 postprocess_fn: Callable | None = None, *, seed: int | None = None, num_train_workers: int = 1,
                 backend: str | None = None, num_shards: int | None = None, ray_options: Any = None) -> None:
        self.settings: BufferSettings = parse_config(config, self.buffer_type)
        self.config = copy.deepcopy(config)
        self._set_hooks(obs_preprocessor, reward_preprocessor, env_ret_preprocess_fn, policy_resp_preprocess_fn,
                        preprocess_fn, postprocess_fn)
        if isinstance(num_train_workers, bool) or not isinstance(num_train_workers, (int, np.integer)) \
                or num_train_workers < 1:
            raise ValueError(f"num_train_workers must be an int >= 1, got {num_train_workers!r}")
        self.num_train_workers = int(num_train_workers)
        self.backend, self.num_shards = self._placement(backend, num_shards)
        self._ray_options = ray_options
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self._store: ExperienceStore | None = None
        self._access: LocalAccess | RayAccess | None = None
        self._stored_transitions = 0          # since the last clear (fixed-mode accounting)
        self._num_envs: dict[str, int] = {}
        self.env_ids: list[str] = []
        self._assembler = Assembler(self.settings.auto_truncate_episode, self._num_envs_of)
        self._pending: dict[str, dict[str, Any]] = {}   # async: env id -> EnvRet record awaiting its response
        self.dropped_env_rets = 0             # async EnvRets replaced before their response came
        self.timing_raw: dict[str, dict[str, float]] = {}

    # -- construction ------------------------------------------------------------------

    def _set_hooks(self, obs_pre, reward_pre, env_ret_fn, policy_fn, pre_fn, post_fn) -> None:
        # The seed's rule: a custom outer hook would bypass a custom inner one. None or a
        # default passed explicitly is not custom.
        defaults = (proc.default_obs_preprocessor, proc.default_reward_preprocessor,
                    proc.default_env_ret_preprocess_fn, proc.default_policy_resp_preprocess_fn,
                    proc.default_preprocess_fn)
        obs_pre, reward_pre, env_ret_fn, policy_fn, pre_fn = (
            None if hook is default else hook
            for hook, default in zip((obs_pre, reward_pre, env_ret_fn, policy_fn, pre_fn), defaults))
        if (obs_pre is not None or reward_pre is not None) and (env_ret_fn is not None or pre_fn is not None):
            raise ValueError("a custom obs_preprocessor / reward_preprocessor is only called by the default "
                             "env_ret_preprocess_fn and preprocess_fn; apply it inside your custom "
                             f"{'env_ret_preprocess_fn' if env_ret_fn is not None else 'preprocess_fn'} instead")
        if pre_fn is not None and (env_ret_fn is not None or policy_fn is not None):
            raise ValueError("a custom env_ret_preprocess_fn / policy_resp_preprocess_fn is only called by the "
                             "default preprocess_fn; handle it inside your custom preprocess_fn instead")
        self._obs_preprocessor = obs_pre or proc.default_obs_preprocessor
        self._reward_preprocessor = reward_pre or proc.default_reward_preprocessor
        self._env_ret_preprocess_fn = env_ret_fn or proc.default_env_ret_preprocess_fn
        self._policy_resp_preprocess_fn = policy_fn or proc.default_policy_resp_preprocess_fn
        self._preprocess_fn = pre_fn or proc.default_preprocess_fn
        self._postprocess_fn = post_fn   # None: arrowbuf's direct path (same result as the seed's default)

    def _placement(self, backend: str | None, num_shards: int | None) -> tuple[str, int]:
        if backend not in (None, "local", "ray"):
            raise ValueError(f"backend must be 'local', 'ray' or None, got {backend!r}")
        if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer))
                                       or num_shards < 1):
            raise ValueError(f"num_shards must be an int >= 1 or None, got {num_shards!r}")
        settings = self.settings
        if settings.storage_type == "sharded":
            shards = settings.num_shards or num_shards
            if shards is None:
                raise ValueError("buffer config 'storage.type' is 'sharded' but no shard count is given; expected "
                                 "'storage.num_shards' in the config or DataBuffer(..., num_shards=K)")
            if backend == "local":
                raise ValueError("storage.type='sharded' needs backend='ray' (or None); got backend='local'")
            return "ray", int(shards)
        if num_shards not in (None, 1):
            raise ValueError(f"num_shards={num_shards} needs storage.type='sharded' in the config")
        return backend or "local", 1

    def init(self, env_meta_list: Sequence[Any] | None = None, env_ids: Sequence[str] | None = None) -> None:
        """Declare the env workers: ``env_meta_list`` gives each one's ``num_envs``.

        Items of ``env_meta_list`` are `EnvMeta` objects or dicts with ``env_id``
        and ``num_envs`` (None or 1: not vectorized). Optional: without it every
        env is taken as not vectorized.

        Raises:
            ValueError: an entry without an env_id or with a bad num_envs.
        """
        with self._lock:
            num_envs = {}
            for meta in env_meta_list or []:
                get = meta.get if isinstance(meta, Mapping) else functools.partial(getattr, meta)
                env_id, n = get("env_id", None), get("num_envs", None)
                if not isinstance(env_id, str):
                    raise ValueError(f"env meta {meta!r} has no env_id str")
                n = 1 if n is None else n
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                    raise ValueError(f"env meta of {env_id!r}: num_envs must be an int >= 1 or None, got {n!r}")
                num_envs[env_id] = int(n)
            self._num_envs = num_envs
            self.env_ids = list(env_ids) if env_ids is not None else list(num_envs)

    def _num_envs_of(self, env_id: str) -> int:
        return self._num_envs.get(env_id, 1)

    # -- the store -------------------------------------------------------------------------

    @property
    def store(self) -> ExperienceStore | None:
        """The underlying `ExperienceStore` (created at the first sealed episode), or None."""
        return self._store

    def _ensure_store(self, first_length: int) -> ExperienceStore:
        if self._store is not None:
            return self._store
        capacity = self.settings.capacity
        if self.settings.mode == "fixed":
            rows = 2 * capacity + 2   # never the limit: the compat layer refuses at `capacity` transitions
        else:                          # capacity transitions + a final-observation row per episode + a tail
            rows = capacity + math.ceil(capacity / max(first_length, 1)) + first_length + 1
        if self.backend == "ray":
            store = ExperienceStore(rows * self.num_shards, backend="ray", num_shards=self.num_shards,
                                    seed=self._seed, mode=self.settings.mode, ray_options=self._ray_options)
            self._access = RayAccess(store)
        else:
            store = ExperienceStore(rows, seed=self._seed, mode=self.settings.mode)
            self._access = LocalAccess(store)
        self._store = store
        return store

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            stats = self.timing_raw.setdefault(name, {"count": 0, "total": 0.0, "avg": 0.0})
            stats["count"] += 1
            stats["total"] += time.perf_counter() - start
            stats["avg"] = stats["total"] / stats["count"]

    def print_timing_summary(self, reset: bool = False) -> None:
        """Log (at DEBUG) count / total / average seconds of the store calls.

        Timers: ``add_episode`` (sealing into the store), ``truncate`` (assembling
        and sealing), ``sample``, ``get`` (index reads), ``clear``.
        """
        with self._lock:
            logger.debug("DataBuffer timing summary (%s, %d shard(s)):", self.backend, self.num_shards)
            for name, stats in sorted(self.timing_raw.items()):
                logger.debug("  %-12s count=%-6d total=%.6fs avg=%.6fs", name, stats["count"], stats["total"],
                             stats["avg"])
            if reset:
                self.timing_raw = {}

    # -- sizes -------------------------------------------------------------------------------

    @_locked
    def size(self) -> int:
        """Stored transitions, or episodes with ``storage.unit="episode"`` (in-progress ones excluded)."""
        if self._store is None:
            return 0
        return self._store.num_episodes if self.settings.unit == "episode" else len(self._store)

    def __len__(self) -> int:
        return self.size()

    def __repr__(self) -> str:
        s = self.settings
        return (f"{type(self).__name__}(type={s.type!r}, capacity={s.capacity}, sampler={s.sampler!r}, "
                f"unit={s.unit!r}, mode={s.mode!r}, backend={self.backend!r}, num_shards={self.num_shards}, "
                f"size={self.size()}, open_envs={len(self._assembler.open_envs())})")

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
        env_ret, policy_resp = _resolve(env_ret), _resolve(policy_resp)
        if getattr(env_ret, "env_id", env_id) != env_id:
            raise ValueError(f"add_transition for env {env_id!r} got an EnvRet of env {env_ret.env_id!r}")
        record = self._preprocess({}, env_ret, policy_resp)
        self._seal(self._assembler.append(env_id, record))
        if truncated:
            self.truncate_one_episode(env_id)

    def _preprocess(self, record: dict, env_ret: Any, policy_resp: Any) -> dict:
        return self._preprocess_fn(record, env_ret, policy_resp, self._obs_preprocessor, self._reward_preprocessor,
                                   self._env_ret_preprocess_fn, self._policy_resp_preprocess_fn)

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
        flags = _truncation_list(truncations, len(batched_env_ret))
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
        data = _resolve(data)
        if getattr(data, "env_id", env_id) != env_id:
            raise ValueError(f"add_data_async for env {env_id!r} got data of env {data.env_id!r}")
        if proc.is_env_ret(data):
            if env_id in self._pending:
                self.dropped_env_rets += 1
                logger.warning("env %r: an EnvRet replaced one that never got its PolicyResponse "
                               "(%d replaced so far); the older step is dropped", env_id, self.dropped_env_rets)
            self._pending[env_id] = self._preprocess({}, data, None)
        elif proc.is_policy_resp(data):
            waiting = self._pending.pop(env_id, None)
            if waiting is None:
                raise ValueError(f"env {env_id!r}: a PolicyResponse arrived with no EnvRet waiting for it; "
                                 "add the env's EnvRet first (each EnvRet is answered once)")
            self._seal(self._assembler.append(env_id, self._preprocess(waiting, None, data)))
        else:
            raise TypeError(f"add_data_async takes an EnvRet or a PolicyResponse, got {type(data).__name__}")
        if truncated:
            self.truncate_one_episode(env_id)

    @_locked
    def add_batched_data_async(self, batched_data: Any, truncations: Any = None) -> None:
        """`add_data_async` for every (id, value) of a `BatchedData`.

        Raises:
            ValueError, TypeError: as `add_data_async`; truncations of another length or type.
        """
        flags = _truncation_list(truncations, len(batched_data))
        for (env_id, data), truncated in zip(batched_data.items(), flags):
            self.add_data_async(env_id, data, truncated)

    @_locked
    def add_episode(self, episode: Any, num_envs: int = 1) -> None:
        """Add a finished episode (no pre- or post-processing, as in the seed).

        ``episode`` is a dict (nested dicts allowed), a TensorDict or a Ray
        ObjectRef of one, in the seed's format (``observation`` and
        ``next_observation`` with T rows each, ``reward``, ``terminated``, ...) or
        arrowbuf's (observation fields with T+1 rows). With ``num_envs`` > 1 the
        values are ``[T, num_envs, ...]`` and make ``num_envs`` episodes. A
        segment is cut where ``next_observation[t]`` is not ``observation[t+1]``.

        Raises:
            ValueError: values that are not ``[T, num_envs, ...]``, or that do not
                match the stored schema (`arrowbuf.SchemaError`).
            BufferFullError: a full fixed-mode buffer.
        """
        episode = _resolve(episode)
        if isinstance(episode, TensorDictBase):
            episode = episode.to_dict()
        if not isinstance(episode, Mapping):
            raise TypeError(f"episode must be a dict or TensorDict, got {type(episode).__name__}")
        if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
            raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
        columns = flatten(episode)
        parts = split_envs(columns, int(num_envs), "add_episode") if num_envs > 1 else [columns]
        episodes = []
        for i, part in enumerate(parts):
            env_id = f"add_episode/{i}" if num_envs > 1 else "add_episode"
            episodes += [(env_id, cols, steps) for cols, steps in fold_next(part)]
        self._store_episodes(episodes)

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
        env_id = _env_id_of(item)
        with self._timed("truncate"):
            self._seal(self._assembler.truncate(env_id))

    @_locked
    def truncate_episodes(self, items: Sequence[Any]) -> None:
        """`truncate_one_episode` for each item (env ids or objects with ``env_id``).

        Raises:
            TypeError: an item without an env id (checked before any is truncated).
        """
        env_ids = [_env_id_of(item) for item in items]
        with self._timed("truncate"):
            segments = [segment for env_id in env_ids for segment in self._assembler.truncate(env_id)]
            self._seal(segments)

    def _seal(self, segments: list[Segment]) -> None:
        if segments:
            self._store_episodes([episode for segment in segments for episode in self._episodes_of(segment)])

    def _episodes_of(self, segment: Segment) -> list[tuple[str, dict[str, Any], int]]:
        """(store env id, flat columns, transitions) of each episode in a finished segment."""
        records = segment.records
        if len(records) < 2:   # one observation, no transition
            return []
        env_id = segment.env_id
        if segment.sub_env is not None:
            records = [take_sub_env(record, segment.sub_env) for record in records]
            env_id = f"{env_id}/{segment.sub_env}"
        split = segment.sub_env is None and segment.num_envs > 1
        if self._postprocess_fn is None:
            columns = step_columns(records, env_id)
            parts = split_envs(columns, segment.num_envs, env_id) if split else [columns]
            steps = len(records) - 1
            return [(f"{env_id}/{i}" if split else env_id, part, steps) for i, part in enumerate(parts)]
        processed = self._postprocess_fn({key: [record[key] for record in records] for key in records[0]})
        if isinstance(processed, TensorDictBase):
            processed = processed.to_dict()
        columns = flatten(processed)
        parts = split_envs(columns, segment.num_envs, env_id) if split else [columns]
        return [(f"{env_id}/{i}" if split else env_id, cols, steps)
                for i, part in enumerate(parts) for cols, steps in fold_next(part)]

    def _store_episodes(self, episodes: list[tuple[str, dict[str, Any], int]]) -> None:
        sealed = False
        for env_id, columns, steps in episodes:
            if steps < 1:
                continue
            store = self._ensure_store(steps)
            capacity = self.settings.capacity
            if self.settings.mode == "fixed":
                limit = capacity * self.num_shards
                if self._stored_transitions + steps > limit:
                    raise BufferFullError(
                        f"buffer is full (storage.mode='fixed'): {self._stored_transitions} of {limit} transitions "
                        f"stored, the episode of {steps} from env {env_id!r} does not fit; clear() or sample a "
                        "RolloutBuffer first")
            elif steps > capacity:
                logger.warning("episode of %d transitions from env %r is longer than the capacity %d; "
                               "keeping its last %d", steps, env_id, capacity, capacity)
                columns = {name: column[-(capacity + 1):] if len(column) == steps + 1 else column[-capacity:]
                           for name, column in columns.items()}
                steps = capacity
            with self._timed("add_episode"):
                store.add_episode(unflatten(_with_flags(columns, steps)), env_id=env_id)
            self._stored_transitions += steps
            sealed = True
        if sealed and self.backend == "ray":
            self._store.flush()   # a shard's error surfaces at the call that sent the episode

    # -- reading -----------------------------------------------------------------------------------

    def _space(self, shard: int | None) -> Any:
        """What indices address: per-shard live rank ranges (transition unit) or the episode table."""
        if self.settings.unit == "episode":
            shards, first, length = self._access.episodes()
            if shard is not None:
                keep = shards == shard
                shards, first, length = shards[keep], first[keep], length[keep]
            return shards, first, length
        ranges = self._access.live_ranges()
        if shard is not None:
            if not 0 <= shard < len(ranges):
                raise IndexError(f"storage index {shard} out of range for {len(ranges)} shard(s)")
            ranges = [(a, b) if s == shard else (a, a) for s, (a, b) in enumerate(ranges)]
        return ranges

    @staticmethod
    def _count(space: Any) -> int:
        if isinstance(space, tuple):
            return len(space[0])
        return int(sum(b - a for a, b in space))

    def _read(self, positions: np.ndarray, space: Any) -> TensorDict:
        """The items at ``positions`` of ``space``, in that order, as one TensorDict."""
        device = self.settings.device if self.settings.device != "cpu" else None
        if isinstance(space, tuple):
            shards, first, length = (column[positions] for column in space)
            span = int(length.max()) if len(length) else 0
            steps = np.arange(span, dtype=np.int64)
            ranks = first[:, None] + np.minimum(steps[None, :], length[:, None] - 1)
            mask = steps[None, :] < length[:, None]
        else:
            bounds = np.cumsum([b - a for a, b in space])
            shards = np.searchsorted(bounds, positions, side="right")
            starts = bounds - np.array([b - a for a, b in space])
            ranks = np.array([a for a, _ in space], np.int64)[shards] + positions - starts[shards]
            span = mask = None
        if not len(positions):
            batch = self._access.gather(0, np.zeros(0, np.int64), device) if self.backend == "local" \
                else TensorDict({}, batch_size=[0])
            return _to_seed_keys(batch)
        parts, order = [], []
        for shard in np.unique(shards):
            chosen = np.flatnonzero(shards == shard)
            part = self._access.gather(int(shard), ranks[chosen].reshape(-1), device)
            parts.append(part.reshape(len(chosen), span) if span is not None else part)
            order.append(chosen)
        batch = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if len(parts) > 1:
            batch = batch[torch.from_numpy(np.argsort(np.concatenate(order), kind="stable"))]
        if mask is not None:
            mask = torch.from_numpy(mask)
            batch["mask"] = mask.to(batch.device) if batch.device is not None else mask
        return _to_seed_keys(batch)

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
            if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)):
                raise TypeError(f"storage index must be an int, got {shard!r}")
            shard = int(shard)
        unit = self.settings.unit
        if self._store is None:
            _positions(item, 0, unit)   # raises for ints; empty selections read as an empty batch
            return TensorDict({}, batch_size=[0])
        with self._timed("get"):
            space = self._space(shard)
            positions, scalar = _positions(item, self._count(space), unit)
            batch = self._read(positions, space)
        return batch[0] if scalar else batch

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
        if self.num_shards > 1 and self._store is not None:
            return {shard: self[shard, :] for shard in range(self.num_shards)}
        return self[:]

    # -- sampling -----------------------------------------------------------------------------------

    def _select(self, batch_size: int | None, count: int, shuffle: bool) -> np.ndarray:
        sampler = self.settings.sampler
        if sampler == "all":
            if batch_size is not None and batch_size != count:
                logger.warning("sampler 'all' returns all %d stored items; batch_size=%d is ignored",
                               count, batch_size)
            return self._rng.permutation(count) if shuffle else np.arange(count)
        if batch_size is None:
            raise ValueError(f"sampler {sampler!r} needs a batch_size (got None); only sampler 'all' samples "
                             "everything without one")
        if sampler == "uniform":
            if count == 0:
                raise ValueError("cannot sample: the buffer is empty")
            return self._rng.integers(0, count, size=batch_size)
        if batch_size > count:
            raise ValueError(f"sampler 'batch' draws without replacement: batch_size {batch_size} is more than "
                             f"the {count} stored items")
        return self._rng.choice(count, size=batch_size, replace=False)

    def _split(self, indices: np.ndarray, drop_last: bool) -> list[np.ndarray]:
        workers = self.num_train_workers
        n = len(indices)
        if drop_last:
            per_worker = n // workers
            if per_worker == 0 and n:
                raise ValueError(f"a batch of {n} items cannot be split over {workers} train workers with "
                                 "drop_last=True; sample more or pass drop_last=False")
            indices = indices[:per_worker * workers]
        else:
            indices = np.resize(indices, math.ceil(n / workers) * workers) if n else indices
        return [indices[k::workers] for k in range(workers)]

    @_locked
    def sample(self, batch_size: int | None = None, shuffle: bool = True, drop_last: bool = True) -> list[TensorDict]:
        """Sample with the config's sampler; one batch per train worker.

        ReplayBuffer keeps its data; RolloutBuffer clears what it stored (episodes
        in progress stay). See the module docstring for the samplers and the split.

        Raises:
            ValueError: ``batch_size`` larger than the stored items (except for
                sampler 'all'), missing for 'uniform' / 'batch', not an int >= 1,
                or too small for the train workers with ``drop_last``.
        """
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
        with self._timed("sample"):
            total = self.size()
            self._check_batch(batch_size, total)
            if self._store is None:
                self._select(batch_size, 0, shuffle)   # the sampler's own errors
                return [TensorDict({}, batch_size=[0]) for _ in range(self.num_train_workers)]
            space = self._space(None)
            indices = self._select(batch_size, self._count(space), shuffle)
            batches = [self._read(part, space) for part in self._split(indices, drop_last)]
        self._after_sample()
        return batches

    def _check_batch(self, batch_size: int | None, total: int) -> None:
        if batch_size is not None and batch_size > total:
            raise ValueError(f"not enough data in the buffer for a batch of {batch_size}: it holds {total} "
                             f"{self.settings.unit}s; collect more or lower the batch size")

    def _after_sample(self) -> None:
        """ReplayBuffer: nothing (data is kept)."""

    # -- clearing -----------------------------------------------------------------------------------

    def _clear_stored(self) -> None:
        if self._store is not None:
            self._store.clear()
        self._stored_transitions = 0

    @_locked
    def clear(self) -> None:
        """Drop everything: stored data, episodes in progress and EnvRets waiting for a response."""
        with self._timed("clear"):
            size_before = self.size()
            open_envs = len(self._assembler.open_envs())
            self._clear_stored()
            self._assembler.clear()
            self._pending.clear()
        logger.debug("buffer cleared: %d %ss stored, %d open episodes and %d waiting EnvRets dropped",
                     size_before, self.settings.unit, open_envs, len(self._pending))


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
        self._clear_stored()


_BUFFERS = {"ReplayBuffer": ReplayBuffer, "RolloutBuffer": RolloutBuffer}


def build_data_buffer(buffer_cls: Any, buffer_cfg: Any, *args: Any, **kwargs: Any) -> DataBuffer:
    """The seed's builder: ``buffer_cls`` is a class or a registered name ("ReplayBuffer" / "RolloutBuffer")."""
    if isinstance(buffer_cls, str):
        if buffer_cls not in _BUFFERS:
            raise ValueError(f"unknown buffer class {buffer_cls!r}; expected one of {sorted(_BUFFERS)}")
        buffer_cls = _BUFFERS[buffer_cls]
    return buffer_cls(buffer_cfg, *args, **kwargs)
