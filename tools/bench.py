#!/usr/bin/env python
"""arrowbuf benchmarks: throughput and memory against an ideal baseline and peers.

Every performance claim is a *ratio measured in the same run*: the machine is
shared and noisy, so absolute numbers drift while paired ratios hold. In each
timing round the contenders take turns in short slices (rotating order), a ratio
is taken per round, and the median over rounds is reported with its min-max range.

Workloads (``--only W1,W2``; ``--list`` shows them):

- W1: state-based replay. obs float32[17], action float32[6], reward float32,
  terminated/truncated bool; capacity 1,000,000 rows; episodes of 1,000 steps
  given with their final observation; uniform batches of 256.
- W2: pixel replay. obs uint8[84,84,3], action int64, reward, terminated,
  truncated; capacity 100,000; episodes of 500 steps; batches of 32.

Contenders of the replay workloads:

- ``ideal``: preallocated, pre-touched numpy columns laid out like the arena
  (an episode's T+1 observation rows contiguous); add = slice assignment,
  sample = ``rng.integers`` + one ``np.take`` per column + ``obs[idx + 1]``.
- ``ideal_torch`` (sample only, information): the same columns gathered with
  ``torch.index_select``.
- ``arrowbuf``: ``ExperienceStore(capacity, seed=0)``; ``add_episode(dict)``,
  ``sample(batch)`` -> TensorDict.
- ``torchrl``: ``ReplayBuffer(LazyTensorStorage(capacity), RandomSampler())`` of
  transition TensorDicts with obs, action, reward, terminated, truncated and
  ("next", "obs"); ``extend`` per episode, ``sample(batch)``.

Protocol: every store is first filled to capacity (one full lap, reported as
"1st lap": first touch of fresh memory dominates it), so add is timed in steady
state (ring overwrite of warm memory) and sampling over a full store. Peak RSS
is measured per contender in a fresh subprocess (this script with a hidden
flag): the peak RSS growth (VmHWM, reset once the inputs are built) over a lap
and a tenth plus some samples, divided by the raw bytes of the rows stored (sum
of the field bytes of a row x rows stored). Targets: add >= 0.5x ideal, sample
>= 0.8x ideal, peak RSS <= 1.1x raw bytes.

Adding a workload (sequence sampling, prioritized, Ray, Parquet, ...): write a
``run(spec, opts) -> WorkloadResult`` (or reuse `run_replay` with a new
`ReplaySpec` and contenders) and `register` a `Workload` with its full and quick
specs; a ``probe(spec, contender) -> dict`` adds per-contender memory probes.

Examples:
    python tools/bench.py                    # full run (W1, W2), a few minutes
    python tools/bench.py --quick            # smoke test, smaller sizes
    python tools/bench.py --only W1 --json out/bench.json
    python tools/bench.py --only W1 --profile   # cProfile arrowbuf's add and sample
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import logging
import math
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

# ----------------------------------------------------------------------------------
# Specs and results
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldSpec:
    dtype: str
    shape: tuple[int, ...] = ()
    observation: bool = False

    @property
    def row_bytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * math.prod(self.shape))


@dataclass(frozen=True)
class ReplaySpec:
    """A uniform-replay workload: whole episodes in, uniform batches out."""

    fields: Mapping[str, FieldSpec]
    capacity: int            # rows (arrowbuf, ideal) / transitions (torchrl)
    episode_len: int         # T transitions; observation fields get T + 1 rows
    batch_size: int
    source_episodes: int = 4  # distinct episodes generated, then cycled

    @property
    def row_bytes(self) -> int:
        return sum(f.row_bytes for f in self.fields.values())

    def short(self) -> str:
        return (f"capacity {self.capacity:,}, episodes of {self.episode_len:,} steps, "
                f"batch {self.batch_size}, {self.row_bytes:,} B/row")

    def describe(self) -> str:
        cols = ", ".join(f"{n} {f.dtype}{list(f.shape) if f.shape else ''}" for n, f in self.fields.items())
        return (f"{cols}; capacity {self.capacity:,}; episodes of {self.episode_len:,} steps (+ final obs); "
                f"batch {self.batch_size}; {self.row_bytes:,} B/row")


@dataclass
class Options:
    quick: bool
    rounds: int
    min_time: float        # seconds per contender per round
    slices: int            # turns per round (see `interleaved_rates`)
    memory: bool
    profile: bool
    script: str


@dataclass
class Series:
    """Per-round values of one measurement (the median is what is reported)."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def to_json(self) -> dict:
        return {"median": self.median, "min": min(self.values, default=float("nan")),
                "max": max(self.values, default=float("nan")), "rounds": self.values}


@dataclass
class Metric:
    """One row of the results table."""

    name: str
    unit: str
    values: dict[str, Series | float | None]          # contender -> per-round series or one value
    ratios: dict[str, Series] = field(default_factory=dict)  # "arrowbuf/ideal" -> paired per-round ratios
    target: str = ""                                   # e.g. "arrowbuf/ideal >= 0.8"
    met: bool | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        vals = {k: (v.to_json() if isinstance(v, Series) else v) for k, v in self.values.items()}
        return {"name": self.name, "unit": self.unit, "values": vals,
                "ratios": {k: v.to_json() for k, v in self.ratios.items()},
                "target": self.target, "met": self.met, "detail": self.detail}


@dataclass
class WorkloadResult:
    name: str
    title: str
    description: str
    contenders: list[str]
    metrics: list[Metric]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"name": self.name, "title": self.title, "description": self.description, "contenders": self.contenders,
                "metrics": [m.to_json() for m in self.metrics], "notes": self.notes, "seconds": self.seconds}


# ----------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A registered benchmark: ``run(spec, opts)`` with the full or the quick spec."""

    name: str
    help: str
    full: Any
    quick: Any
    run: Callable[[Any, Options], WorkloadResult]
    # Hidden child-process entry for per-contender memory probes (None: no probe).
    probe: Callable[[Any, str], dict] | None = None

    def spec(self, quick: bool) -> Any:
        return self.quick if quick else self.full


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    if workload.name in WORKLOADS:
        raise ValueError(f"workload {workload.name!r} registered twice")
    WORKLOADS[workload.name] = workload
    return workload


# ----------------------------------------------------------------------------------
# Measurement helpers
# ----------------------------------------------------------------------------------


def interleaved_rates(fns: Mapping[str, Callable[[], Any]], min_time: float, slices: int,
                      units: float = 1.0, order_seed: int = 0) -> dict[str, float]:
    """Throughput of each function (calls x ``units`` per second), measured in turns.

    Each function runs for ``slices`` slices of ``min_time / slices`` seconds (at
    least one call each), the functions taking turns in a rotating order, so that
    load from other processes hits all of them alike and their ratio holds.
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
            calls[name] += n
            spent[name] += elapsed
    return {name: calls[name] * units / spent[name] for name in names}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rotated(items: Sequence[str], k: int) -> list[str]:
    k %= max(len(items), 1)
    return list(items[k:]) + list(items[:k])


# ----------------------------------------------------------------------------------
# Replay contenders
# ----------------------------------------------------------------------------------


def make_episodes(spec: ReplaySpec, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Distinct source episodes: observation fields with T + 1 rows, others T."""
    rng = np.random.default_rng(seed)
    T = spec.episode_len
    episodes = []
    for _ in range(spec.source_episodes):
        ep = {}
        for name, f in spec.fields.items():
            shape = (T + 1 if f.observation else T, *f.shape)
            if f.dtype == "bool":
                ep[name] = np.zeros(shape, bool)
                if name == "terminated":
                    ep[name][-1] = True
            elif np.issubdtype(np.dtype(f.dtype), np.floating):
                ep[name] = rng.standard_normal(shape, dtype=np.dtype(f.dtype))
            else:
                info = np.iinfo(np.dtype(f.dtype))
                ep[name] = rng.integers(max(info.min, 0), min(info.max, 255) + 1, shape, dtype=np.dtype(f.dtype))
        episodes.append(ep)
    return episodes


class Contender:
    """A replay implementation under test. Subclasses set ``name`` and implement the hooks."""

    name = "?"
    label = "?"
    can_add = True
    probe_memory = True

    @staticmethod
    def preload() -> None:
        """Import what it needs (before a memory probe takes its baseline)."""

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, "Contender"]) -> None:
        self.spec = spec

    def prepare(self, episode: dict[str, np.ndarray]) -> Any:
        """The episode in this contender's input format (not timed)."""
        return episode

    def lap(self) -> int:
        """Episodes that fill the store once."""
        raise NotImplementedError

    def add(self, item: Any) -> None:
        raise NotImplementedError

    def sample(self, batch_size: int) -> Any:
        raise NotImplementedError

    def rows_stored(self) -> int:
        """Rows held now (the unit of the raw-bytes denominator)."""
        raise NotImplementedError


class Ideal(Contender):
    name = "ideal"
    label = "ideal (numpy)"

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        self.T = spec.episode_len
        self.slot_rows = self.T + 1
        self.slots = spec.capacity // self.slot_rows
        self.cols = {}
        for name, f in spec.fields.items():
            col = np.empty((self.slots * self.slot_rows, *f.shape), np.dtype(f.dtype))
            col.reshape(-1).view(np.uint8)[:] = 0          # pre-touch every page
            self.cols[name] = col
        self.obs_names = [n for n, f in spec.fields.items() if f.observation]
        self.next_slot = 0
        self.live = 0
        self.rng = np.random.default_rng(0)

    def lap(self) -> int:
        return self.slots

    def add(self, item: dict[str, np.ndarray]) -> None:
        start = self.next_slot * self.slot_rows
        for name, array in item.items():
            self.cols[name][start:start + len(array)] = array
        self.next_slot = (self.next_slot + 1) % self.slots
        self.live = min(self.live + 1, self.slots)

    def rows(self, batch_size: int) -> np.ndarray:
        ranks = self.rng.integers(0, self.live * self.T, batch_size)
        return ranks + ranks // self.T             # skip each slot's final-observation row

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        rows = self.rows(batch_size)
        out = {name: np.take(col, rows, axis=0) for name, col in self.cols.items()}
        if self.obs_names:
            rows1 = rows + 1
            for name in self.obs_names:
                out["next_" + name] = np.take(self.cols[name], rows1, axis=0)
        return out

    def rows_stored(self) -> int:
        return self.live * self.slot_rows


class IdealTorch(Contender):
    """The ideal's columns gathered with torch.index_select (sample only)."""

    name = "ideal_torch"
    label = "ideal (torch)"
    can_add = False
    probe_memory = False

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        import torch
        self.torch = torch
        self.ideal: Ideal = peers["ideal"]  # type: ignore[assignment]
        self.cols = {n: torch.from_numpy(c) for n, c in self.ideal.cols.items()}

    def sample(self, batch_size: int) -> dict:
        torch = self.torch
        rows = torch.from_numpy(self.ideal.rows(batch_size))
        out = {name: torch.index_select(col, 0, rows) for name, col in self.cols.items()}
        if self.ideal.obs_names:
            rows1 = rows + 1
            for name in self.ideal.obs_names:
                out["next_" + name] = torch.index_select(self.cols[name], 0, rows1)
        return out


class Arrowbuf(Contender):
    name = "arrowbuf"
    label = "arrowbuf"

    @staticmethod
    def preload() -> None:
        import arrowbuf  # noqa: F401

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        import arrowbuf as ab
        self.store = ab.ExperienceStore(spec.capacity, seed=0)

    def lap(self) -> int:
        return self.spec.capacity // (self.spec.episode_len + 1)

    def add(self, item: dict[str, np.ndarray]) -> None:
        self.store.add_episode(item)

    def sample(self, batch_size: int) -> Any:
        return self.store.sample(batch_size)

    def rows_stored(self) -> int:
        # Every episode is given with its final observation: transitions + 1 rows each.
        return len(self.store) + self.store.num_episodes


class TorchRL(Contender):
    name = "torchrl"
    label = "torchrl"

    @staticmethod
    def preload() -> None:
        import torchrl.data  # noqa: F401
        logging.getLogger("torchrl").setLevel(logging.WARNING)

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        self.preload()
        from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer
        self.rb = ReplayBuffer(storage=LazyTensorStorage(spec.capacity), sampler=RandomSampler())

    def prepare(self, episode: dict[str, np.ndarray]) -> Any:
        import torch
        from tensordict import TensorDict
        T = self.spec.episode_len
        data: dict[str, Any] = {}
        nxt: dict[str, Any] = {}
        for name, array in episode.items():
            tensor = torch.from_numpy(array)
            if self.spec.fields[name].observation:
                data[name], nxt[name] = tensor[:T], tensor[1:T + 1]
            else:
                data[name] = tensor
        data["next"] = nxt
        return TensorDict(data, batch_size=[T])

    def lap(self) -> int:
        return -(-self.spec.capacity // self.spec.episode_len)

    def add(self, item: Any) -> None:
        self.rb.extend(item)

    def sample(self, batch_size: int) -> Any:
        return self.rb.sample(batch_size)

    def rows_stored(self) -> int:
        return len(self.rb)


CONTENDERS: dict[str, type[Contender]] = {c.name: c for c in (Ideal, IdealTorch, Arrowbuf, TorchRL)}


def build_contender(name: str, spec: ReplaySpec, peers: Mapping[str, Contender],
                    episodes: list[dict[str, np.ndarray]]) -> tuple[Contender, list[Any]]:
    contender = CONTENDERS[name](spec, peers)
    items = [contender.prepare(ep) for ep in episodes] if contender.can_add else []
    return contender, items


# ----------------------------------------------------------------------------------
# The uniform-replay workload runner (W1, W2)
# ----------------------------------------------------------------------------------

REPLAY_CONTENDERS = ("ideal", "ideal_torch", "arrowbuf", "torchrl")
TARGETS = {"add": 0.5, "sample": 0.8, "memory": 1.1}
NOISY = 1.4   # max/min of a ratio over rounds above which a result is flagged


def run_replay(name: str, spec: ReplaySpec, opts: Options) -> WorkloadResult:
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for c in REPLAY_CONTENDERS:
        CONTENDERS[c].preload()
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    episodes = make_episodes(spec)
    T = spec.episode_len
    notes: list[str] = []

    # Build and fill every contender once (cold fill: first touch of its memory).
    contenders: dict[str, Contender] = {}
    items: dict[str, list[Any]] = {}
    cold = {}
    for c in REPLAY_CONTENDERS:
        contenders[c], items[c] = build_contender(c, spec, contenders, episodes)
        if contenders[c].can_add:
            lap = contenders[c].lap()
            start = time.perf_counter()
            for i in range(lap):
                contenders[c].add(items[c][i % len(items[c])])
            cold[c] = lap * T / (time.perf_counter() - start)
        log(f"  {name}: {c} filled ({contenders[c].rows_stored() if c != 'ideal_torch' else '-'} rows)")
    feeds = {c: itertools.cycle(items[c]) for c in items if items[c]}

    adders = [c for c in REPLAY_CONTENDERS if contenders[c].can_add]
    samplers = list(REPLAY_CONTENDERS)
    add_rates = {c: Series() for c in adders}
    sample_rates = {c: Series() for c in samplers}
    for c in samplers:                     # warm-up (allocator, lazy imports, caches)
        for _ in range(20):
            contenders[c].sample(spec.batch_size)
    for r in range(opts.rounds):
        add_fns = {c: (lambda f=feeds[c], k=contenders[c]: k.add(next(f))) for c in adders}
        for c, v in interleaved_rates(add_fns, opts.min_time, opts.slices, T, r).items():
            add_rates[c].values.append(v)
        sample_fns = {c: (lambda k=contenders[c]: k.sample(spec.batch_size)) for c in samplers}
        for c, v in interleaved_rates(sample_fns, opts.min_time, opts.slices, 1, r).items():
            sample_rates[c].values.append(v)
        log(f"  {name}: round {r + 1}/{opts.rounds} sample/s "
            + " ".join(f"{c}={sample_rates[c].values[-1]:,.0f}" for c in samplers)
            + " | add rows/s " + " ".join(f"{c}={add_rates[c].values[-1]:,.0f}" for c in adders))

    # Check that the samples carry the same information.
    batch = contenders["arrowbuf"].sample(spec.batch_size)
    for key in [*spec.fields, *[("next", n) for n, f in spec.fields.items() if f.observation]]:
        if key not in batch.keys(include_nested=True):
            notes.append(f"arrowbuf sample lacks {key!r}")

    profile_text = profile_arrowbuf(contenders["arrowbuf"], feeds["arrowbuf"], spec) if opts.profile else None
    del contenders, items, feeds, batch
    gc.collect()

    def paired(series: dict[str, Series], a: str, b: str) -> Series:
        return Series([x / y for x, y in zip(series[a].values, series[b].values, strict=True)])

    add = Metric("add", "rows/s", {**{c: add_rates[c] for c in adders}, "ideal_torch": None},
                 {"arrowbuf/ideal": paired(add_rates, "arrowbuf", "ideal"),
                  "arrowbuf/torchrl": paired(add_rates, "arrowbuf", "torchrl")},
                 target=f"arrowbuf/ideal >= {TARGETS['add']}")
    add.met = add.ratios["arrowbuf/ideal"].median >= TARGETS["add"]
    sample = Metric("sample", "batches/s", dict(sample_rates),
                    {"arrowbuf/ideal": paired(sample_rates, "arrowbuf", "ideal"),
                     "arrowbuf/torchrl": paired(sample_rates, "arrowbuf", "torchrl"),
                     "arrowbuf/ideal_torch": paired(sample_rates, "arrowbuf", "ideal_torch")},
                    target=f"arrowbuf/ideal >= {TARGETS['sample']}")
    sample.met = sample.ratios["arrowbuf/ideal"].median >= TARGETS["sample"]
    # The ideal's memory is pre-touched, so its first lap is not cold: no ratio to it.
    fill = Metric("1st lap", "rows/s", {**cold, "ideal_torch": None},
                  {"arrowbuf/torchrl": Series([cold["arrowbuf"] / cold["torchrl"]])},
                  target="info: fresh memory (ideal pre-touched)")
    metrics = [add, sample]
    for m in metrics:
        for key, series in m.ratios.items():
            if series.values and min(series.values) > 0 and max(series.values) / min(series.values) > NOISY:
                notes.append(f"  noisy: {m.name} {key} ranges {min(series.values):.2f}-{max(series.values):.2f} "
                             f"over rounds; re-run with --only {name}")
    notes.append(f"  load average (1 min) {load_start:.1f} at start, {os.getloadavg()[0]:.1f} after timing "
                 f"on {os.cpu_count()} CPUs")
    if opts.memory:
        metrics.append(memory_metric(name, opts))
    metrics.append(fill)
    if profile_text:
        notes.append(profile_text)
    return WorkloadResult(name, spec.short(), spec.describe(), list(REPLAY_CONTENDERS), metrics, notes,
                          time.perf_counter() - t0)


def profile_arrowbuf(contender: Contender, feed: Iterator[Any], spec: ReplaySpec) -> str:
    out = io.StringIO()
    for what, fn, calls in (("add_episode", lambda: contender.add(next(feed)), 300),
                            ("sample", lambda: contender.sample(spec.batch_size), 3000)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        out.write(f"--- cProfile: arrowbuf {what} x{calls} (sorted by own time) ---\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


# -- memory (child processes) ------------------------------------------------------


def memory_metric(name: str, opts: Options) -> Metric:
    values: dict[str, Series | float | None] = {}
    detail: dict[str, Any] = {}
    for c in REPLAY_CONTENDERS:
        if not CONTENDERS[c].probe_memory:
            values[c] = None
            continue
        cmd = [sys.executable, opts.script, "--_probe", f"{name}:{c}"] + (["--quick"] if opts.quick else [])
        log(f"  {name}: memory probe {c} (fresh process)")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"memory probe {name}:{c} failed:\n{proc.stderr[-3000:]}")
        probe = json.loads(proc.stdout.strip().splitlines()[-1])
        detail[c] = probe
        values[c] = probe["peak_delta"] / probe["raw_bytes"]
    ratio = values["arrowbuf"]
    metric = Metric("peak RSS / raw bytes", "x", values, {}, target=f"arrowbuf <= {TARGETS['memory']}",
                    met=ratio is not None and ratio <= TARGETS["memory"], detail=detail)
    return metric


def probe_replay(spec: ReplaySpec, contender_name: str) -> dict:
    """Child process: peak RSS growth of one contender over a lap and a tenth."""
    import torch
    torch.set_num_threads(1)
    cls = CONTENDERS[contender_name]
    cls.preload()
    episodes = make_episodes(spec)
    # Build the contender's inputs before the baseline (torchrl's TensorDicts are
    # views of the same numpy episodes).
    template = cls.__new__(cls)
    template.spec = spec
    items = [template.prepare(ep) for ep in episodes]
    gc.collect()
    baseline = rss_bytes()
    exact = reset_peak_rss()
    contender = cls(spec, {})
    lap = contender.lap()
    for i in range(lap + max(1, lap // 10)):
        contender.add(items[i % len(items)])
    for _ in range(50):
        contender.sample(spec.batch_size)
    gc.collect()
    peak = peak_rss_bytes()
    rows = contender.rows_stored()
    return {"contender": contender_name, "baseline_rss": baseline, "peak_rss": peak,
            "peak_delta": peak - baseline, "rows_stored": rows, "row_bytes": spec.row_bytes,
            "raw_bytes": rows * spec.row_bytes, "peak_reset": exact}


# ----------------------------------------------------------------------------------
# Registered workloads
# ----------------------------------------------------------------------------------

_W1_FIELDS = {
    "obs": FieldSpec("float32", (17,), observation=True),
    "action": FieldSpec("float32", (6,)),
    "reward": FieldSpec("float32"),
    "terminated": FieldSpec("bool"),
    "truncated": FieldSpec("bool"),
}
_W2_FIELDS = {
    "obs": FieldSpec("uint8", (84, 84, 3), observation=True),
    "action": FieldSpec("int64"),
    "reward": FieldSpec("float32"),
    "terminated": FieldSpec("bool"),
    "truncated": FieldSpec("bool"),
}


def _replay(name: str) -> Callable[[ReplaySpec, Options], WorkloadResult]:
    return lambda spec, opts: run_replay(name, spec, opts)


register(Workload(
    "W1", "state replay: obs f32[17], act f32[6]; 1M rows, T=1000, batch 256",
    full=ReplaySpec(_W1_FIELDS, capacity=1_000_000, episode_len=1000, batch_size=256),
    quick=ReplaySpec(_W1_FIELDS, capacity=100_000, episode_len=1000, batch_size=256),
    run=_replay("W1"), probe=probe_replay))
register(Workload(
    "W2", "pixel replay: obs u8[84,84,3], act i64; 100k rows, T=500, batch 32",
    full=ReplaySpec(_W2_FIELDS, capacity=100_000, episode_len=500, batch_size=32),
    quick=ReplaySpec(_W2_FIELDS, capacity=10_000, episode_len=500, batch_size=32),
    run=_replay("W2"), probe=probe_replay))


# ----------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _num(value: float, unit: str) -> str:
    if value != value:  # nan
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    if value >= 1e6:
        return f"{value / 1e6:,.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:,.1f}k"
    return f"{value:,.0f}"


def _ratio(series: Series | None) -> str:
    if series is None or not series.values:
        return "-"
    lo, hi = min(series.values), max(series.values)
    if len(series.values) == 1 or hi - lo < 0.005:
        return f"{series.median:.2f}"
    return f"{series.median:.2f} \\[{lo:.2f}-{hi:.2f}]"


def render(results: list[WorkloadResult], meta: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(150, Console().width))
    for res in results:
        table = Table(title=f"{res.name}: {res.title}", title_justify="left", caption=res.description,
                      caption_justify="left")
        table.add_column("metric")
        for c in res.contenders:
            table.add_column(CONTENDERS[c].label if c in CONTENDERS else c, justify="right")
        table.add_column("arrowbuf/ideal", justify="right")
        table.add_column("arrowbuf/torchrl", justify="right")
        table.add_column("target", justify="left")
        table.add_column("met", justify="center")
        for m in res.metrics:
            cells = [f"{m.name} {m.unit}" if m.unit != "x" else m.name]
            for c in res.contenders:
                v = m.values.get(c)
                cells.append("-" if v is None else _num(v.median if isinstance(v, Series) else v, m.unit))
            if m.unit == "x" and not m.ratios:
                ab = m.values.get("arrowbuf")
                cells += [f"{ab / m.values['ideal']:.2f}" if ab and m.values.get("ideal") else "-",
                          f"{ab / m.values['torchrl']:.2f}" if ab and m.values.get("torchrl") else "-"]
            else:
                cells += [_ratio(m.ratios.get("arrowbuf/ideal")), _ratio(m.ratios.get("arrowbuf/torchrl"))]
            cells.append(m.target)
            cells.append("" if m.met is None else ("[green]yes[/]" if m.met else "[red]NO[/]"))
            table.add_row(*cells)
        console.print(table)
        for m in res.metrics:
            if "arrowbuf/ideal_torch" in m.ratios:
                console.print(f"  {m.name}: arrowbuf/ideal_torch = {_ratio(m.ratios['arrowbuf/ideal_torch'])}")
            if m.detail:
                for c, d in m.detail.items():
                    console.print(f"  {m.name}: {c}: peak RSS growth {d['peak_delta'] / 2**20:,.0f} MiB for "
                                  f"{d['rows_stored']:,} rows x {d['row_bytes']} B = "
                                  f"{d['raw_bytes'] / 2**20:,.0f} MiB raw")
        for note in res.notes:
            console.print(note, highlight=False, markup=False)
        console.print(f"  ({res.seconds:.0f} s)\n")
    console.print(escape(f"ratios: median over {meta['rounds']} rounds of interleaved timings [min-max over rounds]; "
                  f"load average {meta['loadavg_start']} -> {meta['loadavg_end']}; "
                  f"torch threads 1; total {meta['seconds']:.0f} s"))


# ----------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench.py", description=__doc__.split("\n\n")[0],
        epilog="workloads: " + "; ".join(f"{w.name}: {w.help}" for w in WORKLOADS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", metavar="W1,W2", help="comma-separated workloads to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7, quick 3)")
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds each contender runs per round (default 0.3, quick 0.06)")
    parser.add_argument("--slices", type=int, default=6,
                        help="turns per round: contenders alternate in slices of min-time/slices (default 6)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocess probes")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of arrowbuf add and sample")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument("--_probe", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._probe:
        wname, contender = args._probe.split(":")
        workload = WORKLOADS[wname]
        print(json.dumps(workload.probe(workload.spec(args.quick), contender)))
        return 0
    if args.list:
        for w in WORKLOADS.values():
            print(f"{w.name}: {w.help}\n    full: {w.full.describe()}\n    quick: {w.quick.describe()}")
        return 0
    names = list(WORKLOADS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        build_parser().error(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    opts = Options(quick=args.quick,
                   rounds=args.rounds or (3 if args.quick else 7),
                   min_time=args.min_time or (0.06 if args.quick else 0.3), slices=max(1, args.slices),
                   memory=not args.no_memory, profile=args.profile, script=os.path.abspath(__file__))
    meta = {"argv": sys.argv[1:], "quick": opts.quick, "rounds": opts.rounds, "min_time": opts.min_time,
            "slices": opts.slices,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    for mod in ("numpy", "torch", "pyarrow", "tensordict", "torchrl", "arrowbuf"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception as err:  # a missing peer is reported, not fatal here
            meta[mod] = f"unavailable: {err}"
    start = time.perf_counter()
    results = []
    for n in names:
        log(f"running {n} ({'quick' if opts.quick else 'full'})")
        w = WORKLOADS[n]
        results.append(w.run(w.spec(opts.quick), opts))
    meta["seconds"] = time.perf_counter() - start
    meta["loadavg_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    render(results, meta)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "workloads": [r.to_json() for r in results]}, f, indent=2)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
