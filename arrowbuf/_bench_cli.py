"""`arrowbuf bench`: runs the benchmark package ``tools/bench`` of the source checkout.

The benchmarks are not part of the installed library (they import TorchRL and
Ray, and hold baselines no user needs), so ``arrowbuf bench`` finds ``tools/``
next to this package, as an editable install (``pip install -e .``) or a
checkout on ``PYTHONPATH`` has it, and runs ``bench.cli.main`` with the same
arguments as ``python tools/bench.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def run_bench(argv: Sequence[str]) -> int:
    """``python tools/bench.py *argv``; 2 with a message where there is no ``tools/bench``."""
    if not (TOOLS / "bench" / "cli.py").is_file():
        print(f"arrowbuf bench: no benchmark package at {TOOLS / 'bench'}; it ships with the source, not the "
              "wheel: clone the repository and `pip install -e .` (or run `python tools/bench.py` there)",
              file=sys.stderr)
        return 2
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    from bench.cli import main

    return main(list(argv), prog="arrowbuf bench")
