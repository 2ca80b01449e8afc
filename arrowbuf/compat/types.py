"""The RLightning rollout types (`EnvRet`, `PolicyResponse`, `BatchedData`, `EnvMeta`).

Faithful to ``rlightning.types`` (field names, defaults, ``to_dict`` rules), so
code written against the seed runs unchanged; re-exported as `arrowbuf.types`.

Changes from the seed, none of which a caller relies on:

- `PolicyResponse.compute_sent_latency` reads ``ts_policy_sent_ns`` (the seed read
  the env's timestamp, which a response never carries, and reported ~0).
- `BatchedData` does not import Ray: a value is a future if it is a
  ``ray.ObjectRef`` and Ray is already imported (nothing else can make one).
- Tensor conversion (``cpu``/``cuda``/``numpy``) walks nested dicts, lists and
  tuples; as in the seed, ``numpy()`` sends bfloat16 tensors as uint16 views of
  their bits, which the buffer turns back into bfloat16.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields, replace
from types import SimpleNamespace
from typing import Any

import torch

from arrowbuf._checks import tensor_to_numpy

__all__ = ["BatchedData", "EnvMeta", "EnvRet", "MultiAgentEnvRet", "MultiAgentPolicyResponse", "PolicyResponse",
           "Processed_EnvRet_fields"]

#: Keys of a post-processed step (the seed's ``Processed_EnvRet_fields``).
Processed_EnvRet_fields = ("next_observation", "reward", "terminated", "truncated", "info")


def _map_tensors(value: Any, fn) -> Any:
    """``fn`` applied to every tensor in nested dicts / lists / tuples (new containers)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _latency(ts: Any, now_ns: int | None) -> float:
    try:
        ts = int(ts)
    except (TypeError, ValueError):
        return 0.0
    now_ns = time.time_ns() if now_ns is None else now_ns
    return max(0.0, (now_ns - ts) / 1e9)


class _TensorConversions:
    """`cpu`, `cuda` and `numpy` through one ``_apply(fn)`` (a copy or in place, per class)."""

    def _apply(self, fn):
        raise NotImplementedError

    def cpu(self):
        """Every tensor on the CPU."""
        return self._apply(lambda t: t.cpu())

    def cuda(self, device: int | str | None = None):
        """Every tensor on ``device`` (default ``"cuda"``)."""
        device = "cuda" if device is None else device
        return self._apply(lambda t: t.to(device))

    def numpy(self):
        """Every tensor as a numpy array (bfloat16 as its uint16 bits, as the seed sends it)."""
        return self._apply(tensor_to_numpy)   # bf16 as uint16 bits: the seed's carrier


@dataclass
class EnvRet(_TensorConversions):
    """What an environment returned from ``reset`` or ``step``.

    ``last_*`` describe the *previous* action: a reset carries the dummy reward 0.
    A vectorized env worker sends one EnvRet whose fields lead with ``num_envs``.

    Attributes:
        env_id: the env worker's id.
        observation: the observation after the step / reset (any nesting of arrays).
        last_reward, last_terminated, last_truncated: outcome of the previous action.
        info: the env's info dict (not stored by the buffer).
        _extra: more per-step fields, flattened into `to_dict`.
        ts_env_sent_ns: when it was produced (ns since the epoch).
    """

    env_id: str
    observation: Any
    last_reward: Any = 0.0
    last_terminated: Any = False
    last_truncated: Any = False
    info: dict[str, Any] = field(default_factory=dict)
    _extra: dict[str, Any] = field(default_factory=dict)
    ts_env_sent_ns: int = field(default_factory=time.time_ns)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The data fields: observation, last_reward, last_terminated, last_truncated, info."""
        return tuple(f.name for f in fields(cls) if f.name not in ("env_id", "ts_env_sent_ns", "_extra"))

    @classmethod
    def get_defaults(cls) -> dict[str, Any]:
        """Default values of the data fields that have a plain default."""
        return {f.name: f.default for f in fields(cls) if f.name in cls.fields() and f.default is not MISSING}

    def to_dict(self) -> dict[str, Any]:
        """The data fields and the ``_extra`` keys in one dict.

        Raises:
            KeyError: an ``_extra`` key has the name of a data field.
        """
        result = {name: getattr(self, name) for name in self.fields()}
        for key, value in self._extra.items():
            if key in result:
                raise KeyError(f"_extra key {key!r} of EnvRet(env_id={self.env_id!r}) clashes with the EnvRet "
                               f"field {key!r}; rename it")
            result[key] = value
        return result

    def _apply(self, fn) -> EnvRet:
        """A converted copy: `cpu`, `cuda` and `numpy` leave this EnvRet unchanged."""
        changes = {name: _map_tensors(getattr(self, name), fn) for name in self.fields()}
        return replace(self, **changes, _extra=_map_tensors(self._extra, fn))

    def mark_env_sent(self) -> EnvRet:
        """Stamp ``ts_env_sent_ns`` with now; returns self."""
        self.ts_env_sent_ns = time.time_ns()
        return self

    def compute_sent_latency(self, now_ns: int | None = None) -> float:
        """Seconds since ``ts_env_sent_ns`` (0.0 if it is missing or invalid)."""
        return _latency(self.ts_env_sent_ns, now_ns)

    def __hash__(self) -> int:
        return hash(self.env_id)


class PolicyResponse(_TensorConversions, SimpleNamespace):
    """A policy's answer to one EnvRet: ``env_id`` plus any fields (action, log_prob, value, ...).

    As in the seed, `cpu`, `cuda` and `numpy` convert in place and return self.
    """

    def __init__(self, env_id: str, **data: Any) -> None:
        super().__init__(**data)
        self.env_id = env_id

    @property
    def _fields(self) -> list[str]:
        return [k for k in self.__dict__ if k not in ("env_id", "ts_policy_sent_ns")]

    def to_dict(self) -> dict[str, Any]:
        """Every field except ``env_id`` and ``ts_policy_sent_ns``."""
        return {key: getattr(self, key) for key in self._fields}

    def _apply(self, fn) -> PolicyResponse:
        """Convert in place (as in the seed) and return self."""
        for key in self._fields:
            setattr(self, key, _map_tensors(getattr(self, key), fn))
        return self

    def mark_policy_sent(self) -> PolicyResponse:
        """Stamp ``ts_policy_sent_ns`` with now; returns self."""
        self.ts_policy_sent_ns = time.time_ns()
        return self

    def compute_sent_latency(self, now_ns: int | None = None) -> float:
        """Seconds since ``ts_policy_sent_ns`` (0.0 if it was never stamped)."""
        return _latency(getattr(self, "ts_policy_sent_ns", None), now_ns)

    def __reduce__(self) -> tuple:
        return (self.__class__.__new__, (self.__class__,), self.__dict__)

    @staticmethod
    def make_example(action_space: Any, env_id: str | None = None, **data: Any) -> PolicyResponse:
        """A response with an action sampled from ``action_space`` (a gymnasium space) and ``data``."""
        return PolicyResponse(env_id=env_id, action=action_space.sample(), **data)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass
class MultiAgentEnvRet(EnvRet):
    """An EnvRet of several agents: ``last_reward``, ``last_terminated`` and
    ``last_truncated`` are dicts agent id -> value (stored as nested fields
    ``reward.<agent>``, ...); an episode ends when any agent's flag is set."""

    last_reward: dict[str, Any] = field(default_factory=dict)
    last_terminated: dict[str, Any] = field(default_factory=dict)
    last_truncated: dict[str, Any] = field(default_factory=dict)


class MultiAgentPolicyResponse(PolicyResponse):
    """A PolicyResponse whose ``action`` is a dict agent id -> action."""

    @staticmethod
    def make_example(action_spaces: dict[str, Any], env_id: str | None = None, **data: Any) -> MultiAgentPolicyResponse:
        """A response with one action sampled per agent from ``action_spaces``."""
        return MultiAgentPolicyResponse(env_id=env_id, action={k: v.sample() for k, v in action_spaces.items()},
                                        **data)


def is_future_ref(value: Any) -> bool:
    """Whether ``value`` is a Ray ObjectRef (data a remote env or policy sent), without importing Ray."""
    ray = sys.modules.get("ray")
    object_ref = getattr(ray, "ObjectRef", None) if ray is not None else None
    return object_ref is not None and isinstance(value, object_ref)


class BatchedData:
    """Ordered ``(id, value)`` pairs; ids may repeat, values may be Ray ObjectRefs.

    Raises:
        ValueError: ``ids`` and ``data`` differ in length.
    """

    def __init__(self, ids: Any, data: Any) -> None:
        ids, data = tuple(ids), tuple(data)
        if len(ids) != len(data):
            raise ValueError(f"BatchedData got {len(ids)} ids but {len(data)} values; expected as many of each")
        self._ids = ids
        self._data = data
        self.is_future = any(is_future_ref(d) for d in data)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return zip(self._ids, self._data)

    def items(self) -> Iterator[tuple[Any, Any]]:
        return zip(self._ids, self._data)

    def ids(self) -> tuple:
        return self._ids

    def values(self) -> tuple:
        return self._data

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, id_key: Any) -> Any:
        """The value of the first pair with this id.

        Raises:
            KeyError: no pair has this id.
        """
        try:
            return self._data[self._ids.index(id_key)]
        except ValueError:
            raise KeyError(f"no value with id {id_key!r} in BatchedData of ids {self._ids!r}") from None

    def __repr__(self) -> str:
        return f"BatchedData(ids={list(self._ids)!r}, is_future={self.is_future})"

    @staticmethod
    def from_dict(data_dict: dict) -> BatchedData:
        return BatchedData(list(data_dict.keys()), list(data_dict.values()))


@dataclass
class EnvMeta:
    """What an env worker declares at start-up: its id, spaces and vector size."""

    env_id: str | None = None
    action_space: Any = None
    observation_space: Any = None
    num_envs: int | None = None
