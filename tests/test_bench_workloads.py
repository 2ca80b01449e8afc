"""tools/bench.py: the quick GAE, replay (W1-W3, PER, PARQUET) and MIX workloads run and report
every ratio (a file of their own, so that pytest-xdist spreads the bench's runs over both workers).

They run in one subprocess of the real entry (``python tools/bench.py --only W1,...,MIX``): a
process that imports torch and TorchRL costs seconds of the suite. The numbers it measures are
checked for shape only: performance is reported, never asserted.
"""

from __future__ import annotations

import pytest

from support.bench_runs import ROOT, headline_ratios, quick_run

#: The workloads of the one run, W1 first: a smoke run probes the memory of its first workload only.
REPLAY = ["W1", "W2", "W3", "PER", "PARQUET"]
NAMES = [*REPLAY, "GAE", "MIX"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return quick_run(",".join(NAMES), tmp_path_factory)


def test_a_quick_gae_run_times_compute_gae_against_the_loops_and_the_seeds_and_agrees_with_them(runs):
    run, saved = runs
    assert "BUG?" not in run.stdout   # the store's advantages equal the loop's
    ratios = headline_ratios(saved, "GAE")
    for shape, transitions in (("WBC", "6,144"), ("WBC resets", "6,144"), ("VLA", "320")):
        for col in ("arrowbuf/loop", "arrowbuf/loop_floats", "arrowbuf/seed"):
            rounds = ratios[f"{shape} compute_gae ({transitions} transitions)", col]
            assert len(rounds) == 2 and all(r > 0 for r in rounds)


def test_the_quick_replay_sequence_priority_and_parquet_workloads_run_and_report_every_ratio(runs):
    # Not run elsewhere in CI (RAY starts its own cluster; it runs in the published bench):
    # a workload broken by a change to the store (W3's fields lacked the terminal flags a
    # store now asks for) shows here, not in the next published run.
    run, saved = runs
    assert [w["name"] for w in saved["workloads"]] == NAMES
    for name in REPLAY:
        ratios = headline_ratios(saved, name)
        assert ratios, f"{name} reported no ratio"
        assert all(r > 0 for rounds in ratios.values() for r in rounds), name
    # The smoke run probes arrowbuf's memory in its first workload only, in a fresh process.
    w1, = [w for w in saved["workloads"] if w["name"] == "W1"]
    memory, = [m for m in w1["metrics"] if m["name"] == "peak RSS / raw bytes"]
    assert memory["values"]["arrowbuf"] > 0 and memory["values"]["torchrl"] is None, memory


def test_a_quick_mix_run_reports_the_mixture_the_fresh_sample_and_the_open(runs):
    run, saved = runs
    ratios = headline_ratios(saved, "MIX")
    for metric, col in (("sample", "mixture/online"), ("sample", "dataset/online"),
                        ("sample(min_version), 3/4 qualify", "fresh/plain")):
        assert len(ratios[metric, col]) == 2 and all(r > 0 for r in ratios[metric, col])
    assert "open_dataset, 50,000 rows" in run.stdout
    assert "Ray sample(min_version): not run" in run.stdout   # a smoke run starts no cluster
    assert "GB dataset vs" not in run.stdout   # the big-dataset row is opt-in (--mix-dataset-gb)


def test_the_mix_big_dataset_option_builds_in_chunks_resumes_and_samples_within_its_resident_bound(
        tmp_path, monkeypatch):
    import arrowbuf as ab

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from bench import big_dataset
    from bench.cli import build_parser
    from bench.harness import Options
    from bench.specs import w1

    parser = build_parser()
    assert parser.parse_args([]).mix_dataset_gb is None   # off unless asked for
    assert parser.parse_args(["--mix-dataset-gb", "0.5"]).mix_dataset_gb == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--mix-dataset-gb", "0"])
    spec = w1(10_010)
    monkeypatch.setattr(big_dataset, "CHUNK_EPISODES", 10)   # a tiny dataset in several chunks
    monkeypatch.setattr(big_dataset, "SMALL_ROWS", 10_010)   # the in-RAM dataset it is timed against, small too
    where, episodes = big_dataset.layout(tmp_path, spec, 0.0025)
    assert episodes == 26   # 2.5 MB of 1,001-row episodes of 98-byte rows
    assert big_dataset.build(where, spec, episodes)["chunks_written"] == 3
    (where / "source" / big_dataset.EPISODES).unlink()   # an interrupted build: resumed at its missing chunk
    (where / "source" / "rows-00001.arrow").unlink()
    again = big_dataset.build(where, spec, episodes)
    assert (again["chunks_written"], again["chunks_reused"]) == (1, 2)
    assert big_dataset.build(where, spec, episodes) == {"chunks_written": 0, "chunks_reused": 3, "seconds": 0.0}
    dataset = ab.open_dataset(where / "source", cache_dir=where / "cache", progress=False)
    assert len(dataset) == episodes * spec.episode_len
    assert dataset.episodes().column("episode_id").to_pylist() == list(range(episodes))   # ids continue across chunks
    del dataset

    notes: list[str] = []
    # one round: each round samples both datasets in fresh processes (seconds of imports each)
    opts = Options(quick=True, rounds=1, min_time=0.01, slices=1, memory=False, profile=False)
    metric = big_dataset.measure(spec, 0.0025, tmp_path, opts, notes)
    assert len(metric.values["big"].values) == len(metric.values["small"].values) == 1
    assert all(rate > 0 for rate in metric.values["big"].values + metric.ratios["big/small"].values)
    assert metric.detail["transitions"] == episodes * spec.episode_len
    assert metric.detail["batches"]["big"] >= 21   # the warm-up and at least one timed batch
    assert metric.detail["build"]["big"]["chunks_reused"] == 3   # the dataset built above, reused
    assert metric.met, metric.detail   # peak RSS over the child's imports within resident_limit + 200 MB
    assert any("big dataset:" in note for note in notes)
