"""Step records -> episodes, with the seed's semantics.

A *record* is one env step as the seed kept it: the EnvRet's fields (observation
o_t, ``last_reward`` r_{t-1}, ``last_terminated`` / ``last_truncated`` of the
previous action, ``_extra`` keys) merged with the PolicyResponse's (action a_t,
log_prob, value, ...). A finished segment of T+1 records is T transitions:

- ``observation`` (and its nested leaves): all T+1 records -> an arrowbuf
  observation field (the last one is the final observation, read as ``next``);
- ``last_X``: records 1..T -> field ``X`` (reward, terminated, truncated);
- every other key (policy outputs, ``_extra``): records 0..T-1 -> a step field;
- keys containing ``"info"`` are dropped.

This is the seed's ``default_postprocess_fn``, without stacking the observation
twice. Python floats become float32 (torch's default, as the seed's
``torch.tensor``).

`Assembler` keeps the in-progress records of each env (per-env lists, as the
seed's API is per env) and hands back finished `Segment` s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arrowbuf.schema import flatten


@dataclass
class Segment:
    """Records of one finished segment: T+1 records of env ``env_id``.

    ``sub_env`` set: every record is vectorized and only sub-env ``sub_env`` is
    taken. ``num_envs`` > 1 with ``sub_env`` None: the segment holds all sub-envs
    and is split into ``num_envs`` episodes after stacking.
    """

    env_id: str
    records: list[dict[str, Any]]
    sub_env: int | None = None
    num_envs: int = 1


class _Stream:
    __slots__ = ("base", "records", "starts")

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.base = 0                          # running number of records[0]
        self.starts: np.ndarray | None = None  # auto-truncate, vectorized: first record of each sub-env


def _as_bools(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value).astype(bool)


def done_flags(record: Mapping[str, Any], num_envs: int, env_id: str) -> np.ndarray:
    """``last_terminated | last_truncated`` of a record, one flag per sub-env ([1] if not vectorized).

    Raises:
        ValueError: flags of a shape that does not match ``num_envs``.
    """
    done = np.zeros(max(num_envs, 1), bool)
    for key in ("last_terminated", "last_truncated"):
        flags = _as_bools(record.get(key, False))
        if num_envs > 1:
            if flags.ndim and flags.shape != (num_envs,):
                raise ValueError(f"env {env_id!r}: {key} has shape {flags.shape}, expected ({num_envs},) "
                                 f"for an env of num_envs={num_envs}")
        elif flags.size != 1:
            raise ValueError(f"env {env_id!r}: {key} has shape {flags.shape} but the env has num_envs=1; "
                             "declare its num_envs in init(env_meta_list=...)")
        done |= flags.reshape(-1) if flags.ndim else flags
    return done


class Assembler:
    """In-progress records per env, cut into segments by truncation or (auto) done flags.

    Args:
        auto_truncate: end an episode at a record whose ``last_terminated`` or
            ``last_truncated`` is set (per sub-env for vectorized envs).
        num_envs: env id -> its vector size (1: not vectorized).
    """

    def __init__(self, auto_truncate: bool, num_envs: Callable[[str], int]) -> None:
        self.auto_truncate = auto_truncate
        self._num_envs = num_envs
        self._streams: dict[str, _Stream] = {}

    def open_envs(self) -> list[str]:
        return list(self._streams)

    def open_records(self) -> int:
        return sum(len(s.records) for s in self._streams.values())

    def clear(self) -> None:
        self._streams.clear()

    def append(self, env_id: str, record: dict[str, Any]) -> list[Segment]:
        """Add one record; returns the segments it ended (auto-truncate only)."""
        stream = self._streams.setdefault(env_id, _Stream())
        stream.records.append(record)
        if not self.auto_truncate:
            return []
        n = self._num_envs(env_id)
        done = done_flags(record, n, env_id)
        if n <= 1:
            if done[0]:
                del self._streams[env_id]
                return [Segment(env_id, stream.records)]
            return []
        if stream.starts is None:
            stream.starts = np.full(n, stream.base, np.int64)
        last = stream.base + len(stream.records) - 1
        segments = [Segment(env_id, stream.records[stream.starts[i] - stream.base:], int(i), n)
                    for i in np.flatnonzero(done)]
        stream.starts[done] = last + 1   # the record after a done one starts the next episode
        drop = int(stream.starts.min()) - stream.base
        if drop > 0:
            del stream.records[:drop]
            stream.base += drop
        return segments

    def truncate(self, env_id: str) -> list[Segment]:
        """End the open episode(s) of ``env_id`` (or of one sub-env ``"<env_id>/<i>"``).

        Nothing open is not an error (the seed raised KeyError right after an
        automatic truncation).
        """
        stream = self._streams.pop(env_id, None)
        if stream is None:
            return self._truncate_sub_env(env_id)
        n = self._num_envs(env_id)
        if self.auto_truncate and n > 1:
            return [Segment(env_id, stream.records[int(start) - stream.base:], i, n)
                    for i, start in enumerate(stream.starts)]
        return [Segment(env_id, stream.records, None, n)]

    def _truncate_sub_env(self, env_id: str) -> list[Segment]:
        parent, _, index = env_id.rpartition("/")
        stream = self._streams.get(parent)
        if stream is None or stream.starts is None or not index.isdigit() or int(index) >= len(stream.starts):
            return []
        i = int(index)
        segment = Segment(parent, stream.records[int(stream.starts[i]) - stream.base:], i, len(stream.starts))
        stream.starts[i] = stream.base + len(stream.records)
        return [segment]


# -- columns ------------------------------------------------------------------------


def _stack(values: list[Any], name: str) -> Any:
    """Values of one field over steps, stacked on a new first axis (numpy or torch)."""
    try:
        if any(isinstance(v, torch.Tensor) for v in values):
            return torch.stack([torch.as_tensor(v) for v in values])
        array = np.asarray(values)
    except (ValueError, RuntimeError, TypeError) as err:
        raise ValueError(f"field {name!r}: cannot stack its values over the steps of an episode "
                         f"(unequal shapes or types?): {err}") from None
    if type(values[0]) is float and array.dtype == np.float64:
        array = array.astype(np.float32)   # torch.tensor's default for Python floats
    if array.dtype == object:
        raise ValueError(f"field {name!r}: values of unequal shapes or non-numeric types "
                         f"(first: {type(values[0]).__name__})")
    return array


def _stack_tree(values: list[Any], name: str) -> Any:
    if isinstance(values[0], Mapping):
        return {key: _stack_tree([v[key] for v in values], f"{name}.{key}") for key in values[0]}
    return _stack(values, name)


def take_sub_env(value: Any, i: int) -> Any:
    """Sub-env ``i`` of a vectorized value (nested dicts too); scalars are shared."""
    if isinstance(value, Mapping):
        return {key: take_sub_env(v, i) for key, v in value.items()}
    return value[i] if np.ndim(value) >= 1 else value


def step_columns(records: list[dict[str, Any]], env_id: str) -> dict[str, Any]:
    """The flat columns of a segment of T+1 records (observation fields with T+1 rows).

    Raises:
        ValueError: records with different keys, two keys that map to one
            field, or values that cannot be stacked.
    """
    keys = list(records[0])
    for t, record in enumerate(records[1:], 1):
        if record.keys() != set(keys):
            missing = sorted(set(keys) - record.keys())
            extra = sorted(record.keys() - set(keys))
            raise ValueError(f"env {env_id!r}: step {t} of the episode has different keys than step 0 "
                             f"(missing {missing}, extra {extra})")
    columns: dict[str, Any] = {}
    for key in keys:
        if "info" in key:
            continue
        values = [record[key] for record in records]
        if key.startswith("last_"):
            name, values = key[len("last_"):], values[1:]
        elif key == "observation":
            name = key
        else:
            name, values = key, values[:-1]
        for leaf, column in flatten({name: _stack_tree(values, name)}).items():
            if leaf in columns:
                raise ValueError(f"env {env_id!r}: field {leaf!r} comes from two keys ({key!r} and another); "
                                 "rename one of them")
            columns[leaf] = column
    return columns


def split_envs(columns: Mapping[str, Any], num_envs: int, env_id: str) -> list[dict[str, Any]]:
    """Columns of a vectorized segment ([steps, num_envs, ...]) -> one dict per sub-env.

    Raises:
        ValueError: a column that is not [steps, num_envs, ...].
    """
    for name, column in columns.items():
        shape = tuple(column.shape)
        if len(shape) < 2 or shape[1] != num_envs:
            raise ValueError(f"env {env_id!r}: field {name!r} has shape {shape}, expected "
                             f"[steps, {num_envs}, ...] for an env of num_envs={num_envs}")
    return [{name: column[:, i] for name, column in columns.items()} for i in range(num_envs)]


def _numpy_view(column: Any) -> np.ndarray:
    if isinstance(column, torch.Tensor):
        column = column.detach().cpu()
        if column.dtype == torch.bfloat16:
            column = column.view(torch.int16)
        return column.numpy()
    return np.asarray(column)


def _rows_differ(a: Any, b: Any) -> np.ndarray:
    """Per row: does row t of ``a`` differ from row t of ``b`` (NaN equals NaN)?"""
    a, b = _numpy_view(a), _numpy_view(b)
    if a.shape != b.shape:
        return np.ones(len(a), bool)
    differ = a != b
    if np.issubdtype(a.dtype, np.floating) and np.issubdtype(b.dtype, np.floating):
        differ &= ~(np.isnan(a) & np.isnan(b))
    return differ.reshape(len(a), -1).any(axis=1)


def _concat(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.cat([torch.as_tensor(a), torch.as_tensor(b)])
    return np.concatenate([a, b])


def fold_next(columns: Mapping[str, Any]) -> list[tuple[dict[str, Any], int]]:
    """Seed-format columns (``observation`` and ``next_observation``, T rows each) -> arrowbuf episodes.

    Every field ``k`` with a ``next_k`` partner becomes an observation field of
    T+1 rows (``k`` plus the last ``next_k``). Where ``next_k[t]`` is not
    ``k[t+1]`` (an episode boundary inside the segment, e.g. a vector env that
    reset itself) the segment is cut there, so every transition keeps its own
    next observation. Columns without partners pass through unchanged.

    Returns:
        (columns, transitions) of each episode.
    """
    columns = dict(columns)
    pairs = {name: f"next_{name}" for name in columns if f"next_{name}" in columns}
    if not pairs:   # arrowbuf's format: observation fields have T+1 rows, step fields T
        return [(columns, min((len(column) for column in columns.values()), default=0))]
    steps = len(columns[next(iter(pairs))])
    differ = np.zeros(max(steps - 1, 0), bool)
    for name, partner in pairs.items():
        obs, nxt = columns[name], columns[partner]
        if len(obs) != steps or len(nxt) != steps:
            raise ValueError(f"fields {name!r} and {partner!r} have {len(obs)} and {len(nxt)} rows; "
                             f"expected {steps} each")
        if steps > 1:
            differ |= _rows_differ(obs[1:], nxt[:-1])
    ends = [int(t) for t in np.flatnonzero(differ)] + [steps - 1]
    others = [name for name in columns if name not in pairs and name not in pairs.values()]
    episodes = []
    start = 0
    for end in ends:
        cut = slice(start, end + 1)
        episode = {name: _concat(columns[name][cut], columns[partner][end:end + 1]) for name, partner in pairs.items()}
        episode.update({name: columns[name] if len(ends) == 1 else columns[name][cut] for name in others})
        episodes.append((episode, end + 1 - start))
        start = end + 1
    return episodes
