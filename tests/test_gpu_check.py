"""tools/gpu_check.py runs its steps on the CPU too (--device cpu), so it is never dead code.

Its ``main`` runs in this process (the script's entry is ``sys.exit(main())``): a process of its own
would import torch again, seconds of the suite; the steps it runs are still subprocesses of their own.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def gpu_check(capsys: pytest.CaptureFixture, *args: str) -> Done:
    """``python tools/gpu_check.py *args``, its ``main`` called here: its exit code and what it printed."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main(list(args))
    out, err = capsys.readouterr()
    return Done(code, out, err)


def test_gpu_check_on_the_cpu_runs_the_arena_tests_and_the_torch_arena_bench_rows(tmp_path, capsys):
    # --select: a few of the arena tests (the suite runs them all itself), through the same steps
    done = gpu_check(capsys, "--device", "cpu", "--quick", "--smoke", "--min-time", "0.01", "--out", str(tmp_path),
                     "--select", "numpy_arena_samples")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    tests, = [line for line in lines if line.startswith("tests (tests/test_arena.py -k numpy_arena_samples): ")]
    passed = int(tests.split(": ")[1].split(" passed")[0])
    assert passed >= 1 and " 0 failed, 0 errors (exit 0" in tests
    for shape in ("WBC", "VLA"):
        row, = [line for line in lines if line.startswith(f"  {shape} rollout sample, torch arena (cpu) ms: ")]
        assert "arrowbuf_torch/ideal" in row
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["meta"]["argv"][:4] == ["--only", "ONPOLICY", "--device", "cpu"]
    assert "passed" in (tmp_path / "pytest.txt").read_text()
    assert lines[-1].startswith("gpu_check: ok")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_check_without_cuda_refuses_the_cuda_device_and_names_the_cpu_flag(capsys):
    done = gpu_check(capsys)
    assert done.returncode == 2
    assert "torch sees no CUDA device (use --device cpu)" in done.stderr
