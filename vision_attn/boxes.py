"""Box formats and overlaps, in one place.

Formats: ``cxcywh`` (centre x, centre y, width, height — what the DETR head predicts, in
``[0, 1]`` of the image), ``xyxy`` (corners) and ``xywh`` (COCO: top-left corner and size, in
pixels). All functions work on ``[..., 4]`` tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def box_xyxy_to_cxcywh(b: Tensor) -> Tensor:
    x0, y0, x1, y1 = b.unbind(-1)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def box_xywh_to_xyxy(b: Tensor) -> Tensor:
    x, y, w, h = b.unbind(-1)
    return torch.stack([x, y, x + w, y + h], dim=-1)


def box_xyxy_to_xywh(b: Tensor) -> Tensor:
    x0, y0, x1, y1 = b.unbind(-1)
    return torch.stack([x0, y0, x1 - x0, y1 - y0], dim=-1)


def box_area(b: Tensor) -> Tensor:
    """Area of ``xyxy`` boxes (0 for degenerate ones)."""
    return (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)


def _inter_union(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    lt = torch.max(a[:, None, :2], b[None, :, :2])  # (N, M, 2)
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(dim=-1)
    union = box_area(a)[:, None] + box_area(b)[None, :] - inter
    return inter, union


def box_iou(a: Tensor, b: Tensor, eps: float = 1e-7) -> Tensor:
    """Pairwise IoU ``[N, M]`` of ``xyxy`` boxes."""
    inter, union = _inter_union(a, b)
    return inter / union.clamp(min=eps)


def generalized_box_iou(a: Tensor, b: Tensor, eps: float = 1e-7) -> Tensor:
    """Pairwise generalised IoU ``[N, M]`` (Rezatofighi et al. 2019) of ``xyxy`` boxes, in ``[-1, 1]``."""
    inter, union = _inter_union(a, b)
    iou = inter / union.clamp(min=eps)
    lt = torch.min(a[:, None, :2], b[None, :, :2])
    rb = torch.max(a[:, None, 2:], b[None, :, 2:])
    hull = (rb - lt).clamp(min=0).prod(dim=-1)
    return iou - (hull - union) / hull.clamp(min=eps)
