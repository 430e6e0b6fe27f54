"""Deletion / insertion curves on a model whose answer we know."""

from __future__ import annotations

import torch

from vision_attn.explain.faithfulness import auc, deletion_insertion_curve


def _model(x):
    # "Class 0" probability = mean brightness of the top-left 8x8 patch of a 16x16 image.
    p0 = x[:, :, :8, :8].mean(dim=(1, 2, 3)).clamp(0, 1)
    return torch.stack([p0, 1 - p0], dim=1)


def test_right_saliency_beats_wrong_saliency():
    x = torch.zeros(2, 3, 16, 16)
    x[:, :, :8, :8] = 1.0
    right = torch.tensor([[1.0, 0.0], [0.0, 0.0]]).expand(2, 2, 2)
    wrong = torch.tensor([[0.1, 0.5], [0.7, 1.0]]).expand(2, 2, 2)  # decisive patch last
    target = torch.zeros(2, dtype=torch.long)
    d_right = deletion_insertion_curve(_model, x, right, target, "deletion", steps=4)
    d_wrong = deletion_insertion_curve(_model, x, wrong, target, "deletion", steps=4)
    assert d_right.shape == (2, 5)
    assert d_right[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the decisive patch goes first
    assert d_wrong[0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]  # ...or last
    assert torch.all(auc(d_right) < auc(d_wrong))
    i_right = deletion_insertion_curve(_model, x, right, target, "insertion", steps=4, baseline="zero")
    i_wrong = deletion_insertion_curve(_model, x, wrong, target, "insertion", steps=4, baseline="zero")
    assert i_right[0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert torch.all(auc(i_right) > auc(i_wrong))


def test_auc_trapezoid():
    assert torch.allclose(auc(torch.tensor([[1.0, 0.0]])), torch.tensor([0.5]))
    assert torch.allclose(auc(torch.tensor([[1.0, 1.0, 1.0]])), torch.tensor([1.0]))
