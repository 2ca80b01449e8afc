"""TorchRL in and out: collector batches into episodes, samples into TorchRL's keys.

A TorchRL collector yields TensorDicts of batch size ``[T]`` or ``[num_envs, T]``:
``"observation"`` at t, the step's ``("next", "observation")``, ``("next",
"reward")``, ``("next", "done" / "terminated" / "truncated")``, the policy's
``"action"`` (and whatever else it wrote), and ``("collector", "traj_ids")``.
`episodes_of_collector_batch` cuts such a batch into arrowbuf episodes without a
Python loop over T: the steps are taken row-major, an episode ends after a step
whose done flag is set, where the trajectory id changes, at the end of an env's
row, and around steps ``("collector", "mask")`` marks as padding. The cuts are
vectorized (one ``flatnonzero`` over the batch); each episode's columns are one
fancy-indexed gather per field.

**Open trajectories.** An episode still running at the end of the batch is
stored at once, cut: its final observation is its last ``("next",
"observation")`` and its last step is neither terminated nor truncated (as
`arrowbuf.StepWriter.flush` cuts a rollout), so every frame the collector
yielded is a sampleable transition right after `extend`, as in TorchRL's own
buffer (``len(store)`` grows by the frames extended). Its continuation in the
next batch is stored as a further episode; both carry the trajectory id in
their episode metadata (``{"traj_id": ...}``). One-step targets are exact
across the cut (the transition keeps its true next observation and flags);
n-step returns and sequence windows stop at it, as TorchRL's ``MultiStep``
stops at a batch's end. Nothing is held back between calls.

Keys: those under both the root and ``"next"`` (the observation, and whatever
else the env carries from step to step: ``step_count``, ``episode_reward``, a
recurrent state) are stored once, as observation fields (T+1 rows: step t's
value at the root, its ``"next"`` value on row t+1, the episode's last one as its
final row), so a sample gives both back, ``("next", "step_count")`` included;
a store whose schema exists keeps its own observation fields (a key it stores as
a step field is stored from the root only). The other ``"next"`` keys
(``reward``, ``terminated``, ``truncated``, ...) are step fields of step t;
``("next", "done")`` is not stored (it is ``terminated | truncated``); the root
flags (``done`` / ``terminated`` / ``truncated`` at t, the previous step's) and
the ``"collector"`` entries are not stored.

`to_torchrl` turns a sampled batch into what TorchRL's losses read:
``"observation"`` (renamed from arrowbuf's ``"obs"`` when the store has no
``"observation"`` field), ``("next", "observation")``, ``("next", "reward")``,
``("next", "done" / "terminated" / "truncated")`` with TorchRL's trailing
dimension of 1, ``"priority_weight"`` (the prioritized sampler's weights,
where TorchRL's losses look for them), and, for n-step samples,
``"steps_to_next_obs"`` (the steps summed, as TorchRL's ``MultiStep`` writes them:
its value estimators discount the bootstrap by gamma to that power).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from arrowbuf._lazy_torch import is_tensordict
from arrowbuf.errors import SchemaError, describe
from arrowbuf.schema import FLAG_NAMES, Schema

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict, TensorDictBase

LAYOUTS = ("arrowbuf", "torchrl")
# Root keys a collector writes that are not step data: the flags at t repeat the
# previous step's ("next", ...) flags; "collector" holds ids and masks.
_ROOT_SKIPPED = frozenset({"done", "terminated", "truncated", "collector"})
# Step fields TorchRL keeps under "next".
_NEXT_STEP_FIELDS = ("reward", "terminated", "truncated")
# An extend pads its episodes to the longest of a group: one group while that
# costs at most this many times the rows stored, else groups by length.
_PAD_FACTOR = 2


def episodes_of_collector_batch(td: Any, schema: Schema | None
                                ) -> tuple[list[tuple[dict, np.ndarray, list, list]], list[str]]:
    """The episodes of a TorchRL collector batch, as `ExperienceStore.add_episodes` arguments.

    Args:
        td: a TensorDict of batch size [T] or [num_envs, T] with a ``"next"`` entry.
        schema: the store's schema (its observation fields), or None before the first write.

    Returns:
        Groups of episodes, each (columns [E, L(+1), ...], lengths, env_ids, metadata),
        whose episodes are in the batch's order (env by env, oldest first) within a group;
        and the observation fields' names (dotted), for a store that infers its schema.

    Raises:
        ValueError: ``td`` is not such a TensorDict.
        SchemaError: no done / terminated flags under ``"next"``, or no step data.
    """
    import torch
    if not is_tensordict(td) or td.batch_dims not in (1, 2) or "next" not in td.keys():
        raise ValueError(f"extend takes what a TorchRL collector yields: a TensorDict of batch size [T] or "
                         f"[num_envs, T] with a 'next' entry (('next', 'observation'), ('next', 'reward'), "
                         f"('next', 'done'), ...), got {_describe_td(td)}; whole episodes as arrays go to "
                         "add_episodes, steps to writer()")
    from tensordict import is_non_tensor

    kept_apart = [k for k in td.keys(include_nested=True) if is_non_tensor(td.get(k))]
    if kept_apart:   # (a leaves-only walk skips them: they were dropped without a word)
        raise SchemaError(f"extend: keys {sorted(map(str, kept_apart))} hold non-tensor data (strings, objects), "
                          "which extend does not store yet; add such episodes with add_episode (a str per step "
                          "is a text field: ab.Field('string')), or exclude the keys from the batch")
    if td.numel() == 0:
        return [], []
    rows, steps = (1, td.batch_size[0]) if td.batch_dims == 1 else tuple(td.batch_size)
    flat = td.reshape(-1)
    nxt = flat.get("next")
    root_keys = {k for k in flat.keys(include_nested=True, leaves_only=True) if _root_key(k)}
    next_keys = set(nxt.keys(include_nested=True, leaves_only=True))
    observations = _observation_keys(root_keys, next_keys, schema)
    terminated, truncated = _flags(nxt)
    done = terminated | truncated
    if "done" in next_keys:
        done = done | _flag(nxt.get("done"), "done")

    # Steps kept, row-major; cuts after a done step, an env's row end, a change of
    # trajectory, or a gap (padding masked out by the collector).
    keep = torch.arange(rows * steps)
    if ("collector", "mask") in flat.keys(include_nested=True):
        keep = keep[flat.get(("collector", "mask")).reshape(-1).bool().cpu()]
    if len(keep) == 0:
        return [], []
    traj = flat.get(("collector", "traj_ids"), None)
    traj = traj.reshape(-1).cpu()[keep] if traj is not None else None
    cut = done.cpu()[keep].clone()
    cut[:-1] |= (keep[1:] != keep[:-1] + 1) | (keep[1:] // steps != keep[:-1] // steps)
    if traj is not None:
        cut[:-1] |= traj[1:] != traj[:-1]
    cut[-1] = True
    ends = torch.nonzero(cut).reshape(-1)
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    lengths = ends - starts + 1
    env_ids = [f"env-{int(r)}" for r in (keep[starts] // steps).tolist()]
    metadata = [{"traj_id": int(t)} for t in traj[starts].tolist()] if traj is not None else [None] * len(starts)

    columns = {}   # key -> (source [M, ...] tensor, is observation)
    for key in sorted(root_keys, key=str):
        columns[key] = (flat.get(key), key in observations)
    for key in sorted(next_keys - set(observations) - {"done"} - root_keys, key=str):
        columns[key] = (nxt.get(key), False)
    for name, flags in (("terminated", terminated), ("truncated", truncated)):
        source = nxt.get(name) if name in next_keys else None
        columns[name] = (flags.reshape(-1, 1) if source is None else source, False)
    next_obs = {key: nxt.get(key) for key in observations}
    return [_group(columns, next_obs, keep, starts[g], lengths[g],
                   [env_ids[i] for i in g.tolist()], [metadata[i] for i in g.tolist()])
            for g in _groups(lengths)], [_dotted(key) for key in observations]


def to_torchrl(batch: TensorDict, schema: Schema | None) -> TensorDict:
    """A sampled batch in TorchRL's layout (in place; see the module docstring).

    Step flags and rewards move under ``"next"`` with a trailing dimension of 1,
    ``("next", "done")`` is added as ``terminated | truncated``, arrowbuf's
    ``"obs"`` becomes ``"observation"``, the sampler's ``"weight"`` is also given
    as ``"priority_weight"``.
    """
    import torch
    names = set(schema.fields) if schema is not None else set()
    keys = set(batch.keys())
    if "obs" in keys and "observation" not in names:
        batch.rename_key_("obs", "observation")
        if ("next", "obs") in batch.keys(include_nested=True):
            batch.rename_key_(("next", "obs"), ("next", "observation"))
    flags = []
    for name in _NEXT_STEP_FIELDS:
        if name not in keys:
            continue
        value = batch.pop(name)
        if value.ndim == batch.batch_dims:
            value = value.unsqueeze(-1)
        batch.set(("next", name), value)
        if name in FLAG_NAMES:
            flags.append(value.bool() if value.dtype != torch.bool else value)
    if flags:
        done = flags[0] | flags[1] if len(flags) == 2 else flags[0].clone()
        batch.set(("next", "done"), done)
    if "n_steps" in keys:   # n-step targets: TorchRL's value estimators discount by gamma ** steps_to_next_obs
        batch.set("steps_to_next_obs", batch.get("n_steps").unsqueeze(-1))
    if "weight" in keys:
        batch.set("priority_weight", batch.get("weight"))
    return batch


def check_layout(layout: Any) -> str:
    """``layout`` checked against `LAYOUTS`.

    Raises:
        ValueError: naming the value and the choices.
    """
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} ('torchrl': the keys TorchRL's losses read), "
                         f"got {layout!r}")
    return layout


def priorities_of(td: Any) -> tuple[Any, Any]:
    """(index, priority) of a batch a TorchRL loss wrote its ``"td_error"`` into.

    Raises:
        ValueError: ``td`` is not a TensorDict holding ``"index"`` and ``"td_error"``.
    """
    if not is_tensordict(td) or "index" not in td.keys() or "td_error" not in td.keys():
        raise ValueError(f"update_tensordict_priority takes a sampled batch holding 'index' and a loss's "
                         f"'td_error', got {_describe_td(td)}; or call update_priorities(index, priority)")
    index = td.get("index")
    priority = td.get("td_error").detach()
    if priority.ndim > index.ndim:   # TorchRL's losses write [B, 1]
        priority = priority.reshape(*index.shape, -1).amax(-1)
    return index, priority


def as_layout(batch: TensorDict | list[TensorDict], schema: Schema | None,
              layout: str) -> TensorDict | list[TensorDict]:
    """A sample (a batch, or a ``num_workers`` sample's list) in ``layout`` (`to_torchrl`)."""
    if layout == "arrowbuf":
        return batch
    return [to_torchrl(b, schema) for b in batch] if isinstance(batch, list) else to_torchrl(batch, schema)


def each_as_layout(batches: Iterator[TensorDict], store: Any, layout: str) -> Iterator[TensorDict]:
    """The batches of an iterator (``iter_batches``; a batch may be a list of ranks' shares) in ``layout``."""
    if layout == "arrowbuf":
        return batches
    return (as_layout(batch, store.schema, layout) for batch in batches)


# -- ExperienceStore's methods with TorchRL's names (assigned in its class body) ----------


def extend(store: Any, td: Any, *, timeout: float | None = None) -> list[int]:
    """Store what a TorchRL collector yields: a TensorDict [T] or [num_envs, T] with
    ``("next", ...)`` keys, cut into episodes at its done flags and trajectory ids
    (vectorized, `episodes_of_collector_batch`). A trajectory still running at the
    batch's end is stored at once, cut; its continuation in the next batch is a further
    episode with the same ``traj_id`` in its metadata (see the module docstring).

    Returns:
        The new episode ids (transition indices come with samples, as ``"index"``).

    Raises:
        ValueError: ``td`` is not a collector batch.
        SchemaError, CapacityError, RateLimited: as `ExperienceStore.add_episodes`.
    """
    ids: list[int] = []
    groups, observations = episodes_of_collector_batch(td, store.schema)
    for columns, lengths, env_ids, metadata in groups:
        ids += store.add_episodes(columns, lengths=lengths, env_ids=env_ids, metadata=metadata, timeout=timeout,
                                  observations=observations)
    return ids


def add(store: Any, td: Any) -> None:
    """Refused (TypeError), naming `extend` and `ExperienceStore.writer`.

    TorchRL's ``rb.add(td)`` stores one transition in one slot. Here a transition
    stored alone would be an episode of one step, holding its next observation in
    a row of its own: a store filled that way would keep half its capacity in
    transitions, and n-step returns would stop at every step. Batches of steps
    (`extend`) and step writers keep an episode's steps together.
    """
    raise _refused("add(td) of one transition", "extend it with the collector batch the transition belongs to "
                   "(store.extend(td) takes [T] or [num_envs, T]), or write steps one at a time with "
                   "w = store.writer(num_envs); w.add(obs=..., action=..., reward=..., terminated=..., "
                   "truncated=..., next_obs=...), which keeps an episode's steps together")


def no_batch_size() -> TypeError:
    """The error of ``store.sample()`` without a batch size, naming ``sample(batch_size, ...)``."""
    return _refused("default batch size (sample() with no size)", "give it per call: store.sample(batch_size, "
                    "layout='torchrl') for TorchRL's keys, or store.sample_iter(batch_size) for endless batches")


def update_priority(store: Any, index: Any, priority: Any) -> int | None:
    """TorchRL's name for `ExperienceStore.update_priorities` (same arguments)."""
    return store.update_priorities(index, priority)


def update_tensordict_priority(store: Any, td: Any) -> int | None:
    """Set priorities from a sampled batch a TorchRL loss wrote ``"td_error"`` into
    (``[B]`` or TorchRL's ``[B, 1]``); how many indices were still live.

    Raises:
        ValueError: no ``"index"`` or ``"td_error"`` in ``td``; not a prioritized store.
    """
    return store.update_priorities(*priorities_of(td))


def getitem(store: Any, index: Any) -> Any:
    """``store[index]``: the transitions of ``index`` (a batch's ``"index"``, or one int), as
    `ExperienceStore.gather` reads them. Indices, not positions: slices are refused.

    Raises:
        TypeError: a slice, a str, a tuple, None or Ellipsis.
        KeyError: indices that are not live.
    """
    if isinstance(index, (slice, str, tuple)) or index is None or index is Ellipsis:
        raise TypeError(f"ExperienceStore has no positional indexing (store[{index!r}]) as TorchRL's ReplayBuffer "
                        "does: store[index] reads transition indices (a batch's 'index'; live_ranges() gives "
                        "their ranges), as store.gather(index) does")
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return store.gather(np.array([index], np.int64))[0]
    return store.gather(index)


def iterate(store: Any) -> Iterator[TensorDict]:
    """Refused (TypeError), naming ``iter_batches`` (epochs) and ``sample_iter`` (endless)."""
    raise _refused("iteration", "iterate store.iter_batches(batch_size, epochs=...) for every transition once "
                   "per epoch, or store.sample_iter(batch_size) for endless samples")


def state_dict(store: Any) -> Any:
    """Refused (TypeError): a store's state is its rows; it names ``save`` and ``load``."""
    raise _refused("state_dict()", "checkpoint it into a directory with store.save(path) (or store.dumps(path)) "
                   "and restore it with ExperienceStore.load(path)")


def load_state_dict(store: Any, state: Any) -> None:
    """Refused (TypeError), naming ``ExperienceStore.load``."""
    raise _refused("load_state_dict()", "restore a checkpoint with store = ExperienceStore.load(path) (saved by "
                   "store.save(path) or store.dumps(path))")


def dumps(store: Any, path: Any) -> Any:
    """TorchRL's name for `ExperienceStore.save`: checkpoint the store into directory ``path``."""
    return store.save(path)


def loads(store: Any, path: Any) -> None:
    """Refused (TypeError): a checkpoint loads as a new store, ``ExperienceStore.load(path)``."""
    raise _refused("loads() in place",
                   f"a checkpoint loads as a new store: store = ExperienceStore.load({str(path)!r})")


def _refused(verb: str, instead: str) -> TypeError:
    return TypeError(f"ExperienceStore has no {verb} as TorchRL's ReplayBuffer does; {instead}")


# -- internals ---------------------------------------------------------------------------


def _root_key(key: Any) -> bool:
    head = key[0] if isinstance(key, tuple) else key
    return head != "next" and head not in _ROOT_SKIPPED


def _observation_keys(root_keys: set, next_keys: set, schema: Schema | None) -> list:
    """Keys stored once as observation fields: under both the root and "next" (TorchRL
    moves each "next" value to the root of the following step), or, once the store has
    a schema, those of them it stores as observation fields."""
    declared = set(schema.observation_names) if schema is not None else None
    return [key for key in sorted(root_keys & next_keys, key=str) if declared is None or _dotted(key) in declared]


def _dotted(key: Any) -> str:
    return ".".join(key) if isinstance(key, tuple) else key


def _flag(value: torch.Tensor, name: str) -> torch.Tensor:
    """One flag per step, [M], from TorchRL's [M, 1]."""
    if value.ndim > 2 or (value.ndim == 2 and value.shape[1] != 1):
        raise SchemaError(f"('next', {name!r}) must hold one flag per step ([T, 1] or [T]), got shape "
                          f"{tuple(value.shape)}")
    return value.reshape(-1).bool()


def _flags(nxt: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
    """(terminated, truncated) per step; an env with only ``done`` is terminated by it."""
    import torch
    keys = set(nxt.keys())
    if "terminated" not in keys and "done" not in keys:
        raise SchemaError(f"a collector batch needs ('next', 'terminated') or ('next', 'done'); its 'next' holds "
                          f"{sorted(map(str, keys))}")
    terminated = _flag(nxt.get("terminated" if "terminated" in keys else "done"), "terminated")
    truncated = _flag(nxt.get("truncated"), "truncated") if "truncated" in keys else torch.zeros_like(terminated)
    return terminated, truncated


def _groups(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Episodes padded together: all of them while padding costs at most `_PAD_FACTOR`
    times the rows, else groups of lengths within a factor of 2 (each in batch order)."""
    import torch
    everyone = torch.arange(len(lengths))
    if int(lengths.max()) * len(lengths) <= _PAD_FACTOR * int(lengths.sum()):
        return [everyone]
    octave = torch.floor(torch.log2(lengths.double())).long()
    return [everyone[octave == o] for o in torch.unique(octave).tolist()]


def _group(columns: dict, next_obs: dict, keep: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
           env_ids: list, metadata: list) -> tuple[dict, np.ndarray, list, list]:
    """Episodes padded to the longest of them: [E, L, ...] steps, [E, L + 1, ...] observations."""
    import torch
    longest = int(lengths.max())
    offsets = torch.arange(longest)
    rows = keep[starts[:, None] + torch.minimum(offsets[None, :], (lengths - 1)[:, None])]   # [E, L]
    last = rows[torch.arange(len(starts)), lengths - 1]                                     # [E]
    out: dict = {}
    for key, (source, observation) in columns.items():
        values = source[rows.to(source.device)]
        if observation:
            final = next_obs[key][last.to(source.device)]
            values = torch.cat([values, final[:, None]], dim=1)
            values[torch.arange(len(starts)), lengths] = final   # row L_e: the final observation
        _nest(out, key, values)
    return out, lengths.numpy(), env_ids, metadata


def _nest(out: dict, key: Any, value: Any) -> None:
    *parents, leaf = key if isinstance(key, tuple) else (key,)
    for part in parents:
        out = out.setdefault(part, {})
    out[leaf] = value


def _describe_td(td: Any) -> str:
    if is_tensordict(td):
        return f"a TensorDict of batch size {list(td.batch_size)} with keys {sorted(map(str, td.keys()))}"
    if isinstance(td, Mapping):
        return f"a {type(td).__name__} with keys {sorted(map(str, td))}"
    return describe(td)
