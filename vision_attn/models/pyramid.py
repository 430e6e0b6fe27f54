"""ViTDet's simple feature pyramid (Li et al. 2022, "Exploring Plain Vision Transformer
Backbones for Object Detection") over the last patch-token map of a plain ViT: the multi-scale
memory of the DETR head (``DETRConfig(pyramid=True)``), and the map from its levels' tokens back
to the patch grid (:meth:`SimpleFeaturePyramid.to_patches`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PYRAMID_SCALES", "SimpleFeaturePyramid"]


def _masked_max_pool(x: Tensor, mask: Tensor | None, k: int) -> tuple[Tensor, Tensor | None]:
    """``k x k`` stride-``k`` max pooling of ``x [B, D, h, w]`` (partial windows at the bottom and
    right kept, as ``ceil_mode``) over the real cells only (``mask [B, h, w]``); a window with no
    real cell gives zeros and ``False`` in the pooled mask."""
    if mask is None:
        return F.max_pool2d(x, k, k, ceil_mode=True), None
    pooled = F.max_pool2d(x.masked_fill(~mask[:, None], float("-inf")), k, k, ceil_mode=True)
    keep = F.max_pool2d(mask[:, None].float(), k, k, ceil_mode=True)[:, 0] > 0
    return pooled.masked_fill(~keep[:, None], 0.0), keep


PYRAMID_SCALES = (2.0, 1.0, 0.5, 0.25)
"""Resolution of each pyramid level relative to the patch grid (strides 1/2, 1, 2, 4 patches)."""


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid (Li et al. 2022) from the last patch-token map.

    Levels (:data:`PYRAMID_SCALES`): ``2x`` a 2x2 stride-2 transposed convolution, ``1x`` the map
    itself, ``1/2`` and ``1/4`` max pooling (2x2 and 4x4, partial windows kept); each then a
    per-token linear projection to ``out_dim`` and LayerNorm. ViTDet adds a 3x3 convolution per
    level; it is left out so that every level token depends on a known block of patches (one
    patch, or a 2x2 / 4x4 block), which :meth:`to_patches` and the explanations rely on.

    Args:
        in_dim: width of the encoder's tokens.
        out_dim: the decoder width.
    """

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_dim, in_dim, kernel_size=2, stride=2)
        self.proj = nn.ModuleList(nn.Sequential(nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim))
                                  for _ in PYRAMID_SCALES)
        self.level_embed = nn.Parameter(torch.randn(len(PYRAMID_SCALES), out_dim) * 0.02)

    @staticmethod
    def level_grids(grid: tuple[int, int]) -> list[tuple[int, int]]:
        """The levels' grids for a patch grid ``(h, w)``: ``(2h, 2w), (h, w), ceil(/2), ceil(/4)``."""
        h, w = grid
        return [(2 * h, 2 * w), (h, w), (-(-h // 2), -(-w // 2)), (-(-h // 4), -(-w // 4))]

    def forward(self, tokens: Tensor, grid: tuple[int, int], mask: Tensor | None = None
                ) -> list[tuple[Tensor, Tensor | None]]:
        """``tokens [B, h * w, in_dim]`` (row-major), ``mask [B, h * w]`` (``True`` = real or
        ``None``) -> per level ``(tokens [B, h_l * w_l, out_dim], mask [B, h_l * w_l] or None)``."""
        b, _, d = tokens.shape
        h, w = grid
        x = tokens.transpose(1, 2).reshape(b, d, h, w)
        m = None if mask is None else mask.reshape(b, h, w)
        up = self.up(x)
        up_mask = None if m is None else m.repeat_interleave(2, 1).repeat_interleave(2, 2)
        levels = [(up, up_mask), (x, m), _masked_max_pool(x, m, 2), _masked_max_pool(x, m, 4)]
        out = []
        for proj, (feat, keep) in zip(self.proj, levels, strict=True):
            flat = proj(feat.flatten(2).transpose(1, 2))
            out.append((flat, None if keep is None else keep.flatten(1)))
        return out

    @staticmethod
    def to_patches(values: Tensor, grid: tuple[int, int], mask: Tensor | None = None) -> Tensor:
        """Values over the concatenated levels' tokens ``[..., M]`` -> over the patch grid
        ``[..., h * w]``, linear and mass-preserving (sums are kept): a ``2x`` token adds to the
        patch it lies in, a ``1x`` token is its patch, a pooled token is spread evenly over the
        real patches of its window (``mask [B, h * w]``, ``B`` the first of ``values``' leading
        dimensions: a padded batch's real patches; default all). Used for the cross-attention
        maps and their relevance."""
        h, w = grid
        grids = SimpleFeaturePyramid.level_grids(grid)
        total = sum(lh * lw for lh, lw in grids)
        if values.shape[-1] != total:
            raise ValueError(f"to_patches: {values.shape[-1]} tokens, but the pyramid of grid {grid} has {total}")
        lead = values.shape[:-1]
        if mask is None:
            real = values.new_ones(h, w)
        else:
            real = mask.to(values.dtype).reshape(mask.shape[0], *[1] * (len(lead) - 1), h, w)
        out = values.new_zeros(*lead, h, w)
        start = 0
        for scale, (lh, lw) in zip(PYRAMID_SCALES, grids, strict=True):
            part = values[..., start : start + lh * lw].reshape(*lead, lh, lw)
            start += lh * lw
            if scale > 1:
                out = out + part.reshape(*lead, h, 2, w, 2).sum(dim=(-3, -1))
            elif scale == 1:
                out = out + part
            else:
                k = round(1 / scale)
                padded = F.pad(real, (0, lw * k - w, 0, lh * k - h))
                count = padded.reshape(*padded.shape[:-2], lh, k, lw, k).sum(dim=(-3, -1))  # real patches per window
                spread = torch.where(count > 0, part / count.clamp(min=1), torch.zeros_like(part))
                up = spread.repeat_interleave(k, -2)[..., :h, :].repeat_interleave(k, -1)[..., :w]
                out = out + up * real
        return out.reshape(*lead, h * w)
