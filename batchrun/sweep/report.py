"""The sweep's report: one self-contained report.html out of its two tables.

`results` has one row per cell × example × choice (the cell's settings, the output, its tokens
and latency, one `score:<name>` column per scorer); `summary` one row per cell (the settings,
token sums, wall time, throughput and per scorer `<name>:<metric>` with `_ci_low`/`_ci_high`).

The page opens offline: inline CSS, charts drawn here as inline SVG, no fonts, styles or scripts
from anywhere else. A few lines of inline script make the summary table sortable; without them
the page is complete. Everything that comes from the data (model outputs above all) is escaped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import polars as pl

from batchrun.batch.storage import io
from batchrun.batch.storage.store import NO_OPTIONS, Storage
from batchrun.sweep.disagreements import disagreement_section
from batchrun.sweep.report_parts import (TOTAL_LABELS, TOTALS, Cells, Metric, cell_title,
                                         cells_of, fmt_amount, fmt_setting, is_numeric_axis,
                                         metric_columns, sort_key, td, varying)
from batchrun.sweep.svg import (LABEL_CHARS, PALETTE, Bar, Point, bar_chart, clip, e, finite,
                                fmt_metric, legend, line_chart, nice_scale, series_style)


# ---------------------------------------------------------------------------------- sections

def summary_table(summary: pl.DataFrame, cells: Cells, axes: Sequence[str],
                  metrics: list[Metric], errors: dict[str, int]) -> str:
    # An axis that does not vary is in the facts line above the table, not a column of it.
    known = {"cell", *axes, *TOTALS, "errors"}
    axes = [a for a in axes if a in summary.columns and a in cells.varying]
    for m in metrics:
        known |= {m.column, m.low, m.high}
    extra = [c for c in summary.columns if c not in known]
    totals = [t for t in TOTALS if t in summary.columns]
    heads = (["cell"] + axes + [m.label for m in metrics]
             + [TOTAL_LABELS[t] for t in totals] + ["errors"] + extra)
    numeric_axes = {a for a in axes if is_numeric_axis(summary, a)}
    out = ['<div class="table-wrap"><table class="sortable" id="summary"><thead><tr>']
    for h in heads:  # a long scorer name breaks after its underscores, not inside a word
        out.append(f'<th title="sort">{e(h).replace("_", "_<wbr>")}</th>')
    out.append("</tr></thead><tbody>")
    for cid, row in zip(cells.ids, cells.rows):
        tds = [td(cid, cid, "cell")]
        for a in axes:
            value = row[a]
            tds.append(td(fmt_setting(value), sort_key(value) if a in numeric_axes else
                          fmt_setting(value), "num" if a in numeric_axes else ""))
        for m in metrics:
            value = finite(row.get(m.column))
            text = fmt_metric(value)
            if value is not None and m.has_ci:
                low, high = finite(row.get(m.low)), finite(row.get(m.high))
                if low is not None and high is not None:
                    text += f'<br><span class="ci">[{fmt_metric(low)}, {fmt_metric(high)}]</span>'
            tds.append(td(text, sort_key(value), "num", raw=True))
        for t in totals:
            digits = 0 if t in ("examples", "prompt_tokens", "completion_tokens") else 1
            tds.append(td(fmt_amount(row.get(t), digits), sort_key(row.get(t)), "num"))
        n_errors = errors.get(cid, 0)
        tds.append(td(str(n_errors), str(n_errors), "num bad" if n_errors else "num"))
        for c in extra:
            value = row.get(c)
            text = fmt_metric(value) if isinstance(value, float) else fmt_setting(value)
            tds.append(td(text, sort_key(value) if isinstance(value, (int, float))
                          else fmt_setting(value), ""))
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def cell_colors(summary: pl.DataFrame, cells: Cells) -> tuple[dict[str, str], dict]:
    """Bars take their colour from the first varying axis that is not numeric (e.g. model)."""
    axis = next((a for a in cells.varying if not is_numeric_axis(summary, a)), None)
    if axis is None:
        return {cid: PALETTE[0] for cid in cells.ids}, {}
    values = list(dict.fromkeys(fmt_setting(r[axis]) for r in cells.rows))
    color_of = {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(values)}
    colors = {cid: color_of[fmt_setting(r[axis])] for cid, r in zip(cells.ids, cells.rows)}
    return colors, {f"{axis}={v}": (c, "") for v, c in color_of.items()}


def bar_label(cells: Cells, cid: str) -> str:
    return clip(cell_title(cells, cid), LABEL_CHARS)


def metric_charts(cells: Cells, metrics: list[Metric], colors: dict[str, str]) -> list[str]:
    charts = []
    for m in metrics:
        bars = []
        for cid, row in zip(cells.ids, cells.rows):
            value = finite(row.get(m.column))
            low = finite(row.get(m.low)) if m.has_ci else None
            high = finite(row.get(m.high)) if m.has_ci else None
            interval = f" [{fmt_metric(low)}, {fmt_metric(high)}]" if low is not None else ""
            bars.append(Bar(cid, bar_label(cells, cid),
                            f"{cell_title(cells, cid)}: {m.label} {fmt_metric(value)}{interval}",
                            value, low, high, colors[cid]))
        charts.append(figure(m.label, bar_chart(bars, m.label), tall=len(bars) > 40))
    return charts


def axis_charts(summary: pl.DataFrame, cells: Cells, metrics: list[Metric]) -> list[str]:
    """Score against each numeric axis that varies, one line per combination of the others."""
    numeric = [a for a in cells.varying if is_numeric_axis(summary, a)]
    charts = []
    for axis in numeric:
        others = [a for a in cells.varying if a != axis]
        keys = {cid: " · ".join(f"{a}={fmt_setting(r[a])}" for a in others)
                for cid, r in zip(cells.ids, cells.rows)}
        names = list(dict.fromkeys(keys.values()))
        colors = series_style(names)
        for m in metrics:
            series: dict[str, list[Point]] = {n: [] for n in names}
            for cid, row in zip(cells.ids, cells.rows):
                xv = finite(row[axis])
                if xv is None:
                    continue
                value = finite(row.get(m.column))
                low = finite(row.get(m.low)) if m.has_ci else None
                high = finite(row.get(m.high)) if m.has_ci else None
                series[keys[cid]].append(Point(
                    xv, value, low, high,
                    f"{cell_title(cells, cid)}: {m.label} {fmt_metric(value)}"))
            chart = line_chart(series, colors, axis, m.label)
            drawn = any(p.y is not None for ps in series.values() for p in ps)
            charts.append(figure(f"{m.label} against {axis}",
                                 chart + (legend(colors) if drawn else "")))
    return charts


def cost_charts(cells: Cells, colors: dict[str, str]) -> list[str]:
    charts = []
    for column, label, fmt in (("completion_tokens", "completion tokens", fmt_amount),
                               ("wall_time_s", "wall seconds", lambda v: fmt_amount(v, 1))):
        bars = []
        for cid, row in zip(cells.ids, cells.rows):
            value = finite(row.get(column))
            bars.append(Bar(cid, bar_label(cells, cid),
                            f"{cell_title(cells, cid)}: {fmt(value)} {label}", value,
                            color=colors[cid]))
        domain = None
        values = [b.value for b in bars if b.value is not None]
        if values:
            domain = nice_scale(min(0.0, min(values)), max(max(values), 1e-9))
        charts.append(figure(label, bar_chart(bars, label, fmt, domain, plot_w=240,
                                              points=False), tall=len(bars) > 40))
    return charts


def figure(caption: str, body: str, tall: bool = False) -> str:
    cls = "figure tall" if tall else "figure"
    return f'<figure class="{cls}"><figcaption>{e(caption)}</figcaption>{body}</figure>'


# ---------------------------------------------------------------------------------- the page

CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
       margin: 24px auto; max-width: 1500px; padding: 0 24px; color: #1d2330; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 8px; border-bottom: 1px solid #e3e6ea; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.muted { color: #6b7380; } .bad { color: #b3261e; }
.facts { display: flex; flex-wrap: wrap; gap: 6px 18px; margin: 8px 0; }
.facts span b { font-weight: 600; }
.table-wrap { overflow-x: auto; max-height: 80vh; overflow-y: auto; border: 1px solid #e3e6ea; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 4px 8px; border-bottom: 1px solid #eef0f3; text-align: left;
         vertical-align: top; }
thead th { position: sticky; top: 0; background: #f3f5f8; cursor: pointer; }
#summary thead th { max-width: 9em; }
thead th[data-dir="asc"]::after { content: " ▲"; }
thead th[data-dir="desc"]::after { content: " ▼"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.cell { font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
.ci { color: #6b7380; font-size: 12px; }
.charts { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; padding: 8px; border: 1px solid #e3e6ea; border-radius: 4px; max-width: 100%;
         overflow-x: auto; }
figure.tall { max-height: 75vh; overflow-y: auto; }
figcaption { font-weight: 600; margin-bottom: 4px; }
svg.chart { display: block; font: 11px system-ui, "DejaVu Sans", sans-serif; }
svg .grid { stroke: #e6e8ec; } svg .axis { stroke: #9aa1ab; } svg .err { stroke: #222; fill: none; }
svg .tick { fill: #5b6270; } svg .label { fill: #1d2330; } svg .value { fill: #1d2330; }
svg .muted { fill: #8a919c; } svg .axis-label { fill: #1d2330; font-weight: 600; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; max-width: 640px; font-size: 12px;
          margin-top: 4px; }
.key { white-space: nowrap; } .swatch { display: inline-block; width: 18px; height: 0;
       border-top: 3px solid; margin-right: 5px; vertical-align: middle; }
.swatch.dashed { border-top-style: dashed; }
details.example { margin: 8px 0; } details.example > summary { cursor: pointer; }
table.outputs { width: 100%; table-layout: fixed; }
table.outputs th:nth-child(1) { width: 60px; } table.outputs th:nth-child(2) { width: 260px; }
table.outputs th:nth-child(3) { width: 120px; overflow-wrap: anywhere; }
details.example .reference { margin: 4px 0 6px; }
td.output pre { white-space: pre-wrap; word-break: break-word; margin: 0 0 6px;
                font: 12px/1.4 ui-monospace, "DejaVu Sans Mono", monospace; max-height: 18em;
                overflow-y: auto; background: #f8f9fb; padding: 4px 6px; }
.meta { font-size: 12px; color: #6b7380; }
details.spec pre { white-space: pre-wrap; background: #f8f9fb; padding: 8px; }
"""

# Sorting by a header's column: numbers by data-v as numbers, text as text, blanks last. The
# page is complete without it.
SCRIPT = """
document.querySelectorAll('table.sortable').forEach(function (table) {
  var heads = table.tHead.rows[0].cells;
  Array.prototype.forEach.call(heads, function (th, col) {
    th.addEventListener('click', function () {
      var asc = th.getAttribute('data-dir') !== 'asc';
      Array.prototype.forEach.call(heads, function (h) { h.removeAttribute('data-dir'); });
      th.setAttribute('data-dir', asc ? 'asc' : 'desc');
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = a.cells[col].getAttribute('data-v'), y = b.cells[col].getAttribute('data-v');
        if (x === '' || y === '') { return (x === '') - (y === ''); }
        var nx = parseFloat(x), ny = parseFloat(y), c;
        c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
"""


def render_report(results: pl.DataFrame, summary: pl.DataFrame, axes: list[str], title: str,
                  spec_text: str | None = None) -> str:
    """The sweep's report as one self-contained HTML page."""
    axes = [a for a in axes if a in summary.columns]
    metrics = metric_columns(summary.columns, axes)
    cells = cells_of(summary, axes)
    errors: dict[str, int] = {}
    if "error" in results.columns and "cell" in results.columns:
        counts = (results.filter(pl.col("error").is_not_null())
                  .group_by(pl.col("cell").cast(pl.String)).agg(pl.len()))
        errors = dict(counts.iter_rows())
    colors, color_legend = cell_colors(summary, cells)
    examples = results["id"].n_unique() if "id" in results.columns else 0

    facts = [("cells", f"{len(cells.ids):,}"), ("examples", f"{examples:,}"),
             ("rows", f"{results.height:,}"), ("rows with an error", f"{sum(errors.values()):,}")]
    facts += [(a, fmt_setting(v)) for a, v in cells.fixed.items()]
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
             f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{e(title)}</h1>",
             '<div class="facts">' + "".join(f"<span>{e(k)}: <b>{e(v)}</b></span>"
                                             for k, v in facts) + "</div>"]
    if cells.varying:
        parts.append(f'<p class="muted">Grid axes that vary: {e(", ".join(cells.varying))}. '
                     "Intervals are 95% confidence intervals.</p>")
    if spec_text:
        parts.append(f'<details class="spec"><summary>Sweep spec</summary><pre>{e(spec_text)}'
                     "</pre></details>")

    parts.append('<h2 id="summary-table">Summary</h2>')
    parts.append(summary_table(summary, cells, axes, metrics, errors))

    parts.append('<h2 id="scores">Scores per cell</h2>')
    if metrics:
        parts.append(legend(color_legend))
        parts.append('<div class="charts">' + "".join(metric_charts(cells, metrics, colors))
                     + "</div>")
    else:
        parts.append('<p class="muted">The summary has no scorer metrics.</p>')

    parts.append('<h2 id="axes">Scores against the numeric settings</h2>')
    charts = axis_charts(summary, cells, metrics)
    if charts:
        parts.append('<div class="charts">' + "".join(charts) + "</div>")
    else:
        reason = ("no scorer metrics" if not metrics else
                  "no numeric grid axis takes more than one value")
        parts.append(f'<p class="muted">Nothing to plot: {reason}.</p>')

    parts.append('<h2 id="cost">Cost per cell</h2>')
    parts.append('<div class="charts">' + "".join(cost_charts(cells, colors)) + "</div>")

    parts.append('<h2 id="disagreements">Examples the cells disagree on most</h2>')
    parts.append(disagreement_section(results, cells))

    parts.append(f"<script>{SCRIPT}</script></body></html>\n")
    return "".join(parts)


def expected_chart_count(summary: pl.DataFrame, axes: Sequence[str]) -> int:
    """How many <svg> charts render_report draws: one per metric, one per metric and varying
    numeric axis, and the two cost charts."""
    axes = [a for a in axes if a in summary.columns]
    metrics = metric_columns(summary.columns, axes)
    numeric = [a for a in varying(summary, axes) if is_numeric_axis(summary, a)]
    return len(metrics) * (1 + len(numeric)) + 2


# ---------------------------------------------------------------------------------- files

def read_sweep(folder: str | os.PathLike, storage: Storage = NO_OPTIONS
               ) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """The results and summary tables of a sweep's output folder and its sweep.json ({} when
    there is none: then the axes are the summary's columns that are neither totals nor
    metrics)."""
    root = os.fspath(folder).rstrip("/")
    tables = []
    for name in ("results.parquet", "summary.parquet"):
        path = f"{root}/{name}"
        if not storage.exists(path):
            raise FileNotFoundError(f"{folder}: no {name} (is it a sweep's output folder?)")
        with storage.open_read(path) as f:
            tables.append(pl.read_parquet(f))
    meta_path = f"{root}/sweep.json"
    meta = storage.read_json(meta_path) if storage.exists(meta_path) else {}
    results, summary = tables
    if "axes" not in meta:
        metric_cols = set()
        for m in metric_columns(summary.columns):
            metric_cols |= {m.column, m.low, m.high}
        meta["axes"] = [c for c in summary.columns
                        if c != "cell" and c not in TOTALS and c not in metric_cols]
    return results, summary, meta


def write_report(folder: str | os.PathLike, storage: Storage = NO_OPTIONS) -> str:
    """Render the sweep in `folder` (a local path or fsspec URL) to `folder/report.html`,
    written whole (batch.io's atomic write: a reader never sees half a report). Returns the
    report's path."""
    results, summary, meta = read_sweep(folder, storage)
    root = os.fspath(folder).rstrip("/")
    title = str(meta.get("name") or Path(root).name or "sweep")
    page = render_report(results, summary, list(meta["axes"]), title, meta.get("spec"))
    target = f"{root}/report.html"
    io.write_bytes_atomic(target, page.encode("utf-8"), storage.options)
    return target

