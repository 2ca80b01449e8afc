"""The main job, `arrowbuf demo`, at reduced length (the full run is the README's command)."""

from __future__ import annotations

import math

import pytest

import arrowbuf as ab
from arrowbuf.cli import main
from arrowbuf.demo import run_demo


def test_a_short_demo_run_fills_the_store_with_every_episode_it_played():
    result = run_demo(total_steps=2_000, num_envs=4, progress=False)
    store = result.store
    assert result.steps == 2_000
    assert result.episodes > 10
    assert math.isfinite(result.mean_return_last20) and result.mean_return_last20 >= 8   # CartPole's minimum
    assert result.samples_per_second > 0
    episodes = store.episodes()
    # Finished episodes plus the ones still open at the end (flushed into the store).
    assert store.num_episodes >= result.episodes
    assert sum(episodes.column("length").to_pylist()) == len(store)
    # Every env step but the autoreset ones (one after each finished episode, unless
    # it ended on the very last step of its env) is a stored transition.
    assert result.steps - result.episodes <= len(store) <= result.steps - result.episodes + 4
    batch = store.sample(64)
    assert batch["obs"].shape == (64, 4) and batch["next", "obs"].shape == (64, 4)


def test_the_demo_command_prints_a_summary_and_exports_its_replay(tmp_path, capsys):
    assert main(["demo", "--steps", "1500", "--quiet", "--export", str(tmp_path / "replay")]) == 0
    out = capsys.readouterr().out
    assert "steps=1500" in out and "mean_return_last20=" in out and "exported" in out
    loaded = ab.ExperienceStore.from_parquet(tmp_path / "replay")
    assert loaded.num_episodes > 5


@pytest.mark.parametrize("kwargs, name", [({"total_steps": 0}, "total_steps"), ({"num_envs": 0}, "num_envs")])
def test_the_demo_refuses_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        run_demo(progress=False, **kwargs)
