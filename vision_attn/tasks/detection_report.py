"""What ``report.html`` shows of a detector's evaluation, as :mod:`vision_attn.blocks` records.

- **results** (:func:`result_sections`): per-category AP bars (``per_class.json``), the COCO size
  breakdown of ``metrics.json`` (``map_small`` ..., ``mar_1`` ...), TIDE's error split
  (``tide_*``, :func:`tide_bars`) and the precision-recall curves at IoU 0.5 (``pr_curves.json``);
- **mistakes** (:func:`rank_mistakes`, :func:`mistake_cards`): the images with the most missed
  objects and false detections (:func:`~vision_attn.explain.detection.split_detection_errors`), then
  the highest-scoring false detection, each card listing its errors.

:class:`~vision_attn.tasks.DetectionTask` hands these to the report through its hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vision_attn.blocks import Bar, BarChart, Curves, Listing, Mistake, Mistakes, Section, finite
from vision_attn.explain.detection import rank_detection_errors, split_detection_errors

__all__ = ["detection_section", "mistake_cards", "pr_points", "rank_mistakes", "result_sections", "tide_bars"]

SIZE_KEYS = ("map_small", "map_medium", "map_large", "mar_1", "mar_10", "mar_100")
PR_SHOWN = 8  # categories drawn in the precision-recall plot


def result_sections(files: dict[str, Any], metrics: dict[str, float]) -> list[Section]:
    """The detector's result section, from its ``per_class.json``, ``pr_curves.json`` and ``metrics``."""
    return [detection_section(files.get("per_class.json"), metrics, files.get("pr_curves.json"))]


def detection_section(per_class: dict[str, Any] | None, metrics: dict[str, Any],
                      pr_curves: dict[str, Any] | None = None) -> Section:
    """Per-category AP bars (AP@[.5:.95] over AP@0.5, worst first, no ground truth last), the COCO
    size breakdown and, when given, the precision-recall curves of the first 8 categories."""
    blocks: list[Any] = []
    if per_class:
        bars = []
        for name, row in per_class.items():
            row = row if isinstance(row, dict) else {}
            bars.append(Bar(str(name), finite(row.get("ap")), finite(row.get("ap_50")),
                            f"({row.get('n_gt', '?')} objects)"))
        bars.sort(key=lambda b: (b.value is None or b.value < 0, b.value if b.value is not None else 0.0))
        blocks.append(BarChart(bars, title="AP per category (worst first)", id="ap-per-class", value_label="AP",
                               back_label="AP@0.5"))
    sizes = [Bar(k, finite(metrics.get(k))) for k in SIZE_KEYS if k in metrics]
    if sizes:  # -1 (COCO: no object of that size) reads "no ground truth"
        blocks.append(BarChart(sizes, title="By object size; recall at 1 / 10 / 100 detections", id="size-breakdown",
                               hint="COCO: small < 32², large > 96² pixels of area; mar_k: recall with at most k "
                                    "detections per image"))
    tide = tide_bars(metrics)
    if tide:
        blocks.append(BarChart(tide, title="Where the AP at IoU 0.5 goes (TIDE)", id="tide", value_label="dAP",
                               hint="the AP at IoU 0.5 gained by fixing only the errors of each kind (Bolya et al. "
                                    "2020): cls right box, wrong class; loc right class, box off (IoU 0.1-0.5); both "
                                    "neither; dupe a second detection of a found object; bkg on nothing (IoU < 0.1); "
                                    "miss an object nothing detected; false positives / negatives: every FP scored "
                                    "below every TP / every missed object removed"))
    curves = pr_points(pr_curves)
    if curves:
        more = f" (the first {PR_SHOWN} of {len(curves)} categories)" if len(curves) > PR_SHOWN else ""
        blocks.append(Curves(dict(list(curves.items())[:PR_SHOWN]), "recall", "precision",
                             title=f"Precision-recall at IoU 0.5{more}", id="pr-curves", width=420, height=250,
                             y_range=(0.0, 1.0), legend="bottom-left",
                             hint="COCOeval's interpolated precision at each recall threshold; IoU 0.5, all areas, "
                                  "100 detections per image"))
    return Section("", blocks)


TIDE_NAMES = {"cls": "classification", "loc": "localisation", "both": "both", "dupe": "duplicate",
              "bkg": "background", "miss": "missed", "fp": "false positives", "fn": "false negatives"}


def tide_bars(metrics: dict[str, Any]) -> list[Bar]:
    """TIDE's bar chart from ``metrics.json``'s ``tide_<kind>`` (dAP) and ``tide_count_<kind>``."""
    bars = []
    for kind, name in TIDE_NAMES.items():
        if f"tide_{kind}" in metrics:
            count = finite(metrics.get(f"tide_count_{kind}"))
            bars.append(Bar(name, finite(metrics[f"tide_{kind}"]),
                            note="" if count is None else f"({int(count)} errors)"))
    return bars


def pr_points(pr_curves: dict[str, Any] | None) -> dict[str, list[list[float]]]:
    """``{category: [[recall, precision], ...]}`` from either form: point lists, or
    ``pr_curves.json``'s ``{"recall": [...], "precision": [...]}``
    (:func:`~vision_attn.metrics.breakdown.pr_curves_from_precision`). Points with precision ``-1``
    (pycocotools: no ground truth) are left out, and so are categories left without any."""
    out: dict[str, list[list[float]]] = {}
    for name, curve in (pr_curves or {}).items():
        if isinstance(curve, dict):
            pairs: Sequence[Sequence[Any]] = list(zip(curve.get("recall") or [], curve.get("precision") or [],
                                                      strict=False))
        else:
            pairs = [tuple(p)[:2] for p in curve or [] if isinstance(p, list | tuple) and len(p) >= 2]
        points = [[r, p] for r, p in ((finite(a), finite(b)) for a, b in pairs)
                  if r is not None and p is not None and p >= 0]
        if points:
            out[str(name)] = points
    return out


def rank_mistakes(dataset: Any, predictions: Sequence[dict[str, Any]] | None, k: int, **keywords: Any) -> list[int]:
    """The dataset indices of the ``k`` images of ``dataset`` with the most missed and false detections
    in ``predictions`` (COCO results), then the highest-scoring false detection, then split order
    (:func:`~vision_attn.explain.detection.rank_detection_errors`); ``keywords``: those of
    :func:`~vision_attn.explain.detection.split_detection_errors` (``category_ids``,
    ``class_names``, ``score_threshold``)."""
    if k <= 0 or not predictions:
        return []
    return rank_detection_errors(split_detection_errors(dataset, predictions, **keywords))[:k]


def _error_text(error: Any) -> str:
    """A missed object or false detection for display: ``label``, ``label 0.87``, ``label 0.87
    (wrong class: cat)``; a plain string as it is (see
    :func:`~vision_attn.explain.detection.detection_errors` for the records)."""
    if not isinstance(error, dict):
        return str(error)
    text = str(error.get("label", "?"))
    score = finite(error.get("score"))
    if score is not None:
        text += f" {score:.2f}"
    if error.get("why"):
        text += f" ({error['why']})"
    return text


def mistake_cards(items: list[dict[str, Any]], predictions: list[dict[str, Any]] | None, limit: int) -> Mistakes:
    """The explained images with missed objects or false detections (their report items' ``missed``
    and ``false``), the most errors first, then the highest-scoring false detection; each card lists
    its errors."""
    bad = []
    for i, it in enumerate(items):
        missed, false = it.get("missed") or [], it.get("false") or []
        if missed or false:
            top = max((s for x in false if isinstance(x, dict) and (s := finite(x.get("score"))) is not None),
                      default=None)
            bad.append((len(missed) + len(false), top or 0.0, i))
    bad.sort(key=lambda x: (-x[0], -x[1], x[2]))
    cards = []
    for count, top, i in bad[:limit]:
        lists = [Listing(key, [_error_text(x) for x in items[i].get(key) or []], key) for key in ("missed", "false")]
        cards.append(Mistake(str(items[i].get("name", "")), tail=f' — {count} error{"s" if count != 1 else ""}',
                             lists=lists, score=float(count), top=top))
    intro = ("Explained images with missed objects (ground truth that no detection above the threshold matched "
             "at IoU 0.5) or false detections (above the threshold, matching no object of their class), the "
             "most errors first, then the highest-scoring false detection."
             + (" Every mistake of the split, with the map of the query behind it and whether it looked at the "
                "object: mistakes.html next to this page." if predictions is not None else ""))
    # an evaluation (it has predictions) says why the gallery is empty; a folder run's page says nothing
    empty = ("Missed and false detections are listed here when the explained images carry their matching to "
             "the ground truth; these do not." if predictions is not None else "")
    return Mistakes(cards, intro=intro, empty=empty)
