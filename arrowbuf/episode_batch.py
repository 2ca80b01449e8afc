"""Many episodes at once: columns shaped [E, T, ...], checked once, split into `Episode` views.

`read_episodes` is the reading half of `ExperienceStore.add_episodes`: E
episodes of up to T steps stacked on a leading axis (a rollout of E envs, a
padded batch of trajectories). Every episode of a batch has the same dtypes and
per-step shapes, so checking the first one against the schema checks them all;
the episodes are then views of the batch's arrays (no copy until the shard
copies them in), cut to their ``lengths``. Ragged and text fields, whose rows have
no [E, T] form, may come as E values, one per episode: each is read and checked
on its own (an error names the field and the episode).

Example:
    >>> import numpy as np, arrowbuf as ab
    >>> store = ab.ExperienceStore(capacity=1_000)
    >>> E, T = 4, 5
    >>> ids = store.add_episodes({"obs": np.zeros((E, T + 1, 3), np.float32),
    ...                           "action": np.zeros((E, T), np.int64), "reward": np.ones((E, T)),
    ...                           "terminated": np.zeros((E, T), bool), "truncated": np.ones((E, T), bool)},
    ...                          lengths=[5, 3, 5, 1], env_ids=[f"env-{e}" for e in range(E)])
    >>> ids, len(store)
    ([0, 1, 2, 3], 14)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from arrowbuf._lazy_torch import is_tensordict
from arrowbuf._checks import check_env_id, check_metadata
from arrowbuf.stage_arrays import step_tensor
from arrowbuf.errors import SchemaError, describe
from arrowbuf.fields import as_array, check_column
from arrowbuf.schema import Schema, flatten
from arrowbuf.block_add import EpisodeBatch
from arrowbuf.episode_read import read_columns, read_episode
from arrowbuf.shard import Episode



def read_episodes(data: Any, schema: Schema | None, lengths: Any = None, env_ids: Any = None,
                  metadata: Any = None, keep_tensors: bool = False,
                  observations: Any = None) -> tuple[list[Episode], Schema]:
    """Check a batch of E episodes against ``schema`` (inferred from the first when None).

    Args:
        data: a dict (nested dicts allowed) or TensorDict of arrays / tensors shaped
            [E, T, ...] for step fields and [E, T + 1, ...] (with final
            observations) or [E, T, ...] for observation fields; a ragged or text field
            also as a list of E values, one per episode, each any form of its rows (a list
            of sequences or of str, a jagged nested tensor, an Arrow array) with a row per step.
            Or a list of E episodes, each as `arrowbuf.episode_read.read_episode` reads one (any
            lengths; then no ``lengths``): each is checked, an error names it.
        lengths: None (every episode has T steps) or E ints in [1, T]: episode e
            is its first ``lengths[e]`` steps (and observations up to its final
            one, row ``lengths[e]``); later rows are padding, never read.
        env_ids: None ("default"), one env id for all, or E env ids.
        metadata: None, or E JSON-serializable mappings (or None each).
        keep_tensors: torch tensors stay tensors on their device (a torch arena's
            store: `arrowbuf.arena`), and the episodes are views of them.
        observations: the observation fields' names, when ``schema`` is None and is
            inferred (`Schema.infer`'s ``observation_names``); None: by their names.

    Returns:
        The E episodes, in order, and the schema they satisfy.

    Raises:
        SchemaError: a field's dtype or per-step shape, ragged lengths, or arrays
            whose leading dims differ (named).
        ValueError: bad ``lengths``, ``env_ids`` or ``metadata``.
    """
    if isinstance(data, (list, tuple)) and data and all(isinstance(e, Mapping) or is_tensordict(e) for e in data):
        return _read_list(data, schema, lengths, env_ids, metadata, keep_tensors, observations)
    if is_tensordict(data):
        data = data.to_dict()
    if not isinstance(data, Mapping) or not data:
        raise SchemaError(f"episodes must be a non-empty dict or TensorDict of [E, T, ...] arrays, or a list of "
                          f"episodes (dicts or TensorDicts, any lengths), got {describe(data)}")
    exact = schema.read_exact(data, stacked=True) if schema is not None and not keep_tensors else None
    if exact is not None:   # numpy arrays of the fields' exact dtypes and shapes: nothing to read or check
        flat, (num_steps, has_final), apart = exact[0], exact[1:], {}
        columns = {name: (array, schema.fields[name].dtype) for name, array in flat.items()}
        count = len(next(iter(flat.values())))
    else:
        flat, columns, apart, count, schema, (num_steps, has_final) = _read_stacked(data, schema, keep_tensors,
                                                                                    observations)
    steps = _lengths(lengths, count, num_steps)
    ids = _env_ids(env_ids, count)
    metas = _metadata(metadata, count)
    observation = {name: schema.fields[name].observation for name in flat}
    for name, values in apart.items():
        short = [e for e, (value, _) in enumerate(values) if len(value) < steps[e]]
        if short:
            raise SchemaError(f"field {name!r}: episode {short[0]} has {len(values[short[0]][0])} rows for its "
                              f"{int(steps[short[0]])} steps; give each episode a row per step")
    episodes = EpisodeBatch()
    for e, length in enumerate(steps.tolist()):
        cut = {name: array[e, :length + int(has_final and observation[name])] for name, (array, _) in columns.items()}
        cut.update({name: values[e][0][:length] for name, values in apart.items()})
        episodes.append(Episode(cut, length, has_final, ids[e], metas[e]))
    if not apart:
        episodes.keep_arrays({name: array for name, (array, _) in columns.items()})
    return episodes, schema


def _read_stacked(data: Mapping, schema: Schema | None, keep_tensors: bool, observations: Any) -> tuple:
    """`read_episodes`' general read of E stacked episodes: each field read (`as_array`, or kept a tensor),
    checked once for all (their dtypes and shapes are the batch's), a ragged or text field's E values
    each: (flat fields, columns, ragged and text fields' values, E, schema, (T, has_final))."""
    read = step_tensor if keep_tensors else as_array
    flat = flatten(data)
    # Ragged and text fields given as E values, one per episode (`_per_episode`); the rest [E, T, ...].
    apart = {name: _per_episode(value, name) for name, value in flat.items() if _apart_value(value, name, schema)}
    if apart and keep_tensors:
        raise SchemaError(f"ragged or text fields {list(apart)}: a store with a storage_device does not take them "
                          "yet; leave storage_device=None")
    columns = {name: read(value, name) for name, value in flat.items() if name not in apart}
    count = _episode_count(columns, apart)
    first = {name: (array[0], dtype) for name, (array, dtype) in columns.items()} | \
        {name: values[0] for name, values in apart.items()}
    if schema is None:
        schema = Schema.infer(first, _observation_names(observations, {**columns, **apart}))
    checked = schema.check(first)   # dtypes and shapes are the batch's: one check checks all
    for name, values in apart.items():   # each episode's own value: checked each
        for e, value in enumerate(values[1:], 1):
            _check_episode(schema, name, value, e)
    return flat, columns, apart, count, schema, checked


def _read_list(data: Sequence[Any], schema: Schema | None, lengths: Any, env_ids: Any, metadata: Any,
               keep_tensors: bool, observations: Any) -> tuple[list[Episode], Schema]:
    """`read_episodes` of a list of E episodes of any lengths: each read and checked in turn
    against the schema (the first one's, inferred, when None)."""
    if lengths is not None:
        raise ValueError(f"lengths is for [E, T, ...] arrays; a list of episodes gives each its own length, "
                         f"got lengths={describe(lengths)}")
    count = len(data)
    ids, metas = _env_ids(env_ids, count), _metadata(metadata, count)
    if schema is None and observations is not None:   # the first episode's fields, named observations
        columns, _, _ = read_columns(data[0], keep_tensors)
        schema = Schema.infer(columns, _observation_names(observations, columns))
    episodes = []
    for e, episode in enumerate(data):
        try:
            read, schema = read_episode(episode, schema, ids[e], metas[e], keep_tensors)
        except SchemaError as err:
            raise SchemaError(f"episode {e} of the list: {err}") from None
        episodes.append(read)
    return episodes, schema


def _apart_value(value: Any, name: str, schema: Schema | None) -> bool:
    """Whether ``value`` holds one value per episode of a ragged or text field: a list or tuple
    for a field ``schema`` says is ragged or text, or (no schema yet) one that is read per
    episode only (lists of sequences of different lengths, lists of str)."""
    if not isinstance(value, (list, tuple)) or not value:
        return False
    spec = schema.fields.get(name) if schema is not None else None
    if spec is not None:
        return spec.ragged or spec.text
    if schema is not None:
        return False   # an unknown field: the check names it
    try:
        array, dtype = as_array(value, name)
    except (SchemaError, ValueError, TypeError, RuntimeError):   # (numpy's, torch's: a list of nested tensors)
        return True
    return dtype == "string" or not isinstance(array, np.ndarray) or array.ndim < 2


def _per_episode(value: list | tuple, name: str) -> list[tuple[Any, str]]:
    """Each episode's value of a ragged or text field, read (`as_array`): its rows and dtype name.

    Raises:
        SchemaError: naming the field and the episode whose value has no ragged or text form.
    """
    read = []
    for e, item in enumerate(value):
        try:
            read.append(as_array(item, name))
        except SchemaError as err:
            raise SchemaError(f"episode {e}: {err}") from None
    return read


def _check_episode(schema: Schema, name: str, value: tuple[Any, str], e: int) -> None:
    """Episode ``e``'s value of ragged or text field ``name`` checked against the schema.

    Raises:
        SchemaError: naming the field and the episode.
    """
    try:
        check_column(schema.fields[name], name, *value)
    except SchemaError as err:
        raise SchemaError(f"episode {e}: {err}") from None


def _episode_count(columns: Mapping[str, tuple[np.ndarray, str]], apart: Mapping[str, list]) -> int:
    counts = {name: array.shape[0] if array.ndim >= 2 else None for name, (array, _) in columns.items()} | \
        {name: len(values) for name, values in apart.items()}
    flat = [name for name, n in counts.items() if n is None]
    if flat:
        raise SchemaError(f"field {flat[0]!r} has shape {columns[flat[0]][0].shape}; add_episodes takes [E, T, ...] "
                          "arrays (E episodes of T steps)")
    if len(set(counts.values())) != 1 or not next(iter(counts.values())):
        raise SchemaError(f"fields hold different numbers of episodes (leading dims {counts}); expected one E >= 1")
    return next(iter(counts.values()))


def _lengths(lengths: Any, count: int, num_steps: int) -> np.ndarray:
    if lengths is None:
        return np.full(count, num_steps, np.int64)
    array = np.asarray(lengths.detach().cpu() if hasattr(lengths, "detach") else lengths)
    if array.shape != (count,) or not np.issubdtype(array.dtype, np.integer) or array.dtype == bool \
            or (array < 1).any() or (array > num_steps).any():
        raise ValueError(f"lengths must be None or {count} ints in [1, {num_steps}] (steps of each episode), "
                         f"got {describe(lengths)}")
    return array.astype(np.int64)


def _env_ids(env_ids: Any, count: int) -> list[str]:
    if env_ids is None:
        return ["default"] * count
    if isinstance(env_ids, str):
        return [check_env_id(env_ids)] * count
    if not isinstance(env_ids, Sequence) or len(env_ids) != count:
        raise ValueError(f"env_ids must be None, one env id, or {count} env ids (one per episode), "
                         f"got {describe(env_ids)}")
    return [check_env_id(env_id) for env_id in env_ids]


def _metadata(metadata: Any, count: int) -> list[dict | None]:
    if metadata is None:
        return [None] * count
    if isinstance(metadata, Mapping) or not isinstance(metadata, Sequence) or len(metadata) != count:
        raise ValueError(f"metadata must be None or {count} mappings (one per episode), got {describe(metadata)}")
    return [check_metadata(m) for m in metadata]


def _observation_names(observations: Any, columns: Mapping[str, Any]) -> list[str] | None:
    """``observations`` checked: None, or names of fields among ``columns`` (dotted).

    Raises:
        SchemaError: a str, or a name that is no field of the episodes.
    """
    if observations is None:
        return None
    if not isinstance(observations, (list, tuple)) or not all(isinstance(n, str) for n in observations):
        raise SchemaError(f"observations must be a list of field names, got {observations!r}")
    unknown = [n for n in observations if n not in columns]
    if unknown:
        raise SchemaError(f"observations names {unknown}, not fields of the episodes; their fields are {list(columns)}")
    return list(observations)
