#!/usr/bin/env python
"""Entry of the arrowbuf benchmarks (the package ``tools/bench/``; see its docstring or ``--help``)."""

import sys

from bench.cli import main   # this file's directory, tools/, is sys.path[0]: the package wins over this module

if __name__ == "__main__":
    sys.exit(main())
