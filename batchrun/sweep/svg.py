"""Charts as inline SVG for the sweep's report: bar charts with error bars, line charts,
legends, scales; with the few formatting helpers they share with the page. No scripts: a chart
is complete as drawn."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

LABEL_CHARS = 46            # a cell's label beside its bar, before an ellipsis (full in <title>)
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
DASHES = ("", "6 3", "2 3", "8 3 2 3")


def finite(value: Any) -> float | None:
    """A plotted number: None for null, NaN and ±inf (and anything not a number)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt_metric(value: Any) -> str:
    number = finite(value)
    if number is None:
        return "–"
    return f"{number:.3f}" if abs(number) < 1000 else f"{number:,.0f}"


def e(value: Any) -> str:
    """Escaped for HTML text and attribute values alike."""
    return html.escape(str(value), quote=True)



def nice_scale(lo: float, hi: float, count: int = 5) -> tuple[float, float, list[float]]:
    """A domain rounded out to round ticks, and those ticks."""
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(power * m for m in (1, 2, 2.5, 5, 10) if power * m >= raw)
    start, stop = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    ticks = [round(start + i * step, 12) for i in range(int(round((stop - start) / step)) + 1)]
    return start, stop, ticks


def value_domain(values: Iterable[float | None]) -> tuple[float, float, list[float]]:
    """Scores: from 0 (or below, for negative scores) to the largest; [0, 1] for rates."""
    numbers = [v for v in values if v is not None]
    if not numbers:
        return 0.0, 1.0, [0.0, 0.25, 0.5, 0.75, 1.0]
    lo, hi = min(0.0, min(numbers)), max(numbers)
    if lo >= 0 and hi <= 1:
        return 0.0, 1.0, [0.0, 0.25, 0.5, 0.75, 1.0]
    return nice_scale(lo, max(hi, lo + 1e-9))


def fmt_tick(value: float) -> str:
    if abs(value) >= 10000:
        return f"{value:,.0f}"
    return f"{value:g}"


def clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 1] + "…"


def svg_open(width: float, height: float, label: str) -> str:
    # No xmlns: inline SVG in HTML needs none (and the page names no URL at all).
    return (f'<svg class="chart" width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
            f'aria-label="{e(label)}">')


def empty_chart(label: str, message: str, width: int = 640) -> str:
    return (svg_open(width, 60, label)
            + f'<rect x="0.5" y="0.5" width="{width - 1}" height="59" fill="#fafafa" '
            f'stroke="#ddd"/><text x="{width / 2:.0f}" y="35" text-anchor="middle" '
            f'class="muted">{e(message)}</text></svg>')


@dataclass
class Bar:
    key: str            # the cell
    label: str          # what the row says (clipped), full in its <title>
    title: str
    value: float | None
    low: float | None = None
    high: float | None = None
    color: str = PALETTE[0]


CHAR_W = 6.4  # px per character of the 11px chart font, near enough to size the label columns


def bar_chart(bars: list[Bar], label: str, value_fmt=fmt_metric, domain=None,
              plot_w: int = 300, row: int = 18, points: bool = True) -> str:
    """Horizontal bars, one row per cell, each with its interval as an error bar (and a point
    at the value when `points`).

    Rows stack downwards, so 100+ cells stay legible (the figure scrolls); the label column
    is as wide as the longest label and the value is printed at the right of each row."""
    if not bars:
        return empty_chart(label, "no cells")
    if all(b.value is None for b in bars):
        return empty_chart(label, "no values: every cell's value is missing")
    top, axis_h = 8, 26
    label_width = int(min(LABEL_CHARS, max(len(b.label) for b in bars)) * CHAR_W) + 14
    value_w = int(max(len(value_fmt(b.value)) for b in bars) * CHAR_W) + 14
    plot_x = label_width
    width = label_width + plot_w + value_w
    height = top + row * len(bars) + axis_h
    if domain is None:
        domain = value_domain([v for b in bars for v in (b.value, b.low, b.high)])
    lo, hi, ticks = domain

    def x(v: float) -> float:
        return plot_x + (min(max(v, lo), hi) - lo) / (hi - lo) * plot_w

    out = [svg_open(width, height, label)]
    bottom = top + row * len(bars)
    for t in ticks:
        out.append(f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{bottom}" '
                   f'class="grid"/><text x="{x(t):.1f}" y="{bottom + 15}" '
                   f'text-anchor="middle" class="tick">{e(fmt_tick(t))}</text>')
    zero = x(0.0 if lo <= 0 <= hi else lo)
    for i, bar in enumerate(bars):
        y = top + i * row
        mid = y + row / 2
        out.append(f'<g><title>{e(bar.title)}</title>')
        if i % 2:
            out.append(f'<rect x="0" y="{y}" width="{width}" height="{row}" fill="#f6f7f9"/>')
        out.append(f'<text x="{plot_x - 6}" y="{mid + 4:.1f}" text-anchor="end" '
                   f'class="label">{e(bar.label)}</text>')
        if bar.value is None:
            out.append(f'<text x="{plot_x + 4}" y="{mid + 4:.1f}" class="muted">no value</text>')
        else:
            x0, x1 = sorted((zero, x(bar.value)))
            out.append(f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1):.1f}" '
                       f'height="{row - 6}" fill="{bar.color}" fill-opacity="0.55"/>')
            if bar.low is not None and bar.high is not None:
                a, b = x(bar.low), x(bar.high)
                out.append(f'<path d="M{a:.1f} {mid - 4:.1f}V{mid + 4:.1f}M{a:.1f} {mid:.1f}'
                           f'H{b:.1f}M{b:.1f} {mid - 4:.1f}V{mid + 4:.1f}" class="err"/>')
            if points:
                out.append(f'<circle cx="{x(bar.value):.1f}" cy="{mid:.1f}" r="3.2" '
                           f'fill="{bar.color}" stroke="#222" stroke-width="0.6"/>')
            out.append(f'<text x="{width - 4}" y="{mid + 4:.1f}" text-anchor="end" '
                       f'class="value">{e(value_fmt(bar.value))}</text>')
        out.append("</g>")
    out.append(f'<line x1="{plot_x}" y1="{bottom}" x2="{plot_x + plot_w}" y2="{bottom}" '
               f'class="axis"/></svg>')
    return "".join(out)


@dataclass
class Point:
    x: float
    y: float | None
    low: float | None
    high: float | None
    title: str


def line_chart(series: dict[str, list[Point]], colors: dict[str, tuple[str, str]],
               x_label: str, y_label: str, width: int = 580, height: int = 300) -> str:
    """Points joined by lines, one series per combination of the other settings, with each
    point's interval as a vertical error bar. Series at one x are nudged apart a little so
    their bars do not cover each other."""
    label = f"{y_label} against {x_label}"
    points = [p for ps in series.values() for p in ps]
    if not any(p.y is not None for p in points):
        return empty_chart(label, "no values: every cell's score is missing", width)
    left, right, top, bottom = 56, 18, 14, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = sorted({p.x for p in points})
    if len(xs) <= 10:
        x_lo, x_hi, x_ticks = xs[0], xs[-1], xs
    else:
        x_lo, x_hi, x_ticks = nice_scale(xs[0], xs[-1])
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi, y_ticks = value_domain(v for p in points for v in (p.y, p.low, p.high))
    inset = 14  # keeps the outermost points off the frame

    def px(v: float) -> float:
        return left + inset + (v - x_lo) / (x_hi - x_lo) * (plot_w - 2 * inset)

    def py(v: float) -> float:
        v = min(max(v, y_lo), y_hi)
        return top + plot_h - (v - y_lo) / (y_hi - y_lo) * plot_h

    out = [svg_open(width, height, label)]
    for t in y_ticks:
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + plot_w}" y2="{py(t):.1f}" '
                   f'class="grid"/><text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end" '
                   f'class="tick">{e(fmt_tick(t))}</text>')
    for t in x_ticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{top + plot_h}" x2="{px(t):.1f}" '
                   f'y2="{top + plot_h + 4}" class="axis"/><text x="{px(t):.1f}" '
                   f'y="{top + plot_h + 17}" text-anchor="middle" class="tick">'
                   f'{e(fmt_tick(t))}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" '
               f'class="axis"/>')
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{height - 8}" text-anchor="middle" '
               f'class="axis-label">{e(x_label)}</text>')
    out.append(f'<text transform="translate(14 {top + plot_h / 2:.0f}) rotate(-90)" '
               f'text-anchor="middle" class="axis-label">{e(y_label)}</text>')
    count = len(series)
    spread = min(3.0, 24.0 / max(count, 1))
    for i, (name, pts) in enumerate(series.items()):
        color, dash = colors[name]
        nudge = (i - (count - 1) / 2) * spread
        drawn = sorted(((p, p.y) for p in pts if p.y is not None), key=lambda item: item[0].x)
        out.append(f'<g><title>{e(name)}</title>')
        if len(drawn) > 1:
            d = "".join(f"{'M' if j == 0 else 'L'}{px(p.x) + nudge:.1f} {py(y):.1f}"
                        for j, (p, y) in enumerate(drawn))
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.8"'
                       f'{dash_attr}/>')
        for p, y in drawn:
            cx = px(p.x) + nudge
            if p.low is not None and p.high is not None:
                out.append(f'<line x1="{cx:.1f}" y1="{py(p.low):.1f}" x2="{cx:.1f}" '
                           f'y2="{py(p.high):.1f}" stroke="{color}" stroke-width="1.2"/>')
            out.append(f'<circle cx="{cx:.1f}" cy="{py(y):.1f}" r="3.5" fill="{color}">'
                       f'<title>{e(p.title)}</title></circle>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def series_style(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """A colour and a dash pattern per series: ten colours, then the same with dashes."""
    return {n: (PALETTE[i % len(PALETTE)], DASHES[(i // len(PALETTE)) % len(DASHES)])
            for i, n in enumerate(names)}


def legend(colors: dict[str, tuple[str, str]]) -> str:
    if len(colors) <= 1 and "" in colors:
        return ""
    items = "".join(
        f'<span class="key"><span class="swatch{" dashed" if dash else ""}" '
        f'style="border-color:{color}"></span>{e(name)}</span>'
        for name, (color, dash) in colors.items())
    return f'<div class="legend">{items}</div>'
