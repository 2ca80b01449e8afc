"""SEED: RLightning's engines through the real seed, ``arrowbuf.compat.DataBuffer`` and the native writer.

First rows (issue 25 item 5): whole rollouts (ingest, sample, the trainer's PPO
minibatches) as RSLRLEngine (WBC) and SyncRLEngine (VLA) run them, through
RLightning's own ``RolloutBuffer`` with its shipped configs and example hooks
(`seed_engines`, `real_seed`), compat (fed RLightning's own types) and the
native writer: in steady state (one buffer each, >= 5 rollouts, the first left
out) and with a fresh buffer per rollout; compat/seed and native/seed time
ratios, and each contender's ingest max/min over the steady rollouts. Without
an RLightning checkout (``tools/seed_checkout.py``, ``--seed-repo``,
``ARROWBUF_SEED_REPO``) the seed's columns stay empty and a note says why.

Then compat against the native writer alone (issue 12). The same rollout (`rollouts.make_rollout`, torch tensors as local envs and
policies hand them over) goes both ways:

- WBC (RSLRLEngine, wbc_tracking: unit episode, ``batch`` sampler,
  ``auto_truncate_episode``), 4,096 envs x 24 steps with about 1/500
  terminations per step: per step ``add_batched_data_async`` of the env
  returns, then of the policy responses; the final records, then
  ``truncate_episodes``. Native: ``store.writer(num_envs,
  autoreset_mode="same_step")`` (IsaacLab resets inside the step), one ``add``
  per step, ``flush``. Metric: ingest env-steps/s; target compat/native >= 0.5.
  Also the same rollout as whole episodes (one per env): ``store.add_episodes``
  of [E, T, ...] arrays against E ``add_episode`` calls (batched/single > 1).
- VLA (SyncRLEngine, OpenVLA PPO: RolloutBuffer, ``all`` sampler), 32 envs x
  160 steps: ``add_batched_transition`` per step (truncation on the last), then
  ``sample(5120)``, which clears the buffer. Native: writer + flush, then
  ``store.sample(5120)`` and ``clear``. Metrics: ingest env-steps/s and the
  sample's time; target compat within 1.25x of native on both (ratio >= 0.8).
  Native ingest against one copy of the same bytes into a warm buffer (`CopyFloor`;
  target native/copy >= 0.8), and the first rollout into a new store, construction
  included, against that store's second (WBC and VLA; store of num_envs x T; target <= 2x).

Each call ingests one whole rollout into an empty buffer and times only the
part its metric counts (the clear or the ingest before a sample is not timed).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

from ..harness import Options, Race, Workload, at_least, compare, flag_noisy, load_note, log, profile_calls, \
    register, start_workload
from ..results import Metric, Series, WorkloadResult
from .. import real_seed
from ..rollouts import RolloutShape, episodes, ingest_native, make_rollout, vla, wbc
from ..seed_engines import race_rollouts

ENV = "env-worker-0"
RATIO = {"compat/native": ("compat", "native")}


@dataclass(frozen=True)
class SeedSpec:
    """The WBC and VLA rollouts, and the batch the VLA trainer samples."""

    wbc: RolloutShape
    vla: RolloutShape

    def short(self) -> str:
        return (f"the real seed vs arrowbuf.compat vs the native writer: {self.wbc.short()}; "
                f"{self.vla.short()}")

    def describe(self) -> str:
        return (f"{self.wbc.describe()}, terminations {self.wbc.terminations:.2%} per step (RSLRLEngine, "
                f"add_batched_data_async, auto-truncate) | {self.vla.describe()} (SyncRLEngine, "
                f"add_batched_transition, then sample({self.vla.transitions}))")


class CompatRollout:
    """A compat ``DataBuffer`` driven as an RLightning engine drives it, over prebuilt env returns and responses."""

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], config: dict, engine: str,
                 autoreset_mode: str = "next_step") -> None:
        import torch

        from arrowbuf.compat import BatchedData, DataBuffer, EnvMeta, EnvRet, PolicyResponse
        self.shape, self.engine = shape, engine
        self.buffer = DataBuffer(config, seed=0, autoreset_mode=autoreset_mode)
        self.buffer.init([EnvMeta(ENV, num_envs=shape.envs)], [ENV])
        T, obs = shape.steps, shape.observations
        policy = [n for n in shape.fields if n not in obs and n not in ("reward", "terminated", "truncated")]
        zeros = {n: torch.zeros_like(rollout[n][0]) for n in ("reward", "terminated", "truncated")}
        self.env_rets, self.responses = [], []
        for t in range(T + 1):   # T steps and the final record (its response is dropped, as the seed does)
            last = {n: rollout[n][t - 1] if t else zeros[n] for n in zeros}
            observation = {n: rollout[n][t] for n in obs}
            # Same-step autoreset (IsaacLab): an env return that ends episodes carries their
            # terminal observations in info, as the native writer gets final_obs.
            ended = autoreset_mode == "same_step" and bool((last["terminated"] | last["truncated"]).any())
            self.env_rets.append(BatchedData([ENV], [EnvRet(
                ENV, observation, last_reward=last["reward"], last_terminated=last["terminated"],
                last_truncated=last["truncated"], info={"final_observation": observation} if ended else {})]))
            self.responses.append(BatchedData([ENV], [PolicyResponse(
                ENV, **{n: rollout[n][min(t, T - 1)] for n in policy})]))

    def ingest(self) -> float:
        start = time.perf_counter()
        if self.engine == "rsl":
            for env_rets, responses in zip(self.env_rets, self.responses):
                self.buffer.add_batched_data_async(env_rets)
                self.buffer.add_batched_data_async(responses)
            self.buffer.truncate_episodes([ENV])
        else:
            last = len(self.env_rets) - 1
            for t, (env_rets, responses) in enumerate(zip(self.env_rets, self.responses)):
                self.buffer.add_batched_transition(env_rets, responses, [t == last])
        return time.perf_counter() - start

    def sample(self) -> Any:
        return self.buffer.sample(self.shape.transitions)   # a RolloutBuffer clears itself

    def clear(self) -> None:
        self.buffer.clear()

    def transitions(self) -> int:
        return len(self.buffer.store)


class NativeRollout:
    """An ``ExperienceStore`` fed by ``store.writer`` from the same rollout."""

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], autoreset_mode: str) -> None:
        import arrowbuf as ab
        self.shape, self.rollout, self.mode = shape, rollout, autoreset_mode
        self.store = ab.ExperienceStore(2 * shape.envs * (shape.steps + 1), seed=0)

    def ingest(self) -> float:
        start = time.perf_counter()
        ingest_native(self.store, self.shape, self.rollout, autoreset_mode=self.mode)
        return time.perf_counter() - start

    def sample(self) -> Any:
        batch = self.store.sample(self.shape.transitions)
        self.store.clear()
        return batch

    def clear(self) -> None:
        self.store.clear()

    def transitions(self) -> int:
        return len(self.store)


class CopyFloor:
    """The floor of an ingest: the rollout's stored bytes (every field; observations once, T + 1
    rows) copied into a warm buffer of the same layout, one ``copy_`` per field: what a write path
    that copies each byte once cannot beat."""

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any]) -> None:
        import torch
        self.source = {name: rollout[name] for name in shape.fields}
        self.target = {name: torch.empty_like(t) for name, t in self.source.items()}
        self.ingest()   # warm: every page of the target touched once

    def ingest(self) -> float:
        start = time.perf_counter()
        for name, t in self.source.items():
            self.target[name].copy_(t)
        return time.perf_counter() - start

    def clear(self) -> None:
        pass


def first_rollouts(shape: RolloutShape, rollout: Mapping[str, Any], count: int) -> Metric:
    """Seconds of a new store's construction and its first native ingest (fresh arena pages),
    ``count`` times, against the same ingest into that store once warm (its second rollout)."""
    import arrowbuf as ab

    first, warm = Series(), Series()
    for _ in range(count):
        start = time.perf_counter()
        store = ab.ExperienceStore(shape.transitions, seed=0)   # num_envs x T, as the seed sizes its buffer
        ingest_native(store, shape, rollout, autoreset_mode="next_step")
        first.values.append(time.perf_counter() - start)
        store.clear()
        start = time.perf_counter()
        ingest_native(store, shape, rollout, autoreset_mode="next_step")
        warm.values.append(time.perf_counter() - start)
        del store
        gc.collect()
    ratio = Series([f / w for f, w in zip(first.values, warm.values)])
    return Metric(f"{shape.name} first rollout into a fresh store (construction included)", "s",
                  {"native": first, "native warm": warm}, {"first/warm": ratio},
                  target="first/warm <= 2 (issue 33; a fresh arena's page faults bound it)", met=ratio.median <= 2)


class EpisodeAdds:
    """The rollout as whole episodes, one per env: one ``add_episodes`` of [E, T, ...] arrays
    (``batched``) or E ``add_episode`` calls."""

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], batched: bool) -> None:
        import arrowbuf as ab
        self.store = ab.ExperienceStore(shape.envs * (shape.steps + 1), seed=0)
        self.batched = batched
        self.columns = {name: rollout[name].transpose(0, 1) for name in shape.fields}   # env-major views
        self.episodes = episodes(shape, rollout)

    def ingest(self) -> float:
        start = time.perf_counter()
        if self.batched:
            self.store.add_episodes(self.columns)
        else:
            for episode in self.episodes:
                self.store.add_episode(episode)
        return time.perf_counter() - start

    def clear(self) -> None:
        self.store.clear()

    def transitions(self) -> int:
        return len(self.store)


def ingest_then_clear(contender: CompatRollout | NativeRollout | EpisodeAdds) -> float:
    """Seconds of one rollout's ingest (the clear after it untimed)."""
    seconds = contender.ingest()
    contender.clear()
    return seconds


def sample_after_ingest(contender: CompatRollout | NativeRollout) -> float:
    """Seconds of sampling the whole rollout (and clearing, as a RolloutBuffer does) after an untimed ingest."""
    contender.ingest()
    start = time.perf_counter()
    contender.sample()
    return time.perf_counter() - start


def run_seed(spec: SeedSpec, opts: Options) -> WorkloadResult:
    """Whole rollouts against the real seed (steady state, fresh buffers), then the WBC ingest and the
    VLA ingest and sample, compat against native."""
    t0 = start_workload()
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    seed, why_absent = real_seed.load()
    if seed is not None:
        notes.append(f"  real seed: RLightning's DataBuffer from {seed.repo}")
    else:
        notes.append(f"  {why_absent}")
    steady, fresh = max(5, min(opts.rounds, 7)) + 1, max(3, min(opts.rounds, 5))
    metrics: list[Metric] = []
    for shape in (spec.wbc, spec.vla):
        log(f"  SEED: {shape.name} rollouts against the real seed")
        metrics += race_rollouts(shape, seed, why_absent, steady, fresh, notes)
        gc.collect()
    timing = (max(2, min(opts.rounds, 5)), opts.min_time, 1)
    shape = spec.wbc
    rollout = make_rollout(shape)
    wbc_config = {"type": "RolloutBuffer", "capacity": 2 * shape.transitions, "auto_truncate_episode": True,
                  "storage": {"unit": "episode"}, "sampler": {"type": "batch"}}
    pair = {"compat": CompatRollout(shape, rollout, wbc_config, "rsl", autoreset_mode="same_step"),
            "native": NativeRollout(shape, rollout, "same_step")}
    for c, contender in pair.items():   # warm-up, and what each stores of the same data
        contender.ingest()
        notes.append(f"  WBC: {c} stores {contender.transitions():,} of {shape.transitions:,} env steps")
        contender.clear()
    blind = CompatRollout(shape, rollout, wbc_config, "rsl", autoreset_mode="auto")   # IsaacLab's info={}
    blind.ingest()
    notes.append(f"  WBC: compat with info={{}} (no final observation, default autoreset_mode) stores "
                 f"{blind.transitions():,} of {shape.transitions:,} env steps")
    del blind
    log(f"  SEED: WBC {shape.transitions:,} env steps a rollout")
    metrics += compare("SEED WBC", [
        Race("WBC ingest", "env-steps/s", {c: (lambda k=k: ingest_then_clear(k)) for c, k in pair.items()}, RATIO,
             target="compat/native >= 0.5", goal=at_least("compat/native", 0.5), units=shape.transitions,
             self_timed=True)], *timing)
    if opts.profile:
        notes.append(profile_calls("WBC compat ingest (then clear)", lambda: ingest_then_clear(pair["compat"]), 1, 20))
    pair.clear()
    adds = {"batched": EpisodeAdds(shape, rollout, True), "single": EpisodeAdds(shape, rollout, False)}
    for contender in adds.values():   # warm-up
        ingest_then_clear(contender)
    metrics += compare("SEED WBC episodes", [
        Race(f"WBC add_episodes({shape.envs:,} episodes)", "env-steps/s",
             {c: (lambda k=k: ingest_then_clear(k)) for c, k in adds.items()}, {"batched/single": ("batched", "single")},
             target="batched/single > 1", goal=at_least("batched/single", 1.0), units=shape.transitions,
             self_timed=True)], *timing)
    adds.clear()
    metrics.append(first_rollouts(shape, rollout, max(2, min(opts.rounds, 5))))
    del rollout
    gc.collect()

    shape = spec.vla
    rollout = make_rollout(shape)
    vla_config = {"type": "RolloutBuffer", "capacity": shape.transitions, "sampler": {"type": "all"}}
    pair = {"compat": CompatRollout(shape, rollout, vla_config, "sync"),
            "native": NativeRollout(shape, rollout, "next_step")}
    for contender in pair.values():   # warm-up
        sample_after_ingest(contender)
    floor = {"native": pair["native"], "copy": CopyFloor(shape, rollout)}
    log(f"  SEED: VLA {shape.transitions:,} env steps a rollout")
    metrics += compare("SEED VLA", [
        Race("VLA ingest", "env-steps/s", {c: (lambda k=k: ingest_then_clear(k)) for c, k in pair.items()}, RATIO,
             target="compat/native >= 0.8", goal=at_least("compat/native", 0.8), units=shape.transitions,
             self_timed=True),
        Race(f"VLA sample({shape.transitions})", "ms", {c: (lambda k=k: sample_after_ingest(k))
                                                         for c, k in pair.items()}, RATIO,
             target="compat/native >= 0.8", goal=at_least("compat/native", 0.8), per_call=True, scale=1e3,
             self_timed=True),
        Race("VLA native ingest vs one copy of its bytes", "env-steps/s",
             {c: (lambda k=k: ingest_then_clear(k)) for c, k in floor.items()}, {"native/copy": ("native", "copy")},
             target="native/copy >= 0.8", goal=at_least("native/copy", 0.8), units=shape.transitions,
             self_timed=True)], *timing)
    metrics.append(first_rollouts(shape, rollout, max(2, min(opts.rounds, 5))))
    if opts.profile:
        notes.append(profile_calls("VLA compat ingest (then clear)", lambda: ingest_then_clear(pair["compat"]), 1, 20))
        notes.append(profile_calls(f"VLA compat ingest + sample({shape.transitions})",
                                   lambda: sample_after_ingest(pair["compat"]), 1, 20))
    pair.clear()
    floor.clear()
    flag_noisy("SEED", metrics, notes)
    notes.append("  x/seed and compat/native are speed-ups (> 1: faster than the seed / than native); a "
                 "rollout = the engine's ingest + sample + the trainer's PPO minibatches (seed_engines); native "
                 "rollouts take the same minibatches from store.iter_batches(size, epochs, drop_last=True), then "
                 "store.clear(), as the RolloutBuffer's sample clears it")
    notes.append(load_note(load_start))
    seed_label = "RLightning DataBuffer (real seed)" if seed is not None else "real seed (absent)"
    return WorkloadResult("SEED", spec.short(), spec.describe(),
                          ["seed", "compat", "native", "native warm", "copy", "batched", "single"],
                          metrics, notes, time.perf_counter() - t0,
                          labels={"seed": seed_label, "compat": "arrowbuf.compat DataBuffer",
                                  "native": "arrowbuf writer", "native warm": "arrowbuf writer, warm store",
                                  "copy": "one copy into a warm buffer", "batched": "store.add_episodes",
                                  "single": "store.add_episode x E"},
                          ratio_columns=["compat/seed", "native/seed", "compat/native", "native/copy", "first/warm",
                                         "batched/single"])


register(Workload(
    "SEED", "RLightning compat vs native: WBC 4096x24 ingest (async, auto-truncate), VLA 32x160 ingest + sample",
    full=SeedSpec(wbc(4096, terminations=1 / 500), vla(32, 160)),
    quick=SeedSpec(wbc(256, terminations=1 / 500), vla(8, 40)),
    smoke=SeedSpec(wbc(64, terminations=1 / 500), vla(4, 16)),
    run=run_seed))
