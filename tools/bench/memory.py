"""Process memory: RSS now and at peak, and the per-contender probes run in child processes.

A probe runs in a fresh process (this benchmark's entry with a hidden flag), so
that one contender's allocations do not hide another's: the peak RSS growth
(VmHWM, reset once the inputs are built) over a lap and a tenth plus some
samples, divided by the raw bytes of the rows stored.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .harness import Options, log
from .results import Metric, Series

ENTRY = Path(__file__).resolve().parents[1] / "bench.py"   # tools/bench.py, the script that runs a probe


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def private_bytes() -> int:
    """Private memory of this process now (USS: its private clean and dirty pages), or RSS where
    /proc/self/smaps_rollup is missing."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f
                       if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except OSError:
        return rss_bytes()


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size (VmHWM) of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_probe(workload: str, contender: str, quick: bool, smoke: bool = False) -> dict[str, Any]:
    """The probe's JSON answer, from a child process (of the same spec as the run's)."""
    cmd = ([sys.executable, str(ENTRY), "--_probe", f"{workload}:{contender}"] + (["--quick"] if quick else [])
           + (["--smoke"] if smoke else []))
    log(f"  {workload}: memory probe {contender} (fresh process)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {workload}:{contender} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: Workloads probed in this run. A smoke run (the tests) probes arrowbuf in the first only:
#: every probe runs the same code in a fresh process that imports torch, tensordict and
#: TorchRL (~3.5 s each), and W1 and W2's six took 21 of their 23 s (W1's five, 10 s).
_probed: list[str] = []


def memory_metric(workload: str, contenders: Sequence[tuple[str, bool]], opts: Options,
                  limit: float) -> Metric:
    """"peak RSS / raw bytes" of each (contender, probed) pair; arrowbuf's must be <= ``limit``."""
    values: dict[str, Series | float | None] = {}
    detail: dict[str, Any] = {}
    skip = opts.smoke and bool(_probed)
    _probed.append(workload)
    for name, probed in contenders:
        if not probed or skip or (opts.smoke and name != "arrowbuf"):
            values[name] = None
            continue
        probe = run_probe(workload, name, opts.quick, opts.smoke)
        detail[name] = probe
        values[name] = probe["peak_delta"] / probe["raw_bytes"]
    ratio = values["arrowbuf"]
    if skip:
        detail["smoke"] = f"not probed: a smoke run probes its first workload only ({_probed[0]})"
    elif opts.smoke:
        detail["smoke"] = "a smoke run probes arrowbuf only"
    return Metric("peak RSS / raw bytes", "x", values, {}, target=f"arrowbuf <= {limit}",
                  met=ratio is not None and ratio <= limit, detail=detail)


def heap_probe(sample: Callable[[], Any], column: Any, baseline: int, private: int, exact: bool, **counts: Any
               ) -> dict[str, Any]:
    """A heap column's probe (IMAGES, TOKENS), once its store is filled: the memory taken since
    ``baseline`` (RSS) and ``private`` (USS), the heap's live and allocated bytes, then 20 calls of
    ``sample`` and the private memory after them; ``counts`` (rows held, episodes added...) as given."""
    gc.collect()
    rss, own, peak = rss_bytes(), private_bytes(), peak_rss_bytes()
    samples = 20
    for _ in range(samples):
        sample()
    gc.collect()
    return {**counts, "heap_live": int(column.heap.live), "heap_allocated": int(column.heap.allocated),
            "column_nbytes": int(column.nbytes), "rss_delta": rss - baseline, "private_delta": own - private,
            "peak_rss_delta": peak - baseline, "peak_reset": exact, "samples": samples,
            "private_after_samples": private_bytes() - private}
