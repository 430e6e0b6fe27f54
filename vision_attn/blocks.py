"""What a report section holds, as plain data: tables, bar charts, curves, confusion matrices, cards.

A :class:`Section` is a titled group of blocks shown side by side;
:func:`~vision_attn.report.render.render_section` turns it into HTML, escaping every text it holds
(titles, column names, cells, labels, card lines), so whoever builds a section passes plain strings
and numbers, never markup. A task's result section is built from these records::

    Section("", [
        Table(["class", "n", Column("acc", bar=True)], [["cat", "4", 0.25], ["dog", "3", 0.67]],
              title="Per class (worst first)", id="per-class"),
        ConfusionMatrix(["cat", "dog"], [[1, 3], [1, 2]], title="Confusion matrix"),
    ])

and handed to :func:`~vision_attn.report.page.write_report` (``sections=[...]``). The mistakes
gallery is data too: :class:`Mistakes` of :class:`Mistake` cards, worst first
(``write_report(..., mistakes=...)``). The records import nothing from the package, so any layer
may build them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Bar", "BarChart", "Block", "Card", "Cards", "Column", "ConfusionMatrix", "Curves", "Listing", "Mistake",
           "Mistakes", "Section", "Strong", "Table", "finite"]

# A table cell: text as it is, an int as it is, a float with the table's digits; None, NaN and -1.0
# (COCO: no ground truth in range) read "—".
Cell = str | int | float | None


@dataclass(frozen=True, kw_only=True)
class Block:
    """What every block has: a title shown above it (``""``: none), the title's hover text, and the
    ``id`` of its table or chart element (``""``: none) that scripts and tests select it by."""

    title: str = ""
    hint: str = ""
    id: str = ""


@dataclass(frozen=True)
class Column:
    """A table column: its header, the header's hover text, and whether a number in [0, 1] in this
    column is drawn as a short bar before its value."""

    title: str
    hint: str = ""
    bar: bool = False


@dataclass(frozen=True)
class Table(Block):
    """Rows of cells under a header row; the first cell of each row is the row's header.

    Args:
        columns: the header: a column name or a :class:`Column`.
        rows: one sequence of :data:`Cell` per row, as long as ``columns``.
        digits: decimals of the float cells.
    """

    columns: Sequence[str | Column]
    rows: Sequence[Sequence[Cell]]
    digits: int = 3


@dataclass(frozen=True)
class Bar:
    """One horizontal bar: a value in [0, 1] (``None`` or -1: no value, read "no ground truth"), an
    optional lighter background value drawn behind it, and a note after the number."""

    label: str
    value: float | None
    back: float | None = None
    note: str = ""


@dataclass(frozen=True)
class BarChart(Block):
    """Horizontal bars in [0, 1], one per :class:`Bar`, in the given order; the legend names the two
    bars when ``back_label`` is given (charts with background values)."""

    bars: Sequence[Bar]
    value_label: str = "value"
    back_label: str = ""


@dataclass(frozen=True)
class Curves(Block):
    """A line plot of ``{name: [[x, y], ...]}`` (one line per name, at most 8 colours); ``y_range``
    fixes the y axis (e.g. ``(0, 1)``), ``legend`` is ``top-right``, ``bottom-right`` or
    ``bottom-left`` (inside the plot, where the lines leave room)."""

    series: Mapping[str, Sequence[Sequence[float]]]
    xlabel: str
    ylabel: str = ""
    y_range: tuple[float, float] | None = None
    legend: str = "top-right"
    width: int = 380
    height: int = 210


@dataclass(frozen=True)
class ConfusionMatrix(Block):
    """Counts per (truth, predicted) pair, rows = truth, over ``labels`` in both directions (a square
    matrix; another shape is not drawn). The page's filter works on the matrix whose ``id`` is
    ``confusion``: clicking a cell shows exactly the explained images of that cell."""

    labels: Sequence[str]
    counts: Sequence[Sequence[int]]
    id: str = field(default="confusion", kw_only=True)


@dataclass(frozen=True)
class Card:
    """A small box of text: a bold title and lines under it. ``item`` names an explained image (its
    ``name`` in the report items): the card then shows that image's overlay and links to its
    interactive view."""

    title: str
    lines: Sequence[str] = ()
    item: str | None = None


@dataclass(frozen=True)
class Cards(Block):
    """Cards side by side, wrapping."""

    cards: Sequence[Card]


@dataclass(frozen=True)
class Section:
    """A part of the page: an ``<h2>`` title (``""``: none), a note under it, and its blocks side by
    side. A section without blocks (or whose blocks have nothing to draw) is left out."""

    title: str
    blocks: Sequence[Block] = ()
    note: str = ""


@dataclass(frozen=True)
class Strong:
    """A bold part of a :class:`Mistake`'s headline: text, or a number (formatted with the card's
    ``digits``)."""

    value: Cell


@dataclass(frozen=True)
class Listing:
    """A titled list in a :class:`Mistake` card, shown with its length (``missed (2):``) and its
    entries, or ``none``; ``key`` is the list's class attribute, what scripts and tests select it by
    (``""``: ``title``)."""

    title: str
    entries: Sequence[str]
    key: str = ""


@dataclass(frozen=True)
class Mistake:
    """One card of the mistakes gallery: ``#rank`` (its place in :attr:`Mistakes.cards`), the
    headline ``head`` (text, numbers and :class:`Strong` parts), the image's ``name``, ``tail``
    after it, a ``text`` line under them and ``lists``. When the page explains the image called
    ``name``, the card shows its overlay and links to its interactive view.

    Args:
        name: the image, as the report items and ``predictions.json`` name it.
        head: what comes before the name; numbers are shown with ``digits`` decimals (``None``: —).
        tail: text after the name.
        text: a line under the headline (e.g. a caption; ``None``: no line).
        lists: titled lists under the headline (e.g. missed objects, false detections).
        score: what the gallery is ranked by (the card's ``data-score``; ``None``: none).
        top: the second ranking key (the card's ``data-top``; ``None``: none).
        digits: decimals of the numbers in ``head``.
    """

    name: str
    head: Sequence[Cell | Strong] = ()
    tail: str = ""
    text: str | None = None
    lists: Sequence[Listing] = ()
    score: float | None = None
    top: float | None = None
    digits: int = 3


@dataclass(frozen=True)
class Mistakes:
    """The mistakes gallery: its cards, worst first, with an ``intro`` above them; ``empty`` is what
    the page says when there are no cards (``""``: the gallery is left out)."""

    cards: Sequence[Mistake]
    intro: str = ""
    empty: str = ""


def finite(value: Any) -> float | None:
    """A finite float from any value (a number, a numeric string), or ``None`` (empty, garbled, NaN,
    inf): how a result file's number becomes a cell."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
