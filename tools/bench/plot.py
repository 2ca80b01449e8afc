"""The bar chart of a run: each workload's headline ratios (its table's ratio columns).

One horizontal bar per (workload, metric, ratio): the median over rounds, with
the min-max range as an error bar, on a log axis with a line at 1 (parity).
"""

from __future__ import annotations

from typing import Sequence

from .results import WorkloadResult


def bars(results: Sequence[WorkloadResult]) -> list[tuple[str, str, float, float, float]]:
    """(workload, "metric: ratio", median, min, max) of every headline ratio measured."""
    out = []
    for res in results:
        for m in res.metrics:
            for col in res.ratio_columns:
                series = m.ratios.get(col)
                if series is not None and series.values and min(series.values) > 0:
                    # Ratios are speed-ups, except those whose target caps them (incremental/full: a time ratio).
                    lower = f"{col} <=" in m.target
                    out.append((res.name, f"{m.name}: {col}" + (" (time: lower is better)" if lower else ""),
                                series.median, min(series.values), max(series.values)))
    return out


def plot(results: Sequence[WorkloadResult], meta: dict, path: str) -> None:
    """Write the chart of ``results`` to ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = bars(results)
    if not rows:
        raise ValueError("the results hold no ratios to plot")
    workloads = list(dict.fromkeys(r[0] for r in rows))
    colors = {w: plt.get_cmap("tab10")(i % 10) for i, w in enumerate(workloads)}
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.6))
    y = range(len(rows))[::-1]
    medians = [r[2] for r in rows]
    errors = [[r[2] - r[3] for r in rows], [r[4] - r[2] for r in rows]]
    # Bars grow from parity (1): left for slower, right for faster.
    ax.barh(list(y), [m - 1 for m in medians], left=1, xerr=errors, color=[colors[r[0]] for r in rows], capsize=2)
    ax.set_yticks(list(y), [f"{r[0]} {r[1]}" for r in rows], fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio a/b (median over rounds, min-max bars; > 1: a is faster)")
    ax.set_title(f"arrowbuf benchmark ({'quick' if meta.get('quick') else 'full'} run, {meta.get('cpus')} CPUs, "
                 f"load {meta.get('loadavg_start')})", fontsize=9)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
