"""The detector's result section: the precision-recall plot says when it shows only some of the
categories, and keeps its legend where precision-recall curves leave room."""

from __future__ import annotations

from vision_attn.blocks import Curves
from vision_attn.tasks.detection_report import PR_SHOWN, detection_section


def _curves(n: int) -> dict:
    return {f"class{i}": {"recall": [0.0, 0.5, 1.0], "precision": [1.0, 0.8, 0.4]} for i in range(n)}


def test_the_precision_recall_plot_names_what_it_leaves_out():
    plot = next(b for b in detection_section(None, {}, _curves(PR_SHOWN + 2)).blocks if isinstance(b, Curves))
    assert len(plot.series) == PR_SHOWN
    assert f"the first {PR_SHOWN} of {PR_SHOWN + 2} categories" in plot.title
    assert plot.legend == "bottom-left"  # curves run from top-left to bottom-right
    few = next(b for b in detection_section(None, {}, _curves(3)).blocks if isinstance(b, Curves))
    assert len(few.series) == 3 and "first" not in few.title
