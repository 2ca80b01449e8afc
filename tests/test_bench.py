"""tools/bench.py: the quick ONPOLICY and SEED runs complete and report, and saved runs render.

Each run is a subprocess of the real entry (``python tools/bench.py``), with the
numbers it measures checked for shape only: performance is reported, never asserted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from arrowbuf.cli import main

from support.bench_runs import ROOT, bench, headline_ratios, quick_run

WORKLOADS = ["W1", "W2", "W3", "PER", "RAY", "PARQUET", "ONPOLICY", "GAE", "SEED", "MIX", "IMAGES", "TOKENS", "VLA"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run of both workloads: each bench process imports torch and TorchRL (seconds of the suite)."""
    return quick_run("ONPOLICY,SEED", tmp_path_factory)


def alone(runs: tuple, name: str) -> tuple:
    run, saved = runs
    return run, {**saved, "workloads": [w for w in saved["workloads"] if w["name"] == name]}


@pytest.fixture(scope="module")
def onpolicy(runs):
    return alone(runs, "ONPOLICY")


@pytest.fixture(scope="module")
def seed(runs):
    return alone(runs, "SEED")


def test_a_quick_onpolicy_run_prints_the_ratios_of_arrowbuf_to_the_ideal_and_the_seed_like_store(onpolicy):
    run, saved = onpolicy
    assert "ONPOLICY: whole-rollout sample and 4 epochs x 8 minibatches" in run.stdout
    result, = [w for w in saved["workloads"] if w["name"] == "ONPOLICY"]   # (a wide table wraps its headers)
    assert result["labels"]["torchrl"] == "torchrl LazyTensorStorage"
    assert {"arrowbuf/ideal", "arrowbuf/seed", "arrowbuf/rlightning"} <= set(result["ratio_columns"])
    assert result["labels"]["seed"] == "seed-like proxy (TensorDict)"   # the proxy, so labelled
    assert result["labels"]["rlightning"] in ("RLightning (real seed)", "real seed (absent)")
    ratios = headline_ratios(saved, "ONPOLICY")
    for shape in ("WBC", "VLA"):
        for metric in (f"{shape} rollout sample", f"{shape} 4x8 epochs"):
            assert f"{metric} ms" in run.stdout
            for col in ("arrowbuf/ideal", "arrowbuf/seed"):
                assert len(ratios[metric, col]) == 2 and all(r > 0 for r in ratios[metric, col])
        # the torch arena (storage_device: cpu here, cuda on a GPU) against the same ideal
        arena, = [m for m, col in ratios if m.startswith(f"{shape} rollout sample, torch arena (")]
        assert len(ratios[arena, "arrowbuf_torch/ideal"]) == 2 and all(r > 0 for r in ratios[arena, "arrowbuf_torch/ideal"])


def test_a_quick_seed_run_prints_compat_over_native_for_wbc_ingest_and_vla_ingest_and_sample(seed):
    run, saved = seed
    assert "SEED: the real seed vs arrowbuf.compat vs the native writer" in run.stdout
    ratios = headline_ratios(saved, "SEED")
    for metric in ("WBC ingest", "VLA ingest", "VLA sample(64)"):
        assert metric in run.stdout
        assert len(ratios[metric, "compat/native"]) == 2 and all(r > 0 for r in ratios[metric, "compat/native"])
    assert "WBC: native stores 1,536 of 1,536 env steps" in run.stdout
    # IsaacLab / RSL-RL send no final observation: compat still keeps every env step (issue 25 item 4)
    assert "WBC: compat with info={} (no final observation, default autoreset_mode) stores 1,536 of 1,536" in run.stdout
    metric = "WBC add_episodes(64 episodes)"   # one add_episodes of the rollout against one add_episode per env
    assert metric in run.stdout and "store.add_episode x E" in run.stdout
    assert len(ratios[metric, "batched/single"]) == 2 and all(r > 0 for r in ratios[metric, "batched/single"])


def real_seed_checkout() -> Path | None:
    """The RLightning checkout the bench finds (`tools/bench/real_seed.py`), or None."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from bench import real_seed
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return real_seed.locate()[0]


def test_a_quick_seed_run_drives_rlightnings_own_databuffer_in_steady_state_and_with_fresh_buffers(seed):
    if real_seed_checkout() is None:
        pytest.skip("no RLightning checkout: run `python tools/seed_checkout.py` (or set ARROWBUF_SEED_REPO)")
    run, saved = seed
    assert "real seed (absent)" not in run.stdout and "RLightning DataBuffer (real seed)" in run.stdout
    result, = [w for w in saved["workloads"] if w["name"] == "SEED"]
    metrics = {m["name"]: m for m in result["metrics"]}
    for shape in ("WBC", "VLA"):
        steady, fresh = metrics[f"{shape} rollout, steady state"], metrics[f"{shape} rollout, fresh buffers"]
        # steady state: >= 5 rollouts of one buffer each, the first left out; the seed ran every one
        assert len(steady["values"]["seed"]["rounds"]) >= 5 and steady["detail"]["first_left_out"]
        assert len(fresh["values"]["seed"]["rounds"]) >= 3
        for metric in (steady, fresh):
            for col in ("compat/seed", "native/seed"):
                assert all(r > 0 for r in metric["ratios"][col]["rounds"])
        spread = {c: v for c, v in metrics[f"{shape} ingest max/min, steady"]["values"].items() if v is not None}
        assert set(spread) >= {"seed", "compat", "native"} and all(v >= 1 for v in spread.values())


def test_without_the_seed_checkout_its_columns_say_so_and_the_other_contenders_still_run(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from bench import real_seed
        from bench.rollouts import wbc
        from bench.seed_engines import race_rollouts
    finally:
        sys.path.remove(str(ROOT / "tools"))
    real_seed.request(str(tmp_path / "no-such-checkout"))
    try:
        seed, why = real_seed.load()
    finally:
        real_seed.request(None)
    assert seed is None and why.startswith("real seed absent: no RLightning checkout at --seed-repo")
    notes: list[str] = []
    metrics = race_rollouts(wbc(8), None, why, steady_rounds=2, fresh_rounds=1, notes=notes)
    steady = metrics[0]
    assert steady.name == "WBC rollout, steady state" and "seed" not in steady.values
    assert not steady.ratios and len(steady.values["compat"].values) == 1 and len(steady.values["native"].values) == 1
    assert any("real seed absent" in note for note in notes)


def test_a_saved_run_renders_as_markdown_tables_with_a_row_per_metric(onpolicy, seed, tmp_path):
    merged = {"meta": onpolicy[1]["meta"], "workloads": onpolicy[1]["workloads"] + seed[1]["workloads"]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(merged))
    run = bench("--markdown", str(path))
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    headers = [line for line in rows if line.startswith("| metric |")]
    assert len(headers) == 2 and len(rows) == 2 + 6 + 13
    assert "| WBC rollout sample ms |" in run.stdout and "| VLA sample(64) ms |" in run.stdout
    assert "| VLA native ingest vs one copy of its bytes env-steps/s |" in run.stdout
    assert "| VLA first rollout into a fresh store (construction included) s |" in run.stdout
    assert "| WBC first rollout into a fresh store (construction included) s |" in run.stdout
    assert "| VLA rollout sample, torch arena (" in run.stdout
    assert "Command: `python tools/bench.py --quick --only ONPOLICY" in run.stdout


BEGIN, END = "<!-- bench tables: begin", "<!-- bench tables: end"


def around_the_tables(page: str) -> tuple[str, str, str]:
    """A page split into (up to and with its begin marker line, the tables, from its end marker line)."""
    head, rest = page.split(BEGIN, 1)
    marker, rest = rest.split("\n", 1)
    tables, tail = rest.split(END, 1)
    return head + BEGIN + marker + "\n", tables, END + tail


def test_a_saved_run_is_written_into_the_tables_of_docs_performance_md_and_nowhere_else(onpolicy, tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(onpolicy[1]))
    page = tmp_path / "performance.md"   # a copy of the real page: its markers are the ones --docs targets
    original = (ROOT / "docs" / "performance.md").read_text()
    page.write_text(original)
    run = bench("--markdown", str(saved), "--docs", str(page))
    assert run.returncode == 0, run.stderr
    assert "| metric |" not in run.stdout   # written, not printed
    written = page.read_text()
    head, tables, tail = around_the_tables(written)
    old_head, old_tables, old_tail = around_the_tables(original)
    assert (head, tail) == (old_head, old_tail) and tables != old_tables
    assert "| WBC rollout sample ms |" in tables and "Command: `python tools/bench.py --quick --only ONPOLICY" in tables
    assert "**W1**" not in tables   # the page's old tables are gone, not kept beside the new ones
    assert bench("--markdown", str(saved), "--docs", str(page)).returncode == 0
    assert page.read_text() == written   # a second write of the same run changes nothing


def test_the_default_docs_page_is_docs_performance_md_and_docs_without_markdown_runs_nothing():
    run = bench("--help")
    assert run.returncode == 0 and str(ROOT / "docs" / "performance.md") in " ".join(run.stdout.split())
    assert str(ROOT / "README.md") in " ".join(run.stdout.split())
    run = bench("--docs", "--only", "W1")   # --docs alone rewrites the README's section: it runs nothing
    assert run.returncode == 2 and "pass --markdown too" in run.stderr
    head, _, tail = around_the_tables((ROOT / "docs" / "performance.md").read_text())
    assert BEGIN not in tail and END not in head   # one pair of markers, in order


@pytest.mark.parametrize("page_text", ["# no markers\n", f"{END} -->\n{BEGIN} -->\n",
                                       f"{BEGIN} -->\n{BEGIN} -->\n{END} -->\n"])
def test_docs_refuses_a_page_without_one_ordered_pair_of_markers_and_leaves_it_unchanged(onpolicy, tmp_path,
                                                                                         page_text):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(onpolicy[1]))
    page = tmp_path / "page.md"
    page.write_text(page_text)
    run = bench("--markdown", str(saved), "--docs", str(page))
    assert run.returncode == 2 and "bench tables: begin" in run.stderr and str(page) in run.stderr
    assert page.read_text() == page_text


def test_a_saved_run_plots_as_a_png_bar_chart(onpolicy, tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(onpolicy[1]))
    png = tmp_path / "bench.png"
    run = bench("--plot", str(saved), "--png", str(png))
    assert run.returncode == 0, run.stderr
    with Image.open(png) as image:
        assert image.format == "PNG" and image.height > image.width / 4
        image.verify()


def test_arrowbuf_bench_runs_the_benchmark_with_its_arguments(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")] == WORKLOADS
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--only", "W9"])
    assert exit_.value.code == 2
    assert "arrowbuf bench: error: unknown workload(s) ['W9']" in capsys.readouterr().err


# -- the README's performance section (tools/bench/summary.py) ------------------------------------------

README_BEGIN, README_END = "<!-- bench summary: begin", "<!-- bench summary: end"


def bench_module(name: str):
    """A module of the benchmark package ``tools/bench`` (imported as ``bench.<name>``)."""
    import importlib

    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    return importlib.import_module(f"bench.{name}")


def test_the_readmes_performance_section_is_what_docs_renders_from_the_performance_pages_tables():
    # Issue 36: the README quoted a run of 2026-12-03 and a "Not met yet" list later runs changed.
    report, summary = bench_module("report"), bench_module("summary")
    tables = summary.read_tables(report.between((ROOT / "docs" / "performance.md").read_text()))
    readme = (ROOT / "README.md").read_text()
    written = report.between(readme, (README_BEGIN, README_END))
    assert written == summary.summary(tables) + "\n", "README.md's performance section is stale: run " \
        "`python tools/bench.py --docs`"
    assert f"run on {tables.date}," in written and tables.date == "2026-12-05"
    missed = [f"{w} {m}" for w, rows in tables.cells.items() for m, row in rows.items() if row["met"] == "NO"]
    listed = written.split("**Not met yet**", 1)[1]
    assert len(missed) == 9 and all(f"  - {name}: " in listed for name in missed)
    assert listed.count("\n  - ") == len(missed)


def test_docs_alone_rewrites_the_readmes_section_from_the_pages_tables_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    real = (ROOT / "README.md").read_text()
    head, rest = real.split(README_BEGIN, 1)
    marker, rest = rest.split("\n", 1)
    readme.write_text(head + README_BEGIN + marker + "\nstale numbers\n" + rest[rest.index(README_END):])
    run = bench("--docs", str(ROOT / "docs" / "performance.md"), "--readme", str(readme))
    assert run.returncode == 0, run.stderr
    assert readme.read_text() == real
    page = tmp_path / "performance.md"
    page.write_text("no markers\n")
    run = bench("--docs", str(page), "--readme", str(readme))
    assert run.returncode == 2 and "bench tables: begin" in run.stderr and readme.read_text() == real


def test_a_run_records_its_date_and_a_partial_run_leaves_the_readme_as_it_is(onpolicy, tmp_path):
    saved = onpolicy[1]
    assert len(saved["meta"]["date"]) == 10 and saved["meta"]["date"][:2] == "20"
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    page, readme = tmp_path / "performance.md", tmp_path / "README.md"
    page.write_text((ROOT / "docs" / "performance.md").read_text())
    readme.write_text((ROOT / "README.md").read_text())
    run = bench("--markdown", str(path), "--docs", str(page), "--readme", str(readme))
    assert run.returncode == 0, run.stderr
    assert f"Run on {saved['meta']['date']}. Ratios:" in page.read_text()
    assert readme.read_text() == (ROOT / "README.md").read_text()   # an ONPOLICY run is not a full one
    assert "left the performance section" in run.stderr and "lack W1" in run.stderr


def test_the_tables_read_back_are_the_cells_a_saved_run_renders(onpolicy, seed, tmp_path):
    report, summary = bench_module("report"), bench_module("summary")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": onpolicy[1]["meta"], "workloads": onpolicy[1]["workloads"]
                                + seed[1]["workloads"]}))
    results, meta = report.load(str(path))
    tables = summary.read_tables(report.markdown(results, meta))
    assert list(tables.cells) == ["ONPOLICY", "SEED"] and tables.date == meta["date"]
    for res in results:
        header = ["metric", *(res.label(c) for c in res.contenders), *res.ratio_columns, "target", "met"]
        assert [list(row.values()) for row in tables.cells[res.name].values()] == list(report._cells(res, False))
        assert all(list(row) == header for row in tables.cells[res.name].values())


def test_the_not_met_list_names_each_missed_bound_with_its_ratio_and_the_count_of_targets():
    summary = bench_module("summary")
    text = ("**W9**: a workload\n\n| metric | a/b | c/d | target | met |\n|:--|--:|--:|:--|:-:|\n"
            "| add rows/s | 0.40 [0.30-0.50] | 5.00 | a/b >= 0.5, c/d >= 3 | NO |\n"
            "| sample batches/s | 1.20 | - | a/b >= 1.0 | yes |\n| size | 1.0 | - | completes | NO |\n"
            "| info row | 2.0 | - | info |  |\n\nRun on 2026-12-05. Ratios: median over 3 rounds, 2 CPUs\n")
    tables = summary.read_tables(text)
    assert (tables.date, tables.cpus, tables.rounds) == ("2026-12-05", "2", "3")
    assert summary.not_met(tables) == (["W9 add rows/s: a/b 0.40 [0.30-0.50] (target >= 0.5)",
                                        "W9 size: target completes"], 3)
    # A memory row's cells read "2.28x" (a full run's W1 peak RSS missed its bound: --docs failed to parse it).
    memory = summary.read_tables("**W9**: a workload\n\n| metric | arrowbuf | target | met |\n|:--|--:|:--|:-:|\n"
                                 "| peak RSS / raw bytes | 2.28x | arrowbuf <= 1.1 | NO |\n\n"
                                 "Run on 2026-12-07. Ratios: median over 3 rounds, 2 CPUs\n")
    assert summary.not_met(memory) == (["W9 peak RSS / raw bytes: arrowbuf 2.28x (target <= 1.1)"], 1)
