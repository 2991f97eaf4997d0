"""What the sweep report's sections share: the summary's metric columns, the cells (one per
grid point) and their titles, value formatting, and sortable table cells."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import polars as pl

from batchrun.sweep.svg import e, finite

CI_LOW = "_ci_low"
CI_HIGH = "_ci_high"
SCORE_PREFIX = "score:"
# Summary columns the sweep always writes besides the axes and the scorer metrics.
TOTALS = ("examples", "prompt_tokens", "completion_tokens", "wall_time_s", "output_tokens_per_s")
TOTAL_LABELS = {"examples": "examples", "prompt_tokens": "prompt tokens",
                "completion_tokens": "completion tokens", "wall_time_s": "wall s",
                "output_tokens_per_s": "output tok/s"}


@dataclass(frozen=True)
class Metric:
    """One scorer's metric in the summary: `<scorer>:<metric>` and its 95% interval columns."""

    scorer: str
    metric: str
    has_ci: bool = True

    @property
    def column(self) -> str:
        return f"{self.scorer}:{self.metric}"

    @property
    def low(self) -> str:
        return self.column + CI_LOW

    @property
    def high(self) -> str:
        return self.column + CI_HIGH

    @property
    def label(self) -> str:
        return f"{self.scorer} {self.metric}"


def metric_columns(columns: Iterable[str], axes: Iterable[str] = ()) -> list[Metric]:
    """The (scorer, metric) pairs of a summary's column names, in column order.

    `<scorer>:<metric>` is a metric; `<scorer>:<metric>_ci_low`/`_ci_high` its interval when
    that metric's column exists (a lone `x:y_ci_low` is a metric of its own). The metric is
    what follows the last colon (`pass@1`, `mean`); axis columns are never metrics."""
    columns = list(columns)
    present, skip = set(columns), set(axes)
    found = []
    for col in columns:
        if col in skip or ":" not in col or col.startswith(SCORE_PREFIX):
            continue
        base = next((col[:-len(s)] for s in (CI_LOW, CI_HIGH) if col.endswith(s)), None)
        if base is not None and base in present:
            continue
        scorer, _, metric = col.rpartition(":")
        if scorer and metric:
            found.append(Metric(scorer, metric, f"{col}{CI_LOW}" in present
                                and f"{col}{CI_HIGH}" in present))
    return found


def score_columns(results: pl.DataFrame) -> list[str]:
    """The per-row scorer columns of the results (`score:<name>`)."""
    return [c for c in results.columns if c.startswith(SCORE_PREFIX)]


def is_numeric_axis(frame: pl.DataFrame, axis: str) -> bool:
    dtype = frame.schema[axis]
    return dtype.is_numeric() and dtype != pl.Boolean


def varying(frame: pl.DataFrame, axes: Sequence[str]) -> list[str]:
    """The axes that take more than one value across the summary's cells."""
    return [a for a in axes if a in frame.columns and frame[a].n_unique() > 1]


def fmt_setting(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return "–" if not math.isfinite(value) else f"{value:g}"
    return str(value)


def fmt_amount(value: Any, digits: int = 0) -> str:
    number = finite(value)
    if number is None:
        return "–"
    return f"{number:,.{digits}f}"


@dataclass
class Cells:
    """The summary's cells in its order, each with its label (the settings that vary)."""

    ids: list[str]
    rows: list[dict]
    labels: dict[str, str]      # cell -> "model=a · temperature=0.7"
    fixed: dict[str, Any]       # axis -> its one value, for the axes that do not vary
    varying: list[str]


def cells_of(summary: pl.DataFrame, axes: Sequence[str]) -> Cells:
    axes = [a for a in axes if a in summary.columns]
    moving = varying(summary, axes)
    rows = summary.to_dicts()
    ids = [str(r["cell"]) for r in rows]
    labels = {}
    for cid, row in zip(ids, rows):
        settings = " · ".join(f"{a}={fmt_setting(row[a])}" for a in moving)
        labels[cid] = settings
    fixed = {a: rows[0][a] for a in axes if a not in moving} if rows else {}
    return Cells(ids, rows, labels, fixed, moving)


def cell_title(cells: Cells, cid: str) -> str:
    return f"{cid} {cells.labels[cid]}".strip()


def sort_key(value: Any) -> str:
    number = finite(value)
    return "" if number is None else repr(number)


def td(text: str, key: str, cls: str = "", raw: bool = False) -> str:
    """A table cell; `key` is what the sorting script compares ("" sorts last)."""
    body = text if raw else e(text)
    cls_attr = f' class="{cls}"' if cls else ""
    return f'<td data-v="{e(key)}"{cls_attr}>{body}</td>'
