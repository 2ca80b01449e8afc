#!/usr/bin/env python
"""arrowbuf benchmarks: throughput and memory against an ideal baseline and peers.

Every performance claim is a *ratio measured in the same run*: the machine is
shared and noisy, so absolute numbers drift while paired ratios hold. In each
timing round the contenders take turns in short slices (rotating order), a ratio
is taken per round, and the median over rounds is reported with its min-max range.

Workloads (``--only W1,W2,W3,PER,RAY,PARQUET``; ``--list`` shows them):

- W1: state-based replay. obs float32[17], action float32[6], reward float32,
  terminated/truncated bool; capacity 1,000,000 rows; episodes of 1,000 steps
  given with their final observation; uniform batches of 256.
- W2: pixel replay. obs uint8[84,84,3], action int64, reward, terminated,
  truncated; capacity 100,000; episodes of 500 steps; batches of 32.
- W3: sequences. 64 windows of 32 steps from W1's data: arrowbuf
  ``SequenceSampler(32)`` vs the ideal numpy gather (random valid starts, one
  ``np.take`` of a [64, 32] index per column, incl. next obs) vs TorchRL's
  ``SliceSampler(slice_len=32, traj_key="episode")`` (and, for information, the
  same with ``cache_values=True``). Targets: >= 0.5x ideal, >= 4x TorchRL. Also
  the sample time of a small schema (obs f32[4], action int8, reward) at 10M rows
  over 1M rows: <= 1.5.
- PER: proportional prioritized replay over W1's data, 1M rows: median time of
  ``sample(256)`` + ``update_priorities`` (target < 0.3 ms and >= 2x TorchRL's
  ``PrioritizedSampler``), and of the samplers alone (no gather). The ideal is a
  textbook numpy binary sum tree + the ideal gather. TorchRL's sum tree is a C++
  extension; where it does not load, its column is empty and a note says why.
- RAY: ``ray.init(address="local", num_cpus=2)`` for this workload only; W1
  (200k rows) and W2 (20k rows) schemas in a 2-shard store: ``sample_iter(batch,
  prefetch=4)`` vs a naive Ray actor (``ray.get(actor.sample.remote(n))`` per
  batch; target >= 5x), ``add_episode`` + ``flush`` vs ``ray.get(actor.add.remote(
  episode))`` per episode (target >= 3x); ratio to the embedded store's sample;
  the same adds into a ``durable=`` store (each write logged and fsynced before
  its answer) vs the plain store (target: durable/plain time <= 1.3).
- PARQUET: ``to_parquet`` / ``from_parquet`` of W1 (1M rows) and W2 (5k pixel
  rows: pyarrow writes fixed-size lists at ~20-50 MB/s, so 100k would take
  minutes) vs ``pyarrow.parquet.write_table`` / ``read_table`` of
  ``store.to_arrow()`` with the same codec and row-group size (target >= 0.8x);
  ``save`` of 1% new data into an existing checkpoint vs a full save, W1 1M rows
  and W2 100k rows (target <= 0.1x).

Contenders of the replay workloads:

- ``ideal``: preallocated, pre-touched numpy columns laid out like the arena
  (an episode's T+1 observation rows contiguous); add = slice assignment,
  sample = ``rng.integers`` + one ``np.take`` per column + ``obs[idx + 1]``.
- ``ideal_checked`` (add only): the ideal's add plus the least a store that
  checks its input must do per episode: names, dtypes, shapes and lengths checked,
  one episode-table row and the rank -> episode map filled. The floor of a Python
  store that validates writes.
- ``ideal_torch`` (sample only, information): the same columns gathered with
  ``torch.index_select``.
- ``ideal_td`` (sample only): the ideal's gather returned as arrowbuf's sample
  contract, a TensorDict with ``("next", obs)``, ``index``, ``episode_id`` and
  ``step`` (torch.from_numpy + TensorDict's unchecked constructor): the floor of
  any Python store that hands out TensorDicts.
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

Timing: W1, W2, W3 and RAY report throughput and PER median call times, all
interleaved as above (RAY in longer slices, each ending with a wait for the work it
left in flight: a flush, or the prefetched requests); PARQUET runs each operation
once per round in rotating order after a warm-up round.

Adding a workload: write a
``run(spec, opts) -> WorkloadResult`` (or reuse `run_replay` with a new
`ReplaySpec` and contenders) and `register` a `Workload` with its full and quick
specs; a ``probe(spec, contender) -> dict`` adds per-contender memory probes.

Examples:
    python tools/bench.py                    # full run (all workloads), about 6-7 minutes
    python tools/bench.py --quick            # smoke test, smaller sizes
    python tools/bench.py --only W1 --json out/bench.json
    python tools/bench.py --only W1 --profile   # cProfile arrowbuf's add and sample
    python tools/bench.py --only W3,PER,RAY,PARQUET --profile
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
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
    # A metric in "x" without ratios shows values[a] / values[b] in column "a/b".
    ratios_from_values: bool = True

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
    labels: dict[str, str] = field(default_factory=dict)     # contender -> column title (default: CONTENDERS)
    ratio_columns: list[str] = field(default_factory=lambda: ["arrowbuf/ideal", "arrowbuf/torchrl"])

    def label(self, contender: str) -> str:
        if contender in self.labels:
            return self.labels[contender]
        return CONTENDERS[contender].label if contender in CONTENDERS else contender

    def to_json(self) -> dict:
        return {"name": self.name, "title": self.title, "description": self.description, "contenders": self.contenders,
                "metrics": [m.to_json() for m in self.metrics], "notes": self.notes, "seconds": self.seconds,
                "labels": {c: self.label(c) for c in self.contenders}, "ratio_columns": self.ratio_columns}


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
                      units: float = 1.0, order_seed: int = 0,
                      finish: Mapping[str, Callable[[], Any]] | None = None) -> dict[str, float]:
    """Throughput of each function (calls x ``units`` per second), measured in turns.

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
    return {name: calls[name] * units / spent[name] for name in names}


def interleaved_times(fns: Mapping[str, Callable[[], Any]], min_time: float, slices: int,
                      order_seed: int = 0) -> dict[str, float]:
    """Median seconds per call of each function, measured in turns as in `interleaved_rates`."""
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
                fn()
                stop = clock()
                out.append(stop - start)
                if stop >= end:
                    break
    return {name: statistics.median(values) for name, values in times.items()}


def speedup(fast: Series, slow: Series, higher_is_better: bool = True) -> Series:
    """Per-round ratios ``fast/slow`` of rates (or ``slow/fast`` of times): > 1 means faster."""
    pairs = zip(fast.values, slow.values, strict=True)
    return Series([a / b if higher_is_better else b / a for a, b in pairs])


def flag_noisy(name: str, metrics: Sequence[Metric], notes: list[str]) -> None:
    for m in metrics:
        for key, series in m.ratios.items():
            if series.values and min(series.values) > 0 and max(series.values) / min(series.values) > NOISY:
                notes.append(f"  noisy: {m.name} {key} ranges {min(series.values):.2f}-{max(series.values):.2f} "
                             f"over rounds; re-run with --only {name}")


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
    can_sample = True
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

    def ranks(self, batch_size: int) -> np.ndarray:
        """Transition ranks drawn uniformly: ``T`` a slot."""
        return self.rng.integers(0, self.live * self.T, batch_size)

    def rows_of(self, ranks: np.ndarray) -> np.ndarray:
        return ranks + ranks // self.T             # skip each slot's final-observation row

    def rows(self, batch_size: int) -> np.ndarray:
        return self.rows_of(self.ranks(batch_size))

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


class IdealChecked(Ideal):
    """The ideal's add plus the least a checked store must do per episode (add
    only): the dict's names, dtypes, shapes and lengths checked, the copy, one
    episode-table row (first row, length, flags, return, first rank) in a numpy
    record and the rank -> episode map filled for O(1) sampling. The floor of a
    Python store that validates its input."""

    name = "ideal_checked"
    label = "ideal + checks"
    can_sample = False
    probe_memory = False

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        self.specs = [(n, np.dtype(f.dtype), len(f.shape) + 1, tuple(f.shape), f.observation)
                      for n, f in spec.fields.items()]
        self.table = np.zeros(self.slots, [("first_row", "i8"), ("length", "i8"), ("terminated", "?"),
                                           ("truncated", "?"), ("return", "f8"), ("first_rank", "i8")])
        self.rank_map = np.zeros(self.slots * self.T, np.uint32)
        self.next_rank = 0

    def add(self, item: dict[str, np.ndarray]) -> None:
        if type(item) is not dict or len(item) != len(self.specs):
            raise ValueError("fields do not match the schema")
        steps = -1
        for name, dtype, ndim, shape, observation in self.specs:
            array = item.get(name)
            if type(array) is not np.ndarray or array.dtype != dtype or array.ndim != ndim \
                    or array.shape[1:] != shape or (not observation and steps not in (-1, len(array))):
                raise ValueError(f"field {name!r} does not match the schema")
            if not observation:
                steps = len(array)
        slot, rank = self.next_slot, self.next_rank
        super().add(item)
        flag = (lambda name: bool(item[name][-1]) if name in item else False)
        reward = float(np.add.reduce(item["reward"], axis=None, dtype=np.float64)) if "reward" in item else 0.0
        self.table[slot] = (slot * self.slot_rows, steps, flag("terminated"), flag("truncated"), reward, rank)
        start = rank % len(self.rank_map)
        self.rank_map[start:start + steps] = slot   # episodes of T steps: never wraps
        self.next_rank = rank + steps


class IdealView(Contender):
    """A sample-only variant of the ideal that reads the ideal's own columns."""

    can_add = False
    probe_memory = False

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        import torch
        self.torch = torch
        self.ideal: Ideal = peers["ideal"]  # type: ignore[assignment]


class IdealTorch(IdealView):
    """The ideal's columns gathered with torch.index_select (sample only)."""

    name = "ideal_torch"
    label = "ideal (torch)"

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        self.cols = {n: self.torch.from_numpy(c) for n, c in self.ideal.cols.items()}

    def sample(self, batch_size: int) -> dict:
        torch = self.torch
        rows = torch.from_numpy(self.ideal.rows(batch_size))
        out = {name: torch.index_select(col, 0, rows) for name, col in self.cols.items()}
        if self.ideal.obs_names:
            rows1 = rows + 1
            for name in self.ideal.obs_names:
                out["next_" + name] = torch.index_select(self.cols[name], 0, rows1)
        return out


class IdealTensorDict(IdealView):
    """The ideal's gather returned as arrowbuf's sample contract (sample only): the
    same np.take per column, then the keys a trainer gets from ``store.sample`` -
    ``("next", obs)``, ``"index"``, ``"episode_id"``, ``"step"`` - wrapped as a
    TensorDict with torch.from_numpy and TensorDict's unchecked constructor. The
    floor of any Python store that returns TensorDicts."""

    name = "ideal_td"
    label = "ideal + TensorDict"

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        from tensordict import TensorDict
        self.new_td = getattr(TensorDict, "_new_unsafe", TensorDict)

    def sample(self, batch_size: int) -> Any:
        ideal, from_numpy, T = self.ideal, self.torch.from_numpy, self.ideal.T
        ranks = ideal.ranks(batch_size)
        rows = ideal.rows_of(ranks)
        out = {name: from_numpy(np.take(col, rows, axis=0)) for name, col in ideal.cols.items()}
        rows1 = rows + 1
        out["next"] = {name: from_numpy(np.take(ideal.cols[name], rows1, axis=0)) for name in ideal.obs_names}
        out["index"] = from_numpy(ranks)
        out["episode_id"] = from_numpy(ranks // T)
        out["step"] = from_numpy((ranks % T).astype(np.int32))
        return self.new_td(out, batch_size=self.torch.Size([batch_size]))


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


CONTENDERS: dict[str, type[Contender]] = {c.name: c for c in (Ideal, IdealChecked, IdealTorch, IdealTensorDict,
                                                                Arrowbuf, TorchRL)}


def build_contender(name: str, spec: ReplaySpec, peers: Mapping[str, Contender],
                    episodes: list[dict[str, np.ndarray]]) -> tuple[Contender, list[Any]]:
    contender = CONTENDERS[name](spec, peers)
    items = [contender.prepare(ep) for ep in episodes] if contender.can_add else []
    return contender, items


# ----------------------------------------------------------------------------------
# The uniform-replay workload runner (W1, W2)
# ----------------------------------------------------------------------------------

REPLAY_CONTENDERS = ("ideal", "ideal_checked", "ideal_torch", "ideal_td", "arrowbuf", "torchrl")
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
        log(f"  {name}: {c} filled ({contenders[c].rows_stored() if contenders[c].can_add else '-'} rows)")
    feeds = {c: itertools.cycle(items[c]) for c in items if items[c]}

    adders = [c for c in REPLAY_CONTENDERS if contenders[c].can_add]
    samplers = [c for c in REPLAY_CONTENDERS if contenders[c].can_sample]
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

    add = Metric("add", "rows/s", {**{c: add_rates[c] for c in adders}, "ideal_torch": None, "ideal_td": None},
                 {"arrowbuf/ideal": paired(add_rates, "arrowbuf", "ideal"),
                  "arrowbuf/ideal_checked": paired(add_rates, "arrowbuf", "ideal_checked"),
                  "arrowbuf/torchrl": paired(add_rates, "arrowbuf", "torchrl")},
                 target=f"arrowbuf/ideal >= {TARGETS['add']}")
    add.met = add.ratios["arrowbuf/ideal"].median >= TARGETS["add"]
    sample = Metric("sample", "batches/s", {**sample_rates, "ideal_checked": None},
                    {"arrowbuf/ideal": paired(sample_rates, "arrowbuf", "ideal"),
                     "arrowbuf/torchrl": paired(sample_rates, "arrowbuf", "torchrl"),
                     "arrowbuf/ideal_torch": paired(sample_rates, "arrowbuf", "ideal_torch"),
                     "arrowbuf/ideal_td": paired(sample_rates, "arrowbuf", "ideal_td")},
                    target=f"arrowbuf/ideal >= {TARGETS['sample']}")
    sample.met = sample.ratios["arrowbuf/ideal"].median >= TARGETS["sample"]
    # The ideal's memory is pre-touched, so its first lap is not cold: no ratio to it.
    fill = Metric("1st lap", "rows/s", {**cold, "ideal_checked": None, "ideal_torch": None, "ideal_td": None},
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
# W3: sequence (slice) sampling
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceSpec:
    """Windows of ``length`` steps from a replay spec (its batch_size = windows per batch),
    plus a small schema at two capacities for the scaling check."""

    replay: ReplaySpec
    length: int
    scale_fields: Mapping[str, FieldSpec]
    scale_capacities: tuple[int, int]

    def short(self) -> str:
        return (f"{self.replay.batch_size} windows of {self.length} steps; capacity {self.replay.capacity:,}, "
                f"episodes of {self.replay.episode_len:,} steps")

    def describe(self) -> str:
        small = ", ".join(f"{n} {f.dtype}{list(f.shape) if f.shape else ''}" for n, f in self.scale_fields.items())
        return (f"{self.replay.describe()}; sample = {self.replay.batch_size} windows x {self.length} steps "
                f"(incl. next obs). Scaling: {small} at {self.scale_capacities[0]:,} vs "
                f"{self.scale_capacities[1]:,} rows")


class IdealWindows(Ideal):
    """The ideal columns; a sample is random valid window starts + one np.take of a [B, L] index per column."""

    def __init__(self, spec: ReplaySpec, length: int) -> None:
        super().__init__(spec, {})
        self.length = length
        self.offsets = np.arange(length, dtype=np.int64)

    def sample(self, windows: int) -> dict[str, np.ndarray]:
        per_slot = self.T - self.length + 1          # starts 0..T-L: steps and next obs stay in the episode
        k = self.rng.integers(0, self.live * per_slot, windows)
        rows = ((k // per_slot) * self.slot_rows + k % per_slot)[:, None] + self.offsets
        out = {name: np.take(col, rows, axis=0) for name, col in self.cols.items()}
        rows1 = rows + 1
        for name in self.obs_names:
            out["next_" + name] = np.take(self.cols[name], rows1, axis=0)
        return out


class ArrowbufWindows(Arrowbuf):
    def __init__(self, spec: ReplaySpec, length: int) -> None:
        Contender.__init__(self, spec, {})
        import arrowbuf as ab
        self.store = ab.ExperienceStore(spec.capacity, seed=0, sampler=ab.SequenceSampler(length))


class TorchRLSlices(TorchRL):
    """``ReplayBuffer(LazyTensorStorage, SliceSampler(slice_len, traj_key="episode"))``; every added
    episode gets a new id in its "episode" column (the trajectory key)."""

    def __init__(self, spec: ReplaySpec, length: int, cache_values: bool = False, storage: Any = None) -> None:
        Contender.__init__(self, spec, {})
        self.preload()
        from torchrl.data import LazyTensorStorage, ReplayBuffer, SliceSampler
        self.rb = ReplayBuffer(storage=storage if storage is not None else LazyTensorStorage(spec.capacity),
                               sampler=SliceSampler(slice_len=length, traj_key="episode", cache_values=cache_values),
                               batch_size=spec.batch_size * length)
        self.added = 0

    def prepare(self, episode: dict[str, np.ndarray]) -> Any:
        import torch
        td = super().prepare(episode)
        td["episode"] = torch.zeros(self.spec.episode_len, dtype=torch.int64)
        return td

    def add(self, item: Any) -> None:
        item["episode"].fill_(self.added)
        self.added += 1
        self.rb.extend(item)

    def sample(self, windows: int) -> Any:
        return self.rb.sample()


def _rows(n: int) -> str:
    return f"{n / 10**6:g}M" if n >= 10**6 else f"{n / 10**3:g}k"


def fill(contender: Contender, items: list[Any]) -> float:
    """Add one lap of episodes; returns rows/s."""
    lap = contender.lap()
    start = time.perf_counter()
    for i in range(lap):
        contender.add(items[i % len(items)])
    return lap * contender.spec.episode_len / (time.perf_counter() - start)


def check_windows(batch: Any, length: int, notes: list[str], who: str) -> None:
    """Windows stay inside one episode and hold consecutive steps."""
    if who == "arrowbuf":
        episode, step = batch["episode_id"], batch["step"]
    else:   # torchrl: flat [B * L]
        episode = batch["episode"].reshape(-1, length)
        step = None
    if not bool((episode == episode[:, :1]).all()):
        notes.append(f"  BUG? {who}: a window spans several episodes")
    if step is not None and not bool(((step[:, 1:] - step[:, :-1]) == 1).all()):
        notes.append(f"  BUG? {who}: a window's steps are not consecutive")


def start_workload(*contenders: type) -> float:
    """Single-threaded, seeded torch and the contenders' imports done; returns the start time."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for contender in contenders:
        contender.preload()
    return time.perf_counter()


def run_sequences(spec: SequenceSpec, opts: Options) -> WorkloadResult:
    t0 = start_workload(Arrowbuf, TorchRL)
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    B, L = spec.replay.batch_size, spec.length
    episodes = make_episodes(spec.replay)

    main: dict[str, Contender] = {"ideal": IdealWindows(spec.replay, L), "arrowbuf": ArrowbufWindows(spec.replay, L),
                                  "torchrl": TorchRLSlices(spec.replay, L)}
    for c, contender in main.items():
        fill(contender, [contender.prepare(ep) for ep in episodes])
        log(f"  W3: {c} filled ({contender.rows_stored():,} rows)")
    # Same storage, cached trajectory bounds (TorchRL clears the cache on every extend).
    main["torchrl_cached"] = TorchRLSlices(spec.replay, L, cache_values=True, storage=main["torchrl"].rb.storage)

    scale: dict[str, Contender] = {}
    for cap in spec.scale_capacities:
        small = ReplaySpec(spec.scale_fields, cap, spec.replay.episode_len, B)
        small_eps = make_episodes(small)
        for cls, kind in ((IdealWindows, "ideal"), (ArrowbufWindows, "arrowbuf")):
            contender = cls(small, L)
            fill(contender, small_eps)
            scale[f"{kind}@{cap}"] = contender
        log(f"  W3: small schema at {cap:,} rows filled")
        del small_eps

    for c in ("arrowbuf", "torchrl"):
        check_windows(main[c].sample(B), L, notes, c)
    for contender in [*main.values(), *scale.values()]:   # warm-up
        for _ in range(5):
            contender.sample(B)

    rates = {c: Series() for c in main}
    scale_rates = {c: Series() for c in scale}
    for r in range(opts.rounds):
        fns = {c: (lambda k=k: k.sample(B)) for c, k in main.items()}
        for c, v in interleaved_rates(fns, opts.min_time, opts.slices, 1, r).items():
            rates[c].values.append(v)
        fns = {c: (lambda k=k: k.sample(B)) for c, k in scale.items()}
        for c, v in interleaved_rates(fns, opts.min_time, opts.slices, 1, r).items():
            scale_rates[c].values.append(v)
        log(f"  W3: round {r + 1}/{opts.rounds} batches/s " + " ".join(f"{c}={rates[c].values[-1]:,.0f}" for c in main)
            + " | scaling " + " ".join(f"{c}={scale_rates[c].values[-1]:,.0f}" for c in scale))

    small_cap, big_cap = spec.scale_capacities
    sample = Metric("sample", "batches/s", dict(rates),
                    {"arrowbuf/ideal": speedup(rates["arrowbuf"], rates["ideal"]),
                     "arrowbuf/torchrl": speedup(rates["arrowbuf"], rates["torchrl"]),
                     "arrowbuf/torchrl_cached": speedup(rates["arrowbuf"], rates["torchrl_cached"])},
                    target="arrowbuf/ideal >= 0.5, arrowbuf/torchrl >= 4")
    sample.met = sample.ratios["arrowbuf/ideal"].median >= 0.5 and sample.ratios["arrowbuf/torchrl"].median >= 4
    growth = {kind: speedup(scale_rates[f"{kind}@{small_cap}"], scale_rates[f"{kind}@{big_cap}"])
              for kind in ("ideal", "arrowbuf")}
    scaling = Metric(f"sample time {_rows(big_cap)} / {_rows(small_cap)} rows", "x",
                     {"ideal": growth["ideal"], "arrowbuf": growth["arrowbuf"], "torchrl": None,
                      "torchrl_cached": None}, {}, target="arrowbuf <= 1.5",
                     met=growth["arrowbuf"].median <= 1.5, ratios_from_values=False,
                     detail={c: f"{c.replace('@', ' at ')} rows, small schema: {scale_rates[c].median:,.0f} "
                                f"batches/s" for c in scale})
    metrics = [sample, scaling]
    flag_noisy("W3", metrics, notes)
    notes.append(f"  torchrl: SliceSampler(slice_len={L}, traj_key='episode') recomputes the trajectory bounds "
                 "over the whole storage on every sample; torchrl (cache_values) caches them until the next "
                 "extend (so only while nothing is added)")
    notes.append(f"  load average (1 min) {load_start:.1f} at start, {os.getloadavg()[0]:.1f} after timing "
                 f"on {os.cpu_count()} CPUs")
    if opts.profile:
        seq = main["arrowbuf"]
        notes.append(profile_calls("arrowbuf SequenceSampler sample", lambda: seq.sample(B), 2000))
    main.clear()
    scale.clear()
    gc.collect()
    return WorkloadResult("W3", spec.short(), spec.describe(), ["ideal", "arrowbuf", "torchrl", "torchrl_cached"],
                          metrics, notes, time.perf_counter() - t0,
                          labels={"torchrl": "torchrl SliceSampler", "torchrl_cached": "torchrl cache_values"})


_SMALL_FIELDS = {
    "obs": FieldSpec("float32", (4,), observation=True),
    "action": FieldSpec("int8"),
    "reward": FieldSpec("float32"),
}

register(Workload(
    "W3", "sequences: 64 windows of 32 steps from W1's data; slice time at 10M vs 1M rows",
    full=SequenceSpec(ReplaySpec(_W1_FIELDS, capacity=1_000_000, episode_len=1000, batch_size=64), 32,
                      _SMALL_FIELDS, (1_000_000, 10_000_000)),
    quick=SequenceSpec(ReplaySpec(_W1_FIELDS, capacity=100_000, episode_len=1000, batch_size=64), 32,
                       _SMALL_FIELDS, (100_000, 1_000_000)),
    run=run_sequences))


# ----------------------------------------------------------------------------------
# PER: prioritized sampling + priority updates
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrioritySpec:
    replay: ReplaySpec          # data, capacity and batch size
    alpha: float = 0.6
    beta: float = 0.4

    def short(self) -> str:
        return (f"sample {self.replay.batch_size} + update_priorities {self.replay.batch_size}; "
                f"capacity {self.replay.capacity:,}; alpha {self.alpha}, beta {self.beta}")

    def describe(self) -> str:
        return f"{self.replay.describe()}; proportional PER, alpha {self.alpha}, beta {self.beta}"


class IdealPrioritized:
    """Textbook proportional PER in numpy over the ideal's columns: a binary sum tree
    walked by all queries together (one level per step), then the ideal's gather."""

    def __init__(self, ideal: Ideal, alpha: float, beta: float, eps: float = 1e-6) -> None:
        self.ideal, self.alpha, self.beta, self.eps = ideal, alpha, beta, eps
        rows = ideal.live * ideal.slot_rows
        self.depth = max(1, (rows - 1).bit_length())
        self.leaf0 = 1 << self.depth
        self.tree = np.zeros(2 * self.leaf0)
        leaves = np.ones(rows)
        leaves[ideal.slot_rows - 1::ideal.slot_rows] = 0.0     # final-observation rows are no transitions
        self.tree[self.leaf0:self.leaf0 + rows] = leaves
        lo = self.leaf0
        while lo > 1:
            self.tree[lo // 2:lo] = self.tree[lo:2 * lo:2] + self.tree[lo + 1:2 * lo:2]
            lo //= 2
        self.count = int(leaves.sum())
        self.max_priority = 1.0
        self.rng = np.random.default_rng(0)

    def select(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        tree = self.tree
        total = tree[1]
        mass = self.rng.random(n) * total
        node = np.ones(n, np.int64)
        for _ in range(self.depth):
            node *= 2
            left = tree[node]
            right = (mass >= left) & (tree[node + 1] > 0)
            mass -= np.where(right, left, 0.0)
            node += right
        weight = (self.count * tree[node] / total) ** -self.beta
        return node - self.leaf0, (weight / weight.max()).astype(np.float32)

    def update(self, rows: np.ndarray, priority: np.ndarray) -> None:
        priority = priority + self.eps
        node = rows + self.leaf0
        self.tree[node] = priority ** self.alpha
        for _ in range(self.depth):
            node //= 2
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]
        self.max_priority = max(self.max_priority, float(priority.max()))

    def sample(self, n: int) -> dict[str, np.ndarray]:
        rows, weight = self.select(n)
        ideal = self.ideal
        out = {name: np.take(col, rows, axis=0) for name, col in ideal.cols.items()}
        for name in ideal.obs_names:
            out["next_" + name] = np.take(ideal.cols[name], rows + 1, axis=0)
        out["weight"], out["index"] = weight, rows
        return out


def run_prioritized(spec: PrioritySpec, opts: Options) -> WorkloadResult:
    t0 = start_workload(Arrowbuf, TorchRL)
    import torch

    import arrowbuf as ab
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    rs = spec.replay
    B = rs.batch_size
    episodes = make_episodes(rs)
    # |TD errors|: a pool of priority vectors, cycled (numpy for the ideal, float32 tensors as a trainer has).
    pool_np = [np.abs(np.random.default_rng(i).standard_normal(B)) for i in range(64)]
    pool_t = [torch.from_numpy(p).float() for p in pool_np]
    cycle_np, cycle_t = itertools.cycle(pool_np), itertools.cycle(pool_t)

    ideal = Ideal(rs, {})
    fill(ideal, episodes)
    per = IdealPrioritized(ideal, spec.alpha, spec.beta)

    store_c = Arrowbuf.__new__(Arrowbuf)
    Contender.__init__(store_c, rs, {})
    store_c.store = ab.ExperienceStore(rs.capacity, seed=0, sampler=ab.PrioritizedSampler(spec.alpha, spec.beta))
    fill(store_c, episodes)
    store = store_c.store
    log(f"  PER: ideal and arrowbuf filled ({len(store):,} transitions)")

    def ideal_step() -> None:
        batch = per.sample(B)
        per.update(batch["index"], next(cycle_np))

    def ideal_sampler() -> None:
        rows, _ = per.select(B)
        per.update(rows, next(cycle_np))

    def arrowbuf_step() -> None:
        batch = store.sample(B)
        store.update_priorities(batch["index"], next(cycle_t))

    sampler, table, rng = store.sampler, store.engine.shard.table, np.random.default_rng(1)

    def arrowbuf_sampler() -> None:
        selection = sampler.sample(rng, B, table)
        sampler.update(table, selection.ranks, next(cycle_np))

    full = {"ideal": ideal_step, "arrowbuf": arrowbuf_step}
    bare = {"ideal": ideal_sampler, "arrowbuf": arrowbuf_sampler}
    try:
        from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer
        rb = ReplayBuffer(storage=LazyTensorStorage(rs.capacity),
                          sampler=PrioritizedSampler(rs.capacity, spec.alpha, spec.beta), batch_size=B)
    except Exception as err:  # noqa: BLE001  torchrl's C++ sum tree may not load (built for another torch)
        rb = None
        notes.append(f"  torchrl PrioritizedSampler unavailable: {type(err).__name__}: {err}")
        try:
            import torchrl._torchrl  # noqa: F401
        except Exception as cause:  # noqa: BLE001
            notes.append(f"    (import torchrl._torchrl: {type(cause).__name__}: {str(cause)[:160]}...)")
    if rb is not None:
        trl = TorchRL.__new__(TorchRL)
        Contender.__init__(trl, rs, {})
        trl.rb = rb
        fill(trl, [trl.prepare(ep) for ep in episodes])
        trl_sampler, trl_storage = rb.sampler, rb.storage

        def torchrl_step() -> None:
            _, info = rb.sample(return_info=True)
            rb.update_priority(info["index"], next(cycle_t))

        def torchrl_sampler() -> None:
            index, _ = trl_sampler.sample(trl_storage, B)
            trl_sampler.update_priority(index, next(cycle_t))

        full["torchrl"], bare["torchrl"] = torchrl_step, torchrl_sampler
        log(f"  PER: torchrl filled ({len(rb):,} transitions)")

    batch = store.sample(B)
    if "weight" not in batch or not bool((batch["weight"] <= 1).all()):
        notes.append("  arrowbuf prioritized sample lacks normalized 'weight'")
    for fn in [*full.values(), *bare.values()]:   # warm-up
        for _ in range(20):
            fn()
    times = {c: Series() for c in full}
    bare_times = {c: Series() for c in bare}
    for r in range(opts.rounds):
        for c, v in interleaved_times(full, opts.min_time, opts.slices, r).items():
            times[c].values.append(v * 1e3)
        for c, v in interleaved_times(bare, opts.min_time, opts.slices, r).items():
            bare_times[c].values.append(v * 1e3)
        log(f"  PER: round {r + 1}/{opts.rounds} ms " + " ".join(f"{c}={times[c].values[-1]:.3f}" for c in full)
            + " | sampler only " + " ".join(f"{c}={bare_times[c].values[-1]:.3f}" for c in bare))

    def ratios(series: dict[str, Series]) -> dict[str, Series]:
        return {f"arrowbuf/{c}": speedup(series["arrowbuf"], series[c], higher_is_better=False)
                for c in series if c != "arrowbuf"}

    combined = Metric("sample+update (median)", "ms", {"ideal": times["ideal"], "arrowbuf": times["arrowbuf"],
                                                       "torchrl": times.get("torchrl")},
                      ratios(times), target="arrowbuf < 0.3 ms, arrowbuf/torchrl >= 2")
    combined.met = times["arrowbuf"].median < 0.3 and (
        "torchrl" not in times or combined.ratios["arrowbuf/torchrl"].median >= 2)
    sampler_only = Metric("sampler only (median)", "ms", {"ideal": bare_times["ideal"],
                                                          "arrowbuf": bare_times["arrowbuf"],
                                                          "torchrl": bare_times.get("torchrl")},
                          ratios(bare_times), target="info: no gather")
    metrics = [combined, sampler_only]
    flag_noisy("PER", metrics, notes)
    notes.append("  ratios are speed-ups (time of the other / time of arrowbuf); arrowbuf sampler only = "
                 "store.sampler.sample(rng, n, table) + sampler.update(table, ranks, p) on the store's shard")
    notes.append(f"  load average (1 min) {load_start:.1f} at start, {os.getloadavg()[0]:.1f} after timing "
                 f"on {os.cpu_count()} CPUs")
    if opts.profile:
        notes.append(profile_calls("arrowbuf sample + update_priorities", arrowbuf_step, 2000, top=18))
    return WorkloadResult("PER", spec.short(), spec.describe(), ["ideal", "arrowbuf", "torchrl"], metrics, notes,
                          time.perf_counter() - t0,
                          labels={"ideal": "ideal (numpy sum tree)", "torchrl": "torchrl PrioritizedSampler"})


register(Workload(
    "PER", "prioritized: sample 256 + update_priorities 256 over 1M rows (W1 data)",
    full=PrioritySpec(ReplaySpec(_W1_FIELDS, capacity=1_000_000, episode_len=1000, batch_size=256)),
    quick=PrioritySpec(ReplaySpec(_W1_FIELDS, capacity=100_000, episode_len=1000, batch_size=256)),
    run=run_prioritized))


# ----------------------------------------------------------------------------------
# RAY: sharded store in Ray actors vs a naive replay actor
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RaySpec:
    replays: Mapping[str, ReplaySpec]   # schema name -> spec (capacity, episodes, batch)
    num_shards: int = 2
    prefetch: int = 4
    envs: int = 8                       # env ids the episodes cycle through (a shard per env)

    def short(self) -> str:
        return (f"{self.num_shards} shards, sample_iter(prefetch={self.prefetch}) vs a naive actor; "
                + "; ".join(f"{n}: {s.capacity:,} rows, batch {s.batch_size}" for n, s in self.replays.items()))

    def describe(self) -> str:
        return " | ".join(f"{n}: {s.describe()}" for n, s in self.replays.items())


class NaiveReplay:
    """The naive baseline, as a Ray actor: preallocated numpy columns (the ideal's layout),
    ``add(episode_dict)`` and ``sample(n)`` -> dict of numpy arrays, one call per batch."""

    def __init__(self, fields: dict[str, tuple[str, tuple[int, ...], bool]], capacity: int, episode_len: int) -> None:
        self.T = episode_len
        self.slot_rows = episode_len + 1
        self.slots = capacity // self.slot_rows
        self.cols = {}
        for name, (dtype, shape, _) in fields.items():
            col = np.empty((self.slots * self.slot_rows, *shape), np.dtype(dtype))
            col.reshape(-1).view(np.uint8)[:] = 0
            self.cols[name] = col
        self.obs_names = [n for n, (_, _, obs) in fields.items() if obs]
        self.next_slot = 0
        self.live = 0
        self.rng = np.random.default_rng(0)

    def add(self, episode: dict[str, np.ndarray]) -> int:
        start = self.next_slot * self.slot_rows
        for name, array in episode.items():
            self.cols[name][start:start + len(array)] = array
        self.next_slot = (self.next_slot + 1) % self.slots
        self.live = min(self.live + 1, self.slots)
        return self.live

    def sample(self, n: int) -> dict[str, np.ndarray]:
        ranks = self.rng.integers(0, self.live * self.T, n)
        rows = ranks + ranks // self.T
        out = {name: np.take(col, rows, axis=0) for name, col in self.cols.items()}
        for name in self.obs_names:
            out["next_" + name] = np.take(self.cols[name], rows + 1, axis=0)
        return out


def run_ray(spec: RaySpec, opts: Options) -> WorkloadResult:
    import torch
    torch.set_num_threads(1)
    Arrowbuf.preload()
    import ray

    import arrowbuf as ab
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    metrics: list[Metric] = []
    if __name__ != "__main__":   # imported: workers cannot import this file by name
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Longer slices than the in-process workloads: a Ray call costs ~1 ms, and each
    # slice ends by waiting for what it left in flight.
    min_time, slices, rounds = opts.min_time * 3, 3, max(2, min(opts.rounds, 5))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    log(f"  RAY: ray.init {time.perf_counter() - t0:.1f} s")
    try:
        for wname, rs in spec.replays.items():
            metrics += ray_schema(wname, rs, spec, min_time, slices, rounds, notes, opts.profile, ray, ab)
    finally:
        ray.shutdown()
    flag_noisy("RAY", metrics, notes)
    notes.append(f"  arrowbuf: ExperienceStore(backend='ray', num_shards={spec.num_shards}); add = add_episode "
                 f"(env_id cycling over {spec.envs} envs) + flush() at the end of each timed slice; sample = "
                 f"sample_iter(batch, prefetch={spec.prefetch}), each slice ending with len(store), which waits "
                 "for the prefetched requests; 'arrowbuf sample()' = one synchronous store.sample per batch")
    notes.append("  naive: one Ray actor (num_cpus=0), ray.get(actor.sample.remote(n)) / "
                 "ray.get(actor.add.remote(episode)) per call; local = embedded ExperienceStore.sample in the driver")
    notes.append(f"  load average (1 min) {load_start:.1f} at start, {os.getloadavg()[0]:.1f} after timing "
                 f"on {os.cpu_count()} CPUs")
    notes.append("  put: ray.put of each episode alone (nothing stored): the bound of one writer, whose episodes "
                 "must enter the object store")
    return WorkloadResult("RAY", spec.short(), spec.describe(),
                          ["naive", "arrowbuf", "arrowbuf_sync", "local", "put", "durable"],
                          metrics, notes, time.perf_counter() - t0,
                          labels={"naive": "naive actor", "arrowbuf": "arrowbuf sample_iter",
                                  "arrowbuf_sync": "arrowbuf sample()", "local": "local store",
                                  "put": "ray.put only", "durable": "arrowbuf durable=True"},
                          ratio_columns=["arrowbuf/naive", "arrowbuf/local"])


def ray_schema(wname: str, rs: ReplaySpec, spec: RaySpec, min_time: float, slices: int, rounds: int,
               notes: list[str], profile: bool, ray: Any, ab: Any) -> list[Metric]:
    """Fill, time and tear down the contenders of one schema."""
    T, B = rs.episode_len, rs.batch_size
    episodes = make_episodes(rs)
    start = time.perf_counter()
    fields = {n: (f.dtype, f.shape, f.observation) for n, f in rs.fields.items()}
    naive = ray.remote(num_cpus=0)(NaiveReplay).remote(fields, rs.capacity, T)
    store = ab.ExperienceStore(rs.capacity, backend="ray", num_shards=spec.num_shards, seed=0)
    durable_dir = tempfile.mkdtemp(prefix="arrowbuf-bench-durable-")
    durable = ab.ExperienceStore(rs.capacity, backend="ray", num_shards=spec.num_shards, seed=0, durable=durable_dir)
    local = ab.ExperienceStore(rs.capacity, seed=0)
    log(f"  RAY {wname}: actors started in {time.perf_counter() - start:.1f} s")
    laps = rs.capacity // (T + 1)
    env = itertools.count()
    try:
        start = time.perf_counter()
        for i in range(laps):
            ray.get(naive.add.remote(episodes[i % len(episodes)]))
        cold_naive = laps * T / (time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(laps):
            store.add_episode(episodes[i % len(episodes)], env_id=f"env-{next(env) % spec.envs}")
        store.flush()
        cold_ab = laps * T / (time.perf_counter() - start)
        for i in range(laps):
            durable.add_episode(episodes[i % len(episodes)], env_id=f"env-{next(env) % spec.envs}")
        durable.flush()
        for i in range(laps):
            local.add_episode(episodes[i % len(episodes)])
        shards = [s["transitions"] for s in store.stats()["shards"]]
        log(f"  RAY {wname}: filled; shards hold {shards} transitions, local {len(local):,}")

        iterator = store.sample_iter(B, prefetch=spec.prefetch)
        feed = itertools.cycle(episodes)
        sample_fns = {"naive": lambda: ray.get(naive.sample.remote(B)),
                      "arrowbuf": lambda: next(iterator),
                      "arrowbuf_sync": lambda: store.sample(B),
                      "local": lambda: local.sample(B)}
        add_fns = {"naive": lambda: ray.get(naive.add.remote(next(feed))),
                   "arrowbuf": lambda: store.add_episode(next(feed), env_id=f"env-{next(env) % spec.envs}"),
                   "durable": lambda: durable.add_episode(next(feed), env_id=f"env-{next(env) % spec.envs}"),
                   "put": lambda: ray.put(next(feed))}   # one writer's bound: the put alone, nothing stored
        sample_done = {"arrowbuf": lambda: len(store)}   # waits for the prefetched requests
        add_done = {"arrowbuf": store.flush, "durable": durable.flush}
        batch = next(iterator)
        for key in [*rs.fields, ("next", "obs")]:
            if key not in batch.keys(include_nested=True):
                notes.append(f"  RAY {wname}: arrowbuf batch lacks {key!r}")
        for fn in sample_fns.values():   # warm-up
            for _ in range(10):
                fn()
        for c in sample_done.values():
            c()
        sample_rates = {c: Series() for c in sample_fns}
        add_rates = {c: Series() for c in add_fns}
        for r in range(rounds):
            for c, v in interleaved_rates(sample_fns, min_time, slices, 1, r, finish=sample_done).items():
                sample_rates[c].values.append(v)
            for c, v in interleaved_rates(add_fns, min_time, slices, T, r, finish=add_done).items():
                add_rates[c].values.append(v)
            log(f"  RAY {wname}: round {r + 1}/{rounds} batches/s "
                + " ".join(f"{c}={sample_rates[c].values[-1]:,.0f}" for c in sample_fns)
                + " | add rows/s " + " ".join(f"{c}={add_rates[c].values[-1]:,.0f}" for c in add_fns))
        if profile:
            notes.append(profile_calls(f"RAY {wname}: driver side of arrowbuf sample_iter", lambda: next(iterator),
                                       2000, top=16))
            len(store)
            notes.append(profile_calls(f"RAY {wname}: driver side of arrowbuf sample()", lambda: store.sample(B),
                                       300, top=12))
            notes.append(profile_calls(f"RAY {wname}: driver side of arrowbuf add_episode (+flush every 20)",
                                       lambda: (store.add_episode(next(feed), env_id=f"env-{next(env) % spec.envs}"),
                                                next(env) % 20 or store.flush()), 200, top=12))
            store.flush()
    finally:
        store.close()
        durable.close()
        shutil.rmtree(durable_dir, ignore_errors=True)
        ray.kill(naive)
    sample_fns.clear()
    gc.collect()
    sample = Metric(f"{wname} sample", "batches/s", {**sample_rates, "put": None, "durable": None},
                    {"arrowbuf/naive": speedup(sample_rates["arrowbuf"], sample_rates["naive"]),
                     "arrowbuf/local": speedup(sample_rates["arrowbuf"], sample_rates["local"]),
                     "arrowbuf sample()/naive": speedup(sample_rates["arrowbuf_sync"], sample_rates["naive"])},
                    target="arrowbuf/naive >= 5")
    sample.met = sample.ratios["arrowbuf/naive"].median >= 5
    add = Metric(f"{wname} add", "rows/s", {**add_rates, "arrowbuf_sync": None, "local": None},
                 {"arrowbuf/naive": speedup(add_rates["arrowbuf"], add_rates["naive"]),
                  "arrowbuf/put": speedup(add_rates["arrowbuf"], add_rates["put"]),
                  "put/naive": speedup(add_rates["put"], add_rates["naive"]),
                  "arrowbuf/durable": speedup(add_rates["arrowbuf"], add_rates["durable"])},
                 target="arrowbuf/naive >= 3; arrowbuf/durable (durable time / plain time) <= 1.3")
    add.met = add.ratios["arrowbuf/naive"].median >= 3
    first = Metric(f"{wname} 1st lap", "rows/s", {"naive": cold_naive, "arrowbuf": cold_ab, "arrowbuf_sync": None,
                                                  "local": None, "put": None, "durable": None},
                   {"arrowbuf/naive": Series([cold_ab / cold_naive])},
                   target="info: fresh memory (naive pre-touched)")
    return [sample, add, first]


register(Workload(
    "RAY", "Ray: 2 shards, sample_iter and add_episode vs a naive replay actor (W1 200k rows, W2 20k rows)",
    full=RaySpec({"W1": ReplaySpec(_W1_FIELDS, capacity=200_000, episode_len=1000, batch_size=256),
                  "W2": ReplaySpec(_W2_FIELDS, capacity=20_000, episode_len=500, batch_size=32)}),
    quick=RaySpec({"W1": ReplaySpec(_W1_FIELDS, capacity=50_000, episode_len=1000, batch_size=256),
                   "W2": ReplaySpec(_W2_FIELDS, capacity=5_000, episode_len=500, batch_size=32)}),
    run=run_ray))


# ----------------------------------------------------------------------------------
# PARQUET: export / import and incremental checkpoints
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParquetSpec:
    exports: Mapping[str, ReplaySpec]       # to_parquet / from_parquet vs pyarrow on the same table
    checkpoints: Mapping[str, ReplaySpec]   # save: a new fraction of the data vs a full save
    new_fraction: float = 0.01
    compression: str = "zstd"

    def short(self) -> str:
        return ("to_parquet / from_parquet vs pyarrow.parquet; save() of "
                f"{self.new_fraction:.0%} new data vs a full save")

    def describe(self) -> str:
        ex = "; ".join(f"{n}: {s.capacity:,} rows of {s.row_bytes:,} B" for n, s in self.exports.items())
        ck = "; ".join(f"{n}: {s.capacity:,} rows" for n, s in self.checkpoints.items())
        return (f"exports ({self.compression}; pyarrow with the same codec and row-group size, "
                f"table = store.to_arrow(), not timed): {ex} | checkpoints: {ck}")


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_parquet(spec: ParquetSpec, opts: Options) -> WorkloadResult:
    import shutil
    import tempfile

    import pyarrow.parquet as pq

    Arrowbuf.preload()
    import arrowbuf as ab
    try:
        from arrowbuf.parquet import group_rows
    except ImportError:
        def group_rows(row_bytes: int) -> int:
            return int(min(1 << 20, max(1024, (64 << 20) // max(row_bytes, 1))))
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    metrics: list[Metric] = []
    rounds = max(2, min(opts.rounds, 3))
    root = tempfile.mkdtemp(prefix="arrowbuf-bench-")
    stores: dict[str, Any] = {}     # one store per spec (W1's export store is also its checkpoint store)

    def store_for(rs: ReplaySpec) -> Any:
        key = rs.describe()
        if key not in stores:
            store = ab.ExperienceStore(rs.capacity, seed=0)
            eps = make_episodes(rs)
            for i in range(rs.capacity // (rs.episode_len + 1)):
                store.add_episode(eps[i % len(eps)])
            stores[key] = store
        return stores[key]

    try:
        for wname, rs in spec.exports.items():
            store = store_for(rs)
            table = store.to_arrow()
            gb = table.nbytes / 1e9
            group = group_rows(store.schema.row_bytes)
            ab_dir, pa_file = os.path.join(root, f"{wname}-export"), os.path.join(root, f"{wname}.parquet")
            ops = {
                "write": {"arrowbuf": lambda s=store, d=ab_dir: s.to_parquet(d, compression=spec.compression,
                                                                             progress=False, overwrite=True),
                          "pyarrow": lambda t=table, f=pa_file, g=group: pq.write_table(
                              t, f, compression=spec.compression, row_group_size=g)},
                "read": {"arrowbuf": lambda d=ab_dir: ab.ExperienceStore.from_parquet(d, progress=False),
                         "pyarrow": lambda f=pa_file: pq.read_table(f)},
            }
            rates = {op: {c: Series() for c in fns} for op, fns in ops.items()}
            r, wanted = 0, rounds
            while r <= wanted:                 # round 0 warms up (first touch of output memory, page cache)
                started = time.perf_counter()
                for op, fns in ops.items():
                    for c in rotated(list(fns), r):
                        gc.collect()
                        seconds, result = _timed(fns[c])
                        if op == "read" and c == "arrowbuf" and r == 0 and len(result) != len(store):
                            notes.append(f"  BUG? {wname}: from_parquet holds {len(result):,} transitions, "
                                         f"the exported store {len(store):,}")
                        del result
                        if r:
                            rates[op][c].values.append(gb / seconds)
                if r == 0:   # quick operations get more rounds (up to --rounds), within ~15 s
                    per_round = time.perf_counter() - started
                    wanted = max(rounds, min(opts.rounds, int(15 / max(per_round, 1e-3))))
                else:
                    log(f"  PARQUET {wname}: round {r}/{wanted} GB/s "
                        + " ".join(f"{op} {c}={rates[op][c].values[-1]:.3f}" for op in ops for c in ops[op]))
                r += 1
            for op, title in (("write", "to_parquet"), ("read", "from_parquet")):
                m = Metric(f"{wname} {title}", "GB/s", {**rates[op], "full_save": None},
                           {"arrowbuf/pyarrow": speedup(rates[op]["arrowbuf"], rates[op]["pyarrow"])},
                           target="arrowbuf/pyarrow >= 0.8")
                m.met = m.ratios["arrowbuf/pyarrow"].median >= 0.8
                metrics.append(m)
            sizes = sum(f.stat().st_size for f in Path(ab_dir).rglob("*") if f.is_file())
            notes.append(f"  {wname}: table {table.nbytes / 2**20:,.0f} MiB in memory, {table.num_rows:,} rows; export "
                         f"{sizes / 2**20:,.0f} MiB, pyarrow file {os.path.getsize(pa_file) / 2**20:,.0f} MiB; "
                         f"row groups of {group:,} rows")
            if opts.profile:
                notes.append(profile_calls(f"{wname} to_parquet", ops["write"]["arrowbuf"], 1, top=12))
                notes.append(profile_calls(f"{wname} from_parquet", ops["read"]["arrowbuf"], 1, top=12))
            ops.clear()
            table = None
            shutil.rmtree(ab_dir, ignore_errors=True)
            os.remove(pa_file)

        for wname, rs in spec.checkpoints.items():
            store = store_for(rs)
            eps = make_episodes(rs, seed=1)
            new = max(1, round(spec.new_fraction * (rs.capacity // (rs.episode_len + 1))))
            inc_dir, full_dir = os.path.join(root, f"{wname}-ckpt"), os.path.join(root, f"{wname}-full")
            store.save(inc_dir, progress=False)        # the checkpoint that later saves extend
            inc, full = Series(), Series()
            for r in range(rounds + 1):
                for i in range(new):
                    store.add_episode(eps[i % len(eps)])
                gc.collect()
                t_inc, _ = _timed(lambda s=store, d=inc_dir: s.save(d, progress=False))
                shutil.rmtree(full_dir, ignore_errors=True)
                gc.collect()
                t_full, _ = _timed(lambda s=store, d=full_dir: s.save(d, progress=False))
                if r:
                    inc.values.append(t_inc)
                    full.values.append(t_full)
                    log(f"  PARQUET {wname}: round {r}/{rounds} save s incremental={t_inc:.3f} full={t_full:.3f}")
            m = Metric(f"{wname} save, {new} new episode{'s' if new > 1 else ''} "
                       f"({new * (rs.episode_len + 1) / rs.capacity:.0%})", "s",
                       {"arrowbuf": inc, "pyarrow": None, "full_save": full},
                       {"incremental/full": Series([a / b for a, b in zip(inc.values, full.values)])},
                       target="incremental/full <= 0.1")
            m.met = m.ratios["incremental/full"].median <= 0.1
            metrics.append(m)
            files = len([f for f in os.listdir(inc_dir) if f.endswith(".arrow")])
            notes.append(f"  {wname} checkpoint: {files} .arrow files in the incremental checkpoint after "
                         f"{rounds + 1} saves")
            if opts.profile:
                for i in range(new):
                    store.add_episode(eps[i % len(eps)])
                notes.append(profile_calls(f"{wname} incremental save",
                                           lambda s=store, d=inc_dir: s.save(d, progress=False), 1, top=14))
            shutil.rmtree(inc_dir, ignore_errors=True)
            shutil.rmtree(full_dir, ignore_errors=True)
    finally:
        stores.clear()
        shutil.rmtree(root, ignore_errors=True)
    flag_noisy("PARQUET", metrics, notes)
    notes.append("  GB/s = bytes of store.to_arrow() / seconds; arrowbuf's export also writes the episode table and a "
                 "manifest and fsyncs its files, pyarrow's write_table does neither")
    notes.append(f"  load average (1 min) {load_start:.1f} at start, {os.getloadavg()[0]:.1f} after timing "
                 f"on {os.cpu_count()} CPUs")
    return WorkloadResult("PARQUET", spec.short(), spec.describe(), ["arrowbuf", "pyarrow", "full_save"],
                          metrics, notes, time.perf_counter() - t0,
                          labels={"arrowbuf": "arrowbuf (save: incremental)", "pyarrow": "pyarrow",
                                  "full_save": "arrowbuf full save"},
                          ratio_columns=["arrowbuf/pyarrow", "incremental/full"])


register(Workload(
    "PARQUET", "Parquet export/import (W1 1M rows, W2 5k pixel rows) vs pyarrow; incremental checkpoints",
    full=ParquetSpec(exports={"W1": ReplaySpec(_W1_FIELDS, capacity=1_000_000, episode_len=1000, batch_size=256),
                              "W2": ReplaySpec(_W2_FIELDS, capacity=5_010, episode_len=500, batch_size=32)},
                     checkpoints={"W1": ReplaySpec(_W1_FIELDS, capacity=1_000_000, episode_len=1000, batch_size=256),
                                  "W2": ReplaySpec(_W2_FIELDS, capacity=100_200, episode_len=500, batch_size=32)}),
    quick=ParquetSpec(exports={"W1": ReplaySpec(_W1_FIELDS, capacity=100_000, episode_len=1000, batch_size=256),
                               "W2": ReplaySpec(_W2_FIELDS, capacity=2_004, episode_len=500, batch_size=32)},
                      checkpoints={"W1": ReplaySpec(_W1_FIELDS, capacity=100_000, episode_len=1000, batch_size=256),
                                   "W2": ReplaySpec(_W2_FIELDS, capacity=10_020, episode_len=500, batch_size=32)}),
    run=run_parquet))


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
    if value < 10:
        return f"{value:.3g}"
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
            table.add_column(res.label(c), justify="right")
        for col in res.ratio_columns:
            table.add_column(col, justify="right")
        table.add_column("target", justify="left")
        table.add_column("met", justify="center")
        for m in res.metrics:
            cells = [f"{m.name} {m.unit}" if m.unit != "x" else m.name]
            for c in res.contenders:
                v = m.values.get(c)
                cells.append("-" if v is None else _num(v.median if isinstance(v, Series) else v, m.unit))
            for col in res.ratio_columns:
                if m.unit == "x" and not m.ratios and m.ratios_from_values:
                    a, _, b = col.partition("/")
                    va, vb = m.values.get(a), m.values.get(b)
                    cells.append(f"{va / vb:.2f}" if isinstance(va, float) and isinstance(vb, float) and vb else "-")
                else:
                    cells.append(_ratio(m.ratios.get(col)))
            cells.append(m.target)
            cells.append("" if m.met is None else ("[green]yes[/]" if m.met else "[red]NO[/]"))
            table.add_row(*cells)
        console.print(table)
        for m in res.metrics:
            for key, series in m.ratios.items():
                if key not in res.ratio_columns:
                    console.print(f"  {m.name}: {key} = {_ratio(series)}")
            for c, d in m.detail.items():
                if isinstance(d, dict) and "peak_delta" in d:
                    console.print(f"  {m.name}: {c}: peak RSS growth {d['peak_delta'] / 2**20:,.0f} MiB for "
                                  f"{d['rows_stored']:,} rows x {d['row_bytes']} B = "
                                  f"{d['raw_bytes'] / 2**20:,.0f} MiB raw")
                elif isinstance(d, str):
                    console.print(f"  {m.name}: {d}", highlight=False, markup=False)
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
    parser.add_argument("--only", metavar="W1,W2", help="comma-separated workloads to run (default: all): "
                        + ",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7, quick 3)")
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds each contender runs per round (default 0.3, quick 0.06)")
    parser.add_argument("--slices", type=int, default=6,
                        help="turns per round: contenders alternate in slices of min-time/slices (default 6)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocess probes")
    parser.add_argument("--profile", action="store_true",
                        help="print cProfiles of arrowbuf's timed operations (add, sample, export, ...)")
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
