"""The sweep's report.html: self-contained, escaped, and drawn by a real browser.

The tables are synthetic (a few cells × examples, two scorers, a temperature axis). The browser
test renders the page with Debian's Chromium (headless; `make install-test` installs it where
apt-get is available) and checks the DOM it built and the pixels it painted.
"""

from __future__ import annotations

import html.parser
import json
import random
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from click.testing import CliRunner

from batchrun.sweep.commands import sweep
from batchrun.sweep.report import expected_chart_count, metric_columns, render_report, write_report

AXES = ["model", "temperature", "max_tokens", "n", "prompt"]
XSS = "<script>alert(1)</script>"


def synthetic(models=("tiny-a", "tiny-b"), temperatures=(0.0, 0.7, 1.2), examples=6,
              choices=1, seed=0) -> tuple[pl.DataFrame, pl.DataFrame]:
    """results and summary as the sweep writes them: cells = models × temperatures."""
    rng = random.Random(seed)
    rows, cells = [], []
    for model in models:
        for temperature in temperatures:
            cid = f"c{len(cells) + 1:03d}"
            settings = {"model": model, "temperature": float(temperature), "max_tokens": 64,
                        "n": choices, "prompt": "plain"}
            cells.append((cid, settings))
            for i in range(examples):
                for choice in range(choices):
                    good = rng.random() > 0.3 + 0.3 * temperature
                    output = f"answer {i} from {model} at {temperature}"
                    if i == 0 and cid == "c002":
                        output = f"before {XSS} after"
                    rows.append({"cell": cid, **settings, "id": f"ex{i}", "choice": choice,
                                 "output": output, "finish_reason": "stop",
                                 "prompt_tokens": 20 + i, "completion_tokens": 5 + i + choice,
                                 "latency_s": 0.1 * (i + 1), "error": None,
                                 "score:exact_match": 1.0 if good else 0.0,
                                 "score:f1": rng.random()})
    results = pl.DataFrame(rows, schema_overrides={"finish_reason": pl.String,
                                                   "error": pl.String,
                                                   "latency_s": pl.Float64})
    summary_rows = []
    for cid, settings in cells:
        part = results.filter(pl.col("cell") == cid)
        row = {"cell": cid, **settings, "examples": examples,
               "prompt_tokens": int(part["prompt_tokens"].sum()),
               "completion_tokens": int(part["completion_tokens"].sum()),
               "wall_time_s": 1.5 + rng.random(), "output_tokens_per_s": 40 + 10 * rng.random()}
        for name in ("exact_match", "f1"):
            mean = float(part[f"score:{name}"].mean())
            row[f"{name}:mean"] = mean
            row[f"{name}:mean_ci_low"] = max(0.0, mean - 0.15)
            row[f"{name}:mean_ci_high"] = min(1.0, mean + 0.15)
        summary_rows.append(row)
    return results, pl.DataFrame(summary_rows)


def test_metric_columns_finds_scorers_metrics_and_their_intervals():
    cols = ["cell", "model", "examples", "exact_match:mean", "exact_match:mean_ci_low",
            "exact_match:mean_ci_high", "humaneval:pass@1", "humaneval:pass@1_ci_low",
            "humaneval:pass@1_ci_high", "humaneval:pass@5", "odd:thing_ci_low"]
    found = [(m.scorer, m.metric, m.has_ci) for m in metric_columns(cols, ["model"])]
    assert found == [("exact_match", "mean", True), ("humaneval", "pass@1", True),
                     ("humaneval", "pass@5", False), ("odd", "thing_ci_low", False)]


def assert_self_contained(page: str) -> None:
    lowered = page.lower()
    for needle in ("http://", "https://", "//cdn", "<link", "<script src", "@import", "url("):
        assert needle not in lowered, needle


def test_report_is_self_contained_has_every_cell_and_its_charts_and_escapes_outputs():
    results, summary = synthetic()
    page = render_report(results, summary, AXES, "demo <sweep>", spec_text='name = "x<y>"')
    assert_self_contained(page)
    table = page[page.index('<table class="sortable"'):]
    table = table[:table.index("</table>")]
    for cid in summary["cell"]:
        assert f">{cid}</td>" in table
    assert table.count("<tr>") == summary.height + 1
    # two metrics: one chart each, one each against temperature, and the two cost charts
    assert page.count("<svg") == expected_chart_count(summary, AXES) == 2 + 2 + 2
    assert XSS not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "demo &lt;sweep&gt;" in page and "x&lt;y&gt;" in page
    assert page.count("<script>") == 1  # the sorting script, and nothing from the data


def test_edge_cases_one_cell_no_numeric_axis_null_scorer_nan_ci_long_output():
    results, summary = synthetic(models=("only",), temperatures=(0.5,))
    long = "x" * 50_000 + XSS
    results = results.with_columns(
        pl.when(pl.col("id") == "ex1").then(pl.lit(long)).otherwise(pl.col("output"))
        .alias("output"),
        pl.lit(None, pl.Float64).alias("score:f1"))
    summary = summary.with_columns(pl.lit(None, pl.Float64).alias("f1:mean"),
                                   pl.lit(float("nan")).alias("exact_match:mean_ci_low"))
    page = render_report(results, summary, AXES, "one")
    assert_self_contained(page)
    assert page.count("<svg") == expected_chart_count(summary, AXES) == 2 + 2
    assert "no numeric grid axis takes more than one value" in page
    assert "nothing to disagree with" in page
    assert not re.search(r"\bnan\b", page.split("<script>")[0].lower())  # NaN shows as –

    # several cells, the f1 scorer raised everywhere, one very long output in the disagreements
    results, summary = synthetic(temperatures=(0.7,))
    results = results.with_columns(
        pl.when((pl.col("id") == "ex0") & (pl.col("cell") == "c001")).then(pl.lit(long))
        .otherwise(pl.col("output")).alias("output"),
        pl.lit(None, pl.Float64).alias("score:f1"),
        pl.when(pl.col("id") == "ex0").then(pl.col("cell") == "c001").otherwise(True)
        .cast(pl.Float64).alias("score:exact_match"))
    summary = summary.with_columns(pl.lit(None, pl.Float64).alias("f1:mean"),
                                   pl.lit(None, pl.Float64).alias("f1:mean_ci_low"))
    page = render_report(results, summary, AXES, "two")
    assert_self_contained(page)
    assert XSS not in page
    assert "more characters)" in page and len(page) < 40_000
    assert "every cell&#x27;s value is missing" in page
    assert "the scorer raised (or gave no number) for every row" in page
    assert page.count("<code>ex0</code>") == 1


def test_a_hundred_and_twenty_cells_stay_in_scrolling_figures():
    results, summary = synthetic(models=[f"m{i}" for i in range(12)],
                                 temperatures=[round(0.1 * t, 1) for t in range(10)],
                                 examples=3)
    assert summary.height == 120
    page = render_report(results, summary, AXES, "big")
    assert page.count('<figure class="figure tall">') == 2 + 2  # two metrics, two costs
    assert page.count("<svg") == expected_chart_count(summary, AXES)
    assert len(page) < 2_000_000


def test_write_report_reads_the_folder_and_replaces_report_html_atomically(tmp_path):
    results, summary = synthetic()
    results.write_parquet(tmp_path / "results.parquet")
    summary.write_parquet(tmp_path / "summary.parquet")
    (tmp_path / "sweep.json").write_text(json.dumps(
        {"name": "temps", "axes": AXES, "spec": "[grid]\ntemperature = [0.0, 0.7, 1.2]\n"}))
    (tmp_path / "report.html").write_text("old")
    done = CliRunner().invoke(sweep, ["report", str(tmp_path)])
    assert done.exit_code == 0 and done.output.strip() == str(tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "<h1>temps</h1>" in page and "temperature = [0.0, 0.7, 1.2]" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "report.html", "results.parquet", "summary.parquet", "sweep.json"]  # no temp file left
    assert write_report(f"file://{tmp_path}") == f"file://{tmp_path}/report.html"
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "report.html"  # still no temp file
    missing = CliRunner().invoke(sweep, ["report", str(tmp_path / "missing")])
    assert missing.exit_code == 2 and "holds no sweep results" in missing.output
    assert "no results.parquet" in missing.output


def test_write_report_to_an_fsspec_url():
    import fsspec

    results, summary = synthetic(temperatures=(0.0, 1.0))
    fs = fsspec.filesystem("memory")
    for name, frame in (("results", results), ("summary", summary)):
        with fs.open(f"/report-test/{name}.parquet", "wb") as f:
            frame.write_parquet(f)
    # no sweep.json: the axes are the summary's columns that are neither totals nor metrics
    assert write_report("memory://report-test") == "memory://report-test/report.html"
    page = fs.cat_file("/report-test/report.html").decode()
    assert "<h1>report-test</h1>" in page and page.count("<svg") == 2 + 2 + 2
    fs.rm("/report-test", recursive=True)


# ------------------------------------------------------------------------ the browser

def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which(
        "google-chrome")


def browser(*args: str, profile: Path) -> subprocess.CompletedProcess:
    # --headless is the new headless mode in current Chromium (old headless is gone from the
    # browser binary); --no-sandbox because tests run as root; the resolver rule makes any
    # attempt to reach a host fail, so the page renders as it would offline.
    cmd = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
           "--host-resolver-rules=MAP * ~NOTFOUND", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def png_pixels(data: bytes) -> np.ndarray:
    """An 8-bit RGB/RGBA PNG (non-interlaced) as a (height, width, channels) uint8 array:
    zlib and the five PNG filters, no imaging library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            row = line.copy()
        elif kind == 1:    # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.uint64)
            row = (row % 256).astype(np.uint8).reshape(stride)
        elif kind == 2:    # Up
            row = line + prev
        elif kind == 3:    # Average: sequential
            row = bytearray(stride)
            f, b = line.tolist(), prev.tolist()
            for i in range(stride):
                a = row[i - bpp] if i >= bpp else 0
                row[i] = (f[i] + ((a + b[i]) >> 1)) & 255
            row = np.frombuffer(bytes(row), np.uint8)
        elif kind == 4:
            row = unpaeth(line, prev, width, bpp)
        else:
            raise AssertionError(f"PNG filter type {kind}")
        out[y] = row
        prev = row
    return out.reshape(height, width, bpp)


def unpaeth(line: np.ndarray, prev: np.ndarray, width: int, bpp: int) -> np.ndarray:
    """Undo the Paeth filter of one row. Where the row above is flat (a pixel equals its left
    neighbour) the predictor is the left pixel, so those runs are a running sum (vectorised);
    the other pixels are done one by one."""
    f = line.reshape(width, bpp).astype(np.int64)
    b = prev.reshape(width, bpp).astype(np.int64)
    flat = np.zeros(width, bool)
    flat[1:] = (b[1:] == b[:-1]).all(axis=1)
    out = np.zeros((width, bpp), np.int64)
    starts = np.flatnonzero(~flat)
    ends = np.append(starts[1:], width)
    for s, end in zip(starts.tolist(), ends.tolist()):
        if s == 0:
            out[0] = (f[0] + b[0]) % 256        # no left pixel: Paeth picks the one above
        else:
            a, up, c = out[s - 1], b[s], b[s - 1]
            p = a + up - c
            pa, pb, pc = np.abs(p - a), np.abs(p - up), np.abs(p - c)
            pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, up, c))
            out[s] = (f[s] + pred) % 256
        if end > s + 1:
            out[s + 1:end] = (out[s] + np.cumsum(f[s + 1:end], axis=0)) % 256
    return out.astype(np.uint8).reshape(width * bpp)


class DomShapes(html.parser.HTMLParser):
    """The rendered DOM's summary rows and, per <svg>, how many shapes it draws."""

    SHAPES = {"rect", "circle", "path", "line", "polyline", "polygon"}

    def __init__(self):
        super().__init__()
        self.svgs: list[int] = []
        self.in_svg = False
        self.summary_rows = 0
        self.tables: list[str] = []
        self.scripts = 0
        self.boxes: list[tuple[int, int, int, int]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append(attrs.get("id", ""))
        elif tag == "tr" and self.tables and self.tables[-1] == "summary":
            self.summary_rows += 1
        elif tag == "svg":
            self.in_svg = True
            self.svgs.append(0)
            if attrs.get("data-box"):
                self.boxes.append(tuple(int(v) for v in attrs["data-box"].split(",")))
        elif tag in self.SHAPES and self.in_svg:
            self.svgs[-1] += 1
        elif tag == "script":
            self.scripts += 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self.in_svg = False
        elif tag == "table" and self.tables:
            self.tables.pop()


# Test-only: after layout, write each chart's box (page px) onto its <svg> for --dump-dom to show.
MEASURE = """<script>document.querySelectorAll('svg').forEach(function (s) {
  var r = s.getBoundingClientRect();
  s.setAttribute('data-box', [r.left + scrollX, r.top + scrollY, r.width, r.height]
    .map(Math.round).join(','));
});</script>"""
WINDOW = (1280, 4000)


def test_chromium_renders_the_report_table_charts_and_pixels(tmp_path):
    if chromium() is None:
        pytest.skip("no chromium/chromium-browser/google-chrome on PATH (make install-test "
                    "installs Debian's chromium where apt-get is available)")
    results, summary = synthetic()
    page = render_report(results, summary, AXES, "browser check")
    report = tmp_path / "report.html"
    report.write_text(page)
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", MEASURE + "</body>"))
    window = f"--window-size={WINDOW[0]},{WINDOW[1]}"

    dom = browser("--dump-dom", window, measured.as_uri(), profile=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    shapes = DomShapes()
    shapes.feed(dom.stdout)
    assert shapes.summary_rows == summary.height + 1
    assert len(shapes.svgs) == expected_chart_count(summary, AXES)
    assert all(n >= 3 for n in shapes.svgs), shapes.svgs
    # The page's sorting script and the measuring one: the output holding <script> stayed text.
    assert shapes.scripts == 2
    assert len(shapes.boxes) == len(shapes.svgs), "the measuring script did not run"

    png = tmp_path / "report.png"
    shot = browser(f"--screenshot={png}", window, report.as_uri(),
                   profile=tmp_path / "profile-png")
    assert shot.returncode == 0 and png.exists(), shot.stderr[-3000:]
    pixels = png_pixels(png.read_bytes())[..., :3]
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    ink = (pixels < 235).any(axis=2)
    assert ink.mean() > 0.01, f"only {ink.mean():.4f} of the page is not white"
    assert len({tuple(c) for c in pixels[ink][::7].tolist()}) > 50

    # Each chart, where the browser laid it out: painted, with more than one colour, and the
    # chart colours among them (the data marks are the palette's first two colours here).
    for i, (left, top, width, height) in enumerate(shapes.boxes):
        assert width > 100 and height > 40, (i, shapes.boxes[i])
        assert top + height <= WINDOW[1], f"chart {i} at {top}px is below the screenshot"
        region = pixels[top:top + height, left:left + width].reshape(-1, 3).astype(int)
        inked = (region < 235).any(axis=1)
        assert inked.mean() > 0.03, (i, inked.mean())
        colours = {tuple(c) for c in region[inked][::3].tolist()}
        assert len(colours) >= 8, (i, len(colours))
        near_palette = sum(int((np.abs(region - rgb(c)).max(axis=1) <= 40).sum())
                           for c in ("#4e79a7", "#f28e2b"))
        assert near_palette > 30, (i, near_palette)


# Test-only: click a summary header (twice: descending), then note the cells' order.
SORT = """<script>var th = Array.prototype.find.call(document.querySelectorAll('#summary th'),
  function (h) { return h.textContent === '%s'; });
th.click(); %s
document.body.setAttribute('data-order', Array.prototype.map.call(
  document.querySelector('#summary').tBodies[0].rows,
  function (r) { return r.cells[0].textContent; }).join(','));</script>"""


@pytest.mark.parametrize("header,column,clicks", [("exact_match mean", "exact_match:mean", 1),
                                                  ("f1 mean", "f1:mean", 2),
                                                  ("temperature", "temperature", 1)])
def test_chromium_sorts_the_summary_table_by_a_clicked_header(tmp_path, header, column, clicks):
    if chromium() is None:
        pytest.skip("no chromium/chromium-browser/google-chrome on PATH")
    results, summary = synthetic()
    page = render_report(results, summary, AXES, "sorting")
    clicked = tmp_path / "clicked.html"
    clicked.write_text(page.replace("</body>", SORT % (header, "th.click();" * (clicks - 1))
                                    + "</body>"))
    dom = browser("--dump-dom", clicked.as_uri(), profile=tmp_path / "profile")
    order = re.search(r'<body data-order="([^"]*)"', dom.stdout)
    assert order, dom.stdout[-2000:]
    expected = summary.sort(column, descending=clicks == 2, maintain_order=True)["cell"]
    assert order.group(1).split(",") == expected.to_list()


def rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
