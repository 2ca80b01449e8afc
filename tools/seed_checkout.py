"""Check out RLightning (the real seed) into a git-ignored directory for the benchmark.

    python tools/seed_checkout.py [--mirror PATH|URL] [--dest .rlightning]

puts the repository's source at ``<dest>/RLightning`` (a plain clone, never
committed: ``.rlightning/`` is in .gitignore) and installs the few packages its
buffer imports that arrowbuf's environment lacks (intervaltree, pydantic,
omegaconf, codetiming) into ``<dest>/site`` with ``pip install --target``, so
the virtual environment itself is left unchanged. ``tools/bench.py`` finds the
checkout there, or where ``--seed-repo`` / ``ARROWBUF_SEED_REPO`` points.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MIRROR = "/work/.mirror/zyc-bit+RLightning/repo"
#: What ``rlightning.buffer`` (and the types, config and example hooks it uses) imports beyond arrowbuf's deps.
SEED_DEPS = {"intervaltree": "intervaltree", "pydantic": "pydantic", "omegaconf": "omegaconf",
             "codetiming": "codetiming"}


def missing_deps() -> list[str]:
    return [package for module, package in SEED_DEPS.items() if importlib.util.find_spec(module) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help=f"git repository to clone (default {DEFAULT_MIRROR})")
    parser.add_argument("--dest", default=str(ROOT / ".rlightning"), help="where to put it (default .rlightning/)")
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    repo = dest / "RLightning"
    dest.mkdir(parents=True, exist_ok=True)
    if (repo / "rlightning" / "buffer").is_dir():
        subprocess.run(["git", "-C", str(repo), "pull", "--ff-only", "-q"], check=False)
    else:
        subprocess.run(["git", "clone", "-q", args.mirror, str(repo)], check=True)
    deps = missing_deps()
    if deps:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(dest / "site"), *deps],
                       check=True)
    head = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    print(f"RLightning at {repo} ({head.stdout.strip()}); extra packages: {deps or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
