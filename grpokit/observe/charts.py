"""The report's charts: inline SVG line charts of (step, value) series, drawn here without any library.

    svg_line_chart({"reward": [(1, 0.2), (2, None), (3, 0.5)]}, lines=[(0.5, "goal")], marks=[(3, "KL spike")])

A None value breaks the line (a gap); a series longer than MAX_POINTS keeps each bucket's min and max, so a
one-step spike stays visible. Every text from the run (metric names, labels) is escaped (`esc`). The page around
the charts is grpokit.observe.report's.
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

MAX_POINTS = 2000  # per series; longer series keep each bucket's min and max, so spikes survive
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
Points = list[tuple[float, float | None]]  # (step, value); None breaks the line (a None/NaN/inf value)


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def decimate(points: Points, limit: int = MAX_POINTS) -> Points:
    """At most ~limit points: each bucket keeps its first gap, its min and its max, in step order."""
    if len(points) <= limit:
        return points
    size = math.ceil(len(points) / (limit // 2))
    out: Points = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        finite = [p for p in bucket if p[1] is not None]
        keep = {min(finite, key=lambda p: p[1]), max(finite, key=lambda p: p[1])} if finite else set()
        if len(finite) < len(bucket):
            keep.add(next(p for p in bucket if p[1] is None))
        out += sorted(keep, key=lambda p: (p[0], p[1] is not None))
    return out


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    raw = (high - low) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def padded_range(values: list[float]) -> tuple[float, float]:
    """[low, high] with a 5% margin that does not cross 0 for data that does not (a constant gets a band)."""
    low, high = min(values), max(values)
    if high - low < 1e-12 * max(1.0, abs(high)):
        pad = max(abs(high) * 0.1, 1e-3)
        return (low - pad if low < 0 else max(0.0, low - pad)), high + pad
    pad = (high - low) * 0.05
    return (low - pad if low < 0 else max(0.0, low - pad)), high + pad


def svg_line_chart(series: dict[str, Points], *, width: int = 560, height: int = 230,
                   lines: Sequence[tuple[float, str]] = (), marks: Sequence[tuple[int, str]] = (),
                   metric: str = "") -> str:
    """An inline SVG line chart of (x, y) series (None y: a gap), with y guide lines and vertical x marks."""
    left, right, top, bottom = 62, 12, 10, 28
    series = {k: decimate(v) for k, v in series.items()}
    xs = [x for v in series.values() for x, y in v if y is not None] + [float(s) for s, _ in marks]
    ys = [y for v in series.values() for _, y in v if y is not None] + [y for y, _ in lines]
    x0, x1 = (min(xs), max(xs)) if min(xs) < max(xs) else (min(xs) - 1, max(xs) + 1)
    y0, y1 = padded_range(ys)

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * (height - top - bottom)

    parts = [f"<svg class=\"chart\" viewBox=\"0 0 {width} {height}\" width=\"{width}\" height=\"{height}\" "
             f"role=\"img\" data-metric=\"{esc(metric)}\">",
             f"<rect x=\"{left}\" y=\"{top}\" width=\"{width - left - right}\" height=\"{height - top - bottom}\" "
             "fill=\"#fcfcfc\" stroke=\"#ccc\"/>"]
    for y in nice_ticks(y0, y1):
        parts.append(f"<line x1=\"{left}\" x2=\"{width - right}\" y1=\"{py(y):.1f}\" y2=\"{py(y):.1f}\" "
                     f"stroke=\"#eee\"/><text x=\"{left - 6}\" y=\"{py(y) + 4:.1f}\" text-anchor=\"end\">"
                     f"{tick_label(y)}</text>")
    for x in nice_ticks(x0, x1, 6):
        parts.append(f"<text x=\"{px(x):.1f}\" y=\"{height - 10}\" text-anchor=\"middle\">{tick_label(x)}</text>")
    parts.append(f"<text x=\"{width - right}\" y=\"{height - 1}\" text-anchor=\"end\">step</text>")
    for y, label in lines:
        parts.append(f"<line class=\"guide\" x1=\"{left}\" x2=\"{width - right}\" y1=\"{py(y):.1f}\" "
                     f"y2=\"{py(y):.1f}\" stroke=\"#d62728\" stroke-dasharray=\"2 3\"><title>{esc(label)}</title>"
                     "</line>")
    for step, label in marks:
        parts.append(f"<line class=\"alarm-mark\" x1=\"{px(step):.1f}\" x2=\"{px(step):.1f}\" y1=\"{top}\" "
                     f"y2=\"{height - bottom}\" stroke=\"#d62728\" stroke-dasharray=\"5 3\">"
                     f"<title>{esc(label)} at step {esc(step)}</title></line>")
    for i, (key, points) in enumerate(series.items()):
        parts.append(series_svg(key, points, COLORS[i % len(COLORS)], px, py))
    parts.append("</svg>")
    return "".join(parts)


def tick_label(value: float) -> str:
    return f"{0.0 if abs(value) < 1e-12 else value:.4g}"


def series_svg(key: str, points: Points, color: str, px, py) -> str:
    """One series: a path whose pieces break at gaps, and dots when there are few points."""
    commands, pen_down = [], False
    for x, y in points:
        if y is None:
            pen_down = False
            continue
        commands.append(f"{'L' if pen_down else 'M'}{px(x):.1f},{py(y):.1f}")
        pen_down = True
    finite = [(x, y) for x, y in points if y is not None]
    dots = "".join(f"<circle cx=\"{px(x):.1f}\" cy=\"{py(y):.1f}\" r=\"2.5\" fill=\"{color}\"/>"
                   for x, y in finite) if len(finite) <= 60 else ""
    return (f"<g class=\"series\" data-series=\"{esc(key)}\"><title>{esc(key)}</title>"
            f"<path d=\"{' '.join(commands)}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"1.6\"/>{dots}</g>")
