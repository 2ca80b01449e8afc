"""MIX: offline datasets mixed into online batches (issue 27).

- sample: W1-shaped ``sample(256)`` from a 25/75 `Mixture` of a memory-mapped
  dataset (an export of a W1 store, opened with ``open_dataset``; its file in the
  page cache after a warm-up) and an online W1 store, vs ``sample(256)`` of the
  online store alone (target mixture/online >= 0.8). For information: the dataset
  alone vs the store alone.
- versions: W1 ``sample(256, min_version=v)`` with 3/4 of the steps at version >= v
  (a version per episode, rising: the fresh steps are one run of indices) vs a plain
  ``sample(256)`` of the same store (target fresh/plain >= 0.8); for information, a
  store whose fresh episodes are scattered (versions k % 4, runs of 3 episodes: the
  draw maps through the spans). The same on a Ray store of 2 shards (a local Ray
  started for it; readers draw both from the shards' blocks; information only).
- open: ``open_dataset`` of a converted W1 dataset of ``open_rows`` rows (10M full,
  far fewer in quick mode), in a fresh process: seconds and RSS growth (targets
  < 1 s and < 200 MB), its one-time conversion timed apart (info).

- big dataset (opt-in, ``--mix-dataset-gb N``; `bench.big_dataset`): ``sample(256)`` of
  an N GB dataset (possibly larger than RAM) in fresh processes, against a small dataset
  of the same shape in RAM: batches/s and peak RSS. Off by default: it writes about 2N GB
  (once, into ``--mix-dataset-dir``). The test
  ``test_sampling_a_dataset_larger_than_its_resident_limit_stays_under_it`` bounds
  resident memory against an rlimit instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .. import big_dataset
from ..contenders import Arrowbuf
from ..harness import Options, Race, Workload, at_least, compare, flag_noisy, load_note, log, over, \
    profile_calls, register, start_workload
from ..results import Metric, Series, WorkloadResult
from ..specs import ReplaySpec, make_episodes, w1

_OPEN_CHILD = """
import json, sys, time, psutil
import arrowbuf as ab
process = psutil.Process()
before = process.memory_info().rss
start = time.perf_counter()
dataset = ab.open_dataset(sys.argv[1])
seconds = time.perf_counter() - start
grown = process.memory_info().rss - before
dataset.sample(256)
print(json.dumps({"seconds": seconds, "rss_growth": grown, "transitions": len(dataset)}))
"""


@dataclass(frozen=True)
class MixSpec:
    online: ReplaySpec       # the online store, and the dataset (an export of a store like it)
    open_rows: int           # rows of the dataset opened in a fresh process
    demo_weight: float = 0.25
    open_runs: int = 3       # fresh processes that open it (each imports torch: ~3.5 s)
    ray: bool = True         # the Ray row (it starts a local cluster: seconds a smoke run leaves out)

    def short(self) -> str:
        return (f"{self.demo_weight:.0%}/{1 - self.demo_weight:.0%} mixture, batch {self.online.batch_size}; "
                f"open {self.open_rows:,} rows")

    def describe(self) -> str:
        return (f"{self.online.describe()}; dataset = to_parquet of a store like it, open_dataset (memory-mapped); "
                f"open: {self.open_rows:,}-row W1 dataset in a fresh process")


def _filled(ab, spec: ReplaySpec, seed: int, versions: str | None = None):
    """A store of ``spec`` filled once; with ``versions="rising"`` episode k's steps have
    policy_version k, with ``"scattered"`` k % 4 (writers at different versions, interleaved)."""
    import numpy as np

    store = ab.ExperienceStore(spec.capacity, seed=seed)
    episodes = make_episodes(spec, seed=seed)
    for i in range(spec.capacity // (spec.episode_len + 1)):
        episode = episodes[i % len(episodes)]
        if versions:
            episode = {**episode, "policy_version": np.full(spec.episode_len, i if versions == "rising" else i % 4,
                                                            np.int64)}
        store.add_episode(episode)
    return store


def _ray_versioned(ab, spec: ReplaySpec, seed: int):
    """`_filled`'s versioned store on Ray (2 shards, a local Ray started here), filled by
    ``add_episodes`` in chunks (a round trip each)."""
    import logging

    import numpy as np
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    store = ab.ExperienceStore(spec.capacity, backend="ray", num_shards=2, seed=seed)
    episodes = make_episodes(spec, seed=seed)
    count = spec.capacity // (spec.episode_len + 1)
    for first in range(0, count, 256):
        chunk = [episodes[i % len(episodes)] for i in range(first, min(first + 256, count))]
        store.add_episodes({k: np.stack([e[k] for e in chunk]) for k in chunk[0]},
                           policy_version=np.arange(first, first + len(chunk)))
    store.flush()
    return store, count


def run_mix(spec: MixSpec, opts: Options) -> WorkloadResult:
    t0 = start_workload(Arrowbuf)
    import arrowbuf as ab

    load_start = os.getloadavg()[0]
    notes: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="arrowbuf-bench-mix-"))
    try:
        online = _filled(ab, spec.online, 0)
        export = _filled(ab, spec.online, 1).to_parquet(root / "demos", progress=False)
        dataset = ab.open_dataset(export, seed=0, progress=False)
        mixture = ab.Mixture({"demos": dataset, "online": online},
                             weights={"demos": spec.demo_weight, "online": 1 - spec.demo_weight}, seed=0)
        batch = spec.online.batch_size
        fns = {"mixture": lambda: mixture.sample(batch), "online": lambda: online.sample(batch),
               "dataset": lambda: dataset.sample(batch)}
        for fn in fns.values():       # warm-up: the dataset's pages into the page cache, pools
            for _ in range(50):
                fn()
        versioned = _filled(ab, spec.online, 3, versions="rising")
        bound = versioned.num_episodes // 4     # 3/4 of the steps qualify: one run of indices
        scattered = _filled(ab, spec.online, 4, versions="scattered")   # 3/4 qualify, in runs of 3 episodes
        fresh = {"fresh": lambda: versioned.sample(batch, min_version=bound),
                 "scattered": lambda: scattered.sample(batch, min_version=1),
                 "plain": lambda: versioned.sample(batch)}
        for fn in fresh.values():
            for _ in range(50):
                fn()
        races = [
            Race("sample", "batches/s", fns,
                 {"mixture/online": ("mixture", "online"), "dataset/online": ("dataset", "online")},
                 target="mixture/online >= 0.8", goal=at_least("mixture/online", 0.8)),
            Race("sample(min_version), 3/4 qualify", "batches/s", fresh,
                 {"fresh/plain": ("fresh", "plain"), "scattered/plain": ("scattered", "plain")},
                 target="fresh/plain >= 0.8 (scattered: info)", goal=at_least("fresh/plain", 0.8))]
        if spec.ray:
            on_ray, ray_count = _ray_versioned(ab, spec.online, 3)
            ray_bound = ray_count // 4
            ray_fresh = {"ray fresh": lambda: on_ray.sample(batch, min_version=ray_bound),
                         "ray plain": lambda: on_ray.sample(batch)}
            for fn in ray_fresh.values():
                for _ in range(50):
                    fn()
            races.append(Race("Ray sample(min_version), 3/4 qualify", "batches/s", ray_fresh,
                              {"ray fresh/plain": ("ray fresh", "ray plain")},
                              target="info: 2 shards, drawn by the reader"))
        else:
            notes.append("  Ray sample(min_version): not run (a smoke run starts no Ray cluster)")
        timed = compare("MIX", races, opts.rounds, opts.min_time, opts.slices)
        if opts.profile:
            notes.append(profile_calls("mixture sample", fns["mixture"], 3000))
        del mixture, dataset, online, versioned, scattered, fresh, fns
        metrics = [*timed, _open_metric(ab, spec, root, notes)]
        if opts.mix_dataset_gb:
            metrics.append(big_dataset.measure(spec.online, opts.mix_dataset_gb, Path(opts.mix_dataset_dir),
                                               opts, notes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        _stop_ray()
    flag_noisy("MIX", metrics, notes)
    notes.append(load_note(load_start))
    big = opts.mix_dataset_gb is not None
    return WorkloadResult("MIX", spec.short(), spec.describe(),
                          ["mixture", "online", "dataset", "fresh", "scattered", "plain", "ray fresh", "ray plain",
                           *(["big", "small"] if big else [])],
                          metrics, notes, time.perf_counter() - t0,
                          ratio_columns=["mixture/online", "dataset/online", "fresh/plain", "scattered/plain",
                                         "ray fresh/plain",
                                         *(["big/small"] if big else [])])


def _stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _open_metric(ab, spec: MixSpec, root: Path, notes: list[str]) -> Metric:
    """open_dataset of an ``open_rows``-row W1 dataset in fresh processes: seconds and RSS growth."""
    big = w1(spec.open_rows)
    start = time.perf_counter()
    store = _filled(ab, big, 2)
    export = store.to_parquet(root / "big", progress=False)
    del store
    filled = time.perf_counter()
    ab.open_dataset(export, progress=False)   # the one-time conversion
    converted = time.perf_counter() - filled
    notes.append(f"  open: {spec.open_rows:,} rows, export and fill {filled - start:.1f} s, one-time conversion "
                 f"{converted:.1f} s ({big.capacity * big.row_bytes / converted / 1e6:.0f} MB/s of rows)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(ab.__file__).parents[1]),
                                                                   os.environ.get("PYTHONPATH", "")] if p)}
    seconds, growth = Series(), Series()
    for _ in range(spec.open_runs):
        out = subprocess.run([sys.executable, "-c", _OPEN_CHILD, str(export)], capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(f"open_dataset child failed:\n{out.stderr[-2000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        seconds.values.append(result["seconds"])
        growth.values.append(result["rss_growth"] / 1e6)
        log(f"  MIX: open {result['seconds']:.3f} s, RSS +{result['rss_growth'] / 1e6:.0f} MB")
    metric = Metric(f"open_dataset, {spec.open_rows:,} rows (s; RSS MB)", "s",
                    {"mixture": None, "online": None, "dataset": seconds, "fresh": None, "plain": None},
                    {}, target="< 1 s and RSS +< 200 MB", detail={"rss_growth_mb": growth.values})
    metric.met = seconds.median < 1.0 and max(growth.values) < 200
    notes.append(f"  open: median {seconds.median:.3f} s, RSS growth {', '.join(f'{g:.0f}' for g in growth.values)} MB")
    return metric


register(Workload("MIX", "offline dataset + online store mixture (W1, 25/75, batch 256); open_dataset of 10M rows",
                  full=MixSpec(w1(1_000_000), open_rows=10_000_000),
                  quick=MixSpec(w1(100_000), open_rows=200_000),
                  smoke=MixSpec(w1(20_020), open_rows=50_000, open_runs=1, ray=False),
                  run=run_mix))
