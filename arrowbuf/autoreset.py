"""Gymnasium autoreset modes: read from a vector env, and checked as steps arrive.

A gymnasium 1.x vector env says how it resets an env whose episode ended, in
``env.metadata["autoreset_mode"]`` (a ``gymnasium.vector.AutoresetMode``):

- ``NEXT_STEP`` (gymnasium's default): the step after the end only resets that env;
  it returns the new episode's first observation with reward 0 and no flags. It is
  no transition, and a `arrowbuf.StepWriter` does not store it.
- ``SAME_STEP``: the env resets within the ending step; ``next_obs`` is already the
  new episode's first observation and ``info["final_obs"]`` the final one.
- ``DISABLED``: the user resets ended envs (``env.reset(options={"reset_mask": done})``);
  every step is a transition.

`writer_settings` resolves what ``store.writer(...)`` was given (a vector env, a
mode, both or neither). A writer given no mode keeps gymnasium's default,
``"next_step"``, and checks it with a `ResetCheck` wherever it would drop a step
as a reset step (the one hook, in `arrowbuf.StepWriter.add`):

- that step's ``obs`` differs from the env's last ``next_obs``: the user reset the
  env (disabled mode), so the step is a transition and is kept;
- it carries a nonzero reward or a done flag, or ``final_obs`` is passed: the env
  did not reset in the next step, and the writer raises `AutoresetModeError`
  naming the modes and how to choose one, before recording anything of the step.

So a writer never drops a step silently: it drops only steps that look exactly
like gymnasium's next-step reset steps.

A writer that ends (closed, or dropped) leaves its next-step envs' episode ends in
the store's `EnvEnds`, by env id: a new writer per rollout takes them at its first
step and drops gymnasium's reset step of an env whose episode ended on the previous
rollout's last step, as one writer across rollouts (with ``flush()``) drops it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from arrowbuf.stage_arrays import host_copy, owned_copy
from arrowbuf.errors import ArrowbufError

#: gymnasium's ``AutoresetMode`` values -> the writer's mode names.
GYMNASIUM_MODES = {"NextStep": "next_step", "SameStep": "same_step", "Disabled": "disabled"}
#: Step fields a next-step reset step holds as zeros (gymnasium sets them so).
ZERO_ON_RESET = ("reward", "terminated", "truncated")
_HOW_TO_CHOOSE = ("pass the vector env, store.writer(env=envs), which reads envs.metadata['autoreset_mode'], "
                  "or the mode, store.writer(num_envs, autoreset_mode='same_step' | 'next_step' | 'disabled') "
                  "(gymnasium's AutoresetMode.SAME_STEP / NEXT_STEP / DISABLED)")


class AutoresetModeError(ArrowbufError, ValueError):
    """Steps that contradict the writer's autoreset mode (nothing of the step is recorded)."""


def writer_settings(num_envs: Any, autoreset_mode: Any, env: Any) -> tuple[Any, str, bool]:
    """(num_envs, mode, checked) of a writer: ``checked`` when no mode was given or read.

    Args:
        num_envs: the writer's envs, or None to read ``env.num_envs``.
        autoreset_mode: a mode name, a ``gymnasium.vector.AutoresetMode``, or None.
        env: a gymnasium vector env, or None.

    Raises:
        ValueError: neither ``num_envs`` nor ``env``; an ``env`` that is no vector env;
            a ``num_envs`` or mode that contradicts the env's; an unknown mode.
    """
    mode = _mode_name(autoreset_mode, "autoreset_mode")
    if env is None:
        if num_envs is None:
            raise ValueError("writer needs num_envs (an int >= 1) or env (a gymnasium vector env), got neither")
        return num_envs, mode or "next_step", mode is None
    env_envs = getattr(env, "num_envs", None)
    if not isinstance(env_envs, (int, np.integer)) or isinstance(env_envs, bool):
        raise ValueError(f"env must be a gymnasium vector env (with num_envs and metadata['autoreset_mode']), "
                         f"got {type(env).__name__}; for single envs pass num_envs=1 and the mode")
    if num_envs is not None and num_envs != env_envs:
        raise ValueError(f"num_envs={num_envs!r} contradicts env.num_envs={env_envs}; pass one of them")
    metadata = getattr(env, "metadata", None) or {}
    env_mode = _mode_name(metadata.get("autoreset_mode"), "env.metadata['autoreset_mode']")
    if mode is not None and env_mode is not None and mode != env_mode:
        raise ValueError(f"autoreset_mode={mode!r} contradicts the env's {metadata['autoreset_mode']!r}; "
                         "pass one of them")
    mode = mode or env_mode
    return int(env_envs), mode or "next_step", mode is None


class ResetCheck:
    """Checks a writer's unconfirmed ``"next_step"`` mode at each step it would drop.

    One per writer given no mode; stateless apart from counting what it saw (for
    the writer's users and tests): ``kept`` steps it found were user resets, and
    ``dropped`` next-step reset steps.
    """

    def __init__(self) -> None:
        self.kept = 0
        self.dropped = 0

    def reset_steps(self, skip: np.ndarray, obs: dict, last_next: dict, step: dict, final_obs: Any,
                    env_ids: list[str]) -> np.ndarray:
        """Of the envs whose step the writer would drop as a next-step reset (``skip``),
        those whose step is one; the others' steps are kept (the user reset them).

        Args:
            skip: [N] bool, envs whose previous step ended an episode.
            obs, last_next: the step's observation columns, name -> (array, dtype name), and
                each env's last ``next_obs``, name -> array ([N, ...] arrays or tensors).
            step: the step's other columns, name -> (array, dtype name).
            final_obs: what the step passed as ``final_obs`` (None in next-step mode).
            env_ids: the writer's env ids, for the error.

        Raises:
            AutoresetModeError: ``final_obs`` was passed, or a step that looks like a
                reset (same observation) carries a reward or a done flag.
        """
        if final_obs is not None:
            raise AutoresetModeError(
                "writer got final_obs, which only envs that reset in the same step give (info['final_obs']), but "
                "it was given no autoreset_mode and assumed gymnasium's default 'next_step'. Choose the mode: "
                + _HOW_TO_CHOOSE)
        if not skip.any():
            return skip
        envs = np.flatnonzero(skip)
        same = np.ones(len(envs), bool)
        for name, (column, _) in obs.items():
            if name in last_next:   # absent only in a writer restored at an episode's end: gymnasium's default
                same &= _rows_equal(column, last_next[name], envs)
        looks_reset = envs[same]
        wrong = np.zeros(len(looks_reset), bool)
        zero_on_reset = [column for name, (column, _) in step.items() if name.split(".")[0] in ZERO_ON_RESET]
        for column in zero_on_reset if len(looks_reset) else ():
            wrong |= _nonzero(column, looks_reset)
        if wrong.any():
            i = int(looks_reset[np.flatnonzero(wrong)[0]])
            raise AutoresetModeError(
                f"env {env_ids[i]!r} (env {i}): the step after its episode ended starts from the episode's last "
                "next_obs, but carries a reward or a done flag, so it is a real transition: the env did not reset "
                "in that step, as gymnasium's default autoreset_mode 'next_step' (which the writer assumed, given "
                "no mode) does. If the env resets in the same step (AutoresetMode.SAME_STEP), or you reset it "
                "yourself (DISABLED), say so: " + _HOW_TO_CHOOSE + ". Nothing of this step was recorded.")
        resets = np.zeros_like(skip)
        resets[looks_reset] = True
        self.kept += len(envs) - len(looks_reset)
        self.dropped += len(looks_reset)
        return resets


class EnvEnds:
    """The episode ends that next-step writers of one store left, by env id.

    An env whose last step ended its episode (in ``"next_step"`` mode) steps next into
    gymnasium's reset step, which is no transition. A writer that ends before it
    (closed, or dropped: a new writer per rollout) leaves here the env's final
    observation (its last ``next_obs``); a writer of the same env id takes it at its
    first step (`inherited_resets`). Entries are host or device copies, one row each.
    """

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Any]] = {}

    def leave(self, env_ids: list[str], ended: np.ndarray, last_next: dict) -> None:
        """A writer of ``env_ids`` ends; the envs ``ended`` ([N] bool) ended their episode
        at their last step, with final observations in ``last_next`` (name -> [N, ...])."""
        for i, env_id in enumerate(env_ids):
            self._rows.pop(env_id, None)
            if ended[i] and last_next:
                self._rows[env_id] = {name: owned_copy(array[i:i + 1]) for name, array in last_next.items()}

    def take(self, env_ids: list[str]) -> dict[int, dict[str, Any]]:
        """The ends left for ``env_ids``, by env index (each name -> a [1, ...] row); taken."""
        return {i: self._rows.pop(env_id) for i, env_id in enumerate(env_ids) if env_id in self._rows}


def with_ended_rows(saved: dict, skip: np.ndarray, last_next: dict) -> dict:
    """A writer state's ``last_next`` (``saved``: rows after each open piece, or {}) with the final
    observations of the envs ``skip`` holds ended, which the reset check compares their next step
    with (host copies, [N, ...] arrays)."""
    ended = np.flatnonzero(skip)
    if not len(ended) or not last_next:
        return saved
    saved = saved or {name: np.zeros(array.shape, host_copy(array[:1]).dtype) for name, array in last_next.items()}
    for name, kept in last_next.items():
        saved[name][ended] = host_copy(kept[ended])
    return saved


def inherited_resets(inherited: np.ndarray, obs: dict, last_next: dict, step: dict) -> np.ndarray:
    """Of the envs ``inherited`` (their episode ended at a previous writer's last step),
    those whose step is gymnasium's reset step: it starts from that final observation
    and carries no reward and no done flag. Others are transitions (the user reset the
    env before this writer's first step, or the env is another one of the same id)."""
    envs = np.flatnonzero(inherited)
    resets = np.zeros_like(inherited)
    if not len(envs):
        return resets
    same = np.ones(len(envs), bool)
    for name, (column, _) in obs.items():
        same &= _rows_equal(column, last_next[name], envs) if name in last_next else False
    for name, (column, _) in step.items():
        if name.split(".")[0] in ZERO_ON_RESET:
            same &= ~_nonzero(column, envs)
    resets[envs[same]] = True
    return resets


def _mode_name(mode: Any, what: str) -> str | None:
    """A writer mode name from a name, a gymnasium ``AutoresetMode`` (or its value), or None."""
    if mode is None:
        return None
    value = getattr(mode, "value", mode)
    if isinstance(value, str) and value in GYMNASIUM_MODES:
        return GYMNASIUM_MODES[value]
    if isinstance(value, str) and value in GYMNASIUM_MODES.values():
        return value
    raise ValueError(f"{what} must be one of {tuple(GYMNASIUM_MODES.values())} or a gymnasium AutoresetMode, "
                     f"got {mode!r}")


def _rows_equal(column: Any, last: Any, envs: np.ndarray) -> np.ndarray:
    """Per env of ``envs``: its row of ``column`` equals its row of ``last`` (arrays or tensors)."""
    a, b = column[envs], last[envs]
    # Compared in the staged dtype: a float64 obs equals its float32 copy only once cast.
    a = a.astype(b.dtype, copy=False) if isinstance(a, np.ndarray) else a.to(b.dtype)
    return same_rows(a, b)


def same_rows(a: Any, b: Any) -> np.ndarray:
    """Per row (leading dim): the rows of ``a`` and ``b`` (arrays or tensors of one dtype) are
    equal, NaN equal to NaN (a NaN in an observation must not make it differ from its copy)."""
    differs = a != b
    if isinstance(differs, np.ndarray):
        if differs.any() and a.dtype.kind in "fc":
            differs &= ~(np.isnan(a) & np.isnan(b))
        return ~differs.reshape(len(a), -1).any(axis=1)
    if a.is_floating_point() or a.is_complex():   # torch, on the staging device: N flags to the host
        differs &= ~(a.isnan() & b.isnan())
    return ~differs.reshape(len(a), -1).any(1).cpu().numpy()


def _nonzero(column: Any, envs: np.ndarray) -> np.ndarray:
    """Per env of ``envs``: any nonzero value in its row of ``column``."""
    rows = column[envs].reshape(len(envs), -1)
    if not isinstance(rows, np.ndarray):
        return (rows != 0).any(1).cpu().numpy()
    return (rows != 0).any(axis=1)
