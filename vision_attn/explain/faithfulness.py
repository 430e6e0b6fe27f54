"""Deletion / insertion faithfulness of saliency maps (Petsiuk et al. 2018, "RISE").

Deletion: remove the image's patches from most to least salient and track the probability of
the explained class; a faithful map makes it fall fast, so a *lower* area under the curve is
better. Insertion: start from a blurred image and put the most salient patches back first; a
*higher* area is better. Both work on the patch grid of the map, batched over images.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["MODES", "auc", "blur", "curve_ends", "deletion_insertion_curve", "end_probabilities", "order_ends",
           "on_patch_grid", "patch_ranks"]

MODES = ("deletion", "insertion")
"""The two perturbations of a map's curves: patches removed most salient first, or put back."""


def blur(images: Tensor, kernel: int = 11, sigma: float = 5.0) -> Tensor:
    x = torch.arange(kernel, dtype=images.dtype, device=images.device) - kernel // 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    c = images.shape[1]
    pad = kernel // 2
    out = F.conv2d(F.pad(images, (pad, pad, 0, 0), mode="replicate"), g.view(1, 1, 1, -1).repeat(c, 1, 1, 1), groups=c)
    out = F.conv2d(F.pad(out, (0, 0, pad, pad), mode="replicate"), g.view(1, 1, -1, 1).repeat(c, 1, 1, 1), groups=c)
    return out


def auc(curve: Tensor) -> Tensor:
    """Area under curves sampled evenly on ``[0, 1]`` (trapezoid rule).

    Args:
        curve: ``[B, S+1]`` values at ``0, 1/S, ..., 1``.

    Returns:
        ``[B]`` areas.
    """
    return torch.trapezoid(curve, dx=1.0 / (curve.shape[-1] - 1), dim=-1)


@torch.no_grad()
def end_probabilities(predict_proba: Callable[[Tensor], Tensor], images: Tensor) -> dict[str, Tensor]:
    """What every deletion / insertion curve of ``images`` starts or ends with, whatever its
    saliency map: the class probabilities ``[B, C]`` of the images (``image``), of the
    ``zero`` baseline (one all-zero image, the same for every image of the batch) and of the
    ``blur`` baseline. One pass over the images serves the curves of every map and of every
    detection or word that explains them (see :func:`curve_ends`)."""
    if not images.shape[0]:
        return dict.fromkeys(("image", "zero", "blur"), images.new_zeros(0, 0))
    zero = predict_proba(torch.zeros_like(images[:1])).expand(images.shape[0], -1)
    return {"image": predict_proba(images), "zero": zero, "blur": predict_proba(blur(images))}


def curve_ends(ends: dict[str, Tensor], rows: Tensor, target: Tensor,
               mode: Literal["deletion", "insertion"] = "deletion",
               baseline: Literal["zero", "blur"] | None = None) -> tuple[Tensor, Tensor]:
    """The ``ends`` argument of :func:`deletion_insertion_curve` for curves over
    ``images[rows]`` of ``target``, from :func:`end_probabilities` of ``images``."""
    picked = {k: v[rows].gather(1, target.view(-1, 1)).squeeze(1) for k, v in ends.items()}
    return order_ends(picked, mode, baseline)


def order_ends(probs: dict[str, Tensor], mode: Literal["deletion", "insertion"] = "deletion",
               baseline: Literal["zero", "blur"] | None = None) -> tuple[Tensor, Tensor]:
    """``(first, last)`` point of a curve from the ``[R]`` probabilities of what is explained on
    the ``image`` and on its ``zero`` and ``blur`` baselines: deletion runs from the image to
    its baseline (``zero`` by default), insertion from its baseline (``blur``) to the image."""
    baseline = baseline or ("zero" if mode == "deletion" else "blur")
    return (probs["image"], probs[baseline]) if mode == "deletion" else (probs[baseline], probs["image"])


def on_patch_grid(saliency: Tensor, grid: tuple[int, int]) -> Tensor:
    """``[R, h, w]`` maps over the patch ``grid`` from ``[R, h * k, w * l]`` maps over cells that
    split each patch into ``k`` x ``l`` (each patch the sum of its cells; maps already over the
    grid unchanged), so that the curves change whole patches whatever a map's resolution.

    Raises:
        ValueError: the map's size is not a multiple of the grid's.
    """
    (h, w), (rows, cols) = grid, saliency.shape[-2:]
    if (rows, cols) == (h, w):
        return saliency
    if rows % h or cols % w:
        raise ValueError(f"a {rows}x{cols} map does not split the {h}x{w} patch grid into cells")
    return saliency.reshape(saliency.shape[0], h, rows // h, w, cols // w).sum(dim=(2, 4))


def patch_ranks(saliency: Tensor) -> Tensor:
    """``[R, h*w]``: each patch's rank in its map of ``saliency`` (``[R, h, w]``; 0: the most
    salient; ties by position)."""
    r, n = saliency.shape[0], saliency.shape[-2] * saliency.shape[-1]
    order = saliency.reshape(r, n).float().argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return rank


def perturbation_curves(
    score: Callable[[Tensor, Tensor], Tensor],
    images: Tensor,
    base: Tensor,
    saliency: Tensor,
    image_of_row: Tensor,
    mode: Literal["deletion", "insertion"],
    steps: int,
    chunk: int,
    ends: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The curves of ``R`` maps: for each row its image with the ``round(k * n / steps)`` most
    salient of its ``n`` patches changed (deletion: to ``base``; insertion: from ``base`` back to
    the image), scored by ``score(x, rows) -> [len(rows)]``; ``chunk`` (row, point) inputs per call.

    ``saliency`` is ``[R, h, w]``, ``image_of_row`` ``[R]`` indexes ``images`` / ``base``
    (``[B, 3, H, W]``); ties in the ranking are broken by position. With ``ends`` (``[R]`` each,
    the first and last points, which do not depend on the map) only the points in between are
    scored. Returns ``[R, steps + 1]``.
    """
    rows, (H, W), (h, w) = saliency.shape[0], images.shape[-2:], saliency.shape[-2:]
    device, n = images.device, h * w
    rank = patch_ranks(saliency).to(device)
    counts = torch.tensor([round(k * n / steps) for k in range(steps + 1)], device=device)
    probs = torch.empty(rows, steps + 1, device=device)
    points = range(steps + 1)
    if ends is not None:
        probs[:, 0], probs[:, steps] = ends[0].to(probs), ends[1].to(probs)
        points = range(1, steps)
    pairs = [(r, k) for k in points for r in range(rows)]  # (row, curve point)
    for start in range(0, len(pairs), chunk):
        rr = torch.tensor([p[0] for p in pairs[start : start + chunk]], device=device)
        kk = torch.tensor([p[1] for p in pairs[start : start + chunk]], device=device)
        changed = (rank[rr] < counts[kk, None]).view(-1, 1, h, w).to(images.dtype)
        changed = F.interpolate(changed, size=(H, W), mode="nearest")  # (chunk, 1, H, W)
        img, bas = images[image_of_row[rr]], base[image_of_row[rr]]
        x = img * (1 - changed) + bas * changed if mode == "deletion" else bas * (1 - changed) + img * changed
        probs[rr, kk] = score(x, rr).float()
    return probs


@torch.no_grad()
def deletion_insertion_curve(
    predict_proba: Callable[[Tensor], Tensor],
    images: Tensor,
    saliency: Tensor,
    target: Tensor,
    mode: Literal["deletion", "insertion"] = "deletion",
    steps: int = 16,
    baseline: Literal["zero", "blur"] | None = None,
    chunk: int = 256,
    ends: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Probability of ``target`` as patches are deleted (or inserted) in saliency order.

    Args:
        predict_proba: images ``[B, 3, H, W]`` -> class probabilities ``[B, C]``.
        images: normalised model inputs ``[B, 3, H, W]``.
        saliency: ``[B, h, w]`` maps over the patch grid (``H`` and ``W`` multiples of ``h``, ``w``).
        target: ``[B]`` class to track (usually the predicted one).
        mode: ``deletion`` (most salient removed first) or ``insertion`` (most salient put
            back first, starting from the baseline).
        steps: curve points after the start (``steps + 1`` in all).
        baseline: what a removed patch becomes: ``zero`` (the normalisation mean) or ``blur``
            (the blurred image). Default: ``zero`` for deletion, ``blur`` for insertion.
        chunk: images per model call (the curve points of several images are batched).
        ends: ``[B]`` probabilities of ``target`` at the first and the last point, when the
            caller already has them (they do not depend on the saliency: the image itself and
            its baseline, see :func:`curve_ends`); only the points in between are computed.

    Returns:
        ``[B, steps + 1]`` probabilities at ``0, 1/steps, ..., 1`` of the patches changed.
    """
    b, _, H, W = images.shape
    h, w = saliency.shape[-2:]
    if H % h or W % w:
        raise ValueError(f"image size {H}x{W} is not a multiple of the saliency grid {h}x{w}")
    baseline = baseline or ("zero" if mode == "deletion" else "blur")
    base = torch.zeros_like(images) if baseline == "zero" else blur(images)
    return perturbation_curves(lambda x, rows: predict_proba(x).gather(1, target[rows].view(-1, 1)).squeeze(1),
                               images, base, saliency, torch.arange(b, device=images.device), mode, steps, chunk, ends)
