"""The in-place write path of a step writer on a local store: every byte copied once.

A `StepWriter` whose store is embedded (one `ShardEngine`, ``mode="circular"``, no
rate limiter that can refuse) writes each step straight into the arena rows the
step keeps (`arrowbuf.regions` describes the layout). Per call of `StepWriter.add`
and per field, one fancy-indexed assignment copies the N envs' values from the
caller's arrays into their rows:

- the step's fields (action, reward, flags, extras) into row ``start + t`` of each
  env's open piece, the row that already holds observation t;
- the step's ``next_obs`` (or the final observation of an episode that ends) into
  row ``start + t + 1``: it is observation t + 1, stored once, so the caller's
  ``obs`` is read only at the first step of a piece (an episode's first step, or
  the first step in a new region);
- nothing is staged: the writer keeps no copy of a step, and the rows it writes
  are arena rows, faulted in once for the life of the store.

Completed steps are published at once (`EpisodeTable.publish_open`): sampleable
by uniform sampling, `iter_batches` and non-strict sequences; prioritized, strict
sequence and episode samplers see a piece once it is sealed.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np

from arrowbuf._lazy_torch import is_tensor
from arrowbuf.stage_arrays import stage_zeros
from arrowbuf.byte_heap import check_budget
from arrowbuf.columns import APART
from arrowbuf.encoded import EncodedColumn
from arrowbuf.row_stage import RowStage
from arrowbuf.schema import Schema
from arrowbuf.shard import total_reward
from arrowbuf.versions import writer_fields

_log = logging.getLogger(__name__)


class InPlace:
    """The open pieces of one writer's ``num_envs`` envs, as slots of a shard's `OpenRegions`.

    Args:
        engine: the local store's engine (its lock is held for every call).
        env_ids: one name per env.
    """

    def __init__(self, engine: Any, env_ids: list[str]) -> None:
        self.engine = engine
        self.env_ids = env_ids
        self.num_envs = len(env_ids)
        self.shard = None
        self.base = 0

    def bind(self) -> None:
        """Take slots in the engine's shard (made by the first step's schema, if not before)."""
        if self.shard is not None:
            return
        shard = self.engine.shard
        if shard is None:
            return
        codes = np.array([shard.table.env_code(e) for e in self.env_ids], np.int32)
        self.base = shard.regions.allocate(codes)
        self.shard = shard
        # A writer dropped without `close` seals its open pieces (as `flush` does) and gives its
        # slots back when it is collected: it keeps every step it wrote.
        self._finalizer = weakref.finalize(self, _release, self.engine, shard, self.base, self.env_ids)

    def release(self) -> None:
        """Seal the open pieces, as `flush` does, and give the slots back (once)."""
        if self.shard is not None:
            self._finalizer()

    @property
    def slots(self) -> slice:
        return slice(self.base, self.base + self.num_envs)

    def last_observations(self, envs: np.ndarray, given: dict | None = None
                          ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Of ``envs`` ([N] bool), those whose open piece has a step; the step each is at in its
        episode; and the observation row after their last step (host copies, by field). A field
        of a lossy codec never reads back what was written: its row is ``given``'s (the step's
        obs columns, name -> (array [N, ...], dtype)) where that encodes to the bytes stored."""
        if self.shard is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), {}
        with self.engine.lock:
            regions, shard = self.shard.regions, self.shard
            slots = self.base + np.flatnonzero(envs)
            slots = slots[regions.held[slots] & (regions.length[slots] > 0)]
            rows = regions.start[slots] + regions.length[slots]
            last = {name: np.array(shard.reader(name)[rows]) for name in shard.schema.observation_names}
            for name in last:
                column = shard.arena[name]
                if given is not None and name in given and getattr(column, "lossy", False):
                    rows_given = np.asarray(given[name][0])[slots - self.base]
                    same = column.encodes_to(rows, rows_given)
                    last[name][same] = rows_given[same]
            return slots - self.base, regions.first_step[slots] + regions.length[slots], last

    @property
    def lengths(self) -> np.ndarray:
        """Completed transitions of each env's open piece."""
        if self.shard is None:
            return np.zeros(self.num_envs, np.int64)
        return self.shard.regions.length[self.slots].copy()

    # -- a step ---------------------------------------------------------------------

    def add(self, schema: Schema, obs_cols: dict, next_cols: dict, step_cols: dict, final: dict,
            done: np.ndarray, recorded: np.ndarray) -> int:
        """Write one step of the ``recorded`` envs; seal the pieces of those ``done``.

        Returns:
            The number of episodes sealed.

        Raises:
            CapacityError: the store's arena cannot give every env a region of
                `MIN_REGION` rows at once, or the step's rows of a field with ``max_bytes``
                cannot fit in it (`_budgeted`); nothing changed.
        """
        self.bind()
        engine, shard = self.engine, self.shard
        with engine.lock:   # noqa: the shard exists: the writer set the schema before
            regions = shard.regions
            slots = self.base + np.flatnonzero(recorded)
            everyone = len(slots) == self.num_envs
            step_cols, next_cols, final = self._budgeted(slots, obs_cols, step_cols, next_cols, final, done)
            shard.placement.admit(len(slots))   # the oldest transitions past the capacity go first
            # Regions without room for this step (its row and the next observation's):
            # seal the piece written so far, and continue the episode in a new region.
            full = slots[regions.held[slots] & (regions.start[slots] + regions.length[slots] + 1
                                                >= regions.end[slots])]
            boundary = full[regions.length[full] > 0]
            used_to = regions.start[full] + np.where(regions.length[full] > 0, regions.length[full] + 1, 0)
            if len(boundary):
                self._seal(boundary, None, None, continues=True)
            shard.placement.drop_regions(full, used_to)
            shard.placement.reserve_regions(slots[~regions.held[slots]], transitions=len(slots))
            cur = regions.start[slots] + regions.length[slots]
            fresh = regions.length[slots] == 0
            for name, (array, _) in obs_cols.items():
                if fresh.all():
                    shard.scatter(name, cur, array if everyone else array[slots - self.base])
                elif fresh.any():
                    shard.scatter(name, cur[fresh], array[slots[fresh] - self.base])
            for name, (array, _) in step_cols.items():
                shard.scatter(name, cur, array if everyone else array[slots - self.base])
            ends = done[slots - self.base]
            ended = slots[ends]
            # An ended env's row after its step takes its final observation, written below. A field
            # stored apart (encoded, ragged: each write takes bytes) does not write its next_obs (the new
            # episode's first, written again as that step's obs) there first; a fixed-size one does,
            # rather than copy every other env's row out first (4,096 envs: 1.6 of a step's 2.5 ms).
            going = np.flatnonzero(~ends) if final is not None and len(ended) else None
            for name, (array, _) in next_cols.items():
                rows = array if everyone else array[slots - self.base]
                if going is not None and name in final and isinstance(shard.arena[name], APART):
                    shard.scatter(name, cur[going] + 1, rows[going])
                else:
                    shard.scatter(name, cur + 1, rows)
            if len(ended) and final is not None:
                at = cur[ends] + 1
                for name, array in final.items():
                    shard.scatter(name, at, array[ended - self.base])
            regions.wrote(slots)
            engine.counted(inserts=len(slots))   # a step counts once written (sampleable), not when sealed
            if len(ended):
                flags = {flag: _host_flags(step_cols[flag][0], self.num_envs)[ended - self.base]
                         if flag in step_cols else np.zeros(len(ended), bool) for flag in ("terminated", "truncated")}
                self._seal(ended, flags["terminated"], flags["truncated"], continues=False)
            shard.publish_open()
            return len(ended)

    def flush(self) -> int:
        """Seal every open piece (cut: its last row is the last next observation); the
        env's next step starts a new episode. Returns the number sealed."""
        if self.shard is None:
            return 0
        with self.engine.lock:
            regions = self.shard.regions
            slots = self.base + np.flatnonzero(regions.held[self.slots] & (regions.length[self.slots] > 0))
            if len(slots):
                self._seal(slots, None, None, continues=False)
            regions.restart(self.slots)
            self.shard.publish_open()
            return len(slots)

    # -- state ------------------------------------------------------------------------

    def state(self, schema: Schema) -> dict[str, Any]:
        """The open pieces as a staged writer's state holds open episodes: ``pos`` (steps),
        ``stage`` (their rows, [N, steps, ...]), ``last_next`` (the observation after the
        last step) and ``first_step`` (where each piece starts in its episode): host copies."""
        lengths = self.lengths
        steps = int(lengths.max(initial=0))
        fields = writer_fields(schema)
        # (a ragged or text field's: a `RowStage`, saved as arrays and JSON values below)
        stage = {name: stage_zeros((self.num_envs, steps, *f.shape), f, None, name)
                 for name, f in fields.items()} if steps else {}
        last = {name: np.zeros((self.num_envs, *fields[name].shape), fields[name].numpy_dtype)
                for name in schema.observation_names}
        first_step = np.zeros(self.num_envs, np.int64)
        if self.shard is not None and steps:
            with self.engine.lock:
                regions = self.shard.regions
                first_step = regions.first_step[self.slots].copy()
                for i in np.flatnonzero(lengths).tolist():
                    a, n = int(regions.start[self.base + i]), int(lengths[i])
                    for name in fields:
                        stage[name][i, :n] = self.shard.host_rows(name, a, a + n)
                    for name in last:
                        last[name][i] = self.shard.host_rows(name, a + n, a + n + 1)[0]
        held = np.zeros(self.num_envs, bool)
        start = end = np.zeros(self.num_envs, np.int64)
        prev = np.full(self.num_envs, -1, np.int64)
        if self.shard is not None:
            regions = self.shard.regions
            held, start, end = regions.held[self.slots].copy(), regions.start[self.slots].copy(), \
                regions.end[self.slots].copy()
            prev = regions.prev[self.slots].copy()
        stage = {name: rows.saved() if isinstance(rows, RowStage) else rows for name, rows in stage.items()}
        return {"pos": lengths, "stage": stage if steps else {}, "last_next": last if steps else {},
                "first_step": first_step, "regions": {"held": held, "start": start, "end": end, "prev": prev}}

    def load(self, pos: np.ndarray, stage: dict, last_next: dict, first_step: np.ndarray,
             saved: dict | None) -> None:
        """Write saved open pieces (`state`, or a staged writer's open episodes) back into
        regions of this store: the regions they had (``saved``, from a checkpoint of this
        store: the rows there belong to no live piece), else new ones.

        Raises:
            CapacityError: a piece does not fit in the store's capacity.
        """
        self.bind()
        fields = self.shard.schema.fields
        stage = {name: RowStage.from_saved(rows, fields[name], name) if isinstance(rows, dict) else rows
                 for name, rows in stage.items()}   # a ragged or text field's (`state`)
        with self.engine.lock:
            regions, shard = self.shard.regions, self.shard
            slots = self.slots
            checked = None
            if saved is not None:
                held = np.asarray(saved["held"], bool)
                start, end = np.asarray(saved["start"], np.int64), np.asarray(saved["end"], np.int64)
                room = np.where(pos > 0, end - 1, end)   # an open piece's rows start..start + pos lie inside
                if any(a.shape != (self.num_envs,) for a in (held, start, end)) or np.any(
                        held & ((start < 0) | (end > shard.rows) | (start + pos > room))):
                    raise ValueError(f"writer state has regions {saved!r} that do not fit its open steps {pos} "
                                     f"in a store of {shard.rows} rows")
                prev = np.asarray(saved.get("prev", np.full(self.num_envs, -1)), np.int64)
                if prev.shape != (self.num_envs,) or np.any((prev < -1) | (prev >= shard.table.episodes_added)):
                    raise ValueError(f"writer state has pieces continued {prev!r}; expected {self.num_envs} serials "
                                     f"of pieces added to this store (< {shard.table.episodes_added}) or -1")
                checked = {"held": held, "start": start, "end": end, "prev": prev}
            regions.restore(slots, first_step, checked)
            if checked is not None:
                shard.placement.adopt_regions()
            for i in np.flatnonzero(pos).tolist():
                n = int(pos[i])
                slot = np.array([self.base + i])
                if not regions.held[slot[0]]:
                    shard.placement.reserve_regions(slot, n + 2)
                a = int(regions.start[slot[0]])
                for name, rows in stage.items():
                    shard.write_rows(name, a, rows[i, :n])
                for name, row in last_next.items():
                    shard.write_rows(name, a + n, row[i:i + 1])
                regions.wrote(slot, n)
            if saved is None:   # a staged writer's open steps, counted by no store yet (in place: at `add`)
                self.engine.counted(inserts=int(pos.sum()))
            shard.publish_open()

    # -- internals -------------------------------------------------------------------

    def _budgeted(self, slots: np.ndarray, obs_cols: dict, step_cols: dict, next_cols: dict, final: dict | None,
                  done: np.ndarray) -> tuple[dict, dict, dict | None]:
        """The step's columns, its rows of encoded fields with a byte budget encoded once (their
        bytes are known only encoded; the writes store them as they are), once each such field's
        rows that the step writes are known to fit in its budget beside the open tails' last
        observations (`byte_heap.check_budget`): the writes then evict the oldest to make room.

        Raises:
            CapacityError: naming the field, before anything changed.
        """
        shard = self.shard
        if not shard.bounded:
            return step_cols, next_cols, final
        regions, envs = shard.regions, slots - self.base
        # The envs whose obs row this step writes: a new piece (none held, no step yet, or a full region).
        starts = envs[~regions.held[slots] | (regions.length[slots] == 0)
                      | (regions.start[slots] + regions.length[slots] + 1 >= regions.end[slots])]
        ends = envs[done[envs]] if final is not None else envs[:0]
        step_cols, next_cols, final = dict(step_cols), dict(next_cols), dict(final) if final is not None else None
        pinned = shard.placement.pinned_rows()
        for name in shard.bounded:
            column = shard.arena[name]
            nbytes, encoded = 0, isinstance(column, EncodedColumn)
            going = np.setdiff1d(envs, ends) if final is not None and name in final else envs   # as `add` writes
            for cols, rows in ((step_cols, envs), (next_cols, going), (final, ends)):
                if cols is None or name not in cols:
                    continue
                array = cols[name][0] if cols is not final else cols[name]
                if encoded:   # every env's row, as the writes index them
                    array = column.encode(array)
                    cols[name] = (array, cols[name][1]) if cols is not final else array
                    nbytes += int(array.sizes()[rows].sum())
                else:
                    nbytes += column.bytes_of(array if len(rows) == self.num_envs else array[rows])
            if name in obs_cols and len(starts):
                nbytes += column.bytes_of(np.asarray(obs_cols[name][0])[starts])
            check_budget(column, nbytes, pinned, f"a step of {len(envs)} env(s) writes",
                         shard.schema.fields[name].max_bytes,
                         "raise max_bytes, or write fewer envs or smaller rows a step (nothing of it was written)")
        return step_cols, next_cols, final

    def _seal(self, slots: np.ndarray, terminated: np.ndarray | None, truncated: np.ndarray | None,
              continues: bool) -> None:
        """Seal the open pieces of ``slots`` into the episode table (has_final: their last
        row is an observation). ``continues``: the episodes go on in new regions."""
        shard, engine = self.shard, self.engine
        regions, table = shard.regions, shard.table
        start, length = regions.start[slots], regions.length[slots]
        last = start + length
        for name, f in shard.schema.fields.items():
            if not f.observation:
                shard.zero_at(name, last)   # the final row holds only its observation
        reward, none = shard.arena.get("reward"), np.zeros(len(slots), bool)
        terminated, truncated = (none if flags is None else flags for flags in (terminated, truncated))
        runs = list(zip(start.tolist(), length.tolist()))
        returns = [total_reward(reward[a:a + n]) for a, n in runs] if reward is not None else [float("nan")] * len(runs)
        shard.record_many(start, length + 1, length, np.ones(len(slots), bool), terminated, truncated, returns,
                          [self.env_ids[s] for s in (slots - self.base).tolist()],
                          first_step=regions.first_step[slots], prev_piece=regions.prev[slots])
        if engine.sampler.tracks_rows:
            for a, n in runs:
                engine.sampler.on_add(a, n)
        # continued: the next pieces continue these, serials of the k-th added
        regions.sealed(slots, table.episodes_added - len(slots) + np.arange(len(slots)) if continues else None)


def _release(engine: Any, shard: Any, base: int, env_ids: list[str]) -> None:
    """A writer's end (`InPlace.release`, or its finalizer): seal its open pieces as `InPlace.flush`
    does and give its slots back. Never raises (it may run from the garbage collector)."""
    try:
        if engine.lock.held_here():   # inside one of this thread's store calls (GC ran us): when it ends
            engine.lock.defer(lambda: _release(engine, shard, base, env_ids))
            return
        with engine.lock:
            if engine.shard is shard:   # else the store made a new shard since (`clear` keeps it): nothing held
                closing = InPlace(engine, env_ids)
                closing.shard, closing.base = shard, base
                regions = shard.regions
                slots = base + np.flatnonzero(regions.held[closing.slots] & (regions.length[closing.slots] > 0))
                if len(slots):
                    closing._seal(slots, None, None, continues=False)
                shard.placement.release(base, len(env_ids))
                shard.publish_open()
    except Exception:   # noqa: BLE001 - a finalizer must not raise; the store stays as it was
        _log.exception("arrowbuf: sealing the open episodes of a released writer failed")


def _host_flags(flags: Any, num_envs: int) -> np.ndarray:
    """One bool per env, on the host, from a step's flags (N,) or (N, 1), numpy or a tensor."""
    if is_tensor(flags):
        flags = flags.detach().cpu().numpy()
    return np.asarray(flags).reshape(num_envs, -1).any(axis=1)
