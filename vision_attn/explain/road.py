"""Two more faithfulness measures of saliency maps: ROAD and SaCo.

**ROAD** (Rong et al. 2022, "A Consistent and Efficient Evaluation Strategy for Attribution
Methods"): deleting pixels by painting them a constant leaves a shape the model can read (the
mask itself leaks the class), so ROAD *imputes* the removed pixels instead: each removed pixel
is the weighted mean of its eight neighbours (direct ones weigh 1/6, diagonal ones 1/12), the
system of all removed pixels solved at once, plus a little Gaussian noise (noisy linear
imputation, :func:`noisy_linear_impute`). A share ``f`` of the map's patches is removed, most
relevant first (MoRF: the score should fall) or least relevant first (LeRF: it should stay);
:func:`road_curves` gives the score of the explained output at each share. The combined score of
pytorch-grad-cam's ``ROADCombined``, ``(LeRF - MoRF) / 2`` averaged over the shares, is higher
for a more faithful map (``road_<method>`` in ``metrics.json``; ``road_morf_<method>`` and
``road_lerf_<method>`` are the mean scores of the two orders).

**SaCo** (Wu et al. 2024, "On the Faithfulness of Vision Transformer Explanations"): the map's
patches are split by salience into ``K`` equal groups, each group removed alone, and every
pair of groups compared: a faithful map gives the group of more salience the larger effect on
the score. :func:`saco` weighs each pair by its salience difference and returns a coefficient in
``[-1, 1]`` (1: the effects are ordered as the salience is; a random map scores about 0).

Both work on the map's patch grid (the ranking of its patches), as the deletion / insertion
curves do (:mod:`vision_attn.explain.faithfulness`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.sparse import csc_matrix
from scipy.sparse.linalg import spsolve
from torch import Tensor

from vision_attn.explain.faithfulness import patch_ranks

__all__ = ["FRACTIONS", "NEIGHBOURS", "classifier_scores", "noisy_linear_impute", "road_curves",
           "road_scores", "saco"]

NEIGHBOURS = ((-1, 0, 1 / 6), (1, 0, 1 / 6), (0, -1, 1 / 6), (0, 1, 1 / 6),
              (-1, -1, 1 / 12), (-1, 1, 1 / 12), (1, -1, 1 / 12), (1, 1, 1 / 12))
"""``(dy, dx, weight)`` of a pixel's neighbours in the noisy linear imputation (ROAD's weights)."""
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)
"""The shares of the map's patches ROAD removes (each in both orders)."""


def noisy_linear_impute(images: Tensor, removed: Tensor, noise: float = 0.01,
                        generator: torch.Generator | None = None) -> Tensor:
    """``images`` (``[N, C, H, W]``) with the pixels where ``removed`` (``[N, H, W]`` bool) is
    true replaced by ROAD's noisy linear imputation: every removed pixel equals the weighted mean
    of its neighbours inside the image (:data:`NEIGHBOURS`), kept or imputed, solved for all
    removed pixels of all images in one sparse system, then ``noise`` times a standard normal
    draw is added to each imputed value. A removed region needs a kept pixel somewhere in its
    image (an image removed whole has no solution and raises ``ValueError``)."""
    n, c, h, w = images.shape
    if removed.shape != (n, h, w):
        raise ValueError(f"removed must be [N, H, W] = {[n, h, w]}, got {list(removed.shape)}")
    gone = removed.detach().cpu().numpy().astype(bool)
    if not gone.any():
        return images.clone()
    if gone.reshape(n, -1).all(axis=1).any():
        raise ValueError("an image with every pixel removed cannot be imputed")
    values = images.detach().cpu().double().numpy()
    flat = values.transpose(0, 2, 3, 1).reshape(n * h * w, c)  # pixel-major: [N*H*W, C]
    unknown = np.flatnonzero(gone.reshape(-1))
    row_of = np.full(n * h * w, -1, dtype=np.int64)
    row_of[unknown] = np.arange(unknown.size)
    img, rem = np.divmod(unknown, h * w)
    y, x = np.divmod(rem, w)
    diag = np.zeros(unknown.size)
    rhs = np.zeros((unknown.size, c))
    rows, cols, vals = [], [], []
    for dy, dx, weight in NEIGHBOURS:
        ny, nx = y + dy, x + dx
        inside = (ny >= 0) & (ny < h) & (nx >= 0) & (nx < w)
        diag[inside] += weight
        neighbour = img[inside] * h * w + ny[inside] * w + nx[inside]
        at = np.flatnonzero(inside)
        is_unknown = row_of[neighbour] >= 0
        rows.append(at[is_unknown])
        cols.append(row_of[neighbour[is_unknown]])
        vals.append(np.full(int(is_unknown.sum()), -weight))
        np.add.at(rhs, at[~is_unknown], weight * flat[neighbour[~is_unknown]])
    rows.append(np.arange(unknown.size))
    cols.append(np.arange(unknown.size))
    vals.append(diag)
    system = csc_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                        shape=(unknown.size, unknown.size))
    solved = np.asarray(spsolve(system, rhs)).reshape(unknown.size, c)
    out = torch.from_numpy(flat.copy())
    filled = torch.from_numpy(solved)
    if noise:
        filled = filled + noise * torch.randn(filled.shape, generator=generator, dtype=filled.dtype)
    out[torch.from_numpy(unknown)] = filled
    return out.view(n, h, w, c).permute(0, 3, 1, 2).to(images.dtype).to(images.device).contiguous()


def _pixels(patches: Tensor, size: tuple[int, int], grid: tuple[int, int]) -> Tensor:
    """``[R, h*w]`` bool patch masks as ``[R, H, W]`` pixel masks."""
    grid_masks = patches.view(-1, 1, *grid).float()
    return F.interpolate(grid_masks, size=size, mode="nearest")[:, 0].bool()


@torch.no_grad()
def road_curves(score: Callable[[Tensor, Tensor], Tensor], images: Tensor, saliency: Tensor,
                image_of_row: Tensor, fractions: Sequence[float] = FRACTIONS, noise: float = 0.01,
                seed: int = 0, chunk: int = 64) -> dict[str, Tensor]:
    """ROAD's scores of ``R`` maps: ``{"morf": [R, F], "lerf": [R, F]}``, the score of each row's
    item after removing ``round(f * n)`` of its map's ``n`` patches (``f`` in ``fractions``), most
    relevant first (``morf``) or least relevant first (``lerf``), imputed by
    :func:`noisy_linear_impute` (seeded by ``seed``).

    ``score(x, rows) -> [len(rows)]`` scores the perturbed images ``x`` of ``rows``;
    ``saliency`` is ``[R, h, w]`` on the patch grid of ``images`` (``[B, 3, H, W]``);
    ``image_of_row`` (``[R]``) indexes ``images``; ``chunk`` perturbed images per solve and call.
    """
    rows, (big_h, big_w), grid = saliency.shape[0], images.shape[-2:], saliency.shape[-2:]
    n = grid[0] * grid[1]
    rank = patch_ranks(saliency).to(images.device)
    gen = torch.Generator().manual_seed(seed)
    counts = [round(f * n) for f in fractions]
    jobs = [(order, r, k) for order in ("morf", "lerf") for k in range(len(fractions)) for r in range(rows)]
    out = {order: torch.empty(rows, len(fractions)) for order in ("morf", "lerf")}
    for start in range(0, len(jobs), chunk):
        part = jobs[start:start + chunk]
        rr = torch.tensor([j[1] for j in part], device=images.device)
        kk = torch.tensor([counts[j[2]] for j in part], device=images.device)
        most = torch.tensor([j[0] == "morf" for j in part], device=images.device)
        removed = torch.where(most[:, None], rank[rr] < kk[:, None], rank[rr] >= n - kk[:, None])
        x = noisy_linear_impute(images[image_of_row[rr]], _pixels(removed, (big_h, big_w), grid), noise, gen)
        values = score(x, rr).float().cpu()
        for (order, r, k), v in zip(part, values, strict=True):
            out[order][r, k] = v
    return out


def road_scores(curves: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per row: ``morf`` and ``lerf`` (the mean score over the shares) and ``road``, pytorch-grad-cam's
    ``ROADCombined``: the mean of ``(LeRF - MoRF) / 2`` over the shares (higher: more faithful)."""
    morf, lerf = curves["morf"].double().mean(1), curves["lerf"].double().mean(1)
    return {"morf": morf, "lerf": lerf, "road": (lerf - morf) / 2}


@torch.no_grad()
def saco(score: Callable[[Tensor, Tensor], Tensor], images: Tensor, base: Tensor, saliency: Tensor,
         image_of_row: Tensor, groups: int = 10, chunk: int = 256) -> Tensor:
    """SaCo's faithfulness coefficient of ``R`` maps (``[R]``, in ``[-1, 1]``).

    The map's patches are ranked and split into groups of equal size, the most salient first
    (``groups`` of them, or the largest number below it that divides the patches evenly);
    ``s_i`` is the salience summed over group ``i`` and ``d_i`` the fall of the score when group
    ``i`` alone is replaced by ``base`` (``[B, 3, H, W]``, e.g. zeros); a score the groups do not
    change gives ``d_i = d_j``, which counts as ordered (as the paper counts it). Every pair
    ``i < j`` adds ``|s_i - s_j|`` when its effects are ordered as its salience is (``d_i >= d_j``
    where ``s_i >= s_j``) and subtracts it otherwise; the sum is divided by the sum of
    ``|s_i - s_j|`` (a map with equal salience everywhere scores 0).
    ``score``, ``saliency`` and ``image_of_row`` are as in :func:`road_curves`."""
    rows, (big_h, big_w), grid = saliency.shape[0], images.shape[-2:], saliency.shape[-2:]
    n = grid[0] * grid[1]
    if not 2 <= groups <= n:
        raise ValueError(f"SaCo needs 2 <= groups <= patches ({n}), got {groups}")
    # groups of equal size: a larger group would have more salience and more effect whatever the map
    groups = max((k for k in range(2, groups + 1) if n % k == 0), default=n)
    rank = patch_ranks(saliency).to(images.device)
    group_of = (rank * groups) // n  # [R, n]: 0 = the most salient group
    flat = saliency.reshape(rows, n).double().to(images.device)
    s = torch.zeros(rows, groups, dtype=torch.float64, device=images.device).scatter_add_(1, group_of, flat)
    original = score(images[image_of_row], torch.arange(rows, device=images.device)).double()
    d = torch.empty(rows, groups, dtype=torch.float64)
    jobs = [(r, g) for g in range(groups) for r in range(rows)]
    for start in range(0, len(jobs), chunk):
        part = jobs[start:start + chunk]
        rr = torch.tensor([j[0] for j in part], device=images.device)
        gg = torch.tensor([j[1] for j in part], device=images.device)
        changed = _pixels(group_of[rr] == gg[:, None], (big_h, big_w), grid)[:, None].to(images.dtype)
        img, bas = images[image_of_row[rr]], base[image_of_row[rr]]
        values = score(img * (1 - changed) + bas * changed, rr).double()
        d[rr.cpu(), gg.cpu()] = (original[rr] - values).cpu()
    s = s.cpu()
    i, j = torch.triu_indices(groups, groups, offset=1)
    weight = (s[:, i] - s[:, j]).abs()
    sign = torch.where((d[:, i] >= d[:, j]) == (s[:, i] >= s[:, j]), 1.0, -1.0).double()
    total = weight.sum(1)
    return torch.where(total > 0, (sign * weight).sum(1) / total.clamp_min(1e-300), torch.zeros_like(total))


def classifier_scores(predict_proba: Callable[[Tensor], Tensor], images: Tensor, maps: dict[str, Tensor],
                      target: Tensor, road: bool = False, seed: int = 0) -> dict[str, dict[str, Tensor]]:
    """``{method: {name: [B]}}`` of a classifier's maps (``[B, h, w]`` each): ``saco`` (the
    removed groups set to zero, the normalisation mean, as deletion does) and, with ``road``,
    ``road`` / ``road_morf`` / ``road_lerf`` (:func:`road_scores`), all on the probability
    ``predict_proba(x)[:, target]`` of each image's ``target`` class."""
    target = target.to(images.device)
    rows = torch.arange(images.shape[0], device=images.device)

    def score(x: Tensor, r: Tensor) -> Tensor:
        return predict_proba(x).gather(1, target[r].view(-1, 1)).squeeze(1)

    out: dict[str, dict[str, Tensor]] = {}
    for method, sal in maps.items():
        sal = sal.to(images.device)
        named = {"saco": saco(score, images, torch.zeros_like(images), sal, rows)}
        if road:
            found = road_scores(road_curves(score, images, sal, rows, seed=seed))
            named.update(road=found["road"], road_morf=found["morf"], road_lerf=found["lerf"])
        out[method] = named
    return out
