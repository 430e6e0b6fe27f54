"""Where a detector's AP goes: TIDE's error split (Bolya et al. 2020, "TIDE: A General Toolbox for
Identifying Object Detection Errors").

Every detection is matched at IoU ``pos_threshold`` (0.5) to a ground-truth box of its class,
best score first, each box taken once. A detection that matched none is an error of one kind,
tested in this order:

- **loc**: its class's best box overlaps it by at least ``bg_threshold`` (0.1) but less than
  ``pos_threshold`` (it found the object, the box is off);
- **cls**: a box of another class overlaps it by ``pos_threshold`` or more (right place, wrong
  class);
- **dupe**: a box of its class that a better detection already took overlaps it by
  ``pos_threshold`` or more;
- **bkg**: no box of any class overlaps it by more than ``bg_threshold``;
- **both**: the rest (a box of another class overlaps it, but not enough for either test).

A ground-truth box no detection took is **miss** unless a ``cls`` or ``loc`` detection could take
it (then fixing that error recovers it). Crowd regions (``iscrowd``) are ignore regions: a
detection covering one (intersection over the detection's area above ``pos_threshold``, its
class or any) does not count in AP.

The **dAP** of an error type is the AP gained by fixing only the errors of that type, the AP at
``pos_threshold`` computed as TIDE computes it (per class, 101 recall points, the mean over the
classes with ground truth or detections): a ``cls`` detection becomes a true positive of the box's
class and a ``loc`` one of its own class (each box fixed once, by its best-scoring such detection;
the others are dropped), ``dupe``, ``bkg`` and ``both`` detections are dropped, and a missed box is
taken out of the ground truth. **fp** is the AP gained when every false positive scores below
every true positive, **fn** when every box not found is taken out. The numbers equal those of the
``tidecv`` package (its version 1.0.1) on the same boxes, as fractions (``tidecv`` prints them
times 100).

    result = tide_errors(image_ids, annotations, detections)
    result.metrics()   # {"tide_ap50", "tide_cls", ..., "tide_fp", "tide_fn", "tide_count_cls", ...}
    result.detections  # per detection: its outcome ("tp", an error type or "ignored"), IoU, box taken
    result.truths      # per ground-truth box: "tp" (and by which detection) or "fn" with its kind
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pycocotools import mask as mask_utils

__all__ = ["TIDE_ERRORS", "TideResult", "tide_errors"]

TIDE_ERRORS: tuple[str, ...] = ("cls", "loc", "both", "dupe", "bkg", "miss")
"""TIDE's main error types, in the order of its bar chart."""
SPECIAL_ERRORS: tuple[str, ...] = ("fp", "fn")


@dataclass
class _Error:
    kind: str
    cls: int  # the class of the original data point (a missed box: its class)
    det: int | None = None  # the detection's index (None: a missed box)
    gt: int | None = None  # the box a cls / loc error would take
    score: float = 0.0
    counted: bool = True  # False: the detection covers a crowd region (not in AP before fixing)


@dataclass
class _Class:
    points: dict[int, tuple[float, bool]] = field(default_factory=dict)  # detection index -> (score, correct)
    positives: int = 0

    def empty(self) -> bool:
        return not self.points and self.positives == 0


def _ap(cls: _Class) -> float:
    """AP of one class: precision made monotone, read at 101 recall points (nearest recall at or above)."""
    if cls.positives == 0:
        return 0.0
    ordered = sorted(cls.points.values(), key=lambda p: -p[0])  # stable: ties keep their order
    correct = np.array([c for _, c in ordered], dtype=bool)
    if correct.size == 0:
        return 0.0
    tp = np.cumsum(correct)
    precision = tp / np.arange(1, correct.size + 1)
    recall = tp / cls.positives
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    at = np.searchsorted(recall, np.arange(101) / 100, side="left")  # k / 100 exactly, as TIDE reads them
    values = np.where(at < precision.size, precision[np.minimum(at, precision.size - 1)], 0.0)
    return float(values.mean())


def _mean_ap(classes: dict[int, _Class]) -> float:
    aps = [_ap(c) for c in classes.values() if not c.empty()]
    return sum(aps) / len(aps) if aps else 0.0


@dataclass
class TideResult:
    """TIDE's numbers and the outcome of every detection and box (see the module docstring).

    Attributes:
        ap50: the AP at the match threshold, as TIDE computes it (a fraction).
        dap: ``{error type: dAP}`` for :data:`TIDE_ERRORS` and ``fp`` / ``fn`` (fractions; a fix
            that lowers AP, which rounding to 101 recall points can do, counts 0).
        counts: ``{error type: how many}`` for :data:`TIDE_ERRORS`.
        detections: per input detection (same order): ``{"outcome": "tp" | error type |
            "ignored" | "unscored" | "not evaluated", "error": its error type (also of an ignored
            one), "gt": index of the box it took (tp) or is confused with (cls, loc, dupe), else
            None, "iou": the IoU with that box, else the largest with any box}``; ``ignored``: it
            covers a crowd region; ``unscored``: beyond the ``max_dets`` best of its image.
        truths: per input annotation (same order): ``{"outcome": "tp" | "fn" | "crowd", "det":
            the detection that took it (tp), "error": "miss", "cls" or "loc" (fn: missed, or
            recoverable by fixing that error of a detection)}``.
    """

    ap50: float
    dap: dict[str, float]
    counts: dict[str, int]
    detections: list[dict[str, Any]]
    truths: list[dict[str, Any]]

    def metrics(self) -> dict[str, float]:
        """``metrics.json``'s entries: ``tide_ap50``, ``tide_<type>`` (dAP) and ``tide_count_<type>``."""
        out = {"tide_ap50": self.ap50}
        out.update({f"tide_{k}": v for k, v in self.dap.items()})
        out.update({f"tide_count_{k}": float(v) for k, v in self.counts.items()})
        return out


class _Run:
    """One evaluation: matching, errors and the AP of any set of fixes."""

    def __init__(self, pos: float, bg: float, max_dets: int, gt_class: dict[int, int]) -> None:
        self.pos, self.bg, self.max_dets = pos, bg, max_dets
        self.gt_class = gt_class  # annotation index -> its class
        self.classes: dict[int, _Class] = defaultdict(_Class)
        self.errors: list[_Error] = []
        self.missed_by_class: dict[int, int] = defaultdict(int)
        self.best: dict[int, tuple[float, int]] = {}  # box -> (best score, detection) of its cls / loc errors

    def image(self, gts: list[tuple[int, dict]], dets: list[tuple[int, dict]], det_out: list[dict],
              gt_out: list[dict]) -> None:
        real = [(i, a) for i, a in gts if not a.get("iscrowd")]
        crowd = [(i, a) for i, a in gts if a.get("iscrowd")]
        for _, a in real:
            self.classes[int(a["category_id"])].positives += 1
        for i, _ in crowd:
            gt_out[i].update(outcome="crowd")
        dets = sorted(dets, key=lambda d: -float(d[1]["score"]))  # stable: ties keep the file's order
        for i, _ in dets[self.max_dets :]:
            det_out[i].update(outcome="unscored")
        dets = dets[: self.max_dets]
        used_gt = np.zeros(len(real), dtype=bool)
        usable = np.zeros(len(real), dtype=bool)
        taken_by = [-1] * len(real)
        if not dets:
            for i, a in real:
                self._miss(i, a, gt_out)
            return
        boxes = [list(map(float, d["bbox"])) for _, d in dets]
        det_cls = np.array([int(d["category_id"]) for _, d in dets])
        gt_cls = np.array([int(a["category_id"]) for _, a in real])
        iou = (np.asarray(mask_utils.iou(boxes, [list(map(float, a["bbox"])) for _, a in real], [0] * len(real)))
               .reshape(len(dets), len(real)) if real else np.zeros((len(dets), 0)))
        same = det_cls[:, None] == gt_cls[None, :]
        iou_same = iou * same
        status: list[bool | None] = [False] * len(dets)
        free = iou_same.copy()
        for k in range(len(dets)):
            if real:
                g = int(free[k].argmax())
                if free[k, g] >= self.pos:
                    status[k], used_gt[g], taken_by[g] = True, True, k
                    free[:, g] = 0.0
        for _, a in crowd:
            region = list(map(float, a["bbox"]))
            cover = np.asarray(mask_utils.iou(boxes, [region], [1])).reshape(-1)
            for k in range(len(dets)):
                if status[k] is False and cover[k] > self.pos and int(a["category_id"]) in (det_cls[k], -1):
                    status[k] = None
        for k, (i, d) in enumerate(dets):
            c = int(det_cls[k])
            if status[k] is True:
                g = taken_by.index(k)
                self.classes[c].points[i] = (float(d["score"]), True)
                det_out[i].update(outcome="tp", gt=real[g][0], iou=float(iou[k, g]))
                continue
            if status[k] is False:
                self.classes[c].points[i] = (float(d["score"]), False)
            kind, g = self._kind(k, iou, iou_same, same, used_gt, bool(real))
            err = _Error(kind, c, det=i, gt=None if g is None else real[g][0], score=float(d["score"]),
                         counted=status[k] is not None)
            if kind in ("cls", "loc") and not used_gt[g]:
                usable[g] = True
                box = real[g][0]
                if box not in self.best or self.best[box][0] < err.score:
                    self.best[box] = (err.score, i)
            elif kind in ("cls", "loc"):
                err.gt = None  # the box is taken: fixing this error drops it
            self.errors.append(err)
            det_out[i].update(outcome=kind if status[k] is not None else "ignored", error=kind,
                              gt=None if g is None else real[g][0],
                              iou=float(iou[k, g] if g is not None else (iou[k].max() if real else 0.0)))
        for g, (i, a) in enumerate(real):
            if used_gt[g]:
                gt_out[i].update(outcome="tp", det=dets[taken_by[g]][0])
            elif usable[g]:
                self.missed_by_class[int(a["category_id"])] += 1
                gt_out[i].update(outcome="fn", error=None)  # filled in by finish(): the fixing error's kind
            else:
                self._miss(i, a, gt_out)

    def _kind(self, k: int, iou, iou_same, same, used_gt, any_gt: bool) -> tuple[str, int | None]:
        if not any_gt:
            return "bkg", None
        g = int(iou_same[k].argmax())
        if self.bg <= iou_same[k, g] <= self.pos:
            return "loc", g
        other = iou * ~same
        g = int(other[k].argmax())
        if other[k, g] >= self.pos:
            return "cls", g
        taken = iou_same * used_gt[None, :]
        g = int(taken[k].argmax())
        if taken[k, g] >= self.pos:
            return "dupe", g
        if float(iou[k].max()) <= self.bg:
            return "bkg", None
        return "both", None

    def _miss(self, i: int, a: dict, gt_out: list[dict]) -> None:
        c = int(a["category_id"])
        self.missed_by_class[c] += 1
        self.errors.append(_Error("miss", c, gt=i))
        gt_out[i].update(outcome="fn", error="miss")

    # ------------------------------------------------------------------ fixing
    def fixed_ap(self, fix: Callable[[_Error], bool] = lambda e: False,
                 rescore: Callable[[float, bool], float] | None = None, drop_missed: bool = False) -> float:
        positives = {c: v.positives for c, v in self.classes.items()}
        new: dict[int, _Class] = defaultdict(_Class)

        def push(c: int, i: int, score: float, correct: bool) -> None:
            new[c].points[i] = (rescore(score, correct) if rescore else score, correct)

        for e in self.errors:
            if fix(e):
                if e.kind == "miss":
                    positives[e.cls] -= 1
                elif e.kind in ("cls", "loc") and e.gt is not None and self.best[e.gt][1] == e.det:
                    push(self.gt_class[e.gt] if e.kind == "cls" else e.cls, e.det, e.score, True)
            elif e.det is not None and e.counted:
                push(e.cls, e.det, e.score, False)
        for c in positives:
            for i, (score, correct) in self.classes[c].points.items():
                if correct:
                    push(c, i, score, True)
        for c, n in positives.items():
            new[c].positives += n - (self.missed_by_class.get(c, 0) if drop_missed else 0)
        return _mean_ap(new)


def tide_errors(image_ids: Sequence[int], annotations: Sequence[dict], detections: Sequence[dict],
                pos_threshold: float = 0.5, bg_threshold: float = 0.1, max_dets: int = 100) -> TideResult:
    """TIDE's error split of COCO-format detections (see the module docstring).

    Args:
        image_ids: the evaluated images (a detection or box of another image is left out).
        annotations: ground-truth boxes ``{"image_id", "category_id", "bbox": [x, y, w, h]}`` and
            optionally ``"iscrowd"`` (an instances file's ``annotations``).
        detections: ``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}`` (a COCO
            results list, e.g. ``predictions.json``).
        pos_threshold: the IoU of a match.
        bg_threshold: at most this IoU with every box: background.
        max_dets: per image, the best this many detections are evaluated.
    """
    wanted = set(image_ids)
    run = _Run(pos_threshold, bg_threshold, max_dets, {i: int(a["category_id"]) for i, a in enumerate(annotations)})
    det_out: list[dict[str, Any]] = [{"outcome": None, "iou": 0.0, "gt": None, "error": None} for _ in detections]
    gt_out: list[dict[str, Any]] = [{"outcome": None, "det": None, "error": None} for _ in annotations]
    gts_by, dets_by = defaultdict(list), defaultdict(list)
    for i, a in enumerate(annotations):
        gts_by[a["image_id"]].append((i, a))
    for i, d in enumerate(detections):
        dets_by[d["image_id"]].append((i, d))
    for image in dict.fromkeys(image_ids):
        run.image(gts_by.get(image, []), dets_by.get(image, []), det_out, gt_out)
    for i, a in enumerate(annotations):  # boxes and detections of images not evaluated
        if a["image_id"] not in wanted:
            gt_out[i].update(outcome="not evaluated")
    for i, d in enumerate(detections):
        if d["image_id"] not in wanted:
            det_out[i].update(outcome="not evaluated")
    for box, (_, det) in run.best.items():  # a recoverable box: the kind of the error that fixes it
        if gt_out[box]["outcome"] == "fn":
            gt_out[box]["error"] = det_out[det]["error"]
    base = _mean_ap(run.classes)
    dap = {kind: max(run.fixed_ap(lambda e, kind=kind: e.kind == kind) - base, 0.0) for kind in TIDE_ERRORS}
    dap["fp"] = run.fixed_ap(rescore=lambda score, correct: 1.0 if correct else 0.0) - base
    dap["fn"] = run.fixed_ap(drop_missed=True) - base
    counts = {kind: sum(e.kind == kind for e in run.errors) for kind in TIDE_ERRORS}
    return TideResult(ap50=base, dap=dap, counts=counts, detections=det_out, truths=gt_out)
