"""Step records -> episodes: where segments end, and what each one stores.

A *record* is one env step as the seed keeps it: an EnvRet's fields (observation
o_t, ``last_reward`` r_{t-1}, ``last_terminated`` / ``last_truncated`` of the
previous action, ``_extra`` keys) merged with its PolicyResponse's (a_t and any
policy output, ``next_*`` keys included, stored as sent). A segment of records
s..k is T = k - s transitions: ``observation`` rows s..k (stored once, read back as
``observation`` and ``next_observation``), ``last_X`` rows s+1..k as ``X``, every
other field rows s..k-1; ``*info*`` keys are not stored.

Segments end only where the seed ends them: `Segmenter.truncate` (a truncation,
or the end of a rollout) and, with ``auto_truncate_episode``, a record whose
``last_terminated`` or ``last_truncated`` is set (per sub-env for vector envs,
found with numpy masks over the env axis). What a boundary stores depends on the
env's autoreset style, so that every env step's transition is stored exactly once:

- ``next_step`` (gymnasium's default): the record with the flag holds the terminal
  observation; it is the last of its episode. The next record of that sub-env is
  the reset (its ``last_reward`` is a dummy 0, it has no flags, and the action sent
  at the terminal observation is ignored by the env): the next episode starts
  there. Nothing real is dropped; the reset step is not a transition.
- ``same_step`` (IsaacLab / RSL-RL, ManiSkill, gymnasium < 1.0): the env resets
  inside the step that ended the episode; the record with the flag holds the *new*
  episode's first observation, and its action and the next record's reward are
  that episode's first transition. The ended episode keeps its last transition
  (reward, flags); its next observation is the terminal one from
  ``info["final_observation"]`` or ``info["final_obs"]`` (an ``[num_envs, ...]``
  array / tensor / dict of them, or an object array with None for sub-envs that
  did not end) when given. When not given (IsaacLab, RSL-RL) it is not known: the
  episode's final observation row repeats the last step's observation, so a
  time-out bootstraps from V(obs_t), RSL-RL's ``reward += gamma * V(obs_t) *
  time_out``, and the step field ``next_observation_valid`` is False there (True on
  every other step of an auto-truncated episode).

``autoreset_mode="auto"`` (the default) reads each boundary from the records: a
done record whose info carries a final observation is same-step (in every mode).
Without one, the sub-env's next record decides: a next-step reset carries a
reward of exactly 0 and no flags, so a nonzero reward or a flag there shows a
same-step env, and the env worker is read as same-step from then on (RLightning's
shipped WBC config, IsaacLab with ``info={}``, keeps every transition with no
setting). Until a worker has shown same-step resets, a boundary its next record
does not show (a reward of exactly 0, no flags) is read as next-step, and one a
rollout ends on (a truncation right after it) keeps its transition with its next
observation marked not known. ``"next_step"`` / ``"same_step"`` force one reading.

A segment that opens on a record with a flag (RSL-style rollouts re-add their
last EnvRet as the next rollout's first record) is read the same way: same-step,
a new episode opens there; next-step, that record is a terminal one, and the
episode starts at the reset after it.

Without ``auto_truncate_episode`` a segment is a rollout window (as in the seed):
flags are stored, nothing is cut, and at an internal reset the next observation
is whatever the env returned.

With a custom ``postprocess_fn`` the segment is handed to it as the seed does:
a dict of per-step lists (T+1 records; ``*info*`` values as sent, the rest converted by
``to_device`` (numpy -> torch on the storage device, uint16 -> bfloat16), with
the same-step terminal observation in the last record; every key it returns is
stored as a step field as returned (T rows each, ``next_*`` included).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from arrowbuf.compat.staging import FIRST_ROWS, Stage, split_record, to_column, to_device, to_tensor
from arrowbuf.schema import flatten, unflatten

AUTORESET_MODES = ("auto", "next_step", "same_step")
#: Step field of auto-truncated episodes: False where the step's next observation is not known.
VALID = "next_observation_valid"
_FINAL_KEYS = ("final_observation", "final_obs")
#: Runs of consecutive sub-envs of one worker whose episodes end together from one start row that go
#: to the store as one window (`Segmenter._window`, one ``add_episodes``), not an ``add_episode`` each.
_WINDOW_ENVS = 2


@dataclass
class Piece:
    """One episode ready for the store: flat columns (observation fields with T+1 rows)."""

    env_id: str
    columns: dict[str, Any]
    steps: int


@dataclass
class Window:
    """The episodes of a vector env's rollout window side by side: columns ``[T, num_envs, ...]``
    (what the seed's one ``postprocess_fn`` call per window returns); episode k is sub-env
    ``envs[k]`` under ``env_ids[k]``. `arrowbuf.compat.sink.StoreSink` writes it with one
    `ExperienceStore.add_episodes` call (no per-episode checks or slicing), or as its `pieces`."""

    env_ids: list[str]
    envs: list[int]
    columns: dict[str, Any]
    steps: int

    def pieces(self) -> list[Piece]:
        """One `Piece` per sub-env (views of the columns)."""
        return [Piece(env_id, {name: value[:, i] for name, value in self.columns.items()}, self.steps)
                for env_id, i in zip(self.env_ids, self.envs)]


def is_observation(name: str) -> bool:
    return name == "observation" or name.startswith("observation.")


def _field_of(name: str) -> str:
    return name[len("last_"):] if name.startswith("last_") else name


class Segmenter:
    """Open segments per env worker; hands back finished episodes as `Piece` s.

    Args:
        auto_truncate: end an episode at a record whose ``last_terminated`` or
            ``last_truncated`` is set.
        num_envs: env id -> its vector size (1: not vectorized).
        autoreset_mode: ``"auto"``, ``"next_step"`` or ``"same_step"`` (see the module docstring).
        postprocess_fn: the seed's hook, or None for no hook (the buffer's own path).
        device: the storage device the hook's tensors are put on.
        obs_preprocessor: applied to a same-step terminal observation from ``info``.
        stage_rows: env id -> the records its staging starts with room for (default `FIRST_ROWS`; it grows).

    Raises:
        ValueError: an unknown autoreset mode.
    """

    def __init__(self, auto_truncate: bool, num_envs: Callable[[str], int], autoreset_mode: str = "auto",
                 postprocess_fn: Callable | None = None, device: Any = "cpu",
                 obs_preprocessor: Callable[[Any], Any] | None = None,
                 stage_rows: Callable[[str], int] | None = None) -> None:
        if autoreset_mode not in AUTORESET_MODES:
            raise ValueError(f"autoreset_mode must be one of {AUTORESET_MODES}, got {autoreset_mode!r}")
        self.auto_truncate = auto_truncate
        self.autoreset_mode = autoreset_mode
        self._num_envs = num_envs
        self._postprocess_fn = postprocess_fn
        self._device = device
        self._obs_preprocessor = obs_preprocessor or (lambda obs: obs)
        self._stage_rows = stage_rows or (lambda env_id: FIRST_ROWS)
        self._stages: dict[str, Stage] = {}
        # Stages of envs with nothing open: their next segment reuses their (pre-faulted) columns,
        # a VLA rollout's ~0.8 GB, instead of growing fresh ones from 32 rows again.
        self._spare: dict[str, Stage] = {}
        self._same_step_envs: set[str] = set()   # env workers whose records showed same-step resets

    def open_envs(self) -> list[str]:
        return list(self._stages)

    def clear(self) -> None:
        self._spare.update(self._stages)
        self._stages.clear()

    def append(self, env_id: str, record: Mapping[str, Any]) -> list[Piece | Window]:
        """Stage one record; returns the episodes it ended (auto-truncate only).

        Raises:
            ValueError: a record that does not match the env's earlier ones, flags of
                the wrong shape, or a same-step terminal observation that is missing
                or malformed (the record is not kept).
        """
        stage = self._stages.get(env_id)
        if stage is None:
            n = self._num_envs(env_id)
            spare = self._spare.pop(env_id, None)
            stage = Stage(env_id, n, n > 1, reuse=spare if spare is not None and spare.num_envs == n else None,
                          same_step_seen=env_id in self._same_step_envs, first_rows=self._stage_rows(env_id))
            self._stages[env_id] = stage
        row = stage.write(*split_record(record))
        if not self.auto_truncate:
            return []
        info = record.get("info")
        given = _has_final(info)
        done = self._done(stage, row)
        try:   # every done sub-env with an open episode (or a boundary waiting for this record)
            ending = np.flatnonzero(done & ((stage.starts < row) | (stage.pending >= 0)))
            final = self._final_obs(stage, info, ending, row) if given and len(ending) else None
        except ValueError:
            stage.unwrite()   # the record is refused whole
            raise
        pieces = self._settle(stage, row)
        ended = np.flatnonzero(done & (stage.starts < row))
        opening = done & (stage.starts == row)
        if given:
            self._saw_same_step(stage)
        if given or self.autoreset_mode == "same_step" or (self.autoreset_mode == "auto" and stage.same_step_seen):
            # Same-step: this record starts the next episode; the ended one's last next observation
            # is the final one given, or not known.
            pieces += self._episodes(stage, ended, row, final, unknown=final is None)   # final: None or for all ended
            stage.start_at(ended, row)
        elif self.autoreset_mode == "next_step":
            # This record holds the terminal observation; the next episode starts at the reset after it.
            pieces += self._episodes(stage, ended, row, None)
            stage.start_at(ended, row + 1)
            stage.start_at(opening, row + 1)
        else:   # auto: read at this sub-env's next record (`_settle`)
            stage.defer(ended, row)
            stage.defer(opening, row)
        return pieces

    def _settle(self, stage: Stage, row: int) -> list[Piece]:
        """Read the boundaries left open at the previous record (``autoreset_mode="auto"``).

        A next-step reset record carries a dummy reward of exactly 0 and no flags; a
        reward or a flag on the record after a done one shows a real step, so a
        same-step env (the worker is then read as same-step from there on)."""
        waiting = np.flatnonzero(stage.pending >= 0)
        if not len(waiting):
            return []
        stepped = self._stepped(stage, row)[waiting]
        if stepped.any():
            self._saw_same_step(stage)
        same = stepped | stage.same_step_seen
        return self._close(stage, waiting, same)

    def _close(self, stage: Stage, envs: np.ndarray, same: np.ndarray) -> list[Piece]:
        """End the waiting episodes of ``envs``: same-step (the done record opens the next episode;
        the last next observation is not known) where ``same``, else next-step."""
        last = int(stage.pending[envs[0]])   # every waiting boundary is at the worker's previous record
        pieces = []
        for subset, is_same in ((envs[same], True), (envs[~same], False)):
            if len(subset):
                pieces += self._episodes(stage, subset, last, None, unknown=is_same)
                stage.start_at(subset, last if is_same else last + 1)
        stage.settle(envs)
        return pieces

    def _saw_same_step(self, stage: Stage) -> None:
        stage.saw_same_step()
        self._same_step_envs.add(stage.env_id)

    @staticmethod
    def _stepped(stage: Stage, row: int) -> np.ndarray:
        """Per sub-env: the record at ``row`` carries a nonzero reward or a done flag."""
        out = np.zeros(stage.num_envs, bool)
        for name in stage.columns:
            top = name.split(".", 1)[0]
            if top in ("last_terminated", "last_truncated") or (top.startswith("last_") and "reward" in top):
                out |= stage.row(name, row).reshape(stage.num_envs, -1).astype(bool).any(axis=1)
        return out

    def truncate(self, env_id: str) -> list[Piece | Window]:
        """End the open episode(s) of ``env_id`` (or of one sub-env ``"<env_id>/<i>"``).

        Nothing open is not an error (the seed raised KeyError right after an
        automatic truncation).
        """
        stage = self._stages.pop(env_id, None)
        if stage is not None:   # its pieces are views of it: written before its next record reuses it
            self._spare[env_id] = stage
            last = stage.rows - 1
            # A boundary still waiting is at this last record: no record after it tells whether its
            # observation was terminal, so the ended episode's last next observation is not known.
            return self._episodes(stage, np.arange(stage.num_envs), last, None,
                                  unknown=stage.pending >= 0) if last >= 0 else []
        parent, _, index = env_id.rpartition("/")
        stage = self._stages.get(parent)
        if stage is None or not stage.vector or not index.isdigit() or int(index) >= stage.num_envs:
            return []
        i = np.array([int(index)])
        pieces = self._episodes(stage, i, stage.rows - 1, None, unknown=stage.pending[i] >= 0)
        stage.start_at(i, stage.rows)
        stage.settle(i)
        return pieces

    # -- boundaries ---------------------------------------------------------------------

    @staticmethod
    def _done(stage: Stage, row: int) -> np.ndarray:
        done = np.zeros(stage.num_envs, bool)
        for name in stage.columns:
            if name.split(".", 1)[0] in ("last_terminated", "last_truncated"):   # multi-agent: any agent's flag
                done |= stage.row(name, row).reshape(stage.num_envs, -1).any(axis=1)
        return done

    def _final_obs(self, stage: Stage, info: Any, ended: np.ndarray, row: int) -> dict[str, np.ndarray]:
        """The terminal observations ``info`` gives for the ended sub-envs (``[num_envs, ...]`` per field)."""
        given = next(info[key] for key in _FINAL_KEYS if info.get(key) is not None)
        names = [name for name in stage.columns if is_observation(name)]
        out = {name: stage.row(name, row).copy() for name in names}
        if stage.vector and isinstance(given, np.ndarray) and given.dtype == object:
            for i in ended:
                if given[i] is None:
                    raise ValueError(f"env {stage.env_id!r}: sub-env {int(i)} ended but info's final observation "
                                     "for it is None")
                self._fill(out, self._obs_columns(stage, given[i], f"final observation of sub-env {int(i)}"), i)
            return out
        columns = self._obs_columns(stage, given, "info's final observation")
        for name, array in columns.items():
            if stage.vector and (array.ndim == 0 or array.shape[0] != stage.num_envs):
                raise ValueError(f"env {stage.env_id!r}: final observation field {name!r} has shape {array.shape}, "
                                 f"expected ({stage.num_envs}, ...) (or an object array of per-env entries)")
            out[name][ended] = array[ended] if stage.vector else array
        return out

    def _obs_columns(self, stage: Stage, obs: Any, what: str) -> dict[str, np.ndarray]:
        flat = flatten({"observation": self._obs_preprocessor(obs)})
        names = {name for name in stage.columns if is_observation(name)}
        if flat.keys() != names:
            raise ValueError(f"env {stage.env_id!r}: {what} has fields {sorted(flat)}, expected {sorted(names)}")
        return {name: to_column(value, name)[0] for name, value in flat.items()}

    @staticmethod
    def _fill(out: dict[str, np.ndarray], columns: dict[str, np.ndarray], i: int) -> None:
        for name, array in columns.items():
            out[name][i] = array

    # -- episodes -----------------------------------------------------------------------

    def _episodes(self, stage: Stage, envs: np.ndarray, last: int, final: dict | None,
                  unknown: bool | np.ndarray = False) -> list[Piece | Window]:
        """Episodes of sub-envs ``envs``, from their start row to record ``last``.

        ``unknown`` (one bool, or one per env of ``envs``): the last transition's next
        observation is not known (a same-step reset without a final observation). Its
        final observation row then repeats the last step's observation (so a time-out
        bootstraps from V(obs_t), RSL-RL's rule) and ``next_observation_valid`` is False
        there; every episode cut with auto-truncation carries that column."""
        starts = stage.starts[envs]
        unknown = np.broadcast_to(np.asarray(unknown, bool), envs.shape)
        keep = starts < last
        envs, starts, unknown = envs[keep], starts[keep], unknown[keep]
        if not len(envs):
            return []
        ids = [f"{stage.env_id}/{i}" if stage.vector else stage.env_id for i in envs]
        if self._postprocess_fn is not None:
            return self._processed(stage, envs, starts, last, final, ids, unknown)
        names = list(stage.columns)
        fields = [_field_of(name) for name in names]
        if len(set(fields)) != len(fields):
            clash = sorted({f for f in fields if fields.count(f) > 1})
            raise ValueError(f"env {stage.env_id!r}: fields {clash} come from two keys each (e.g. 'reward' and "
                             "'last_reward'); rename one of them")
        # Runs of consecutive sub-envs whose episodes start at one row: one window each (one
        # `add_episodes`), in sub-env order as the pieces would be (ids, evictions, a fixed buffer's fill).
        cuts = (np.flatnonzero((np.diff(envs) != 1) | (np.diff(starts) != 0)) + 1).tolist() if stage.vector else []
        pieces: list[Piece | Window] = []
        for a, b in zip([0, *cuts], [*cuts, len(envs)]):
            runs = [(a, b)] if b - a >= _WINDOW_ENVS else [(k, k + 1) for k in range(a, b)]
            for i, j in runs:   # a single sub-env goes as its one piece (`add_episode`)
                window = self._window(stage, int(envs[i]), j - i, int(starts[i]), last, final, unknown[i:j],
                                      ids[i:j], names, fields)
                pieces += [window] if j - i > 1 else window.pieces()
        return pieces

    @staticmethod
    def _window(stage: Stage, first: int, count: int, s: int, last: int, final: dict | None, unknown: np.ndarray,
                ids: list[str], names: list[str], fields: list[str]) -> Window:
        """The episodes of sub-envs ``first .. first + count - 1``, all from row ``s`` to record ``last``,
        as one `Window` of columns ``[T, count, ...]``: views of the stage, but for observation
        fields whose last row takes a final observation or repeats the one before (copies)."""
        envs = slice(first, first + count)
        blind = np.flatnonzero(unknown)
        given = np.flatnonzero(~unknown) if final is not None else blind[:0]
        base, steps = stage.base, last - s
        columns = {}
        for name, field in zip(names, fields):
            if is_observation(name):
                a, b = s, last + 1
            elif name.startswith("last_"):
                a, b = s + 1, last + 1
            else:
                a, b = s, last
            block = stage.columns[name][a - base:b - base, envs]
            if is_observation(name) and (len(blind) or len(given)):
                block = block.copy()
                block[-1, blind] = block[-2, blind]   # not known: the last step's observation again
                if len(given):
                    block[-1, given] = final[name][first + given]
            columns[field] = to_tensor(block, "bfloat16", False) if stage.dtypes[name] == "bfloat16" else block
        valid = np.ones((steps, count), bool)
        valid[-1] = ~unknown
        columns[VALID] = valid
        return Window(ids, list(range(count)), columns, steps)

    def _processed(self, stage: Stage, envs: np.ndarray, starts: np.ndarray, last: int, final: dict | None,
                   ids: list[str], unknown: np.ndarray) -> list[Piece | Window]:
        """Segments through the user's ``postprocess_fn``, as the seed calls it."""
        if not self.auto_truncate and stage.vector and (starts == starts[0]).all():
            # The seed's vector-env window: one call on [T+1] records of [num_envs, ...] values.
            block = {name: stage.columns[name][starts[0] - stage.base:last + 1 - stage.base] for name in stage.columns}
            out = self._call_hook(stage, block, int(starts[0]), last)
            steps = self._length(out, stage.env_id, stage.num_envs)
            return [Window(ids, envs.tolist(), out, steps)]
        pieces = []
        for env_id, i, s, blind in zip(ids, envs.tolist(), starts.tolist(), unknown.tolist()):
            block = {name: stage.rows_of(name, s, last + 1, i) for name in stage.columns}
            if blind:   # the hook gets the last step's observation again as the unknown terminal one
                block.update({name: np.concatenate([block[name][:-1], block[name][-2:-1]])
                              for name in block if is_observation(name)})
            elif final is not None:
                block.update({name: np.concatenate([block[name][:-1], final[name][i][None]]) for name in final})
            out = self._call_hook(stage, block, s, last)
            pieces.append(Piece(env_id, out, self._length(out, env_id, None)))
        return pieces

    def _call_hook(self, stage: Stage, block: dict[str, np.ndarray], first: int, last: int) -> dict[str, Any]:
        tensors = {name: to_device(to_tensor(column, stage.dtypes[name]), self._device)
                   for name, column in block.items()}
        buffer: dict[str, list[Any]] = {}
        for top, value in unflatten(tensors).items():
            buffer[top] = _per_step(value)
        infos = stage.infos[first - stage.base:last + 1 - stage.base]
        for key in infos[0] if infos else ():
            buffer[key] = [info.get(key) for info in infos]
        result = self._postprocess_fn(buffer)
        if isinstance(result, TensorDictBase):
            result = result.to_dict()
        if not isinstance(result, Mapping):
            raise ValueError(f"postprocess_fn returned {type(result).__name__}; expected a dict of per-step "
                             "tensors (T rows each)")
        return flatten(result)

    @staticmethod
    def _length(columns: Mapping[str, Any], env_id: str, num_envs: int | None) -> int:
        """The rows every returned field has (and ``num_envs`` as its second dim for a vector window).

        Raises:
            ValueError: fields of different lengths, naming them.
        """
        # A list of T values (a ragged field's sequences, a text field's str: `arrowbuf.ragged`,
        # `arrowbuf.text`) has T rows too.
        shapes = {name: tuple(value.shape) if hasattr(value, "shape") else _list_shape(value)
                  for name, value in columns.items()}
        bad = {name: shape for name, shape in shapes.items()
               if shape is None or not shape or (num_envs is not None and (len(shape) < 2 or shape[1] != num_envs))}
        if bad:
            expected = f"[T, {num_envs}, ...]" if num_envs is not None else "[T, ...]"
            raise ValueError(f"env {env_id!r}: postprocess_fn returned fields of shapes {bad}; expected {expected} "
                             "arrays or tensors")
        lengths = {shape[0] for shape in shapes.values()}
        if len(lengths) > 1:
            raise ValueError(f"env {env_id!r}: postprocess_fn returned fields of different lengths {shapes}; "
                             "every field of an episode needs the same number of rows")
        return lengths.pop() if lengths else 0


def _has_final(info: Any) -> bool:
    return isinstance(info, Mapping) and any(info.get(key) is not None for key in _FINAL_KEYS)


def _per_step(value: Any) -> list[Any]:
    """A stacked value (or nested dict of them) -> its list of per-step values."""
    if isinstance(value, Mapping):
        keys = list(value)
        steps = list(zip(*(_per_step(value[key]) for key in keys)))
        return [dict(zip(keys, step)) for step in steps]
    return list(torch.unbind(value, 0))


def _list_shape(value: Any) -> tuple[int, ...] | None:
    """(T,) of a non-empty list of T steps' values; None for others (a vector window's fields are
    ``[T, num_envs, ...]`` arrays or tensors)."""
    return (len(value),) if isinstance(value, (list, tuple)) and value else None
