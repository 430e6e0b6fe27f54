"""Inline SVG charts: pure functions from data to SVG text (line plots, horizontal bars, a confusion matrix).

Every text drawn (series names, bar labels, class names, axis labels) is HTML-escaped; the
numbers are formatted here. Each chart is one ``<svg class="plot">`` element with the ``id`` it
is given, which the page's tests and script select it by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vision_attn.report.markup import esc, fmt, tick

__all__ = ["COLOURS", "bars_svg", "confusion_svg", "line_svg"]

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]

# One horizontal bar: (label, value, background value, note); values in [0, 1], None or -1 for none.
BarRow = tuple[str, float | None, float | None, str]


def _svg_open(svg_id: str, width: float, height: float) -> str:
    """The opening ``<svg>`` tag of a plot (its ``id`` left out when empty)."""
    ident = f'id="{esc(svg_id)}" ' if svg_id else ""
    return f'<svg {ident}class="plot" width="{width}" height="{height}" role="img" viewBox="0 0 {width} {height}">'


def line_svg(svg_id: str, series: dict[str, Sequence[Sequence[float]]], xlabel: str, ylabel: str = "",
             width: int = 380, height: int = 210, y_range: tuple[float, float] | None = None,
             legend: str = "top-right") -> str:
    """Inline SVG line plot of ``{name: [[x, y], ...]}``: axes with their ranges, a legend
    (``top-right``, ``bottom-right`` or ``bottom-left`` inside the plot: where the curves leave
    room), a dot per point when a series has few points (one point still shows). Non-finite
    points are left out; ``""`` when no point is left."""
    left, right, top, bottom = 54, 8, 8, 34
    pw, ph = width - left - right, height - top - bottom
    series = {name: [(float(x), float(y)) for x, y in points if math.isfinite(float(x)) and math.isfinite(float(y))]
              for name, points in series.items()}
    pts = [p for s in series.values() for p in s]
    if not pts:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = y_range if y_range else (min(ys), max(ys))
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 0.5), y1 + (abs(y1) * 0.1 or 0.5)

    def sx(x: float) -> float:
        return left + pw * (x - x0) / (x1 - x0)

    def sy(y: float) -> float:
        return top + ph * (1 - (y - y0) / (y1 - y0))

    parts = [_svg_open(svg_id, width, height),
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>']
    for v in (y0, y1):
        parts.append(f'<text x="{left - 4}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="end">{tick(v)}</text>')
    for v, anchor in ((x0, "start"), (x1, "end")):
        parts.append(f'<text x="{sx(v):.1f}" y="{top + ph + 12}" font-size="10" text-anchor="{anchor}">'
                     f'{tick(v)}</text>')
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{height - 6}" font-size="11" text-anchor="middle">'
                 f'{esc(xlabel)}</text>')
    if ylabel:
        parts.append(f'<text x="10" y="{top + ph / 2:.1f}" font-size="11" text-anchor="middle" '
                     f'transform="rotate(-90 10 {top + ph / 2:.1f})">{esc(ylabel)}</text>')
    for i, (name, points) in enumerate(series.items()):
        c = COLOURS[i % len(COLOURS)]
        coords = [(sx(x), sy(min(max(y, y0), y1))) for x, y in points]
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        if len(coords) <= 30:
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{c}"/>' for x, y in coords]
        if legend.startswith("bottom"):
            y = top + ph - 6 - 13 * (len(series) - 1 - i)
            x, anchor = (left + 6, "start") if legend == "bottom-left" else (left + pw - 4, "end")
        else:
            x, y, anchor = left + pw - 4, top + 14 + 13 * i, "end"
        parts.append(f'<text x="{x}" y="{y}" fill="{c}" font-size="11" text-anchor="{anchor}">{esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def bars_svg(svg_id: str, rows: Sequence[BarRow], width: int = 520, value_label: str = "AP",
             back_label: str = "AP@0.5") -> str:
    """Horizontal bars in [0, 1]: per row ``(name, value, background value, note)``; the
    background bar (lighter) is drawn behind; ``None`` / -1 show as "no ground truth". The
    legend names both bars when ``back_label`` is given."""
    label_w, bar_h, gap, top = 150, 16, 4, 22
    pw = width - label_w - 130
    height = top + len(rows) * (bar_h + gap) + 8
    parts = [_svg_open(svg_id, width, height)]
    if back_label:  # the legend: only needed when there are two bars per row
        parts.append(f'<rect x="{label_w}" y="4" width="12" height="10" fill="#9ecae1"/><text x="{label_w + 16}" '
                     f'y="13" font-size="11">{esc(back_label)}</text><rect x="{label_w + 90}" y="4" width="12" '
                     f'height="10" fill="#1f77b4"/><text x="{label_w + 106}" y="13" font-size="11">'
                     f'{esc(value_label)}</text>')
    for i, (name, value, back, note) in enumerate(rows):
        y = top + i * (bar_h + gap)
        parts.append(f'<g><title>{esc(name)}</title><text x="{label_w - 6}" y="{y + bar_h - 4}" font-size="11" '
                     f'text-anchor="end">{esc(name[:24])}</text></g>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{pw}" height="{bar_h}" fill="#f3f3f3"/>')
        known = [v for v in (back, value) if v is not None and v >= 0]
        if back is not None and back >= 0:
            parts.append(f'<rect class="bar" x="{label_w}" y="{y}" width="{pw * min(back, 1.0):.1f}" '
                         f'height="{bar_h}" fill="#9ecae1"/>')
        if value is not None and value >= 0:
            parts.append(f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{pw * min(value, 1.0):.1f}" '
                         f'height="{bar_h - 6}" fill="#1f77b4"/>')
        text = f"{fmt(value, 3)} {note}" if known else f"no ground truth {note}"
        parts.append(f'<text x="{label_w + pw + 4}" y="{y + bar_h - 4}" font-size="10">{esc(text.strip())}</text>')
    parts.append("</svg>")
    return "".join(parts)


def confusion_svg(labels: Sequence[str], counts: Sequence[Sequence[int]], svg_id: str = "confusion") -> str:
    """A confusion matrix (rows: truth, columns: predicted): row-normalised colour (blue on the
    diagonal, red off it), the count in each cell when cells are large enough to read, the class
    names along both axes. Each cell is a ``rect.cell`` with ``data-t`` / ``data-p`` (row, column)
    for the page's script."""
    n = len(labels)
    cell = max(6, min(34, 480 // max(n, 1)))
    show_text = cell >= 12
    margin = min(130, 7 * max((len(x) for x in labels), default=1) + 10) if show_text else 10
    size = margin + n * cell + 4
    parts = [_svg_open(svg_id, size, size)]
    for t in range(n):
        total = sum(counts[t]) or 1
        for p in range(n):
            share, c = counts[t][p] / total, counts[t][p]
            colour = f"rgba(31,119,180,{share:.3f})" if t == p else f"rgba(214,39,40,{share:.3f})"
            parts.append(f'<rect class="cell" data-t="{t}" data-p="{p}" x="{margin + p * cell}" '
                         f'y="{margin + t * cell}" width="{cell - 1}" height="{cell - 1}" fill="{colour}" '
                         f'stroke="#ddd"><title>{esc(labels[t])} → {esc(labels[p])}: {c}</title></rect>')
            if show_text and c:
                parts.append(f'<text x="{margin + p * cell + cell / 2:.1f}" y="{margin + t * cell + cell / 2 + 4:.1f}" '
                             f'font-size="10" text-anchor="middle" pointer-events="none">{c}</text>')
        if show_text:
            y = margin + t * cell + cell / 2 + 4
            parts.append(f'<text x="{margin - 4}" y="{y:.1f}" font-size="10" text-anchor="end">'
                         f'{esc(labels[t][:18])}</text>')
            x = margin + t * cell + cell / 2 + 4
            parts.append(f'<text x="{x:.1f}" y="{margin - 4}" font-size="10" '
                         f'transform="rotate(-90 {x:.1f} {margin - 4})">{esc(labels[t][:18])}</text>')
    parts.append("</svg>")
    return "".join(parts)
