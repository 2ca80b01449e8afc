"""tools/bench.py: the smoke TOKENS run (ragged token fields) reports every ratio, and what it
measures of memory and of the gathered rows is in a sane range (a file of its own, so that
pytest-xdist spreads it).

The run is a subprocess of the real entry (``python tools/bench.py``); its times are checked for
shape only (performance is reported, never asserted), its memory by wide bounds that only a
miscounted heap or a column that pads or copies its rows would leave.
"""

from __future__ import annotations

import pytest

from support.bench_runs import headline_ratios, quick_run

pytest.importorskip("torchrl")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    run, saved = quick_run("TOKENS", tmp_path_factory)
    result, = [w for w in saved["workloads"] if w["name"] == "TOKENS"]
    return run, result, {m["name"]: m for m in result["metrics"]}


def value(metric: dict, contender: str) -> float:
    v = metric["values"][contender]
    return v["median"] if isinstance(v, dict) else v


def test_a_smoke_tokens_run_times_every_contender_and_reports_every_ratio(tokens):
    run, result, metrics = tokens
    assert result["ratio_columns"] == ["arrowbuf/ideal", "arrowbuf/torchrl", "arrowbuf/torchrl_stack"]
    assert "ListStorage" in result["labels"]["torchrl"] and "LazyStackStorage" in result["labels"]["torchrl_stack"]
    ratios = headline_ratios({"workloads": [result]}, "TOKENS")
    for metric in ("sample(32), jagged", "sample(32, pad=)"):
        for col in result["ratio_columns"]:
            assert len(ratios[metric, col]) == 2 and all(r > 0 for r in ratios[metric, col]), (metric, col)
    split = "split + gather, 0.05M-token global batch over 8 ranks"
    assert len(ratios[split, "arrowbuf/ideal"]) == 2 and all(r > 0 for r in ratios[split, "arrowbuf/ideal"])
    assert value(metrics[split], "arrowbuf") > 0 and metrics[split]["unit"] == "GB/s"
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
