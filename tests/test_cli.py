"""The `arrowbuf` command line: `arrowbuf inspect` on exports and checkpoints."""

from __future__ import annotations

import re
import subprocess
import sys

import pyarrow.compute as pc
import pytest
from PIL import Image

import arrowbuf as ab
from arrowbuf.cli import main

from support.envs import cartpole_store


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
    err = capsys.readouterr().err
    assert err.startswith("arrowbuf inspect: error: ") and "neither a Parquet export" in err and "Traceback" not in err


# -- argument errors: argparse's exit status 2 and one line, never a traceback ------------


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arrowbuf.cli", *args], capture_output=True, text=True, check=False)


def _error_line(stderr: str) -> str:
    """The one line after the usage that says what is wrong."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, stderr
    return errors[0]


@pytest.mark.parametrize("args, message", [
    (["demo", "--steps", "0"], "arrowbuf demo: error: argument --steps: expected an int >= 1, got 0"),
    (["demo", "--num-envs", "0"], "arrowbuf demo: error: argument --num-envs: expected an int >= 1, got 0"),
    (["demo", "--steps", "many"], "arrowbuf demo: error: argument --steps: expected an int >= 1, got 'many'"),
    (["demo", "--seed", "-1"], "arrowbuf demo: error: argument --seed: expected an int >= 0, got -1"),
])
def test_bad_demo_numbers_exit_with_status_2_and_name_the_argument(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert _error_line(capsys.readouterr().err) == message


def test_a_bad_argument_in_a_subprocess_prints_no_traceback():
    run = _run_cli("demo", "--num-envs", "0")
    assert run.returncode == 2 and run.stdout == ""
    assert _error_line(run.stderr).endswith("argument --num-envs: expected an int >= 1, got 0")


def test_demo_refuses_an_existing_export_directory_before_training(tmp_path, capsys, monkeypatch):
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "kept.txt").write_text("not ours")
    trained = []
    monkeypatch.setattr("arrowbuf.demo.run_demo", lambda **kwargs: trained.append(kwargs))
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--quiet", "--export", str(tmp_path / "replay")])
    assert exited.value.code == 2 and trained == [], "the check must come before the run"
    assert "exists and is not empty; pass --overwrite to replace it" in _error_line(capsys.readouterr().err)
    assert (tmp_path / "replay" / "kept.txt").read_text() == "not ours"


def test_demo_refuses_an_export_directory_whose_parent_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--export", str(tmp_path / "missing" / "replay")])
    assert exited.value.code == 2
    assert "argument --export: the parent directory of" in _error_line(capsys.readouterr().err)


def test_demo_overwrite_replaces_an_existing_export(tmp_path, capsys):
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "old.txt").write_text("old")
    assert main(["demo", "--steps", "600", "--quiet", "--export", str(tmp_path / "replay"), "--overwrite"]) == 0
    assert "exported" in capsys.readouterr().out
    assert not (tmp_path / "replay" / "old.txt").exists()
    assert ab.ExperienceStore.from_parquet(tmp_path / "replay").num_episodes > 0


@pytest.mark.parametrize("plot, message", [
    ("missing/summary.png", "argument --plot: the directory of"),
    ("summary.unknown", "argument --plot:"),
    (".", "argument --plot:"),
])
def test_inspect_refuses_a_plot_path_it_cannot_write_before_reading(store, tmp_path, capsys, plot, message):
    export = store.to_parquet(tmp_path / "export", progress=False)
    with pytest.raises(SystemExit) as exited:
        main(["inspect", str(export), "--plot", str(tmp_path / plot)])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert message in _error_line(captured.err) and captured.out == ""


def _exit_and_stdout(args: list[str], capsys) -> tuple[int, str]:
    """``main(args)``'s exit status and what it printed, in this process (a subprocess of the entry
    is test_a_bad_argument_in_a_subprocess_prints_no_traceback's: each costs a second of imports)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(args)
    return exited.value.code, capsys.readouterr().out


def test_version_prints_the_package_version(capsys):
    code, out = _exit_and_stdout(["--version"], capsys)
    assert code == 0 and out.strip() == f"arrowbuf {ab.__version__}"


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")   # argparse's width, as in a subprocess without a terminal
    code, demo_help = _exit_and_stdout(["demo", "--help"], capsys)
    assert code == 0
    for text in ("--steps STEPS", "(default: 50000)", "(default: 4)", "--overwrite", "(default: None)"):
        assert text in demo_help
