"""Generalized advantage estimation over ragged segments, without a per-step Python loop.

One implementation for the store (`ExperienceStore.compute_gae`, through `gae`)
and for trainers and the RLightning layer (`gae_steps`, per-step arrays as the
seed passes them). Segments (episodes, or the collected part of one) are laid
end to end in flat per-step arrays. The backward recursion
``A_t = delta_t + gamma * lam * A_{t+1}`` runs once per step index, over every
segment that has that step at once (`discounted_segments`): the Python loop has
as many iterations as the longest segment, not as there are steps (4,096
episodes of 24 steps: 24 iterations of vector work), and nothing is padded.

Example:
    >>> import numpy as np
    >>> adv, target = gae(np.ones(3), np.zeros(3), np.array([0.0]), np.array([3]), gamma=1.0, lam=1.0)
    >>> adv.tolist(), target.tolist()
    ([3.0, 2.0, 1.0], [3.0, 2.0, 1.0])

On a store (``compute_gae`` writes the ``"advantage"`` and ``"value_target"`` columns):
    >>> import arrowbuf as ab
    >>> store = ab.ExperienceStore(100)
    >>> _ = store.add_episode({"obs": np.zeros((3, 2), np.float32), "reward": np.ones(2, np.float32),
    ...                        "value": np.zeros(2, np.float32), "terminated": np.array([False, True]),
    ...                        "truncated": np.zeros(2, bool)})
    >>> store.compute_gae(gamma=1.0, lam=1.0)
    2
    >>> store.episode(0).column("advantage").to_pylist()
    [2.0, 1.0, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from arrowbuf._checks import bf16_bits_to_float32, real_numbers
from arrowbuf._lazy_torch import is_tensor
from arrowbuf.errors import describe
from arrowbuf.fields import Field
from arrowbuf.indexing import piece_chains
from arrowbuf.shard import Shard
from arrowbuf.tensors import make_tensordict

if TYPE_CHECKING:
    from tensordict import TensorDict

# Columns `write_advantages` adds (TorchRL's names).
DERIVED = ("advantage", "value_target")
# `write_advantages` reads and writes the rows from the first live transition to the last
# as slices when they are at most this many times the transitions (else by row lists).
SPAN_FACTOR = 2


def discounted_segments(delta: np.ndarray, lengths: np.ndarray, decay: float,
                        starts: np.ndarray | None = None) -> np.ndarray:
    """``A_t = delta_t + decay * A_{t+1}`` within each segment (0 past its last step).

    Args:
        delta: per-step terms.
        lengths: [S] steps of each segment (>= 0).
        decay: the factor (gamma * lambda for GAE).
        starts: [S] position of each segment's first step in ``delta`` (segments
            must not overlap); None: laid end to end, ``lengths`` summing to
            ``len(delta)``. Positions outside every segment are 0 in the result.
    """
    return _discounted(delta, lengths, decay, starts)[0]


def _discounted(delta: np.ndarray, lengths: np.ndarray, decay: float, starts: np.ndarray | None,
                plus: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """`discounted_segments`, and with ``plus`` (an array like ``delta``) also ``A + plus``
    within the segments (0 outside; GAE's value targets)."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.cumsum(lengths) - lengths if starts is None else np.asarray(starts, np.int64)
    result = np.zeros(len(delta), np.float64)
    shifted = np.zeros(len(delta), np.float64) if plus is not None else None
    if not len(lengths):
        return result, shifted
    spacing = _spacing(starts) if len(starts) > 1 else int(lengths[0])
    if lengths[0] > 0 and spacing is not None and spacing >= lengths[0] and (lengths == lengths[0]).all():
        # Equal segments evenly spaced (a rollout of E envs x T steps, in a flat array or
        # in the arena's rows): [segments, steps] strided views, one vector step per step
        # index, without the ragged case's gathers and scatters (WBC's 4,096 x 24: 0.5 ->
        # ~0.1 ms). The views end at the last segment's last step, inside every array.
        def grid(array: np.ndarray, writeable: bool = False) -> np.ndarray:
            return np.lib.stride_tricks.as_strided(np.ascontiguousarray(array, np.float64)[starts[0]:],
                                                   (len(lengths), int(lengths[0])), (spacing * 8, 8),
                                                   writeable=writeable)
        steps, out, carry = grid(delta), grid(result, True), np.zeros(len(lengths))
        for s in range(steps.shape[1] - 1, -1, -1):
            carry *= decay
            carry += steps[:, s]
            out[:, s] = carry
        if plus is not None:
            np.add(out, grid(plus), out=grid(shifted, True))
        return result, shifted
    # Longest segments first: at step index s, the segments that have it are a prefix.
    order = np.argsort(-lengths, kind="stable")
    sorted_starts, sorted_lengths = starts[order], lengths[order]
    carry = np.zeros(len(lengths))
    for s in range(int(sorted_lengths[0]) - 1, -1, -1):
        k = int(np.searchsorted(-sorted_lengths, -s, side="left"))   # segments longer than s
        rows = sorted_starts[:k] + s
        carry[:k] = delta[rows] + decay * carry[:k]
        result[rows] = carry[:k]
        if plus is not None:
            shifted[rows] = carry[:k] + plus[rows]
    return result, shifted


def gae(reward: np.ndarray, value: np.ndarray, last_value: np.ndarray, lengths: np.ndarray,
        gamma: float, lam: float, starts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and value targets (``advantage + value``) of episodes in flat per-step arrays.

    Args:
        reward: per-step rewards.
        value: value estimates of the states the steps act on.
        last_value: [E] the value after each episode's last step: 0 where the
            episode terminated, the value of its final observation where it was
            cut (truncated, or the end of a rollout).
        lengths: [E] steps of each episode (>= 0).
        gamma: discount.
        lam: GAE's lambda.
        starts: [E] position of each episode's first step in the arrays (as rows
            lie in an arena: final observations and free rows between them); None:
            laid end to end (N = ``lengths.sum()`` steps).

    Returns:
        (advantage, value_target), float64 like ``reward``; 0 at positions outside
        every episode.
    """
    lengths = np.asarray(lengths, np.int64)
    starts = np.cumsum(lengths) - lengths if starts is None else np.asarray(starts, np.int64)
    # Rows between episodes (free rows, a cleared store's old rows) may hold anything, a signalling
    # NaN or inf included: their casts and sums must not warn (they are never read back).
    with np.errstate(all="ignore"):
        reward = np.asarray(reward, np.float64)
        value = np.asarray(value, np.float64)
        next_value = np.empty_like(value)
        next_value[:-1] = value[1:]
        next_value[-1:] = 0.0
        has_steps = lengths > 0
        next_value[(starts + lengths - 1)[has_steps]] = np.asarray(last_value, np.float64)[has_steps]
        delta = reward + gamma * next_value - value
        return _discounted(delta, lengths, gamma * lam, starts, plus=value)


def gae_steps(rewards: Any, values: Any, next_values: Any, terminated: Any, ends: Any, gamma: float = 0.99,
              lam: float = 0.95) -> tuple[Any, Any]:
    """Advantages and value targets of flat per-step arrays (the form trainers hold).

    For step t with ``terminated`` d_t and next value v'_t (the value of the next
    observation; for a truncated episode's last step, the value of its final
    observation, so truncations bootstrap)::

        delta_t  = r_t + gamma * v'_t * (1 - d_t) - v_t
        A_t      = delta_t + gamma * lam * (1 - d_t) * (1 - end_t) * A_{t+1}
        target_t = A_t + v_t

    Args:
        rewards, values, next_values: float arrays (numpy or torch) of N steps.
        terminated: bools: the episode ended in a terminal state (no bootstrap).
        ends: bools: the last step of each segment (terminated, truncated, or the
            end of the collected steps); ``ends[-1]`` must be True.
        gamma, lam: discount and GAE lambda, in [0, 1].

    Returns:
        ``(advantages, value_targets)``: torch tensors of ``rewards``' dtype and
        device if ``rewards`` is a tensor, else float64 numpy arrays.

    Raises:
        ValueError: arrays of other shapes or lengths, ``ends[-1]`` False, or
            gamma / lam outside [0, 1].

    Example:
        >>> adv, target = gae_steps(np.ones(3), np.zeros(3), np.zeros(3), np.array([False, False, True]),
        ...                         np.array([False, False, True]), gamma=1.0, lam=1.0)
        >>> adv.tolist()
        [3.0, 2.0, 1.0]
    """
    for name, number in (("gamma", gamma), ("lam", lam)):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= 1:
            raise ValueError(f"{name} must be a number in [0, 1], got {number!r}")
    r = _steps(rewards, "rewards", None)
    n = len(r)
    v = _steps(values, "values", n)
    nv = _steps(next_values, "next_values", n)
    done = _steps(terminated, "terminated", n).astype(bool)
    end = _steps(ends, "ends", n).astype(bool)
    if n and not end[-1]:
        raise ValueError("ends: the last step must end a segment (ends[-1] is False)")
    # A terminal step stops the recursion as the end of a segment does.
    bounds = np.flatnonzero(end | done) + 1
    lengths = np.diff(bounds, prepend=0)
    advantage = discounted_segments(r + gamma * nv * ~done - v, lengths, gamma * lam)
    target = advantage + v
    if is_tensor(rewards):
        import torch

        return (torch.from_numpy(advantage).to(rewards.device, rewards.dtype),
                torch.from_numpy(target).to(rewards.device, rewards.dtype))
    return advantage, target


def _steps(array: Any, name: str, n: int | None) -> np.ndarray:
    """A 1-D float64 (or bool) numpy copy of per-step values, checked against ``n`` steps."""
    array = array.detach().cpu().double().numpy() if is_tensor(array) else np.asarray(array)
    if array.ndim != 1 or (n is not None and len(array) != n):
        raise ValueError(f"{name} must be a 1-D array of {n if n is not None else 'N'} steps, got shape {array.shape}")
    return array if array.dtype == bool else array.astype(np.float64)


def check_gae_fields(shard: Shard, value_key: str) -> None:
    """Raises ValueError unless ``reward`` and ``value_key`` are scalar step fields of ``shard``."""
    for name in ("reward", value_key):
        spec = shard.schema.fields.get(name)
        if spec is None or spec.observation or spec.shape not in ((), (1,)):
            raise ValueError(f"compute_gae needs a scalar step field {name!r}; the schema is {shard.schema}")


def cut_episodes(shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    """(keys, arena rows of the final observations) of the live episodes cut after a final
    observation (truncated, or cut by a writer's flush): those that bootstrap from it. A key
    is the id of the episode's last held piece (of an open tail: -2 - its position there)."""
    table = shard.table
    if table.pieces:
        segments = Segments.of(table)
        cut = segments.last[segments.cut]
        return segments.key(table, cut), table.ecol("first_row")[cut] + table.ecol("length")[cut]
    cut = _cut(table)
    return table.col("episode_id")[cut].astype(np.int64), table.col("first_row")[cut] + table.col("length")[cut]


@dataclass(frozen=True)
class Segments:
    """The live transitions of a table whose episodes may be cut into pieces, as GAE runs
    over them: one segment per played episode's held chain of pieces (`arrowbuf.indexing.PieceChains`),
    its transition rows in step order, the open tails' included (an episode that goes on
    bootstraps at its last written step, as one cut by a flush)."""

    rows: np.ndarray       # transition rows, segment after segment
    lengths: np.ndarray    # transitions of each segment
    last: np.ndarray       # each segment's last entry (`EpisodeTable.ecol` position)
    cut: np.ndarray        # whether it ends cut after a final observation (it bootstraps from its value)
    sealed: np.ndarray     # per row: a sealed entry's (written; an open tail's are not)

    @classmethod
    def of(cls, table: Any) -> "Segments":
        chains = piece_chains(table)
        n = len(chains.first_row)
        head = np.flatnonzero(chains.prev < 0)
        chain, rank = np.full(n, -1, np.int64), np.zeros(n, np.int64)
        cur, ids, r = head, np.arange(len(head)), 0
        while len(cur):   # one round per piece of the longest chain
            chain[cur], rank[cur] = ids, r
            ahead = chains.next[cur]
            cur, ids, r = ahead[ahead >= 0], ids[ahead >= 0], r + 1
        order = np.lexsort((rank, chain))
        length = chains.length[order].astype(np.int64)
        ends = np.cumsum(length)
        rows = np.repeat(chains.first_row[order] - (ends - length), length) + np.arange(int(ends[-1]) if n else 0)
        lengths = np.bincount(chain, weights=chains.length, minlength=len(head)).astype(np.int64)
        last = np.zeros(len(head), np.int64)
        np.maximum.at(last, chain, np.arange(n))   # a chain's pieces were added in step order
        is_open = last >= len(table)
        cut = is_open | (table.ecol("has_final")[last].astype(bool) & ~table.ecol("terminated")[last].astype(bool))
        sealed = np.repeat(order < len(table), length)
        return cls(rows, lengths, last, cut & (lengths > 0), sealed)

    def key(self, table: Any, entries: np.ndarray) -> np.ndarray:
        """`cut_episodes`' keys of ``entries``."""
        return np.where(entries < len(table), table.ecol("episode_id")[entries], -2 - entries).astype(np.int64)


def _cut(table: Any) -> np.ndarray:
    """Positions in the episode table of the episodes cut after a final observation."""
    length = table.col("length")
    return np.flatnonzero(table.col("has_final").astype(bool) & ~table.col("terminated").astype(bool) & (length > 0))


def final_observations(shard: Shard, rows: np.ndarray, views: bool = False) -> TensorDict:
    """The observation fields at arena ``rows`` as a TensorDict [len(rows)] (`observation_arrays`,
    `as_observations`)."""
    return as_observations(observation_arrays(shard, rows, views), shard.schema, len(rows))


def observation_arrays(shard: Shard, rows: np.ndarray, views: bool = False) -> dict[str, np.ndarray]:
    """The observation fields at arena ``rows``, by field name: numpy copies (what a Ray shard
    sends, without importing torch), or with ``views`` (for a callable run here and now, never
    to pickle: a view pickles its whole column) strided views of a numpy arena where ``rows``
    are evenly spaced, as a rollout's episodes of equal length lie (WBC's 4,096 final
    observations: a 7.3 MB gather, half of `write_advantages`' time, saved)."""
    step = _spacing(rows) if views else None
    arrays = {}
    for name in shard.schema.observation_names:
        column = shard.reader(name)
        if step is not None and type(column) is np.ndarray:
            arrays[name] = column[rows[0]:rows[-1] + 1:step]
        else:
            arrays[name] = column[rows]
    return arrays


def as_observations(arrays: Mapping[str, np.ndarray], schema: Any, count: int) -> TensorDict:
    """`observation_arrays`' ``arrays`` (``count`` rows each) as a TensorDict [count] of tensors
    viewing them (bfloat16 from its bits; copies of read-only ones, a Ray shard's as they
    arrive: they go to the user's value function, which may write them), keyed as ``schema``
    nests them."""
    import torch

    observations = {}
    for name, array in arrays.items():
        spec = schema.fields[name]
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        observations[tuple(name.split("."))] = tensor.view(spec.torch_dtype) if spec.dtype == "bfloat16" else tensor
    return make_tensordict(observations, (count,))


def _spacing(rows: np.ndarray) -> int | None:
    """The step of ``rows`` when they are an increasing arithmetic progression, else None."""
    if not len(rows):
        return None
    step = int(rows[1] - rows[0]) if len(rows) > 1 else 1
    if step < 1 or not np.array_equal(rows, rows[0] + step * np.arange(len(rows))):
        return None
    return step


def bootstrap_values(bootstrap_value: Callable[[TensorDict], Any] | None, observations: TensorDict) -> np.ndarray:
    """``bootstrap_value(observations)`` checked: one finite value per observation (float64).

    Raises:
        ValueError: no callable, or a result that is not one finite value per observation.
    """
    count = observations.batch_size[0]
    if bootstrap_value is None:
        raise ValueError(f"{count} episode(s) were cut after a final observation (truncated, or cut by "
                         "flush at the end of a rollout) and bootstrap from its value: pass "
                         "bootstrap_value=fn, fn(final_obs: TensorDict[n]) -> values [n]")
    result = bootstrap_value(observations)
    values = real_numbers(result, "bootstrap_value's result")
    real = np.issubdtype(values.dtype, np.integer) or np.issubdtype(values.dtype, np.floating)   # not str, complex
    values = values.astype(np.float64) if real else values
    if not real or values.size != count or not np.isfinite(values).all():
        raise ValueError(f"bootstrap_value returned {describe(result)}; expected {count} finite values, "
                         "one per final observation")
    return values.reshape(count)


def write_advantages(shard: Shard, gamma: float, lam: float, value_key: str,
                     bootstrap_value: Callable[[TensorDict], Any] | None,
                     final_values: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """GAE of every live transition of ``shard``, written to its derived columns.

    The columns ``"advantage"`` and ``"value_target"`` (advantage + value) extend the
    shard's schema as derived float32 fields at the first call: sampled and exported
    like any field; episodes written later hold zeros until the next call, and rows
    that are no transitions hold 0. An episode's last transition bootstraps from:

    - nothing if it terminated;
    - ``bootstrap_value(final_obs)`` if it was cut after its final observation
      (truncated, or cut by a writer's ``flush()``): ``final_obs`` is a TensorDict [n]
      of the observation fields of those n episodes (on a local store its tensors may
      view the rows: clone what you keep), and the result holds n finite values;
    - the value of its last stored step if it was stored without a final observation.

    Args:
        final_values: (episode ids, values) of the final observations of the cut
            episodes (`cut_episodes`), computed before (a Ray store calls the user's
            ``bootstrap_value`` in its own process); None calls ``bootstrap_value`` here.

    Returns:
        The number of transitions written.

    Raises:
        ValueError: no scalar ``reward`` / ``value_key`` step field, episodes cut
            after a final observation but no ``bootstrap_value``, or a callable
            that returns something other than one finite value per episode; with
            ``final_values``, a cut episode without a value. Nothing is changed
            when it raises.
    """
    check_gae_fields(shard, value_key)
    table = shard.table
    if table.pieces:
        return _write_across_pieces(shard, gamma, lam, value_key, bootstrap_value, final_values)
    first, length = table.col("first_row").astype(np.int64), table.col("length").astype(np.int64)
    has_final = table.col("has_final").astype(bool)
    # After the last transition: nothing (terminated), the last stored step's value
    # (no final observation), or the value of the final observation (cut).
    last_value = np.where(has_final, 0.0, _numbers_at(shard, value_key, np.minimum(first + length,
                                                                                   shard.rows - 1)))
    cut = _cut(table)
    if len(cut):
        if final_values is None:
            final = final_observations(shard, first[cut] + length[cut], views=True)
            last_value[cut] = bootstrap_values(bootstrap_value, final)
        else:
            last_value[cut] = _values_of(table.col("episode_id")[cut].astype(np.int64), *final_values)
    total = int(length.sum())
    lo, hi = (int(first.min()), int((first + length).max())) if total else (0, 0)
    if hi - lo <= SPAN_FACTOR * total:
        # The rows from the first transition to the last, as slices: the transitions and the
        # rows between them (final observations, free rows: 0 written there, as rows that are
        # not transitions always hold): no row lists, no fancy reads or writes (WBC's 98k:
        # ~40% of the call).
        value = _numbers(shard, value_key, lo, hi)
        advantage, target = gae(_numbers(shard, "reward", lo, hi), value, last_value, length, gamma, lam,
                                starts=first - lo)
        def write(name: str, values: np.ndarray) -> None:
            shard.write_rows(name, lo, values)
    else:   # few live rows over a long stretch of the arena (a ring after evictions)
        rows = shard.transition_rows()
        advantage, target = gae(_numbers_at(shard, "reward", rows), _numbers_at(shard, value_key, rows),
                                last_value, length, gamma, lam)
        def write(name: str, values: np.ndarray) -> None:
            shard.put_rows(name, rows, values)
    if "advantage" not in shard.schema.fields:
        shard.add_fields(shard.schema.extended({name: Field("float32", derived=True) for name in DERIVED}))
    for name, column in zip(DERIVED, (advantage, target)):
        write(name, column.astype(np.float32))
    return total


def _write_across_pieces(shard: Shard, gamma: float, lam: float, value_key: str,
                         bootstrap_value: Callable[[TensorDict], Any] | None,
                         final_values: tuple[np.ndarray, np.ndarray] | None) -> int:
    """`write_advantages` of a shard whose episodes may be cut into pieces: GAE runs over each
    played episode's held pieces as one (`Segments`), and is written to the sealed ones."""
    table = shard.table
    segments = Segments.of(table)
    first, length = table.ecol("first_row")[segments.last], table.ecol("length")[segments.last]
    has_final = table.ecol("has_final")[segments.last].astype(bool)
    last_value = np.where(has_final, 0.0, _numbers_at(shard, value_key, np.minimum(first + length,
                                                                                   shard.rows - 1)))
    cut = np.flatnonzero(segments.cut)
    if len(cut):
        if final_values is None:
            final = final_observations(shard, first[cut] + length[cut], views=True)
            last_value[cut] = bootstrap_values(bootstrap_value, final)
        else:
            last_value[cut] = _values_of(segments.key(table, segments.last[cut]), *final_values)
    rows = segments.rows
    advantage, target = gae(_numbers_at(shard, "reward", rows), _numbers_at(shard, value_key, rows),
                            last_value, segments.lengths, gamma, lam)
    if "advantage" not in shard.schema.fields:
        shard.add_fields(shard.schema.extended({name: Field("float32", derived=True) for name in DERIVED}))
    written = rows[segments.sealed]
    for name, column in zip(DERIVED, (advantage, target)):
        shard.put_rows(name, written, column[segments.sealed].astype(np.float32))
    return len(written)


def _values_of(episode_ids: np.ndarray, known_ids: np.ndarray, known_values: np.ndarray) -> np.ndarray:
    """The values given for ``episode_ids``.

    Raises:
        ValueError: some episode has none (it was cut after the final observations were read).
    """
    order = np.argsort(known_ids)
    at = np.minimum(np.searchsorted(known_ids[order], episode_ids), max(len(known_ids) - 1, 0))
    found = len(known_ids) > 0 and known_ids[order][at] == episode_ids
    if not np.all(found):
        missing = episode_ids[~np.asarray(found, bool)] if len(known_ids) else episode_ids
        raise ValueError(f"episodes {missing[:5].tolist()} were cut after a final observation but have no "
                         "bootstrap value: they were stored while compute_gae ran; call it again")
    return np.asarray(known_values, np.float64)[order][at]


def _numbers(shard: Shard, name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a scalar column as numbers (bfloat16 bits decoded)."""
    return _decoded(shard, name, shard.host_rows(name, start, stop).reshape(stop - start))


def _numbers_at(shard: Shard, name: str, rows: np.ndarray) -> np.ndarray:
    """A scalar column's values at arena ``rows``, as numbers."""
    return _decoded(shard, name, np.asarray(shard.reader(name)[rows]).reshape(len(rows)))


def _decoded(shard: Shard, name: str, column: np.ndarray) -> np.ndarray:
    return bf16_bits_to_float32(column) if shard.schema.fields[name].dtype == "bfloat16" else column
