"""Training-only extra queries of the DETR head: denoising groups (DN-DETR, Li et al. 2022; DINO's
contrastive negatives, Zhang et al. 2022) made from noised ground truth (:func:`noise_labels`,
:func:`noise_boxes`, :func:`denoising_slots`), and the self-attention mask that keeps them and the
one-to-many query groups (Group DETR / H-DETR) apart from the matching queries
(:func:`query_group_mask`)."""

from __future__ import annotations

import torch
from torch import Tensor

from vision_attn.boxes import box_cxcywh_to_xyxy, box_xyxy_to_cxcywh

__all__ = ["O2M_MODES", "denoising_slots", "noise_boxes", "noise_labels", "query_group_mask"]

O2M_MODES = ("group", "hybrid")


def query_group_mask(
    num_queries: int,
    o2m_groups: int = 0,
    o2m_mode: str = "group",
    dn_groups: int = 0,
    dn_group_size: int = 0,
    device: torch.device | None = None,
) -> Tensor:
    """Self-attention keep-mask ``[T, T]`` (``True`` = query ``i`` may attend to query ``j``).

    Queries are ordered ``[num_queries matching | o2m_groups * num_queries | dn_groups *
    dn_group_size denoising]``. The matching queries see only each other, so they compute
    exactly what they compute alone (the extra queries leak no ground truth and cost nothing at
    inference). One-to-many queries see only their own group (``"group"``, Group DETR) or the
    whole one-to-many set (``"hybrid"``, H-DETR). A denoising group sees itself and the matching
    queries (DN-DETR), never another denoising group nor the one-to-many queries.
    """
    if o2m_mode not in O2M_MODES:
        raise ValueError(f"o2m_mode must be one of {O2M_MODES}, got {o2m_mode!r}")
    q, n_o2m, n_dn = num_queries, o2m_groups * num_queries, dn_groups * dn_group_size
    total = q + n_o2m + n_dn
    keep = torch.zeros(total, total, dtype=torch.bool, device=device)
    keep[:q, :q] = True
    if n_o2m:
        if o2m_mode == "hybrid":
            keep[q : q + n_o2m, q : q + n_o2m] = True
        else:
            for g in range(o2m_groups):
                s = q + g * num_queries
                keep[s : s + num_queries, s : s + num_queries] = True
    for g in range(dn_groups):
        s = q + n_o2m + g * dn_group_size
        keep[s : s + dn_group_size, s : s + dn_group_size] = True
        keep[s : s + dn_group_size, :q] = True
    return keep


def noise_labels(labels: Tensor, num_classes: int, ratio: float, generator: torch.Generator | None = None) -> Tensor:
    """Each label replaced, with probability ``ratio / 2``, by a class drawn uniformly from
    ``0..C-1`` (which may be the same class), as DINO's ``prepare_for_cdn`` does with its
    ``label_noise_ratio``: a label changes with probability ``ratio / 2 * (1 - 1 / C)``."""
    if ratio <= 0:
        return labels.clone()
    flip = torch.rand(labels.shape, generator=generator, device=labels.device) < ratio * 0.5
    random = torch.randint(0, num_classes, labels.shape, generator=generator, device=labels.device)
    return torch.where(flip, random, labels)


def noise_boxes(boxes: Tensor, scale: float, negative: Tensor | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Noised copies of ``cxcywh`` boxes ``[..., 4]``, clamped to the image.

    Each corner of a box moves, per coordinate, by ``± u * scale`` times half the box's size, with
    ``u`` uniform in ``[0, 1)`` — so the centre shifts by at most ``scale * w / 2`` (resp. ``h``) and
    the size is scaled by a factor in ``[1 - scale, 1 + scale]`` (DN-DETR's centre-shift and
    box-scale noise). Where ``negative`` (broadcastable to ``boxes[..., 0]``) is ``True``, ``u``
    lies in ``[1, 2)`` instead: DINO's contrastive negatives, farther from the truth than any
    positive.
    """
    if scale <= 0:
        return boxes.clone()
    xyxy = box_cxcywh_to_xyxy(boxes)
    half = torch.cat([boxes[..., 2:], boxes[..., 2:]], dim=-1) / 2
    u = torch.rand(boxes.shape, generator=generator, device=boxes.device, dtype=boxes.dtype)
    if negative is not None:
        u = u + negative[..., None].to(u.dtype)
    sign = torch.rand(boxes.shape, generator=generator, device=boxes.device) < 0.5
    shift = torch.where(sign, u, -u) * half * scale
    return box_xyxy_to_cxcywh((xyxy + shift).clamp(0, 1))


def denoising_slots(targets: list[dict[str, Tensor]], groups: int, negatives: bool, device: torch.device
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, dict]:
    """The ground truth laid out in denoising slots, before any noise: ``(labels [B, n, S],
    boxes [B, n, S, 4], real [B, n, S], negative [S], meta)`` for ``n = groups`` groups of ``S``
    slots.

    A group holds ``P = max_b G_b`` positive slots (and, with ``negatives``, ``P`` negative slots
    after them); image ``b`` fills the first ``G_b`` of each, the rest are padding (``real`` is
    ``False``: hidden from every query and from the loss). ``meta["positive"]`` gives per image
    ``(query index, target index)`` (indices within the denoising queries, on the CPU),
    ``meta["negative"]`` the query indices that must predict "no object"; ``meta["groups"]`` and
    ``meta["group_size"]`` the layout, ``meta["padded"]`` whether any slot is padding.
    """
    b = len(targets)
    pad = max((len(t["labels"]) for t in targets), default=0)
    size = pad * (2 if negatives else 1)
    n = groups
    labels = torch.zeros(b, n, size, dtype=torch.int64, device=device)
    boxes = torch.full((b, n, size, 4), 0.5, device=device)
    real = torch.zeros(b, n, size, dtype=torch.bool, device=device)
    negative = torch.zeros(size, dtype=torch.bool, device=device)
    negative[pad:] = True
    positive_idx, negative_idx = [], []
    for i, t in enumerate(targets):
        g = len(t["labels"])
        starts = torch.arange(n)[:, None] * size  # indices on the CPU, as the matcher's
        slots = torch.arange(g)[None, :]
        positive_idx.append(((starts + slots).flatten(), torch.arange(g).repeat(n)))
        negative_idx.append((starts + pad + slots).flatten() if negatives else
                            torch.empty(0, dtype=torch.int64))
        for offset in (0, pad) if negatives else (0,):
            labels[i, :, offset : offset + g] = t["labels"].to(device)
            boxes[i, :, offset : offset + g] = t["boxes"].to(device=device, dtype=boxes.dtype)
            real[i, :, offset : offset + g] = True
    meta = {"groups": n, "group_size": size, "positive": positive_idx, "negative": negative_idx,
            "padded": any(len(t["labels"]) < pad for t in targets)}
    return labels, boxes, real, negative, meta
