"""What comes in: EnvRets and PolicyResponses (sync pairs or async halves), truncations and
whole episodes, turned into step records and handed to the `Segmenter`; finished
episodes go to the `StoreSink`.

Async pairing: an EnvRet waits for its PolicyResponse; the pair is one record.
A truncation ends the records paired so far (a waiting EnvRet opens the next
segment). A PolicyResponse with no EnvRet waiting is an error (the seed merged it
into an already stored step).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from arrowbuf._checks import check_int, is_int
from arrowbuf.compat.processing import Hooks, is_env_ret, is_policy_resp
from arrowbuf.compat.segments import Piece, Segmenter
from arrowbuf.compat.sink import StoreSink
from arrowbuf.compat.timing import Timers
from arrowbuf.compat.types import is_future_ref
from arrowbuf.schema import flatten

logger = logging.getLogger(__name__)


def resolve(value: Any) -> Any:
    """The value of a Ray ObjectRef (values sent by remote envs / policies), else the value."""
    if is_future_ref(value):
        import ray

        return ray.get(value)
    return value


def env_id_of(item: Any) -> str:
    """The env id of ``item`` (a str or anything with ``env_id``).

    Raises:
        TypeError: neither.
    """
    env_id = item if isinstance(item, str) else getattr(item, "env_id", None)
    if not isinstance(env_id, str):
        raise TypeError(f"expected an env_id str or an object with an env_id attribute, got {type(item).__name__}")
    return env_id


def truncation_list(truncations: Any, count: int) -> list[bool]:
    """``truncations`` (None, a bool, or one per item) as ``count`` bools.

    Raises:
        ValueError: another number of entries; TypeError: another type.
    """
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


def parse_env_meta(env_meta_list: Sequence[Any] | None) -> dict[str, int]:
    """env id -> num_envs of `EnvMeta` objects or dicts (None or 1: not vectorized).

    Raises:
        ValueError: an entry without an env_id or with a bad num_envs.
    """
    num_envs = {}
    for meta in env_meta_list or []:
        get = meta.get if isinstance(meta, Mapping) else (lambda key, default, m=meta: getattr(m, key, default))
        env_id, n = get("env_id", None), get("num_envs", None)
        if not isinstance(env_id, str):
            raise ValueError(f"env meta {meta!r} has no env_id str")
        n = 1 if n is None else n
        if not is_int(n, 1):
            raise ValueError(f"env meta of {env_id!r}: num_envs must be an int >= 1 or None, got {n!r}")
        num_envs[env_id] = int(n)
    return num_envs


class Ingest:
    """Records in, finished episodes out to the sink.

    Args:
        hooks: the buffer's pre-processing hooks.
        segmenter: where records become episodes.
        sink: where episodes are stored.
        timers: ``truncate`` calls are timed here.
    """

    def __init__(self, hooks: Hooks, segmenter: Segmenter, sink: StoreSink, timers: Timers) -> None:
        self.hooks = hooks
        self.segmenter = segmenter
        self.sink = sink
        self._timers = timers
        self.pending: dict[str, dict[str, Any]] = {}   # async: env id -> EnvRet record awaiting its response
        self.dropped_env_rets = 0                       # async EnvRets replaced before their response came

    def add_pair(self, env_id: str, env_ret: Any, policy_resp: Any, truncated: bool) -> None:
        env_ret, policy_resp = resolve(env_ret), resolve(policy_resp)
        if getattr(env_ret, "env_id", env_id) != env_id:
            raise ValueError(f"add_transition for env {env_id!r} got an EnvRet of env {env_ret.env_id!r}")
        self.sink.write(self.segmenter.append(env_id, self.hooks.preprocess({}, env_ret, policy_resp)))
        if truncated:
            self.truncate([env_id])

    def add_async(self, env_id: str, data: Any, truncated: bool) -> None:
        data = resolve(data)
        if getattr(data, "env_id", env_id) != env_id:
            raise ValueError(f"add_data_async for env {env_id!r} got data of env {data.env_id!r}")
        if is_env_ret(data):
            if env_id in self.pending:
                self.dropped_env_rets += 1
                logger.warning("env %r: an EnvRet replaced one that never got its PolicyResponse "
                               "(%d replaced so far); the older step is dropped", env_id, self.dropped_env_rets)
            self.pending[env_id] = self.hooks.preprocess({}, data, None)
        elif is_policy_resp(data):
            waiting = self.pending.pop(env_id, None)
            if waiting is None:
                raise ValueError(f"env {env_id!r}: a PolicyResponse arrived with no EnvRet waiting for it; "
                                 "add the env's EnvRet first (each EnvRet is answered once)")
            self.sink.write(self.segmenter.append(env_id, self.hooks.preprocess(waiting, None, data)))
        else:
            raise TypeError(f"add_data_async takes an EnvRet or a PolicyResponse, got {type(data).__name__}")
        if truncated:
            self.truncate([env_id])

    def truncate(self, items: Sequence[Any]) -> None:
        env_ids = [env_id_of(item) for item in items]   # all checked before any is truncated
        with self._timers.timed("truncate"):
            self.sink.write([piece for env_id in env_ids for piece in self.segmenter.truncate(env_id)])

    def add_episode(self, episode: Any, num_envs: Any) -> None:
        episode = resolve(episode)
        if isinstance(episode, TensorDictBase):
            episode = episode.to_dict()
        if not isinstance(episode, Mapping):
            raise TypeError(f"episode must be a dict or TensorDict, got {type(episode).__name__}")
        num_envs = check_int("num_envs", num_envs, 1)
        columns = flatten(episode)
        if num_envs == 1:
            lengths = [len(column) for column in columns.values()]
            self.sink.write([Piece("add_episode", columns, min(lengths, default=0))])
            return
        for name, column in columns.items():
            shape = tuple(column.shape)
            if len(shape) < 2 or shape[1] != num_envs:
                raise ValueError(f"add_episode: field {name!r} has shape {shape}, expected [T, {num_envs}, ...] "
                                 f"for num_envs={num_envs}")
        steps = min(len(column) for column in columns.values())
        self.sink.write([Piece(f"add_episode/{i}", {name: column[:, i] for name, column in columns.items()}, steps)
                         for i in range(int(num_envs))])

    def clear(self) -> tuple[int, int]:
        """Drop open episodes and waiting EnvRets; returns how many of each."""
        dropped = (len(self.segmenter.open_envs()), len(self.pending))
        self.segmenter.clear()
        self.pending.clear()
        return dropped
