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

and handed to :func:`~vision_attn.report.page.write_report` (``sections=[...]``). The records
import nothing from the package, so any layer may build them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Bar", "BarChart", "Block", "Card", "Cards", "Column", "ConfusionMatrix", "Curves", "Section", "Table"]

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
