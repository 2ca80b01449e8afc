"""PER: proportional prioritized replay over W1's data, 1M rows.

Median time of ``sample(256)`` + ``update_priorities`` (target < 0.3 ms and >= 2x
TorchRL's ``PrioritizedSampler``), and of the samplers alone (no gather). The
ideal is a textbook numpy binary sum tree + the ideal gather. TorchRL's sum tree
is a C++ extension; where it does not load, its column is empty and a note says why.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import numpy as np

from ..contenders import Arrowbuf, Ideal, TorchRL, fill
from ..harness import Options, Race, Workload, compare, flag_noisy, load_note, log, profile_calls, register, \
    start_workload
from ..results import WorkloadResult
from ..specs import ReplaySpec, make_episodes, w1


@dataclass(frozen=True)
class PrioritySpec:
    """Prioritized replay over a replay spec's data, capacity and batch size."""

    replay: ReplaySpec
    alpha: float = 0.6
    beta: float = 0.4

    def short(self) -> str:
        return (f"sample {self.replay.batch_size} + update_priorities {self.replay.batch_size}; "
                f"capacity {self.replay.capacity:,}; alpha {self.alpha}, beta {self.beta}")

    def describe(self) -> str:
        return f"{self.replay.describe()}; proportional PER, alpha {self.alpha}, beta {self.beta}"


class IdealPrioritized:
    """Textbook proportional PER in numpy over the ideal's columns: a binary sum tree
    walked by all queries together (one level per step), then the ideal's gather."""

    def __init__(self, ideal: Ideal, alpha: float, beta: float, eps: float = 1e-6) -> None:
        self.ideal, self.alpha, self.beta, self.eps = ideal, alpha, beta, eps
        rows = ideal.live * ideal.slot_rows
        self.depth = max(1, (rows - 1).bit_length())
        self.leaf0 = 1 << self.depth
        self.tree = np.zeros(2 * self.leaf0)
        leaves = np.ones(rows)
        leaves[ideal.slot_rows - 1::ideal.slot_rows] = 0.0     # final-observation rows are no transitions
        self.tree[self.leaf0:self.leaf0 + rows] = leaves
        lo = self.leaf0
        while lo > 1:
            self.tree[lo // 2:lo] = self.tree[lo:2 * lo:2] + self.tree[lo + 1:2 * lo:2]
            lo //= 2
        self.count = int(leaves.sum())
        self.max_priority = 1.0
        self.rng = np.random.default_rng(0)

    def select(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        tree = self.tree
        total = tree[1]
        mass = self.rng.random(n) * total
        node = np.ones(n, np.int64)
        for _ in range(self.depth):
            node *= 2
            left = tree[node]
            right = (mass >= left) & (tree[node + 1] > 0)
            mass -= np.where(right, left, 0.0)
            node += right
        weight = (self.count * tree[node] / total) ** -self.beta
        return node - self.leaf0, (weight / weight.max()).astype(np.float32)

    def update(self, rows: np.ndarray, priority: np.ndarray) -> None:
        priority = priority + self.eps
        node = rows + self.leaf0
        self.tree[node] = priority ** self.alpha
        for _ in range(self.depth):
            node //= 2
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]
        self.max_priority = max(self.max_priority, float(priority.max()))

    def sample(self, n: int) -> dict[str, np.ndarray]:
        rows, weight = self.select(n)
        ideal = self.ideal
        out = {name: np.take(col, rows, axis=0) for name, col in ideal.cols.items()}
        for name in ideal.obs_names:
            out["next_" + name] = np.take(ideal.cols[name], rows + 1, axis=0)
        out["weight"], out["index"] = weight, rows
        return out


def torchrl_prioritized(spec: PrioritySpec, notes: list[str]) -> TorchRL | None:
    """TorchRL's PrioritizedSampler buffer, or None (with notes) where its C++ sum tree does not load."""
    try:
        from torchrl.data import PrioritizedSampler
        rs = spec.replay
        return TorchRL(rs, {}, sampler=PrioritizedSampler(rs.capacity, spec.alpha, spec.beta), batch_size=rs.batch_size)
    except Exception as err:  # noqa: BLE001  torchrl's C++ sum tree may not load (built for another torch)
        notes.append(f"  torchrl PrioritizedSampler unavailable: {type(err).__name__}: {err}")
        try:
            import torchrl._torchrl  # noqa: F401
        except Exception as cause:  # noqa: BLE001
            notes.append(f"    (import torchrl._torchrl: {type(cause).__name__}: {str(cause)[:160]}...)")
        return None


def run_prioritized(spec: PrioritySpec, opts: Options) -> WorkloadResult:
    """Fill the ideal, arrowbuf and (where it loads) TorchRL, then time sample + update."""
    t0 = start_workload(Arrowbuf, TorchRL)
    import torch

    import arrowbuf as ab
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    rs = spec.replay
    B = rs.batch_size
    episodes = make_episodes(rs)
    # |TD errors|: a pool of priority vectors, cycled (numpy for the ideal, float32 tensors as a trainer has).
    pool_np = [np.abs(np.random.default_rng(i).standard_normal(B)) for i in range(64)]
    pool_t = [torch.from_numpy(p).float() for p in pool_np]
    cycle_np, cycle_t = itertools.cycle(pool_np), itertools.cycle(pool_t)

    ideal = Ideal(rs, {})
    fill(ideal, episodes)
    per = IdealPrioritized(ideal, spec.alpha, spec.beta)
    contender = Arrowbuf(rs, {}, sampler=ab.PrioritizedSampler(spec.alpha, spec.beta))
    fill(contender, episodes)
    store = contender.store
    log(f"  PER: ideal and arrowbuf filled ({len(store):,} transitions)")

    def ideal_step() -> None:
        batch = per.sample(B)
        per.update(batch["index"], next(cycle_np))

    def ideal_sampler() -> None:
        rows, _ = per.select(B)
        per.update(rows, next(cycle_np))

    def arrowbuf_step() -> None:
        batch = store.sample(B)
        store.update_priorities(batch["index"], next(cycle_t))

    sampler, table, rng = store.sampler, store.engine.table, np.random.default_rng(1)

    def arrowbuf_sampler() -> None:
        selection = sampler.sample(rng, B, table)
        sampler.update(table, selection.indices, next(cycle_np))

    full = {"ideal": ideal_step, "arrowbuf": arrowbuf_step}
    bare = {"ideal": ideal_sampler, "arrowbuf": arrowbuf_sampler}
    trl = torchrl_prioritized(spec, notes)
    if trl is not None:
        fill(trl, [trl.prepare(ep) for ep in episodes])
        rb = trl.rb
        trl_sampler, trl_storage = rb.sampler, rb.storage

        def torchrl_step() -> None:
            _, info = rb.sample(return_info=True)
            rb.update_priority(info["index"], next(cycle_t))

        def torchrl_sampler() -> None:
            index, _ = trl_sampler.sample(trl_storage, B)
            trl_sampler.update_priority(index, next(cycle_t))

        full["torchrl"], bare["torchrl"] = torchrl_step, torchrl_sampler
        log(f"  PER: torchrl filled ({len(rb):,} transitions)")

    batch = store.sample(B)
    if "weight" not in batch or not bool((batch["weight"] <= 1).all()):
        notes.append("  arrowbuf prioritized sample lacks normalized 'weight'")
    for fn in [*full.values(), *bare.values()]:   # warm-up
        for _ in range(20):
            fn()
    others = {f"arrowbuf/{c}": ("arrowbuf", c) for c in full if c != "arrowbuf"}
    metrics = compare("PER", [
        Race("sample+update (median)", "ms", full, others, target="arrowbuf < 0.3 ms, arrowbuf/torchrl >= 2",
             goal=lambda m: m.values["arrowbuf"].median < 0.3 and (
                 "arrowbuf/torchrl" not in m.ratios or m.ratios["arrowbuf/torchrl"].median >= 2),
             per_call=True, scale=1e3),
        Race("sampler only (median)", "ms", bare, others, target="info: no gather", per_call=True, scale=1e3),
    ], opts.rounds, opts.min_time, opts.slices)
    flag_noisy("PER", metrics, notes)
    notes.append("  ratios are speed-ups (time of the other / time of arrowbuf); arrowbuf sampler only = "
                 "store.sampler.sample(rng, n, table) + sampler.update(table, indices, p) on store.engine.table")
    notes.append(load_note(load_start))
    if opts.profile:
        notes.append(profile_calls("arrowbuf sample + update_priorities", arrowbuf_step, 2000, top=18))
    return WorkloadResult("PER", spec.short(), spec.describe(), ["ideal", "arrowbuf", "torchrl"], metrics, notes,
                          time.perf_counter() - t0,
                          labels={"ideal": "ideal (numpy sum tree)", "torchrl": "torchrl PrioritizedSampler"})


register(Workload(
    "PER", "prioritized: sample 256 + update_priorities 256 over 1M rows (W1 data)",
    full=PrioritySpec(w1(1_000_000)), quick=PrioritySpec(w1(100_000)), run=run_prioritized))
