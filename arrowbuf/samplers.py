"""Samplers: pure, vectorized index selection; they never touch column data.

A sampler turns (a seeded `numpy.random.Generator`, a batch size, a shard's
episode table) into a `Selection`: arena rows to gather, the transition indices
that become the batch's ``"index"``, and extra tensors (weights, masks). Every
sampler costs O(batch), whatever the capacity or the number of episodes: live
transitions (and live windows of a sequence length) hold contiguous ranges of
serial numbers, so a uniform draw is an integer draw plus a binary search.

Stateful samplers (prioritized, without replacement) are bound to one shard; the
shard engine that owns both tells the sampler of each write and eviction
(`Sampler.on_add`, `Sampler.on_evict`): the shard never calls the sampler. A Ray
store gives each shard its own copy.
"""

from __future__ import annotations

import warnings
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from arrowbuf._checks import check_bool, check_int
from arrowbuf._sumtree import SumTree, leaves_at_depth
from arrowbuf.indexing import PieceChains, piece_chains
from arrowbuf.table import EpisodeTable


@dataclass
class Selection:
    """What a sampler chose: rows to gather, their indices and episodes, and extra per-item arrays."""

    rows: np.ndarray                     # arena rows, [B] or [B, L]
    indices: np.ndarray                  # transition indices, same shape ("index")
    pos: np.ndarray                      # live position of each one's episode, same shape
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    step: np.ndarray | None = None       # step within the episode (a piece's first_step added), when known


def select_indices(table: EpisodeTable, indices: np.ndarray, extra: dict | None = None) -> Selection:
    """The selection of live transition indices."""
    pos, step = table.locate(indices)
    rows = table.ecol("first_row").take(pos)
    rows += step
    if table.pieces:   # the step within the episode of a piece that continues one
        step = step + table.ecol("first_step").take(pos)
    return Selection(rows, indices, pos, extra or {}, step)


def uniform_indices(rng: np.random.Generator, n: int, first_index: int, stop_index: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """``n`` indices drawn uniformly with replacement from ``[first_index, stop_index)``
    (into ``out``, int64 ``[n]``, when given).

    Scaled uniform floats: 1.5x faster than ``rng.integers`` for a batch; with 53
    random bits per draw, the relative bias is below ``count / 2**53`` (1e-10 at a
    million transitions). The product never reaches ``count`` (no clamp needed):
    the largest draw is ``1 - 2**-53``, and ``count * (1 - 2**-53)`` is exact for a
    power of two and otherwise rounds down, as ``count * 2**-53`` is more than half
    the spacing of doubles near ``count`` (for any ``count`` below ``2**52``).
    """
    draws = rng.random(n)
    draws *= stop_index - first_index
    indices = draws.astype(np.int64)
    if out is None:
        indices += first_index
        return indices
    return np.add(indices, first_index, out=out)


def epoch_batches(rng: np.random.Generator, indices: np.ndarray, batch_size: int,
                  shuffle: bool = True, drop_last: bool = False) -> list[np.ndarray]:
    """Every one of ``indices`` once, in batches of ``batch_size`` (shuffled in place).

    Eager, not a generator: the draw from ``rng`` happens now, under whatever lock
    the caller holds, not whenever the first batch is asked for.
    """
    if shuffle:
        rng.shuffle(indices)
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    return [indices[start:start + batch_size] for start in range(0, stop, batch_size)]


class Sampler:
    """Base of the samplers: `bind` attaches one to a shard, `sample` selects.

    Subclasses override `sample`; those that keep per-row state set
    ``tracks_rows`` and override `on_add` and `on_evict`, which the shard engine
    calls after each write (evictions first, then the new rows).
    """

    tracks_rows = False   # whether on_add / on_evict do anything (the engine skips the spans otherwise)
    draws_open = False    # whether it draws open tails (`EpisodeTable.sample_range`), or sealed episodes only
    reads_values = False  # whether a draw reads stored values (a group's key): a Ray shard copies lent rows in first

    def __init__(self) -> None:
        self._shard = None

    @property
    def bound_shard(self) -> Any:
        """The shard `bind` gave this sampler (None before)."""
        return self._shard

    def check_schema(self, schema: Any) -> None:
        """Raise ValueError when this sampler cannot select from a store of ``schema`` (`GroupSampler`:
        its key); checked when a shard is made for it, before anything is stored."""

    def bind(self, shard) -> None:
        """Attach to the shard whose episodes this sampler selects from.

        Raises:
            ValueError: the sampler is already bound to another shard, or cannot select from
                its schema (`check_schema`).
        """
        if self._shard is not shard:
            self.check_unused()
        if getattr(shard, "schema", None) is not None:   # (a Ray reader's view binds a copy to its table only)
            self.check_schema(shard.schema)
        self._shard = shard

    def check_unused(self) -> None:
        """Raises ValueError when a store uses this sampler already (a Ray store checks it before its
        shards copy the sampler: one bound to a local store's shard does not copy)."""
        if self._shard is not None:
            raise ValueError(f"{self!r} is already used by another store; create one sampler per store")

    def on_add(self, first_row: int, length: int) -> None:
        """Transitions at arena rows ``[first_row, first_row + length)`` were written."""

    def on_evict(self, first_rows: np.ndarray, num_rows: np.ndarray) -> None:
        """Episodes at ``first_rows`` (of ``num_rows`` rows each) were evicted."""

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable) -> Selection:
        raise NotImplementedError

    def epoch(self, rng: np.random.Generator, indices: np.ndarray, batch_size: int, shuffle: bool,
              drop_last: bool, table: EpisodeTable) -> list[np.ndarray]:
        """``iter_batches``' order: every one of ``indices`` once, in batches (`epoch_batches`);
        a sampler whose batches have a structure (`arrowbuf.groups.GroupSampler`) keeps it."""
        return epoch_batches(rng, indices, batch_size, shuffle, drop_last)

    def mass(self, table: EpisodeTable) -> float:
        """This shard's share of a sharded batch: what the sampler draws from (by default
        the transitions of sealed episodes; open tails are drawn by `UniformSampler`)."""
        return float(table.sealed_transitions)

    def config(self) -> dict:
        """The constructor arguments that rebuild this sampler (JSON values)."""
        return {}

    def state_dict(self) -> dict:
        """Type, `config` and mutable state (JSON values and numpy arrays, copied)."""
        return {"type": type(self).__name__, "config": self.config()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict` into a sampler built from its ``config`` and bound
        to the restored shard.

        Raises:
            ValueError: the state is of another sampler type or configuration.
        """
        if state.get("type") != type(self).__name__ or dict(state.get("config", {})) != self.config():
            raise ValueError(f"sampler state of {state.get('type')}({state.get('config')}) cannot be loaded "
                             f"into {self!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class UniformSampler(Sampler):
    """Uniform sampling with replacement over stored transitions (the default).

    Both ways of sampling draw through `draw`: `sample` is `draw`, then
    `select_indices`; and a store's plain ``sample(batch_size)`` (this sampler, no
    rate limit, on the CPU, no n-step or frame stack, no reuse tracking: the most
    common call of off-policy replay) takes the engine's path that writes `draw`'s
    indices, their episodes and steps straight into its pooled batch, with no
    `Selection` (`arrowbuf.engine.ShardEngine.sample`). A seeded store thus samples
    the same batches either way (`arrowbuf.direct`, tests/test_direct.py).

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=100, sampler=ab.UniformSampler(), seed=0)
        >>> _ = store.add_episode({"obs": np.zeros((4, 2)), "action": np.zeros(3), "terminated": np.zeros(3, bool)})
        >>> store.sample(5)["index"].shape
        torch.Size([5])
    """

    draws_open = True

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable) -> Selection:
        return select_indices(table, self.draw(rng, n, table))

    def draw(self, rng: np.random.Generator, n: int, table: EpisodeTable, out: np.ndarray | None = None
             ) -> np.ndarray:
        """``n`` sampleable transition indices of ``table`` (`EpisodeTable.sample_range`), drawn
        uniformly with replacement (into ``out``, int64 ``[n]``, when given): what `sample` selects."""
        return uniform_indices(rng, n, *table.sample_range(), out=out)

    def mass(self, table: EpisodeTable) -> float:
        """Sealed transitions and open tails' (`EpisodeTable.sample_range`)."""
        return float(table.num_transitions)


class WithoutReplacementSampler(Sampler):
    """Epochs: each stored transition once per epoch, in random order.

    A batch stops at the end of an epoch, so the last batch of an epoch can be
    short; with ``drop_last=True`` that remainder is skipped and the next epoch
    starts instead. Transitions added during an epoch join the next one; evicted
    ones are skipped.

    Args:
        drop_last: skip the short last batch of each epoch.

    Raises:
        ValueError: ``drop_last`` is not True or False.

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=100, sampler=ab.WithoutReplacementSampler(), seed=0)
        >>> _ = store.add_episode({"obs": np.zeros((5, 2)), "action": np.zeros(4), "terminated": np.zeros(4, bool)})
        >>> sorted(store.sample(4)["index"].tolist())
        [0, 1, 2, 3]
    """

    def __init__(self, drop_last: bool = False) -> None:
        super().__init__()
        self.drop_last = check_bool("drop_last", drop_last)
        self._order = np.empty(0, np.int64)
        self._cursor = 0
        self.epoch = 0

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable) -> Selection:
        if self.drop_last and table.sealed_transitions < n:
            raise ValueError(f"batch of {n} is larger than the {table.sealed_transitions} stored transitions "
                             "and drop_last=True")
        remaining = self._order[self._cursor:]
        remaining = remaining[table.is_live(remaining)]
        if not len(remaining) or (self.drop_last and len(remaining) < n):
            # A new epoch: every live transition once, in a new random order.
            remaining = np.arange(*table.live_range(), dtype=np.int64)
            rng.shuffle(remaining)
            self.epoch += 1
        indices = remaining[:n]
        self._order, self._cursor = remaining, len(indices)
        return select_indices(table, indices)

    def config(self) -> dict:
        return {"drop_last": self.drop_last}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "order": self._order.copy(), "cursor": self._cursor, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._order = np.array(state["order"], np.int64)
        self._cursor, self.epoch = int(state["cursor"]), int(state["epoch"])

    def __repr__(self) -> str:
        return f"WithoutReplacementSampler(drop_last={self.drop_last})"


#: The smallest sum-tree leaf of a live transition: the smallest normal float64.
MIN_LEAF = float(np.finfo(np.float64).tiny)


class PrioritizedSampler(Sampler):
    """Proportional prioritized replay (Schaul et al., 2016) over a sum tree.

    P(i) = p_i^alpha / sum_k p_k^alpha. New transitions get the largest priority
    seen so far. Batches carry ``"weight"``: the importance weight
    (N * P(i))^-beta, divided by the largest weight in the batch. Priorities are
    set with `ExperienceStore.update_priorities` from a batch's ``"index"``;
    indices of transitions evicted since are ignored.

    Priority underflow: with a large ``alpha``, ``(p + eps) ** alpha`` rounds to 0
    (``1e-6 ** 60``); a tree of such leaves has no mass to draw from. Every live
    leaf is therefore at least `MIN_LEAF` (2.2e-308), the smallest normal float64.
    That keeps eps's promise (no live transition is undrawable), keeps the total
    positive and exact, and changes P(i) only among leaves below 2.2e-308, which
    are drawn alike (uniformly, when all are that small). Bounding ``alpha``
    would refuse settings that are fine for the priorities a run actually has,
    and a uniform fallback when the total is 0 would still let subnormal totals
    lose the proportions; clamping at the leaf is the one place that covers both.

    Args:
        alpha: how much priorities count (0 = uniform).
        beta: importance-sampling correction (1 = full).
        eps: added to every priority so none is zero.

    Raises:
        ValueError: alpha < 0, beta outside [0, 1], or eps <= 0.

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=100, seed=0, sampler=ab.PrioritizedSampler(alpha=0.6, beta=0.4))
        >>> _ = store.add_episode({"obs": np.zeros((5, 2)), "action": np.zeros(4), "terminated": np.zeros(4, bool)})
        >>> batch = store.sample(8)
        >>> store.update_priorities(batch["index"], np.ones(8))
        8
    """

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6) -> None:
        super().__init__()
        real = (int, float, np.integer, np.floating)   # numbers, not bools (np.isfinite("x") was a TypeError)
        if isinstance(alpha, bool) or not isinstance(alpha, real) or not (np.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        if isinstance(beta, bool) or not isinstance(beta, real) or not (0 <= beta <= 1):
            raise ValueError(f"beta must be in [0, 1], got {beta!r}")
        if isinstance(eps, bool) or not isinstance(eps, real) or not (np.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.max_priority = 1.0
        self.tree: SumTree | None = None

    tracks_rows = True

    def bind(self, shard) -> None:
        super().bind(shard)
        if self.tree is None:
            shard.index_rows()
            self.tree = SumTree(min(shard.rows, leaves_at_depth(shard.capacity + 1)))

    def _cover(self, rows: int) -> None:
        """Grow the tree to hold leaves ``[0, rows)``. It starts with the rows a ring of whole
        episodes uses (its capacity and a row per piece), not the arena's 2.5x (`placement.arena_rows`):
        each ``ARITY``-fold more leaves is one more level for every search and update to walk."""
        if rows > self.tree.size:
            grown = SumTree(max(rows, min(self._shard.rows, leaves_at_depth(rows))))
            grown.load_state_dict(self.tree.state_dict())   # the leaves held, in the first rows
            self.tree = grown

    def on_add(self, first_row: int, length: int) -> None:
        self._cover(first_row + length)
        self.tree.fill(first_row, first_row + length, float(self._leaves(np.float64(self.max_priority))))

    def on_evict(self, first_rows: np.ndarray, num_rows: np.ndarray) -> None:
        for first, rows in zip(first_rows.tolist(), num_rows.tolist()):
            self.tree.fill(first, first + rows, 0.0)

    def mass(self, table: EpisodeTable) -> float:
        """Sum of p^alpha over stored transitions: exact global proportional sampling across shards."""
        return self.tree.total if self.tree is not None else 0.0

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable,
               population: tuple[int, float] | None = None) -> Selection:
        """Draw ``n`` transitions; ``population`` = (transitions, mass) of all shards.

        Within a sharded store the weights use the global population and are left
        unnormalized; the router divides by the batch maximum.
        """
        total = self.tree.total
        rows = self.tree.find(rng.random(n) * total)
        pos = self._shard.positions_of_rows(rows)
        step = rows - table.col("first_row").take(pos)
        indices = table.col("first_index").take(pos) + step
        if table.pieces:
            step = step + table.col("first_step").take(pos)
        count, mass = population if population is not None else (table.sealed_transitions, total)
        weight = (count * self.tree.leaves[rows] / mass) ** -self.beta
        if population is None:
            weight = weight / weight.max()
        return Selection(rows, indices, pos, {"weight": weight.astype(np.float32)}, step)

    def update(self, table: EpisodeTable, indices: np.ndarray, priorities: np.ndarray) -> int:
        """Set the priorities of live ``indices``; returns how many were live."""
        live = table.is_live(indices)
        indices, priorities = indices[live], priorities[live]
        if len(indices):
            priorities = priorities + self.eps
            self.tree.update(table.rows_of(indices), self._leaves(priorities))
            self.max_priority = max(self.max_priority, float(priorities.max()))
        return int(live.sum())

    def _leaves(self, priorities: np.ndarray) -> np.ndarray:
        """Sum-tree leaves of priorities (eps added): p ** alpha, at least `MIN_LEAF`."""
        with np.errstate(under="ignore"):
            return np.maximum(priorities ** self.alpha, MIN_LEAF)

    def config(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "eps": self.eps}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "max_priority": self.max_priority,
                "tree": self.tree.state_dict() if self.tree is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore priorities; the sampler must be bound to a shard of the same capacity."""
        super().load_state_dict(state)
        if state["tree"] is not None:
            if self.tree is None:
                raise ValueError("bind the PrioritizedSampler to its shard before loading its state")
            self._cover(min(int(state["tree"]["size"]), self._shard.rows))   # the size it had grown to
            self.tree.load_state_dict(state["tree"])
        self.max_priority = float(state["max_priority"])

    def __repr__(self) -> str:
        return f"PrioritizedSampler(alpha={self.alpha}, beta={self.beta}, eps={self.eps})"


class SequenceSampler(Sampler):
    """Windows of ``seq_len`` consecutive steps inside one episode; batches [B, seq_len].

    With ``strict=True`` only windows that fit in their episode are drawn, each
    with equal probability. With ``strict=False`` any transition can start a
    window; steps past the episode end are padded (repeating the last step) and
    ``"mask"`` is False there. Either way a window never crosses an episode
    boundary and never reads an evicted row. A non-strict window goes on across the
    held pieces of an episode that a step writer cut (`arrowbuf.indexing.PieceChains`);
    a strict one lies within one piece.

    Args:
        seq_len: steps per window (>= 1). An episode's *length* is its count of
            transitions everywhere in arrowbuf; a window's is its ``seq_len``
            (TorchRL's ``slice_len``, RLlib's ``max_seq_len``).
        strict: only windows that fit.
        length: the former name of ``seq_len`` (deprecated; checkpoints written
            before the rename still load).

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=100, seed=0, sampler=ab.SequenceSampler(seq_len=3))
        >>> _ = store.add_episode({"obs": np.arange(6.0), "action": np.zeros(5), "terminated": np.zeros(5, bool)})
        >>> store.sample(2)["obs"].shape
        torch.Size([2, 3])
    """

    def __init__(self, seq_len: int | None = None, strict: bool = True, *, length: int | None = None) -> None:
        super().__init__()
        if length is not None:
            if seq_len is not None:
                raise TypeError(f"SequenceSampler got seq_len={seq_len!r} and its former name length={length!r}; "
                                "pass seq_len only")
            warnings.warn("SequenceSampler(length=) is now SequenceSampler(seq_len=)", DeprecationWarning, stacklevel=2)
            seq_len = length
        if seq_len is None:
            raise TypeError("SequenceSampler needs seq_len, the steps per window (an int >= 1)")
        self.seq_len = check_int("seq_len", seq_len, 1)
        self.strict = check_bool("strict", strict)
        self.draws_open = not self.strict   # strict windows: within sealed episodes
        self._counter = f"windows{self.seq_len}"

    def bind(self, shard) -> None:
        super().bind(shard)
        if self.strict:
            span = self.seq_len
            shard.table.add_counter(self._counter, lambda n: max(0, n - span + 1))

    def mass(self, table: EpisodeTable) -> float:
        if not self.strict:
            return float(table.num_transitions)   # open tails too
        first, stop = table.live_range(self._counter)
        return float(stop - first)

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable) -> Selection:
        offsets = np.arange(self.seq_len, dtype=np.int64)
        if self.strict:
            first, stop = table.live_range(self._counter)
            if stop <= first:
                raise ValueError(f"no episode has {self.seq_len} transitions for a strict window "
                                 f"(longest: {int(table.col('length').max(initial=0))}); "
                                 "use strict=False or a shorter seq_len")
            pos, start = table.locate(rng.integers(first, stop, size=n, dtype=np.int64), self._counter)
            steps = start[:, None] + offsets
            mask = np.ones((n, self.seq_len), bool)
        else:
            # Open tails too: a window stops at the last written step, as at an episode's end.
            pos, step = table.locate(uniform_indices(rng, n, *table.sample_range()))
            if table.pieces:   # across the held pieces of an episode (`PieceChains`)
                return self._across_pieces(piece_chains(table), table, pos, step + table.ecol("first_step")[pos])
            last = table.ecol("length")[pos] - 1
            steps = step[:, None] + offsets
            mask = steps <= last[:, None]
            steps = np.minimum(steps, last[:, None])
        indices = table.ecol("first_index")[pos][:, None] + steps
        rows = table.ecol("first_row")[pos][:, None] + steps
        return Selection(rows, indices, np.broadcast_to(pos[:, None], rows.shape), {"mask": mask})

    def _across_pieces(self, chains: PieceChains, table: EpisodeTable, pos: np.ndarray, step: np.ndarray) -> Selection:
        """Non-strict windows from episode ``step`` of entries ``pos`` that go on into the
        next pieces of their episode, up to its last held step (``mask`` False after)."""
        _, at = chains.locate(pos, step + self.seq_len)
        end = chains.first_step[at] + chains.length[at]   # past the chain's last held transition
        steps = step[:, None] + np.arange(self.seq_len, dtype=np.int64)
        mask = steps < end[:, None]
        rows, where = chains.locate(pos[:, None], np.minimum(steps, (end - 1)[:, None]))
        indices = table.ecol("first_index")[where] + (rows - chains.first_row[where])
        return Selection(rows, indices, where, {"mask": mask})

    def config(self) -> dict:
        return {"seq_len": self.seq_len, "strict": self.strict}

    def __repr__(self) -> str:
        return f"SequenceSampler(seq_len={self.seq_len}, strict={self.strict})"


class EpisodeSampler(Sampler):
    """Whole episodes, uniformly; batches [B, T_max] padded, with ``"mask"``.

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=100, seed=0, sampler=ab.EpisodeSampler())
        >>> _ = store.add_episode({"obs": np.arange(4.0), "action": np.zeros(3), "terminated": np.zeros(3, bool)})
        >>> _ = store.add_episode({"obs": np.arange(6.0), "action": np.zeros(5), "terminated": np.zeros(5, bool)})
        >>> batch = store.sample(2)
        >>> batch["mask"].sum(1).tolist() in ([3, 5], [5, 3], [3, 3], [5, 5])
        True
    """

    def sample(self, rng: np.random.Generator, n: int, table: EpisodeTable) -> Selection:
        lengths = table.col("length")
        pos = rng.integers(0, len(lengths), size=n)
        empty = lengths[pos] == 0
        while empty.any():  # episodes of one step without a final observation have no transition
            pos[empty] = rng.integers(0, len(lengths), size=int(empty.sum()))
            empty = lengths[pos] == 0
        return episode_selection(table, pos)


def episode_selection(table: EpisodeTable, pos: np.ndarray) -> Selection:
    """The sealed episodes at live positions ``pos`` (each with a transition) as a [B, T_max]
    selection of their steps, padded with their last, and ``"mask"``."""
    chosen = table.col("length")[pos]
    steps = np.arange(int(chosen.max()), dtype=np.int64)[None, :]
    mask = steps < chosen[:, None]
    steps = np.minimum(steps, chosen[:, None] - 1)
    indices = table.col("first_index")[pos][:, None] + steps
    rows = table.col("first_row")[pos][:, None] + steps
    return Selection(rows, indices, np.broadcast_to(pos[:, None], rows.shape), {"mask": mask})
