"""Box conversions and overlaps against torchvision.ops."""

from __future__ import annotations

import torch
from torchvision.ops import box_convert
from torchvision.ops import box_iou as tv_box_iou
from torchvision.ops import generalized_box_iou as tv_giou

from vision_attn.boxes import (
    box_cxcywh_to_xyxy,
    box_iou,
    box_xywh_to_xyxy,
    box_xyxy_to_cxcywh,
    box_xyxy_to_xywh,
    generalized_box_iou,
)


def _boxes(n, seed):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g)
    wh = torch.rand(n, 2, generator=g) * 0.5 + 0.01
    return torch.cat([xy, xy + wh], dim=1)


def test_round_trips_and_torchvision_parity():
    b = _boxes(10, 0)
    assert torch.allclose(box_cxcywh_to_xyxy(box_xyxy_to_cxcywh(b)), b, atol=1e-6)
    assert torch.allclose(box_xywh_to_xyxy(box_xyxy_to_xywh(b)), b, atol=1e-6)
    assert torch.allclose(box_xyxy_to_cxcywh(b), box_convert(b, "xyxy", "cxcywh"), atol=1e-6)
    assert torch.allclose(box_xyxy_to_xywh(b), box_convert(b, "xyxy", "xywh"), atol=1e-6)
    assert box_xyxy_to_cxcywh(torch.tensor([0.0, 0.0, 2.0, 4.0])).tolist() == [1.0, 2.0, 2.0, 4.0]


def test_iou_and_giou_match_torchvision():
    a, b = _boxes(7, 1), _boxes(5, 2)
    assert torch.allclose(box_iou(a, b), tv_box_iou(a, b), atol=1e-6)
    assert torch.allclose(generalized_box_iou(a, b), tv_giou(a, b), atol=1e-6)
    same = generalized_box_iou(a, a).diagonal()
    assert torch.allclose(same, torch.ones(7), atol=1e-6)
    far = generalized_box_iou(torch.tensor([[0.0, 0, 1, 1]]), torch.tensor([[3.0, 3, 4, 4]]))
    assert -1 <= far.item() < 0


def test_overlaps_are_torchvision_ops_batched_and_at_least_float32():
    a, b = _boxes(4, 3), _boxes(3, 4)
    batched = generalized_box_iou(torch.stack([a, a]), torch.stack([b, b]))  # [..., N, 4] inputs
    assert batched.shape == (2, 4, 3) and torch.allclose(batched[1], tv_giou(a, b))
    half = box_iou(a.bfloat16(), b.bfloat16())
    assert half.dtype == torch.float32  # areas and IoU of bf16 boxes in float32 (torchvision's upcast)
    assert torch.allclose(half, tv_box_iou(a, b), atol=1e-2)
