"""A detector's evaluation, object by object: TIDE's error split, the per-image results and the
per-class precision, recall and F1 at the score threshold.

``eval.py`` writes, next to ``metrics.json`` (which gets the ``tide_*`` numbers of
:func:`~vision_attn.metrics.tide.tide_errors`):

- ``results_per_image.json``: per image ``{"image_id", "file_name", "truths": [...],
  "detections": [...]}``; a truth ``{"category", "bbox", "size", "outcome": "tp" | "fn" |
  "crowd", "error" (fn: "miss", or "cls" / "loc" when a detection of that error could take it),
  "detection" (the index of the detection that took it), "score" (that detection's score)}``; a
  detection ``{"category", "bbox", "score", "size", "outcome": "tp" | "cls" | "loc" | "both" |
  "dupe" | "bkg" | "ignored" | "unscored", "error", "iou", "truth" (the index of the box it took
  or is confused with)}``; boxes ``[x, y, w, h]`` in pixels of the original image, sizes COCO's
  ranges of the box's area (``small`` below 32², ``medium`` below 96², ``large``);
- ``results_per_image.csv``: the same, one row per truth and per detection (``kind``);
- ``per_class.csv``: per category the counts at the score threshold (``--explain.score_threshold``)
  and what they give: ``tp``, ``fp``, ``fn``, precision, recall, F1, with COCO's AP and AP at IoU
  0.5 from ``per_class.json``.

The counts at a threshold follow from the per-image results: a detection scoring at least the
threshold is a true positive when its outcome is ``tp`` and a false positive when it is an
error (``ignored`` ones count as neither); a box is found when the detection that took it scores
at least the threshold (matching goes best score first, so a detection's match does not depend
on the detections scoring less).
"""

from __future__ import annotations

from typing import Any

from vision_attn.metrics.breakdown import precision_recall_f1
from vision_attn.metrics.tide import TIDE_ERRORS, tide_errors

__all__ = ["SIZE_RANGES", "class_counts", "detection_results", "size_range"]

SIZE_RANGES = (("small", 32.0**2), ("medium", 96.0**2), ("large", float("inf")))
"""COCO's area ranges (upper bounds, in square pixels)."""


def size_range(area: float) -> str:
    """COCO's size range of an area in square pixels."""
    return next(name for name, upper in SIZE_RANGES if area < upper)


def _truths(dataset, category_ids: list[int]) -> tuple[list[int], list[dict[str, Any]]]:
    """The split's image ids and its ground truth as COCO annotations (with ``label`` and ``area``)."""
    from torchvision.ops import box_convert

    ids, anns = [], []
    for im in dataset.images:
        ids.append(im["id"])
        t = dataset.scoring_target(im["id"])
        for box, label, crowd, area in zip(box_convert(t["boxes"], "xyxy", "xywh").tolist(), t["labels"].tolist(),
                                           t["iscrowd"].tolist(), t["area"].tolist(), strict=True):
            anns.append({"image_id": im["id"], "category_id": category_ids[label], "label": label, "bbox": box,
                         "iscrowd": int(crowd), "area": float(area)})
    return ids, anns


def detection_results(dataset, results: list[dict[str, Any]], category_ids: list[int], class_names: list[str],
                      score_threshold: float, per_class_ap: dict[str, dict[str, Any]] | None = None
                      ) -> tuple[dict[str, float], dict[str, Any]]:
    """``(metrics, files)``: TIDE's numbers for ``metrics.json`` and the files of the module
    docstring, from the evaluation's COCO results list (``predictions.json``: category ids of
    the file, ``[x, y, w, h]`` boxes, unrounded scores).

    Args:
        dataset: the evaluated :class:`~vision_attn.data.detection.CocoDetection` split.
        results: the COCO results list.
        category_ids: the file's category id of each label ``0 .. C-1``.
        class_names: each label's name.
        score_threshold: the threshold of the per-class counts.
        per_class_ap: ``per_class.json`` (``{name: {"ap", "ap_50", "n_gt"}}``), for the CSV's AP columns.
    """
    ids, anns = _truths(dataset, category_ids)
    tide = tide_errors(ids, anns, results)
    label_of = {c: k for k, c in enumerate(category_ids)}

    def name(category_id: int) -> str:
        k = label_of.get(int(category_id))
        return str(class_names[k]) if k is not None and k < len(class_names) else str(category_id)

    files_by_image = {im["id"]: im.get("file_name") for im in dataset.images}
    per_image = {i: {"image_id": i, "file_name": files_by_image[i], "truths": [], "detections": []} for i in ids}
    where: dict[tuple[str, int], int] = {}  # (kind, input index) -> index within its image
    for n, (a, out) in enumerate(zip(anns, tide.truths, strict=True)):
        entry = per_image[a["image_id"]]
        where["truth", n] = len(entry["truths"])
        entry["truths"].append({"category": name(a["category_id"]), "bbox": a["bbox"], "size": size_range(a["area"]),
                                "outcome": out["outcome"], "error": out["error"], "detection": None, "score": None})
    for n, (d, out) in enumerate(zip(results, tide.detections, strict=True)):
        entry = per_image.get(d["image_id"])
        if entry is None:
            continue
        where["detection", n] = len(entry["detections"])
        w, h = d["bbox"][2], d["bbox"][3]
        entry["detections"].append({"category": name(d["category_id"]), "bbox": d["bbox"], "score": d["score"],
                                    "size": size_range(max(w, 0.0) * max(h, 0.0)), "outcome": out["outcome"],
                                    "error": out["error"], "iou": out["iou"],
                                    "truth": None if out["gt"] is None else where["truth", out["gt"]]})
    for n, out in enumerate(tide.truths):
        if out["det"] is not None:
            truth = per_image[anns[n]["image_id"]]["truths"][where["truth", n]]
            truth["detection"] = where["detection", out["det"]]
            truth["score"] = results[out["det"]]["score"]
    images = list(per_image.values())
    counts = class_counts(images, score_threshold)
    rows = []
    for c in category_ids:
        label = name(c)
        tp, fp, fn = counts.get(label, (0, 0, 0))
        precision, recall, f1 = precision_recall_f1(tp, fp, fn)
        ap = (per_class_ap or {}).get(label, {})
        rows.append({"class": label, "category_id": c, "n_gt": tp + fn, "tp": tp, "fp": fp, "fn": fn,
                     "precision": precision, "recall": recall, "f1": f1, "score_threshold": score_threshold,
                     "ap": ap.get("ap"), "ap_50": ap.get("ap_50")})
    return tide.metrics(), {"results_per_image.json": images, "results_per_image.csv": per_image_rows(images),
                            "per_class.csv": rows}


def class_counts(images: list[dict[str, Any]], score_threshold: float) -> dict[str, tuple[int, int, int]]:
    """``{class: (tp, fp, fn)}`` at ``score_threshold`` from ``results_per_image.json``'s entries
    (see the module docstring)."""
    counts: dict[str, list[int]] = {}
    for entry in images:
        for d in entry["detections"]:
            if d["score"] >= score_threshold and d["outcome"] in ("tp", *TIDE_ERRORS):
                counts.setdefault(d["category"], [0, 0, 0])[0 if d["outcome"] == "tp" else 1] += 1
        for t in entry["truths"]:
            if t["outcome"] in ("tp", "fn"):
                found = t["outcome"] == "tp" and t["score"] is not None and t["score"] >= score_threshold
                counts.setdefault(t["category"], [0, 0, 0])[2] += 0 if found else 1
    return {k: (v[0], v[1], v[2]) for k, v in counts.items()}


def per_image_rows(images: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results_per_image.csv``: one row per truth and per detection of ``results_per_image.json``."""
    rows = []
    for entry in images:
        for kind, key, other in (("truth", "truths", "detection"), ("detection", "detections", "truth")):
            for n, obj in enumerate(entry[key]):
                x, y, w, h = obj["bbox"]
                rows.append({"image_id": entry["image_id"], "file_name": entry["file_name"], "kind": kind, "index": n,
                             "category": obj["category"], "score": obj.get("score"), "outcome": obj["outcome"],
                             "error": obj.get("error"), "iou": obj.get("iou"), "size": obj["size"],
                             "x": x, "y": y, "w": w, "h": h, "match": obj.get(other)})
    return rows
