"""The report's disagreements section: per scorer, the examples the cells score most
differently, with the example's reference answer and each cell's outputs side by side
(escaped, cut at MAX_OUTPUT_CHARS). A loglikelihood scorer scores the choice it picked by the
choices' log-probabilities, not the generated text: its rows show that choice."""

from __future__ import annotations

import polars as pl

from batchrun.sweep.report_parts import SCORE_PREFIX, Cells, score_columns
from batchrun.sweep.svg import e, finite, fmt_metric
from batchrun.sweep.tables import PICKED_PREFIX

TOP_DISAGREEMENTS = 10
MAX_OUTPUT_CHARS = 600      # an output shown in the disagreements, before "… N more characters"
MAX_CHOICES_SHOWN = 3       # choices shown per cell and example (n > 1)
OPEN_DETAILS_UP_TO = 16     # cells; with more, each disagreement's table starts folded


def per_example_scores(results: pl.DataFrame, column: str) -> pl.DataFrame:
    """(cell, id, score): each cell's mean score over an example's choices."""
    return (results.select(pl.col("cell").cast(pl.String), pl.col("id").cast(pl.String),
                           pl.col(column).cast(pl.Float64).fill_nan(None).alias("score"))
            .group_by("cell", "id").agg(pl.col("score").mean()))


def disagreements(results: pl.DataFrame, column: str, top: int = TOP_DISAGREEMENTS
                  ) -> pl.DataFrame:
    """The examples whose per-example score differs most across cells: id, spread (max − min
    of the cells' per-example means), std, and how many cells scored it. Only examples at
    least two cells scored and that some pair of cells scored differently."""
    scores = per_example_scores(results, column).drop_nulls("score")
    return (scores.group_by("id")
            .agg(spread=pl.col("score").max() - pl.col("score").min(),
                 std=pl.col("score").std(), cells=pl.len())
            .filter((pl.col("cells") >= 2) & (pl.col("spread") > 0))
            .sort(["spread", "std", "id"], descending=[True, True, False], nulls_last=True)
            .head(top))


def truncated(text: str | None, limit: int = MAX_OUTPUT_CHARS) -> str:
    """Escaped model text, cut at `limit` characters with a note of what was left out."""
    if text is None:
        return '<span class="muted">(no output)</span>'
    if len(text) <= limit:
        return e(text)
    more = len(text) - limit
    return e(text[:limit]) + f'<span class="muted">… ({more:,} more characters)</span>'


def disagreement_section(results: pl.DataFrame, cells: Cells) -> str:
    columns = score_columns(results)
    if not columns:
        return '<p class="muted">No scorer columns in the results.</p>'
    if len(cells.ids) < 2:
        return '<p class="muted">One cell: there is nothing to disagree with.</p>'
    order = {cid: i for i, cid in enumerate(cells.ids)}
    out = []
    for column in columns:
        name = column[len(SCORE_PREFIX):]
        picked = PICKED_PREFIX + name if PICKED_PREFIX + name in results.columns else None
        out.append(f'<h3>{e(name)}</h3>')
        if results[column].cast(pl.Float64).fill_nan(None).null_count() == results.height:
            out.append('<p class="muted">No per-example scores: the scorer raised (or gave '
                       'no number) for every row.</p>')
            continue
        top = disagreements(results, column)
        if top.height == 0:
            out.append('<p class="muted">The cells agree on every example.</p>')
            continue
        out.append(f'<p class="muted">The {top.height} examples whose mean {e(name)} differs '
                   'most across cells (spread = highest − lowest cell).</p>')
        means = per_example_scores(results, column)
        shown = results.filter(pl.col("id").cast(pl.String).is_in(top["id"].to_list()))
        for ex in top.iter_rows(named=True):
            rows = (shown.filter(pl.col("id").cast(pl.String) == ex["id"])
                    .with_columns(pl.col("cell").cast(pl.String)))
            mean_of = {r["cell"]: r["score"] for r in
                       means.filter(pl.col("id") == ex["id"]).iter_rows(named=True)}
            by_cell: dict[str, list[dict]] = {}
            for r in rows.sort("choice").iter_rows(named=True):
                by_cell.setdefault(r["cell"], []).append(r)
            ordered = sorted(by_cell, key=lambda c: order.get(c, len(order)))
            is_open = " open" if len(ordered) <= OPEN_DETAILS_UP_TO else ""
            out.append(f'<details class="example"{is_open}><summary><code>{e(ex["id"])}'
                       f'</code> spread {fmt_metric(ex["spread"])}, {ex["cells"]} cells</summary>')
            out.append(_reference(rows))
            shows = "choice it picked (log-probabilities)" if picked else "output"
            out.append('<table class="outputs"><thead><tr><th>cell</th><th>settings</th>'
                       f'<th>{e(name).replace("_", "_<wbr>")}</th><th>{shows}</th></tr></thead>'
                       '<tbody>')
            for cid in ordered:
                choices = by_cell[cid]
                parts = []
                for r in choices[:MAX_CHOICES_SHOWN]:
                    head = []
                    if len(choices) > 1:
                        head.append(f"choice {r['choice']}")
                    score = finite(r.get(column))
                    if len(choices) > 1:
                        head.append(f"score {fmt_metric(score)}")
                    if not picked and r.get("finish_reason") not in (None, "stop"):
                        head.append(f"finish: {r['finish_reason']}")
                    meta = (f'<div class="meta">{e(" · ".join(head))}</div>' if head else "")
                    error = (f'<div class="bad">error: {truncated(r["error"], 300)}</div>'
                             if r.get("error") else "")
                    text = r.get(picked) if picked else r.get("output")
                    parts.append(f'{meta}{error}<pre>{truncated(text)}</pre>')
                if len(choices) > MAX_CHOICES_SHOWN:
                    parts.append(f'<div class="muted">+{len(choices) - MAX_CHOICES_SHOWN} more '
                                 'choices</div>')
                out.append(f'<tr><td><code>{e(cid)}</code></td><td>{e(cells.labels.get(cid, ""))}'
                           f'</td><td class="num">{fmt_metric(mean_of.get(cid))}</td>'
                           f'<td class="output">{"".join(parts)}</td></tr>')
            out.append("</tbody></table></details>")
    return "".join(out)


def _reference(rows: pl.DataFrame) -> str:
    """The example's reference answer, as the scorers compare against it."""
    if "reference" not in rows.columns or rows["reference"].null_count() == rows.height:
        return '<div class="reference muted">no reference answer</div>'
    return (f'<div class="reference">reference answer: <code>'
            f'{truncated(rows["reference"].drop_nulls()[0], 300)}</code></div>')
