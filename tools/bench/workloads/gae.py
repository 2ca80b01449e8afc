"""GAE: ``compute_gae`` over a stored PPO rollout against per-step Python loops (issue 13:
over WBC's 98k transitions, >= 50x a per-step Python loop).

The rollouts are ONPOLICY's (WBC 4,096 envs x 24 steps, VLA 32 x 160), one episode
per env, none terminated: every episode bootstraps from the value of its final
observation. "WBC resets" is WBC with a 2% chance per step that an env's episode
terminates and the env resets (about 5,900 episodes of 1-24 steps, stored through a
step writer as a rollout is): ragged episodes, as humanoid training has, for
information (the target is judged on ONPOLICY's shape). arrowbuf's call includes what the API does for that: the final
observations gathered into a TensorDict for ``bootstrap_value`` (here a constant
0.5; a trainer's value network would run on them), the advantages and value
targets written to the store's columns. The loops get the bootstrap values as
given. Contenders:

- ``loop``: the textbook loop, every env, every step backwards, one Python
  iteration per transition, over the rollout's numpy arrays indexed per step (what
  the loop is over data held as arrays: the target's baseline);
- ``loop_floats``: the same over plain Python floats (the rollout converted to lists
  once, outside the timing): the fastest a per-step loop gets, for information;
- ``seed``: the seed's ``default_compute_gae`` (RLightning's buffer utils, without its
  advantage normalization): a loop over the time steps of ``[T, N]`` torch tensors,
  each step vectorized over the envs. It needs the rollout as one ``[T, N]`` grid
  (every env the same steps, nothing evicted), which the store does not assume;
  for information;
- ``arrowbuf``: ``store.compute_gae(gamma, lam, bootstrap_value=...)``.

The advantages are compared with the loop's once: a mismatch is a note.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..contenders import Arrowbuf
from ..harness import Options, Race, Workload, compare, flag_noisy, load_note, over, register, start_workload
from ..results import Metric, WorkloadResult
from ..rollout_contenders import ArrowbufRollout
from ..rollouts import RolloutShape, ingest_native, make_rollout, vla, wbc

GAMMA, LAMBDA = 0.99, 0.95
BOOTSTRAP = 0.5
TARGET = 50
CONTENDERS = ["loop", "loop_floats", "seed", "arrowbuf"]


class LoopGAE:
    """GAE of a time-major rollout (``[T, E]`` reward / value / terminated) by a loop over
    envs and steps; ``floats``: over Python lists instead of numpy arrays."""

    def __init__(self, rollout: Mapping[str, Any], floats: bool = False) -> None:
        def env_major(name: str, dtype: Any) -> Any:
            array = np.ascontiguousarray(np.asarray(rollout[name], dtype).T)
            return array.tolist() if floats else array
        self.reward = env_major("reward", np.float64)
        self.value = env_major("value", np.float64)
        self.terminated = env_major("terminated", bool)

    def __call__(self, bootstrap: list[float]) -> list[list[float]]:
        """Advantages, env-major ``[E][T]``; ``bootstrap[e]``: the value after env e's last step."""
        gamma, lam = GAMMA, LAMBDA
        out = []
        for reward, value, terminated, next_value in zip(self.reward, self.value, self.terminated, bootstrap):
            advantage = [0.0] * len(reward)
            gae = 0.0
            for t in range(len(reward) - 1, -1, -1):
                keep = 0.0 if terminated[t] else 1.0
                delta = reward[t] + gamma * next_value * keep - value[t]
                gae = delta + gamma * lam * keep * gae
                advantage[t] = gae
                next_value = value[t]
            out.append(advantage)
        return out


class SeedGAE:
    """The seed's time-step loop over ``[T, N]`` tensors (see the module docstring)."""

    def __init__(self, rollout: Mapping[str, Any]) -> None:
        import torch
        self.reward = rollout["reward"].to(torch.float32)
        self.value = rollout["value"].to(torch.float32)
        self.done = rollout["terminated"].to(torch.float32)

    def __call__(self, bootstrap: list[float]) -> Any:
        import torch
        steps, envs = self.reward.shape
        next_values = torch.cat([self.value[1:], torch.tensor(bootstrap, dtype=torch.float32)[None]])
        advantages = torch.zeros_like(self.reward)
        last = torch.zeros(envs)
        for t in reversed(range(steps)):
            delta = self.reward[t] + GAMMA * next_values[t] * (1.0 - self.done[t]) - self.value[t]
            advantages[t] = delta + GAMMA * LAMBDA * (1.0 - self.done[t]) * last
            last = advantages[t]
        return advantages, advantages + self.value


@dataclass(frozen=True)
class GAESpec:
    shapes: tuple[RolloutShape, ...]

    def short(self) -> str:
        return "compute_gae over a stored rollout; " + "; ".join(s.short() for s in self.shapes)

    def describe(self) -> str:
        return " | ".join(s.describe() for s in self.shapes)


def run_gae(spec: GAESpec, opts: Options) -> WorkloadResult:
    t0 = start_workload(Arrowbuf)
    import torch
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    metrics: list[Metric] = []
    for shape in spec.shapes:
        rollout = make_rollout(shape)
        loops = {"loop": LoopGAE(rollout), "loop_floats": LoopGAE(rollout, floats=True), "seed": SeedGAE(rollout)}
        if shape.terminations:   # ragged episodes, as a step writer stores them
            import arrowbuf as ab
            store = ab.ExperienceStore(2 * shape.envs * (shape.steps + 1), seed=0)
            ingest_native(store, shape, rollout, autoreset_mode="same_step")
        else:
            store = ArrowbufRollout(shape, rollout, 1).store
        del rollout
        bootstrap = [BOOTSTRAP] * shape.envs

        def arrowbuf_gae(store: Any = store) -> None:
            store.compute_gae(GAMMA, LAMBDA, value_key="value",
                              bootstrap_value=lambda final: torch.full((final.batch_size[0],), BOOTSTRAP))

        arrowbuf_gae()
        expected = np.asarray(loops["loop"](bootstrap))                        # [E, T]
        if shape.terminations:   # episodes in the order they ended: the same values, sorted
            rows = store.to_arrow()
            stored = rows.column("advantage").to_numpy()[~rows.column("is_last").to_numpy(zero_copy_only=False)]
            error = float(np.max(np.abs(np.sort(stored) - np.sort(expected.ravel())))) \
                if len(stored) == expected.size else float("inf")
        else:   # one episode per env, added in env order: episode ids are the env numbers
            got = store.sample(shape.transitions, keys=["advantage"])
            error = float(np.max(np.abs(got["advantage"].numpy()
                                        - expected[got["episode_id"].numpy(), got["step"].numpy()])))
        seed_error = float(np.max(np.abs(loops["seed"](bootstrap)[0].numpy().T - expected)))
        if max(error, seed_error) > 1e-3:
            notes.append(f"  BUG? {shape.name}: compute_gae (seed's loop) differs from the loop by up to "
                         f"{error:.3g} ({seed_error:.3g})")
        metric, = compare(f"GAE {shape.name}", [
            Race(f"{shape.name} compute_gae ({shape.transitions:,} transitions)", "ms",
                 {**{name: (lambda loop=loop: loop(bootstrap)) for name, loop in loops.items()},
                  "arrowbuf": arrowbuf_gae},
                 over("arrowbuf", *loops), per_call=True, scale=1e3),
        ], max(2, min(opts.rounds, 5)), opts.min_time, 2)
        judged = shape.transitions >= 90_000 and not shape.terminations   # the target: 98k, ONPOLICY's WBC
        metric.met = metric.ratios["arrowbuf/loop"].median >= TARGET if judged else None
        metric.target = f"arrowbuf/loop >= {TARGET}" if judged else "info"
        metrics.append(metric)
    flag_noisy("GAE", metrics, notes)
    notes.append(f"  ms = median time of one call; ratios are speed-ups; every episode bootstraps from {BOOTSTRAP}")
    notes.append(load_note(load_start))
    return WorkloadResult("GAE", spec.short(), spec.describe(), CONTENDERS, metrics, notes, time.perf_counter() - t0,
                          labels={"loop": "per-step loop (numpy)", "loop_floats": "per-step loop (floats)",
                                  "seed": "seed's [T, N] loop"},
                          ratio_columns=["arrowbuf/loop", "arrowbuf/loop_floats", "arrowbuf/seed"])


register(Workload(
    "GAE", "compute_gae over a stored rollout against per-step Python loops, WBC 4096x24 (also with resets) and VLA 32x160",
    full=GAESpec((wbc(4096), dataclasses.replace(wbc(4096, 0.02), name="WBC resets"), vla(32, 160))),
    quick=GAESpec((wbc(256), dataclasses.replace(wbc(256, 0.02), name="WBC resets"), vla(8, 40))),
    run=run_gae))
