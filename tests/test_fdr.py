"""D-FINE's fine-grained distribution refinement: the offsets by hand, the expected offsets equal
to the box they decode, the localisation and self-distillation losses equal to hand
computations, and the head and set criterion with it (a detector that learns a box through it)."""

from __future__ import annotations

import math

import pytest
import torch

from vision_attn.models.detr import DETRConfig, DETRHead
from vision_attn.models.fdr import (
    decode_edges,
    distillation_loss,
    edge_offsets,
    encode_edges,
    localization_loss,
    two_bin_targets,
)


def test_offsets_by_hand():
    # N = 4: t = -1, 0, 1 for n = 1, 2, 3 -> [-2a, -a, 0, a, 2a]
    assert edge_offsets(4, 0.5, 0.25).tolist() == pytest.approx([-1.0, -0.5, 0.0, 0.5, 1.0])
    # N = 6: t = -1, -1/2, 0, 1/2, 1; W(2) = -c ((a / c + 1) ** 0.5 - 1)
    w = edge_offsets(6, 0.5, 0.25).tolist()
    inner = 0.25 * (math.sqrt(3.0) - 1)
    assert w == pytest.approx([-1.0, -0.5, -inner, 0.0, inner, 0.5, 1.0])
    w = edge_offsets(32, 0.5, 0.25)
    assert bool((w.diff() > 0).all()) and torch.allclose(w, -w.flip(0))
    # finer near 0 than at the ends
    assert float(w[17] - w[16]) < float(w[30] - w[29]) / 2
    for bad in ((5, 0.5, 0.25), (2, 0.5, 0.25), (8, 0.0, 0.25), (8, 0.5, -1.0)):
        with pytest.raises(ValueError, match="fdr_"):
            edge_offsets(*bad)


def test_expected_offsets_equal_the_box_they_decode():
    """The two-bin distribution of each edge's true offset has exactly that offset as its
    expectation: decoding it gives the target box back."""
    g = torch.Generator().manual_seed(0)
    w = edge_offsets(32, 0.5, 0.25).double()
    initial = torch.cat([torch.rand(50, 2, generator=g, dtype=torch.float64) * 0.6 + 0.2,
                         torch.rand(50, 2, generator=g, dtype=torch.float64) * 0.3 + 0.1], -1)
    # targets within reach of the offsets: each edge moved by at most 0.9 of the box's size
    target = initial + (torch.rand(50, 4, generator=g, dtype=torch.float64) - 0.5) * initial[:, 2:].repeat(1, 2) * 0.6
    offsets = encode_edges(initial, target)
    k, r = two_bin_targets(offsets, w)
    assert bool((r >= 0).all() and (r <= 1).all()) and bool((w[k] <= offsets).all() and (offsets <= w[k + 1]).all())
    probs = torch.zeros(50, 4, 33, dtype=torch.float64)
    probs.scatter_(-1, k[..., None], (1 - r)[..., None])
    probs.scatter_add_(-1, k[..., None] + 1, r[..., None])
    assert torch.allclose(decode_edges(initial, probs, w), target, atol=1e-12)
    # the uniform distribution's expectation is 0: the initial box itself
    assert torch.allclose(decode_edges(initial, torch.full_like(probs, 1 / 33), w), initial, atol=1e-12)
    # an offset beyond the outer ones is clamped to them
    k, r = two_bin_targets(torch.tensor([5.0, -5.0], dtype=torch.float64), w)
    assert k.tolist() == [31, 0] and r.tolist() == [1.0, 0.0]


def test_localization_loss_by_hand():
    w = edge_offsets(4, 0.5, 0.25).double()  # [-1, -0.5, 0, 0.5, 1]
    initial = torch.tensor([[0.5, 0.5, 0.2, 0.2]], dtype=torch.float64)
    # left edge 0.35 (offset (0.5 - 0.35) / 0.2 - 0.5 = 0.25: bins 2, 3, r = 0.5); top 0.4 (offset 0:
    # bin 2, r = 0); right 0.6 (offset 0); bottom 0.65 (offset 0.25)
    target = torch.tensor([[0.475, 0.525, 0.25, 0.25]], dtype=torch.float64)
    logits = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 0.0, 2.0, 0.0, -1.0],
                            [0.0, 0.0, 0.0, 0.0, 0.0], [0.5, -0.5, 0.25, 0.0, 1.0]]], dtype=torch.float64)
    loss = localization_loss(logits, initial, target, w, torch.tensor([0.8], dtype=torch.float64))
    logp = logits[0].log_softmax(-1)
    expected = 0.8 * -(0.5 * logp[0, 2] + 0.5 * logp[0, 3] + logp[1, 2] + logp[2, 2]
                       + 0.5 * logp[3, 2] + 0.5 * logp[3, 3]) / 4
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert localization_loss(logits[:0], initial[:0], target[:0], w, torch.zeros(0)).item() == 0.0


def test_distillation_loss_by_hand():
    g = torch.Generator().manual_seed(1)
    student = torch.randn(1, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(1, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    matched = torch.tensor([[True, False, False]])
    weight = torch.tensor([[0.9, 0.2, 0.4]], dtype=torch.float64)
    loss = distillation_loss(student, teacher, matched, weight, temperature=2.0)
    per = []
    for q in range(3):
        kl = 0.0
        for e in range(4):
            p = (teacher[0, q, e].detach() / 2).softmax(-1)
            s = (student[0, q, e].detach() / 2).log_softmax(-1)
            kl += float((p * (p.log() - s)).sum())
        per.append(kl / 4 * 4.0 * float(weight[0, q]))
    assert loss.item() == pytest.approx(per[0] + (per[1] + per[2]) / 2, rel=1e-10)
    loss.backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0
    same = distillation_loss(teacher.detach(), teacher.detach(), matched, weight)
    assert same.item() == pytest.approx(0.0, abs=1e-12)




def test_config_refuses_fdr_without_reference_boxes_or_with_look_forward_twice():
    with pytest.raises(ValueError, match="box_refine"):
        DETRConfig(fdr=True)
    with pytest.raises(ValueError, match="look_forward_twice"):
        DETRConfig(fdr=True, box_refine=True, look_forward_twice=True)
    with pytest.raises(ValueError, match="fdr_bins"):
        DETRConfig(fdr=True, box_refine=True, fdr_bins=7)


def test_head_starts_at_the_initial_box_and_refines_logits_layer_by_layer(tiny_encoder):
    torch.manual_seed(0)
    head = DETRHead(tiny_encoder.embed_dim, 2, DETRConfig(num_queries=5, hidden_dim=32, num_layers=3, num_heads=2,
                                                          box_refine=True, focal=True, fdr=True, fdr_bins=8))
    enc = tiny_encoder(torch.randn(2, 3, 32, 32))
    out = head(enc)
    assert out["pred_corners"].shape == (2, 5, 4, 9) and len(out["aux_outputs"]) == 2
    # zero-initialised distribution heads: uniform, expectation 0 -> every layer gives the initial box
    for layer in [*out["aux_outputs"], out]:
        assert torch.allclose(layer["pred_boxes"], layer["fdr_initial"], atol=1e-6)
    # with trained-looking heads the last layer's logits are the sum of every layer's steps
    for h in head.fdr_heads:
        torch.nn.init.normal_(h.layers[-1].weight, std=0.1)
    out = head(enc)
    first, second = out["aux_outputs"][0]["pred_corners"], out["aux_outputs"][1]["pred_corners"]
    assert not torch.allclose(first, second)
    expected = decode_edges(out["fdr_initial"], out["pred_corners"].softmax(-1), head.fdr_offsets)
    assert torch.allclose(out["pred_boxes"], expected)
    assert len(head.box_heads) == 1  # only the initial box is regressed


def test_criterion_terms_and_a_detector_that_learns_a_box_through_the_distributions(tiny_encoder):
    from vision_attn.tasks import DetectionTask
    from vision_attn.tasks.detection import SetLossConfig

    torch.manual_seed(0)
    cfg = DETRConfig(num_queries=4, hidden_dim=32, num_layers=2, num_heads=2, box_refine=True, focal=True,
                     fdr=True, fdr_bins=8)
    task = DetectionTask(tiny_encoder, num_classes=2, head=cfg, loss=SetLossConfig(weight_fgl=0.5))
    images = torch.randn(2, 3, 32, 32)
    targets = [{"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.3]])},
               {"labels": torch.tensor([0, 1]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.2, 0.3]])}]
    terms = task.criterion(task(images), targets)
    assert {"loss_fgl", "loss_fgl_0", "loss_ddf_0"} <= set(terms)
    weights = task.criterion.weight_dict(1)
    assert weights["loss_fgl"] == 0.5 and weights["loss_ddf_0"] == 1.5
    # at initialisation every layer's distribution is the same (uniform): nothing to distil yet
    assert terms["loss_ddf_0"].item() == pytest.approx(0.0, abs=1e-7)
    opt = torch.optim.Adam(task.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        out = task(images)
        terms = task.criterion(out, targets)
        loss = task.criterion.total(terms, 1)
        first = first if first is not None else terms["loss_bbox"].item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.isfinite(v) for v in terms.values())
    assert terms["loss_bbox"].item() < 0.5 * first
    # the distributions moved the boxes away from the initial ones (the refinement does part of the fit)
    assert (out["pred_boxes"] - out["fdr_initial"]).abs().mean().item() > 1e-3
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in task.head.fdr_heads.parameters())
    # a criterion built for distributions refuses a head without them
    plain = DETRHead(task.encoder.embed_dim, 2, DETRConfig(num_queries=4, hidden_dim=32, num_layers=2, num_heads=2,
                                                           box_refine=True, focal=True))
    with pytest.raises(ValueError, match="pred_corners"):
        task.criterion(plain(task.encoder(images)), targets)
