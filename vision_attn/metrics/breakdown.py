"""Where an evaluation's headline number comes from: per-class and per-size breakdowns.

``eval.py`` writes these next to ``metrics.json`` (the numbers behind ``report.html``):

- classification: the confusion matrix (``confusion_matrix.json``: ``{"labels", "counts"}``,
  rows = true class, columns = predicted class) and, per class, its accuracy, image count,
  precision and recall (``per_class.json``);
- detection: COCO's size ranges and recall at 1 / 10 / 100 detections per image (added to
  ``metrics.json``) and, per category, AP, AP at IoU 0.5 and the number of ground-truth objects
  (``per_class.json``), and per category its precision-recall curve at IoU 0.5
  (``pr_curves.json``, :func:`pr_curves_from_precision`).

The detection numbers are COCOeval's (pycocotools' definitions, computed by the same
``torchmetrics`` evaluation as ``map``): ``-1`` where a range or a category has no ground truth,
exactly as pycocotools reports it. Classification values that are undefined (accuracy and
recall of a class without images, precision of a class never predicted) are ``None`` (JSON
``null``) rather than a number a reader could take for a measurement.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics.detection import MeanAveragePrecision

__all__ = [
    "COCO_SUMMARY_KEYS",
    "DetectionBreakdown",
    "classification_breakdown",
    "coco_map_metric",
    "confusion_counts",
    "detection_breakdown",
    "pr_curves_from_precision",
    "precision_recall_f1",
]

log = logging.getLogger(__name__)

# COCOeval's own thresholds, in float64. torchmetrics' defaults come from float32 linspace
# (0.55 -> 0.550000011...), which moves recall thresholds past recalls that are exact fractions
# (few boxes per class) and changes mAP in the 4th digit.
COCO_IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10).tolist()
COCO_REC_THRESHOLDS = np.linspace(0.0, 1.0, 101).tolist()
COCO_MAX_DETECTIONS = (1, 10, 100)

# What detection's metrics.json holds (flat floats): COCOeval's summary, less the size ranges of recall.
COCO_SUMMARY_KEYS = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large", "mar_1", "mar_10", "mar_100")


def coco_map_metric(extended_summary: bool = False) -> MeanAveragePrecision:
    """torchmetrics' COCO mAP on xyxy pixel boxes with COCOeval's exact thresholds (faster_coco_eval's
    backend when installed, else pycocotools'). ``extended_summary`` keeps COCOeval's precision
    array (per category), from which :func:`detection_breakdown` reads per-category AP."""
    kwargs = {"box_format": "xyxy", "iou_type": "bbox", "iou_thresholds": COCO_IOU_THRESHOLDS,
              "rec_thresholds": COCO_REC_THRESHOLDS, "max_detection_thresholds": list(COCO_MAX_DETECTIONS),
              "extended_summary": extended_summary}
    try:
        return MeanAveragePrecision(backend="faster_coco_eval", **kwargs)
    except (ModuleNotFoundError, ImportError):  # pragma: no cover - depends on the install
        log.warning("faster_coco_eval is not installed; using the slower pycocotools backend")
        return MeanAveragePrecision(backend="pycocotools", **kwargs)


# ---------------------------------------------------------------------------------------------- classification
def confusion_counts(labels: Tensor | Sequence[int], preds: Tensor | Sequence[int], num_classes: int) -> Tensor:
    """``[C, C]`` int64 counts: row = true class, column = predicted class.

    Raises:
        ValueError: for a label or prediction outside ``0..num_classes-1``, or lengths that differ.
    """
    labels = torch.as_tensor(labels, dtype=torch.int64).flatten()
    preds = torch.as_tensor(preds, dtype=torch.int64).flatten()
    if labels.shape != preds.shape:
        raise ValueError(f"confusion_counts: {labels.numel()} labels but {preds.numel()} predictions")
    for what, values in (("label", labels), ("prediction", preds)):
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= num_classes):
            raise ValueError(f"confusion_counts: a {what} lies outside 0..{num_classes - 1}")
    flat = torch.bincount(labels * num_classes + preds, minlength=num_classes * num_classes)
    return flat.view(num_classes, num_classes)  # (truth, prediction)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def precision_recall_f1(tp: int, fp: int, fn: int) -> tuple[float | None, float | None, float | None]:
    """``(precision, recall, F1)`` of the counts; ``None`` where undefined (nothing predicted,
    nothing to find; F1 where either is undefined), F1 0 where both are 0."""
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    if precision is None or recall is None:
        return precision, recall, None
    return precision, recall, (2 * precision * recall / (precision + recall) if precision + recall else 0.0)


def classification_breakdown(labels: Tensor | Sequence[int], preds: Tensor | Sequence[int],
                             class_names: Sequence[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``(per_class, confusion)``: the contents of ``per_class.json`` and ``confusion_matrix.json``.

    Args:
        labels: the true class of each evaluated image (``0..C-1``).
        preds: the predicted (top-1) class of each image.
        class_names: the ``C`` names, in label order, as ``predictions.json`` writes them.

    Returns:
        ``per_class``: ``{name: {"acc", "n", "precision", "recall"}}`` (``acc`` is the share of the
        class's images predicted as it, so it equals ``recall``; ``None`` where undefined, see the
        module docstring); ``confusion``: ``{"labels": names, "counts": [[int]]}``, rows = truth.
        The counts sum to the number of images and their diagonal over that number is ``acc_top1``.
    """
    names = [str(n) for n in class_names]
    if len(set(names)) != len(names):
        raise ValueError(f"class names are not unique: {names}")
    counts = confusion_counts(labels, preds, len(names))
    correct = counts.diagonal().tolist()
    n = counts.sum(1).tolist()  # images per true class
    predicted = counts.sum(0).tolist()  # images per predicted class
    per_class = {
        name: {"acc": _ratio(correct[c], n[c]), "n": int(n[c]), "precision": _ratio(correct[c], predicted[c]),
               "recall": _ratio(correct[c], n[c])}
        for c, name in enumerate(names)
    }
    return per_class, {"labels": names, "counts": counts.tolist()}


# ---------------------------------------------------------------------------------------------- detection
@dataclasses.dataclass
class DetectionBreakdown:
    """COCO evaluation of a split, as :func:`detection_breakdown` returns it.

    Attributes:
        metrics: :data:`COCO_SUMMARY_KEYS` -> float (``metrics.json``), ``-1`` where undefined.
        per_class: ``{category name: {"ap", "ap_50", "n_gt"}}`` (``per_class.json``).
        pr_curves: ``{category name: {"recall": [101], "precision": [101]}}`` at IoU 0.5
            (``pr_curves.json``, see :func:`pr_curves_from_precision`).
    """

    metrics: dict[str, float]
    per_class: dict[str, dict[str, float | int]]
    pr_curves: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)


def _unique_names(names: list[str]) -> list[str]:
    """``names`` with repeats told apart (``"name [label]"``): an annotation file may give two
    categories one name, and ``per_class.json`` is keyed by name."""
    repeated = {n for n in names if names.count(n) > 1}
    if repeated:
        log.warning("category names %s occur more than once: per_class.json keys them as 'name [label]'",
                    sorted(repeated))
    return [f"{n} [{k}]" if n in repeated else n for k, n in enumerate(names)]


def _mean_defined(values: Tensor) -> float:
    """COCOeval's summary of a precision slice: the mean of its defined (> -1) entries, else -1."""
    defined = values[values > -1]
    return float(defined.mean()) if defined.numel() else -1.0


def pr_curves_from_precision(precision: Tensor | np.ndarray | None, present: Sequence[int],
                             names: Sequence[str]) -> dict[str, dict[str, list[float]]]:
    """Per category its precision-recall curve at IoU 0.5, read from COCOeval's precision array.

    Args:
        precision: COCOeval's ``eval["precision"]`` ``[T, R, K, A, M]`` (IoU thresholds from 0.5,
            the 101 recall thresholds of :data:`COCO_REC_THRESHOLDS`, categories, areas with
            ``all`` first, max detections with 100 last), or ``None``.
        present: the label (``0..C-1``) of each of its ``K`` categories.
        names: the ``C`` category names (the keys, in label order).

    Returns:
        ``{name: {"recall": [101 thresholds], "precision": [101 values]}}`` with, for the
        category's index ``k`` in ``present``, ``precision[r] = eval["precision"][0, r, k, 0, -1]``:
        COCOeval's interpolated precision
        (the best precision at any recall at least ``recall[k]``; IoU 0.5, all areas, 100
        detections per image). ``-1`` entries are pycocotools' own: a recall the detections
        never reach is ``0``, a category without ground truth is ``-1`` throughout (also a
        category COCOeval did not see: neither detected nor annotated).
    """
    recall = [float(r) for r in COCO_REC_THRESHOLDS]
    curves = {str(n): {"recall": list(recall), "precision": [-1.0] * len(recall)} for n in names}
    if precision is None:
        return curves
    array = torch.as_tensor(np.asarray(precision) if not isinstance(precision, Tensor) else precision).double()
    if array.ndim != 5 or array.shape[1] != len(recall) or array.shape[2] != len(present):
        raise ValueError(f"COCOeval precision array of shape {tuple(array.shape)} does not match "
                         f"{len(recall)} recall thresholds and {len(present)} categories")
    for k, label in enumerate(present):
        if not 0 <= label < len(names):
            raise ValueError(f"pr_curves_from_precision: label {label} outside 0..{len(names) - 1}")
        curves[str(names[label])]["precision"] = [float(v) for v in array[0, :, k, 0, -1].tolist()]
    return curves


def detection_breakdown(preds: list[dict[str, Tensor]], targets: list[dict[str, Tensor]],
                        class_names: Sequence[str]) -> DetectionBreakdown:
    """COCO mAP, its size ranges and recalls, and per-category AP of xyxy-pixel detections.

    Args:
        preds: per image ``{"boxes" [N, 4] xyxy pixels, "scores" [N], "labels" [N] in 0..C-1}``.
        targets: per image ``{"boxes", "labels"}`` and optionally ``"iscrowd"`` (detections matched
            to crowd regions are ignored) and ``"area"`` (the annotation's area, used for the size
            ranges), as :meth:`~vision_attn.data.detection.CocoDetection.scoring_target` gives them.
        class_names: the ``C`` category names in label order (keys of ``per_class``).

    Returns:
        A :class:`DetectionBreakdown`. Per category: ``ap`` (IoU 0.50:0.95) and ``ap_50`` from
        COCOeval's precision array (all areas, 100 detections), ``-1`` for a category without
        ground truth, as pycocotools; ``n_gt``: its ground-truth objects that are not crowd regions.
    """
    names = _unique_names([str(n) for n in class_names])
    metric = coco_map_metric(extended_summary=True)
    metric.update(preds, targets)
    res = metric.compute()
    metrics = {k: float(res[k]) for k in COCO_SUMMARY_KEYS}
    n_gt = [0] * len(names)
    for t in targets:
        crowd = t.get("iscrowd")
        labels = t["labels"] if crowd is None else t["labels"][crowd == 0]
        for label in labels.tolist():
            n_gt[label] += 1
    per_class = {name: {"ap": -1.0, "ap_50": -1.0, "n_gt": n_gt[c]} for c, name in enumerate(names)}
    precision = res.get("precision")  # (iou T, recall R, class K, area A, max detections M)
    pr_curves = pr_curves_from_precision(None, [], names)
    if precision is not None and precision.ndim == 5:
        # K runs over the labels present in preds or targets, sorted (torchmetrics' category ids);
        # area 0 is "all", the last M is 100 detections: pycocotools' per-category AP.
        labels_seen = [p["labels"].reshape(-1) for p in preds] + [t["labels"].reshape(-1) for t in targets]
        present = sorted(set(torch.cat(labels_seen).tolist())) if labels_seen else []
        if len(present) != precision.shape[2]:
            raise RuntimeError(f"COCOeval returned {precision.shape[2]} categories for {len(present)} labels")
        for k, label in enumerate(present):
            if not 0 <= label < len(names):
                raise ValueError(f"detection_breakdown: label {label} outside 0..{len(names) - 1}")
            entry = per_class[names[label]]
            entry["ap"] = _mean_defined(precision[:, :, k, 0, -1])
            entry["ap_50"] = _mean_defined(precision[0, :, k, 0, -1])
        pr_curves = pr_curves_from_precision(precision, present, names)
    return DetectionBreakdown(metrics, per_class, pr_curves)
