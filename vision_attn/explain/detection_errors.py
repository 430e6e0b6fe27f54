"""Missed and false detections: what the detection report shows under each explained image and
how the mistakes gallery ranks the images.

:func:`detection_errors` matches one image's detections scoring at least the threshold to its
ground-truth boxes with :func:`match_detections` (greedy in score order, as COCOeval at IoU 0.5);
a missed object is a non-crowd ground-truth box no such detection matched, a false detection one
that matched no box. :func:`split_detection_errors` does it for every image of a split from the
evaluation's COCO results, and :func:`rank_detection_errors` orders the images worst first.
"""

from __future__ import annotations

import torch

__all__ = ["detection_errors", "error_keywords", "match_detections", "rank_detection_errors",
           "split_detection_errors"]


def error_keywords(task, dataset, options) -> dict:
    """The keywords of :func:`split_detection_errors` for ``task``'s evaluation of ``dataset``: its
    category ids and class names (else the dataset's), and ``options.score_threshold`` (0.3
    without options)."""
    return {"category_ids": getattr(task, "category_ids", None) or getattr(dataset, "category_ids", None),
            "class_names": task.class_names or getattr(dataset, "class_names", None),
            "score_threshold": getattr(options, "score_threshold", 0.3)}


def detection_errors(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, truth: dict[str, torch.Tensor],
                     class_names: list[str] | None = None, score_threshold: float = 0.0,
                     iou_threshold: float = 0.5) -> dict[str, list[dict]]:
    """One image's missed ground-truth objects and false detections.

    Args:
        boxes: ``[K, 4]`` detections, xyxy pixels of the original image.
        scores: ``[K]`` their scores.
        labels: ``[K]`` their classes (``0..C-1``).
        truth: ``{"boxes" [G, 4] xyxy pixels, "labels" [G]}`` and optionally ``"iscrowd" [G]``
            (``dataset.scoring_target``).
        class_names: the names reported (default: the label numbers).
        score_threshold: detections scoring less are left out (as in the overlays).
        iou_threshold: the least IoU of a match.

    Returns:
        ``{"missed": [{"label", "box"}], "false": [{"label", "score", "box", "why"}]}``: the
        detections scoring at least ``score_threshold`` are matched best score first by
        :func:`match_detections`; ``missed`` are the non-crowd ground-truth boxes left
        unmatched (in annotation order), ``false`` the detections left unmatched (best score
        first), each with ``why``: ``"wrong class: <name>"`` when it overlaps an object of another
        class at ``iou_threshold`` or more, ``"duplicate"`` when it overlaps one of its own class
        that a better detection took, else ``"background"``. Detections that match a crowd region
        are neither (COCOeval ignores them). Boxes are ``[x0, y0, x1, y1]`` floats.
    """
    from torchvision.ops import box_iou

    def name(c: int) -> str:
        return str(class_names[c]) if class_names is not None and 0 <= c < len(class_names) else str(c)

    boxes = boxes.detach().float().reshape(-1, 4).cpu()
    scores, labels = scores.detach().double().reshape(-1).cpu(), labels.detach().reshape(-1).cpu()
    keep = (scores >= score_threshold).nonzero().flatten()
    keep = keep[scores[keep].argsort(descending=True, stable=True)]
    boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
    t_boxes = truth["boxes"].detach().float().reshape(-1, 4).cpu()
    t_labels = truth["labels"].detach().reshape(-1).cpu()
    crowd = truth.get("iscrowd")
    crowd = torch.zeros(len(t_boxes), dtype=torch.bool) if crowd is None else crowd.detach().reshape(-1).cpu() != 0
    match = match_detections(boxes, labels, t_boxes, t_labels, crowd.long())
    iou = box_iou(boxes, t_boxes) if len(boxes) and len(t_boxes) else torch.zeros(len(boxes), len(t_boxes))
    taken = {g for g in match if g >= 0}
    missed = [{"label": name(int(t_labels[g])), "box": [float(v) for v in t_boxes[g].tolist()]}
              for g in range(len(t_boxes)) if not crowd[g] and g not in taken]
    false = []
    for k, g in enumerate(match):
        if g >= 0:
            continue
        over = iou[k] >= iou_threshold
        same = over & (t_labels == labels[k])
        if bool((same & crowd).any()):
            continue  # on a crowd region of its class: ignored, as COCOeval does
        other = over & (t_labels != labels[k]) & ~crowd
        if bool(other.any()):
            g_other = int(torch.where(other, iou[k], torch.full_like(iou[k], -1.0)).argmax())
            why = f"wrong class: {name(int(t_labels[g_other]))}"
        else:
            why = "duplicate" if bool(same.any()) else "background"
        false.append({"label": name(int(labels[k])), "score": float(scores[k]),
                      "box": [float(v) for v in boxes[k].tolist()], "why": why})
    return {"missed": missed, "false": false}


def split_detection_errors(dataset, predictions, category_ids: list[int] | None = None,
                           class_names: list[str] | None = None,
                           score_threshold: float = 0.3) -> dict[int, dict[str, list[dict]]]:
    """:func:`detection_errors` of every image of ``dataset`` with missed or false detections.

    Args:
        dataset: a COCO split (``images``, ``scoring_target``).
        predictions: the evaluation's COCO results list (``predictions.json``: ``{"image_id",
            "category_id", "bbox" [x, y, w, h], "score"}``).
        category_ids: ``category_ids[label]`` is the file's id of class ``label`` (default:
            ``dataset.category_ids``).
        class_names: the names reported (default: ``dataset.class_names``).
        score_threshold: the least score of a detection counted.

    Returns:
        ``{dataset index: {"missed", "false"}}`` of the images with at least one error.
    """
    category_ids = list(category_ids or getattr(dataset, "category_ids", None) or [])
    class_names = list(class_names or getattr(dataset, "class_names", None) or [])
    label_of = {int(c): k for k, c in enumerate(category_ids)}
    per_image: dict[object, list[tuple[list[float], float, int]]] = {}
    for r in predictions or []:
        if not isinstance(r, dict) or float(r.get("score", 0.0)) < score_threshold:
            continue
        cid = int(r["category_id"])
        x, y, w, h = (float(v) for v in r["bbox"])
        per_image.setdefault(r["image_id"], []).append(([x, y, x + w, y + h], float(r["score"]),
                                                        label_of.get(cid, -1 - cid)))
    out: dict[int, dict[str, list[dict]]] = {}
    for i, im in enumerate(dataset.images):
        dets = per_image.get(im["id"], [])
        truth = dataset.scoring_target(im["id"])
        found = detection_errors(torch.tensor([d[0] for d in dets], dtype=torch.float32).reshape(-1, 4),
                                 torch.tensor([d[1] for d in dets], dtype=torch.float64),
                                 torch.tensor([d[2] for d in dets], dtype=torch.int64), truth, class_names,
                                 score_threshold)
        if found["missed"] or found["false"]:
            out[i] = found
    return out


def rank_detection_errors(errors: dict[int, dict[str, list[dict]]]) -> list[int]:
    """The images of ``errors`` (:func:`split_detection_errors`) worst first: the most missed and
    false detections, then the highest-scoring false detection, then split order."""
    def key(i: int) -> tuple[int, float, int]:
        e = errors[i]
        top = max((float(f["score"]) for f in e["false"]), default=0.0)
        return (-(len(e["missed"]) + len(e["false"])), -top, i)

    return sorted(errors, key=key)


def match_detections(boxes: torch.Tensor, labels: torch.Tensor, truth_boxes: torch.Tensor,
                     truth_labels: torch.Tensor, truth_crowd: torch.Tensor | None = None,
                     iou_threshold: float = 0.5) -> list[int]:
    """The ground-truth box each detection explains: greedy in the given (score) order, as
    COCOeval matches at one IoU threshold.

    Args:
        boxes: ``[K, 4]`` detections, xyxy pixels, best first.
        labels: ``[K]`` their classes.
        truth_boxes: ``[G, 4]`` ground-truth boxes, xyxy pixels.
        truth_labels: ``[G]`` their classes.
        truth_crowd: ``[G]`` crowd flags: crowd regions are never matched.
        iou_threshold: the least IoU of a match.

    Returns:
        Per detection the index of its ground-truth box, or ``-1``: each detection takes the
        unmatched non-crowd box of its class with the highest IoU (first on ties) when that
        IoU is at least ``iou_threshold``; each box is matched once.
    """
    from torchvision.ops import box_iou

    boxes, truth_boxes = boxes.detach().float().reshape(-1, 4).cpu(), truth_boxes.detach().float().reshape(-1, 4).cpu()
    if len(boxes) == 0:
        return []
    if len(truth_boxes) == 0:
        return [-1] * len(boxes)
    iou = box_iou(boxes, truth_boxes)  # (K, G)
    free = torch.ones(len(truth_boxes), dtype=torch.bool)
    if truth_crowd is not None:
        free &= truth_crowd.cpu().reshape(-1) == 0
    truth_labels = truth_labels.cpu().reshape(-1)
    out = []
    for k, label in enumerate(labels.cpu().reshape(-1).tolist()):
        cand = torch.where(free & (truth_labels == label), iou[k], torch.full_like(iou[k], -1.0))
        g = int(cand.argmax())
        if float(cand[g]) >= iou_threshold:
            free[g] = False
            out.append(g)
        else:
            out.append(-1)
    return out
