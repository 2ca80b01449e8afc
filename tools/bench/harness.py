"""The measuring harness: options, the workload registry, interleaved timing, and
`compare`, the one path from interleaved rounds to ratios to metrics.

Every performance claim is a *ratio measured in the same run*: the machine is
shared and noisy, so absolute numbers drift while paired ratios hold. In each
timing round the contenders take turns in short slices (rotating order), a ratio
is taken per round, and the median over rounds is reported with its min-max range.
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .results import Metric, Series, WorkloadResult, speedup

NOISY = 1.4   # max/min of a ratio over rounds above which a result is flagged


@dataclass
class Options:
    """How a run measures (from the command line)."""

    quick: bool
    rounds: int
    min_time: float        # seconds per contender per round
    slices: int            # turns per round (see `interleaved_rates`)
    memory: bool
    profile: bool
    device: str | None = None   # torch device of the torch-arena contenders (None: cuda if available, else cpu)
    mix_dataset_gb: float | None = None   # MIX: also sample a dataset of this many GB (`big_dataset`)
    mix_dataset_dir: str | None = None    # where that dataset is built once and kept
    smoke: bool = False    # the smoke specs (tests): every code path at the smallest sizes, nothing worth reading

    def torch_device(self) -> str:
        """The torch device the torch-arena (``storage_device``) contenders use."""
        if self.device:
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Workload:
    """A registered benchmark: ``run(spec, opts)`` with the full, the quick or the smoke spec.

    ``smoke`` (default: the quick spec) is for the tests, which check that a run completes
    and reports, never what it measures: sizes where the fills and the memory probes'
    child processes take seconds, not the quick spec's tens of seconds on a loaded CI box.
    """

    name: str
    help: str
    full: Any
    quick: Any
    run: Callable[[Any, Options], WorkloadResult]
    # Hidden child-process entry for per-contender memory probes (None: no probe).
    probe: Callable[[Any, str], dict] | None = None
    smoke: Any = None

    def spec(self, quick: bool, smoke: bool = False) -> Any:
        if smoke and self.smoke is not None:
            return self.smoke
        return self.quick if quick or smoke else self.full


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    """Add a workload to `WORKLOADS` (in the order the run and ``--list`` show them)."""
    if workload.name in WORKLOADS:
        raise ValueError(f"workload {workload.name!r} registered twice")
    WORKLOADS[workload.name] = workload
    return workload


def log(message: str) -> None:
    """Progress on stderr (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def rotated(items: Sequence[str], k: int) -> list[str]:
    """``items`` rotated left by ``k``: round k's turn order."""
    k %= max(len(items), 1)
    return list(items[k:]) + list(items[:k])


def units_of(units: float | Mapping[str, float], name: str) -> float:
    """Units of one call of contender ``name``: ``units``, or its entry when it maps contenders to units."""
    return units[name] if isinstance(units, Mapping) else units


def interleaved_rates(fns: Mapping[str, Callable[[], Any]], min_time: float, slices: int,
                      units: float | Mapping[str, float] = 1.0, order_seed: int = 0,
                      finish: Mapping[str, Callable[[], Any]] | None = None) -> dict[str, float]:
    """Throughput of each function (calls x ``units`` per second), measured in turns.

    ``units`` is one number for all, or one per function (contenders whose calls do
    different amounts of work, e.g. one episode against a batch of K).

    Each function runs for ``slices`` slices of ``min_time / slices`` seconds (at
    least one call each), the functions taking turns in a rotating order, so that
    load from other processes hits all of them alike and their ratio holds.
    ``finish[name]``, where given, runs (timed) at the end of each of that
    function's slices: it waits for work the calls left in flight (a flush, the
    prefetched requests of a pipelined sampler) so that no slice is charged for
    another one's work.
    """
    names = list(fns)
    calls = dict.fromkeys(names, 0)
    spent = dict.fromkeys(names, 0.0)
    slice_time = min_time / slices
    gc.collect()
    for s in range(slices):
        for name in rotated(names, order_seed + s):
            fn = fns[name]
            n = 0
            start = time.perf_counter()
            while True:
                fn()
                n += 1
                elapsed = time.perf_counter() - start
                if elapsed >= slice_time:
                    break
            if finish is not None and name in finish:
                finish[name]()
                elapsed = time.perf_counter() - start
            calls[name] += n
            spent[name] += elapsed
    return {name: calls[name] * units_of(units, name) / spent[name] for name in names}


def interleaved_times(fns: Mapping[str, Callable[[], Any]], min_time: float, slices: int,
                      order_seed: int = 0, self_timed: bool = False) -> dict[str, float]:
    """Median seconds per call of each function, measured in turns as in `interleaved_rates`.

    With ``self_timed`` each call returns the seconds of the part of it that counts
    (a call that must set up or clean up around what it measures).
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    slice_time = min_time / slices
    clock = time.perf_counter
    gc.collect()
    for s in range(slices):
        for name in rotated(names, order_seed + s):
            fn, out = fns[name], times[name]
            end = clock() + slice_time
            while True:
                start = clock()
                seconds = fn()
                stop = clock()
                out.append(seconds if self_timed else stop - start)
                if stop >= end:
                    break
    return {name: statistics.median(values) for name, values in times.items()}


def over(numerator: str, *denominators: str) -> dict[str, tuple[str, str]]:
    """Ratio columns ``"a/b"`` of contender ``numerator`` over each denominator."""
    return {f"{numerator}/{d}": (numerator, d) for d in denominators}


def at_least(ratio: str, threshold: float) -> Callable[[Metric], bool]:
    """A goal: the median of ``ratio`` is at least ``threshold``."""
    return lambda metric: metric.ratios[ratio].median >= threshold


@dataclass
class Race:
    """One interleaved comparison, timed every round and reported as one metric.

    ``fns`` are the contenders' calls. A rate race reports calls x ``units`` per
    second (``units``: one number, or a mapping with one per contender) (``finish`` as in `interleaved_rates`); a ``per_call`` race reports the
    median time of one call, in seconds x ``scale`` (1e3: ms). ``self_timed``
    calls return their own seconds (see `interleaved_times`); a self-timed rate
    race reports ``units`` / the median call. ``ratios`` maps a column name to
    (a, b): the per-round speed-up of a over b (> 1: a is faster).
    """

    metric: str
    unit: str
    fns: Mapping[str, Callable[[], Any]]
    ratios: Mapping[str, tuple[str, str]]
    target: str = ""
    goal: Callable[[Metric], bool] | None = None
    units: float | Mapping[str, float] = 1.0
    finish: Mapping[str, Callable[[], Any]] | None = None
    per_call: bool = False
    scale: float = 1.0
    self_timed: bool = False

    def measure(self, order_seed: int, min_time: float, slices: int) -> dict[str, float]:
        """One round: each contender's rate or time."""
        if not (self.per_call or self.self_timed):
            return interleaved_rates(self.fns, min_time, slices, self.units, order_seed, self.finish)
        times = interleaved_times(self.fns, min_time, slices, order_seed, self.self_timed)
        if self.per_call:
            return {c: t * self.scale for c, t in times.items()}
        return {c: units_of(self.units, c) / t for c, t in times.items()}


def _short(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def compare(workload: str, races: Sequence[Race], rounds: int, min_time: float, slices: int) -> list[Metric]:
    """Run ``races`` in ``rounds`` (each round times every race, in turns) -> their metrics."""
    series = [{c: Series() for c in race.fns} for race in races]
    for r in range(rounds):
        for race, out in zip(races, series):
            for c, value in race.measure(r, min_time, slices).items():
                out[c].values.append(value)
        log(f"  {workload}: round {r + 1}/{rounds} " + " | ".join(
            f"{race.metric} {race.unit} " + " ".join(f"{c}={_short(s.values[-1])}" for c, s in out.items())
            for race, out in zip(races, series)))
    metrics = []
    for race, out in zip(races, series):
        ratios = {key: speedup(out[a], out[b], higher_is_better=not race.per_call)
                  for key, (a, b) in race.ratios.items()}
        metric = Metric(race.metric, race.unit, dict(out), ratios, target=race.target)
        if race.goal is not None:
            metric.met = race.goal(metric)
        metrics.append(metric)
    return metrics


def flag_noisy(name: str, metrics: Sequence[Metric], notes: list[str]) -> None:
    """Note every ratio whose rounds spread by more than `NOISY`."""
    for m in metrics:
        for key, series in m.ratios.items():
            if series.values and min(series.values) > 0 and max(series.values) / min(series.values) > NOISY:
                notes.append(f"  noisy: {m.name} {key} ranges {min(series.values):.2f}-{max(series.values):.2f} "
                             f"over rounds; re-run with --only {name}")


def load_note(load_start: float) -> str:
    """The load average at the start of a workload and now: how loaded the machine was."""
    return (f"  load average (1 min) {load_start:.1f} at start, {os.getloadavg()[0]:.1f} after timing "
            f"on {os.cpu_count()} CPUs")


def profile_calls(what: str, fn: Callable[[], Any], calls: int, top: int = 14) -> str:
    """cProfile of ``calls`` calls of ``fn``, sorted by own time."""
    out = io.StringIO()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out.write(f"--- cProfile: {what} x{calls} (sorted by own time) ---\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def start_workload(*contenders: Any) -> float:
    """Single-threaded, seeded torch and the contenders' imports done; returns the start time."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for contender in contenders:
        contender.preload()
    # What exists now (the imported modules, mostly torch's, and earlier results) stays:
    # frozen, later collections before each timed turn skip it. In smoke runs those
    # collections, each walking torch's millions of objects, took 8 of PARQUET's 13 s.
    gc.collect()
    gc.freeze()
    return time.perf_counter()
