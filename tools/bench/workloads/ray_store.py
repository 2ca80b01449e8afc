"""RAY: the sharded store in Ray actors vs a naive replay actor.

``ray.init(address="local", num_cpus=2)`` for this workload only; W1 (200k rows)
and W2 (20k rows) schemas in a 2-shard store: ``sample_iter(batch, prefetch=4)``
and ``sample(batch)`` vs a naive Ray actor (``ray.get(actor.sample.remote(n))``
per batch) and the embedded store (targets of issue 15: ``sample()`` >= 10x
naive on W1, ``sample_iter`` >= 10x naive on W2, and ``sample_iter`` >= 0.8x (W1) /
0.7x (W2) the embedded store; W2's ``sample()`` / naive is reported too; issue 24: W1's
plain ``sample()``, handed out of the reader's draws ahead as ``sample_iter``'s
batches are, >= 0.5x the embedded store, ``arrowbuf sample()/local``); writes vs
``ray.get(actor.add.remote(episode))`` per episode (target >= 3x) and vs
``ray.put`` of each episode alone (issue 15: W2 >= 0.9x, judged on ``batch``) through arrowbuf's three paths: ``add_episode`` (a round trip that
returns the shard's episode id), ``add_episodes`` of a rollout of K episodes
(``batch``: one waited request per shard for all of its episodes) and a step
writer (asynchronous, batched, the throughput path); ratio to the embedded store's sample; the same
``add_episode`` calls into a ``durable=`` store, whose shards log and fsync each
write before answering it, vs the plain store (arrowbuf/durable: durable time
over plain time, target <= 1.3). On W1, a learner's prioritized step (``sample`` +
``update_priorities``) with the update waited for or left in flight (``wait=False``),
and on the embedded store (`PerStores`; info). Timed in longer slices than the in-process
workloads, each ending with a flush.

Add race rows/s count every row a call writes: T for the contenders that write one
episode per call (the writer's call is T // N steps of N envs, T rows), K x T for
``batch``. K is the workload's env cycle (8 envs, ``RaySpec.envs``): RLightning's
``add_episode(episode, num_envs)`` takes a [T, num_envs] rollout, and issue 15 asks
writers to put "each episode (or batch of episodes) once"; one episode per env of
the cycle keeps each env on the shard it was routed to at the fill, so a call sends
K / 2 episodes to each of the 2 shards. Before one put per request, we measured ``add_episodes`` at 0.57x
put with K=4, 0.68x with 8 and 0.81x with 16: 8 is a vector env's size, not the
batch that flatters the store most. ``stack_put`` is the bound of a step-fed
writer without a store (`stack_put_calls`): ``writer/stack_put`` is what the
writer's checks, staging and routing cost beyond one stacking copy and a put. It
is a bound for large rows only: W1's episodes stack 1,000 step views of ~100 B per
field, which costs Python per row, and the writer's staging (one vectorized copy
per field and step) measured ~7x faster there.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..contenders import Arrowbuf, NaiveReplay
from ..harness import Options, Race, Workload, at_least, compare, flag_noisy, load_note, log, over, \
    profile_calls, register, start_workload
from ..results import Metric, Series, WorkloadResult
from ..specs import ReplaySpec, make_episodes, w1, w2


@dataclass(frozen=True)
class RaySpec:
    """Schemas to run through a sharded store, with its shard count and prefetch depth."""

    replays: Mapping[str, ReplaySpec]   # schema name -> spec (capacity, episodes, batch)
    num_shards: int = 2
    prefetch: int = 4
    envs: int = 8                       # env ids the episodes cycle through (a shard per env)

    def short(self) -> str:
        return (f"{self.num_shards} shards, sample_iter(prefetch={self.prefetch}) vs a naive actor; "
                + "; ".join(f"{n}: {s.capacity:,} rows, batch {s.batch_size}" for n, s in self.replays.items()))

    def describe(self) -> str:
        return " | ".join(f"{n}: {s.describe()}" for n, s in self.replays.items())


def writer_envs(rs: ReplaySpec) -> int:
    """Envs of the writer contender: as many as a vector env would run (at most 100) whose
    staging fits in 64 MiB, dividing T so that a call is exactly T rows."""
    T = rs.episode_len
    return next(n for n in range(min(100, T), 0, -1) if T % n == 0 and n * (T + 1) * rs.row_bytes <= 64 << 20)


def writer_calls(writer: Any, episodes: list[dict[str, np.ndarray]], T: int) -> Callable[[], None]:
    """One call = T rows through a step writer: T // N steps of N episodes side by side
    (episode k on env k, autoreset 'disabled'), the path of env runners that produce steps."""
    n = writer.num_envs
    cols = {name: np.stack([episodes[k % len(episodes)][name] for k in range(n)], axis=1)
            for name in episodes[0]}   # [T (+1), N, ...]
    steps = itertools.cycle(range(T))

    def call() -> None:
        for _ in range(T // n):
            t = next(steps)
            writer.add(obs=cols["obs"][t], action=cols["action"][t], reward=cols["reward"][t],
                       terminated=cols["terminated"][t], truncated=cols["truncated"][t], next_obs=cols["obs"][t + 1])
    return call


def batch_calls(store: Any, episodes: list[dict[str, np.ndarray]], envs: int) -> Callable[[], None]:
    """One call = ``store.add_episodes`` of a rollout of ``envs`` episodes ([E, T, ...] arrays,
    stacked once before timing), one per env of the workload's env cycle (each env keeps the
    shard it was routed to at the fill): one request per shard, waited for."""
    batch = {name: np.stack([episodes[k % len(episodes)][name] for k in range(envs)]) for name in episodes[0]}
    env_ids = [f"env-{k}" for k in range(envs)]

    def call() -> None:
        store.add_episodes(batch, env_ids=env_ids)
    return call


def warm_object_store(ray: Any, call: Callable[[], None], call_bytes: int, limit_s: float = 10.0) -> tuple[int, float]:
    """Run ``call`` (a write contender putting ``call_bytes`` a call) until it has written 3x the
    object store's memory, or for ``limit_s``; (calls, seconds). Ray allocates the object
    store's /dev/shm pages lazily: a put landing on pages never used before pays their first
    touch (measured, 85 MB puts of 8 W2 episodes kept by the store: ~21% of the puts in the
    first 8.5 GB written were 5x slower, each ~20,700 page faults; 0-1% after ~25 GB, with a
    7.5 GB store). ``ray.put`` alone frees each object at once and puts the next on the same pages, so a
    contender whose objects are kept (as a store's are) is timed once its pages are in use too."""
    budget = 3 * ray.available_resources().get("object_store_memory", 0)
    calls, start = 0, time.perf_counter()
    while calls * call_bytes < budget and time.perf_counter() - start < limit_s:
        call()
        calls += 1
    return calls, time.perf_counter() - start


def stack_put_calls(ray: Any, episodes: list[dict[str, np.ndarray]], T: int, n: int) -> Callable[[], None]:
    """The bound of a step-fed writer without a store, fed as `writer_calls` feeds the writer
    (T // N steps of N envs per call, episode k on env k): per field a list of the steps'
    [N, ...] arrays (references, no copy: it assumes the env hands a fresh array every
    step, which the writer may not), and at an env's episode end ``np.stack`` of that env's
    rows of each list (one copy, as the writer's staging is one) and ``ray.put`` of the
    episode. Nothing is checked, routed or stored, and no final observation is copied at
    every step (the writer copies each step's ``next_obs``: an env may reuse its buffer)."""
    cols = {name: np.stack([episodes[k % len(episodes)][name] for k in range(n)], axis=1)
            for name in episodes[0]}   # [T (+1), N, ...]
    ticks = itertools.cycle(range(T))
    steps: dict[str, list[np.ndarray]] = {name: [] for name in cols}
    start = np.zeros(n, np.int64)   # each env's first step in the lists

    def call() -> None:
        for _ in range(T // n):
            t = next(ticks)
            for name, kept in steps.items():
                kept.append(cols[name][t])
            done = cols["terminated"][t] | cols["truncated"][t]
            for k in np.flatnonzero(done).tolist():
                first = int(start[k])
                episode = {name: np.stack([step[k] for step in kept[first:]]) for name, kept in steps.items()
                           if name != "obs"}
                episode["obs"] = np.stack([step[k] for step in steps["obs"][first:]] + [cols["obs"][t + 1][k]])
                ray.put(episode)
                start[k] = len(steps["obs"])
            drop = int(start.min())
            if drop:   # steps no open episode holds any more
                for kept in steps.values():
                    del kept[:drop]
                start[:] -= drop
    return call


class PerStores:
    """A prioritized Ray store and a prioritized embedded store of the same rows, and the
    race of a learner's step on them: ``sample(batch)`` + ``update_priorities`` of its
    indices, the update waited for (``per_wait``) or left in flight (``per_inflight``,
    ``wait=False``; each slice ends with a flush that collects the answers), against the
    embedded store (``per_local``)."""

    def __init__(self, ab: Any, rs: ReplaySpec, spec: RaySpec, episodes: list[dict[str, np.ndarray]]) -> None:
        def sampler() -> Any:
            return ab.PrioritizedSampler(alpha=0.6, beta=0.4)
        self.store = ab.ExperienceStore(rs.capacity, backend="ray", num_shards=spec.num_shards, seed=0,
                                        sampler=sampler())
        self.local = ab.ExperienceStore(rs.capacity, seed=0, sampler=sampler())
        T = rs.episode_len
        for i in range(rs.capacity // (T + 1)):
            self.store.add_episode(episodes[i % len(episodes)], env_id=f"env-{i % spec.envs}")
            self.local.add_episode(episodes[i % len(episodes)])
        self.store.flush()
        self.batch = rs.batch_size
        self.priorities = itertools.cycle(np.random.default_rng(0).uniform(0.1, 3.0, (64, rs.batch_size)))

    def step(self, store: Any, wait: bool) -> Callable[[], None]:
        def call() -> None:
            batch = store.sample(self.batch)
            store.update_priorities(batch["index"], next(self.priorities), wait=wait)
        return call

    def race(self, wname: str) -> Race:
        return Race(f"{wname} PER step", "steps/s",
                    {"per_wait": self.step(self.store, True), "per_inflight": self.step(self.store, False),
                     "per_local": self.step(self.local, True)},
                    {"inflight/wait": ("per_inflight", "per_wait"), "inflight/local": ("per_inflight", "per_local")},
                    target="info: a learner's sample + update_priorities",
                    finish={"per_inflight": self.store.flush})


def run_ray(spec: RaySpec, opts: Options) -> WorkloadResult:
    """Start a local Ray, run each schema's contenders, shut Ray down."""
    t0 = start_workload(Arrowbuf)
    import ray

    import arrowbuf as ab
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    metrics: list[Metric] = []
    # Ray workers cannot import this package by name: its classes travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__package__.partition(".")[0]])
    # Longer slices than the in-process workloads: a Ray call costs ~1 ms, and each
    # slice ends by waiting for what it left in flight.
    timing = (max(2, min(opts.rounds, 5)), opts.min_time * 3, 3)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    log(f"  RAY: ray.init {time.perf_counter() - t0:.1f} s")
    try:
        for wname, rs in spec.replays.items():
            metrics += ray_schema(wname, rs, spec, timing, notes, opts.profile, ray, ab)
    finally:
        ray.shutdown()
    flag_noisy("RAY", metrics, notes)
    notes.append(f"  arrowbuf: ExperienceStore(backend='ray', num_shards={spec.num_shards}); add = add_episode "
                 f"(env_id cycling over {spec.envs} envs; a round trip that returns the episode id); 'writer' = "
                 "the asynchronous batched path, a StepWriter of N envs ("
                 + ", ".join(f"{n}: {writer_envs(rs)}" for n, rs in spec.replays.items())
                 + ") fed T // N steps per call (T rows); both + flush() at the end of each timed slice; sample = "
                 f"sample_iter(batch, prefetch={spec.prefetch}), each slice ending with flush() (a size and a "
                 "manifest round trip to every shard); both sample paths draw in the driver and gather from "
                 "the shards' sealed blocks in the object store (no actor call per batch); 'arrowbuf sample()' "
                 "= one synchronous store.sample per batch, handed out of the reader's draws ahead of its request "
                 "(several batches drawn and staged at once, as sample_iter's)")
    notes.append("  naive: one Ray actor (num_cpus=0), ray.get(actor.sample.remote(n)) / "
                 "ray.get(actor.add.remote(episode)) per call; local = embedded ExperienceStore.sample in the driver")
    notes.append(load_note(load_start))
    notes.append("  durable: add_episode + flush into ExperienceStore(backend='ray', durable=dir), each shard "
                 "logging and fsyncing every write request before answering it; unsynced: the same with "
                 "RayOptions(durable_sync=False) (the log written, its flush to disk left to the OS)")
    notes.append("  PER step (W1): sample(batch) + update_priorities(index, priorities) on prioritized stores "
                 "(alpha 0.6, beta 0.4) of the same rows; per_inflight passes wait=False and ends each slice with "
                 "flush() (its updates answered)")
    notes.append("  put: ray.put of each episode alone (nothing stored): the bound of one writer, whose episodes "
                 "must enter the object store")
    notes.append(f"  batch: store.add_episodes of {spec.envs} episodes ([E, T, ...] arrays, env ids env-0..env-"
                 f"{spec.envs - 1}) per call, counted as {spec.envs} x T rows; stack_put: the writer's feed (T // N "
                 "steps of N envs per call) kept as per-field lists of the step arrays (no copy), np.stack of an "
                 "env's rows + ray.put of each finished episode: nothing checked or stored, no per-step copy of "
                 "next_obs")
    return WorkloadResult("RAY", spec.short(), spec.describe(),
                          ["naive", "arrowbuf", "arrowbuf_sync", "arrowbuf_writer", "arrowbuf_batch", "local", "put",
                           "stack_put", "durable", "unsynced", "per_wait", "per_inflight", "per_local"],
                          metrics, notes, time.perf_counter() - t0,
                          labels={"naive": "naive actor", "arrowbuf": "arrowbuf sample_iter / add_episode",
                                  "arrowbuf_sync": "arrowbuf sample()", "arrowbuf_writer": "arrowbuf writer",
                                  "arrowbuf_batch": f"arrowbuf add_episodes x{spec.envs}",
                                  "stack_put": "np.stack + ray.put",
                                  "local": "local store", "put": "ray.put only", "durable": "arrowbuf durable=True",
                                  "unsynced": "durable, durable_sync=False",
                                  "per_wait": "PER step, update waited", "per_inflight": "PER step, wait=False",
                                  "per_local": "PER step, local store"},
                          ratio_columns=["arrowbuf/naive", "arrowbuf/local", "inflight/wait"])


def ray_schema(wname: str, rs: ReplaySpec, spec: RaySpec, timing: tuple[int, float, int], notes: list[str],
               profile: bool, ray: Any, ab: Any) -> list[Metric]:
    """Fill, time and tear down the contenders of one schema."""
    from arrowbuf import RayOptions

    T, B = rs.episode_len, rs.batch_size
    episodes = make_episodes(rs)
    start = time.perf_counter()
    naive = ray.remote(num_cpus=0)(NaiveReplay).remote(rs)
    store = ab.ExperienceStore(rs.capacity, backend="ray", num_shards=spec.num_shards, seed=0)
    durable_dir = tempfile.mkdtemp(prefix="arrowbuf-bench-durable-")
    durable = ab.ExperienceStore(rs.capacity, backend="ray", num_shards=spec.num_shards, seed=0, durable=durable_dir)
    unsynced = ab.ExperienceStore(rs.capacity, backend="ray", num_shards=spec.num_shards, seed=0,
                                  durable=os.path.join(durable_dir, "unsynced"),
                                  ray_options=RayOptions(durable_sync=False))
    local = ab.ExperienceStore(rs.capacity, seed=0)
    per = PerStores(ab, rs, spec, episodes) if wname == "W1" else None
    log(f"  RAY {wname}: actors started in {time.perf_counter() - start:.1f} s")
    laps = rs.capacity // (T + 1)
    env = itertools.count()
    try:
        start = time.perf_counter()
        for i in range(laps):
            ray.get(naive.add.remote(episodes[i % len(episodes)]))
        cold_naive = laps * T / (time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(laps):
            store.add_episode(episodes[i % len(episodes)], env_id=f"env-{next(env) % spec.envs}")
        store.flush()
        cold_ab = laps * T / (time.perf_counter() - start)
        for durable_store in (durable, unsynced):
            for i in range(laps):
                durable_store.add_episode(episodes[i % len(episodes)], env_id=f"env-{next(env) % spec.envs}")
            durable_store.flush()
        for i in range(laps):
            local.add_episode(episodes[i % len(episodes)])
        shards = [s["transitions"] for s in store.stats()["shards"]]
        log(f"  RAY {wname}: filled; shards hold {shards} transitions, local {len(local):,}")

        iterator = store.sample_iter(B, prefetch=spec.prefetch)
        feed = itertools.cycle(episodes)
        sample_fns = {"naive": lambda: ray.get(naive.sample.remote(B)),
                      "arrowbuf": lambda: next(iterator),
                      "arrowbuf_sync": lambda: store.sample(B),
                      "local": lambda: local.sample(B)}
        add_fns = {"naive": lambda: ray.get(naive.add.remote(next(feed))),
                   "arrowbuf": lambda: store.add_episode(next(feed), env_id=f"env-{next(env) % spec.envs}"),
                   "arrowbuf_writer": writer_calls(store.writer(num_envs=writer_envs(rs), autoreset_mode="disabled"),
                                                   episodes, T),
                   "durable": lambda: durable.add_episode(next(feed), env_id=f"env-{next(env) % spec.envs}"),
                   "unsynced": lambda: unsynced.add_episode(next(feed), env_id=f"env-{next(env) % spec.envs}"),
                   "arrowbuf_batch": batch_calls(store, episodes, spec.envs),
                   "stack_put": stack_put_calls(ray, episodes, T, writer_envs(rs)),
                   "put": lambda: ray.put(next(feed))}   # one writer's bound: the put alone, nothing stored
        sample_done = {"arrowbuf": store.flush}
        local_target = 0.8 if wname == "W1" else 0.7   # issue 15: sample_iter vs the embedded store
        # Issue 15's other read target: plain sample() >= 10x naive on W1, sample_iter on W2.
        naive_key = "arrowbuf sample()/naive" if wname == "W1" else "arrowbuf/naive"
        # Issue 24: W1's plain sample() (the reader's loop, as sample_iter's) >= 0.5x the embedded store.
        sync_target = ", arrowbuf sample()/local >= 0.5" if wname == "W1" else ""
        # Issue 15: large episodes' writes ("each episode, or batch of episodes, put once") at
        # ray.put's speed; judged on add_episodes of a vector env's episodes: one add_episode
        # waits for its id, a round trip that costs ~1 ms here (0.38x put at best).
        put_target = ", batch/put >= 0.9" if wname == "W2" else ""
        batch = next(iterator)
        for key in [*rs.fields, ("next", "obs")]:
            if key not in batch.keys(include_nested=True):
                notes.append(f"  RAY {wname}: arrowbuf batch lacks {key!r}")
        for fn in sample_fns.values():   # warm-up
            for _ in range(10):
                fn()
        sample_done["arrowbuf"]()
        if rs.row_bytes * T >= RayOptions().block_bytes // 8:   # the batch lends its episodes: objects kept
            call_bytes = rs.row_bytes * T * spec.envs
            calls, seconds = warm_object_store(ray, add_fns["arrowbuf_batch"], call_bytes)
            store.flush()
            notes.append(f"  RAY {wname}: write warm-up before timing: {calls} add_episodes calls ({seconds:.1f} s, "
                         f"{calls * call_bytes / 1e9:.1f} GB; `warm_object_store`)")
        rounds, min_time, slices = timing
        per_race = [] if per is None else [per.race(wname)]
        sample, add, *per_metric = compare(f"RAY {wname}", [
            Race(f"{wname} sample", "batches/s", sample_fns,
                 {**over("arrowbuf", "naive", "local"), "arrowbuf sample()/naive": ("arrowbuf_sync", "naive"),
                  "arrowbuf sample()/local": ("arrowbuf_sync", "local")},
                 target=f"{naive_key} >= 10, arrowbuf/local >= {local_target}{sync_target}",
                 goal=lambda m: at_least(naive_key, 10)(m) and at_least("arrowbuf/local", local_target)(m)
                 and (wname != "W1" or at_least("arrowbuf sample()/local", 0.5)(m)),
                 finish=sample_done),
            Race(f"{wname} add", "rows/s", add_fns,
                 {**over("arrowbuf", "naive", "put", "durable", "unsynced"), **over("put", "naive"),
                  "writer/naive": ("arrowbuf_writer", "naive"), "writer/put": ("arrowbuf_writer", "put"),
                  "writer/stack_put": ("arrowbuf_writer", "stack_put"),
                  "batch/naive": ("arrowbuf_batch", "naive"), "batch/put": ("arrowbuf_batch", "put")},
                 target="arrowbuf/naive >= 3, arrowbuf/durable <= 1.3" + put_target,
                 goal=lambda m: at_least("arrowbuf/naive", 3)(m) and m.ratios["arrowbuf/durable"].median <= 1.3
                 and (wname != "W2" or at_least("batch/put", 0.9)(m)),
                 units={c: T * spec.envs if c == "arrowbuf_batch" else T for c in add_fns},
                 finish={"arrowbuf": store.flush, "arrowbuf_writer": store.flush, "arrowbuf_batch": store.flush,
                         "durable": durable.flush, "unsynced": unsynced.flush}),
            *per_race,
        ], rounds, min_time, slices)
        if profile:
            notes.append(profile_calls(f"RAY {wname}: driver side of arrowbuf sample_iter", lambda: next(iterator),
                                       2000, top=16))
            store.flush()
            notes.append(profile_calls(f"RAY {wname}: driver side of arrowbuf sample()", lambda: store.sample(B),
                                       300, top=12))
            notes.append(profile_calls(f"RAY {wname}: driver side of arrowbuf add_episode",
                                       lambda: store.add_episode(next(feed), env_id=f"env-{next(env) % spec.envs}"),
                                       200, top=12))
            store.flush()
    finally:
        store.close()
        if per is not None:
            per.store.close()
        durable.close()
        unsynced.close()
        shutil.rmtree(durable_dir, ignore_errors=True)
        ray.kill(naive)
    sample_fns.clear()
    gc.collect()
    first = Metric(f"{wname} 1st lap", "rows/s", {"naive": cold_naive, "arrowbuf": cold_ab},
                   {"arrowbuf/naive": Series([cold_ab / cold_naive])},
                   target="info: fresh memory (naive pre-touched)")
    return [sample, add, *per_metric, first]


register(Workload(
    "RAY", "Ray: 2 shards, sample_iter and add_episode vs a naive replay actor (W1 200k rows, W2 20k rows)",
    full=RaySpec({"W1": w1(200_000), "W2": w2(20_000)}),
    quick=RaySpec({"W1": w1(50_000), "W2": w2(5_000)}),
    run=run_ray))
