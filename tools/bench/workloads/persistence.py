"""PARQUET: Parquet export / import and incremental checkpoints.

``to_parquet`` / ``from_parquet`` of W1 (1M rows) and W2 (5k pixel rows: pyarrow
writes fixed-size lists at ~20-50 MB/s, so 100k would take minutes) vs
``pyarrow.parquet.write_table`` / ``read_table`` of ``store.to_arrow()`` with the
same codec and row-group size (target >= 0.8x); ``save`` of 1% new data into an
existing checkpoint vs a full save, W1 1M rows and W2 100k rows (target <= 0.1x).
Each operation runs once per round, in rotating order, after a warm-up round.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..contenders import Arrowbuf
from ..harness import Options, Race, Workload, at_least, compare, flag_noisy, load_note, log, over, profile_calls, \
    register, start_workload
from ..results import Metric, Series, WorkloadResult
from ..specs import ReplaySpec, make_episodes, w1, w2


@dataclass(frozen=True)
class ParquetSpec:
    """Stores to export and import, and stores to checkpoint incrementally."""

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
    """Seconds one call of ``fn`` takes, and what it returned."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _seconds(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn`` after a garbage collection (what it returns is dropped, untimed)."""
    gc.collect()
    seconds, _ = _timed(fn)
    return seconds


def run_parquet(spec: ParquetSpec, opts: Options) -> WorkloadResult:
    """Time export and import against pyarrow, then incremental against full saves."""
    import shutil
    import tempfile

    import pyarrow.parquet as pq

    t0 = start_workload(Arrowbuf)
    import arrowbuf as ab
    try:
        from arrowbuf.parquet import group_rows
    except ImportError:
        def group_rows(row_bytes: int) -> int:
            return int(min(1 << 20, max(1024, (64 << 20) // max(row_bytes, 1))))
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
            # A warm-up round (first touch of output memory, page cache) that checks the import and
            # sizes the run: quick operations get more rounds (up to --rounds), within ~15 s.
            started = time.perf_counter()
            for op, fns in ops.items():
                for c, fn in fns.items():
                    gc.collect()
                    result = fn()
                    if op == "read" and c == "arrowbuf" and len(result) != len(store):
                        notes.append(f"  BUG? {wname}: from_parquet holds {len(result):,} transitions, "
                                     f"the exported store {len(store):,}")
                    del result
            wanted = max(rounds, min(opts.rounds, int(15 / max(time.perf_counter() - started, 1e-3))))
            metrics += compare(f"PARQUET {wname}", [
                Race(f"{wname} {title}", "GB/s", {c: (lambda fn=fn: _seconds(fn)) for c, fn in ops[op].items()},
                     over("arrowbuf", "pyarrow"), target="arrowbuf/pyarrow >= 0.8",
                     goal=at_least("arrowbuf/pyarrow", 0.8), units=gb, self_timed=True)
                for op, title in (("write", "to_parquet"), ("read", "from_parquet"))], wanted, 0.0, 1)
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
    notes.append(load_note(load_start))
    return WorkloadResult("PARQUET", spec.short(), spec.describe(), ["arrowbuf", "pyarrow", "full_save"],
                          metrics, notes, time.perf_counter() - t0,
                          labels={"arrowbuf": "arrowbuf (save: incremental)", "pyarrow": "pyarrow",
                                  "full_save": "arrowbuf full save"},
                          ratio_columns=["arrowbuf/pyarrow", "incremental/full"])


register(Workload(
    "PARQUET", "Parquet export/import (W1 1M rows, W2 5k pixel rows) vs pyarrow; incremental checkpoints",
    full=ParquetSpec(exports={"W1": w1(1_000_000), "W2": w2(5_010)},
                     checkpoints={"W1": w1(1_000_000), "W2": w2(100_200)}),
    quick=ParquetSpec(exports={"W1": w1(100_000), "W2": w2(2_004)},
                      checkpoints={"W1": w1(100_000), "W2": w2(10_020)}),
    smoke=ParquetSpec(exports={"W1": w1(10_010), "W2": w2(501)},
                      checkpoints={"W1": w1(10_010), "W2": w2(2_004)}),
    run=run_parquet))
