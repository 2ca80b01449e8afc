"""What a workload returns: per-round series, metrics (one table row each) and results."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Series:
    """Per-round values of one measurement (the median is what is reported)."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def to_json(self) -> dict:
        return {"median": self.median, "min": min(self.values, default=float("nan")),
                "max": max(self.values, default=float("nan")), "rounds": self.values}


def speedup(fast: Series, slow: Series, higher_is_better: bool = True) -> Series:
    """Per-round ratios ``fast/slow`` of rates (or ``slow/fast`` of times): > 1 means faster."""
    pairs = zip(fast.values, slow.values, strict=True)
    return Series([a / b if higher_is_better else b / a for a, b in pairs])


@dataclass
class Metric:
    """One row of the results table."""

    name: str
    unit: str
    values: dict[str, Series | float | None]          # contender -> per-round series or one value
    ratios: dict[str, Series] = field(default_factory=dict)  # "arrowbuf/ideal" -> paired per-round ratios
    target: str = ""                                   # e.g. "arrowbuf/ideal >= 0.8"
    met: bool | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    # A metric in "x" without ratios shows values[a] / values[b] in column "a/b".
    ratios_from_values: bool = True

    def to_json(self) -> dict:
        vals = {k: (v.to_json() if isinstance(v, Series) else v) for k, v in self.values.items()}
        return {"name": self.name, "unit": self.unit, "values": vals,
                "ratios": {k: v.to_json() for k, v in self.ratios.items()},
                "target": self.target, "met": self.met, "detail": self.detail,
                "ratios_from_values": self.ratios_from_values}


@dataclass
class WorkloadResult:
    """A workload's metrics, in the columns of its table: contenders, then ratio columns."""

    name: str
    title: str
    description: str
    contenders: list[str]
    metrics: list[Metric]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)     # contender -> column title (default: its name)
    ratio_columns: list[str] = field(default_factory=lambda: ["arrowbuf/ideal", "arrowbuf/torchrl"])

    def __post_init__(self) -> None:
        for metric in self.metrics:   # a contender a metric does not measure is shown (and saved) as None
            for contender in self.contenders:
                metric.values.setdefault(contender, None)

    def label(self, contender: str) -> str:
        return self.labels.get(contender, contender)

    def to_json(self) -> dict:
        return {"name": self.name, "title": self.title, "description": self.description, "contenders": self.contenders,
                "metrics": [m.to_json() for m in self.metrics], "notes": self.notes, "seconds": self.seconds,
                "labels": {c: self.label(c) for c in self.contenders}, "ratio_columns": self.ratio_columns}
