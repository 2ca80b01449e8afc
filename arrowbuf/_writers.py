"""The step writers of one store, by name, so that checkpoints can save their open episodes.

Live writers are held weakly: a writer the user dropped is not saved. Writers
restored by `ExperienceStore.load` are held strongly until someone claims them
with ``store.writer(..., name=...)``, else their open episodes would vanish
before anyone could ask for them.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Mapping, Sequence

from arrowbuf._checks import check_int, check_name, default_env_ids
from arrowbuf.autoreset import EnvEnds, ResetCheck, writer_settings
from arrowbuf.episodes import StepWriter
from arrowbuf.errors import EmptyStoreError


class WriterRegistry:
    """Name -> `StepWriter` (and the sink the store made for it) of one store."""

    def __init__(self) -> None:
        self._live: weakref.WeakValueDictionary[str, StepWriter] = weakref.WeakValueDictionary()
        self._sinks: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._restored: dict[str, StepWriter] = {}
        self._serial = itertools.count()
        self.ends = EnvEnds()   # episode ends that next-step writers left for the next writer of their envs

    def new_name(self) -> str:
        """A name no live writer has: ``writer-<k>``."""
        while True:
            name = f"writer-{next(self._serial)}"
            if not self._is_open(name):
                return name

    def add(self, name: str, writer: StepWriter, sink: Any) -> None:
        """Track ``writer`` (and the ``sink`` the store made for it) under ``name``.

        Raises:
            ValueError: a live writer already has this name.
        """
        if self._is_open(name):
            raise ValueError(f"a writer named {name!r} is already open; writer names are unique per store "
                             f"(open: {sorted(self._live)})")
        self._live[name] = writer
        self._sinks[name] = sink

    def _is_open(self, name: str) -> bool:
        writer = self._live.get(name)
        return writer is not None and not writer.closed

    def hold(self, name: str) -> None:
        """Keep the (restored) writer ``name`` alive until `claim` hands it over."""
        self._restored[name] = self._live[name]

    def claim(self, name: str, num_envs: int, autoreset_mode: str,
              env_ids: Sequence[str] | None) -> tuple[StepWriter, Any] | None:
        """The restored writer ``name`` and its sink, handed over to the caller; None if there is none.

        Raises:
            ValueError: it was saved with another number of envs, mode or env ids.
        """
        writer = self._restored.get(name)
        if writer is None:
            return None
        if (writer.num_envs, writer.autoreset_mode) != (num_envs, autoreset_mode) or (
                env_ids is not None and list(env_ids) != writer.env_ids):
            raise ValueError(f"writer {name!r} was saved with num_envs={writer.num_envs}, "
                             f"autoreset_mode={writer.autoreset_mode!r}, env_ids={writer.env_ids}; "
                             f"asked for num_envs={num_envs}, autoreset_mode={autoreset_mode!r}, "
                             f"env_ids={env_ids}")
        del self._restored[name]
        return writer, self._sinks[name]

    def sinks(self) -> list[Any]:
        """The sinks of every writer still referenced, in name order."""
        return [sink for _, sink in sorted(self._sinks.items())]

    def live(self) -> dict[str, StepWriter]:
        """Every writer still referenced and not closed (or restored and not yet claimed), by name, in name order."""
        return {name: writer for name, writer in sorted(self._live.items()) if not writer.closed}

    def open(self, make_sink: Callable[[float | None, Sequence[str] | None], Any], num_envs: int | None,
             autoreset_mode: Any, env_ids: Sequence[str] | None, timeout: float | None, name: str | None,
             device: Any, env: Any = None) -> StepWriter:
        """The restored writer ``name`` if there is one (its sink now waits ``timeout``), else a
        new writer over ``make_sink(timeout, env_ids)`` (the store's backend), tracked by name.
        ``num_envs`` and ``autoreset_mode`` (None: not given, then checked) may come from
        ``env``, a gymnasium vector env (`arrowbuf.autoreset.writer_settings`)."""
        num_envs, autoreset_mode, check_resets = writer_settings(num_envs, autoreset_mode, env)
        num_envs = check_int("num_envs", num_envs, 1)
        claimed = self.claim(name, num_envs, autoreset_mode, env_ids) if name else None
        if claimed is not None:
            writer, sink = claimed
            sink.retime(timeout)
            return writer
        # The env ids the writer will have (its default ones too): a Ray store routes them now.
        sink = make_sink(timeout, list(env_ids) if env_ids is not None else default_env_ids(num_envs))
        name = name or self.new_name()
        writer = StepWriter(sink, num_envs, autoreset_mode, env_ids, device=device,
                            reset_check=ResetCheck() if check_resets else None, name=name, ends=self.ends)
        self.add(name, writer, sink)
        return writer

    def restore(self, states: Mapping[str, Any], make_sink: Callable[..., Any], device: Any) -> None:
        """Writers of a loaded checkpoint (states by name, checked as `ExperienceStore.writer`
        checks its arguments), held until claimed."""
        for name, state in states.items():
            num_envs = check_int("num_envs", int(state["num_envs"]), 1)
            mode = None if state.get("check_resets") else state["autoreset_mode"]   # None: checked, as saved
            # Its sink is made without env ids: it goes on by its saved routes (where its open pieces
            # are), and a Ray store's shares do not count it (`arrowbuf.ray.shares`).
            writer = self.open(lambda timeout, _: make_sink(timeout, None), num_envs, mode, state["env_ids"], None,
                               check_name(name), device)
            writer.load_state_dict(state)
            self.hold(name)

    def explain(self, err: EmptyStoreError) -> EmptyStoreError:
        """``err``, or when this process's writers hold open steps, an `EmptyStoreError`
        that says what they hold (``store.sample`` raises it instead, from None)."""
        held = {name: int(w.open_steps.sum()) for name, w in self.live().items()}
        held = {name: steps for name, steps in held.items() if steps}
        if not held:
            return err
        return EmptyStoreError(
            f"{err}. This process's writers hold {sum(held.values())} steps of open episodes "
            f"({', '.join(f'{n!r}: {k}' for n, k in held.items())}), which are stored when their episodes "
            "end (a Ray writer's also on its delivery timer): call writer.flush() to cut and store them now "
            "(e.g. at the end of a rollout), or sample once an episode has ended")

    def flush(self) -> None:
        """Send what the writers' sinks queued and wait for it (no-op for a local store's)."""
        for sink in self.sinks():
            sink.flush()
