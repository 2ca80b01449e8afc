"""A LeRobot v3 dataset written by ``lerobot`` itself (``tests/data``, made by ``tests/data/make_lerobot_v3.py``).

The tabular columns are opened and sampled as the writer wrote them; the camera feature is an AV1 video,
which the dataset lists as skipped (issue 35 decodes it at gather; the test data is here for that).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

import arrowbuf as ab

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
import make_lerobot_v3 as made  # noqa: E402


def _copy(tmp_path: Path) -> Path:
    """The dataset copied where its cache may be written (the committed copy stays read-only)."""
    root = tmp_path / "lerobot"
    shutil.copytree(DATA / "lerobot_v3_video", root)
    return root


def test_a_dataset_written_by_lerobot_opens_with_its_episodes_and_values(tmp_path):
    dataset = ab.open_dataset(_copy(tmp_path), seed=0)
    assert dataset.info["kind"] == "lerobot" and dataset.info["codebase_version"] == "v3.0"
    assert dataset.info["skipped"] == ["observation.images.front (video)"]
    episodes = dataset.episodes().to_pandas()
    # LeRobot's last frame of an episode is its final observation: T frames make T - 1 transitions.
    assert episodes["length"].tolist() == [n - 1 for n in made.EPISODES]
    assert len(dataset) == sum(made.EPISODES) - len(made.EPISODES)
    batch = dataset.sample(256)
    state = batch["observation", "state"].numpy()
    step = batch["step"].numpy()
    episode = state[:, 0].astype(int)            # the script writes [episode, t, t / 2, -t]
    np.testing.assert_array_equal(state[:, 1], step)
    expected_action = np.stack([made.action(e, t) for e, t in zip(episode, step)])
    np.testing.assert_array_equal(batch["action"].numpy(), expected_action)
    np.testing.assert_array_equal(batch["next", "observation", "state"].numpy()[:, 1], step + 1)
    rewards = [made.reward(e, t, made.EPISODES[e]) for e, t in zip(episode, step)]
    np.testing.assert_array_equal(batch["reward"].numpy(), np.array(rewards, np.float32))
    assert not batch["terminated"].any()         # next.done is set on the last frame only, which has no next one


def test_the_committed_video_holds_the_frames_the_script_encoded():
    """The data's video decodes (PyAV, FFmpeg in its wheel) to the script's frames within AV1's loss."""
    av = __import__("pytest").importorskip("av")
    video = DATA / "lerobot_v3_video" / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    expected = [made.frame(e, t) for e, n in enumerate(made.EPISODES) for t in range(n)]
    assert len(frames) == len(expected) == pq.read_table(DATA / "lerobot_v3_video" / "data").num_rows
    psnr = [10 * np.log10(255.0 ** 2 / np.mean((a.astype(np.float64) - b) ** 2)) for a, b in zip(frames, expected)]
    assert min(psnr) > 30.0
