"""W3: sequence (slice) sampling.

64 windows of 32 steps from W1's data: arrowbuf ``SequenceSampler(32)`` vs the
ideal numpy gather (random valid starts, one ``np.take`` of a [64, 32] index per
column, incl. next obs) vs TorchRL's ``SliceSampler(slice_len=32,
traj_key="episode")`` (and, for information, the same with ``cache_values=True``).
Targets: >= 0.5x ideal, >= 4x TorchRL. Also the sample time of a small schema
(obs f32[4], action int8, reward) at 10M rows over 1M rows: <= 1.5.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..contenders import Arrowbuf, Contender, Ideal, TorchRL, fill
from ..harness import Options, Race, Workload, at_least, compare, flag_noisy, load_note, log, over, \
    profile_calls, register, start_workload
from ..results import Metric, WorkloadResult, speedup
from ..specs import SMALL_FIELDS, FieldSpec, ReplaySpec, describe_fields, make_episodes, rows_text, w1


@dataclass(frozen=True)
class SequenceSpec:
    """Windows of ``seq_len`` steps from a replay spec (its batch_size = windows per batch),
    plus a small schema at two capacities for the scaling check."""

    replay: ReplaySpec
    seq_len: int
    scale_fields: Mapping[str, FieldSpec]
    scale_capacities: tuple[int, int]

    def short(self) -> str:
        return (f"{self.replay.batch_size} windows of {self.seq_len} steps; capacity {self.replay.capacity:,}, "
                f"episodes of {self.replay.episode_len:,} steps")

    def describe(self) -> str:
        return (f"{self.replay.describe()}; sample = {self.replay.batch_size} windows x {self.seq_len} steps "
                f"(incl. next obs). Scaling: {describe_fields(self.scale_fields)} at {self.scale_capacities[0]:,} "
                f"vs {self.scale_capacities[1]:,} rows")


class IdealWindows(Ideal):
    """The ideal columns; a sample is random valid window starts + one np.take of a [B, L] index per column."""

    def __init__(self, spec: ReplaySpec, seq_len: int) -> None:
        super().__init__(spec, {})
        self.seq_len = seq_len
        self.offsets = np.arange(seq_len, dtype=np.int64)

    def sample(self, windows: int) -> dict[str, np.ndarray]:
        per_slot = self.T - self.seq_len + 1          # starts 0..T-L: steps and next obs stay in the episode
        k = self.rng.integers(0, self.live * per_slot, windows)
        rows = ((k // per_slot) * self.slot_rows + k % per_slot)[:, None] + self.offsets
        out = {name: np.take(col, rows, axis=0) for name, col in self.cols.items()}
        rows1 = rows + 1
        for name in self.obs_names:
            out["next_" + name] = np.take(self.cols[name], rows1, axis=0)
        return out


def arrowbuf_windows(spec: ReplaySpec, seq_len: int) -> Arrowbuf:
    """arrowbuf with ``SequenceSampler(seq_len)``."""
    import arrowbuf as ab
    return Arrowbuf(spec, {}, sampler=ab.SequenceSampler(seq_len))


class TorchRLSlices(TorchRL):
    """``ReplayBuffer(LazyTensorStorage, SliceSampler(slice_len, traj_key="episode"))``; every added
    episode gets a new id in its "episode" column (the trajectory key)."""

    def __init__(self, spec: ReplaySpec, seq_len: int, cache_values: bool = False, storage: Any = None) -> None:
        self.preload()
        from torchrl.data import LazyTensorStorage, SliceSampler
        super().__init__(spec, {}, storage=storage if storage is not None else LazyTensorStorage(spec.capacity),
                         sampler=SliceSampler(slice_len=seq_len, traj_key="episode", cache_values=cache_values),
                         batch_size=spec.batch_size * seq_len)
        self.added = 0

    def prepare(self, episode: dict[str, np.ndarray]) -> Any:
        import torch
        td = super().prepare(episode)
        td["episode"] = torch.zeros(self.spec.episode_len, dtype=torch.int64)
        return td

    def add(self, item: Any) -> None:
        item["episode"].fill_(self.added)
        self.added += 1
        self.rb.extend(item)

    def sample(self, windows: int) -> Any:
        return self.rb.sample()


def check_windows(batch: Any, seq_len: int, notes: list[str], who: str) -> None:
    """Windows stay inside one episode and hold consecutive steps."""
    if who == "arrowbuf":
        episode, step = batch["episode_id"], batch["step"]
    else:   # torchrl: flat [B * L]
        episode = batch["episode"].reshape(-1, seq_len)
        step = None
    if not bool((episode == episode[:, :1]).all()):
        notes.append(f"  BUG? {who}: a window spans several episodes")
    if step is not None and not bool(((step[:, 1:] - step[:, :-1]) == 1).all()):
        notes.append(f"  BUG? {who}: a window's steps are not consecutive")


def run_sequences(spec: SequenceSpec, opts: Options) -> WorkloadResult:
    """Fill the three stores (and the scaling pair), then time their window samples."""
    t0 = start_workload(Arrowbuf, TorchRL)
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    B, L = spec.replay.batch_size, spec.seq_len
    episodes = make_episodes(spec.replay)

    main: dict[str, Contender] = {"ideal": IdealWindows(spec.replay, L), "arrowbuf": arrowbuf_windows(spec.replay, L),
                                  "torchrl": TorchRLSlices(spec.replay, L)}
    for c, contender in main.items():
        fill(contender, [contender.prepare(ep) for ep in episodes])
        log(f"  W3: {c} filled ({contender.rows_stored():,} rows)")
    # Same storage, cached trajectory bounds (TorchRL clears the cache on every extend).
    main["torchrl_cached"] = TorchRLSlices(spec.replay, L, cache_values=True, storage=main["torchrl"].rb.storage)

    scale: dict[str, Contender] = {}
    for cap in spec.scale_capacities:
        small = ReplaySpec(spec.scale_fields, cap, spec.replay.episode_len, B)
        small_eps = make_episodes(small)
        for make, kind in ((IdealWindows, "ideal"), (arrowbuf_windows, "arrowbuf")):
            contender = make(small, L)
            fill(contender, small_eps)
            scale[f"{kind}@{cap}"] = contender
        log(f"  W3: small schema at {cap:,} rows filled")
        del small_eps

    for c in ("arrowbuf", "torchrl"):
        check_windows(main[c].sample(B), L, notes, c)
    for contender in [*main.values(), *scale.values()]:   # warm-up
        for _ in range(5):
            contender.sample(B)

    small_cap, big_cap = spec.scale_capacities
    sample, scaled = compare("W3", [
        Race("sample", "batches/s", {c: (lambda k=k: k.sample(B)) for c, k in main.items()},
             over("arrowbuf", "ideal", "torchrl", "torchrl_cached"), target="arrowbuf/ideal >= 0.5, arrowbuf/torchrl >= 4",
             goal=lambda m: at_least("arrowbuf/ideal", 0.5)(m) and at_least("arrowbuf/torchrl", 4)(m)),
        Race("scaling", "batches/s", {c: (lambda k=k: k.sample(B)) for c, k in scale.items()}, {}),
    ], opts.rounds, opts.min_time, opts.slices)
    scale_rates = scaled.values
    growth = {kind: speedup(scale_rates[f"{kind}@{small_cap}"], scale_rates[f"{kind}@{big_cap}"])
              for kind in ("ideal", "arrowbuf")}
    scaling = Metric(f"sample time {rows_text(big_cap)} / {rows_text(small_cap)} rows", "x",
                     {"ideal": growth["ideal"], "arrowbuf": growth["arrowbuf"]}, {}, target="arrowbuf <= 1.5",
                     met=growth["arrowbuf"].median <= 1.5, ratios_from_values=False,
                     detail={c: f"{c.replace('@', ' at ')} rows, small schema: {scale_rates[c].median:,.0f} "
                                f"batches/s" for c in scale})
    metrics = [sample, scaling]
    flag_noisy("W3", metrics, notes)
    notes.append(f"  torchrl: SliceSampler(slice_len={L}, traj_key='episode') recomputes the trajectory bounds "
                 "over the whole storage on every sample; torchrl (cache_values) caches them until the next "
                 "extend (so only while nothing is added)")
    notes.append(load_note(load_start))
    if opts.profile:
        seq = main["arrowbuf"]
        notes.append(profile_calls("arrowbuf SequenceSampler sample", lambda: seq.sample(B), 2000))
    main.clear()
    scale.clear()
    gc.collect()
    return WorkloadResult("W3", spec.short(), spec.describe(), ["ideal", "arrowbuf", "torchrl", "torchrl_cached"],
                          metrics, notes, time.perf_counter() - t0,
                          labels={"ideal": Ideal.label, "torchrl": "torchrl SliceSampler",
                                  "torchrl_cached": "torchrl cache_values"})


register(Workload(
    "W3", "sequences: 64 windows of 32 steps from W1's data; slice time at 10M vs 1M rows",
    full=SequenceSpec(w1(1_000_000, batch_size=64), 32, SMALL_FIELDS, (1_000_000, 10_000_000)),
    quick=SequenceSpec(w1(100_000, batch_size=64), 32, SMALL_FIELDS, (100_000, 1_000_000)),
    run=run_sequences))
