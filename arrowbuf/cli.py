"""The `arrowbuf` command line: `arrowbuf demo`."""

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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arrowbuf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train DQN on CartPole-v1 with an ExperienceStore as replay buffer")
    demo.add_argument("--steps", type=int, default=None, help="environment steps over all envs")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--num-envs", type=int, default=None)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
