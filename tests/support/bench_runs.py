"""Runs of tools/bench.py for the bench tests (tests/test_bench.py, tests/test_bench_workloads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    """``python tools/bench.py *args`` from the repository root, this checkout's arrowbuf first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "tools/bench.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)


def quick_run(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    """A quick run at the smoke sizes (where a workload has them) and 10 ms turns: only its report is checked."""
    path = tmp_path_factory.mktemp(name) / "run.json"
    run = bench("--quick", "--only", name, "--rounds", "2", "--smoke", "--min-time", "0.01", "--json", str(path))
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(path.read_text())


def headline_ratios(saved: dict, workload: str) -> dict[tuple[str, str], list[float]]:
    """(metric, ratio column) -> the per-round ratios of each headline ratio the run measured."""
    result, = [w for w in saved["workloads"] if w["name"] == workload]
    return {(m["name"], col): m["ratios"][col]["rounds"] for m in result["metrics"] for col in result["ratio_columns"]
            if col in m["ratios"]}
