"""Localisation against ground truth: maps in original image pixels, the pointing game, energy.

A method's map lives on the patch grid of the *model input*; the boxes of the objects live in
the pixels of the *original image*. :func:`grid_to_image` maps the grid back through the
evaluation preprocessing (:mod:`vision_attn.data.transforms`: resize per ``crop_mode``, centre
crop or pad), so every map is compared with the boxes where they are:

- each original pixel's centre ``(x + 0.5, y + 0.5)`` is carried through the resize (scaled
  by ``resized / original`` per axis) and the crop (shifted by the crop's origin) into the
  model input; pixels that land outside it (cut off by a centre crop) get ``0``;
- the map is read there, bilinearly from the patch centres (``mode="bilinear"``, the default:
  ``F.interpolate(align_corners=False)`` sampled at that point, edges replicated) or from the
  patch containing the point (``mode="nearest"``).

Scores of one map against the boxes of the explained object (``[x0, y0, x1, y1]`` pixels):

- :func:`pointing_hit`: the map's maximum (first index in row-major order on ties) is a hit
  when its pixel's centre lies within ``tolerance`` (1) px of a box (Euclidean distance to the
  closed rectangle; inside counts as 0);
- :func:`energy_share`: the share of the map's non-negative mass on pixels whose centre lies
  inside a box (the union of the boxes; ``0`` for a map without mass).

:func:`localisation` returns both; it serves every head (the caller chooses the boxes: a
classifier's labelled class, a detection's matched ground truth, a caption word's object).
:func:`load_image_boxes` reads the boxes from a COCO instances file keyed by ``file_name``;
:func:`load_image_objects` the boxes with the objects' masks (scored by
:mod:`vision_attn.explain.segmentation`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from vision_attn.data.coco import annotation_problem, category_names, load_coco_annotations, validate_image_entry
from vision_attn.data.imageio import DEFAULT_MAX_PIXELS
from vision_attn.data.masks import ImageMask, image_mask
from vision_attn.data.transforms import CROP_MODES, LEGACY_CROP_MODE
from vision_attn.errors import DataError

__all__ = [
    "EvalGeometry",
    "Box",
    "eval_geometry",
    "grid_to_image",
    "energy_share",
    "ImageMask",
    "load_image_boxes",
    "load_image_objects",
    "localisation",
    "pointing_hit",
]

Box = tuple[float, float, float, float]
"""``(x0, y0, x1, y1)`` in pixels of the original image."""


@dataclass(frozen=True)
class EvalGeometry:
    """Where an original image lands in the model input (timm's evaluation resize and crop).

    Attributes:
        original: ``(H, W)`` of the original image.
        resized: ``(h, w)`` after the resize.
        offset: ``(top, left)`` of the crop in resized pixels (negative: padding before).
        input: ``(h, w)`` of the model input.
    """

    original: tuple[int, int]
    resized: tuple[int, int]
    offset: tuple[int, int]
    input: tuple[int, int]

    def to_input(self, y: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Original pixel coordinates (continuous, ``0`` = the image's top / left edge) ->
        model input coordinates (continuous)."""
        (h0, w0), (rh, rw), (top, left) = self.original, self.resized, self.offset
        return np.asarray(y) * rh / h0 - top, np.asarray(x) * rw / w0 - left


def _center_crop_offset(size: int, crop: int) -> int:
    """torchvision's ``center_crop`` (and timm's ``center_crop_or_pad``) along one axis: the
    crop's first index (negative: the image was padded by that much before)."""
    if crop > size:
        return -((crop - size) // 2)
    return int(round((size - crop) / 2.0))


def eval_geometry(original_hw: tuple[int, int], pre: dict[str, Any]) -> EvalGeometry:
    """The geometry of :func:`~vision_attn.data.transforms.build_eval_transform` for one image.

    Mirrors ``timm.data.transforms_imagenet_eval`` (timm 1.0): ``scale = floor(input /
    crop_pct)`` per axis; ``squash`` resizes to ``scale``; ``center`` resizes the shorter side
    to ``scale`` (torchvision's integer rule; ``ResizeKeepRatio`` for non-square inputs);
    ``border`` resizes the longer side (``ResizeKeepRatio(longest=1)``); then a centre crop
    (padding where the image is smaller) to the input size.

    Args:
        original_hw: ``(H, W)`` of the decoded original image.
        pre: the preprocessing dict (``input_size``, ``crop_pct``, ``crop_mode``).
    """
    h0, w0 = int(original_hw[0]), int(original_hw[1])
    if h0 <= 0 or w0 <= 0:
        raise ValueError(f"image size must be positive, got {original_hw}")
    _, ih, iw = (int(v) for v in pre["input_size"])
    crop_pct = float(pre.get("crop_pct", 1.0) or 0.875)  # timm: None / 0 mean its default
    mode = pre.get("crop_mode") or LEGACY_CROP_MODE
    if mode not in CROP_MODES:
        raise ValueError(f"preprocessing crop_mode must be one of {', '.join(CROP_MODES)}, got {mode!r}")
    sh, sw = math.floor(ih / crop_pct), math.floor(iw / crop_pct)
    if mode == "squash":
        rh, rw = sh, sw
    elif mode == "center" and sh == sw:  # torchvision Resize(int): the shorter side to sh
        short, long = (w0, h0) if w0 <= h0 else (h0, w0)
        new_short, new_long = sh, int(sh * long / short)
        rw, rh = (new_short, new_long) if w0 <= h0 else (new_long, new_short)
    else:  # timm ResizeKeepRatio: longest=0 (center) or 1 (border)
        ratios = (h0 / sh, w0 / sw)
        ratio = max(ratios) if mode == "border" else min(ratios)
        rh, rw = round(h0 / ratio), round(w0 / ratio)
    offset = (_center_crop_offset(rh, ih), _center_crop_offset(rw, iw))
    return EvalGeometry((h0, w0), (rh, rw), offset, (ih, iw))


def _axis_weights(n_out: int, coords: np.ndarray, size: int, cells: int, mode: str) -> np.ndarray:
    """``[n_out, cells]`` interpolation weights of the grid cells for points at input
    coordinates ``coords`` (``[n_out]``) along an axis of ``size`` input pixels; rows of points
    outside ``[0, size)`` are zero."""
    weights = np.zeros((n_out, cells), np.float64)
    inside = (coords >= 0) & (coords < size)
    rows = np.nonzero(inside)[0]
    if mode == "nearest":
        cell = np.minimum(np.floor(coords[rows] * cells / size).astype(np.int64), cells - 1)
        weights[rows, cell] = 1.0
        return weights
    g = np.clip(coords[rows] * cells / size - 0.5, 0.0, cells - 1)  # cell-centre units
    lo = np.floor(g).astype(np.int64)
    hi = np.minimum(lo + 1, cells - 1)
    frac = g - lo
    np.add.at(weights, (rows, lo), 1.0 - frac)
    np.add.at(weights, (rows, hi), frac)
    return weights


def grid_to_image(
    grid_map: np.ndarray | torch.Tensor,
    original_hw: tuple[int, int],
    pre: dict[str, Any],
    mode: Literal["bilinear", "nearest"] = "bilinear",
) -> np.ndarray:
    """A patch-grid map of the model input as a map over the original image's pixels.

    Args:
        grid_map: ``[h, w]`` (or ``[B, h, w]``) map over the patch grid of the model input.
        original_hw: ``(H, W)`` of the original image.
        pre: the preprocessing that made the model input (``task.inference_data_config()``).
        mode: ``bilinear`` (between patch centres) or ``nearest`` (the patch under the pixel).

    Returns:
        float32 ``[H, W]`` (or ``[B, H, W]``); pixels the model did not see are ``0``.
    """
    if mode not in ("bilinear", "nearest"):
        raise ValueError(f"mode must be 'bilinear' or 'nearest', got {mode!r}")
    grid = grid_map.detach().float().cpu().numpy() if isinstance(grid_map, torch.Tensor) else np.asarray(grid_map)
    if grid.ndim not in (2, 3):
        raise ValueError(f"expected a grid map [h, w] or [B, h, w], got shape {grid.shape}")
    geo = eval_geometry(original_hw, pre)
    (h0, w0), (ih, iw) = geo.original, geo.input
    gh, gw = grid.shape[-2:]
    ys, xs = geo.to_input(np.arange(h0) + 0.5, np.arange(w0) + 0.5)  # pixel centres
    wy = _axis_weights(h0, ys, ih, gh, mode)  # (H, gh)
    wx = _axis_weights(w0, xs, iw, gw, mode)  # (W, gw)
    out = np.einsum("yi,...ij,xj->...yx", wy, grid.astype(np.float64), wx)  # (..., H, W)
    return out.astype(np.float32)


def _as_boxes(boxes: Sequence[Sequence[float]]) -> np.ndarray:
    arr = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if not np.isfinite(arr).all() or (arr[:, 2] < arr[:, 0]).any() or (arr[:, 3] < arr[:, 1]).any():
        raise ValueError(f"boxes must be finite [x0, y0, x1, y1] with x1 >= x0, y1 >= y0, got {arr.tolist()}")
    return arr


def pointing_hit(image_map: np.ndarray, boxes: Sequence[Sequence[float]], tolerance: float = 1.0) -> bool:
    """Whether the maximum of ``image_map`` (``[H, W]``, first index on ties) lies within
    ``tolerance`` px of one of ``boxes`` (``[x0, y0, x1, y1]`` pixels): the Euclidean distance
    from the maximum pixel's centre to the closed box is at most ``tolerance``."""
    arr = np.asarray(image_map)
    if arr.ndim != 2:
        raise ValueError(f"expected a map [H, W], got shape {arr.shape}")
    b = _as_boxes(boxes)
    if len(b) == 0:
        return False
    r, c = np.unravel_index(int(np.argmax(arr)), arr.shape)  # argmax: first index on ties
    cx, cy = c + 0.5, r + 0.5
    dx = np.maximum.reduce([b[:, 0] - cx, np.zeros(len(b)), cx - b[:, 2]])
    dy = np.maximum.reduce([b[:, 1] - cy, np.zeros(len(b)), cy - b[:, 3]])
    return bool((dx * dx + dy * dy <= tolerance * tolerance).any())


def box_mask(boxes: Sequence[Sequence[float]], shape: tuple[int, int]) -> np.ndarray:
    """``bool [H, W]``: pixels whose centre lies inside (or on the edge of) one of ``boxes``."""
    h, w = shape
    b = _as_boxes(boxes)
    cy, cx = np.arange(h)[:, None] + 0.5, np.arange(w)[None, :] + 0.5
    mask = np.zeros((h, w), bool)
    for x0, y0, x1, y1 in b:
        mask |= (cx >= x0) & (cx <= x1) & (cy >= y0) & (cy <= y1)
    return mask


def energy_share(image_map: np.ndarray, boxes: Sequence[Sequence[float]]) -> float:
    """The share of ``image_map``'s non-negative mass on pixels inside ``boxes`` (their union;
    see :func:`box_mask`); ``0`` for a map without positive mass."""
    arr = np.clip(np.asarray(image_map, dtype=np.float64), 0, None)
    if arr.ndim != 2:
        raise ValueError(f"expected a map [H, W], got shape {arr.shape}")
    total = arr.sum()
    if total <= 0:
        return 0.0
    return float(arr[box_mask(boxes, arr.shape)].sum() / total)


def localisation(image_map: np.ndarray, boxes: Sequence[Sequence[float]], tolerance: float = 1.0
                 ) -> tuple[bool, float]:
    """``(pointing hit, energy share)`` of one map in original image pixels against the boxes
    of the object it explains.

    Args:
        image_map: ``[H, W]`` map in the original image's pixels.
        boxes: ``[x0, y0, x1, y1]`` boxes of the object, in the same pixels.
        tolerance: pixels the map's maximum may lie outside a box and still count as a hit.
    """
    return pointing_hit(image_map, boxes, tolerance), energy_share(image_map, boxes)


def load_image_boxes(path: str | Path) -> dict[str, list[tuple[str, Box]]]:
    """Boxes of a COCO instances file per image: ``{file_name: [(category name, (x0, y0, x1,
    y1))]}``, ``file_name`` as written (with ``/``; for classification data: the image's path
    relative to the data root, as ``predictions.json`` names it).

    Args:
        path: the instances file.

    Raises:
        DataError: an unreadable or malformed file (the message names the file and entry).
    """
    return {f: [(name, box) for name, box, _ in objects] for f, objects in load_image_objects(path).items()}


def load_image_objects(path: str | Path) -> dict[str, list[tuple[str, Box, ImageMask | None]]]:
    """The objects of a COCO instances file per image: ``{file_name: [(category name, box,
    mask)]}`` as :func:`load_image_boxes` reads them, with each object's mask
    (:class:`ImageMask`, decoded when asked for) when it has a ``segmentation``, else ``None``.

    Raises:
        DataError: an unreadable or malformed file (the message names the file and entry).
    """
    path = Path(path).expanduser()
    data = load_coco_annotations(path)
    names = category_names(data.get("categories"), path,
                           f"annotation file {path} has no categories; the boxes need category names",
                           invalid="needs an integer 'id' and a 'name'")
    files: dict[int, str] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for im in data["images"]:
        validate_image_entry(im, path)
        files[im["id"]] = Path(im["file_name"]).as_posix()
        sizes[im["id"]] = (im.get("height"), im.get("width"))
    out: dict[str, list[tuple[str, Box, ImageMask | None]]] = {f: [] for f in files.values()}
    for a in data["annotations"]:
        reason, box = annotation_problem(a, files, names)
        if reason in ("not an object", "unknown image id"):
            raise DataError(f"{path}: annotation {str(a)[:80]} names no image of the file ('image_id')")
        if reason == "unknown category id":
            raise DataError(f"{path}: annotation id {a.get('id')} has category_id {a.get('category_id')!r}, "
                            "which is not in 'categories'")
        if reason is not None and (reason != "zero or negative size" or min(box[2:]) < 0):  # a size of 0 is a box
            raise DataError(f"{path}: annotation id {a.get('id')} has bbox {str(a.get('bbox'))[:80]}; expected "
                            "[x, y, width, height] in pixels, finite, width and height >= 0")
        x, y, w, h = box
        mask = None
        if a.get("segmentation") is not None:
            mask = image_mask(a["segmentation"], *sizes[a["image_id"]], f"{path}: annotation id {a.get('id')}")
            if mask is None:
                raise DataError(f"{path}: annotation id {a.get('id')} has a 'segmentation' but its image has no "
                                f"whole-number 'height' and 'width' (at most {DEFAULT_MAX_PIXELS} pixels); add them "
                                "to the image entry")
        out[files[a["image_id"]]].append((names[a["category_id"]], (x, y, x + w, y + h), mask))
    return out
