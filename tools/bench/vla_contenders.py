"""VLA's contenders: online stores with the LeRobot dataset's fields, and the ideal video decoder.

- `online_store`: an ``ExperienceStore`` with the fields the bench's LeRobot dataset
  (`lerobot_video`) opens with (``observation.images.front``, ``observation.state``,
  ``action``, ``reward``, ``terminated``, ``timestamp``, ``dataset_index``,
  ``task_index``), its camera stored by ``codec`` (``"jpeg:90"``) or raw, filled with
  the same footage: what a `Mixture` needs to stack the two into one batch.
- `IdealVideo`: the floor of decoding a batch's video frames with PyAV alone: the same
  kind of draw (uniform transitions, each frame and, optionally, its next frame), the
  distinct frames in time order, decoded from a container opened once whose every
  keyframe is known (demuxed once, up front: arrowbuf learns them as it decodes), a seek
  only where a keyframe lies past the frame decoded last (decoding on from there decodes
  no more frames), each wanted frame converted by one persistent ``VideoReformatter``
  (one thread) into a preallocated, pre-touched batch. ``threads``: the decoder's
  threads (1, or 0: FFmpeg's choice, slice threads).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from .camera import Footage
from .lerobot_video import FPS, STATE, TASK, state


def online_store(footage: Footage, capacity: int, codec: str | None, seed: int = 1) -> Any:
    """A store of the dataset's fields, camera by ``codec`` (None: raw), filled a lap of the footage."""
    import arrowbuf as ab

    frame = footage.frames[0].shape[1:]
    store = ab.ExperienceStore(capacity, seed=seed, schema={
        "observation": {"images": {"front": ab.Field("uint8", frame, observation=True, codec=codec)},
                        "state": ab.Field("float32", (STATE,), observation=True)},
        "action": ab.Field("float32", (2,)), "reward": "float32", "terminated": "bool", "timestamp": "float32",
        "dataset_index": "int64", "task_index": "int64", "task": ab.Field("string")})
    added = 0
    while len(store) < capacity:
        source = added % len(footage.frames)
        T = footage.episode_len
        steps = np.arange(T)
        store.add_episode({"observation": {"images": {"front": footage.frames[source]}, "state": state(source, T + 1)},
                           "action": np.stack([np.sin(steps / 5), np.ones(T)], axis=1).astype(np.float32),
                           "reward": np.zeros(T, np.float32), "terminated": steps == T - 1,
                           "timestamp": (steps / FPS).astype(np.float32), "dataset_index": np.full(T, -1, np.int64),
                           "task_index": np.zeros(T, np.int64), "task": [TASK] * T})
        added += 1
    return store


class IdealVideo:
    """Random transitions' frames of one video file decoded by PyAV alone (see the module docstring).

    Args:
        path: the MP4 (every episode's frames one after another).
        starts: frame numbers of the transitions (frames with a next frame in their episode).
        batch_size: transitions a batch.
        threads: the decoder's threads (0: FFmpeg's choice).
    """

    def __init__(self, path: str, starts: np.ndarray, batch_size: int, frame: tuple[int, ...], threads: int) -> None:
        import av
        from av.video.reformatter import VideoReformatter

        self.container = av.open(path)
        self.stream = stream = self.container.streams.video[0]
        self.tick = float(stream.time_base) * FPS                # frames per pts unit
        self.first = stream.start_time or 0
        self.keyframes = sorted(round((p.pts - self.first) * self.tick) for p in self.container.demux(stream)
                                if p.pts is not None and p.is_keyframe)
        self.container.seek(self.first, stream=stream, backward=True)
        stream.thread_type = "SLICE"
        stream.thread_count = threads
        self.reformat = VideoReformatter().reformat
        self.starts = starts
        self.out = np.empty((2 * batch_size, *frame), np.uint8)
        self.out[...] = 0   # pre-touch
        self.rng = np.random.default_rng(2)

    def sample(self, batch_size: int, with_next: bool = True) -> np.ndarray:
        """Decode ``batch_size`` random transitions' frames (and their next frames): the dataset's work."""
        rows = self.starts[self.rng.integers(0, len(self.starts), batch_size)]
        if with_next:
            rows = np.concatenate([rows, rows + 1])
        wanted = np.unique(rows).tolist()
        out, frames, at = self.out, None, -1
        for i, n in enumerate(wanted):
            k = self.keyframes[bisect.bisect_right(self.keyframes, n) - 1]
            if frames is None or k > at + 1:
                self.container.seek(self.first + int((n + 0.25) / self.tick), stream=self.stream, backward=True)
                frames = self.container.decode(self.stream)
            for frame in frames:
                if round((frame.pts - self.first) * self.tick) == n:
                    out[i] = self.reformat(frame, format="rgb24", threads=1).to_ndarray()
                    at = n
                    break
            else:
                raise RuntimeError(f"frame {n} not found")
        return out[:len(wanted)]

    def close(self) -> None:
        self.container.close()
