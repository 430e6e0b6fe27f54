"""DEIM's matchability-aware loss: equal to a hand computation, in the set criterion of a focal
head (and refused without one)."""

from __future__ import annotations

import math

import pytest
import torch

from vision_attn.errors import ConfigError
from vision_attn.losses.set_criterion import box_iou_pairs, matchability_aware_loss


def _bce(logit: float, target: float) -> float:
    p = 1 / (1 + math.exp(-logit))
    return -(target * math.log(p) + (1 - target) * math.log(1 - p))


def test_equals_a_hand_computation():
    """One image, two queries, two classes; query 0 matched to class 1 with IoU 0.64, gamma 1.5:
    its class-1 logit has target 0.64^1.5 = 0.512 at weight 1; every other logit target 0 at
    weight sigmoid(logit)^1.5."""
    logits = torch.tensor([[[0.3, 1.2], [-0.7, 2.0]]], dtype=torch.float64)
    loss = matchability_aware_loss(logits, (torch.tensor([0]), torch.tensor([0]), torch.tensor([1])),
                                   torch.tensor([0.64], dtype=torch.float64), gamma=1.5)

    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    expected = _bce(1.2, 0.64 ** 1.5)
    for x in (0.3, -0.7, 2.0):
        expected += sig(x) ** 1.5 * _bce(x, 0.0)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # a better-fitting box asks for more confidence: at IoU 1 the target is 1
    full = matchability_aware_loss(logits, (torch.tensor([0]), torch.tensor([0]), torch.tensor([1])),
                                   torch.tensor([1.0], dtype=torch.float64), gamma=1.5)
    assert full.item() == pytest.approx(expected - _bce(1.2, 0.512) + _bce(1.2, 1.0), rel=1e-12)


def test_pairwise_iou():
    a = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 1.0, 1.0]])
    b = torch.tensor([[1.0, 0.0, 3.0, 2.0], [2.0, 2.0, 3.0, 3.0]])
    assert box_iou_pairs(a, b).tolist() == pytest.approx([2 / 6, 0.0])


def test_detector_trains_with_it_and_refuses_it_without_a_focal_head(tiny_encoder):
    from vision_attn.models.detr import DETRConfig
    from vision_attn.tasks import DetectionTask
    from vision_attn.tasks.detection import SetLossConfig

    head = DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2, focal=True)
    torch.manual_seed(0)
    task = DetectionTask(tiny_encoder, num_classes=2, head=head, loss=SetLossConfig(mal_gamma=1.5))
    plain = DetectionTask(tiny_encoder, num_classes=2, head=head, loss=SetLossConfig())
    plain.load_state_dict(task.state_dict())
    images = torch.randn(2, 3, 32, 32)
    targets = [{"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.3]])},
               {"labels": torch.tensor([0, 1]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.2, 0.3]])}]
    out = task(images)
    mal = task.criterion(out, targets)
    focal = plain.criterion(plain(images), targets)
    assert torch.isfinite(mal["loss_ce"]) and mal["loss_ce"].item() != pytest.approx(focal["loss_ce"].item())
    assert mal["loss_bbox"].item() == pytest.approx(focal["loss_bbox"].item())  # only the class term changes
    mal["loss_ce"].backward()
    assert task.head.class_heads[0].weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="model.loss.mal_gamma"):
        DetectionTask(tiny_encoder, num_classes=2, head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1,
                                                                   num_heads=2), loss=SetLossConfig(mal_gamma=1.5))
