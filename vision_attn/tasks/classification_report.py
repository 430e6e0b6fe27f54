"""What ``report.html`` shows of a classifier's evaluation, as :mod:`vision_attn.blocks` records.

- **results** (:func:`result_sections`): ``per_class.json`` as a table, worst accuracy first, with
  the class each is most often confused with, and ``confusion_matrix.json`` as the clickable matrix
  (id ``confusion``: a click on a cell shows exactly the explained images of that cell);
- **mistakes** (:func:`rank_mistakes`, :func:`mistake_cards`): the most confident wrong predictions
  of the split (``label != pred`` in ``predictions.json``), the most probable first.

:class:`~vision_attn.tasks.ClassificationTask` hands these to the report through its hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vision_attn.blocks import (
    Column,
    ConfusionMatrix,
    Mistake,
    Mistakes,
    Section,
    Strong,
    Table,
    finite,
)

__all__ = ["classification_section", "mistake_cards", "rank_mistakes", "result_sections"]


def result_sections(files: dict[str, Any], metrics: dict[str, float]) -> list[Section]:
    """The classifier's result section, from its ``per_class.json`` and ``confusion_matrix.json``."""
    return [classification_section(files.get("per_class.json"), files.get("confusion_matrix.json"))]


def classification_section(per_class: dict[str, Any] | None, confusion: dict[str, Any] | None) -> Section:
    """``per_class.json`` (``{class: {acc, n, precision, recall}}``) as a table (worst accuracy first,
    ties in file order, with the class each is most confused with) and ``confusion_matrix.json``
    (``{"labels", "counts"}``, rows = truth) as the clickable matrix."""
    labels = [str(x) for x in (confusion or {}).get("labels") or []]
    counts = [[int(c) for c in row] for row in (confusion or {}).get("counts") or []]
    blocks: list[Any] = []
    if per_class:
        def order(entry: tuple[str, Any]) -> tuple[bool, float]:
            acc = finite(entry[1].get("acc")) if isinstance(entry[1], dict) else None
            return (acc is None, acc if acc is not None else 0.0)

        rows = []
        for name, row in sorted(per_class.items(), key=order):
            row = row if isinstance(row, dict) else {}
            rows.append([str(name), str(row.get("n", "—")), finite(row.get("acc")), finite(row.get("precision")),
                         finite(row.get("recall")), _most_confused(str(name), labels, counts)])
        columns = ["class", "n", Column("acc", bar=True), "precision", "recall", "most confused with"]
        blocks.append(Table(columns, rows, title="Per class (worst first)", id="per-class"))
    if labels:
        blocks.append(ConfusionMatrix(labels, counts, title="Confusion matrix (rows: truth, columns: predicted; "
                                                            "click a cell)"))
    return Section("", blocks)


def _most_confused(name: str, labels: list[str], counts: list[list[int]]) -> str:
    """``other (count)``: the class ``name`` is most often predicted as instead, or ``""``."""
    if name not in labels or len(counts) != len(labels):
        return ""
    t = labels.index(name)
    off = [(c, labels[p]) for p, c in enumerate(counts[t]) if p != t and c > 0]
    if not off:
        return ""
    c, other = max(off, key=lambda x: x[0])
    return f"{other} ({c})"


def rank_mistakes(dataset: Any, predictions: Sequence[dict[str, Any]] | None, k: int) -> list[int]:
    """The dataset indices of the ``k`` wrong predictions (``label != pred``) of ``predictions``, the
    most probable first (ties in split order), joined to ``dataset.samples`` by ``file``; records of
    files the split does not have are skipped."""
    if k <= 0 or not predictions:
        return []
    where = {str(Path(rel).as_posix()): i for i, (rel, *_rest) in enumerate(getattr(dataset, "samples", []))}
    wrong = [(-float(r.get("score", 0.0)), where[str(Path(str(r["file"])).as_posix())]) for r in predictions
             if isinstance(r, dict) and str(Path(str(r.get("file"))).as_posix()) in where
             and "label" in r and "pred" in r and str(r["label"]) != str(r["pred"])]
    return [i for _, i in sorted(wrong)[:k]]


def mistake_cards(items: list[dict[str, Any]], predictions: list[dict[str, Any]] | None, limit: int) -> Mistakes:
    """The split's ``limit`` most confident wrong predictions (truth → predicted, probability), the
    most confident first; without ``predictions``, those of the explained images (their ``truth``,
    ``pred`` and ``score``)."""
    wrong = [r for r in predictions or [] if isinstance(r, dict) and "label" in r and "pred" in r
             and str(r["label"]) != str(r["pred"])]
    source, known = "the split", predictions is not None
    if predictions is None:
        source = "the explained images"
        judged = [it for it in items if it.get("truth") is not None and it.get("pred") is not None]
        known = bool(judged)
        wrong = [{"file": it.get("name"), "label": it["truth"], "pred": it["pred"], "score": it.get("score")}
                 for it in judged if str(it["truth"]) != str(it["pred"])]
    if not wrong:
        return Mistakes([], empty=f"No wrong prediction in {source}." if known else "")
    wrong.sort(key=lambda r: -(finite(r.get("score")) or 0.0))
    cards = []
    for r in wrong[:limit]:
        score = finite(r.get("score"))
        cards.append(Mistake(str(r.get("file", "")), head=[Strong(str(r["label"])), " → ", Strong(str(r["pred"])),
                                                           " ", score, " "], score=score))
    intro = (f"{len(wrong)} wrong predictions in {source}; the {len(cards)} most confident, most confident "
             "first (truth → predicted, probability).")
    return Mistakes(cards, intro=intro)
