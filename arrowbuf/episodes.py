"""Episode assembly from steps: the vectorized step writer.

On a local store `StepWriter` writes each step straight into the arena rows it
keeps (`arrowbuf.inplace`: one copy per byte, completed steps sampleable at once,
episodes of any length as pieces). Elsewhere (a Ray store's sink, or a store whose
rate limiter or ``mode="fixed"`` may refuse a write) it stages steps from N envs in
per-field arrays [N, T_max, ...] (one fancy-indexed assignment per field and step)
and seals each episode as it ends; a Ray writer also ships open episodes' completed
steps as pieces on its delivery timer (`arrowbuf.piece_cutting`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from arrowbuf._checks import AUTORESET_MODES, check_int, default_env_ids
from arrowbuf._lazy_torch import is_tensor
from arrowbuf.stage_arrays import host_copy, like_stage, owned_copy, owned_episode, stage_zeros, staged
from arrowbuf.autoreset import inherited_resets, with_ended_rows
from arrowbuf.errors import CapacityError, RateLimited, WriterClosedError
from arrowbuf.inplace import InPlace
from arrowbuf.piece_cutting import PieceCutter
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode
from arrowbuf.step_reading import StepReader, check_obs_chain, done_flags, passed_on
from arrowbuf.versions import commit_versions, read_schema, step_versions, writer_fields

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from arrowbuf.backend import EpisodeSink


class StepWriter:
    """Assembles episodes from N vectorized environments, step by step.

    Call `add` once per vector-env step with what the env returned; an environment
    whose step ends its episode (``terminated | truncated``) seals that episode into
    the store, with ``next_obs`` as its final observation. `flush` cuts every open
    episode (end of a rollout); the final observation is the last ``next_obs``.

    Gymnasium autoreset modes (``autoreset_mode``; `arrowbuf.autoreset`):
        - ``"next_step"`` (gymnasium's default): the step after an episode ends only
          resets that env; the writer ignores it for that env (checked: ``reset_check``).
        - ``"same_step"``: the env resets within the ending step and ``next_obs`` is
          already the next episode's first observation; pass ``final_obs`` (e.g.
          ``info["final_obs"]``) so the final observation is stored.
        - ``"disabled"``: you reset envs yourself; ``next_obs`` is the final observation.

    On a local store (``mode="circular"``, no rate limiter that waits) each step is
    written once, straight into the arena rows it keeps, and is sampleable as soon as
    its ``next_obs`` is known (`arrowbuf.inplace`; docs/guide.md "Steps written in
    place"): ``obs`` is read at an episode's first step only, later observations come
    from ``next_obs``; an episode longer than the env's region is sealed in pieces, so
    none is ever too long for the store. Elsewhere (Ray, ``mode="fixed"``, a rate
    limiter; or ``in_place=False``) steps are staged per env and each episode is
    written when it ends.

    With a ``device`` (a store's ``storage_device``) steps stay on it: tensors there
    never cross to the host (only the done flags do).

    After `close` (or its ``with`` block) a writer refuses every write with
    `WriterClosedError`. A writer dropped without `close` keeps every step it wrote:
    its open episodes are cut as `flush` cuts them when it is collected.

    Example:
        >>> import numpy as np, arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=1000, seed=0)
        >>> w = store.writer(num_envs=2)
        >>> obs = np.zeros((2, 3), np.float32)
        >>> w.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2),
        ...       terminated=np.array([True, False]), truncated=np.zeros(2, bool), next_obs=obs + 1)
        1
        >>> store.num_episodes, len(store)   # env 1's open step is sampleable already
        (1, 2)
    """

    def __init__(self, sink: "EpisodeSink", num_envs: int, autoreset_mode: str = "next_step",
                 env_ids: Sequence[str] | None = None, device: torch.device | None = None,
                 in_place: bool = True, reset_check: Any = None, name: str | None = None,
                 ends: Any = None) -> None:
        num_envs = check_int("num_envs", num_envs, 1)
        if autoreset_mode not in AUTORESET_MODES:
            raise ValueError(f"autoreset_mode must be one of {AUTORESET_MODES}, got {autoreset_mode!r}")
        if env_ids is not None and (isinstance(env_ids, str) or len(env_ids) != num_envs
                                    or not all(isinstance(e, str) for e in env_ids)):
            raise ValueError(f"env_ids must be {num_envs} strings, got {env_ids!r}")
        self.num_envs = int(num_envs)
        self.autoreset_mode = autoreset_mode
        self.env_ids = list(env_ids) if env_ids is not None else default_env_ids(num_envs)
        self._sink = sink
        self.name = name or "writer"   # the store's name for it (`arrowbuf._writers`), in errors
        self.closed = False            # after `close`: every write is refused
        self.device = device   # where steps are staged: None (numpy) or a torch device
        self._stage: dict[str, np.ndarray] = {}
        self._last_next: dict[str, np.ndarray] = {}
        self._reader = StepReader(self.num_envs, device, autoreset_mode if reset_check is None else None)
        self._pos = np.zeros(num_envs, np.int64)      # steps in each env's open episode
        self._skip = np.zeros(num_envs, bool)         # next_step mode: the coming step is a reset
        # An episode that outgrew the capacity was refused: the rest of it is skipped,
        # so that its tail is not stored as an episode of its own.
        self._refused = np.zeros(num_envs, bool)
        # Sealed episodes the store refused (rate limiter, full fixed store): kept,
        # and pushed again before the next step is recorded.
        self._pending: list[Episode] = []
        self.episodes_written = 0
        self.reset_check = reset_check   # an `arrowbuf.autoreset.ResetCheck` of a mode not given, or None
        self._versions = np.zeros(num_envs, np.int64)   # each env's last policy_version (`arrowbuf.versions`)
        # Episode ends of next-step envs left by the writers before, taken at the first step; this writer's
        # own, left when it is closed or collected (`arrowbuf.autoreset.EnvEnds`; `_skip`, `_last_next` in place).
        self._ends = ends if autoreset_mode == "next_step" else None
        self._inherited = np.zeros(num_envs, bool)
        self._leave: Any = None
        self._given_next: Any = None   # the last step's next_obs columns as given, and where they lie (`_check_chain`)
        # A local store's engine: steps are written in place (`arrowbuf.inplace`);
        # ``in_place=False`` stages them as a Ray store's writer does.
        engine = getattr(sink, "inplace_engine", None) if in_place else None
        self._inplace = InPlace(engine, self.env_ids) if engine is not None else None
        if self._inplace is not None:
            self._inplace.bind()   # now, if the store has its schema: regions are shared among all writers
        # A Ray sink ships completed steps of open episodes as pieces (`arrowbuf.piece_cutting`).
        self._first_step = np.zeros(num_envs, np.int64)   # step of each env's first staged row in its episode
        self.lock = threading.Lock()   # `add` and `flush` against the sink's timer (`PieceCutter.cut_due`)
        self._ships = PieceCutter.attach(self, sink) if self._inplace is None else None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("lock", "_ships", "_ends", "_leave", "_given_next")}

    def __setstate__(self, state: dict) -> None:
        # Unpickled from Ray's object store, arrays are read-only views: own them.
        self.__dict__.update(state)
        self._ends = self._leave = self._given_next = None   # a copy in a task or an actor leaves no ends
        self._inherited = self.__dict__.get("_inherited", np.zeros(self.num_envs, bool)).copy()
        self.lock = threading.Lock()
        self._first_step = self.__dict__.get("_first_step", np.zeros(self.num_envs, np.int64)).copy()
        self._ships = PieceCutter.attach(self, self._sink) if self._inplace is None else None
        self._pos, self._skip, self._refused = self._pos.copy(), self._skip.copy(), self._refused.copy()
        self._versions = self.__dict__.get("_versions", np.zeros(self.num_envs, np.int64)).copy()
        self._stage = {n: a.copy() for n, a in self._stage.items()}
        self._last_next = {n: a.copy() for n, a in self._last_next.items()}

    @property
    def pending(self) -> int:
        """Sealed episodes waiting for the store to accept them."""
        return len(self._pending)

    @property
    def open_steps(self) -> np.ndarray:
        """Steps recorded so far in each env's open episode (in place: in its open piece)."""
        if self._inplace is not None:
            return self._inplace.lengths
        return self._pos.copy()

    def add(self, *, obs: Any, action: Any, reward: Any, terminated: Any, truncated: Any, next_obs: Any,
            final_obs: Any = None, **extra: Any) -> int:
        """Record one step of every env; seals the episodes that end.

        Args:
            obs: observations before the step, leading dim N (a dict for Dict spaces).
            action, reward, terminated, truncated: leading dim N.
            next_obs: observations returned by the step.
            final_obs: ``same_step`` mode only: final observations of the envs that
                ended (an [N, ...] array, or gymnasium's object array with None for
                envs that did not end).
            **extra: more per-step fields (log_prob, value, ...), leading dim N;
                ``policy_version`` may be one int for every env (non-decreasing per env).

        Returns:
            The number of episodes sealed by this step.

        Raises:
            SchemaError: a field with the wrong name, dtype, shape or leading dim;
                nothing is recorded.
            RateLimited, CapacityError: the store still refuses episodes sealed
                earlier; nothing is recorded, retry the step later. (Episodes this
                step seals that the store refuses are kept and pushed first next time.)
            ObservationMismatchError: an env's ``obs`` differs from its last
                ``next_obs`` mid-episode (observation t + 1 is stored once, as the
                ``next_obs`` of step t); nothing is recorded.
            ValueError: a bad, decreasing or out-of-range ``policy_version``, or ``final_obs``
                in another mode than ``same_step``; nothing is recorded.
            WriterClosedError: the writer is closed; nothing is recorded.
            CapacityError: an env's open episode outgrew the store's capacity at
                this step (its steps and final observation need more rows than a
                shard holds), or an episode this step ended is longer than the
                capacity. That env's episode is dropped and its remaining steps are
                skipped until it ends (or `flush` cuts it); the other envs' steps
                are recorded.
        """
        self._check_open("add")
        versions = step_versions(self._versions, extra, self._sink.schema, self._sink)   # checked, not yet recorded
        self._push_pending()
        step = {"action": action, "reward": reward, "terminated": terminated, "truncated": truncated, **extra}
        schema, obs_cols, next_cols, step_cols = self._reader.read(read_schema(self._sink.schema, versions), obs,
                                                                   next_obs, step)
        if self._ends is not None:   # the first step: the ends of the writers before (once); this one's at its end
            self._inherit(schema, self._ends.take(self.env_ids))
            self._leave = weakref.finalize(self, self._ends.leave, self.env_ids, self._skip, self._last_next)
            self._ends = None
        # Flags are () or (1,) a step (Schema enforces it): one per env either way.
        done = done_flags(step_cols["terminated"][0], self.num_envs) | done_flags(step_cols["truncated"][0], self.num_envs)
        done = done.cpu().numpy() if is_tensor(done) else done   # N flags to the host: which episodes end
        final = self._reader.final_obs(final_obs, next_cols, done, schema)
        skip = self._skip if self.reset_check is None else self.reset_check.reset_steps(   # next_step: reset steps
            self._skip, obs_cols, self._last_next, step_cols, final_obs, self.env_ids)
        if self.reset_check is None and self._inherited.any():   # checked writers checked them above
            skip = (skip & ~self._inherited) | inherited_resets(self._inherited, obs_cols, self._last_next, step_cols)
        self._check_chain(obs_cols, schema, ~skip)
        if self._sink.schema is None:
            self._sink.set_schema(schema)   # only once the whole step is known to be good
        commit_versions(self._versions if self._inplace is None else None, versions, self._sink)
        schema = self._sink.schema
        self._inherited[:] = False
        self._given_next = next_cols   # held, so that its memory is not reused before the next step
        if self._inplace is not None:
            return self._add_in_place(schema, obs_cols, next_cols, step_cols, final, done, skip, versions)
        with self.lock:
            return self._add_staged(schema, obs_cols, next_cols, step_cols, final, done, skip)

    def _add_staged(self, schema: Schema, obs_cols: dict, next_cols: dict, step_cols: dict, final: dict,
                    done: np.ndarray, skip: np.ndarray) -> int:
        active = ~skip if self.autoreset_mode == "next_step" else np.ones(self.num_envs, bool)
        if self._ships is not None:   # pieces of at most a quarter of a shard
            self._ships.cut_full(self)
        outgrown = self._outgrown(active)
        refused = self._refuse(outgrown) if len(outgrown) else None
        recorded = active & ~self._refused
        envs = np.flatnonzero(recorded)
        self._ensure_stage(schema, int(self._pos.max(initial=0)) + 2)
        pos = self._pos[envs]
        everyone = len(envs) == self.num_envs   # then array[envs] would only copy the step once more
        for cols in (obs_cols, step_cols):
            for name, (array, _) in cols.items():
                self._stage[name][envs, pos] = like_stage(array if everyone else array[envs], self._stage[name])
        ended = np.flatnonzero(done & recorded)
        for name, array in final.items() if len(ended) else ():   # most steps end no episode: ~8 us saved
            self._stage[name][ended, self._pos[ended] + 1] = like_stage(array[ended], self._stage[name])
        for name, (array, _) in next_cols.items():
            self._last_next[name][...] = array
        self._pos[envs] += 1
        if self._ships is not None:
            self._ships.staged()
        too_long = self._seal(ended, has_final=True)
        if self.autoreset_mode == "next_step":
            self._skip[...] = done & active
        self._refused &= ~(done & active)   # a refused episode's end: the env's next one is recorded
        self._sink.commit()
        if refused is not None:
            raise refused
        if too_long is not None:
            raise too_long
        return len(ended)

    def _add_in_place(self, schema: Schema, obs_cols: dict, next_cols: dict, step_cols: dict, final: dict,
                      done: np.ndarray, skip: np.ndarray, versions: np.ndarray | None) -> int:
        active = ~skip if self.autoreset_mode == "next_step" else np.ones(self.num_envs, bool)
        ended = self._inplace.add(schema, obs_cols, next_cols, step_cols,
                                  final if self.autoreset_mode == "same_step" and done.any() else None, done, active)
        commit_versions(self._versions, versions, self._sink)   # once written: a refused step writes nothing
        if self.autoreset_mode == "next_step":
            self._skip[...] = done & active
            if self._skip.any():
                # The reset check (and `EnvEnds`) compares an ended env's next step with its last next_obs;
                # in place no other copy of it is kept: keep the ended envs' (a row each, at episode ends only).
                envs = np.flatnonzero(self._skip)
                self._ensure_last_next(schema)
                for name, (array, _) in next_cols.items():
                    self._last_next[name][envs] = like_stage(array[envs], self._last_next[name])
        self.episodes_written += ended
        return ended

    def flush(self) -> int:
        """Cut every open episode; its final observation is the env's last ``next_obs``.

        Returns:
            The number of episodes sealed.

        Raises:
            RateLimited, CapacityError: the store refuses an episode; it is kept
                and pushed again by the next `add` or `flush`.
            WriterClosedError: the writer is closed.
        """
        self._check_open("flush")
        if self._inplace is not None:
            sealed = self._inplace.flush()
            self.episodes_written += sealed
            return sealed
        with self.lock:
            cut, too_long = self._cut_open()
        self._sink.flush()
        if too_long is not None:
            raise too_long
        return cut

    def _cut_open(self) -> tuple[int, CapacityError | None]:
        """`flush`'s cut, under `lock`: seal every open episode into the sink (and close those
        shipped with no step since); how many, and the error of one that can never fit."""
        self._push_pending()
        open_envs = np.flatnonzero(self._pos > 0)
        for name, last in self._last_next.items():
            self._stage[name][open_envs, self._pos[open_envs]] = last[open_envs]
        too_long = self._seal(open_envs, has_final=True)
        shipped = np.flatnonzero(self._first_step > 0)   # open pieces shipped, no step since: closed
        if len(shipped):
            self._sink.close_open([self.env_ids[i] for i in shipped.tolist()])
            self._first_step[shipped] = 0
        if self._ships is not None:
            self._ships.reset()
        self._refused[:] = False   # cut here: what comes next is a new episode, refused or not before
        self._push_pending()
        return len(open_envs), too_long

    def __del__(self) -> None:
        # A dropped writer keeps every step it wrote, cut as flush() cuts: in place by its regions' finalizer
        # (`arrowbuf.inplace`), staged locally by `EngineSink.write_dropped`, on Ray by `RaySink.dropped`'s thread.
        if self.__dict__.get("closed", True) or self.__dict__.get("_inplace") is not None:
            return
        if self.__dict__.get("_ships") is None:
            self._sink.write_dropped(self._cut_dropped)
        elif not self._sink.closed:
            self._cut_dropped()

    def _cut_dropped(self) -> None:
        """A dropped writer's `flush`: what the store refuses (a full fixed store, the rate limiter) is logged as lost."""
        too_long = None
        try:
            with self.lock:
                _, too_long = self._cut_open()
            self._sink.dropped()   # a Ray sink delivers on a thread of its own; a local one has written
        except (CapacityError, RateLimited):   # refused: it and the episodes after it stay pending
            pass
        except Exception:   # a finalizer cannot raise: say what became of the steps
            logger.exception("an arrowbuf writer was dropped without flush() or close(); cutting its %d open steps "
                             "failed, and they are lost", int(self._pos.sum()))
            return
        lost = [e.num_steps for e in self._pending] + self._pos[self._pos > 0].tolist()   # refused, or never cut
        if lost or too_long is not None:
            logger.warning("an arrowbuf writer was dropped without flush() or close(); the store refused %d of its "
                           "episodes (%d steps), and they are lost %s", len(lost), sum(lost), too_long or "")
        self._pending.clear()

    def close(self) -> None:
        """`flush` (cut every open episode), wait until the store holds them, and stop
        the sink's delivery thread (Ray). ``with store.writer(...) as w:`` calls it.

        Closing a closed writer does nothing; any other use of it raises `WriterClosedError`.

        Raises:
            What `flush` raises; a Ray writer also raises `ShardError` naming the
            episodes that no shard stored.
        """
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            if self._inplace is not None:
                self._inplace.release()
            if self._leave is not None:
                self._leave()   # this writer's episode ends, for the next writer of its envs
            self._sink.close()

    def __enter__(self) -> "StepWriter":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def take_open_pieces(self, min_steps: int = 1) -> list[Episode]:
        """The staged steps of each open episode with at least ``min_steps`` of them (and not
        refused) as pieces (`arrowbuf.piece_cutting`): owned copies, with the observation after
        the last step, ``first_step`` and ``open=True``. Their envs' staging starts over at row
        0 and their next piece starts where this one ends.

        The caller holds `lock` until the pieces are written to the sink, so that an
        episode's pieces reach it in order.
        """
        if int(self._pos.max(initial=0)) < min_steps:   # most steps: nothing to cut, in ~1 us
            return []
        pieces = []
        for i in np.flatnonzero((self._pos >= min_steps) & ~self._refused).tolist():
            steps = int(self._pos[i])
            for name, last in self._last_next.items():   # the observation after the last step
                self._stage[name][i, steps] = last[i]
            columns = {name: owned_copy(column) for name, column in self._columns(i, final=True).items()}
            pieces.append(Episode(columns, steps, True, self.env_ids[i], owned=True,
                                  first_step=int(self._first_step[i]), open=True))
            self._first_step[i] += steps
            self._pos[i] = 0
        return pieces

    # -- state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The open episodes, refused (pending) episodes and counters: JSON values
        and numpy arrays (copies). The sink is not part of it.

        Not thread-safe against a concurrent `add`: take it between steps (a Ray
        writer's delivery timer may run meanwhile).
        """
        if self._inplace is not None:
            schema = self._sink.schema
            state = self._inplace.state(schema) if schema is not None else \
                {"pos": np.zeros(self.num_envs, np.int64), "stage": {}, "last_next": {},
                 "first_step": np.zeros(self.num_envs, np.int64)}
            state["last_next"] = with_ended_rows(state["last_next"], self._skip, self._last_next)   # reset checks'
            return {"num_envs": self.num_envs, "autoreset_mode": self.autoreset_mode, "env_ids": list(self.env_ids),
                    "episodes_written": self.episodes_written, "skip": self._skip.copy(), "versions": self._versions.copy(),
                    "refused": self._refused.copy(), "check_resets": self.reset_check is not None, "pending": [],
                    **state}
        with self.lock:   # a Ray writer's timer may be cutting pieces
            return self._staged_state()

    def _staged_state(self) -> dict[str, Any]:
        steps = int(self._pos.max(initial=0))
        return {
            "num_envs": self.num_envs, "autoreset_mode": self.autoreset_mode, "env_ids": list(self.env_ids),
            "episodes_written": self.episodes_written, "pos": self._pos.copy(), "skip": self._skip.copy(),
            "refused": self._refused.copy(), "check_resets": self.reset_check is not None,
            "first_step": self._first_step.copy(), "versions": self._versions.copy(),   # first_step: after shipped pieces
            "stage": {name: host_copy(stage[:, :steps]) for name, stage in self._stage.items()},
            "last_next": {name: host_copy(last) for name, last in self._last_next.items()},
            "pending": [{"columns": {n: host_copy(a) for n, a in e.columns.items()}, "num_steps": e.num_steps,
                         "has_final": e.has_final, "env_id": e.env_id, "metadata": e.metadata,
                         "first_step": e.first_step} for e in self._pending],
            # A Ray sink's owner of the pieces shipped so far: a restored writer ends them.
            **({"shipping": self._sink.open_state()} if self._ships is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` into a writer of the same ``num_envs`` and mode, its sink of the schema it had.

        Raises:
            ValueError: another number of envs or autoreset mode, or staged data
                while the sink has no schema.
        """
        if int(state["num_envs"]) != self.num_envs or state["autoreset_mode"] != self.autoreset_mode:
            raise ValueError(f"writer state of {state['num_envs']} envs in mode {state['autoreset_mode']!r} cannot "
                             f"be loaded into a writer of {self.num_envs} envs in mode {self.autoreset_mode!r}")
        self._check_open("load_state_dict")
        self.env_ids[:] = list(state["env_ids"])
        self.episodes_written = int(state["episodes_written"])
        self._pos = np.array(state["pos"], np.int64)
        self._skip[...] = np.array(state["skip"], bool)
        self._refused = np.array(state.get("refused", np.zeros(self.num_envs, bool)), bool)   # older states lack it
        self._versions[...] = np.array(state.get("versions", self._versions), np.int64)   # each env's last policy_version
        if self._inplace is not None:
            if state["stage"] and self._sink.schema is None:
                raise ValueError("writer state holds staged steps but the store has no schema")
            if self._sink.schema is not None:
                self._inplace.load(self._pos, state["stage"], state["last_next"],
                                   np.array(state.get("first_step", np.zeros(self.num_envs, np.int64)), np.int64),
                                   state.get("regions"))
                ended = np.flatnonzero(self._skip & (self._pos == 0))
                if len(ended) and state["last_next"]:   # what the reset check compares the next step with
                    self._ensure_last_next(self._sink.schema)
                    for name, rows in state["last_next"].items():
                        self._last_next[name][ended] = staged(np.asarray(rows)[ended], self._sink.schema.fields[name],
                                                              self.device)
            self._pos[:] = 0
            for episode in state["pending"]:   # a staged writer's refused episodes: stored now
                self._sink.write(Episode({n: np.array(a) for n, a in episode["columns"].items()},
                                         int(episode["num_steps"]), bool(episode["has_final"]), episode["env_id"],
                                         episode["metadata"], owned=True))
            return
        self._first_step = np.array(state.get("first_step", np.zeros(self.num_envs, np.int64)), np.int64)
        if self._ships is not None and state.get("shipping") is not None:   # older states lack it
            self._sink.load_open_state(state["shipping"])
        self._stage = {}
        self._last_next.clear()
        if state["stage"]:
            schema = self._sink.schema
            if schema is None:
                raise ValueError("writer state holds staged steps but the store has no schema")
            steps = int(self._pos.max(initial=0))
            self._ensure_stage(schema, steps + 2)
            for name, stage in state["stage"].items():
                self._stage[name][:, :steps] = staged(stage, schema.fields[name], self.device)
            for name, last in state["last_next"].items():
                self._last_next[name][...] = staged(last, schema.fields[name], self.device)
        self._pending = [Episode({n: np.array(a) for n, a in e["columns"].items()}, int(e["num_steps"]),
                                 bool(e["has_final"]), e["env_id"], e["metadata"], owned=True,
                                 first_step=int(e.get("first_step", 0))) for e in state["pending"]]

    # -- internals -----------------------------------------------------------------

    def _outgrown(self, active: np.ndarray) -> np.ndarray:
        """Envs whose open episode this step would make too long for the store: more
        transitions than a shard holds."""
        capacity = self._sink.capacity
        if capacity is None or int(self._pos.max(initial=0)) + 1 <= capacity:   # the common case, in ~1 us
            return np.zeros(0, np.int64)
        return np.flatnonzero(active & ~self._refused & (self._pos + 1 > capacity))

    def _refuse(self, envs: np.ndarray) -> CapacityError:
        """Drop the open episodes of ``envs`` and skip the rest of them; the error that names them."""
        capacity = self._sink.capacity
        named = ", ".join(f"{self.env_ids[i]!r} (env {i}) at step {n + 1}"
                          for i, n in zip(envs.tolist(), self._pos[envs].tolist()))
        self._pos[envs] = 0
        self._refused[envs] = True
        return CapacityError(
            f"writer refused the open episode of {named}: it holds more transitions than the store's "
            f"capacity of {capacity:,}, so it can never be stored. Its staged steps are dropped and "
            "its remaining steps are skipped until it ends; the other envs' steps are recorded. Raise the "
            "capacity, or cut long episodes with flush()")

    def _ensure_stage(self, schema: Schema, steps: int) -> None:
        if self._stage:   # a column the store gained since (policy_version): 0 in the steps staged so far
            width = next(iter(self._stage.values())).shape[1]
            for name, f in writer_fields(schema).items():
                if name not in self._stage:
                    self._stage[name] = stage_zeros((self.num_envs, width, *f.shape), f, self.device, name)
        if not self._stage:
            for name, f in writer_fields(schema).items():
                self._stage[name] = stage_zeros((self.num_envs, max(64, steps), *f.shape), f, self.device, name)
            self._ensure_last_next(schema)
        capacity = next(iter(self._stage.values())).shape[1]
        if steps > capacity:
            new_capacity = max(steps, 2 * capacity)
            for name, stage in self._stage.items():
                grown = stage_zeros((self.num_envs, new_capacity) + stage.shape[2:], schema.fields[name], self.device, name)
                grown[:, :capacity] = stage
                self._stage[name] = grown

    def _ensure_last_next(self, schema: Schema) -> None:
        """`_last_next` holds a zeroed [N, ...] array of each observation field it lacks."""
        for name in schema.observation_names:
            if name not in self._last_next:
                self._last_next[name] = stage_zeros((self.num_envs, *schema.fields[name].shape),
                                                    schema.fields[name], self.device)

    def _inherit(self, schema: Schema, ends: dict[int, dict[str, Any]]) -> None:
        """Take the episode ends previous writers left for this writer's envs (`EnvEnds`)."""
        self._ensure_last_next(schema)
        for i, rows in ends.items():   # rows of every observation field: writers of one store share them
            for name, row in rows.items():
                self._last_next[name][i] = like_stage(row, self._last_next[name])[0]
            self._skip[i] = self._inherited[i] = True

    def _check_chain(self, obs_cols: dict, schema: Schema, recorded: np.ndarray) -> None:
        """Refuse a mid-episode ``obs`` other than the env's last ``next_obs`` (`check_obs_chain`)."""
        if self._given_next is not None and passed_on(obs_cols, self._given_next):   # the usual loop
            return
        if self._inplace is not None:
            envs, steps, previous = self._inplace.last_observations(recorded, obs_cols)
        else:
            envs = np.flatnonzero(recorded & ~self._refused & ((self._pos > 0) | (self._first_step > 0)))
            steps, previous = self._first_step[envs] + self._pos[envs], {n: a[envs] for n, a in self._last_next.items()}
        check_obs_chain(obs_cols, previous, envs, steps, self.env_ids, schema)

    def _check_open(self, verb: str) -> None:
        if self.closed:
            raise WriterClosedError(f"writer {self.name!r} is closed: {verb}() after close() (or after its `with` "
                                    "block) would write into rows the store has given to other writers, so nothing "
                                    "is written. Open a new writer with store.writer(...)")

    def _seal(self, envs: np.ndarray, has_final: bool) -> CapacityError | None:
        """Seal the open episodes of ``envs``; returns the error of one that can never fit."""
        too_long = None
        for i in envs:
            steps = int(self._pos[i])
            columns = self._columns(i, has_final)
            self._pos[i] = 0
            episode = Episode(columns, steps, has_final, self.env_ids[i], first_step=int(self._first_step[i]))
            self._first_step[i] = 0
            if self._pending:
                self._pending.append(owned_episode(episode))
                continue
            try:
                self._sink.write(episode)
                self.episodes_written += 1
            except CapacityError as err:
                if not err.retryable:
                    too_long = err
                    continue
                self._pending.append(owned_episode(episode))
            except RateLimited:
                self._pending.append(owned_episode(episode))
        return too_long

    def _columns(self, env: int, final: bool) -> dict[str, np.ndarray]:
        """Views of the staged rows of ``env``'s open episode, by field: its steps, and the
        observation after them when ``final`` (sealed or cut, an episode's rows are these)."""
        steps = int(self._pos[env])
        return {name: self._stage[name][env, :steps + (1 if f.observation and final else 0)]
                for name, f in writer_fields(self._sink.schema).items()}

    def _push_pending(self) -> None:
        while self._pending:
            self._sink.write(self._pending[0])
            self._pending.pop(0)
            self.episodes_written += 1
