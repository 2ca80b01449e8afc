"""The checks that need a GPU, in one short run: the CUDA tests and the ONPOLICY torch-arena rows.

Runs, each in a subprocess with a time limit:

1. ``pytest -m cuda`` over the test files that mark any: the tests marked ``cuda`` (the torch arena on a CUDA device,
   pinned slots reused once their copy to the GPU is done, ...); without CUDA they
   skip, and ``--device cpu`` adds ``tests/test_arena.py``, the same arena on the CPU.
2. ``tools/bench.py --only ONPOLICY --device DEVICE``: the whole-rollout sample from a
   torch arena (``storage_device=DEVICE``) against the numpy ideal, and with CUDA the
   numpy arena sampled to ``device="cuda"``.

then prints a compact summary (tests passed / skipped / failed, one line per bench
row) and exits non-zero if a test failed or a step did not finish.

    python tools/gpu_check.py                  # on a GPU machine: device cuda, full sizes
    python tools/gpu_check.py --device cpu --quick   # anywhere: the same steps on the CPU
    python tools/gpu_check.py --out results/   # also keep the pytest log and the bench JSON
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(exit code or None when it ran out of time, stdout + stderr, seconds) of ``command`` in the repo root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        return done.returncode, done.stdout + done.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return None, out, time.perf_counter() - start


def test_counts(output: str) -> dict[str, int]:
    """passed / skipped / failed / error counts from pytest's last summary line."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line)]
    counts = {"passed": 0, "skipped": 0, "failed": 0, "error": 0}
    for number, word in re.findall(r"(\d+) (passed|skipped|failed|errors?)", lines[-1] if lines else ""):
        counts["error" if word.startswith("error") else word] += int(number)
    return counts


def bench_rows(saved: dict) -> list[str]:
    """One line per ONPOLICY metric: the torch-arena rows in full, the others by arrowbuf keys= / ideal."""
    rows = []
    for workload in saved.get("workloads", []):
        for metric in workload["metrics"]:
            values = {c: v["median"] for c, v in metric["values"].items() if isinstance(v, dict)}
            ratios = {k: v["median"] for k, v in metric["ratios"].items()}
            times = " ".join(f"{c}={v:,.1f}" for c, v in values.items() if c in ("ideal", "arrowbuf_keys",
                                                                                  "arrowbuf_torch", "arrowbuf_cuda"))
            shown = {k: v for k, v in ratios.items()
                     if k in ("arrowbuf_keys/ideal", "arrowbuf_torch/ideal", "arrowbuf_torch/arrowbuf_keys",
                              "arrowbuf_cuda/ideal")}
            met = {True: "met", False: "NOT met", None: ""}[metric["met"]]
            rows.append(f"  {metric['name']} {metric['unit']}: {times}; "
                        + ", ".join(f"{k} {v:.2f}" for k, v in shown.items()) + f"  [{met}]")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="the torch device to check (default cuda; cpu runs the same steps without a GPU)")
    parser.add_argument("--quick", action="store_true", help="the bench's quick sizes and 2 rounds")
    parser.add_argument("--smoke", action="store_true",
                        help="with --quick, the bench's smoke sizes (the suite's own test of this script)")
    parser.add_argument("--timeout", type=float, default=270.0, help="seconds each step may take (default 270)")
    parser.add_argument("--min-time", type=float, default=None, metavar="SECONDS",
                        help="the bench's --min-time (default: the bench's own); the tests pass 0.01, as they check "
                             "that the rows are reported, not their numbers")
    parser.add_argument("--select", metavar="EXPR",
                        help="only the tests that pytest's -k EXPR selects (the suite's own test of this script runs "
                             "a few: the suite runs the rest itself)")
    parser.add_argument("--out", metavar="DIR", help="keep the pytest output and the bench JSON in DIR")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"gpu_check: torch {torch.__version__}, device {args.device} ({where})")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    failed = False

    # one process: `-o addopts=` drops the suite's `-n 2` (pytest-xdist may be missing on a GPU image)
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts="]
    # only the files that hold cuda tests: the others import Ray, gymnasium, TorchRL, which a bare GPU image lacks
    marked = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                    if "pytest.mark.cuda" in path.read_text())
    tests = [*pytest, "-m", "cuda", *marked] if args.device == "cuda" else [*pytest, "tests/test_arena.py"]
    tests += ["-k", args.select] if args.select else []
    code, output, seconds = run(tests, args.timeout)
    (out / "pytest.txt").write_text(output)
    counts = test_counts(output)
    failed |= code not in (0, 5) or counts["failed"] > 0 or counts["error"] > 0   # 5: nothing collected
    status = "timed out" if code is None else f"exit {code}"
    print(f"tests ({' '.join(tests[len(pytest):])}): {counts['passed']} passed, {counts['skipped']} skipped, "
          f"{counts['failed']} failed, {counts['error']} errors ({status}, {seconds:.0f} s)")
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            print(f"  {line}")

    saved_path = out / "bench.json"
    bench = [sys.executable, "tools/bench.py", "--only", "ONPOLICY", "--device", args.device, "--no-memory",
             "--json", str(saved_path), *(["--quick", "--rounds", "2"] if args.quick else ["--rounds", "3"]),
             *(["--smoke"] if args.smoke and args.quick else []),
             *(["--min-time", str(args.min_time)] if args.min_time else [])]
    code, output, seconds = run(bench, args.timeout)
    (out / "bench.txt").write_text(output)
    if code != 0 or not saved_path.exists():
        failed = True
        print(f"bench ({' '.join(bench[1:])}): {'timed out' if code is None else f'exit {code}'} after "
              f"{seconds:.0f} s\n" + "\n".join(f"  {line}" for line in output.splitlines()[-8:]))
    else:
        print(f"bench ({' '.join(bench[1:])}, {seconds:.0f} s): ms per call, ratios are speed-ups")
        print("\n".join(bench_rows(json.loads(saved_path.read_text()))))
    print(f"gpu_check: {'FAILED' if failed else 'ok'}; logs in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
