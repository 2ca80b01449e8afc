"""VLA: an off-policy VLA's batches (issue 35): LeRobot video demos mixed with an online JPEG store.

The demonstrations are a LeRobot v3 dataset whose camera is an AV1 video
(`lerobot_video`: the layout, written by the bench with PyAV at lerobot's default
settings, not by lerobot itself), opened with ``ab.open_dataset``; the online store keeps
the same fields, its camera JPEG-encoded (``codec="jpeg:90"``), or raw for the figure
beside it. Frames are the IMAGES footage: crops of a real photograph along camera paths,
224 x 224 x 3. Measured:

- ``Dataset.sample(64)`` of the video field (``keys=`` of the camera alone, and with the
  next observation) against PyAV decoding the same kind of draw alone (`IdealVideo`: every
  keyframe known up front, one decoder thread, or FFmpeg's choice of threads). Target:
  arrowbuf/pyav >= 0.8 against both.
- ``Mixture.sample(256)`` rows/s of a 50/50 mixture of the demos and the online JPEG store,
  beside the same mixture with a raw online store (report); for information, each half
  alone (``sample(128)`` of the demos, of the JPEG store, of the raw store), and the
  PSNR of a mixed batch's frames against the frames written (AV1 demos, JPEG online rows).

Every dataset here keeps no decoded frames (``video_cache_bytes=0``): the bench's few
thousand frames would fit in the default 256 MiB cache and be decoded once, where a real
demo set of 100k frames and more mostly misses it.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..camera import make_footage, psnr
from ..harness import Options, Race, Workload, compare, flag_noisy, load_note, log, over, profile_calls, register, \
    start_workload
from ..lerobot_video import CAMERA, CRF, FPS, GOP, VIDEO, encoder, write_lerobot
from ..results import Metric, Series, WorkloadResult
from ..vla_contenders import IdealVideo, online_store

CONTENDERS = ["arrowbuf", "pyav", "pyav_threads", "mix_jpeg", "mix_raw", "demos", "online_jpeg", "online_raw"]
LABELS = {"arrowbuf": "arrowbuf Dataset.sample (video)", "pyav": "PyAV alone, 1 thread",
          "pyav_threads": "PyAV alone, FFmpeg's threads", "mix_jpeg": "Mixture: demos + online jpeg:90",
          "mix_raw": "Mixture: demos + online raw u8", "demos": "demos alone (half)",
          "online_jpeg": "online jpeg:90 alone (half)", "online_raw": "online raw alone (half)"}
RATIO_COLUMNS = ["arrowbuf/pyav", "arrowbuf/pyav_threads", "mix_jpeg/mix_raw"]
TARGET = 0.8
KEY = tuple(CAMERA.split("."))


@dataclass(frozen=True)
class VLASpec:
    """The demos, the online stores and the batches."""

    episode_len: int            # T: T + 1 frames an episode (demos and online)
    episodes: int               # camera paths: the demo episodes, cycled by the online stores
    online_transitions: int     # capacity of each online store
    batch_size: int = 256       # Mixture.sample
    video_batch: int = 64       # Dataset.sample of the video alone
    frame: tuple[int, int, int] = (224, 224, 3)
    demo_weight: float = 0.5

    def short(self) -> str:
        return (f"u8{list(self.frame)} camera; {self.episodes * (self.episode_len + 1):,}-frame AV1 demos + "
                f"{self.online_transitions:,}-transition online store; Mixture.sample({self.batch_size}), "
                f"video sample({self.video_batch})")

    def describe(self) -> str:
        return (f"demos: LeRobot v3 layout written by the bench with PyAV ({encoder()}, g={GOP}, crf={CRF}, "
                f"yuv420p, {FPS} fps; lerobot's defaults are libsvtav1, g=2, crf=30), {self.episodes} episodes of "
                f"{self.episode_len + 1} frames in one MP4, observation.state f32[4], action f32[2]; online: the "
                f"same fields, camera jpeg:90 or raw, {self.online_transitions:,} transitions of the same camera paths; "
                f"{self.demo_weight:.0%} demos; no decoded-frame cache")


def run_vla(spec: VLASpec, opts: Options) -> WorkloadResult:
    """Write the demos, fill the online stores, time the video and mixture samples in interleaved rounds."""
    import av  # noqa: F401  imported before start_workload freezes what exists
    import simplejpeg  # noqa: F401

    import arrowbuf as ab

    t0 = start_workload()
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    footage = make_footage(spec.episodes, spec.episode_len, spec.frame)
    with tempfile.TemporaryDirectory(prefix="arrowbuf-vla-") as tmp:
        start = time.perf_counter()
        root = write_lerobot(Path(tmp) / "demos", footage)
        size = (root / VIDEO).stat().st_size
        frames = spec.episodes * (spec.episode_len + 1)
        notes.append(f"  demos: {frames:,} frames written in {time.perf_counter() - start:.1f} s; the MP4 is "
                     f"{size / 1e6:.1f} MB, {size / frames / 1e3:.1f} kB a frame "
                     f"({size / (frames * int(np.prod(spec.frame))):.3f} of raw)")
        video = ab.open_dataset(root, seed=0, video_cache_bytes=0)
        demos = ab.open_dataset(root, seed=1, video_cache_bytes=0)
        jpeg, raw = (online_store(footage, spec.online_transitions, codec) for codec in ("jpeg:90", None))
        log(f"  VLA: demos {len(video):,} transitions, online stores {len(jpeg):,} transitions")
        metrics = measure(spec, opts, root, footage, video, demos, jpeg, raw, notes)
        for dataset in (video, demos):
            dataset.close()
        gc.collect()
    flag_noisy("VLA", metrics, notes)
    notes.append(load_note(load_start))
    return WorkloadResult("VLA", spec.short(), spec.describe(), CONTENDERS, metrics, notes,
                          time.perf_counter() - t0, labels=LABELS, ratio_columns=RATIO_COLUMNS)


def measure(spec: VLASpec, opts: Options, root: Path, footage, video, demos, jpeg, raw, notes: list[str]) -> list:
    """The races, the frames' PSNR, and the notes on what they time."""
    import arrowbuf as ab

    B, V = spec.batch_size, spec.video_batch
    T = spec.episode_len
    starts = np.concatenate([np.arange(T) + e * (T + 1) for e in range(spec.episodes)])   # frames with a next
    ideals = {name: IdealVideo(str(root / VIDEO), starts, V, spec.frame, threads)
              for name, threads in (("pyav", 1), ("pyav_threads", 0))}
    weights = {"demos": spec.demo_weight, "online": 1 - spec.demo_weight}
    mixes = {name: ab.Mixture({"demos": demos, "online": store}, weights=weights, seed=0)
             for name, store in (("mix_jpeg", jpeg), ("mix_raw", raw))}
    half = mixes["mix_jpeg"].counts(B)
    camera = [CAMERA]
    alone = {"arrowbuf": lambda: video.sample(V, keys=camera),
             **{name: (lambda i=ideal: i.sample(V, with_next=False)) for name, ideal in ideals.items()}}
    paired = {"arrowbuf": lambda: video.sample(V),
              **{name: (lambda i=ideal: i.sample(V)) for name, ideal in ideals.items()}}
    mixed = {**{name: (lambda m=mix: m.sample(B)) for name, mix in mixes.items()},
             "demos": lambda: demos.sample(half["demos"]), "online_jpeg": lambda: jpeg.sample(half["online"]),
             "online_raw": lambda: raw.sample(half["online"])}
    units = {"mix_jpeg": B, "mix_raw": B, "demos": half["demos"], "online_jpeg": half["online"],
             "online_raw": half["online"]}
    for fn in [*alone.values(), *paired.values(), *mixed.values()]:   # warm-up: files open, slots, pools
        for _ in range(2):
            fn()
    quality = frame_psnr(mixes["mix_jpeg"].sample(B), footage, mixes["mix_jpeg"].position("demos"))

    def both(metric: Metric) -> bool:
        return min(metric.ratios["arrowbuf/pyav"].median, metric.ratios["arrowbuf/pyav_threads"].median) >= TARGET

    target = f"arrowbuf/pyav >= {TARGET} (both)"
    metrics = compare("VLA", [
        Race(f"video sample({V}), camera alone", "ms", alone, over("arrowbuf", "pyav", "pyav_threads"), target=target,
             goal=both, per_call=True, scale=1e3),
        Race(f"video sample({V}), camera + next camera", "ms", paired, over("arrowbuf", "pyav", "pyav_threads"),
             target=target, goal=both, per_call=True, scale=1e3),
        Race(f"Mixture.sample({B}), {spec.demo_weight:.0%} video demos", "rows/s", mixed, over("mix_jpeg", "mix_raw"),
             target="report: online jpeg:90 beside online raw (halves alone: info)", units=units),
    ], opts.rounds, opts.min_time, opts.slices)
    if opts.profile:
        notes.append(profile_calls(f"Dataset.sample({V}) of the video", paired["arrowbuf"], 10))
        notes.append(profile_calls(f"Mixture.sample({B}), demos + online jpeg:90", mixed["mix_jpeg"], 10))
    for ideal in ideals.values():
        ideal.close()
    metrics += [Metric(f"PSNR of a mixed batch's frames, {name}", "dB", {contender: Series([value])},
                       target="info: against the frames written (a wrong frame scores ~10-20 dB)")
                for name, contender, value in (("AV1 demos, worst", "demos", quality[0]),
                                               ("jpeg:90 online, worst", "online_jpeg", quality[1]))]
    notes.append(f"  video: {V} random transitions a batch (uniform over the demos' {len(starts):,}); 'camera alone': "
                 f"keys=[{CAMERA!r}] ({V} frames), '+ next camera': sample({V}) ({2 * V} frames, t and t + 1). "
                 "PyAV alone draws its own transitions the same way and decodes the distinct frames in time order "
                 "from one open container, every keyframe known, a seek only where a keyframe lies past the "
                 "frame decoded last, into a preallocated batch")
    notes.append(f"  Mixture: {half['demos']} demo rows (video decoded, camera and next camera) + {half['online']} "
                 "online rows (jpeg:90 decoded on the codec pool, or raw) a batch, with observation.state, action, "
                 "reward, terminated, timestamp, dataset_index, task_index, task (its string); the halves alone are "
                 "their sources' own sample of the same counts")
    return metrics


def frame_psnr(batch, footage, demos_position: int) -> tuple[float, float]:
    """The worst PSNR of a mixed batch's demo rows and online rows (camera and next camera) against
    the footage: ``observation.state`` holds each row's camera path and step."""
    state = batch["observation", "state"].numpy()
    source, step = state[:, 0].astype(int), state[:, 1].astype(int)
    demo = batch["source"].numpy() == demos_position
    worst = []
    for rows in (demo, ~demo):
        decoded = np.concatenate([batch[KEY].numpy()[rows], batch[("next", *KEY)].numpy()[rows]])
        written = np.concatenate([np.stack([footage.frames[s][t + k] for s, t in zip(source[rows], step[rows])])
                                  for k in (0, 1)])
        worst.append(float(psnr(decoded, written).min()))
    return worst[0], worst[1]


register(Workload(
    "VLA", "off-policy VLA: LeRobot AV1 video demos + online jpeg:90 store, Mixture.sample(256) rows/s (raw beside); "
           "video sample(64) vs PyAV alone",
    full=VLASpec(episode_len=200, episodes=8, online_transitions=4_000),
    quick=VLASpec(episode_len=100, episodes=4, online_transitions=1_000),
    smoke=VLASpec(episode_len=24, episodes=2, online_transitions=96, batch_size=16, video_batch=8, frame=(64, 64, 3)),
    run=run_vla))
