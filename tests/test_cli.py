"""The `arrowbuf` command line: `arrowbuf inspect` on exports and checkpoints."""

from __future__ import annotations

import re
import subprocess
import sys

import pyarrow.compute as pc
import pytest
from PIL import Image

from arrowbuf.cli import main

from _cartpole import cartpole_store


@pytest.fixture(scope="module")
def store():
    return cartpole_store(steps=400)


def _mean_return(output: str) -> float:
    return float(re.search(r"return\s*│\s*([-\d.]+)", output).group(1))


def test_inspect_prints_the_episode_count_and_mean_return_of_a_fresh_export(store, tmp_path, capsys):
    export = store.to_parquet(tmp_path / "export", progress=False)
    episodes = store.episodes()
    assert main(["inspect", str(export)]) == 0
    out = capsys.readouterr().out
    assert f"parquet export {export}: {episodes.num_rows} episodes" in out
    assert _mean_return(out) == round(pc.mean(episodes.column("return")).as_py(), 2)
    for text in ("obs", "float32", "(4,)", "observation", "episodes.parquet", "steps/part-", "total"):
        assert text in out


def test_inspect_of_a_checkpoint_writes_the_summary_figure_as_png(store, tmp_path):
    checkpoint = store.save(tmp_path / "checkpoint", progress=False)
    png = tmp_path / "summary.png"
    run = subprocess.run([sys.executable, "-m", "arrowbuf.cli", "inspect", str(checkpoint), "--plot", str(png)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert f"checkpoint {checkpoint}: {store.num_episodes} episodes" in run.stdout
    assert _mean_return(run.stdout) == round(pc.mean(store.episodes().column("return")).as_py(), 2)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 0 and image.height > 0
        image.verify()


def test_inspect_of_a_directory_that_is_not_an_export_fails_with_a_message(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "neither a Parquet export" in capsys.readouterr().err
