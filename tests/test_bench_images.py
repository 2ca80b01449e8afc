"""tools/bench.py: the smoke IMAGES run (encoded image fields) reports every ratio, and what it
measures of the codecs is in a sane range (a file of its own, so that pytest-xdist spreads it).

The run is a subprocess of the real entry (``python tools/bench.py``); its times are checked for
shape only (performance is reported, never asserted), its bytes and PSNR by wide bounds that
only a broken codec, a mismatched frame or a miscounted heap would leave.
"""

from __future__ import annotations

import math

import pytest

from support.bench_runs import headline_ratios, quick_run

pytest.importorskip("simplejpeg")
pytest.importorskip("zstandard")
pytest.importorskip("matplotlib")
pytest.importorskip("torchrl")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    run, saved = quick_run("IMAGES", tmp_path_factory)
    result, = [w for w in saved["workloads"] if w["name"] == "IMAGES"]
    return run, result, {m["name"]: m for m in result["metrics"]}


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
