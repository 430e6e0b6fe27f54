"""Box formats and overlaps, in one place, on ``torchvision.ops``.

Formats: ``cxcywh`` (centre x, centre y, width, height — what the DETR head predicts, in
``[0, 1]`` of the image), ``xyxy`` (corners) and ``xywh`` (COCO: top-left corner and size, in
pixels). The conversions work on ``[..., 4]`` tensors (``torchvision.ops.box_convert``).
:func:`box_iou` and :func:`generalized_box_iou` are torchvision's: pairwise ``[..., N, M]`` of
``xyxy`` boxes ``[..., N, 4]`` and ``[..., M, 4]``, areas and results in float32 at least; two
zero-area boxes have no IoU (NaN), which the DETR losses never meet (their targets have an area).
"""

from __future__ import annotations

from torch import Tensor
from torchvision.ops import box_convert, box_iou, generalized_box_iou

__all__ = [
    "box_area",
    "box_cxcywh_to_xyxy",
    "box_iou",
    "box_xywh_to_xyxy",
    "box_xyxy_to_cxcywh",
    "box_xyxy_to_xywh",
    "generalized_box_iou",
]


def box_cxcywh_to_xyxy(b: Tensor) -> Tensor:
    return box_convert(b, "cxcywh", "xyxy")


def box_xyxy_to_cxcywh(b: Tensor) -> Tensor:
    return box_convert(b, "xyxy", "cxcywh")


def box_xywh_to_xyxy(b: Tensor) -> Tensor:
    return box_convert(b, "xywh", "xyxy")


def box_xyxy_to_xywh(b: Tensor) -> Tensor:
    return box_convert(b, "xyxy", "xywh")


def box_area(b: Tensor) -> Tensor:
    """Area of ``xyxy`` boxes ``[..., 4]``, 0 for degenerate ones (``x1 < x0``); torchvision's
    ``box_area`` would give a negative area there, so this one stays ours."""
    return (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)
