"""How much of a rollout a store of exactly the rollout's size holds (issue 33).

For each ``envs x T``, a store of ``capacity=envs * T`` (local, Ray with 1 and with 2
shards) is fed 3 rollouts of T vectorized steps, episodes ending at random (5% a
step); between rollouts the store is cleared. ``per-rollout``: a new writer each
rollout, flushed at its end; ``across``: one writer for all rollouts, flushed at each
end. Prints, per rollout, the transitions held after the flush over those written
(every one should be held: `capacity` counts transitions). Counts only, no timings.

Usage:
    python tools/capacity_held.py                     # all sizes, local and Ray
    python tools/capacity_held.py --sizes 4x150 --no-ray
"""

from __future__ import annotations

import argparse

import numpy as np

import arrowbuf as ab

SIZES = ["4x150", "16x64", "64x32", "512x24"]


def rollouts(store: ab.ExperienceStore, envs: int, steps: int, one_writer: bool, seed: int = 0) -> list[tuple[int, int]]:
    """(held, written) after each of 3 rollouts, `clear()` between them."""
    rng = np.random.default_rng(seed)
    out = []
    writer = store.writer(num_envs=envs, autoreset_mode="disabled") if one_writer else None
    obs = np.zeros((envs, 3), np.float32)
    for rollout in range(3):
        if not one_writer:
            writer = store.writer(num_envs=envs, autoreset_mode="disabled")
        for _ in range(steps):
            nxt = obs + 1
            writer.add(obs=obs, action=np.zeros(envs, np.int64), reward=np.ones(envs, np.float32),
                       terminated=rng.random(envs) < 0.05, truncated=np.zeros(envs, bool), next_obs=nxt)
            obs = nxt
        writer.flush()
        if not one_writer:
            writer.close()
        store.flush()
        out.append((len(store), envs * steps))
        if rollout < 2:
            store.clear()
    if one_writer:
        writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=SIZES)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    backends = [("local", {})]
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        backends += [("ray x1", {"backend": "ray", "num_shards": 1}), ("ray x2", {"backend": "ray", "num_shards": 2})]
    print(f"{'envs x T':>9} {'backend':>7} {'writer':>11}  held/written per rollout")
    for size in args.sizes:
        envs, steps = (int(x) for x in size.split("x"))
        for name, kwargs in backends:
            for one_writer in (False, True):
                store = ab.ExperienceStore(capacity=envs * steps, seed=0, **kwargs)
                try:
                    held = rollouts(store, envs, steps, one_writer)
                finally:
                    store.close()
                cells = "  ".join(f"{h:,}/{w:,}" for h, w in held)
                print(f"{size:>9} {name:>7} {'across' if one_writer else 'per-rollout':>11}  {cells}", flush=True)


if __name__ == "__main__":
    main()
