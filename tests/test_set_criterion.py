"""DETR set criterion: named terms, weights in one place, finite with no targets, perfect = 0."""

from __future__ import annotations

import pytest
import torch

from vision_attn.losses.matcher import HungarianMatcher
from vision_attn.losses.set_criterion import SetCriterion, sigmoid_focal_loss


def _outputs(b=2, q=5, c=3, aux=1, focal=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def one():
        return {"pred_logits": torch.randn(b, q, c if focal else c + 1, generator=g, requires_grad=True),
                "pred_boxes": torch.rand(b, q, 4, generator=g).mul(0.4).add(0.1).requires_grad_(True)}

    out = one()
    out["aux_outputs"] = [one() for _ in range(aux)]
    return out


@pytest.mark.parametrize("focal", [False, True])
def test_terms_weights_and_total(focal):
    crit = SetCriterion(3, HungarianMatcher(focal=focal), focal=focal)
    out = _outputs(focal=focal)
    targets = [{"labels": torch.tensor([0, 2]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.2]])},
               {"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.4]])}]
    terms = crit(out, targets)
    assert {"loss_ce", "loss_bbox", "loss_giou", "cardinality_error", "loss_ce_0", "loss_bbox_0", "loss_giou_0"} == set(terms)
    weights = crit.weight_dict(num_aux=1)
    assert "cardinality_error" not in weights and weights["loss_bbox_0"] == 5.0
    total = crit.total(terms, num_aux=1)
    manual = sum(weights[k] * terms[k] for k in weights)
    assert torch.allclose(total, manual)
    total.backward()
    assert out["pred_boxes"].grad is not None and torch.isfinite(out["pred_boxes"].grad).all()


@pytest.mark.parametrize("focal", [False, True])
def test_finite_with_zero_targets(focal):
    crit = SetCriterion(3, HungarianMatcher(focal=focal), focal=focal)
    out = _outputs(focal=focal)
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}] * 2
    terms = crit(out, empty)
    assert all(torch.isfinite(v) for v in terms.values())
    assert terms["loss_bbox"] == 0 and terms["loss_giou"] == 0 and terms["loss_ce"] > 0
    crit.total(terms, 1).backward()


def test_perfect_prediction_has_zero_box_loss_and_low_ce():
    crit = SetCriterion(2, HungarianMatcher(), eos_coef=0.1)
    boxes = torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.2, 0.3]])
    logits = torch.full((1, 3, 3), -20.0)
    logits[0, 0, 1] = 20.0
    logits[0, 1, 0] = 20.0
    logits[0, 2, 2] = 20.0  # the third query says "no object"
    pred_boxes = torch.cat([boxes[[1, 0]], torch.tensor([[0.5, 0.5, 0.1, 0.1]])]).unsqueeze(0)
    terms = crit({"pred_logits": logits, "pred_boxes": pred_boxes},
                 [{"labels": torch.tensor([0, 1]), "boxes": boxes}])
    assert terms["loss_bbox"] < 1e-6 and terms["loss_giou"] < 1e-6 and terms["loss_ce"] < 1e-6
    assert terms["cardinality_error"] == 0


def test_focal_loss_reference_values():
    logits = torch.tensor([0.0, 2.0])
    t = torch.tensor([1.0, 0.0])
    fl = sigmoid_focal_loss(logits, t, alpha=0.25, gamma=2.0)
    p = torch.sigmoid(logits)
    expected = torch.stack([0.25 * (1 - p[0]) ** 2 * -torch.log(p[0]), 0.75 * p[1] ** 2 * -torch.log(1 - p[1])])
    assert torch.allclose(fl, expected, atol=1e-6)


def test_focal_loss_is_torchvisions_and_alpha_is_checked_when_built():
    from torchvision.ops import sigmoid_focal_loss as tv_focal

    assert sigmoid_focal_loss is tv_focal
    with pytest.raises(ValueError, match=r"focal_alpha 1.5 must lie in \[0, 1\]"):
        SetCriterion(3, HungarianMatcher(), focal=True, focal_alpha=1.5)
