"""IMAGES' frames: crops of a real photograph seen by a panning camera, and their PSNR.

The photograph is matplotlib's bundled ``grace_hopper.jpg`` (600 x 512, a real photo:
skin, cloth, a flag and a dark background, so a codec meets real texture and real
gradients, not synthetic noise that no codec compresses or flat colour that every codec
does). An episode is a camera path over it: a 224 x 224 window that starts somewhere
new, moves a few pixels a step, drifts its velocity now and then, and bounces off the
photo's edges. Nothing is upscaled.

Each source episode keeps its path, so a sampled row's original frame is recovered from
its ``episode_id`` (which source it was) and ``step`` (where the window was).

Example:
    >>> photo = load_photo()
    >>> path = camera_path(np.random.default_rng(0), photo.shape, (224, 224), 10)
    >>> path.shape, frames_along(photo, path, (224, 224)).shape
    ((11, 2), (11, 224, 224, 3))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PHOTO = "grace_hopper.jpg"   # in matplotlib's sample data (matplotlib: the [bench] and [test] extras)
MAX_SPEED = 4                # pixels a step, along each axis


def load_photo() -> np.ndarray:
    """matplotlib's bundled photograph, uint8 RGB (600, 512, 3)."""
    from matplotlib import cbook
    from PIL import Image

    with cbook.get_sample_data(PHOTO) as f, Image.open(f) as image:
        return np.asarray(image.convert("RGB"))


def camera_path(rng: np.random.Generator, photo_shape: Sequence[int], frame: Sequence[int], steps: int) -> np.ndarray:
    """Top-left corners (y, x) of ``steps + 1`` windows of size ``frame`` panning over the photo."""
    room = np.array([photo_shape[0] - frame[0], photo_shape[1] - frame[1]])
    if (room < 0).any():
        raise ValueError(f"frames of {tuple(frame[:2])} do not fit in a photo of {tuple(photo_shape[:2])}")
    at = rng.integers(0, room + 1)
    velocity = rng.integers(-3, 4, 2)
    velocity[velocity == 0] = 1
    path = np.empty((steps + 1, 2), np.int64)
    for t in range(steps + 1):
        path[t] = at
        if rng.random() < 0.1:   # a hand-held camera: the pan drifts
            velocity = np.clip(velocity + rng.integers(-1, 2, 2), -MAX_SPEED, MAX_SPEED)
        step = at + velocity
        bounce = (step < 0) | (step > room)
        velocity[bounce] = -velocity[bounce]
        at = np.clip(at + velocity, 0, room)
    return path


def frames_along(photo: np.ndarray, path: np.ndarray, frame: Sequence[int]) -> np.ndarray:
    """The frames a camera path sees, contiguous uint8 (len(path), H, W, C)."""
    h, w = frame[0], frame[1]
    return np.stack([photo[y:y + h, x:x + w] for y, x in path.tolist()])


@dataclass
class Footage:
    """Source episodes: each one's camera path and frames (T + 1), and the small step fields."""

    paths: list[np.ndarray]
    frames: list[np.ndarray]

    @property
    def episode_len(self) -> int:
        return len(self.frames[0]) - 1

    def episode(self, source: int, frames_key: str = "obs") -> dict[str, np.ndarray]:
        """Source ``source`` as an ``add_episode`` dict: frames (T + 1), action, reward, terminated."""
        T = self.episode_len
        terminated = np.zeros(T, bool)
        terminated[-1] = True
        steps = np.arange(T)
        return {frames_key: self.frames[source], "action": (steps % 6).astype(np.int64),
                "reward": np.cos(steps / 7).astype(np.float32), "terminated": terminated}


def make_footage(episodes: int, episode_len: int, frame: Sequence[int], seed: int = 0) -> Footage:
    """``episodes`` camera paths of ``episode_len`` steps over the photograph, and their frames."""
    rng = np.random.default_rng(seed)
    photo = load_photo()
    paths = [camera_path(rng, photo.shape, frame, episode_len) for _ in range(episodes)]
    return Footage(paths, [frames_along(photo, path, frame) for path in paths])


def psnr(decoded: np.ndarray, original: np.ndarray) -> np.ndarray:
    """Peak signal-to-noise ratio (dB) of each decoded frame against its original (uint8 [N, ...])."""
    diff = decoded.reshape(len(decoded), -1).astype(np.float32) - original.reshape(len(original), -1)
    mse = np.einsum("ij,ij->i", diff, diff) / diff.shape[1]
    with np.errstate(divide="ignore"):
        return 10 * np.log10(255.0 ** 2 / mse)
