"""MIX's opt-in row ``--mix-dataset-gb N``: sampling a dataset of N GB, possibly larger than RAM.

`build` writes (once) an Arrow IPC dataset directory of about N GB of W1 rows in chunks
of at most `CHUNK_EPISODES` episodes: a store filled with one chunk, its rows
(``to_arrow``) and episodes (``episodes``) written with episode ids continuing the
previous chunk's, the store cleared, the next chunk. Each chunk file is written under a
temporary name and renamed, and ``episodes.arrow`` (what makes the directory a dataset)
is written last, so an interrupted build resumes at its first missing chunk, and a built
one is reused. Memory stays at one chunk (~100 MB) whatever N.

`measure` then opens it with ``open_dataset`` (the one-time conversion into the
memory-mappable cache, beside it in the same directory: about N GB more on disk, timed
apart) and samples ``sample(256)`` in a fresh process per round, in turns with a small
dataset of the same shape (`SMALL_ROWS` rows, in the page cache after its warm-up): each
child reports batches/s, its resident memory before and after, and its peak
(``VmHWM``) over its resident memory after its imports. The big dataset's children
sample with ``resident_limit`` = a quarter of its rows' bytes (64 MiB to 1 GiB, the
default), so the bound shows at any size: resident memory stays near that limit while the
pages stay in (or are read back from) the page cache; pages dropped and touched again
cost minor faults, which the big/small ratio includes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .harness import Options, log
from .results import Metric, Series
from .specs import ReplaySpec, make_episodes

#: Episodes per chunk file (1,001 W1 rows each: ~98 MB of rows).
CHUNK_EPISODES = 1000
#: Rows of the small in-RAM dataset the big one is reported against.
SMALL_ROWS = 100_100
EPISODES = "episodes.arrow"

_SAMPLE_CHILD = """
import json, resource, sys, time, psutil
import arrowbuf as ab
import arrowbuf.dataset, arrowbuf.store, tensordict, torch   # loaded before `before`: `import arrowbuf` is lazy

def peak_rss():
    # VmHWM: this process's own peak; ru_maxrss keeps the parent's across fork and exec.
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

path, cache, limit, seconds, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
process = psutil.Process()
before = process.memory_info().rss
dataset = ab.open_dataset(path, cache_dir=cache, seed=0, rebuild=False, resident_limit=limit, progress=False)
for _ in range(20):
    dataset.sample(batch)
calls, start = 0, time.perf_counter()
while True:
    dataset.sample(batch)
    calls += 1
    elapsed = time.perf_counter() - start
    if elapsed >= seconds:
        break
print(json.dumps({"batches_per_s": calls / elapsed, "batches": calls + 20, "transitions": len(dataset),
                  "rss_before": before, "rss_after": process.memory_info().rss,
                  "peak_rss": peak_rss()}))
"""


def layout(directory: Path, spec: ReplaySpec, gigabytes: float) -> tuple[Path, int]:
    """(the dataset's directory under ``directory``, its episodes) for ``gigabytes`` of ``spec``'s rows."""
    rows_per_episode = spec.episode_len + 1
    episodes = max(1, math.ceil(gigabytes * 1e9 / (rows_per_episode * spec.row_bytes)))
    return Path(directory) / f"w1-{episodes}ep", episodes


def build(directory: Path, spec: ReplaySpec, episodes: int) -> dict:
    """The IPC dataset ``directory/source`` of ``episodes`` episodes of ``spec`` (built, resumed or
    reused); returns what it did: chunks written and reused, seconds."""
    import pyarrow as pa
    import pyarrow.compute as pc

    import arrowbuf as ab

    source, parts = directory / "source", directory / "parts"
    done = {"chunks_written": 0, "chunks_reused": 0, "seconds": 0.0}
    if (source / EPISODES).is_file():
        done["chunks_reused"] = len(list(source.glob("rows-*.arrow")))
        return done
    source.mkdir(parents=True, exist_ok=True)
    parts.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = make_episodes(spec, seed=7)
    chunks = math.ceil(episodes / CHUNK_EPISODES)
    tables = []
    for k in range(chunks):
        rows_file, episodes_file = source / f"rows-{k:05d}.arrow", parts / f"episodes-{k:05d}.arrow"
        if rows_file.is_file() and episodes_file.is_file():
            with pa.memory_map(str(episodes_file)) as f:
                tables.append(pa.ipc.open_file(f).read_all())
            done["chunks_reused"] += 1
            continue
        count = min(CHUNK_EPISODES, episodes - k * CHUNK_EPISODES)
        store = ab.ExperienceStore(count * (spec.episode_len + 1), seed=k)
        for i in range(count):
            store.add_episode(data[(k + i) % len(data)])
        offset = k * CHUNK_EPISODES   # a fresh store numbers its episodes from 0: continue the last chunk's
        for table, file in ((store.to_arrow(), rows_file), (store.episodes(), episodes_file)):
            ids = table.schema.get_field_index("episode_id")
            table = table.set_column(ids, table.schema.field(ids), pc.add(table.column(ids), offset))
            _write(file, table)
            if file is episodes_file:
                tables.append(table)
        del store
        done["chunks_written"] += 1
        log(f"  MIX: dataset chunk {k + 1}/{chunks} written ({count} episodes)")
    _write(source / EPISODES, pa.concat_tables(tables))   # last: the directory is now a dataset
    done["seconds"] = time.perf_counter() - start
    return done


def _write(file: Path, table) -> None:
    """``table`` as an Arrow IPC file at ``file``, written under a temporary name and renamed."""
    import pyarrow as pa

    partial = file.with_name(file.name + ".partial")
    with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(partial, file)


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(spec: ReplaySpec, gigabytes: float, directory: Path, opts: Options, notes: list[str]) -> Metric:
    """Build (or reuse) the ``gigabytes`` dataset and a small one under ``directory``, open both
    (converting once), and sample each in fresh processes, in turns: batches/s and resident memory."""
    import arrowbuf as ab

    big_dir, big_episodes = layout(directory, spec, gigabytes)
    small_dir = Path(directory) / f"w1-{SMALL_ROWS // (spec.episode_len + 1)}ep"
    made = {}
    for name, where, episodes in (("big", big_dir, big_episodes),
                                  ("small", small_dir, SMALL_ROWS // (spec.episode_len + 1))):
        made[name] = build(where, spec, episodes)
        start = time.perf_counter()
        dataset = ab.open_dataset(where / "source", cache_dir=where / "cache", progress=None)
        made[name]["open_s"] = time.perf_counter() - start
        made[name]["transitions"] = len(dataset)
        del dataset
    cache_bytes = directory_bytes(big_dir / "cache")
    limit = min(1 << 30, max(cache_bytes // 4, 64 << 20))
    notes.append(f"  big dataset: {big_dir} ({made['big']['transitions']:,} transitions, "
                 f"cache {cache_bytes / 1e9:.2f} GB"
                 f" + source {directory_bytes(big_dir / 'source') / 1e9:.2f} GB on disk); chunks written "
                 f"{made['big']['chunks_written']}, reused {made['big']['chunks_reused']}; open (with any conversion) "
                 f"{made['big']['open_s']:.1f} s; children sample with resident_limit {limit / 2**20:.0f} MiB")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(ab.__file__).parents[1]),
                                                                   os.environ.get("PYTHONPATH", "")] if p)}
    seconds = max(0.2, 5 * opts.min_time)
    rates = {"big": Series(), "small": Series()}
    peaks: dict[str, list[float]] = {"big": [], "small": []}
    growth: dict[str, list[float]] = {"big": [], "small": []}
    batches = {"big": 0, "small": 0}
    for r in range(opts.rounds):
        for name in (("big", "small") if r % 2 == 0 else ("small", "big")):
            where = big_dir if name == "big" else small_dir
            child_limit = limit if name == "big" else 1 << 30
            out = subprocess.run([sys.executable, "-c", _SAMPLE_CHILD, str(where / "source"), str(where / "cache"),
                                  str(child_limit), str(seconds), str(spec.batch_size)],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                raise RuntimeError(f"dataset sampling child failed:\n{out.stderr[-2000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rates[name].values.append(result["batches_per_s"])
            peaks[name].append((result["peak_rss"] - result["rss_before"]) / 1e6)
            growth[name].append((result["rss_after"] - result["rss_before"]) / 1e6)
            batches[name] += result["batches"]
        log(f"  MIX: big dataset round {r + 1}/{opts.rounds}: big {rates['big'].values[-1]:,.0f} batches/s "
            f"(peak RSS +{peaks['big'][-1]:.0f} MB), small {rates['small'].values[-1]:,.0f} batches/s")
    ratio = Series([b / s for b, s in zip(rates["big"].values, rates["small"].values)])
    bound = limit / 1e6 + 200   # the resident limit, plus the dataset's tables and pooled batches
    metric = Metric(f"sample, {cache_bytes / 1e9:.2f} GB dataset vs {SMALL_ROWS:,} rows in RAM", "batches/s",
                    {"big": rates["big"], "small": rates["small"]},
                    {"big/small": ratio},
                    target=f"completes; peak RSS +< {bound:.0f} MB (resident limit + 200 MB)",
                    detail={"peak_rss_growth_mb": peaks, "rss_growth_mb": growth, "batches": batches,
                            "dataset_bytes": cache_bytes, "resident_limit": limit,
                            "transitions": made["big"]["transitions"], "build": made})
    metric.met = max(peaks["big"]) < bound
    notes.append(f"  big dataset: {batches['big']:,} batches sampled; peak RSS +{max(peaks['big']):.0f} MB over "
                 f"the child's after its imports (small dataset's +{max(peaks['small']):.0f} MB); RSS growth at the "
                 f"end {', '.join(f'{g:.0f}' for g in growth['big'])} MB")
    return metric
