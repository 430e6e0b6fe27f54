"""``report.html``: the self-contained page of an evaluation or a folder run (:func:`write_report`).

A task's result sections are data (:mod:`vision_attn.blocks`: :class:`Section` of
:class:`Table`, :class:`BarChart`, :class:`Curves`, :class:`ConfusionMatrix`, :class:`Cards`),
drawn by :func:`render_section` and passed to :func:`write_report` as ``sections``; its mistakes
gallery is a :class:`Mistakes` of :class:`Mistake` cards, passed as ``mistakes``.
"""

from vision_attn.blocks import (
    Bar,
    BarChart,
    Block,
    Card,
    Cards,
    Column,
    ConfusionMatrix,
    Curves,
    Listing,
    Mistake,
    Mistakes,
    Section,
    Strong,
    Table,
)
from vision_attn.report.page import read_training_curves, script_json, write_report
from vision_attn.report.render import render_section

__all__ = ["Bar", "BarChart", "Block", "Card", "Cards", "Column", "ConfusionMatrix", "Curves", "Listing", "Mistake",
           "Mistakes", "Section", "Strong", "Table", "read_training_curves", "render_section", "script_json",
           "write_report"]
