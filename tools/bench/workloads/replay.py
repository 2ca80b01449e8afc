"""W1 and W2: uniform replay of whole episodes (state rows, pixel rows).

Every store is first filled to capacity (one full lap, reported as "1st lap":
first touch of fresh memory dominates it), so add is timed in steady state (ring
overwrite of warm memory) and sampling over a full store. Peak RSS is measured
per contender in a fresh subprocess (see `memory`). Targets: add >= 0.5x ideal,
sample >= 1.0x ideal for W1 (issue 13: pooled, prebuilt batches make small-row
replay as cheap as the bare takes) and 0.8x for W2, peak RSS <= 1.1x raw bytes.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from typing import Any, Callable, Iterator

from ..contenders import CONTENDERS, Contender, build_contender, fill
from ..harness import Options, Race, Workload, at_least, compare, flag_noisy, load_note, log, over, \
    profile_calls, register, start_workload
from ..memory import memory_metric, peak_rss_bytes, reset_peak_rss, rss_bytes
from ..results import Metric, Series, WorkloadResult
from ..specs import ReplaySpec, make_episodes, w1, w2

REPLAY_CONTENDERS = ("ideal", "ideal_checked", "ideal_torch", "ideal_out", "ideal_td", "arrowbuf", "torchrl")
TARGETS = {"add": 0.5, "sample": 0.8, "memory": 1.1}
#: Sample targets that differ from TARGETS["sample"], by workload.
SAMPLE_TARGETS = {"W1": 1.0}


def run_replay(name: str, spec: ReplaySpec, opts: Options) -> WorkloadResult:
    """Fill every contender once, then time add and sample in interleaved rounds."""
    t0 = start_workload(*(CONTENDERS[c] for c in REPLAY_CONTENDERS))
    sample_target = SAMPLE_TARGETS.get(name, TARGETS["sample"])
    load_start = os.getloadavg()[0]
    episodes = make_episodes(spec)
    notes: list[str] = []

    # Build and fill every contender once (cold fill: first touch of its memory).
    contenders: dict[str, Contender] = {}
    items: dict[str, list[Any]] = {}
    cold = {}
    for c in REPLAY_CONTENDERS:
        contenders[c], items[c] = build_contender(c, spec, contenders, episodes)
        if contenders[c].can_add:
            cold[c] = fill(contenders[c], items[c])
        log(f"  {name}: {c} filled ({contenders[c].rows_stored() if contenders[c].can_add else '-'} rows)")
    feeds = {c: itertools.cycle(items[c]) for c in items if items[c]}

    adders = [c for c in REPLAY_CONTENDERS if contenders[c].can_add]
    samplers = [c for c in REPLAY_CONTENDERS if contenders[c].can_sample]
    for c in samplers:                     # warm-up (allocator, lazy imports, caches)
        for _ in range(20):
            contenders[c].sample(spec.batch_size)
    add, sample = compare(name, [
        Race("add", "rows/s", {c: (lambda f=feeds[c], k=contenders[c]: k.add(next(f))) for c in adders},
             over("arrowbuf", "ideal", "ideal_checked", "torchrl"), target=f"arrowbuf/ideal >= {TARGETS['add']}",
             goal=at_least("arrowbuf/ideal", TARGETS["add"]), units=spec.episode_len),
        Race("sample", "batches/s", {c: (lambda k=contenders[c]: k.sample(spec.batch_size)) for c in samplers},
             over("arrowbuf", "ideal", "torchrl", "ideal_torch", "ideal_out", "ideal_td"),
             target=f"arrowbuf/ideal >= {sample_target}", goal=at_least("arrowbuf/ideal", sample_target)),
    ], opts.rounds, opts.min_time, opts.slices)

    # Check that the samples carry the same information.
    batch = contenders["arrowbuf"].sample(spec.batch_size)
    for key in [*spec.fields, *[("next", n) for n, f in spec.fields.items() if f.observation]]:
        if key not in batch.keys(include_nested=True):
            notes.append(f"arrowbuf sample lacks {key!r}")

    profile_text = profile_arrowbuf(contenders["arrowbuf"], feeds["arrowbuf"], spec) if opts.profile else None
    del contenders, items, feeds, batch
    gc.collect()

    # The ideal's memory is pre-touched, so its first lap is not cold: no ratio to it.
    first_lap = Metric("1st lap", "rows/s", dict(cold), {"arrowbuf/torchrl": Series([cold["arrowbuf"] / cold["torchrl"]])},
                       target="info: fresh memory (ideal pre-touched)")
    metrics = [add, sample]
    flag_noisy(name, metrics, notes)
    notes.append(load_note(load_start))
    if opts.memory:
        metrics.append(memory_metric(name, [(c, CONTENDERS[c].probe_memory) for c in REPLAY_CONTENDERS], opts,
                                     TARGETS["memory"]))
    metrics.append(first_lap)
    if profile_text:
        notes.append(profile_text)
    return WorkloadResult(name, spec.short(), spec.describe(), list(REPLAY_CONTENDERS), metrics, notes,
                          time.perf_counter() - t0, labels={c: CONTENDERS[c].label for c in REPLAY_CONTENDERS})


def profile_arrowbuf(contender: Contender, feed: Iterator[Any], spec: ReplaySpec) -> str:
    """cProfiles of arrowbuf's add_episode and sample."""
    return (profile_calls("arrowbuf add_episode", lambda: contender.add(next(feed)), 300)
            + profile_calls("arrowbuf sample", lambda: contender.sample(spec.batch_size), 3000))


def probe_replay(spec: ReplaySpec, contender_name: str) -> dict:
    """Child process: peak RSS growth of one contender over a lap and a tenth."""
    cls = CONTENDERS[contender_name]
    if cls.needs_torch:   # imported before the baseline; the numpy ideals' probes skip its seconds of import
        import torch
        torch.set_num_threads(1)
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


def _replay(name: str) -> Callable[[ReplaySpec, Options], WorkloadResult]:
    return lambda spec, opts: run_replay(name, spec, opts)


register(Workload("W1", "state replay: obs f32[17], act f32[6]; 1M rows, T=1000, batch 256",
                  full=w1(1_000_000), quick=w1(100_000), smoke=w1(10_010), run=_replay("W1"),
                  probe=probe_replay))
register(Workload("W2", "pixel replay: obs u8[84,84,3], act i64; 100k rows, T=500, batch 32",
                  full=w2(100_000), quick=w2(10_000), smoke=w2(2_004), run=_replay("W2"),
                  probe=probe_replay))
