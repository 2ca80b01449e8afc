"""The `arrowbuf` command line: `arrowbuf demo`, `arrowbuf inspect`, `arrowbuf bench`.

Bad arguments end like any argparse error: usage, one ``arrowbuf <command>:
error: ...`` line on stderr and exit status 2, never a traceback. Every check that
can fail is made before any work starts (a demo does not train for a minute to
find out that its export directory exists).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

from arrowbuf._version import __version__
from arrowbuf.demo import NUM_ENVS, TOTAL_STEPS


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        return value

    return parse


def _check_new_directory(parser: argparse.ArgumentParser, option: str, path: Path, overwrite: bool) -> None:
    """``path`` can become a new directory: its parent is a directory, and it does not
    exist (or is an empty directory, or ``overwrite``)."""
    if not path.parent.is_dir():
        parser.error(f"argument {option}: the parent directory of {path} does not exist")
    if path.exists() and not path.is_dir():
        parser.error(f"argument {option}: {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        parser.error(f"argument {option}: {path} exists and is not empty; pass --overwrite to replace it")


def _check_plot_path(parser: argparse.ArgumentParser, path: Path) -> None:
    """``path`` can take a figure: matplotlib is installed, knows the suffix, and the
    parent is a directory."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        parser.error("argument --plot: plots need matplotlib: pip install 'arrowbuf[plot]'")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        parser.error(f"argument --plot: {path} has no image suffix matplotlib writes; expected one of "
                     f"{', '.join('.' + f for f in sorted(formats))}")
    if not path.parent.is_dir():
        parser.error(f"argument --plot: the directory of {path} does not exist")
    if path.is_dir():
        parser.error(f"argument --plot: {path} is a directory; expected an image file name")


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.export is not None:
        _check_new_directory(parser, "--export", Path(args.export), args.overwrite)
    from arrowbuf.demo import run_demo

    result = run_demo(total_steps=args.steps, seed=args.seed, num_envs=args.num_envs, progress=not args.quiet)
    print(f"steps={result.steps} episodes={result.episodes} "
          f"mean_return_last20={result.mean_return_last20:.1f} "
          f"samples_per_s={result.samples_per_second:,.0f} wall_s={result.wall_seconds:.1f}")
    if args.export is not None:
        path = result.store.to_parquet(args.export, progress=not args.quiet, overwrite=args.overwrite)
        print(f"exported {result.store.num_episodes} episodes to {path}")
    return 0


def _inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from arrowbuf.errors import FormatError
    from arrowbuf.inspect import plot_summary, print_summary

    if args.plot is not None:
        _check_plot_path(parser, Path(args.plot))
    try:
        print_summary(args.path)
        if args.plot is not None:
            plot_summary(args.path).savefig(args.plot, dpi=100)
            print(f"wrote {args.plot}")
    except FormatError as err:
        print(f"arrowbuf inspect: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:   # the file system refused the figure after the checks passed
        parser.error(f"argument --plot: cannot write {args.plot}: {err}")
    return 0


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from arrowbuf._bench_cli import run_bench

    return run_bench(args.args)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the `arrowbuf` command and its subcommands."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="arrowbuf", description=__doc__.split("\n\n")[0], formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,inspect,bench}")
    demo = commands.add_parser("demo", formatter_class=formatter,
                               help="train DQN on CartPole-v1 with an ExperienceStore as replay buffer",
                               description="Train DQN on CartPole-v1 with an ExperienceStore as replay buffer.")
    demo.add_argument("--steps", type=_int_at_least(1), default=TOTAL_STEPS, help="environment steps over all envs")
    demo.add_argument("--seed", type=_int_at_least(0), default=0, help="seed of the envs, networks and sampling")
    demo.add_argument("--num-envs", type=_int_at_least(1), default=NUM_ENVS, help="vectorized CartPole envs")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--export", metavar="DIR", default=None,
                      help="after the run, export the replay buffer to Parquet in DIR (a new or empty directory, "
                           "checked before training)")
    demo.add_argument("--overwrite", action="store_true", help="replace an existing --export DIR")
    demo.set_defaults(run=_demo, parser=demo)
    inspect = commands.add_parser("inspect", formatter_class=formatter,
                                  help="summarize a Parquet export or a checkpoint directory",
                                  description="Summarize a Parquet export or a checkpoint directory.")
    inspect.add_argument("path", help="a directory written by store.to_parquet or store.save")
    inspect.add_argument("--plot", metavar="PNG", default=None,
                         help="also write the returns / lengths figure to this image file")
    inspect.set_defaults(run=_inspect, parser=inspect)
    # No option of its own (prefix_chars no argument starts with): every argument goes to the benchmark's parser.
    bench = commands.add_parser("bench", add_help=False, prefix_chars="\0",
                                help="run the benchmarks of a source checkout (tools/bench.py; `bench --help`)")
    bench.add_argument("args", nargs="*", help="arguments of tools/bench.py")
    bench.set_defaults(run=_bench, parser=bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits with 2 on bad arguments)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args.parser, args)


if __name__ == "__main__":
    sys.exit(main())
