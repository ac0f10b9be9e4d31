"""Inline SVG charts for the HTML report: line charts and stacked bars, no JavaScript.

Each function returns one ``<figure>``: an ``<svg>`` sized in CSS pixels, with a
``<title>`` on every line, point and bar segment so a browser shows the value on hover,
and the legend under it as HTML. The browser lays the legend's labels out by their real
width and wraps them, so they cannot overlap whatever their length or font.

Example:
    >>> fig = line_chart("loss", [Series("train", [(1, 2.0), (2, 1.5), (3, 1.2)])],
    ...                  x_label="step", y_label="loss")
    >>> fig.startswith('<figure class="chart"><svg') and "polyline" in fig
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

# Tableau 10: distinct on white and for the common kinds of colour blindness.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
WIDTH, HEIGHT = 1080, 280
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 45
MAX_POINTS = 800  # a series longer than this is averaged into this many buckets


@dataclass
class Series:
    """One line of a chart: a name and its (x, y) points; ``dots`` draws points only."""

    name: str
    points: list[tuple[float, float]] = field(default_factory=list)
    dots: bool = False
    dashed: bool = False


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering ``lo``..``hi``.

    Example:
        >>> nice_ticks(0, 87)
        [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]
    """
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t < hi + step * 0.999:
        ticks.append(float(round(t, 10)))
        t += step
    return ticks


def downsample(points: Sequence[tuple[float, float]], limit: int = MAX_POINTS,
               ) -> list[tuple[float, float]]:
    """At most ``limit`` points: consecutive points averaged in equal-sized buckets."""
    if len(points) <= limit:
        return list(points)
    size = len(points) / limit
    out = []
    for b in range(limit):
        chunk = points[int(b * size):int((b + 1) * size)] or [points[int(b * size)]]
        out.append((sum(p[0] for p in chunk) / len(chunk), sum(p[1] for p in chunk) / len(chunk)))
    return out


def _fmt(v: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-2):
        return f"{v:.3g}"
    return f"{v:.6g}" if float(v).is_integer() else f"{v:.4g}"


def line_chart(title: str, series: Sequence[Series], x_label: str, y_label: str,
               y_min: float | None = 0.0, y_max: float | None = None) -> str:
    """A line chart with axes, ticks, a legend and a tooltip per line and point.

    Args:
        title: shown above the plot.
        series: the lines; empty ones are skipped.
        x_label, y_label: axis names (with units).
        y_min, y_max: fixed ends of the y axis; None fits the data.
    """
    series = [Series(s.name, downsample(s.points), s.dots, s.dashed)
              for s in series if s.points]
    if not series:
        return f'<p class="note">{escape(title)}: no data.</p>'
    xs = [p[0] for s in series for p in s.points]
    ys = [p[1] for s in series for p in s.points]
    lo_y = min(ys) if y_min is None else min(y_min, *ys)
    hi_y = max(ys) if y_max is None else max(y_max, *ys)
    yt = nice_ticks(lo_y, hi_y)
    xt = nice_ticks(min(xs), max(xs), 8)
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    out = [_open(title)]
    for t in yt:
        out.append(f'<line class="grid" x1="{LEFT}" x2="{LEFT + pw}" y1="{sy(t):.1f}" '
                   f'y2="{sy(t):.1f}"/><text class="tick" x="{LEFT - 6}" y="{sy(t) + 4:.1f}" '
                   f'text-anchor="end">{_fmt(t)}</text>')
    for t in xt:
        out.append(f'<text class="tick" x="{sx(t):.1f}" y="{TOP + ph + 16}" '
                   f'text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}"/>')
    out.append(f'<text class="axis" x="{LEFT + pw / 2}" y="{HEIGHT - 6}" '
               f'text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text class="axis" transform="translate(14 {TOP + ph / 2}) rotate(-90)" '
               f'text-anchor="middle">{escape(y_label)}</text>')
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        name = escape(s.name)
        if not s.dots and len(s.points) > 1:
            coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
            dash = ' stroke-dasharray="6 4"' if s.dashed else ""
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8"{dash} '
                       f'points="{coords}"><title>{name}</title></polyline>')
        if s.dots or len(s.points) == 1 or len(s.points) <= 60:
            r = 3.5 if s.dots or len(s.points) == 1 else 2.0
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{r}" fill="{color}">'
                       f'<title>{name}: {_fmt(y)} at {_fmt(x)}</title></circle>'
                       for x, y in s.points)
    out.append("</svg>")
    out.append(_legend([s.name for s in series], [s.dashed for s in series]))
    return "\n".join(out)


def stacked_bars(title: str, rows: Sequence[tuple[str, dict[str, float]]],
                 parts: Sequence[str], unit: str, measured: Sequence[float] = (),
                 notes: Sequence[str] = ()) -> str:
    """Horizontal bars, one per row, each split into ``parts`` (in that order).

    Args:
        title: shown above the bars.
        rows: (label, {part: value}); a missing part counts as 0.
        parts: the segment names, in drawing order (they get the palette's colours).
        unit: the values' unit, for the axis and the tooltips (e.g. "ms").
        measured: per row, a value measured apart from the parts (the step clock),
            drawn as a black tick across the bar.
        notes: per row, the text after the bar (default: the parts' total).
    """
    bar_h, gap = 22, 8
    height = TOP + BOTTOM + len(rows) * (bar_h + gap)
    totals = [sum(v.get(p, 0.0) for p in parts) for _, v in rows]
    longest = max([*totals, *measured], default=0.0)
    xt = nice_ticks(0.0, longest if longest > 0 else 1.0, 8)
    pw = WIDTH - LEFT - RIGHT - 40 - (260 if notes else 0)

    def sx(x: float) -> float:
        return LEFT + 40 + x / xt[-1] * pw

    out = [_open(title, height)]
    for t in xt:
        out.append(f'<line class="grid" x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{TOP}" '
                   f'y2="{height - BOTTOM}"/><text class="tick" x="{sx(t):.1f}" '
                   f'y="{height - BOTTOM + 16}" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<text class="axis" x="{LEFT + 40 + pw / 2}" y="{height - 6}" '
               f'text-anchor="middle">{escape(unit)} per step</text>')
    for i, ((label, values), total) in enumerate(zip(rows, totals)):
        y = TOP + i * (bar_h + gap)
        out.append(f'<text class="tick" x="{LEFT + 34}" y="{y + bar_h / 2 + 4}" '
                   f'text-anchor="end">{escape(label)}</text>')
        x = 0.0
        for j, part in enumerate(parts):
            v = values.get(part, 0.0)
            if v <= 0:
                continue
            share = v / total if total else 0.0
            out.append(f'<rect x="{sx(x):.1f}" y="{y}" width="{sx(x + v) - sx(x):.1f}" '
                       f'height="{bar_h}" fill="{PALETTE[j % len(PALETTE)]}"><title>'
                       f'{escape(label)} {escape(part)}: {_fmt(v)} {escape(unit)} '
                       f'({share:.0%})</title></rect>')
            x += v
        end = total
        if i < len(measured):
            end = max(total, measured[i])
            out.append(f'<line class="measured" x1="{sx(measured[i]):.1f}" '
                       f'x2="{sx(measured[i]):.1f}" y1="{y - 3}" y2="{y + bar_h + 3}" '
                       f'stroke="#000" stroke-width="2"><title>{escape(label)} measured: '
                       f'{_fmt(measured[i])} {escape(unit)}</title></line>')
        note = notes[i] if i < len(notes) else _fmt(total)
        out.append(f'<text class="tick" x="{sx(end) + 6:.1f}" y="{y + bar_h / 2 + 4}">'
                   f'{escape(note)}</text>')
    out.append("</svg>")
    out.append(_legend(list(parts)))
    return "\n".join(out)


def _open(title: str, height: int = HEIGHT) -> str:
    return (f'<figure class="chart"><svg class="chart" viewBox="0 0 {WIDTH} {height}" '
            f'width="{WIDTH}" height="{height}" role="img" aria-label="{escape(title)}">'
            f'<text class="title" x="{LEFT}" y="22">{escape(title)}</text>')


def _legend(names: Sequence[str], dashed: Sequence[bool] = ()) -> str:
    """Colour keys in the order of the series, as HTML that wraps (closes the figure).

    Example:
        >>> _legend(["train"])
        '<figcaption class="legend"><span class="key"><i style="border-color:#4e79a7">\
</i>train</span></figcaption></figure>'
    """
    keys = []
    for i, name in enumerate(names):
        cls = ' class="dashed"' if i < len(dashed) and dashed[i] else ""
        keys.append(f'<span class="key"><i{cls} style="border-color:'
                    f'{PALETTE[i % len(PALETTE)]}"></i>{escape(name)}</span>')
    return f'<figcaption class="legend">{"".join(keys)}</figcaption></figure>'
