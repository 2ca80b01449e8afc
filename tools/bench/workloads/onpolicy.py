"""ONPOLICY: replaying a PPO rollout, the seed's own workload (issue 13).

Shapes: WBC (4,096 envs x 24 steps; obs f32[160], critic obs f32[286], action
f32[29], log-prob, value, reward, flags) and VLA (32 envs x 160 steps; bf16
pixel_values[6,112,112], action tokens int64[7], log-probs f32[7], value,
reward, flags). Operations: a sample of the whole rollout, and 4 epochs x 8
minibatches. Contenders: see `rollout_contenders`; arrowbuf twice, with its
default sample (every field and ``("next", obs)``) and with ``keys=`` (PPO's
fields), the latter only where ``ExperienceStore.sample`` / ``iter_batches``
accept ``keys``. Targets (the keys= path where it exists): rollout sample >= 0.9x
the ideal and >= 3x the real seed (RLightning's own ReplayBuffer, `real_seed`;
without its checkout, the seed-like proxy, so labelled); epochs >= 0.9x the ideal.

One more row per shape samples the whole rollout (``keys=``) out of a torch arena
(``storage_device``, ``--device``: cuda when available, else cpu), against the same
ideal and the numpy arena; with CUDA, also the numpy arena sampled to
``device="cuda"`` (pinned slots, one copy). Target: torch arena >= 0.9x the ideal.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

from ..contenders import Arrowbuf, TorchRL
from ..harness import Options, Race, Workload, compare, flag_noisy, load_note, log, over, profile_calls, register, \
    start_workload
from ..memory import rss_bytes
from ..results import Metric, WorkloadResult
from .. import real_seed
from ..rollout_contenders import ArrowbufRollout, IdealRollout, RealSeedRollout, RolloutContender, SeedRollout, \
    TorchRLRollout, accepts
from ..rollouts import RolloutShape, make_rollout, vla, wbc

CONTENDERS = ["ideal", "rlightning", "seed", "torchrl", "arrowbuf", "arrowbuf_keys"]
#: The torch-arena row's ratios; "arrowbuf_cuda" only runs with CUDA.
TORCH_RATIOS = ["arrowbuf_torch/ideal", "arrowbuf_torch/arrowbuf_keys", "arrowbuf_cuda/ideal"]


@dataclass(frozen=True)
class OnPolicySpec:
    """Rollout shapes, and PPO's epochs x minibatches over each."""

    shapes: tuple[RolloutShape, ...]
    epochs: int = 4
    minibatches: int = 8

    def short(self) -> str:
        return (f"whole-rollout sample and {self.epochs} epochs x {self.minibatches} minibatches; "
                + "; ".join(s.short() for s in self.shapes))

    def describe(self) -> str:
        return " | ".join(s.describe() for s in self.shapes)


def run_onpolicy(spec: OnPolicySpec, opts: Options) -> WorkloadResult:
    """Time each shape's whole-rollout sample and epochs, one shape at a time."""
    # A bare GPU image (tools/gpu_check.py) may lack TorchRL: its columns are then empty, not an error.
    try:
        TorchRL.preload()
        has_torchrl = True
    except ImportError:
        has_torchrl = False
    t0 = start_workload(Arrowbuf, *([TorchRL] if has_torchrl else []))
    import arrowbuf as ab
    load_start = os.getloadavg()[0]
    notes: list[str] = [] if has_torchrl else ["  torchrl: not installed (its columns are empty)"]
    seed, why_absent = real_seed.load()
    notes.append(f"  rlightning: RLightning's ReplayBuffer from {seed.repo}" if seed is not None
                 else f"  rlightning: {why_absent} (its columns are empty)")
    keys = {"sample": accepts(ab.ExperienceStore.sample, "keys"),
            "iter_batches": accepts(ab.ExperienceStore.iter_batches, "keys")}
    for method, accepted in keys.items():
        if not accepted:
            notes.append(f"  arrowbuf_keys: ExperienceStore.{method} takes no keys= yet: no {method} column")
    metrics: list[Metric] = []
    for shape in spec.shapes:
        metrics += onpolicy_shape(shape, spec, opts, keys, notes, seed, has_torchrl)
        gc.collect()
    judged = "arrowbuf_keys" if all(keys.values()) else "arrowbuf"
    for metric in metrics:
        if "torch arena" in metric.name:
            metric.met = metric.ratios["arrowbuf_torch/ideal"].median >= 0.9
            metric.target = "arrowbuf_torch/ideal >= 0.9"
            continue
        # Against the real seed where its checkout is there; else against the proxy (so labelled).
        peer = "rlightning" if seed is not None else "seed"
        metric.met = metric.ratios[f"{judged}/ideal"].median >= 0.9 and (
            "epochs" in metric.name or metric.ratios[f"{judged}/{peer}"].median >= 3)
        metric.target = f"{judged}/ideal >= 0.9" + ("" if "epochs" in metric.name else f", {judged}/{peer} >= 3")
    flag_noisy("ONPOLICY", metrics, notes)
    notes.append("  ms = median time of one call; ratios are speed-ups (time of the other / time of arrowbuf). "
                 "arrowbuf samples the rollout with store.sample(n) (uniform, with replacement), the others "
                 "with a permutation: the same rows gathered")
    notes.append(load_note(load_start))
    extra = ["arrowbuf_torch", "arrowbuf_cuda"] if opts.torch_device() == "cuda" else ["arrowbuf_torch"]
    return WorkloadResult("ONPOLICY", spec.short(), spec.describe(), CONTENDERS + extra, metrics, notes,
                          time.perf_counter() - t0,
                          labels={"ideal": "ideal (np.take, out=)",
                                  "rlightning": "RLightning (real seed)" if seed is not None else "real seed (absent)",
                                  "seed": "seed-like proxy (TensorDict)",
                                  "torchrl": "torchrl LazyTensorStorage", "arrowbuf_keys": "arrowbuf keys=",
                                  "arrowbuf_torch": f"torch arena ({opts.torch_device()})",
                                  "arrowbuf_cuda": "keys= to cuda"},
                          ratio_columns=["arrowbuf/ideal", "arrowbuf/rlightning", "arrowbuf/seed",
                                         "arrowbuf_keys/ideal", "arrowbuf_keys/rlightning", "arrowbuf_keys/seed",
                                         *(f"{c}/ideal" for c in extra)])


def onpolicy_shape(shape: RolloutShape, spec: OnPolicySpec, opts: Options, keys: dict[str, bool],
                   notes: list[str], seed: object = None, has_torchrl: bool = True) -> list[Metric]:
    """Build the contenders over one rollout, time them, and drop them."""
    rollout = make_rollout(shape)
    contenders: dict[str, RolloutContender] = {
        "ideal": IdealRollout(shape, rollout, spec.minibatches),
        **({"rlightning": RealSeedRollout(shape, rollout, spec.minibatches, seed)} if seed is not None else {}),
        "seed": SeedRollout(shape, rollout, spec.minibatches),
        **({"torchrl": TorchRLRollout(shape, rollout, spec.minibatches)} if has_torchrl else {}),
        "arrowbuf": ArrowbufRollout(shape, rollout, spec.minibatches),
    }
    torch_device = opts.torch_device()
    if any(keys.values()):
        contenders["arrowbuf_keys"] = ArrowbufRollout(shape, rollout, spec.minibatches, keys=list(shape.fields))
    arenas = {"arrowbuf_torch": ArrowbufRollout(shape, rollout, spec.minibatches, keys=list(shape.fields),
                                                storage_device=torch_device)}
    if torch_device == "cuda":
        arenas["arrowbuf_cuda"] = ArrowbufRollout(shape, rollout, spec.minibatches, keys=list(shape.fields),
                                                  device="cuda")
    del rollout
    log(f"  ONPOLICY {shape.name}: {len(contenders)} stores filled ({shape.transitions:,} transitions)")
    samplers = {c: k.sample_all for c, k in contenders.items() if c != "arrowbuf_keys" or keys["sample"]}
    epochs = {c: (lambda k=k: k.epochs(spec.epochs)) for c, k in contenders.items()
              if c != "arrowbuf_keys" or keys["iter_batches"]}
    check_batches(shape, {c: contenders[c] for c in samplers}, notes)
    on_arenas = {"ideal": samplers["ideal"], **{c: k.sample_all for c, k in arenas.items()}}
    if "arrowbuf_keys" in samplers:
        on_arenas["arrowbuf_keys"] = samplers["arrowbuf_keys"]
    for fn in [*samplers.values(), *epochs.values(), *on_arenas.values()]:   # warm-up (first touch, lazy imports)
        fn()
    peers = tuple(p for p in ("ideal", "rlightning", "seed", "torchrl") if p in contenders)
    ratios = {**over("arrowbuf", *peers), **over("arrowbuf_keys", *peers)}
    rss = rss_bytes()
    metrics = compare(f"ONPOLICY {shape.name}", [
        Race(f"{shape.name} rollout sample", "ms", samplers, {k: v for k, v in ratios.items() if set(v) <= set(samplers)},
             per_call=True, scale=1e3),
        Race(f"{shape.name} {spec.epochs}x{spec.minibatches} epochs", "ms", epochs,
             {k: v for k, v in ratios.items() if set(v) <= set(epochs)}, per_call=True, scale=1e3),
        Race(f"{shape.name} rollout sample, torch arena ({torch_device})", "ms", on_arenas,
             {k: tuple(k.split("/")) for k in TORCH_RATIOS if set(k.split("/")) <= set(on_arenas)},
             per_call=True, scale=1e3),
    ], max(2, min(opts.rounds, 5)), opts.min_time, 2)
    if opts.profile:
        store = contenders["arrowbuf"]
        notes.append(profile_calls(f"{shape.name} arrowbuf sample({shape.transitions})", store.sample_all, 3))
        notes.append(profile_calls(f"{shape.name} arrowbuf {spec.epochs} epochs", lambda: store.epochs(spec.epochs), 1))
    notes.append(f"  {shape.name}: RSS {rss / 2**20:,.0f} MiB before the timed rounds, {rss_bytes() / 2**20:,.0f} "
                 f"MiB after; {shape.row_bytes:,} B per transition, {shape.transitions:,} transitions "
                 f"({shape.transitions * shape.row_bytes / 2**20:,.0f} MiB) per rollout sample")
    contenders.clear()
    arenas.clear()
    return metrics


def check_batches(shape: RolloutShape, contenders: dict[str, RolloutContender], notes: list[str]) -> None:
    """arrowbuf's samples carry every field (and with keys=, no ``next``)."""
    for name in ("arrowbuf", "arrowbuf_keys"):
        if name not in contenders:
            continue
        got = contenders[name].sample_all().keys(include_nested=True, leaves_only=True)
        missing = [f for f in shape.fields if f not in got]
        if missing:
            notes.append(f"  BUG? {shape.name}: {name} sample lacks {missing}")
        if name == "arrowbuf_keys" and any(isinstance(k, tuple) and k[0] == "next" for k in got):
            notes.append(f"  {shape.name}: arrowbuf keys= sample still gathers next observations")


register(Workload(
    "ONPOLICY", "on-policy PPO: whole-rollout sample and 4x8 minibatch epochs, WBC 4096x24 and VLA 32x160 rows",
    full=OnPolicySpec((wbc(4096), vla(32, 160))),
    quick=OnPolicySpec((wbc(256), vla(8, 40))),
    smoke=OnPolicySpec((wbc(64), vla(4, 16))),
    run=run_onpolicy))
