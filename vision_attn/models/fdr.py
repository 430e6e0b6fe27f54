"""Fine-grained distribution refinement of box edges (D-FINE, Peng et al. 2025).

Instead of regressing four numbers, each decoder layer predicts, for each edge of a box (left,
top, right, bottom), a probability distribution over ``N + 1`` offsets ``W(0) .. W(N)``; the
edge's offset is the distribution's expectation. Offsets are fractions of an *initial* box
``b0 = (cx, cy, w, h)`` (the first layer's ordinary box prediction):

    x1 = cx - (0.5 + o_left) * w        x2 = cx + (0.5 + o_right) * w
    y1 = cy - (0.5 + o_top) * h         y2 = cy + (0.5 + o_bottom) * h

so all-zero offsets give ``b0`` back. Each layer adds its logits to the previous layer's
(the distributions are refined, not the box), and the offsets ``W(n)`` are spaced finely near 0
and coarsely at the ends (:func:`edge_offsets`): small corrections are precise, large ones
possible.

Training (:mod:`vision_attn.losses.set_criterion` with ``fdr=True``):

- :func:`localization_loss` (D-FINE's fine-grained localisation loss): each matched edge's true
  offset lies between two neighbouring offsets ``W(k) <= o < W(k + 1)``; the distribution is
  taught the two-bin distribution whose expectation is exactly ``o`` (the distribution focal
  loss of GFL, Li et al. 2020), weighted by the IoU of the predicted box with its object.
- :func:`distillation_loss` (GO-LSD: global-optimal localisation self-distillation): every earlier
  layer's distributions learn the last layer's (softened by a temperature, no gradient into the
  teacher); matched queries weighted by the last layer's IoU, the others by its confidence, the
  two groups averaged separately ("decoupled").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.boxes import box_cxcywh_to_xyxy

__all__ = ["decode_edges", "distillation_loss", "edge_offsets", "encode_edges", "localization_loss",
           "two_bin_targets"]

MIN_SIZE = 1e-4
"""The smallest width and height a decoded box gets (fractions of the image)."""


def edge_offsets(bins: int = 32, up: float = 0.5, curvature: float = 0.25) -> Tensor:
    """D-FINE's weighting function: the ``bins + 1`` edge offsets ``W(0) .. W(N)`` (fractions of
    the initial box's width or height), increasing and symmetric about ``W(N / 2) = 0``.

    ``W(1) = -up`` and ``W(N - 1) = up``, with the inner offsets spaced geometrically (``curvature``
    ``c``: ``W(n) = sign(t) * c * ((up / c + 1) ** |t| - 1)`` with ``t = (2n - N) / (N - 2)``; a
    smaller ``c`` packs them closer to 0); the two outer ones, ``-2 up`` and ``2 up``, catch
    larger corrections.

    Args:
        bins: ``N``, even and at least 4.
        up: the largest inner offset ``a``.
        curvature: ``c`` (> 0).
    """
    if bins < 4 or bins % 2:
        raise ValueError(f"fdr_bins must be an even number >= 4, got {bins}")
    if not up > 0 or not curvature > 0:
        raise ValueError(f"fdr_up ({up}) and fdr_curvature ({curvature}) must be > 0")
    n = torch.arange(1, bins, dtype=torch.float64)
    t = (2 * n - bins) / (bins - 2)
    inner = torch.sign(t) * curvature * ((up / curvature + 1) ** t.abs() - 1)
    return torch.cat([inner.new_tensor([-2 * up]), inner, inner.new_tensor([2 * up])]).float()


def decode_edges(initial: Tensor, probs: Tensor, offsets: Tensor) -> Tensor:
    """Boxes ``[..., 4]`` (``cxcywh``) from the initial boxes ``[..., 4]`` and the edges'
    distributions ``probs [..., 4, N + 1]`` (left, top, right, bottom) over ``offsets [N + 1]``.
    Width and height are at least :data:`MIN_SIZE`."""
    o = (probs * offsets.to(probs.dtype)).sum(-1)
    cx, cy, w, h = initial.unbind(-1)
    x1, y1 = cx - (0.5 + o[..., 0]) * w, cy - (0.5 + o[..., 1]) * h
    x2, y2 = cx + (0.5 + o[..., 2]) * w, cy + (0.5 + o[..., 3]) * h
    ctr_x, ctr_y = (x1 + x2) / 2, (y1 + y2) / 2
    return torch.stack([ctr_x, ctr_y, (x2 - x1).clamp(min=MIN_SIZE), (y2 - y1).clamp(min=MIN_SIZE)], -1)


def encode_edges(initial: Tensor, boxes: Tensor) -> Tensor:
    """The edge offsets ``[..., 4]`` that turn ``initial`` into ``boxes`` (both ``cxcywh``
    ``[..., 4]``): the inverse of :func:`decode_edges`' expectation."""
    cx, cy, w, h = initial.unbind(-1)
    x1, y1, x2, y2 = box_cxcywh_to_xyxy(boxes).unbind(-1)
    w, h = w.clamp(min=MIN_SIZE), h.clamp(min=MIN_SIZE)
    return torch.stack([(cx - x1) / w, (cy - y1) / h, (x2 - cx) / w, (y2 - cy) / h], -1) - 0.5


def two_bin_targets(target: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """The two-bin distribution of each target offset ``[...]``: ``(k [...], right weight [...])``,
    ``W(k) <= o <= W(k + 1)`` and ``(1 - r) W(k) + r W(k + 1) = o`` (offsets outside
    ``[W(0), W(N)]`` are clamped to it)."""
    offsets = offsets.to(target.dtype)
    o = target.clamp(float(offsets[0]), float(offsets[-1]))
    k = (torch.searchsorted(offsets, o.contiguous(), right=True) - 1).clamp(0, len(offsets) - 2)
    left, right = offsets[k], offsets[k + 1]
    return k, (o - left) / (right - left)


def localization_loss(logits: Tensor, initial: Tensor, boxes: Tensor, offsets: Tensor, weight: Tensor) -> Tensor:
    """D-FINE's fine-grained localisation loss, summed: per matched query (``logits [M, 4, N + 1]``,
    its initial box ``[M, 4]``, its object's box ``[M, 4]``, ``weight [M]``: the IoU of its
    predicted box with the object) the cross-entropy of each edge's distribution with the
    two-bin distribution of the true offset (:func:`two_bin_targets`), averaged over the four
    edges and weighted."""
    if logits.numel() == 0:
        return logits.sum() * 0
    k, r = two_bin_targets(encode_edges(initial.detach(), boxes), offsets)
    logp = logits.log_softmax(-1)
    nll = -((1 - r) * logp.gather(-1, k[..., None]).squeeze(-1) + r * logp.gather(-1, k[..., None] + 1).squeeze(-1))
    return (nll.mean(-1) * weight.detach()).sum()


def distillation_loss(student: Tensor, teacher: Tensor, matched: Tensor, weight: Tensor,
                      temperature: float = 5.0) -> Tensor:
    """GO-LSD's decoupled distillation of one earlier layer: ``KL(teacher || student)`` of each
    edge's distribution softened by ``temperature`` (times its square), averaged over the four
    edges, weighted per query (``weight [B, Q]``), then averaged over the matched queries
    (``matched [B, Q]`` bool) and over the rest separately, the two averages summed.

    Args:
        student: ``[B, Q, 4, N + 1]`` logits of the earlier layer.
        teacher: ``[B, Q, 4, N + 1]`` logits of the last layer (no gradient flows into it).
    """
    t = temperature
    kl = F.kl_div((student / t).log_softmax(-1), (teacher.detach() / t).softmax(-1), reduction="none").sum(-1)
    per_query = kl.mean(-1) * (t * t) * weight.detach()
    zero = per_query.sum() * 0
    pos = per_query[matched].mean() if bool(matched.any()) else zero
    neg = per_query[~matched].mean() if bool((~matched).any()) else zero
    return pos + neg

