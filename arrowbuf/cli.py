"""The `arrowbuf` command line: `arrowbuf demo`, `arrowbuf inspect`, `arrowbuf bench`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def _demo(args: argparse.Namespace) -> int:
    from arrowbuf.demo import run_demo

    result = run_demo(total_steps=args.steps, seed=args.seed, num_envs=args.num_envs, progress=not args.quiet)
    print(f"steps={result.steps} episodes={result.episodes} "
          f"mean_return_last20={result.mean_return_last20:.1f} "
          f"samples_per_s={result.samples_per_second:,.0f} wall_s={result.wall_seconds:.1f}")
    if args.export is not None:
        path = result.store.to_parquet(args.export, progress=not args.quiet)
        print(f"exported {result.store.num_episodes} episodes to {path}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from arrowbuf.errors import FormatError
    from arrowbuf.inspect import plot_summary, print_summary

    try:
        print_summary(args.path)
        if args.plot is not None:
            plot_summary(args.path).savefig(args.plot, dpi=100)
            print(f"wrote {args.plot}")
    except FormatError as err:
        print(f"arrowbuf inspect: {err}", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace) -> int:
    from arrowbuf._bench_cli import run_bench

    return run_bench(args.args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arrowbuf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train DQN on CartPole-v1 with an ExperienceStore as replay buffer")
    demo.add_argument("--steps", type=int, default=None, help="environment steps over all envs")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--num-envs", type=int, default=None)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--export", metavar="DIR", default=None,
                      help="after the run, export the replay buffer to Parquet in DIR (a new directory)")
    demo.set_defaults(run=_demo)
    inspect = commands.add_parser("inspect", help="summarize a Parquet export or a checkpoint directory")
    inspect.add_argument("path", help="a directory written by store.to_parquet or store.save")
    inspect.add_argument("--plot", metavar="PNG", default=None, help="also write the returns / lengths figure")
    inspect.set_defaults(run=_inspect)
    # No option of its own (prefix_chars no argument starts with): every argument goes to the benchmark's parser.
    bench = commands.add_parser("bench", add_help=False, prefix_chars="\0",
                                help="run the benchmarks of a source checkout (tools/bench.py; `bench --help`)")
    bench.add_argument("args", nargs="*", help="arguments of tools/bench.py")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
