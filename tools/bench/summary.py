"""The README's performance section: a few headline ratios and every target a run did not meet.

Its one source is a run's Markdown tables (`report.markdown`, kept in docs/performance.md
between its markers): `read_tables` reads them back, cell by cell, and `summary` picks
its lines from them, so the README quotes the run the performance page shows, with the
run's date, and a saved JSON run or the page's tables render the same section.
``python tools/bench.py --docs`` writes it between the README's `BEGIN` and `END` markers.
"""

from __future__ import annotations

import operator
import re
import textwrap
from dataclasses import dataclass

BEGIN = "<!-- bench summary: begin"   # the README's markers (a marker line may go on with a note)
END = "<!-- bench summary: end"
WIDTH = 100   # the section's lines wrap here (never inside a word, a cell or a target)
KEEP = "\x00"   # a space the wrapping keeps
#: What the wrapping keeps on one line: a ratio with its range (``1.00 [0.99-1.00]x``), a target.
UNBROKEN = re.compile(r"\d[\d.]* \[[\d.]+-[\d.]+\]x?|\(target [^)]*\)")
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass(frozen=True)
class Tables:
    """A run's tables as its Markdown shows them: per workload, per metric (its first cell),
    per column, the cell's text; and the run's date, CPUs and rounds from the line under them."""

    cells: dict[str, dict[str, dict[str, str]]]
    date: str | None
    cpus: str | None
    rounds: str | None


def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` is a pipe inside a cell)."""
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def read_tables(text: str) -> Tables:
    """The tables `report.markdown` wrote (a workload's table follows its ``**NAME**: title`` line)."""
    cells: dict[str, dict[str, dict[str, str]]] = {}
    workload, header = None, None
    for line in text.splitlines():
        title = re.match(r"^\*\*([\w-]+)\*\*: ", line)
        if title:
            workload, header = title.group(1), None
            cells[workload] = {}
        elif workload is not None and line.startswith("|"):
            row = split_row(line)
            if header is None:
                header = row
            elif not all(re.fullmatch(r":?-+:?", cell) for cell in row):
                cells[workload][row[0]] = dict(zip(header, row))
        else:
            header = None
    found = {key: re.search(pattern, text) for key, pattern in
             (("date", r"Run on (\d{4}-\d{2}-\d{2})"), ("cpus", r"(\d+) CPUs"), ("rounds", r"median over (\d+) rounds"))}
    return Tables(cells, *(m.group(1) if m else None for m in found.values()))


@dataclass(frozen=True)
class Ratio:
    """A headline ratio: ``column`` of the ``metrics`` rows of ``workload`` (one row: its cell as
    the table shows it; several: the range of their medians), and what it compares against."""

    workload: str
    metrics: tuple[str, ...]
    column: str
    against: str


#: The README's headline lines: (lead, ratios) clauses, joined by "; " on one line.
HEADLINES: tuple[tuple[tuple[str, tuple[Ratio, ...]], ...], ...] = (
    (("**Replay sampling** (W1: 1M rows, batch 256)",
      (Ratio("W1", ("sample batches/s",), "arrowbuf/ideal", "an ideal numpy gather"),
       Ratio("W1", ("sample batches/s",), "arrowbuf/torchrl", "TorchRL"))),
     ("**sequences** (W3)", (Ratio("W3", ("sample batches/s",), "arrowbuf/torchrl", "TorchRL's `SliceSampler`"),))),
    (("**On-policy** (ONPOLICY, PPO rollouts read with `keys=`)",
      (Ratio("ONPOLICY", ("WBC rollout sample ms", "WBC 4x8 epochs ms", "VLA rollout sample ms", "VLA 4x8 epochs ms"),
             "arrowbuf_keys/ideal", "an ideal `np.take`"),
       Ratio("ONPOLICY", ("WBC rollout sample ms", "WBC 4x8 epochs ms", "VLA rollout sample ms", "VLA 4x8 epochs ms"),
             "arrowbuf_keys/rlightning", "RLightning's own `ReplayBuffer`"))),),
    (("**RLightning's engines** (SEED, whole WBC and VLA rollouts, steady state)",
      (Ratio("SEED", ("WBC rollout, steady state s", "VLA rollout, steady state s"), "compat/seed",
             "the real seed through `arrowbuf.compat`"),
       Ratio("SEED", ("WBC rollout, steady state s", "VLA rollout, steady state s"), "native/seed",
             "with the native writer"))),),
    (("**Ray** (W1)",
      (Ratio("RAY", ("W1 sample batches/s",), "arrowbuf/naive", "a naive actor (`sample_iter`)"),
       Ratio("RAY", ("W1 sample batches/s",), "arrowbuf/local", "the embedded store"))),),
)


def _cell(tables: Tables, workload: str, metric: str, column: str) -> str:
    try:
        return tables.cells[workload][metric][column]
    except KeyError:
        raise ValueError(f"the run's tables lack {workload} {metric!r} / {column!r}: the README quotes a full run "
                         "(every workload)") from None


def _median(cell: str) -> float:
    """The median of a table cell: ``0.91 [0.88-0.98]``, ``2.27`` or ``1.08x``."""
    return float(cell.split()[0].rstrip("x"))


def ratio_text(tables: Tables, ratio: Ratio) -> str:
    """``1.10 [1.05-1.11]x`` (one row) or ``0.51-1.02x`` (the range of several rows' medians)."""
    cells = [_cell(tables, ratio.workload, metric, ratio.column) for metric in ratio.metrics]
    cells = [cell for cell in cells if cell != "-"]
    if not cells:
        raise ValueError(f"the run measured no {ratio.workload} {ratio.column} of {list(ratio.metrics)}")
    if len(ratio.metrics) == 1:
        return f"{cells[0]}x"
    medians = [_median(cell) for cell in cells]
    return f"{min(medians):.2f}-{max(medians):.2f}x"


def not_met(tables: Tables) -> tuple[list[str], int]:
    """One line per row whose target the run did not meet (its judged ratios and their bounds,
    in table order), and how many rows it judged."""
    lines, judged = [], 0
    for workload, rows in tables.cells.items():
        for metric, row in rows.items():
            met = row.get("met", "")
            judged += met in ("yes", "NO")
            if met != "NO":
                continue
            parts = []
            for clause in row.get("target", "").split(","):   # the bounds on a ratio column its median misses
                bound = re.match(r"\s*(.+?)\s*(>=|<=|<|>)\s*([\d.]+)\s*$", clause)
                if bound and row.get(bound.group(1), "-") != "-":
                    name, op, limit = bound.groups()
                    if not OPS[op](_median(row[name]), float(limit)):
                        parts.append(f"{name} {row[name]} (target {op} {limit})")
            lines.append(f"{workload} {metric}: " + ("; ".join(parts) if parts else f"target {row.get('target', '')}"))
    return lines, judged


def summary(tables: Tables) -> str:
    """The README's performance section (between its markers) for a run's tables.

    Raises:
        ValueError: the tables carry no run date, or lack a headline (not a full run).
    """
    if tables.date is None:
        raise ValueError("the run's tables carry no date (\"Run on YYYY-MM-DD\" under them): a run saved before runs "
                         "recorded theirs; add \"date\" to its JSON's meta")
    def wrap(text: str, first: str = "", then: str = "") -> list[str]:
        text = UNBROKEN.sub(lambda m: m.group(0).replace(" ", KEEP), text)
        return [line.replace(KEEP, " ") for line in textwrap.wrap(
            text, WIDTH, initial_indent=first, subsequent_indent=then, break_long_words=False, break_on_hyphens=False)]

    lines = wrap(f"One full `tools/bench.py` run on {tables.date}, on {tables.cpus} CPUs (ratios of contenders timed "
                 f"in the same run, median [min-max] of {tables.rounds} rounds; > 1: arrowbuf is faster):") + [""]
    for clauses in HEADLINES:
        lines += wrap("; ".join(f"{lead}: " + ", ".join(f"{ratio_text(tables, r)} {r.against}" for r in ratios)
                                for lead, ratios in clauses) + ".", "- ", "  ")
    missed, judged = not_met(tables)
    lines.append(f"- **Not met yet** ({len(missed)} of the {judged} targets it judged):" if missed
                 else f"- Every one of the {judged} targets it judged is met.")
    for line in missed:
        lines += wrap(line, "  - ", "    ")
    return "\n".join(lines) + "\n"
