"""Checks of a checkpoint's state against its domains, before a store is built from it.

A checkpoint's manifest and state file carry hashes that catch corruption; these
checks catch the rest: a state that is well-formed but impossible (an edited
manifest, a file from a buggy writer). Every loaded value that sampling or the next
write trusts is checked here: the store settings, the episode table against the
arena (rows inside it, episodes not overlapping, the write position right after
the newest episode), sampler, rate-limiter, generator and writer state.

Each check raises `FormatError` naming the file, the field, the value found and
what was expected.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from arrowbuf._checks import AUTORESET_MODES, is_int
from arrowbuf.errors import FormatError, describe
from arrowbuf.placement import arena_rows
from arrowbuf.shard import MODES


def check_state(state: Mapping[str, Any], where: str) -> None:
    """Check every part of a checkpoint's state (see the module docstring).

    Args:
        state: the state tree with its arrays joined in (`arrowbuf._persist.join_arrays`).
        where: the file named in errors (the manifest).

    Raises:
        FormatError: the first value outside its domain.
    """
    info = state["store"]
    # A Ray shard's capacity is its share of the store's (0 or more), its arena made for ``room``.
    capacity = _int(where, "store.capacity", info["capacity"], 0 if "room" in info else 1)
    room = _int(where, "store.room", info.get("room", capacity), max(capacity, 1))
    _choice(where, "store.mode", info["mode"], MODES)
    if info["seed"] is not None:
        _int(where, "store.seed", info["seed"], 0)
    _choice(where, "store.track_reuse", info["track_reuse"], (True, False))
    _number(where, "store.created_at", info["created_at"], 0.0)
    _generator(where, state["rng"])
    if state["shard"] is not None:
        _shard(where, state["shard"], capacity, info["mode"], room)
    _sampler(where, state["sampler"], state["shard"])
    _counter(where, "rate_limiter.inserts", state["rate_limiter"]["inserts"])
    _counter(where, "rate_limiter.samples", state["rate_limiter"]["samples"])
    for name, writer in state["writers"].items():
        _writer(where, f"writers.{name}", writer)


# -- one helper per check ---------------------------------------------------------------


def _bad(where: str, field: str, value: Any, expected: str) -> FormatError:
    return FormatError(f"{where}: {field} is {describe(value)}; expected {expected}")


def _int(where: str, field: str, value: Any, low: int, high: int | None = None) -> int:
    if not is_int(value, low) or (high is not None and value > high):
        raise _bad(where, field, value, f"an int in [{low}, {'inf' if high is None else high}]")
    return int(value)


def _counter(where: str, field: str, value: Any) -> int:
    return _int(where, field, value, 0)


def _number(where: str, field: str, value: Any, low: float, high: float = math.inf,
            low_open: bool = False) -> float:
    ok = (isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
          and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        raise _bad(where, field, value, f"a finite number in {'(' if low_open else '['}{low}, {high}]")
    return float(value)


def _choice(where: str, field: str, value: Any, choices: tuple) -> None:
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise _bad(where, field, value, f"one of {choices}")


def _array(where: str, field: str, value: Any, kind: str, length: int | None = None) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype.kind not in kind or value.ndim != 1 or (
            length is not None and len(value) != length):
        raise _bad(where, field, value, f"a 1-d array of kind {kind!r}" + (f" of length {length}" if length else ""))
    return value


# -- the parts ---------------------------------------------------------------------------


def _generator(where: str, state: Any) -> None:
    """The state must load into the store's bit generator (PCG64)."""
    if not isinstance(state, Mapping) or state.get("bit_generator") != "PCG64":
        raise _bad(where, "rng", state, "the state of a PCG64 bit generator")
    try:
        np.random.PCG64().state = dict(state)
    except (TypeError, ValueError, KeyError, OverflowError) as err:
        raise _bad(where, "rng", state, f"a loadable PCG64 state ({err})") from None


def _shard(where: str, shard: Mapping[str, Any], capacity: int, mode: str, room: int) -> None:
    """The episode table against the arena (made for ``room`` transitions): placement, order, ids,
    indices, write position."""
    if shard["capacity"] != capacity or shard["mode"] != mode:
        raise _bad(where, "shard.capacity/mode", (shard["capacity"], shard["mode"]), f"{(capacity, mode)}")
    rows_max = arena_rows(room)   # the arena's rows: capacity counts transitions (`arrowbuf.placement`)
    write_pos = _int(where, "shard.write_pos", shard["write_pos"], 0, rows_max)
    table = shard["table"]
    columns = table["columns"]
    ids = _array(where, "episode_id", columns["episode_id"], "i")
    n = len(ids)
    first = _array(where, "first_row", columns["first_row"], "i", n)
    rows = _array(where, "num_rows", columns["num_rows"], "i", n)
    length = _array(where, "length", columns["length"], "i", n)
    has_final = _array(where, "has_final", columns["has_final"], "b", n)
    indices = _array(where, "first_index", columns["first_index"], "i", n)
    env = _array(where, "env", columns["env"], "i", n)
    for name in ("terminated", "truncated"):
        _array(where, name, columns[name], "b", n)
    _array(where, "inserted_at", columns["inserted_at"], "i", n)
    _array(where, "return", columns["return"], "f", n)
    stride = _int(where, "shard.table.id_stride", table["id_stride"], 1)
    offset = _int(where, "shard.table.id_offset", table["id_offset"], 0)
    added = _int(where, "shard.table.episodes_added", table["episodes_added"], n)
    env_names = table["env_names"]
    if not isinstance(env_names, list) or not all(isinstance(e, str) for e in env_names):
        raise _bad(where, "shard.table.env_names", env_names, "a list of strings")
    counters = table["counters"]
    for name, value in counters.items():
        _counter(where, f"shard.table.counters.{name}", value)
        _array(where, f"first_{name}", columns.get(f"first_{name}"), "i", n)
    # A CUDA arena's rows (allocated at once, grown as needed: `arrowbuf.placement.Ring.grow_arena`)
    arena = shard.get("rows")
    if arena is not None:
        arena = _int(where, "shard.rows", arena, min(arena_rows(capacity, lazy=False), rows_max), rows_max)
    reuse = shard.get("reuse")
    if reuse is not None:   # one count a row of the arena (of `capacity` rows before capacity counted transitions)
        _array(where, "shard.reuse", reuse, "iu")
        if len(reuse) not in {capacity, rows_max, arena}:
            raise _bad(where, "shard.reuse", reuse, f"one count a row of the arena ({arena or rows_max} rows)")
    if not n:
        return
    if np.any(rows < 1) or np.any(first < 0) or np.any(first + rows > rows_max):
        k = int(np.flatnonzero((rows < 1) | (first < 0) | (first + rows > rows_max))[0])
        raise _bad(where, f"episode {int(ids[k])}'s rows", (int(first[k]), int(rows[k])),
                   f"(first_row, num_rows) inside the arena of {rows_max} rows")
    if np.any((length < rows - 1) | (length > rows - has_final)):
        raise _bad(where, "length", length, "transitions: num_rows - 1, or num_rows for an episode without "
                   "observations (and a final observation)")
    if not np.array_equal(ids, offset + stride * np.arange(added - n, added)):
        raise _bad(where, "episode_id", ids, f"the last {n} of {added} ids from {offset} in steps of {stride}")
    order = np.argsort(first, kind="stable")
    if np.any(first[order][1:] < (first + rows)[order][:-1]):
        raise _bad(where, "first_row", first, "episodes whose rows do not overlap")
    if shard.get("ordered", True) and write_pos != int(first[-1] + rows[-1]):
        raise _bad(where, "shard.write_pos", write_pos,
                   f"{int(first[-1] + rows[-1])}, the row after the newest episode (episode {int(ids[-1])})")
    if np.any(np.diff(indices) != length[:-1]) or counters.get("index") != int(indices[-1] + length[-1]):
        raise _bad(where, "first_index", indices, "consecutive indices, ending at the index counter")
    if np.any((env < 0) | (env >= len(env_names))):
        raise _bad(where, "env", env, f"codes into the {len(env_names)} env names")
    if "episode" in columns:   # the played episode of each piece: an id given no later than its own
        episode = _array(where, "episode", columns["episode"], "i", n)
        if np.any((episode > ids) | (episode < offset) | ((episode - offset) % stride != 0)):
            raise _bad(where, "episode", episode, f"ids from {offset} in steps of {stride}, each <= its own episode_id")
    if "tail" in columns and np.any(_array(where, "tail", columns["tail"], "i", n) < -1):
        raise _bad(where, "tail", columns["tail"], "open-tail uids >= 0, or -1")


def _sampler(where: str, state: Mapping[str, Any], shard: Mapping[str, Any] | None) -> None:
    """Prioritized: a finite max priority > 0 and a consistent tree; epochs: a cursor in range."""
    if "max_priority" in state:
        _number(where, "sampler.max_priority", state["max_priority"], 0.0, low_open=True)
        tree = state["tree"]
        if tree is not None:
            _tree(where, tree, shard)
    if "cursor" in state:
        order = _array(where, "sampler.order", state["order"], "i")
        _int(where, "sampler.cursor", state["cursor"], 0, len(order))
        _counter(where, "sampler.epoch", state["epoch"])


def _tree(where: str, tree: Mapping[str, Any], shard: Mapping[str, Any] | None) -> None:
    levels = tree["levels"]
    if not isinstance(levels, list) or not levels:
        raise _bad(where, "sampler.tree.levels", levels, "a list of arrays")
    for d, level in enumerate(levels):
        _array(where, f"sampler.tree.levels[{d}]", level, "f")
        if not np.all(np.isfinite(level)) or np.any(level < 0):
            raise _bad(where, f"sampler.tree.levels[{d}]", level, "finite priorities >= 0")
    for d in range(1, len(levels)):
        parent, child = levels[d - 1], levels[d]
        if len(child) != len(parent) * (len(child) // max(len(parent), 1)) or not np.allclose(
                parent, child.reshape(len(parent), -1).sum(1), rtol=1e-6, atol=1e-300):
            raise _bad(where, f"sampler.tree.levels[{d - 1}]", parent, "the sums of the level below")
    if shard is None:
        return
    size = _int(where, "sampler.tree.size", tree["size"], 0)
    leaves = levels[-1][:size]
    live = np.zeros(len(leaves), bool)
    columns = shard["table"]["columns"]
    for start, count in zip(columns["first_row"].tolist(), columns["length"].tolist()):
        live[start:start + count] = True
    if np.any(leaves[~live] != 0):
        raise _bad(where, "sampler.tree leaves", leaves, "0 on every row that is not a live transition")


def _writer(where: str, field: str, state: Mapping[str, Any]) -> None:
    num_envs = _int(where, f"{field}.num_envs", state["num_envs"], 1)
    _choice(where, f"{field}.autoreset_mode", state["autoreset_mode"], AUTORESET_MODES)
    if not isinstance(state.get("check_resets", False), bool):
        raise _bad(where, f"{field}.check_resets", state["check_resets"], "a bool")
    _counter(where, f"{field}.episodes_written", state["episodes_written"])
    pos = _array(where, f"{field}.pos", state["pos"], "i", num_envs)
    if np.any(pos < 0):
        raise _bad(where, f"{field}.pos", pos, "step counts >= 0")
    _array(where, f"{field}.skip", state["skip"], "b", num_envs)
    if "versions" in state and np.any(_array(where, f"{field}.versions", state["versions"], "i", num_envs) < 0):
        raise _bad(where, f"{field}.versions", state["versions"], "each env's last policy_version, ints >= 0")
    env_ids = state["env_ids"]
    if not isinstance(env_ids, list) or len(env_ids) != num_envs or not all(isinstance(e, str) for e in env_ids):
        raise _bad(where, f"{field}.env_ids", env_ids, f"a list of {num_envs} strings")
    grids = None
    for part, ndim in (("stage", 2), ("last_next", 1)):
        arrays = state[part]
        if part == "stage" and isinstance(arrays, dict):   # a ragged or text field's rows: its [envs, steps] grid
            arrays = grids = {name: _grid(a) for name, a in arrays.items()}
        if not isinstance(arrays, dict) or not all(isinstance(a, np.ndarray) and a.ndim >= ndim and len(a) == num_envs
                                                   for a in arrays.values()):
            raise _bad(where, f"{field}.{part}", arrays, f"arrays with a row per env ({num_envs})"
                       + (" and a column per staged step" if part == "stage" else ""))
    _open_steps(where, field, pos, grids, state["last_next"])
    if not isinstance(state["pending"], list):
        raise _bad(where, f"{field}.pending", state["pending"], "a list of episodes")


def _grid(staged: Any) -> Any:
    """A staged field's rows, or a ragged or text field's saved rows' grid of lengths or codes
    (`arrowbuf.row_stage.RowStage.saved`; the rest is checked where it is read back)."""
    if isinstance(staged, dict):
        return staged.get("lengths", staged.get("codes"))
    return staged


def _open_steps(where: str, field: str, pos: np.ndarray, stage: Mapping[str, np.ndarray],
                last_next: Mapping[str, np.ndarray]) -> None:
    """A writer's open steps are rows it staged: ``pos`` (steps per env) within every staged
    field's rows, and the observation after them kept (a step's next observation is read
    from it); else a load would make arena rows that were never written sampleable."""
    steps = int(pos.max(initial=0))
    if not steps:
        return
    staged = min((a.shape[1] for a in stage.values()), default=0)
    if steps > staged:
        raise _bad(where, f"{field}.pos", pos, f"step counts of at most the {staged} staged rows of each env "
                   f"({field}.stage)")
    if not last_next or not set(last_next) <= set(stage):
        raise _bad(where, f"{field}.last_next", last_next, f"the observation after the open steps, for observation "
                   f"fields of {field}.stage ({sorted(stage)})")
