"""One shard: a ring arena of preallocated columns, its episode table, and views.

The shard is the one owner of placement (`arrowbuf.placement` plans, the shard applies):
``capacity`` counts transitions, and the arena keeps the rows beyond it that final
observations and repeated first rows take. A write first evicts the oldest transitions
past the capacity (``mode="circular"``; ``mode="fixed"`` raises `CapacityError`), then
takes rows at the ring's head, or grows the ring into rows never written (`evict_oldest`
is the one eviction routine). Episodes are written contiguously and never wrap.

A local store's step writers write steps in place into per-env regions reserved at
the ring's head (`reserve_regions`, `arrowbuf.regions`, `arrowbuf.inplace`): an episode
is then a chain of contiguous pieces (table rows linked by env and ``first_step``), and
open tails are published after the sealed episodes (`EpisodeTable.publish_open`).

The embedded store and each Ray shard actor run this same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from arrowbuf._checks import metadata_text
from arrowbuf.byte_heap import bind_heap_columns, check_budget, share_budgets
from arrowbuf.columns import APART, arena_column, host_column, stored_rows
from arrowbuf.encoded import EncodedColumn, EncodedRows
from arrowbuf.ragged import nested
from arrowbuf.errors import CapacityError
from arrowbuf.indexing import look_ahead, piece_chains
from arrowbuf.packing import column_view, item_dtype, pack_layout
from arrowbuf.placement import Plan, Ring, arena_rows
from arrowbuf.regions import OpenRegions
from arrowbuf.sample_args import SampleArgs
from arrowbuf.schema import SYSTEM_SPECS, Schema
from arrowbuf.table import EpisodeTable
from arrowbuf.tensors import Gather, make_tensordict

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from arrowbuf.samplers import Selection

MODES = ("circular", "fixed")


@dataclass
class Episode:
    """One checked episode, ready to be copied into a shard.

    ``columns`` hold T rows for step fields and T (+1 when ``has_final``) rows for
    observation fields, in dtypes that cast to the schema's without loss.
    """

    columns: Mapping[str, np.ndarray]
    num_steps: int
    has_final: bool
    env_id: str = "default"
    metadata: dict[str, Any] | None = field(default=None)
    owned: bool = False   # columns are private copies, not views of a writer's staging rows
    inserted_at: int | None = None   # ns since the epoch; None = when added (imports keep the original)
    first_step: int = 0   # the step of its first row in its episode: > 0 for a piece that continues one
    open: bool = False    # a piece whose episode goes on (a Ray writer's shipped open steps: `arrowbuf.ray.tails`)
    prev_piece: int = -1  # serial of the stored piece this one continues (its shard's: `arrowbuf.ray.tails`); -1: none

    @property
    def num_rows(self) -> int:
        return self.num_steps + int(self.has_final)


def total_reward(reward: Any) -> float:
    """The sum of an episode's rewards, in float64 (a numpy array or a torch tensor on any device)."""
    if isinstance(reward, np.ndarray):
        return float(np.add.reduce(reward, axis=None, dtype=np.float64))
    return float(reward.double().sum())


def contiguous(rows: np.ndarray) -> bool:
    """Whether arena ``rows`` (1-D, distinct) are consecutive, ascending: a slice of the arena."""
    return rows.ndim == 1 and len(rows) > 0 and int(rows[-1]) - int(rows[0]) == len(rows) - 1 \
        and bool(np.all(np.diff(rows) == 1))


def position_runs(first_row: np.ndarray, num_rows: np.ndarray) -> list[tuple[int, int]]:
    """Maximal ranges [a, b) of episodes (given oldest first) that lie back to back in the arena."""
    if not len(first_row):
        return []
    breaks = np.flatnonzero(first_row[1:] != (first_row + num_rows)[:-1]) + 1
    bounds = [0, *breaks.tolist(), len(first_row)]
    return list(zip(bounds[:-1], bounds[1:]))


class Shard:
    """A ring arena that holds ``capacity`` transitions, evicting the oldest first.

    Args:
        schema: the fields of every row.
        capacity: transitions held (the arena keeps `arena_rows` rows: an episode of
            T steps with its final observation takes T+1 rows).
        mode: "circular" evicts the oldest transitions; "fixed" raises `CapacityError`.
        shard: this shard's number (Ray backend); ``num_shards`` spaces episode ids.
        whole_pieces: evict whole pieces only (a Ray shard: its sealed blocks hold
            whole episodes), never the front of one.
        room: the largest capacity `set_capacity` may give it later (a Ray shard's
            store capacity: its share may grow to it); the arena's rows are made for it,
            and cost memory only once written. Default: ``capacity``.

    Raises:
        ValueError: a capacity below 1 or an unknown mode.
    """

    #: numpy columns in host memory, sampled by `arrowbuf.direct` (a torch arena's are not).
    host_columns = True
    #: whether the columns' pages are faulted in by the first write (the rows past the ring cost nothing).
    lazy_rows = True

    def __init__(self, schema: Schema, capacity: int, mode: str = "circular", shard: int = 0,
                 num_shards: int = 1, whole_pieces: bool = False, room: int | None = None) -> None:
        if capacity < (0 if room else 1):   # 0: a Ray shard's share may be none of its store (`room`)
            raise ValueError(f"capacity must be >= 1 transition, got {capacity}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.schema = schema
        self.capacity = capacity
        self.room = max(capacity, room or 0)   # what `set_capacity` may grow the capacity to
        self.mode = mode
        # Rows of the arena: the ring laps over as many as its pieces need (`arrowbuf.placement`).
        self.rows = arena_rows(self.room, self.lazy_rows)
        self.table = EpisodeTable(shard=shard, id_offset=shard, id_stride=num_shards, capacity=self.room)
        self.specs = {**schema.fields, **SYSTEM_SPECS}
        # User fields only: the system columns (episode_id, step, is_first, is_last)
        # follow from the episode table, and storing them would cost 14 bytes a row.
        # np.empty leaves pages untouched until written: memory grows with the data.
        # Small per-step fields share one row-packed block (`arrowbuf.packing`).
        self.packed, self._pack_offsets = self.new_packed(schema.fields)
        self.arena = {name: self._packed_column(name, f) if name in self._pack_offsets
                      else self.new_column(f, zero=False) for name, f in schema.fields.items()}
        # Encoded columns: named, bounded by their share of max_bytes, emptied of what is evicted.
        self._total = room or capacity * num_shards   # the store's capacity, of which this shard's is a share
        released = bind_heap_columns(self.arena, schema.fields, (capacity, self._total),
                                     lambda fraction: self.placement.free_oldest(fraction), mode)
        # Fields with a byte budget (max_bytes): each write checks its rows of them before evicting.
        self.bounded = tuple(name for name, c in self.arena.items() if getattr(c, "budget", None) is not None)
        # Where rows go and what is evicted: the head, the ring, the writers' open regions.
        self.placement = Ring(self.table, capacity, self.rows, mode, self.reward_sum, whole_pieces,
                              released=released, grow_arena=None if self.lazy_rows else self.grow_arena)
        # Packed vector fields as one opaque item per row, what `write_rows` copies into.
        self._items = {name: column_view(self.packed, offset, item_dtype(f.numpy_dtype, f.shape), ())
                       for name, offset in self._pack_offsets.items()
                       for f in [schema.fields[name]] if f.shape}
        # Row -> serial of its episode (mod 2**32): which pieces a write overwrites once
        # pieces are sealed out of ring order (`arrowbuf.regions`), and which episode a
        # row picked by a sampler (prioritized) belongs to: see `positions_of_rows`.
        # 4 bytes a row, built by the first `positions_of_rows` (`index_rows`): a store
        # that only adds whole episodes in ring order never needs it, and keeping it
        # cost a fill of 4 bytes a row per write (~0.5 us of a W1 add_episode).
        self._row_episode: np.ndarray | None = None
        # How often each row was sampled, or None: counting costs ~5% of a W1 sample,
        # so only `track_reuse` turns it on. Zeroed when the row is written.
        self.reuse: np.ndarray | None = None
        self.gatherer = self.make_gatherer(self.gather_columns())

    def __len__(self) -> int:
        """Sampleable transitions: sealed, and open tails'."""
        return self.table.num_transitions

    @property
    def regions(self) -> OpenRegions:
        """The writers' open regions (`arrowbuf.regions`), kept by the `placement`."""
        return self.placement.regions

    @property
    def write_pos(self) -> int:
        """The row after the newest piece (the ring's head)."""
        return self.placement.write_pos

    @property
    def ring(self) -> int:
        """Rows the head laps over (grown as the pieces need, up to `rows`)."""
        return self.placement.ring

    def add_fields(self, schema: Schema) -> None:
        """Take on ``schema``: this shard's fields plus new (derived) ones, zero in every row."""
        for name, f in schema.fields.items():
            if name not in self.arena:
                self.arena[name] = self.new_column(f, zero=True)
        self.schema = schema
        self.specs = {**schema.fields, **SYSTEM_SPECS}
        self.gatherer = self.make_gatherer(self.gather_columns())

    def grow_arena(self, rows: int) -> int:
        """Take ``rows`` rows (more than now), every column's rows copied: the arena's rows after,
        the same when it cannot grow. A lazy arena keeps all its rows from the start (never asked);
        a CUDA one grows (`arrowbuf.arena.TorchShard.grow_arena`)."""
        return self.rows

    def rows_grown(self, old: int) -> None:
        """The arena grew from ``old`` rows to `rows`: the per-row counts grow with it (zero)."""
        for name in ("reuse", "_row_episode"):
            counts = getattr(self, name)
            if counts is not None:
                grown = np.zeros(self.rows, counts.dtype)
                grown[:old] = counts[:old]
                setattr(self, name, grown)

    def gather_columns(self) -> dict:
        """The gather's columns: key -> (column, role, tensor dtype name, packed block or None)."""
        columns = {}
        for name, f in self.schema.fields.items():
            key = tuple(name.split("."))
            offset = self._pack_offsets.get(name)
            columns[key] = (self.arena[name], "obs" if f.observation else "step", f.dtype,
                            None if offset is None else (self.packed, offset))
            if f.observation:
                columns[("next", *key)] = (self.arena[name], "next", f.dtype)
        return columns

    # -- the columns (a subclass keeps them elsewhere: `arrowbuf.arena.TorchShard`) ------

    def new_column(self, spec: Any, zero: bool) -> Any:
        """A column of ``capacity`` rows for field ``spec`` (zeroed when ``zero``): its kind's
        (`arrowbuf.columns.host_column`)."""
        return host_column(spec, self.rows, zero)

    def new_packed(self, fields: Mapping[str, Any]) -> tuple[np.ndarray | None, dict[str, int]]:
        """(the row-packed block of ``fields``' small per-step fields, their byte offsets);
        (None, {}) when none are packed."""
        row_bytes, offsets = pack_layout(fields)
        if not offsets:
            return None, {}
        return arena_column((self.rows, row_bytes), np.uint8), offsets

    def _packed_column(self, name: str, spec: Any) -> np.ndarray:
        return column_view(self.packed, self._pack_offsets[name], spec.numpy_dtype, spec.shape)

    def make_gatherer(self, columns: dict) -> Gather:
        """The gather of `gather_columns`' columns."""
        return Gather(columns)

    def write_rows(self, name: str, start: int, data: Any) -> None:
        """Copy ``data`` (rows first) into column ``name`` from row ``start``."""
        items = self._items.get(name)
        if items is not None and type(data) is np.ndarray and data.flags.c_contiguous \
                and data.dtype == self.arena[name].dtype:
            # A packed vector: whole rows as items (`packing.item_dtype`), 4x faster.
            items[start:start + len(data)] = data.view(np.uint8).reshape(len(data), items.itemsize).view(items.dtype)[:, 0]
        else:
            self.arena[name][start:start + len(data)] = data

    def write_block(self, name: str, start: int, rows: int, block: np.ndarray) -> None:
        """Copy ``block`` ``[E, n, ...]`` (n <= ``rows``) into column ``name`` as E runs of ``rows`` rows
        from row ``start`` (`arrowbuf.block_add`); each run's rows past n are zeroed."""
        column = self.arena[name][start:start + len(block) * rows]
        runs = np.lib.stride_tricks.as_strided(column, (len(block), rows, *column.shape[1:]),
                                               (rows * column.strides[0], *column.strides))
        runs[:, :block.shape[1]] = block
        if block.shape[1] < rows:
            runs[:, block.shape[1]:] = 0

    def write_parts(self, name: str, start: int, parts: list[np.ndarray]) -> None:
        """Copy ``parts`` (rows first) one after the other into column ``name`` from row ``start``, in one pass."""
        np.concatenate(parts, out=self.arena[name][start:start + sum(len(p) for p in parts)], casting="unsafe")

    def zero_rows(self, name: str, start: int, stop: int) -> None:
        """Zero rows ``[start, stop)`` of column ``name``."""
        self.arena[name][start:stop] = 0

    def scatter(self, name: str, rows: np.ndarray, values: Any) -> None:
        """Write a step's ``values`` (one row per entry of ``rows``, cast to the column) at arena ``rows``."""
        column = self.arena[name]
        if not len(rows):
            return
        if type(values) is np.ndarray and type(column) is np.ndarray and values.dtype == column.dtype and column.ndim > 1 \
                and values.flags.c_contiguous and column.flags.c_contiguous and values.shape[1:] == column.shape[1:]:
            # Rows as flat runs: a fancy assignment of uint16[6, 112, 112] rows walks their dimensions
            # (2-3x slower for 256 rows); viewing rows as opaque items cost ~6 us a call.
            column.reshape(len(column), -1)[rows] = values.reshape(len(values), -1)
        else:
            column[rows] = values

    def zero_at(self, name: str, rows: np.ndarray) -> None:
        """Zero arena ``rows`` of column ``name``."""
        self.arena[name][rows] = 0

    def put_rows(self, name: str, rows: np.ndarray, values: np.ndarray) -> None:
        """Write host ``values`` (numpy, bfloat16 as its uint16 bits) at arena ``rows``."""
        self.arena[name][rows] = values

    def host_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of column ``name`` in host memory (numpy; bfloat16 as
        uint16 bits): a view of this arena."""
        return self.arena[name][start:stop]

    def stored_rows(self, name: str, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of column ``name`` as stored (what exports and checkpoints
        write): `arrowbuf.columns.stored_rows`."""
        column = self.arena[name]
        return stored_rows(column, start, stop) if isinstance(column, APART) else self.host_rows(name, start, stop)

    def reader(self, name: str) -> Any:
        """Column ``name`` for reads by host index arrays (``reader(name)[rows]`` is numpy)."""
        return self.arena[name]

    def _read(self, name: str) -> Any:
        """`reader` of a field, None for a name that is none (the look-ups' flags)."""
        return self.reader(name) if name in self.schema.fields else None

    def tensor_rows(self, name: str, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of column ``name`` as a torch tensor viewing the arena (a
        ragged field's: a jagged nested tensor of a copy)."""
        import torch

        if self.schema.fields[name].ragged:
            return nested(self.arena[name][start:stop], self.schema.fields[name].dtype)
        view = torch.from_numpy(self.arena[name][start:stop])
        spec = self.schema.fields[name]
        return view.view(spec.torch_dtype) if view.dtype != spec.torch_dtype else view

    def extra_tensor(self, array: np.ndarray) -> torch.Tensor:
        """A host array computed for a batch (index, episode id, step) as a tensor beside the arena's."""
        import torch

        return torch.from_numpy(array)

    def viewable(self, rows: np.ndarray) -> bool:
        """Whether `view_batch` can give arena ``rows``: contiguous, in a shard with no text field
        (a text field's strings are no view of the arena: such a batch is gathered)."""
        return contiguous(rows) and not any(f.text for f in self.schema.fields.values())

    def view_batch(self, start: int, stop: int, extra: Mapping[str, np.ndarray],
                   keys: frozenset | None = None, device: Any = None) -> TensorDict:
        """The transitions at the contiguous arena rows ``[start, stop)`` as a TensorDict of
        *views* of the arena (no copy): fields at t read rows ``[start, stop)``, ``next``
        observations rows ``[start + 1, stop + 1)``. The views alias the arena: they
        change when the ring overwrites those rows.

        Args:
            start, stop: arena rows of consecutive transitions.
            extra: per-transition arrays added as they are (index, episode id, step).
            keys: `Gather.check_keys` of the fields to include (None: all).
            device: where the batch goes (a copy when elsewhere); None: where the arena is.
        """
        tensors = {}
        for name, spec in self.schema.fields.items():
            key = tuple(name.split("."))
            if keys is None or key in keys:
                tensors[key] = self.tensor_rows(name, start, stop)
            if spec.observation and (keys is None or ("next", *key) in keys):
                tensors[("next", *key)] = self.tensor_rows(name, start + 1, stop + 1)
        for name, array in extra.items():
            tensors[tuple(name.split("."))] = self.extra_tensor(array)
        batch = make_tensordict(tensors, (stop - start,))
        return batch if device is None else batch.to(device)

    # -- writing --------------------------------------------------------------------

    def transitions_of(self, episode: Episode) -> int:
        """Transitions an episode contributes: steps that have a next observation."""
        if self.schema.observation_names and not episode.has_final:
            return episode.num_steps - 1
        return episode.num_steps

    def check_fits(self, episode: Episode) -> Plan:
        """Where ``episode`` goes and what it evicts first (`plan`), or `CapacityError` with nothing changed."""
        length = self.transitions_of(episode)
        if length > self.capacity or episode.num_rows > self.rows:
            raise CapacityError(
                f"episode of {episode.num_steps} steps holds {length} transitions, more than the shard "
                f"capacity of {self.capacity:,} transitions; raise the capacity or cut the episode")
        self._check_budgets(episode)
        return self.placement.plan(episode.num_rows, length)

    def _check_budgets(self, episode: Episode) -> None:
        """`CapacityError` for an episode whose rows of a field with a byte budget (this shard's part
        of ``max_bytes``; ragged values, or encoded rows as `encoded` made them) do not fit in it
        (`byte_heap.check_budget`): storing it evicted every episode held first."""
        for name in self.bounded:
            column, data = self.arena[name], episode.columns.get(name)
            if data is not None:
                check_budget(column, column.bytes_of(data), self.placement.pinned_rows(), "an episode of",
                             self.schema.fields[name].max_bytes)

    def encoded(self, episode: Episode) -> Episode:
        """``episode`` with its rows of encoded fields with a byte budget encoded (`EncodedRows`, stored
        as they are): their bytes are known only once encoded, and `check_fits` checks them first."""
        encoded = {name: column.encode(data) for name in self.bounded
                   for column, data in [(self.arena[name], episode.columns.get(name))]
                   if isinstance(column, EncodedColumn) and data is not None
                   and not (isinstance(data, EncodedRows) and data.codec.spec == column.codec.spec)}
        return replace(episode, columns={**episode.columns, **encoded}) if encoded else episode

    def evicted_spans(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(first row, rows) of the ``count`` oldest episodes."""
        return self.table.col("first_row")[:count].copy(), self.table.col("num_rows")[:count].copy()

    def add(self, episode: Episode, plan: tuple[int, int] | None = None, rows: bool = True) -> int:
        """Copy an episode into the arena, evicting the oldest as needed; returns its id.

        Args:
            episode: a checked episode.
            plan: `check_fits` of this episode, if the caller just computed it.
            rows: False records the episode without copying its rows: the caller writes
                them (`write_episode`) before anything reads them. A Ray shard does so
                for the episodes whose rows a writer lent it in a sealed object, read
                from there until something needs them here (`arrowbuf.ray.lent`).

        Raises:
            CapacityError: the episode is longer than the capacity, or the store is
                full in ``mode="fixed"``; the shard is unchanged.
        """
        plan = plan if plan is not None else self.check_fits(episode)
        # Summaries first: the columns may be views of this arena (an episode read
        # back from the store) that the copy below overwrites.
        columns = episode.columns
        # A flag is () or (1,) a step (the schema's rule): bool() reads either.
        terminated = "terminated" in columns and bool(columns["terminated"][episode.num_steps - 1])
        truncated = "truncated" in columns and bool(columns["truncated"][episode.num_steps - 1])
        ret = total_reward(columns["reward"]) if "reward" in columns else float("nan")
        start = self.placement.apply(plan, episode.num_rows)
        if rows:
            self.write_episode(start, episode)
        episode_id = self.record(episode, start, terminated, truncated, ret)
        if self.regions.count:
            self.publish_open()
        return episode_id

    def record(self, episode: Episode, start: int, terminated: bool, truncated: bool, ret: float) -> int:
        """Append ``episode`` (rows from ``start`` on; end flags and return read before they were written) to the table."""
        self.own_rows(start, start + episode.num_rows)
        return self.table.append(first_row=start, num_rows=episode.num_rows, length=self.transitions_of(episode),
                                 has_final=episode.has_final, terminated=terminated, truncated=truncated, ret=ret,
                                 env_id=episode.env_id, metadata=metadata_text(episode.metadata), inserted_at=episode.inserted_at,
                                 first_step=episode.first_step, prev_piece=episode.prev_piece)

    def reward_sum(self, start: int, stop: int) -> float:
        """The sum of the rewards in rows ``[start, stop)`` (NaN without a reward field)."""
        return total_reward(self.arena["reward"][start:stop]) if "reward" in self.arena else float("nan")

    def own_rows(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` are the next appended piece's: the row -> episode map; `track_reuse`'s counts restart."""
        if self._row_episode is not None:
            self._row_episode[start:stop] = self.table.episodes_added & 0xFFFFFFFF
        if self.reuse is not None:
            self.reuse[start:stop] = 0

    def record_many(self, starts: np.ndarray, rows: np.ndarray, *entries: Any, **named: Any) -> list[int]:
        """`record` of many episodes, the k-th at rows ``[starts[k], starts[k] + rows[k])``; the rest of
        each one's table entry as `EpisodeTable.append_many` takes it (``entries``, ``named``). Their ids."""
        at = np.repeat(starts - np.cumsum(rows) + rows, rows) + np.arange(int(rows.sum()))   # `own_rows` of each
        if self._row_episode is not None:
            self._row_episode[at] = np.repeat(self.table.episodes_added + np.arange(len(rows)), rows) & 0xFFFFFFFF
        if self.reuse is not None:
            self.reuse[at] = 0
        return self.table.append_many(starts, rows, *entries, **named)

    def publish_open(self) -> None:
        """Publish the open tails of the writers' regions in the episode table (sampleable)."""
        *tails, grown_only = self.regions.published()
        self.table.publish_open(*tails, grown_only=grown_only)

    def write_episode(self, start: int, episode: Episode) -> None:
        """Copy ``episode``'s rows into the arena from row ``start`` (where `add` placed it)."""
        rows = episode.num_rows
        stop = start + rows
        columns, packed = episode.columns, self._pack_offsets
        short = []   # packed fields one row short: their last row is zeroed below
        for name in self.schema.fields:
            data = columns.get(name)
            if data is None:        # a derived field the writer left out: zero until computed
                self.zero_rows(name, start, stop)
                continue
            self.write_rows(name, start, data)
            if len(data) < rows:    # a step field beside a final observation: one row short
                if name in packed:
                    short.append(name)
                else:
                    self.zero_rows(name, stop - 1, stop)
        if short:
            if len(short) == len(packed):   # every packed field: one store zeroes the record
                self.packed[stop - 1] = 0
            else:
                for name in short:
                    self.zero_rows(name, stop - 1, stop)

    def set_capacity(self, capacity: int) -> int:
        """Hold ``capacity`` transitions from now on (`arrowbuf.placement.Ring.resize`: a
        smaller one evicts the oldest now; a fixed store's shrinks no lower than it holds);
        the capacity taken.

        Raises:
            ValueError: a capacity outside ``[0, room]``.
        """
        if not 0 <= capacity <= self.room:
            raise ValueError(f"capacity must be in [0, {self.room}] (the transitions this shard's arena was made "
                             f"for), got {capacity}")
        self.capacity = self.placement.resize(capacity)
        share_budgets(self.arena, self.schema.fields, self.capacity, self._total)   # bytes follow the share
        return self.capacity

    def clear(self) -> None:
        """Drop every episode and open tail (the arena stays allocated for reuse); the
        writers' open episodes continue in new regions from their next step."""
        self.table.clear()
        self.placement.clear()

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the next episode goes, the episode table and the sample counts of
        `track_reuse` (the rows are saved apart)."""
        return {"capacity": self.capacity, "mode": self.mode, **self.placement.state(),
                "table": self.table.state_dict(), "reuse": self.reuse.copy() if self.reuse is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` into an empty shard of the same capacity; the caller
        copies the live episodes' rows into the arena at their ``first_row``.

        Raises:
            ValueError: another capacity, or a write position outside the arena.
        """
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"shard state is for capacity {state['capacity']}, this shard has {self.capacity}")
        self.table.load_state_dict(state["table"])
        self.placement.load(state)
        if self._row_episode is not None:   # rebuild the row -> episode map for the loaded table
            self._row_episode = None
            self.index_rows()
        if state.get("reuse") is not None:   # (a state of a version whose arena had `capacity` rows: fewer)
            self.reuse = np.zeros(self.rows, np.uint32)
            self.reuse[:len(state["reuse"])] = state["reuse"]

    # -- reuse ------------------------------------------------------------------------

    def track_reuse(self) -> None:
        """Count from now on how often each row is sampled (`count_samples`, `reuse_counts`)."""
        if self.reuse is None:
            self.reuse = np.zeros(self.rows, np.uint32)

    def count_samples(self, rows: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Count one sample of each of ``rows`` (where ``mask``: padding is not a sample)."""
        if self.reuse is not None:
            np.add.at(self.reuse, rows[mask] if mask is not None else rows.reshape(-1), np.uint32(1))

    def transition_rows(self) -> np.ndarray:
        """Arena rows of the live transitions, oldest first."""
        first, length = self.table.col("first_row"), self.table.col("length")
        ends = np.cumsum(length)
        return np.repeat(first - (ends - length), length) + np.arange(int(ends[-1]) if len(ends) else 0)

    def reuse_counts(self) -> np.ndarray | None:
        """How often each live transition was sampled, oldest first; None when not tracked."""
        return self.reuse[self.transition_rows()] if self.reuse is not None else None

    # -- reading ----------------------------------------------------------------------

    def lookups(self, selection: Selection, args: SampleArgs, index_base: int = 0
                ) -> tuple[np.ndarray, dict, np.ndarray | None, np.ndarray | None]:
        """(rows, extra arrays, observation rows, next-observation rows) of a selection of
        this shard's transitions, for the look-ups ``args``; ``index_base`` is added to the
        ``index`` extra."""
        n, frames = args.n_step, args.frame_stack
        table = self.table
        rows, pos = selection.rows, selection.pos
        # episode_id and step come from the episode table, not from per-row columns.
        step = selection.step
        first = table.ecol("first_row").take(pos) if step is None or n > 1 or frames > 1 else None
        if step is None:
            step = rows - first
            if table.pieces:   # the step within the episode of a piece that continues one
                step = step + table.ecol("first_step").take(pos)
        # Open steps' indices as tokens that keep naming their step (`arrowbuf.open_indices`).
        indices = table.public_indices(selection.indices, pos) if table.open_total else selection.indices
        extra = {"index": indices + index_base if index_base else indices,
                 "episode_id": table.ecol("episode").take(pos),
                 "step": step.astype(np.int32), **selection.extra}
        # Pieces of one episode read as one episode where their rows are held (`PieceChains`).
        chains = piece_chains(table) if table.pieces and not args.plain else None
        looked, obs_rows, next_rows = look_ahead(table, chains, rows, pos, step, first, args, self._read)
        extra.update(looked)
        return rows, extra, obs_rows, next_rows

    def index_rows(self) -> None:
        """Keep a row -> episode map from now on (4 bytes a row), for `positions_of_rows`."""
        if self._row_episode is None:
            self._row_episode = np.zeros(self.rows, np.uint32)
            table = self.table
            for k, (first, rows) in enumerate(zip(table.col("first_row"), table.col("num_rows"))):
                self._row_episode[first:first + rows] = (table.episodes_added - len(table) + k) & 0xFFFFFFFF

    def positions_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """Live positions of the episodes holding arena ``rows`` (`index_rows` from now on);
        a row outside every live episode may map to any position: callers check the row
        against the episode's ``first_row`` and ``num_rows``."""
        if self._row_episode is None:
            self.index_rows()
        head_serial = (self.table.episodes_added - len(self.table)) & 0xFFFFFFFF
        return (self._row_episode[rows].astype(np.int64) - head_serial) & 0xFFFFFFFF
