"""Explanation maps scored against object masks, as Chefer et al. (2021) score them.

A map (in original image pixels, :func:`~vision_attn.explain.localisation.grid_to_image`) is
compared with the pixel mask of the object it explains (the union of the masks of that object's
instances: the labelled class's objects, a detection's matched object, a caption word's objects):

- the map is rescaled to ``[0, 1]`` (min-max; a constant map is all zeros) and thresholded at its
  mean: pixels above the mean are the predicted object, the rest the background;
- ``pixel_acc_<m>``: correctly labelled pixels over all pixels, summed over the items first;
- ``miou_<m>``: intersection over union of the object and of the background class (each summed
  over the items first), their mean;
- ``map_mask_<m>``: per item the average precision of the rescaled map as a score of "object"
  and of one minus it as a score of "background", their mean; the mean over the items.

Average precision is scikit-learn's ``average_precision_score`` (the precision at each distinct
score, weighted by the recall it adds), written here so that nothing beyond numpy is needed;
tests/test_segmentation_measures.py checks it against scikit-learn.

Masks come from a COCO instances file's ``segmentation`` (polygons, uncompressed or compressed
RLE; :func:`~vision_attn.data.masks.decode_segmentation`, through pycocotools).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vision_attn.data.masks import decode_segmentation  # noqa: F401 (re-exported)

__all__ = ["SegmentationScores", "average_precision", "decode_segmentation", "segmentation_counts"]


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Average precision of ``scores`` as predictions of the boolean ``labels`` (scikit-learn's
    ``average_precision_score``: sum over distinct scores, high to low, of the precision there
    times the recall it adds); ``nan`` when no label is true."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels, dtype=bool).ravel()
    positives = int(y.sum())
    if positives == 0:
        return float("nan")
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # the last index of each distinct score
    tp = np.cumsum(y)[last]
    precision = tp / (last + 1)
    recall = tp / positives
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def segmentation_counts(image_map: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
    """The counts of one map against one mask (see the module docstring): ``correct`` and
    ``labeled`` pixels, ``inter`` and ``union`` ``[background, object]``, and ``ap`` (the mean of
    the two classes' average precision; a class with no pixel is left out of that mean)."""
    arr = np.asarray(image_map, dtype=np.float64)
    truth = np.asarray(mask, dtype=bool)
    if arr.shape != truth.shape or arr.ndim != 2:
        raise ValueError(f"a map {arr.shape} and a mask {truth.shape} of one image size [H, W] are needed")
    low, high = float(arr.min()), float(arr.max())
    scaled = (arr - low) / (high - low) if high > low else np.zeros_like(arr)
    predicted = scaled > scaled.mean()
    inter = np.array([np.sum(~predicted & ~truth), np.sum(predicted & truth)], dtype=np.float64)
    union = np.array([np.sum(~predicted | ~truth), np.sum(predicted | truth)], dtype=np.float64)
    aps = [average_precision(1.0 - scaled, ~truth), average_precision(scaled, truth)]
    aps = [a for a in aps if not np.isnan(a)]
    return {"correct": float(np.sum(predicted == truth)), "labeled": float(truth.size), "inter": inter,
            "union": union, "ap": float(np.mean(aps)) if aps else 0.0}


class SegmentationScores:
    """``pixel_acc_<method>``, ``miou_<method>`` and ``map_mask_<method>`` of items' maps against
    their masks, accumulated as the module docstring says. A method given several maps per item
    (draws of the ``random`` baseline) adds each draw with weight ``1 / draws``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, dict[str, Any]] = {}
        self.count = 0

    def update(self, maps: Mapping[str, np.ndarray], masks: Sequence[np.ndarray]) -> bool:
        """Score one item against the union of ``masks`` (bool ``[H, W]`` each, the map's size);
        ``False`` (nothing added) without a mask or with an empty one."""
        if not masks:
            return False
        union = np.logical_or.reduce([np.asarray(m, dtype=bool) for m in masks])
        if not union.any():
            return False
        for method, image_map in maps.items():
            draws = np.asarray(image_map)
            draws = draws[None] if draws.ndim == 2 else draws
            acc = self.sums.setdefault(method, {"correct": 0.0, "labeled": 0.0, "inter": np.zeros(2),
                                                "union": np.zeros(2), "ap": 0.0})
            for one in draws:
                counts = segmentation_counts(one, union)
                for key in acc:
                    acc[key] = acc[key] + counts[key] / len(draws)
        self.count += 1
        return True

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if not self.count:
            return out
        for method, acc in self.sums.items():
            out[f"pixel_acc_{method}"] = acc["correct"] / acc["labeled"]
            out[f"miou_{method}"] = float(np.mean(acc["inter"] / np.maximum(acc["union"], 1e-12)))
            out[f"map_mask_{method}"] = acc["ap"] / self.count
        return out
