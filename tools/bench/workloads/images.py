"""IMAGES: encoded image fields (issue 35): stored bytes, fidelity, memory and sample time.

Frames are 224 x 224 x 3 crops of a real photograph seen by a panning camera
(`camera`); every store is given the same episodes. Measured:

- stored bytes / raw bytes of ``codec="jpeg:90"``, ``"png"`` and ``"zstd"`` (the encoded
  column's ``heap.live`` over the rows it holds, each source episode stored once; exact,
  so one value, not rounds). Target: jpeg:90 <= 1/8.
- PSNR of jpeg:90 rows sampled back (``obs`` and ``("next", "obs")``) against the frames
  written, found by ``episode_id`` and ``step``: the mean and the worst of each round's
  batch. Targets: mean >= 35 dB, worst >= 30 dB.
- private memory (USS growth, in a fresh process) of a store of ``memory_rows`` jpeg:90
  rows, filled a lap and a tenth (so the ring evicts and the heap frees chunks), over
  the encoded bytes it holds (rows held x mean encoded row = ``heap.live``).
  Target <= 1.3.
- ``store.sample(B)`` of the jpeg:90 store (``obs`` and ``("next", "obs")``: 2B decodes)
  against the ideal decoding the same 2B byte strings on 2 threads (`IdealDecoder`),
  the raw uint8 store's sample, and TorchRL's `CompressedListStorage` (default zlib, and
  with simplejpeg functions); again with ``keys=`` that leave out the next observation
  (B decodes; TorchRL has no such selection). Target: arrowbuf/ideal >= 0.8.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import numpy as np

from ..camera import Footage, make_footage, psnr
from ..harness import Options, Race, Workload, at_least, compare, flag_noisy, load_note, log, over, profile_calls, \
    register, start_workload
from ..image_contenders import FIELDS, FrameStore, IdealDecoder, TorchRLCompressed
from ..memory import heap_probe, private_bytes, reset_peak_rss, rss_bytes, run_probe
from ..results import Metric, Series, WorkloadResult

CONTENDERS = ["arrowbuf", "ideal", "raw", "png", "zstd", "torchrl", "torchrl_jpeg"]
LABELS = {"arrowbuf": "arrowbuf jpeg:90", "ideal": "ideal: simplejpeg, 2 threads", "raw": "arrowbuf raw u8",
          "png": "arrowbuf png", "zstd": "arrowbuf zstd",
          "torchrl": "torchrl CompressedListStorage (zlib)", "torchrl_jpeg": "torchrl CompressedListStorage (jpeg:90)"}
RATIO_COLUMNS = ["arrowbuf/ideal", "arrowbuf/raw", "arrowbuf/torchrl", "arrowbuf/torchrl_jpeg"]
TARGETS = {"jpeg_bytes": 1 / 8, "psnr_mean": 35.0, "psnr_worst": 30.0, "memory": 1.3, "sample": 0.8}
JPEG = "jpeg:90"


@dataclass(frozen=True)
class ImagesSpec:
    """Footage, and the sizes of the stores each measurement fills."""

    episode_len: int             # T transitions (T + 1 frames) a camera path
    source_episodes: int         # distinct camera paths, cycled
    sample_transitions: int      # capacity of the sampled stores (jpeg:90, raw)
    memory_rows: int             # rows of frames the memory probe's store holds
    peer_transitions: int        # capacity of TorchRL's stores (a transition holds two frames there)
    batch_size: int = 256
    frame: tuple[int, int, int] = (224, 224, 3)
    codecs: tuple[str, ...] = (JPEG, "png", "zstd")

    @property
    def frame_bytes(self) -> int:
        return int(np.prod(self.frame))

    @property
    def memory_capacity(self) -> int:
        """Transitions of a store that holds ``memory_rows`` rows of whole episodes (T + 1 rows each)."""
        return self.memory_rows * self.episode_len // (self.episode_len + 1)

    def short(self) -> str:
        return (f"u8{list(self.frame)} camera crops of a photo; sample({self.batch_size}) of "
                f"{self.sample_transitions:,} transitions; memory at {self.memory_rows:,} rows")

    def describe(self) -> str:
        return (f"obs u8{list(self.frame)} (codec {', '.join(self.codecs)}, or raw), action i64, reward f32, "
                f"terminated; {self.source_episodes} camera paths of {self.episode_len} steps over "
                f"matplotlib's grace_hopper.jpg (600x512), cycled; sampled stores {self.sample_transitions:,} "
                f"transitions, TorchRL's {self.peer_transitions:,}; memory probe {self.memory_rows:,} rows")


def run_images(spec: ImagesSpec, opts: Options) -> WorkloadResult:
    """Fill the stores, read bytes and PSNR, time the samples in interleaved rounds, probe memory."""
    import arrowbuf  # noqa: F401  imported before start_workload freezes what exists
    import simplejpeg  # noqa: F401
    import torchrl.data  # noqa: F401

    t0 = start_workload()
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    footage = make_footage(spec.source_episodes, spec.episode_len, spec.frame)
    ratio = codec_bytes(spec, footage, notes)
    metrics = sampled(spec, opts, footage, ratio, notes)
    gc.collect()
    flag_noisy("IMAGES", metrics, notes)
    notes.append(load_note(load_start))
    if opts.memory:
        metrics.append(memory_metric(spec, opts))
    return WorkloadResult("IMAGES", spec.short(), spec.describe(), CONTENDERS, metrics, notes,
                          time.perf_counter() - t0, labels=LABELS, ratio_columns=RATIO_COLUMNS)


def codec_bytes(spec: ImagesSpec, footage: Footage, notes: list[str]) -> dict[str, float]:
    """Stored bytes / raw bytes of each codec's store of every source episode once."""
    ratio = {}
    for codec in spec.codecs:
        store = FrameStore(footage, spec.source_episodes * spec.episode_len, codec)
        start = time.perf_counter()
        store.fill(spec.source_episodes)
        seconds = time.perf_counter() - start
        rows, held = store.rows_held(), store.frame_bytes()
        ratio[codec] = held / (rows * spec.frame_bytes)
        notes.append(f"  {codec}: {held / rows / 1e3:.1f} kB a frame ({rows:,} frames, {rows / seconds:,.0f} "
                     "frames/s encoded and added)")
    return ratio


def sampled(spec: ImagesSpec, opts: Options, footage: Footage, ratio: dict[str, float],
            notes: list[str]) -> list[Metric]:
    """The sampled stores and peers: PSNR, stored bytes and the interleaved sample times."""
    B = spec.batch_size
    jpeg, raw = FrameStore(footage, spec.sample_transitions, JPEG), FrameStore(footage, spec.sample_transitions, None)
    for name, store in (("arrowbuf", jpeg), ("raw", raw)):
        store.fill(store.lap())
        log(f"  IMAGES: {name} filled ({store.rows_held():,} rows)")
    ideal = IdealDecoder(jpeg, B)
    peers = {"torchrl": TorchRLCompressed(footage, spec.peer_transitions, "zlib"),
             "torchrl_jpeg": TorchRLCompressed(footage, spec.peer_transitions, JPEG)}
    for name, peer in peers.items():
        start = time.perf_counter()
        peer.fill()
        log(f"  IMAGES: {name} filled ({peer.transitions():,} transitions, {time.perf_counter() - start:.1f} s)")
        ratio[name] = peer.frame_bytes() / (2 * peer.transitions() * spec.frame_bytes)

    keys = list(FIELDS)
    full = {"arrowbuf": lambda: jpeg.sample(B), "ideal": lambda: ideal.sample(B), "raw": lambda: raw.sample(B),
            **{name: (lambda p=peer: p.sample(B)) for name, peer in peers.items()}}
    no_next = {"arrowbuf": lambda: jpeg.sample(B, keys), "ideal": lambda: ideal.sample(B, with_next=False),
               "raw": lambda: raw.sample(B, keys)}
    for fn in [*full.values(), *no_next.values()]:   # warm-up: slots, pools, lazy imports
        for _ in range(3):
            fn()
    psnr_mean, psnr_worst = Series(), Series()
    for _ in range(opts.rounds):   # fidelity: a batch a round, obs and next obs against the frames written
        batch = jpeg.sample(B)
        obs, nxt = jpeg.originals(batch)
        quality = psnr(np.concatenate([batch["obs"].numpy(), batch["next", "obs"].numpy()]),
                       np.concatenate([obs, nxt]))
        psnr_mean.values.append(float(quality.mean()))
        psnr_worst.values.append(float(quality.min()))
        del batch
    target = f"arrowbuf/ideal >= {TARGETS['sample']}"
    metrics = compare("IMAGES", [
        Race(f"sample({B}), obs + next obs", "ms", full, over("arrowbuf", "ideal", "raw", "torchrl", "torchrl_jpeg"),
             target=target, goal=at_least("arrowbuf/ideal", TARGETS["sample"]), per_call=True, scale=1e3),
        Race(f"sample({B}), keys without next obs", "ms", no_next, over("arrowbuf", "ideal", "raw"),
             target=target, goal=at_least("arrowbuf/ideal", TARGETS["sample"]), per_call=True, scale=1e3),
    ], opts.rounds, opts.min_time, opts.slices)
    if opts.profile:
        notes.append(profile_calls(f"arrowbuf sample({B}) of {JPEG} rows", full["arrowbuf"], 20))
    ideal.close()

    per_transition = {"arrowbuf": jpeg.frame_bytes() / len(jpeg.store) / 1e3,
                      "raw": raw.frame_bytes() / len(raw.store) / 1e3,
                      **{name: peer.frame_bytes() / peer.transitions() / 1e3 for name, peer in peers.items()}}
    metrics += [
        Metric("stored bytes / raw bytes", "x",
               {"arrowbuf": ratio[JPEG], "raw": 1.0, "png": ratio.get("png"), "zstd": ratio.get("zstd"),
                "torchrl": ratio["torchrl"], "torchrl_jpeg": ratio["torchrl_jpeg"]},
               target=f"arrowbuf <= 1/{round(1 / TARGETS['jpeg_bytes'])}", met=ratio[JPEG] <= TARGETS["jpeg_bytes"]),
        Metric("stored kB per transition", "kB", per_transition,
               target="info: frames held a transition (arrowbuf: T + 1 per T; TorchRL: 2)"),
        Metric(f"PSNR {JPEG}, mean", "dB", {"arrowbuf": psnr_mean}, target=f"arrowbuf >= {TARGETS['psnr_mean']:g}",
               met=psnr_mean.median >= TARGETS["psnr_mean"]),
        Metric(f"PSNR {JPEG}, worst of a batch", "dB", {"arrowbuf": psnr_worst},
               target=f"arrowbuf >= {TARGETS['psnr_worst']:g}", met=min(psnr_worst.values) >= TARGETS["psnr_worst"]),
    ]
    notes.append(f"  PSNR over {opts.rounds} batches of {B} transitions (obs and next obs: {2 * B} frames each); "
                 f"worst of all {2 * B * opts.rounds} frames {min(psnr_worst.values):.1f} dB")
    notes.append("  stored bytes: heap.live of the obs column over the rows held (ratio columns: arrowbuf's over "
                 "theirs, < 1: arrowbuf stores less); TorchRL: its compressed obs and next_obs over the raw bytes of "
                 "both (it keeps two frames a transition; a nested ('next', 'obs') it would keep uncompressed); its "
                 "sample is made contiguous (.contiguous() of its lazy stack)")
    notes.append("  ideal: the store's JPEG bytes in a list, simplejpeg.decode_jpeg(data, buffer=out[i]) on a 2-thread "
                 "ThreadPoolExecutor into a reused output; torchvision.io.decode_jpeg is not measured: torchvision "
                 "cannot be installed beside torch 2.13 on this machine")
    return metrics


def memory_metric(spec: ImagesSpec, opts: Options) -> Metric:
    """The probe's private-memory growth over the encoded bytes it holds."""
    probe = run_probe("IMAGES", "arrowbuf", opts.quick, opts.smoke)
    rows, live, mib = probe["rows_held"], probe["heap_live"], 2**20
    text = (f"arrowbuf: {rows:,} rows held ({probe['episodes_added']:,} episodes added, a lap and a tenth), "
            f"{live / mib:,.0f} MiB encoded ({live / rows / 1e3:.1f} kB a row), heap chunks "
            f"{probe['heap_allocated'] / mib:,.0f} MiB; private memory +{probe['private_delta'] / mib:,.0f} MiB, RSS "
            f"+{probe['rss_delta'] / mib:,.0f} MiB, peak RSS +{probe['peak_rss_delta'] / mib:,.0f} MiB; after "
            f"{probe['samples']} samples of {spec.batch_size}, private "
            f"+{probe['private_after_samples'] / mib:,.0f} MiB")
    if spec.memory_rows < 200_000:
        text += f" ({spec.memory_rows:,} rows: a quick or smoke run; the full run holds 200,000)"
    value = probe["private_delta"] / live
    return Metric("private memory / encoded bytes", "x", {"arrowbuf": value}, target=f"arrowbuf <= {TARGETS['memory']}",
                  met=value <= TARGETS["memory"], detail={"arrowbuf": probe, "text": text})


def probe_images(spec: ImagesSpec, contender: str) -> dict:
    """Child process: private memory of a jpeg:90 store of ``memory_rows`` rows, filled a lap and a tenth."""
    import tensordict  # noqa: F401  every import before the baseline
    import torch

    import arrowbuf  # noqa: F401
    torch.set_num_threads(1)
    footage = make_footage(spec.source_episodes, spec.episode_len, spec.frame)
    gc.collect()
    baseline, private = rss_bytes(), private_bytes()
    exact = reset_peak_rss()
    store = FrameStore(footage, spec.memory_capacity, JPEG)
    lap = store.lap()
    store.fill(lap + max(1, lap // 10))
    return heap_probe(lambda: store.sample(spec.batch_size), store.column, baseline, private, exact,
                      contender=contender, rows_held=store.rows_held(), episodes_added=store.added)


register(Workload(
    "IMAGES", "encoded images: u8[224,224,3] camera crops, jpeg:90/png/zstd bytes, PSNR, memory at 200k rows, "
              "sample(256) vs simplejpeg and TorchRL",
    full=ImagesSpec(episode_len=200, source_episodes=8, sample_transitions=10_000, memory_rows=200_000,
                    peer_transitions=2_000),
    quick=ImagesSpec(episode_len=200, source_episodes=4, sample_transitions=4_000, memory_rows=5_000,
                     peer_transitions=600),
    smoke=ImagesSpec(episode_len=50, source_episodes=2, sample_transitions=300, memory_rows=1_000,
                     peer_transitions=50, batch_size=16),
    run=run_images, probe=probe_images))
