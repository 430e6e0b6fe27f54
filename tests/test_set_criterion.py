"""DETR set criterion: named terms, weights in one place, finite with no targets, perfect = 0."""

from __future__ import annotations

import math

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
    assert {"loss_ce", "loss_bbox", "loss_giou", "cardinality_error",
            "loss_ce_0", "loss_bbox_0", "loss_giou_0"} == set(terms)
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


# --- denoising, encoder-selection and one-to-many terms ----------------------------------------------

GT = {"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])}
NO_GT = {"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}
PERFECT, SHIFTED = [0.5, 0.5, 0.2, 0.2], [0.6, 0.5, 0.2, 0.2]  # SHIFTED: L1 0.1, GIoU 1/3 (by hand)


def _dn_case(focal: bool, garbage: float = 0.0):
    """Image 0: one target, 2 denoising groups with negatives ([pos, neg] per group); image 1: no
    target, so both of its slots per group are padding (their rows get ``garbage`` values)."""
    c = 2 if focal else 3
    rows = [[0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    logits = torch.tensor([[r[:c] for r in rows], [[garbage] * c] * 4])
    boxes = torch.tensor([[PERFECT, [0.2, 0.2, 0.1, 0.1], SHIFTED, [0.9, 0.9, 0.1, 0.1]],
                          [[0.5 + garbage / 100, 0.5, 0.1, 0.1]] * 4])
    meta = {"groups": 2, "group_size": 2,
            "positive": [(torch.tensor([0, 2]), torch.tensor([0, 0])), (torch.empty(0, dtype=torch.int64),) * 2],
            "negative": [torch.tensor([1, 3]), torch.empty(0, dtype=torch.int64)]}
    aux = {"pred_logits": logits.clone(), "pred_boxes": boxes.clone()}
    dn = {"pred_logits": logits, "pred_boxes": boxes, "aux_outputs": [aux]}
    main = _outputs(b=2, q=3, c=2, aux=1, focal=focal)
    return {**main, "dn_outputs": dn, "dn_meta": meta}


@pytest.mark.parametrize("focal", [False, True])
def test_denoising_terms_hand_computed(focal):
    crit = SetCriterion(2, HungarianMatcher(focal=focal), eos_coef=0.1, focal=focal, dn=True)
    terms = crit(_dn_case(focal), [GT, NO_GT], across_processes=False)
    # positives (rows 0 and 2) reconstruct target 0, normalised by 1 box x 2 groups
    assert terms["loss_dn_bbox"].item() == pytest.approx((0 + 0.1) / 2, abs=1e-6)
    assert terms["loss_dn_giou"].item() == pytest.approx((0 + (1 - 1 / 3)) / 2, abs=1e-6)
    rows = [[0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    if focal:  # sigmoid focal loss summed over rows and classes, over 2; negatives' targets are all 0
        def fl(x, y, a=0.25, g=2.0):
            p = 1 / (1 + math.exp(-x))
            pt, at = (p, a) if y else (1 - p, 1 - a)
            return -at * (1 - pt) ** g * math.log(pt)

        onehot = [[0, 1], [0, 0], [0, 1], [0, 0]]
        expected = sum(fl(x, y) for r, t in zip(rows, onehot, strict=True) for x, y in zip(r[:2], t, strict=True)) / 2
    else:  # weighted cross-entropy: classes [1, none, 1, none], weights [1, 0.1, 1, 0.1]
        classes, weights = [1, 2, 1, 2], [1.0, 0.1, 1.0, 0.1]
        nll = [math.log(sum(math.exp(v) for v in r)) - r[k] for r, k in zip(rows, classes, strict=True)]
        expected = sum(w * n for w, n in zip(weights, nll, strict=True)) / sum(weights)
    assert terms["loss_dn_ce"].item() == pytest.approx(expected, abs=1e-6)
    assert terms["loss_dn_ce_0"].item() == pytest.approx(expected, abs=1e-6)  # aux layer: same values
    # padding slots are ignored
    other = crit(_dn_case(focal, garbage=7.0), [GT, NO_GT], across_processes=False)
    assert all(torch.equal(terms[k], other[k]) for k in terms if "dn" in k)
    # the main terms do not depend on the denoising outputs
    plain = _dn_case(focal)
    del plain["dn_outputs"], plain["dn_meta"]
    alone = crit(plain, [GT, NO_GT], across_processes=False)
    assert set(alone) == {"loss_ce", "loss_bbox", "loss_giou", "cardinality_error", "loss_ce_0", "loss_bbox_0",
                          "loss_giou_0"}
    assert all(torch.equal(alone[k], terms[k]) for k in alone)


def test_denoising_terms_zero_without_targets_and_in_the_weighted_total():
    crit = SetCriterion(2, HungarianMatcher(), dn=True, enc=True)
    case = _dn_case(False)
    case["dn_meta"] = {"groups": 2, "group_size": 0, "positive": [(torch.empty(0, dtype=torch.int64),) * 2] * 2,
                       "negative": [torch.empty(0, dtype=torch.int64)] * 2}
    case["dn_outputs"] = {k: v[:, :0] if torch.is_tensor(v) else [{kk: vv[:, :0] for kk, vv in v[0].items()}]
                          for k, v in case["dn_outputs"].items()}
    terms = crit(case, [NO_GT, NO_GT], across_processes=False)
    assert all(terms[k] == 0 for k in ("loss_dn_ce", "loss_dn_bbox", "loss_dn_giou", "loss_dn_ce_0"))
    terms = crit(_dn_case(False), [GT, NO_GT], across_processes=False)
    weights = crit.weight_dict(num_aux=1)
    assert weights["loss_dn_ce"] == weights["loss_ce"] and weights["loss_dn_bbox_0"] == 5.0
    assert weights["loss_enc_giou"] == 2.0 and "loss_enc_giou_0" not in weights
    weighted = sum(weights[k] * terms[k].item() for k in terms if k in weights)
    assert crit.total(terms, 1).item() == pytest.approx(weighted)
    assert crit.total(terms, 1) > crit.total({k: v for k, v in terms.items() if "dn" not in k}, 1)
    with pytest.raises(KeyError, match="no dn_meta"):
        crit({k: v for k, v in _dn_case(False).items() if k != "dn_meta"}, [GT, NO_GT], across_processes=False)
    with pytest.raises(ValueError, match="carry dn_outputs .* build SetCriterion with dn=True"):
        SetCriterion(2, HungarianMatcher())(_dn_case(False), [GT, NO_GT], across_processes=False)
    assert set(SetCriterion(2, HungarianMatcher()).weight_dict(2)) == {
        f"loss_{k}{s}" for k in ("ce", "bbox", "giou") for s in ("", "_0", "_1")}


def _set(boxes, classes, c=1):
    """One image's set: each query sure of its class (``c`` = "no object" for a softmax head)."""
    logits = torch.full((1, len(boxes), c + 1), -10.0)
    for i, k in enumerate(classes):
        logits[0, i, k] = 10.0
    return {"pred_logits": logits, "pred_boxes": torch.tensor([boxes])}


def test_o2m_group_detr_sums_independent_matchings_hybrid_repeats_the_targets():
    far = [0.1, 0.1, 0.05, 0.05]
    gt = [{"labels": torch.tensor([0]), "boxes": torch.tensor([PERFECT])}]
    main = _set([PERFECT, far], [0, 1])
    group_a, group_b = _set([far, PERFECT], [1, 0]), _set([SHIFTED, far], [0, 1])
    crit = SetCriterion(1, HungarianMatcher(), o2m=True)
    terms = crit({**main, "o2m_outputs": [group_a, group_b]}, gt, across_processes=False)
    # Group DETR: each group matched on its own (A: query 1, perfect; B: query 0, shifted), summed
    assert terms["loss_o2m_bbox"].item() == pytest.approx(0 + 0.1, abs=1e-6)
    assert terms["loss_o2m_giou"].item() == pytest.approx(0 + 2 / 3, abs=1e-6)
    assert terms["loss_bbox"].item() == pytest.approx(0, abs=1e-6)
    # H-DETR: one set (A and B together) matched to the target repeated twice, normalised by 2 boxes
    hybrid = {k: torch.cat([group_a[k], group_b[k]], dim=1) for k in group_a}
    crit2 = SetCriterion(1, HungarianMatcher(), o2m=True, o2m_repeat=2)
    terms2 = crit2({**main, "o2m_outputs": [hybrid]}, gt, across_processes=False)
    assert terms2["loss_o2m_bbox"].item() == pytest.approx((0 + 0.1) / 2, abs=1e-6)
    assert terms2["loss_o2m_giou"].item() == pytest.approx((0 + 2 / 3) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="o2m_repeat must be >= 1"):
        SetCriterion(1, HungarianMatcher(), o2m_repeat=0)


def test_encoder_selection_terms_are_matched_like_the_decoder():
    gt = [{"labels": torch.tensor([0]), "boxes": torch.tensor([PERFECT])}]
    far = [0.1, 0.1, 0.05, 0.05]
    out = {**_set([PERFECT, far], [0, 1]), "enc_outputs": _set([far, SHIFTED], [1, 0])}
    terms = SetCriterion(1, HungarianMatcher(), enc=True)(out, gt, across_processes=False)
    assert terms["loss_enc_bbox"].item() == pytest.approx(0.1, abs=1e-6)
    assert terms["loss_enc_giou"].item() == pytest.approx(2 / 3, abs=1e-6)
    assert {k for k in terms if "enc" in k} == {"loss_enc_ce", "loss_enc_bbox", "loss_enc_giou"}


def test_dense_assignment_hand_computed():
    """FCOS's rule on a 4 x 4 grid: inside the smallest box, each box owns its nearest token,
    padding never assigned."""
    from vision_attn.losses.set_criterion import dense_assignment
    from vision_attn.models.detr import cell_centres

    centres = cell_centres((4, 4))
    boxes = torch.tensor([[0.25, 0.25, 0.5, 0.5], [0.3, 0.3, 0.2, 0.2], [0.9, 0.9, 0.01, 0.01]])
    expected = torch.tensor([[0, 0, -1, -1], [0, 1, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, 2]]).flatten()
    assert torch.equal(dense_assignment(centres, boxes), expected)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[3, 3] = mask[0, 0] = False  # the tiny box's token and box 0's nearest are padding
    owner = dense_assignment(centres, boxes, mask.flatten()).reshape(4, 4)
    assert owner[3, 3] == -1 and owner[0, 0] == -1
    assert owner[2, 3] == 2  # the tiny box takes its nearest real token (first of two at the same distance)
    assert (owner == 0).sum() == 2 and (owner == 1).sum() == 1
    assert torch.equal(dense_assignment(centres, torch.zeros(0, 4)), torch.full((16,), -1))


@pytest.mark.parametrize("focal", [False, True])
def test_dense_terms_against_a_per_token_reference(focal):
    """``loss_dense_*``: every token's class against its assigned label (background elsewhere),
    boxes of the assigned tokens only, normalised by the number of assigned tokens."""
    from vision_attn.boxes import box_cxcywh_to_xyxy, generalized_box_iou
    from vision_attn.losses.set_criterion import dense_assignment
    from vision_attn.models.detr import cell_centres

    g = torch.Generator().manual_seed(0)
    c, n = 3, 9
    centres = cell_centres((3, 3)).expand(2, -1, -1)
    logits = torch.randn(2, n, c if focal else c + 1, generator=g)
    boxes = torch.rand(2, n, 4, generator=g) * 0.5 + 0.2
    targets = [{"labels": torch.tensor([2, 0]), "boxes": torch.tensor([[0.3, 0.3, 0.5, 0.5], [0.8, 0.8, 0.2, 0.2]])},
               {"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}]
    dense = {"pred_logits": logits, "pred_boxes": boxes, "centres": centres, "mask": None}
    crit = SetCriterion(c, HungarianMatcher(focal=focal), eos_coef=0.1, focal=focal, dense=True)
    terms = crit({**_outputs(b=2, q=3, c=c, aux=0, focal=focal), "dense_outputs": dense}, targets,
                 across_processes=False)
    owner = dense_assignment(centres[0], targets[0]["boxes"])
    assert owner.tolist() == [0, 0, -1, 0, 0, -1, -1, -1, 1]
    n_pos = 5
    ce, l1, giou = 0.0, 0.0, 0.0
    weights = 0.0
    for i in range(2):
        for t in range(n):
            o = int(owner[t]) if i == 0 else -1
            label = int(targets[0]["labels"][o]) if o >= 0 else None
            if focal:
                y = torch.zeros(c)
                if label is not None:
                    y[label] = 1
                ce += float(sigmoid_focal_loss(logits[i, t], y, 0.25, 2.0, reduction="sum"))
            else:
                k = label if label is not None else c
                w = 1.0 if label is not None else 0.1
                ce += w * float(-logits[i, t].log_softmax(-1)[k])
                weights += w
            if o >= 0:
                tb = targets[0]["boxes"][o]
                l1 += float((boxes[i, t] - tb).abs().sum())
                giou += 1 - float(generalized_box_iou(box_cxcywh_to_xyxy(boxes[i, t][None]),
                                                      box_cxcywh_to_xyxy(tb[None])))
    assert terms["loss_dense_ce"].item() == pytest.approx(ce / n_pos if focal else ce / weights, rel=1e-5)
    assert terms["loss_dense_bbox"].item() == pytest.approx(l1 / n_pos, rel=1e-5)
    assert terms["loss_dense_giou"].item() == pytest.approx(giou / n_pos, rel=1e-5)
    assert crit.weight_dict(0)["loss_dense_bbox"] == 5.0 and "loss_dense_bbox_0" not in crit.weight_dict(1)
    with pytest.raises(ValueError, match="carry dense_outputs .* build SetCriterion with dense=True"):
        SetCriterion(c, HungarianMatcher(focal=focal), focal=focal)(
            {**_outputs(b=2, q=3, c=c, aux=0, focal=focal), "dense_outputs": dense}, targets, across_processes=False)
