"""What ``report.html`` shows of a task's evaluation, and the defaults every task starts from:
callers ask the task these and never switch on its name."""

from __future__ import annotations

from typing import Any

from vision_attn.blocks import Mistakes, Section
from vision_attn.explain.evaluate import DEFAULT_MISTAKES

__all__ = ["TaskReportHooks"]


class TaskReportHooks:
    """The report hooks of :class:`~vision_attn.tasks.base.VisionTask` with their defaults (no
    mistakes, no sections, no gallery); a task overrides those it has."""

    def rank_mistakes(self, dataset: Any, predictions: list[dict[str, Any]], k: int,
                      options: Any = None) -> list[int]:
        """The dataset indices of the ``k`` worst mistakes of ``predictions`` (the evaluation's
        ``predictions.json`` records of ``dataset``), worst first; ``eval.py`` explains them
        besides the seeded sample, so the mistakes gallery shows their overlays. ``options``: the
        evaluation's :class:`~vision_attn.explain.evaluate.ExplainOptions` (e.g. a score
        threshold). Default: none."""
        return []

    def report_sections(self, files: dict[str, Any], metrics: dict[str, float]) -> list[Section]:
        """The task's result sections of ``report.html`` (:mod:`vision_attn.blocks` records), built
        from its evaluation files (:meth:`~vision_attn.tasks.base.VisionTask.eval_files`: file name
        -> JSON object) and ``metrics``. Default: none."""
        return []

    def mistake_cards(self, items: list[dict[str, Any]], predictions: list[dict[str, Any]] | None,
                      limit: int = DEFAULT_MISTAKES) -> Mistakes | None:
        """The mistakes gallery of ``report.html``: at most ``limit`` cards, worst first, from the
        evaluation's ``predictions`` (``None``: a page without them, e.g. a folder run) and the
        explained images' report ``items`` (a card whose ``name`` is an item's shows its overlay).
        Default: no gallery."""
        return None
