"""tools/bench.py: the smoke IMAGES (encoded image fields), TOKENS (ragged token fields) and VLA (video
demos mixed with an online JPEG store) runs report every ratio, and what they measure of the codecs, of
memory and of the gathered rows is in a sane range. All run in one subprocess of the real entry
(``python tools/bench.py --only IMAGES,TOKENS,VLA``): a process that imports torch and TorchRL costs
seconds of the suite.

Times are checked for shape only (performance is reported, never asserted); bytes, PSNR and memory by
wide bounds that only a broken codec, a mismatched frame, a miscounted heap or a column that pads or
copies its rows would leave.
"""

from __future__ import annotations

import math

import pytest

from support.bench_runs import headline_ratios, quick_run

pytest.importorskip("simplejpeg")
pytest.importorskip("zstandard")
pytest.importorskip("matplotlib")
pytest.importorskip("torchrl")
pytest.importorskip("av")   # VLA's demos are an AV1 video


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run, saved = quick_run("IMAGES,TOKENS,VLA", tmp_path_factory)
    return run, {w["name"]: w for w in saved["workloads"]}


@pytest.fixture(scope="module")
def images(runs):
    run, results = runs
    return run, results["IMAGES"], {m["name"]: m for m in results["IMAGES"]["metrics"]}


@pytest.fixture(scope="module")
def tokens(runs):
    run, results = runs
    return run, results["TOKENS"], {m["name"]: m for m in results["TOKENS"]["metrics"]}


@pytest.fixture(scope="module")
def vla(runs):
    run, results = runs
    return run, results["VLA"], {m["name"]: m for m in results["VLA"]["metrics"]}


def value(metric: dict, contender: str) -> float:
    v = metric["values"][contender]
    return v["median"] if isinstance(v, dict) else v


def test_a_smoke_images_run_times_every_contender_and_reports_every_ratio(images):
    run, result, metrics = images
    assert result["ratio_columns"] == ["arrowbuf/ideal", "arrowbuf/raw", "arrowbuf/torchrl", "arrowbuf/torchrl_jpeg"]
    assert "CompressedListStorage" in result["labels"]["torchrl"] and "jpeg" in result["labels"]["torchrl_jpeg"]
    ratios = headline_ratios({"workloads": [result]}, "IMAGES")
    both = "sample(16), obs + next obs"
    for col in result["ratio_columns"]:
        assert len(ratios[both, col]) == 2 and all(r > 0 for r in ratios[both, col]), col
    for col in ("arrowbuf/ideal", "arrowbuf/raw"):
        assert len(ratios["sample(16), keys without next obs", col]) == 2
    assert "torchvision" in run.stdout   # the report says why the ideal is simplejpeg's


def test_a_smoke_images_run_measures_the_codecs_bytes_and_jpeg_fidelity_in_a_sane_range(images):
    run, _, metrics = images
    stored = metrics["stored bytes / raw bytes"]
    assert 0.03 < value(stored, "arrowbuf") < 0.2   # jpeg:90 of photo crops: ~0.1
    assert value(stored, "raw") == 1.0
    for lossless in ("png", "zstd", "torchrl"):
        assert 0.2 < value(stored, lossless) < 1.0, lossless
    # the same codec and settings (TorchRL's store holds fewer of the camera paths)
    assert abs(value(stored, "torchrl_jpeg") / value(stored, "arrowbuf") - 1) < 0.25
    # PSNR of the frames sampled back against those written, found by episode_id and step:
    # a row decoded against the wrong frame scores ~10-20 dB
    assert 33 < value(metrics["PSNR jpeg:90, mean"], "arrowbuf") < 60
    worst = metrics["PSNR jpeg:90, worst of a batch"]["values"]["arrowbuf"]["rounds"]
    assert len(worst) == 2 and all(28 < p < 60 and math.isfinite(p) for p in worst)
    memory = metrics["private memory / encoded bytes"]
    assert 0.5 < value(memory, "arrowbuf") < 4
    assert memory["detail"]["arrowbuf"]["rows_held"] >= 900
    assert "a quick or smoke run; the full run holds 200,000" in run.stdout


def test_a_smoke_tokens_run_times_every_contender_and_reports_every_ratio(tokens):
    run, result, metrics = tokens
    assert result["ratio_columns"] == ["arrowbuf/ideal", "arrowbuf/torchrl", "arrowbuf/torchrl_stack"]
    assert "ListStorage" in result["labels"]["torchrl"] and "LazyStackStorage" in result["labels"]["torchrl_stack"]
    ratios = headline_ratios({"workloads": [result]}, "TOKENS")
    for metric in ("sample(32), jagged", "sample(32, pad=)"):
        for col in result["ratio_columns"]:
            assert len(ratios[metric, col]) == 2 and all(r > 0 for r in ratios[metric, col]), (metric, col)
    for split in ("split + gather, 0.05M-token global batch over 8 ranks",   # each rank its own split, and a driver's
                  "split + gather, 0.05M-token global batch over 8 ranks, one split for all"):
        assert len(ratios[split, "arrowbuf/ideal"]) == 2 and all(r > 0 for r in ratios[split, "arrowbuf/ideal"])
        assert 0 < value(metrics[split], "arrowbuf") < 1000 and metrics[split]["unit"] == "GB/s"   # GB, not bytes
    padded = metrics["sample(32, pad=)"]["ratios"]["arrowbuf padded time / jagged time"]["rounds"]
    assert len(padded) == 2 and all(r > 0 for r in padded)
    assert "ranks: rank 0's step on a" in run.stdout   # a rank's split and gather, apart


def test_a_smoke_tokens_run_measures_memory_near_the_token_bytes_and_gathers_the_rows_written(tokens):
    run, _, metrics = tokens
    memory = metrics["private memory / token bytes"]
    assert 0.8 < value(memory, "arrowbuf") < 4   # 33 MB of tokens: a few MB of arrowbuf's own objects show
    probe = memory["detail"]["arrowbuf"]
    assert probe["rows_held"] == 10_000 and probe["heap_allocated"] >= probe["heap_live"] > 0
    # ~826 tokens of 4 B a row; heap chunks of 4 MiB over ~30 MB
    assert 2_500 < probe["heap_live"] / probe["rows_held"] < 4_200
    assert 1.0 <= value(metrics["column bytes / token bytes"], "arrowbuf") < 1.5
    assert 1.0 <= value(metrics["heap allocated / live"], "arrowbuf") < 1.5
    assert "a quick, smoke or scaled-down run" in run.stdout
    equal = metrics["sampled rows equal to those written"]
    assert equal["met"] and equal["values"]["arrowbuf"]["rounds"] == [100.0, 100.0]
    for contender, mean in metrics["mean tokens a sampled row"]["values"].items():   # one length distribution
        assert 500 < mean < 1_300, contender


def test_a_smoke_tokens_run_splits_global_batches_over_ranks_whole_and_balanced(tokens):
    _, _, metrics = tokens
    balance = metrics["rank tokens max/mean, 512 rows over 8 ranks"]["values"]["arrowbuf"]["rounds"]
    assert len(balance) == 2 and all(1.0 <= b < 1.05 for b in balance)   # largest-first: ~1.003
    united = metrics["rank shares uniting to their global batch"]
    assert united["met"] and united["values"]["arrowbuf"]["rounds"] == [100.0, 100.0]


def test_a_smoke_vla_run_times_video_against_pyav_and_the_mixture_beside_a_raw_store(vla):
    run, result, metrics = vla
    assert result["ratio_columns"] == ["arrowbuf/pyav", "arrowbuf/pyav_threads", "mix_jpeg/mix_raw"]
    ratios = headline_ratios({"workloads": [result]}, "VLA")
    for race in ("video sample(8), camera alone", "video sample(8), camera + next camera"):
        for col in ("arrowbuf/pyav", "arrowbuf/pyav_threads"):
            assert len(ratios[race, col]) == 2 and all(r > 0 for r in ratios[race, col]), (race, col)
    mixture = "Mixture.sample(16), 50% video demos"
    assert len(ratios[mixture, "mix_jpeg/mix_raw"]) == 2 and metrics[mixture]["unit"] == "rows/s"
    for half in ("demos", "online_jpeg", "online_raw"):
        assert value(metrics[mixture], half) > 0, half
    # the demos are the bench's own LeRobot v3 layout, said so: lerobot itself did not write them
    assert "written by the bench with PyAV" in result["description"]
    # a mixed batch's frames against the frames written: a wrong frame scores ~10-20 dB
    assert 28 < value(metrics["PSNR of a mixed batch's frames, AV1 demos, worst"], "demos") < 60
    assert 30 < value(metrics["PSNR of a mixed batch's frames, jpeg:90 online, worst"], "online_jpeg") < 60
