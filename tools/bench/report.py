"""The report: rich tables on the terminal, Markdown tables for docs/performance.md, and JSON.

JSON is the exchange format: `save` writes a run, `load` reads one back, and
`markdown` and `bench.plot` work from it, so a saved run can be re-rendered.
`into_page` puts the Markdown tables into a page between its `BEGIN` and `END`
markers (docs/performance.md), leaving the rest of the page as it is; `between` reads
them back (`summary` renders the README's section from them).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Sequence

from .results import Series, WorkloadResult

BEGIN = "<!-- bench tables: begin"   # the markers' starts: a marker line may go on with a note
END = "<!-- bench tables: end"


def number(value: float, unit: str) -> str:
    """A value for a table cell: 1.23M, 45.6k, 789, 0.123, 1.10x."""
    if value != value:  # nan
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    if value >= 1e6:
        return f"{value / 1e6:,.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:,.1f}k"
    if value < 10:
        return f"{value:.3g}"
    return f"{value:,.0f}"


def ratio_text(series: Series | None, escape: bool = True) -> str:
    """``median [min-max]`` of a per-round ratio (``-`` if absent)."""
    if series is None or not series.values:
        return "-"
    lo, hi = min(series.values), max(series.values)
    if len(series.values) == 1 or hi - lo < 0.005:
        return f"{series.median:.2f}"
    bracket = "\\[" if escape else "["   # rich reads a bare "[" as markup
    return f"{series.median:.2f} {bracket}{lo:.2f}-{hi:.2f}]"


def _cells(res: WorkloadResult, escape: bool) -> Iterator[list[str]]:
    """Each metric's row: name, a value per contender, a ratio per ratio column, target, met."""
    for m in res.metrics:
        cells = [f"{m.name} {m.unit}" if m.unit != "x" else m.name]
        for c in res.contenders:
            v = m.values.get(c)
            cells.append("-" if v is None else number(v.median if isinstance(v, Series) else v, m.unit))
        for col in res.ratio_columns:
            if m.unit == "x" and not m.ratios and m.ratios_from_values:
                a, _, b = col.partition("/")
                va, vb = m.values.get(a), m.values.get(b)
                cells.append(f"{va / vb:.2f}" if isinstance(va, float) and isinstance(vb, float) and vb else "-")
            else:
                cells.append(ratio_text(m.ratios.get(col), escape))
        cells.append(m.target)
        cells.append("" if m.met is None else ("yes" if m.met else "NO"))
        yield cells


def render(results: Sequence[WorkloadResult], meta: dict) -> None:
    """Print each workload's table, its extra ratios, details and notes (rich)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    terminal = Console()
    # Tables are wide (a column per contender and ratio): never squeeze them below 150 columns, and
    # give a file or pipe room for every column unwrapped.
    console = Console(width=max(150, terminal.width) if terminal.is_terminal else 420)
    for res in results:
        table = Table(title=f"{res.name}: {res.title}", title_justify="left", caption=res.description,
                      caption_justify="left")
        table.add_column("metric", no_wrap=True)
        for c in res.contenders:
            table.add_column(res.label(c), justify="right")
        for col in res.ratio_columns:
            table.add_column(col, justify="right")
        table.add_column("target", justify="left")
        table.add_column("met", justify="center")
        for cells in _cells(res, escape=True):
            cells[-1] = {"yes": "[green]yes[/]", "NO": "[red]NO[/]"}.get(cells[-1], "")
            table.add_row(*cells)
        console.print(table)
        for m in res.metrics:
            for key, series in m.ratios.items():
                if key not in res.ratio_columns:
                    console.print(f"  {m.name}: {key} = {ratio_text(series)}")
            for c, d in m.detail.items():
                if isinstance(d, dict) and "peak_delta" in d:
                    console.print(f"  {m.name}: {c}: peak RSS growth {d['peak_delta'] / 2**20:,.0f} MiB for "
                                  f"{d['rows_stored']:,} rows x {d['row_bytes']} B = "
                                  f"{d['raw_bytes'] / 2**20:,.0f} MiB raw")
                elif isinstance(d, str):
                    console.print(f"  {m.name}: {d}", highlight=False, markup=False)
        for note in res.notes:
            console.print(note, highlight=False, markup=False)
        console.print(f"  ({res.seconds:.0f} s)\n")
    console.print(escape(f"ratios: median over {meta['rounds']} rounds of interleaved timings [min-max over rounds]; "
                  f"load average {meta['loadavg_start']} -> {meta['loadavg_end']}; "
                  f"torch threads 1; total {meta['seconds']:.0f} s"))


def save(path: str, results: Sequence[WorkloadResult], meta: dict) -> None:
    """Write a run as JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "workloads": [r.to_json() for r in results]}, f, indent=2)


def load(path: str) -> tuple[list[WorkloadResult], dict]:
    """A run written by `save`, as results again (series from their per-round values)."""
    from .results import Metric

    with open(path) as f:
        data = json.load(f)

    def value(v: Any) -> Series | float | None:
        return Series(list(v["rounds"])) if isinstance(v, dict) else v

    results = []
    for w in data["workloads"]:
        metrics = [Metric(m["name"], m["unit"], {c: value(v) for c, v in m["values"].items()},
                          {k: Series(list(r["rounds"])) for k, r in m["ratios"].items()}, m["target"], m["met"],
                          m["detail"], m.get("ratios_from_values", True)) for m in w["metrics"]]
        results.append(WorkloadResult(w["name"], w["title"], w["description"], w["contenders"], metrics, w["notes"],
                                      w["seconds"], w["labels"], w["ratio_columns"]))
    return results, data["meta"]


def markdown(results: Sequence[WorkloadResult], meta: dict) -> str:
    """A Markdown summary: one table per workload (the terminal's columns), then the machine and command."""
    lines = []
    for res in results:
        header = ["metric", *(res.label(c) for c in res.contenders), *res.ratio_columns, "target", "met"]
        lines += [f"**{res.name}**: {res.title}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join([":--"] + ["--:"] * (len(header) - 3) + [":--", ":-:"]) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
                  for cells in _cells(res, escape=False)]
        lines.append("")
    versions = ", ".join(f"{k} {meta[k]}" for k in ("python", "numpy", "torch", "pyarrow", "tensordict", "torchrl",
                                                     "arrowbuf") if k in meta)
    lines.append((f"Run on {meta['date']}. " if meta.get("date") else "") + f"Ratios: median over {meta.get('rounds')} rounds of interleaved timings [min-max over rounds], "
                 f"> 1 means arrowbuf is faster. {meta.get('cpus')} CPUs, load average {meta.get('loadavg_start')} "
                 f"-> {meta.get('loadavg_end')}; {versions}. Command: `python tools/bench.py "
                 f"{' '.join(meta.get('argv', []))}`.")
    return "\n".join(lines) + "\n"


def into_page(page: str, tables: str, markers: tuple[str, str] = (BEGIN, END)) -> str:
    """``page`` with the text between its ``markers`` lines (the tables', by default; the lines
    excluded) replaced by ``tables``.

    Raises:
        ValueError: the page lacks a marker, has either twice, or has them in the wrong order.
    """
    lines = page.splitlines(keepends=True)
    begin, end = _marked(lines, markers)
    return "".join(lines[:begin + 1]) + tables.rstrip("\n") + "\n\n" + "".join(lines[end:])


def between(page: str, markers: tuple[str, str] = (BEGIN, END)) -> str:
    """The text between ``page``'s ``markers`` lines, as `into_page` wrote it.

    Raises:
        ValueError: as `into_page`.
    """
    lines = page.splitlines(keepends=True)
    begin, end = _marked(lines, markers)
    return "".join(lines[begin + 1:end])


def _marked(lines: list[str], markers: tuple[str, str]) -> tuple[int, int]:
    """The lines of the one pair of ``markers``, in order."""
    begin, end = markers
    begins = [i for i, line in enumerate(lines) if line.startswith(begin)]
    ends = [i for i, line in enumerate(lines) if line.startswith(end)]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(f"expected one line starting {begin!r} and, after it, one starting {end!r}; found "
                         f"{len(begins)} and {len(ends)}" + (" in the wrong order" if begins and ends and
                                                              begins[0] > ends[0] else ""))
    return begins[0], ends[0]
