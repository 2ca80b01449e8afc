"""Write the small LeRobot v3 dataset with a video feature that the tests open (``tests/data/lerobot_v3_video``).

It is written by ``lerobot`` itself (0.4.x), which pins an older torch than arrowbuf's, so it runs in a
virtual environment of its own, once; its output is committed:

    python -m venv /tmp/lrvenv && /tmp/lrvenv/bin/pip install "lerobot==0.4.2"
    /tmp/lrvenv/bin/python tests/data/make_lerobot_v3.py [--out tests/data/lerobot_v3_video]

Frames are computed, not photographs: `frame(episode, t)` is a smooth pattern that moves a few pixels a
step, like a camera panning, so the tests compute the very frames that were encoded and compare the decoded
ones against them (AV1 is lossy: a PSNR bound, not equality). This module imports nothing but numpy at
its top, so the tests import `frame` and `EPISODES` from it without lerobot.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

#: Frames in each episode.
EPISODES = (12, 9, 15)
HEIGHT, WIDTH = 48, 64
FPS = 10
TASKS = ("pick the red cube", "open the drawer", "pick the red cube")


def frame(episode: int, t: int) -> np.ndarray:
    """The camera frame of step ``t`` of ``episode``: uint8 [H, W, 3]."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    shift = 3.0 * t + 11.0 * episode
    red = 127 + 100 * np.sin((x + shift) / 9.0)
    green = 127 + 100 * np.cos((y - 0.5 * shift) / 7.0)
    blue = 60 + 40 * episode + 2.0 * t + 0 * x
    return np.clip(np.stack([red, green, blue], axis=-1), 0, 255).astype(np.uint8)


def state(episode: int, t: int) -> np.ndarray:
    return np.array([episode, t, 0.5 * t, -t], np.float32)


def action(episode: int, t: int) -> np.ndarray:
    return np.array([0.1 * t, episode - 1.0], np.float32)


def reward(episode: int, t: int, length: int) -> float:
    """A shaped reward, and 1 on the last frame (where a success reward goes)."""
    return 1.0 if t == length - 1 else 0.125 * t - 0.5 * episode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "lerobot_v3_video"))
    args = parser.parse_args(argv)
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    features = {
        "observation.images.front": {"dtype": "video", "shape": (HEIGHT, WIDTH, 3),
                                     "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (4,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
        "next.done": {"dtype": "bool", "shape": (1,), "names": None},
    }
    dataset = LeRobotDataset.create("arrowbuf/lerobot_v3_video", fps=FPS, features=features, root=out,
                                    use_videos=True)
    for episode, length in enumerate(EPISODES):
        for t in range(length):
            dataset.add_frame({"observation.images.front": frame(episode, t),
                               "observation.state": state(episode, t), "action": action(episode, t),
                               "next.reward": np.array([reward(episode, t, length)], np.float32),
                               "next.done": np.array([t == length - 1]), "task": TASKS[episode]})
        dataset.save_episode()
    dataset.finalize()
    print("wrote", out, sum(f.stat().st_size for f in out.rglob("*") if f.is_file()), "bytes")


if __name__ == "__main__":
    main()
