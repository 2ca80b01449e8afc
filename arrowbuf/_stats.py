"""Summaries for `ExperienceStore.stats` and the HTML a notebook shows for a store."""

from __future__ import annotations

import html
from typing import Any, Mapping, Sequence

import numpy as np

from arrowbuf.samplers import PrioritizedSampler
from arrowbuf.schema import SYSTEM_SPECS, Schema

PRIORITY_BINS = 10


def reuse_summary(counts: np.ndarray | None) -> dict[str, float] | None:
    """min / mean / max of per-transition sample counts; None when they are not tracked."""
    if counts is None:
        return None
    if not len(counts):
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": int(counts.min()), "mean": float(counts.mean()), "max": int(counts.max())}


def priority_histogram(priorities: np.ndarray, bins: int = PRIORITY_BINS) -> dict[str, list]:
    """Counts of ``priorities`` over ``bins`` log-spaced bins from their min to their max.

    Example:
        >>> priority_histogram(np.array([1.0, 10.0, 100.0]), bins=2)
        {'edges': [1.0, 10.0, 100.0], 'counts': [1, 2]}
    """
    if not len(priorities):
        return {"edges": [], "counts": []}
    low, high = float(priorities.min()), float(priorities.max())
    if not low < high:
        return {"edges": [low, high], "counts": [len(priorities)]}
    edges = np.geomspace(low, high, bins + 1)   # priorities are > 0: eps is added to each
    counts, _ = np.histogram(priorities, edges)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


# -- HTML ------------------------------------------------------------------------------

_STYLE = "border-collapse:collapse;margin:0 1.5em 0.5em 0;vertical-align:top;display:inline-table"


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
    return (f"<table style='{_STYLE}'><caption style='text-align:left'><b>{html.escape(title)}</b></caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, Mapping):
        if "edges" in value and "counts" in value:
            return "; ".join(f"[{a:.3g}, {b:.3g}): {c}" for a, b, c in
                            zip(value["edges"], value["edges"][1:], value["counts"])) or "empty"
        return ", ".join(f"{k} {_value(v)}" for k, v in value.items())
    return str(value)


def schema_rows(schema: Schema) -> list[tuple[str, str, str, str]]:
    """(field, dtype, shape, role) of every column, system columns last."""
    rows = [(name, f.dtype, str(tuple(f.shape)), "observation" if f.observation else "step")
            for name, f in schema.fields.items()]
    return rows + [(name, f.dtype, str(tuple(f.shape)), "system") for name, f in SYSTEM_SPECS.items()]


def store_html(title: str, schema: Schema | None, stats: Mapping[str, Any]) -> str:
    """The schema and the stats of a store as HTML tables (shards of a Ray store in a third)."""
    parts = [f"<div><p><b>{html.escape(title)}</b></p>"]
    if schema is None:
        parts.append("<p>schema: none yet (inferred from the first write)</p>")
    else:
        parts.append(_table("schema", ("field", "dtype", "shape", "role"), schema_rows(schema)))
    scalar = [(k, _value(v)) for k, v in stats.items() if k != "shards" and v is not None]
    parts.append(_table("stats", ("stat", "value"), scalar))
    shards = stats.get("shards")
    if shards:
        keys = [k for k in ("shard", "transitions", "episodes", "inserts", "samples", "reuse") if k in shards[0]]
        parts.append(_table("shards", keys, [[_value(s.get(k)) for k in keys] for s in shards]))
    parts.append("</div>")
    return "".join(parts)


def sampler_priorities(sampler: Any, shard: Any) -> dict | None:
    """`priority_histogram` of the priorities a `PrioritizedSampler` holds for ``shard``'s
    transitions; None for other samplers, or before the first write."""
    if not isinstance(sampler, PrioritizedSampler) or shard is None:
        return None
    leaves = sampler.tree.leaves[shard.transition_rows()]   # p^alpha
    return priority_histogram(leaves ** (1 / sampler.alpha) if sampler.alpha else leaves)
