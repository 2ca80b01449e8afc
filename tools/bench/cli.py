"""The command line: run workloads (``--only``, ``--quick``, ``--rounds``, ``--profile``,
``--json``), or render a saved run (``--markdown``, ``--plot``); ``--docs`` writes the Markdown
tables into docs/performance.md (between its markers) instead of printing them, and the
README's performance section from them (`summary`); ``--docs`` alone rewrites that section
from the tables the page holds."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

from . import __doc__ as OVERVIEW
from . import real_seed, workloads  # noqa: F401  registers the workloads
from .harness import WORKLOADS, Options, log
from .report import between, into_page, load, markdown, render, save
from .summary import BEGIN as README_BEGIN
from .summary import END as README_END
from .summary import read_tables, summary

DEFAULT_PNG = Path(__file__).resolve().parents[1] / "bench.png"   # tools/bench.png
DEFAULT_DOCS = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
DEFAULT_README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_DATA = Path(__file__).resolve().parents[2] / ".bench-data"   # git-ignored


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of GB > 0, got {text!r}")
    return value


def build_parser(prog: str = "bench.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=OVERVIEW.split("\n\n")[0],
        epilog="workloads: " + "; ".join(f"{w.name}: {w.help}" for w in WORKLOADS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", metavar="W1,W2", help="comma-separated workloads to run (default: all): "
                        + ",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (smoke test)")
    parser.add_argument("--smoke", action="store_true",
                        help="tests only: --quick at the smallest sizes that run every step (numbers not worth "
                             "reading)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7, quick 3)")
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds each contender runs per round (default 0.3, quick 0.06)")
    parser.add_argument("--slices", type=int, default=6,
                        help="turns per round: contenders alternate in slices of min-time/slices (default 6)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocess probes")
    parser.add_argument("--profile", action="store_true",
                        help="print cProfiles of arrowbuf's timed operations (add, sample, export, ...)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="torch device of ONPOLICY's torch-arena rows (storage_device=; default: cuda when "
                             "available, else cpu)")
    parser.add_argument("--seed-repo", metavar="PATH", default=None,
                        help="RLightning checkout SEED drives as the real seed (default: $ARROWBUF_SEED_REPO, else "
                             ".rlightning/RLightning from tools/seed_checkout.py)")
    parser.add_argument("--mix-dataset-gb", type=_positive, default=None, metavar="N",
                        help="MIX also samples an IPC dataset of about N GB (larger than RAM if you like), built once "
                             "in --mix-dataset-dir and reused (about 2N GB on disk with its cache): batches/s and "
                             "peak RSS against a small dataset in RAM (default: off)")
    parser.add_argument("--mix-dataset-dir", metavar="PATH", default=str(DEFAULT_DATA),
                        help=f"where --mix-dataset-gb builds and keeps its datasets (default {DEFAULT_DATA})")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument("--markdown", nargs="?", const="", metavar="JSON",
                        help="print the results as Markdown tables (of this run, or of a saved JSON run, then exit)")
    parser.add_argument("--docs", nargs="?", const=str(DEFAULT_DOCS), metavar="PAGE",
                        help=f"with --markdown: write the tables into PAGE (default {DEFAULT_DOCS}) between its "
                             "'bench tables' markers instead of printing them, then the README's performance "
                             "section from them (a full run's: its headline ratios, the targets not met, its date); "
                             "alone: rewrite that section from the tables PAGE holds")
    parser.add_argument("--readme", metavar="PATH", default=str(DEFAULT_README),
                        help=f"the README whose 'bench summary' section --docs writes (default {DEFAULT_README})")
    parser.add_argument("--plot", metavar="JSON", help="draw the ratios of a saved JSON run as a bar chart and exit")
    parser.add_argument("--png", metavar="PATH", default=str(DEFAULT_PNG),
                        help=f"where --plot writes the chart (default {DEFAULT_PNG})")
    parser.add_argument("--_probe", help=argparse.SUPPRESS)
    return parser


def run(names: Sequence[str], opts: Options) -> tuple[list, dict]:
    """Run the named workloads; returns their results and the run's metadata."""
    meta = {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d", time.gmtime()), "quick": opts.quick, "smoke": opts.smoke, "rounds": opts.rounds,
            "min_time": opts.min_time, "slices": opts.slices, "python": platform.python_version(),
            "cpus": os.cpu_count(), "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    for mod in ("numpy", "torch", "pyarrow", "tensordict", "torchrl", "arrowbuf"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception as err:  # noqa: BLE001  a missing peer is reported, not fatal here
            meta[mod] = f"unavailable: {err}"
    start = time.perf_counter()
    results = []
    for n in names:
        log(f"running {n} ({'smoke' if opts.smoke else 'quick' if opts.quick else 'full'})")
        w = WORKLOADS[n]
        results.append(w.run(w.spec(opts.quick, opts.smoke), opts))
    meta["seconds"] = time.perf_counter() - start
    meta["loadavg_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return results, meta


def publish(tables: str, page: str | None, readme: str, parser: argparse.ArgumentParser) -> None:
    """Print the Markdown tables, or write them into ``page`` between its markers and the
    README's performance section from them (left as it is, with a note, for a run that is not
    a full one)."""
    if page is None:
        print(tables, end="")
        return
    path = Path(page)
    try:
        path.write_text(into_page(path.read_text(), tables))
    except (OSError, ValueError) as err:
        parser.error(f"--docs {page}: {err}")
    log(f"wrote the tables into {page}")
    try:
        section = summary(read_tables(tables))
    except ValueError as err:
        log(f"left the performance section of {readme} as it is: {err}")
        return
    write_readme(section, readme, parser)


def publish_readme(page: str, readme: str, parser: argparse.ArgumentParser) -> None:
    """Write the README's performance section from the tables ``page`` holds."""
    try:
        section = summary(read_tables(between(Path(page).read_text())))
    except (OSError, ValueError) as err:
        parser.error(f"--docs {page}: {err}")
    write_readme(section, readme, parser)


def write_readme(section: str, readme: str, parser: argparse.ArgumentParser) -> None:
    path = Path(readme)
    try:
        path.write_text(into_page(path.read_text(), section, (README_BEGIN, README_END)))
    except (OSError, ValueError) as err:
        parser.error(f"--readme {readme}: {err}")
    log(f"wrote the performance section of {readme}")


def main(argv: Sequence[str] | None = None, prog: str = "bench.py") -> int:
    """Entry of ``python tools/bench.py`` and ``arrowbuf bench``."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    real_seed.request(args.seed_repo)
    if args._probe:
        wname, contender = args._probe.split(":")
        workload = WORKLOADS[wname]
        print(json.dumps(workload.probe(workload.spec(args.quick, args.smoke), contender)))
        return 0
    if args.list:
        for w in WORKLOADS.values():
            print(f"{w.name}: {w.help}\n    full: {w.full.describe()}\n    quick: {w.quick.describe()}")
        return 0
    if args.docs is not None and args.markdown is None:   # the README's section from the page's tables
        if args.only or args.quick or args.smoke or args.json:
            parser.error("--docs without --markdown rewrites the README's performance section from the page's "
                         "tables, it runs nothing: to write a run's tables, pass --markdown too")
        publish_readme(args.docs, args.readme, parser)
        return 0
    if args.markdown:
        publish(markdown(*load(args.markdown)), args.docs, args.readme, parser)
    if args.plot:
        from .plot import plot

        plot(*load(args.plot), args.png)
        log(f"wrote {args.png}")
    if args.markdown or args.plot:
        return 0
    names = list(WORKLOADS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    quick = args.quick or args.smoke
    opts = Options(quick=quick, rounds=args.rounds or (3 if quick else 7),
                   min_time=args.min_time or (0.06 if quick else 0.3), slices=max(1, args.slices),
                   memory=not args.no_memory, profile=args.profile, device=args.device,
                   mix_dataset_gb=args.mix_dataset_gb, mix_dataset_dir=args.mix_dataset_dir, smoke=args.smoke)
    results, meta = run(names, opts)
    render(results, meta)
    if args.json:
        save(args.json, results, meta)
        log(f"wrote {args.json}")
    if args.markdown is not None:   # after the save: a page it cannot write loses no run
        publish(markdown(results, meta), args.docs, args.readme, parser)
    return 0
