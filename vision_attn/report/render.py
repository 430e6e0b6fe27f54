"""HTML of a report :class:`~vision_attn.blocks.Section`: its blocks as tables, SVG charts and cards.

Every text a section holds is HTML-escaped here, where it enters markup (the records hold plain
strings); numbers are formatted here (:func:`~vision_attn.report.markup.fmt`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from vision_attn.blocks import (
    BarChart,
    Block,
    Cards,
    Cell,
    Column,
    ConfusionMatrix,
    Curves,
    Section,
    Table,
)
from vision_attn.report.charts import bars_svg, confusion_svg, line_svg
from vision_attn.report.markup import esc, fmt

__all__ = ["cell_text", "render_block", "render_section"]

# The explained images by name: their index in the page's grid (``#item<index>``).
ItemIndex = Mapping[str, int]


def render_section(section: Section, items: ItemIndex | None = None) -> str:
    """The section's ``<h2>`` title (when it has one) and note, then its blocks side by side in a
    ``div.row``; ``""`` when no block has anything to draw.

    Args:
        section: the section.
        items: the explained images' grid index by name (what :class:`~vision_attn.blocks.Card`
            ``item`` refers to); cards naming an image not in it show no overlay.
    """
    blocks = [html for block in section.blocks if (html := render_block(block, items))]
    if not blocks:
        return ""
    head = f"<h2>{esc(section.title)}</h2>" if section.title else ""
    note = f'<p class="note">{esc(section.note)}</p>' if section.note else ""
    return head + note + '<div class="row">' + "".join(blocks) + "</div>"


def render_block(block: Block, items: ItemIndex | None = None) -> str:
    """One block in its panel, under its ``<h4>`` title; ``""`` when it has nothing to draw."""
    draw = next((_DRAW[t] for t in type(block).__mro__ if t in _DRAW), None)
    if draw is None:
        raise TypeError(f"report: no way to draw a {type(block).__name__} block; a section holds "
                        f"{', '.join(sorted(t.__name__ for t in _DRAW))}")
    body = draw(block, items or {})
    if not body:
        return ""
    title = f"<h4{_hint(block.hint)}>{esc(block.title)}</h4>" if block.title else ""
    return f'<div class="panel-box">{title}{body}</div>'


def _id(block: Block) -> str:
    """The ``id`` attribute of a block's element (none when the block has no id)."""
    return f' id="{esc(block.id)}"' if block.id else ""


def _hint(text: str) -> str:
    """A ``title`` attribute: the hover text of a heading (none when empty)."""
    return f' title="{esc(text)}"' if text else ""


def cell_text(value: Cell, digits: int) -> str:
    """A cell's text: strings as they are, ints whole, floats with ``digits`` decimals (escaped)."""
    if isinstance(value, str):
        return esc(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return esc(value)
    return fmt(value, digits)


def _bar(value: Cell) -> str:
    """A short bar (60 px at 1) for a number in [0, 1]; ``""`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return ""
    return f'<span class="bar" style="width:{60 * min(max(value, 0.0), 1.0):.0f}px"></span>'


def _table(block: Table, items: ItemIndex) -> str:
    columns = [c if isinstance(c, Column) else Column(str(c)) for c in block.columns]
    head = "".join(f"<th{_hint(c.hint)}>{esc(c.title)}</th>" for c in columns)
    rows = []
    for r, row in enumerate(block.rows):
        if len(row) != len(columns):
            raise ValueError(f"report table {block.id or block.title!r}: row {r} has {len(row)} cells for "
                             f"{len(columns)} columns")
        cells = []
        for k, (column, value) in enumerate(zip(columns, row, strict=True)):
            tag = "th" if k == 0 else "td"
            text = (_bar(value) if column.bar else "") + cell_text(value, block.digits)
            cells.append(f"<{tag}>{text}</{tag}>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table{_id(block)}><tr>{head}</tr>" + "".join(rows) + "</table>"


def _bar_chart(block: BarChart, items: ItemIndex) -> str:
    if not block.bars:
        return ""
    rows = [(str(b.label), b.value, b.back, str(b.note)) for b in block.bars]
    return bars_svg(block.id, rows, value_label=block.value_label, back_label=block.back_label)


def _curves(block: Curves, items: ItemIndex) -> str:
    return line_svg(block.id, dict(block.series), block.xlabel, block.ylabel, width=block.width,
                    height=block.height, y_range=block.y_range, legend=block.legend)


def _confusion(block: ConfusionMatrix, items: ItemIndex) -> str:
    labels, counts = [str(x) for x in block.labels], [[int(c) for c in row] for row in block.counts]
    if not labels or len(counts) != len(labels) or any(len(row) != len(labels) for row in counts):
        return ""
    return confusion_svg(labels, counts, block.id)


def _cards(block: Cards, items: ItemIndex) -> str:
    """Each card: its title and lines; with the overlay of the explained image it names (copied by
    the page's script from the grid, so the file holds each image once) and a link to its view."""
    if not block.cards:
        return ""
    out = []
    for card in block.cards:
        i = items.get(card.item) if card.item is not None else None
        lines = "".join(f"<p>{esc(line)}</p>" for line in card.lines)
        overlay = ("" if i is None else f'<img class="copy" data-item="{i}" alt="overlay">'
                   f'<a class="goto" href="#item{i}">interactive view ↓</a>')
        out.append(f'<div class="card" data-item="{"" if i is None else i}"><p><b>{esc(card.title)}</b></p>'
                   f"{lines}{overlay}</div>")
    return f'<div class="cards"{_id(block)}>' + "".join(out) + "</div>"


_DRAW: dict[type, Callable[[Any, ItemIndex], str]] = {
    Table: _table, BarChart: _bar_chart, Curves: _curves, ConfusionMatrix: _confusion, Cards: _cards}
