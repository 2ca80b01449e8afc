"""Corruption campaign: flip bytes and truncate files of checkpoints and exports, then load them.

Three fixtures are written once: a local checkpoint (two incremental saves, a
prioritized sampler, an open writer episode), a Parquet export without
compression and one with zstd. Each corruption is a single byte replaced at a
sampled offset of one file (seeded), or a file cut short. Loads run in worker
subprocesses, many corruptions per worker, so a crash (SIGSEGV, SIGABRT) shows
as a negative return code and is counted against the corruption being loaded;
the worker is then restarted on a fresh copy for the rest. One worker runs the
corruptions of every fixture (each worker imports torch, for the sampled batch). Every outcome is one of:

- ``rejected``: `arrowbuf.FormatError` (what a corrupted file must give);
- ``same``: the load succeeded and gave exactly the saved data (rows, episode
  table, and for checkpoints the next sampled batch);
- ``untyped``: any other exception;
- ``wrong``: the load succeeded but the data differs, or fails on first use;
- ``crash``: the worker died.

Usage:
    python tools/corrupt.py --flips 2000 --seed 0
    python tools/corrupt.py --flips 2000 --reseal     # the checks behind the hashes

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


def _apply(directory: Path, job: dict[str, Any], reseal: bool) -> dict[Path, bytes]:
    """Corrupt one file in place (and with ``reseal`` make the manifest match it);
    returns the original bytes of every file changed."""
    file = directory / job["file"]
    originals = {file: file.read_bytes()}
    if "truncate" in job:
        file.write_bytes(originals[file][:job["truncate"]])
    else:
        data = bytearray(originals[file])
        data[job["offset"]] ^= job["xor"]
        file.write_bytes(bytes(data))
    if reseal:
        manifest = next(p for p in (directory / "manifest.json", directory / "_arrowbuf.json") if p.exists())
        originals.setdefault(manifest, manifest.read_bytes())
        _reseal(manifest, job["file"])
    return originals


def _reseal(manifest_path: Path, changed: str) -> None:
    """Record the changed file's size and hash in the manifest and seal it again,
    as an editor who knows the format would."""
    from arrowbuf import _persist

    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError:
        return                    # a manifest that no longer parses stays as it is

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if value.get("path") == changed and "sha256" in value:
                value.update(_persist.file_entry(manifest_path.parent / changed))
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    if isinstance(manifest, dict):
        walk(manifest)
        _persist.write_manifest(manifest_path, manifest)


def worker(pristine: Path, work: Path, jobs_file: Path, reseal: bool) -> None:
    """Load the fixture of each corruption of ``jobs_file`` (``work/<fixture>``, a copy of
    ``pristine/<fixture>``) once it is applied; one outcome per line on stdout."""
    import arrowbuf as ab

    expected: dict[str, str] = {}
    for job in json.loads(jobs_file.read_text()):
        fixture = job["fixture"]
        if fixture not in expected:
            expected[fixture] = fingerprint(fixture, pristine / fixture)
        originals = _apply(work / fixture, job, reseal)
        try:
            outcome = "same" if fingerprint(fixture, work / fixture) == expected[fixture] else "wrong"
        except ab.FormatError:
            outcome = "rejected"
        except Exception as err:   # anything else is what the campaign looks for
            outcome = f"untyped {type(err).__name__}: {str(err)[:200]}"
        for file, data in originals.items():
            file.write_bytes(data)
        print(json.dumps(outcome), flush=True)


def run_jobs(pristine: Path, jobs: list[dict[str, Any]], scratch: Path, reseal: bool = False,
             batch: int = 400) -> dict[str, dict[str, Any]]:
    """Run ``jobs`` (each naming its fixture, a directory of ``pristine``) in worker subprocesses,
    one at a time (each imports torch: seconds); the counts and examples of each fixture."""
    fixtures = list(dict.fromkeys(job["fixture"] for job in jobs))
    results = {f: {**dict.fromkeys(OUTCOMES, 0), "examples": [], "untyped_or_wrong_by_file": {}} for f in fixtures}
    done = 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    while done < len(jobs):
        work = scratch / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        todo = jobs[done:done + batch]
        jobs_file = scratch / "jobs.json"
        jobs_file.write_text(json.dumps(todo))
        proc = subprocess.run([sys.executable, __file__, "--worker", str(pristine), str(work), str(jobs_file),
                               *(["--reseal"] if reseal else [])], capture_output=True, text=True, env=env)
        outcomes = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('"')]
        for job, outcome in zip(todo, outcomes):
            kind = outcome.split(" ", 1)[0]
            result = results[job["fixture"]]
            result[kind] += 1
            if kind in ("untyped", "wrong"):
                result["examples"].append(f"{job}: {outcome}")
                by_file = result["untyped_or_wrong_by_file"]
                by_file[job["file"].split("-")[0]] = by_file.get(job["file"].split("-")[0], 0) + 1
        done += len(outcomes)
        if len(outcomes) < len(todo):
            if proc.returncode >= 0:    # the harness failed, not the load: no signal killed the worker
                raise RuntimeError(f"worker failed (return code {proc.returncode}):\n{proc.stderr[-2000:]}")
            crashed = todo[len(outcomes)]
            results[crashed["fixture"]]["crash"] += 1
            results[crashed["fixture"]]["examples"].append(f"{crashed}: crash (return code {proc.returncode})")
            done += 1
    for fixture, result in results.items():
        mine = [job for job in jobs if job["fixture"] == fixture]
        truncations = sum("truncate" in job for job in mine)
        result.update(tried=len(mine), flips=len(mine) - truncations, truncations=truncations)
    return results


def campaign(flips: int, seed: int = 0, root: Path | None = None, reseal: bool = False,
             fixtures: tuple[str, ...] = FIXTURES) -> dict[str, Any]:
    """Write the fixtures, corrupt them and load every corruption; counts per fixture and total.

    With ``reseal`` every corruption is followed by a manifest that matches it
    (sizes, hashes, checksum): the hashes no longer catch it, so this tries the
    checks behind them (Arrow validation, page checksums, state domains). A
    flipped value in a data buffer then loads as written (``wrong``): only
    crashes and untyped errors count against arrowbuf there.
    """
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(root or tmp)
        paths = write_fixtures(base / "pristine")
        jobs = [{"fixture": fixture, **job} for k, fixture in enumerate(fixtures)
                for job in plan(paths[fixture], flips // len(fixtures) + (k < flips % len(fixtures)), seed + k)]
        results = run_jobs(base / "pristine", jobs, base, reseal)
        total = {key: sum(r[key] for r in results.values()) for key in COUNTS}
        return {"fixtures": results, "total": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--flips", type=int, default=2000, help="byte flips in total, across the fixtures")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled offsets and bytes")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--reseal", action="store_true",
                        help="make the manifest match each corruption (tests the checks behind the hashes)")
    parser.add_argument("--worker", nargs=3, metavar=("PRISTINE", "WORK", "JOBS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        pristine, work, jobs = args.worker
        worker(Path(pristine), Path(work), Path(jobs), args.reseal)
        return 0
    result = campaign(args.flips, args.seed, reseal=args.reseal)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
        return 0
    for name, counts in [*result["fixtures"].items(), ("total", result["total"])]:
        line = ", ".join(f"{key} {counts[key]}" for key in COUNTS)
        sys.stdout.write(f"{name:>13}: {line}\n")
        if counts.get("untyped_or_wrong_by_file"):
            sys.stdout.write(f"               untyped or wrong, by file: {counts['untyped_or_wrong_by_file']}\n")
        for example in counts.get("examples", [])[:10]:
            sys.stdout.write(f"               {example}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
