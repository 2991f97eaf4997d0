"""Issue 43's sweep report: the summary table fits a 1280-pixel window (headless Chromium), and
the disagreements of a loglikelihood scorer show the example's reference and the choice each
cell picked (not the generated text); each loglikelihood scorer picks by its own
normalisation (loglikelihood_choice_norm scored loglikelihood_choice's picks before)."""

from __future__ import annotations

import re

import polars as pl
import pytest

from batchrun.sweep import tables
from batchrun.sweep.cells import Cell
from batchrun.sweep.report import render_report
from batchrun.sweep.scorers import Example
from batchrun.sweep.scorers.loglikelihood import LoglikelihoodChoice, LoglikelihoodChoiceConfig
from tests.unit.test_sweep_report import AXES, browser, chromium, synthetic

LONG = ("loglikelihood_choice", "loglikelihood_choice_norm")
# Test-only: the summary table's box after layout, for --dump-dom to show.
WIDTHS = """<script>var w = document.querySelector('.table-wrap');
document.body.setAttribute('data-widths', w.scrollWidth + ',' + w.clientWidth);</script>"""


def _wide_summary():
    """synthetic()'s tables with multiple_choice.toml's long scorer names beside its two."""
    results, summary = synthetic(models=("smollm2-135m",))
    for name in LONG:
        summary = summary.with_columns(pl.lit(0.7).alias(f"{name}:mean"),
                                       pl.lit(0.481).alias(f"{name}:mean_ci_low"),
                                       pl.lit(0.855).alias(f"{name}:mean_ci_high"))
    return results, summary


def test_chromium_fits_the_summary_table_in_a_1280_pixel_window(tmp_path):
    if chromium() is None:
        pytest.skip("no chromium/chromium-browser/google-chrome on PATH")
    results, summary = _wide_summary()
    page = render_report(results, summary, AXES, "width")
    # The axes that do not vary are in the facts line, not columns.
    assert "model: <b>smollm2-135m</b>" in page and ">model</th>" not in page
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", WIDTHS + "</body>"))
    dom = browser("--dump-dom", "--window-size=1280,900", measured.as_uri(),
                  profile=tmp_path / "profile")
    widths = re.search(r'data-widths="(\d+),(\d+)"', dom.stdout)
    assert widths, dom.stdout[-2000:]
    scroll, client = map(int, widths.groups())
    assert scroll <= client, f"the summary table is {scroll}px wide in a {client}px box"


def _chooser(name, normalize):
    return LoglikelihoodChoice(LoglikelihoodChoiceConfig(name=name, choices_column="choices",
                                                         normalize=normalize))


def test_loglikelihood_disagreements_show_the_reference_and_each_scorers_pick():
    example = Example("q1", {"choices": ["Rome", "Paris", "Copenhagen"]}, reference=1)
    # Per-character, Paris wins; summed, Rome does.
    logprobs = [-4.0, -4.6, -12.0]
    outputs, context = {}, {}
    for j, lp in enumerate(logprobs):
        key = f"ll/plain/q1/{j}"
        outputs[key] = {"choices": [{"logprobs": {"token_logprobs": [None, lp]}}]}
        context[key] = 1
    cells = [Cell("c001", (("temperature", 0.0), ("prompt", "plain"))),
             Cell("c002", (("temperature", 0.7), ("prompt", "plain")))]
    choosers = [_chooser("loglikelihood_choice", "none"),
                _chooser("loglikelihood_choice_norm", "length")]
    rows = tables.score_rows(cells, ["temperature", "prompt"], [example], outputs, {}, context,
                             [], choosers)
    assert [(r["picked:loglikelihood_choice"], r["score:loglikelihood_choice"],
             r["picked:loglikelihood_choice_norm"], r["score:loglikelihood_choice_norm"])
            for r in rows] == [("Rome", 0.0, "Paris", 1.0)] * 2
    assert rows[0]["reference"] == "1: Paris"

    results = pl.DataFrame(rows)
    results = pl.concat([results, results.with_columns(
        pl.lit("c003").alias("cell"), pl.lit(1.0).alias("score:loglikelihood_choice"),
        pl.lit("Paris").alias("picked:loglikelihood_choice"))])
    summary = pl.DataFrame([{"cell": c, "temperature": t, "prompt": "plain", "examples": 1,
                             "loglikelihood_choice:mean": m}
                            for c, t, m in (("c001", 0.0, 0.0), ("c002", 0.7, 0.0),
                                            ("c003", 1.0, 1.0))])
    page = render_report(results, summary, ["temperature", "prompt"], "picks")
    section = page[page.index('id="disagreements"'):]
    assert "reference answer: <code>1: Paris</code>" in section
    assert "choice it picked (log-probabilities)" in section
    assert "<pre>Rome</pre>" in section and "<pre>Paris</pre>" in section
