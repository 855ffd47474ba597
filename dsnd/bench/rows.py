"""Benchmark output: medians, targets and rows, printed as a table and as JSON lines (pure).

Every ``dsnd bench`` prints its results as `Row`s, each a measured ratio against a baseline run
in the same job with its `Target`, so a reader sees at once what passed.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BENCH = "pipeline"  # a row's bench unless it names another
LOSS_TOLERANCE = 1e-4  # a benchmark's run against its baseline: the same losses, or it is void


def median(values: Iterable[float]) -> float:
    items = list(values)
    if not items:
        raise ValueError("median of no values")
    return float(statistics.median(items))


class Skipped(Exception):
    """A bench with nothing to measure on this machine (no GPU, say): the command says why in one
    line and exits 0."""


@dataclass(frozen=True)
class Target:
    """A range a metric should fall in: lo <= value <= hi (either side open when None)."""

    lo: float | None = None
    hi: float | None = None
    text: str = ""
    strict: bool = False  # hi itself is not met (value < hi)

    @classmethod
    def at_least(cls, lo: float) -> Target:
        return cls(lo=lo, text=f">= {lo:g}")

    @classmethod
    def at_most(cls, hi: float) -> Target:
        return cls(hi=hi, text=f"<= {hi:g}")

    @classmethod
    def between(cls, lo: float, hi: float) -> Target:
        return cls(lo=lo, hi=hi, text=f"{lo:g}..{hi:g}")

    @classmethod
    def near(cls, centre: float, rel: float) -> Target:
        """Within `rel` (a fraction) of `centre`."""
        lo, hi = centre * (1 - rel), centre * (1 + rel)
        return cls(lo=min(lo, hi), hi=max(lo, hi), text=f"{format_value(centre)} ±{rel:.0%}")

    @classmethod
    def below(cls, hi: float) -> Target:
        return cls(hi=hi, text=f"< {hi:g}", strict=True)

    def met(self, value: float) -> bool:
        under = self.hi is None or value < self.hi or (not self.strict and value == self.hi)
        return (self.lo is None or value >= self.lo) and under


@dataclass(frozen=True)
class Row:
    """One line of output; `target` None for a number shown for context only."""

    metric: str
    value: float
    target: Target | None = None
    note: str = ""
    bench: str = BENCH

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.value)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bench": self.bench,
            "metric": self.metric,
            "value": self.value,
            "target": None if self.target is None else self.target.text,
            "met": self.met,
        }
        if self.note:
            out["note"] = self.note
        return out


def format_value(value: float) -> str:
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 1000):
        return str(int(value))
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def json_lines(rows: Sequence[Row]) -> str:
    return "\n".join(json.dumps(row.as_json()) for row in rows)


def format_table(rows: Sequence[Row]) -> str:
    """An aligned table (bench, metric, value, target, met), then each row's note."""
    header = ("bench", "metric", "value", "target", "met")
    cells = [header]
    for row in rows:
        met = "-" if row.met is None else ("yes" if row.met else "NO")
        target = "-" if row.target is None else row.target.text
        cells.append((row.bench, row.metric, format_value(row.value), target, met))
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    right = {2}  # numbers align right
    lines = []
    for c in cells:
        parts = [c[i].rjust(w) if i in right else c[i].ljust(w) for i, w in enumerate(widths)]
        lines.append("  ".join(parts).rstrip())
    notes = [f"  {row.metric}: {row.note}" for row in rows if row.note]
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


# --- from raw measurements ------------------------------------------------------------------


def timed(raw: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The repetitions after warm-up."""
    reps = [rep for rep in raw["reps"] if rep["timed"]]
    if not reps:
        raise ValueError("no timed repetitions")
    return reps
