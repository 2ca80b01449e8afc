"""Corruption campaign: flip bytes and truncate files of checkpoints and exports, then load them.

Three fixtures are written once: a local checkpoint (two incremental saves, a
prioritized sampler, an open writer episode), a Parquet export without
compression and one with zstd. Each corruption is a single byte replaced at a
sampled offset of one file (seeded), or a file cut short. Loads run in worker
subprocesses, many corruptions per worker, so a crash (SIGSEGV, SIGABRT) shows
as a negative return code and is counted against the corruption being loaded;
the worker is then restarted on a fresh copy for the rest. Every outcome is one of:

- ``rejected``: `arrowbuf.FormatError` (what a corrupted file must give);
- ``same``: the load succeeded and gave exactly the saved data (rows, episode
  table, and for checkpoints the next sampled batch);
- ``untyped``: any other exception;
- ``wrong``: the load succeeded but the data differs, or fails on first use;
- ``crash``: the worker died.

Usage:
    python tools/corrupt.py --flips 2000 --seed 0

prints the counts per fixture and in total, as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = ("checkpoint", "parquet-none", "parquet-zstd")
OUTCOMES = ("rejected", "same", "untyped", "wrong", "crash")
COUNTS = ("tried", "flips", "truncations", *OUTCOMES)


# -- fixtures -------------------------------------------------------------------------


def write_fixtures(root: Path) -> dict[str, Path]:
    """Write the three fixtures under ``root``; returns their directories."""
    import arrowbuf as ab

    rng = np.random.default_rng(0)
    store = ab.ExperienceStore(capacity=400, seed=1, sampler=ab.PrioritizedSampler(alpha=0.6, beta=0.4))

    def add(episodes: int) -> None:
        for k in range(episodes):
            steps = int(rng.integers(3, 12))
            final = k % 3 != 2
            store.add_episode({"obs": rng.standard_normal((steps + final, 5)).astype(np.float32),
                               "action": rng.integers(0, 4, steps), "reward": rng.standard_normal(steps),
                               "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool)},
                              env_id=f"env-{k % 3}")

    add(30)
    batch = store.sample(32)
    store.update_priorities(batch["index"], rng.uniform(0.1, 3.0, 32))
    paths = {name: root / name for name in FIXTURES}
    store.save(paths["checkpoint"])
    add(6)
    writer = store.writer(num_envs=2, name="open")
    writer.add(obs=rng.standard_normal((2, 5)).astype(np.float32), action=np.zeros(2, np.int64),
               reward=np.ones(2), terminated=np.zeros(2, bool), truncated=np.zeros(2, bool),
               next_obs=rng.standard_normal((2, 5)).astype(np.float32))
    store.save(paths["checkpoint"])        # incremental: a second row file
    store.to_parquet(paths["parquet-none"], compression="none", rows_per_file=80)
    store.to_parquet(paths["parquet-zstd"], compression="zstd", rows_per_file=80)
    return paths


def fingerprint(fixture: str, directory: Path) -> str:
    """A hash of everything a load gives: rows, episode table (and a sampled batch)."""
    import pyarrow as pa
    import torch

    import arrowbuf as ab

    if fixture == "checkpoint":
        store = ab.ExperienceStore.load(directory, progress=False)
    else:
        store = ab.ExperienceStore.from_parquet(directory, progress=False, seed=0)
    digest = hashlib.sha256()
    for table in (store.to_arrow(), store.episodes()):
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        digest.update(sink.getvalue())
    batch = store.sample(16)
    for key in sorted(batch.keys(include_nested=True, leaves_only=True), key=str):
        tensor = batch[key].contiguous()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
        digest.update(str(key).encode() + tensor.numpy().tobytes())
    digest.update(json.dumps(sorted(store.writers)).encode())
    return digest.hexdigest()


# -- corruptions ----------------------------------------------------------------------


def plan(directory: Path, flips: int, seed: int) -> list[dict[str, Any]]:
    """Corruptions of every file of a fixture: ``flips`` byte flips spread evenly over
    the files, and truncations of each file to 0, 1, half and all but one byte."""
    rng = np.random.default_rng(seed)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    jobs = []
    for i, file in enumerate(files):
        size = file.stat().st_size
        share = flips // len(files) + (i < flips % len(files))
        for offset in rng.integers(0, size, share).tolist():
            jobs.append({"file": str(file.relative_to(directory)), "offset": int(offset),
                         "xor": int(rng.integers(1, 256))})
        for keep in sorted({0, 1, size // 2, size - 1}):
            jobs.append({"file": str(file.relative_to(directory)), "truncate": keep})
    return jobs


def _apply(directory: Path, job: dict[str, Any]) -> bytes:
    """Corrupt one file in place; returns its original bytes."""
    file = directory / job["file"]
    original = file.read_bytes()
    if "truncate" in job:
        file.write_bytes(original[:job["truncate"]])
    else:
        data = bytearray(original)
        data[job["offset"]] ^= job["xor"]
        file.write_bytes(bytes(data))
    return original


def worker(fixture: str, pristine: Path, work: Path, jobs_file: Path) -> None:
    """Load ``work`` once per corruption of ``jobs_file``; one outcome per line on stdout."""
    import arrowbuf as ab

    expected = fingerprint(fixture, pristine)
    for job in json.loads(jobs_file.read_text()):
        original = _apply(work, job)
        try:
            outcome = "same" if fingerprint(fixture, work) == expected else "wrong"
        except ab.FormatError:
            outcome = "rejected"
        except Exception as err:   # anything else is what the campaign looks for
            outcome = f"untyped {type(err).__name__}: {str(err)[:200]}"
        (work / job["file"]).write_bytes(original)
        print(json.dumps(outcome), flush=True)


def run_fixture(fixture: str, pristine: Path, jobs: list[dict[str, Any]], scratch: Path,
                batch: int = 400) -> dict[str, Any]:
    """Run ``jobs`` against one fixture in worker subprocesses; the counts and examples."""
    counts = dict.fromkeys(OUTCOMES, 0)
    examples: list[str] = []
    done = 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    while done < len(jobs):
        work = scratch / f"work-{fixture}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        todo = jobs[done:done + batch]
        jobs_file = scratch / f"jobs-{fixture}.json"
        jobs_file.write_text(json.dumps(todo))
        proc = subprocess.run([sys.executable, __file__, "--worker", fixture, str(pristine), str(work),
                               str(jobs_file)], capture_output=True, text=True, env=env)
        outcomes = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('"')]
        for job, outcome in zip(todo, outcomes):
            kind = outcome.split(" ", 1)[0]
            counts[kind] += 1
            if kind in ("untyped", "wrong") and len(examples) < 10:
                examples.append(f"{job}: {outcome}")
        done += len(outcomes)
        if len(outcomes) < len(todo):
            if proc.returncode >= 0 and not outcomes and proc.returncode != 0:
                raise RuntimeError(f"worker for {fixture} failed to start:\n{proc.stderr[-2000:]}")
            counts["crash"] += 1
            examples.append(f"{todo[len(outcomes)]}: crash (return code {proc.returncode})")
            done += 1
    truncations = sum("truncate" in job for job in jobs)
    return {"tried": len(jobs), "flips": len(jobs) - truncations, "truncations": truncations, **counts,
            "examples": examples}


def campaign(flips: int, seed: int = 0, root: Path | None = None) -> dict[str, Any]:
    """Write the fixtures, corrupt them and load every corruption; counts per fixture and total."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(root or tmp)
        paths = write_fixtures(base / "pristine")
        results = {}
        for k, fixture in enumerate(FIXTURES):
            jobs = plan(paths[fixture], flips // len(FIXTURES) + (k < flips % len(FIXTURES)), seed + k)
            results[fixture] = run_fixture(fixture, paths[fixture], jobs, base)
        total = {key: sum(r[key] for r in results.values()) for key in COUNTS}
        return {"fixtures": results, "total": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--flips", type=int, default=2000, help="byte flips in total, across the fixtures")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled offsets and bytes")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--worker", nargs=4, metavar=("FIXTURE", "PRISTINE", "WORK", "JOBS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        fixture, pristine, work, jobs = args.worker
        worker(fixture, Path(pristine), Path(work), Path(jobs))
        return 0
    result = campaign(args.flips, args.seed)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
        return 0
    for name, counts in [*result["fixtures"].items(), ("total", result["total"])]:
        line = ", ".join(f"{key} {counts[key]}" for key in COUNTS)
        sys.stdout.write(f"{name:>13}: {line}\n")
        for example in counts.get("examples", []):
            sys.stdout.write(f"               {example}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
