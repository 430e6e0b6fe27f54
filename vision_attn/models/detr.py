"""DETR-style detection head: object queries cross-attend over the encoder's patch tokens.

Outputs (a dict, the same keys as DETR):

- ``pred_logits``: ``[B, Q, C + 1]`` (last = "no object"), or ``[B, Q, C]`` with ``focal=True``;
- ``pred_boxes``: ``[B, Q, 4]`` boxes as ``(cx, cy, w, h)`` in ``[0, 1]`` of the model input;
- ``aux_outputs``: the same two for every earlier decoder layer (auxiliary losses);
- ``cross_attn`` (with ``need_weights=True``): per layer ``[B, heads, Q, h * w]``.

``box_refine=True`` switches on a published remedy for DETR's slow convergence: each query owns
a learned reference box (anchor, as in DAB-DETR), its positional query is the sine embedding of
that box, and every layer predicts a correction of the previous layer's box in logit space
(iterative refinement, Deformable DETR). The plain recipe stays available with ``False``.

Further published training aids, each off by default (then the head is exactly the one above):

- **Denoising queries** (``dn_groups > 0``; DN-DETR, Li et al. 2022; with ``dn_negatives``
  DINO's contrastive denoising, Zhang et al. 2022). While training, and only when the forward
  is given the targets, ``dn_groups`` copies of the ground truth with noised boxes
  (:func:`noise_boxes`) and flipped labels (:func:`noise_labels`) are added as extra queries
  (content: an embedding of the noised label; reference box: the noised box). Each must
  reconstruct its original box and class; DINO's negatives (noised further) must say "no
  object". A self-attention mask (:func:`query_group_mask`) keeps the matching queries from
  seeing them and the groups from seeing each other. Output keys ``dn_outputs`` (logits, boxes
  and ``aux_outputs`` of the denoising queries) and ``dn_meta`` (which query reconstructs which
  target).
- **Mixed query selection** (``query_selection``; DINO): every patch token predicts a class and
  a box (a box two patches wide at the patch, corrected by an auxiliary head); the ``Q``
  best-scoring tokens' boxes (detached) become the anchors, the query contents stay learned.
  Output key ``enc_outputs`` (logits and boxes of the selected tokens), trained by the set
  criterion with its own Hungarian matching.
- **Dense token supervision** (``dense_encoder``, with query selection; the auxiliary dense heads
  of Co-DETR, Zong et al. 2023): while training, every token's class and box (those query
  selection scores) are returned as ``dense_outputs`` and trained one-to-many by the set
  criterion (FCOS's assignment: the tokens inside a box learn it). Unlike Co-DETR, whose auxiliary
  heads are separate, it trains the selection head itself: no extra weights, nothing changes at
  inference.
- **Look forward twice** (``look_forward_twice``; DINO): layer ``i``'s box is predicted from
  layer ``i - 1``'s box *without* detaching it, so layer ``i - 1``'s box head also learns from
  layer ``i``'s loss; the forward values are those of plain refinement.
- **One-to-many auxiliary groups** (``o2m_groups > 0``): while training, ``o2m_groups`` extra
  sets of ``Q`` queries run beside the ``Q`` matching ones, unseen by them.
  ``o2m_mode="group"`` (Group DETR, Chen et al. 2022): each extra group is its own set, matched
  one-to-one to the ground truth independently, the groups masked from each other.
  ``o2m_mode="hybrid"`` (H-DETR, Jia et al. 2023): the extra queries form one set matched to
  the ground truth repeated ``K`` times (the criterion's ``o2m_repeat``). Output key
  ``o2m_outputs`` (a list of such sets). At inference only the first (matching) group runs.

Query order inside the decoder while training: ``[Q matching | o2m_groups * Q | denoising]``.

Multi-scale memory (``pyramid``, off by default):

- **Simple feature pyramid** (``pyramid=True``; ViTDet, Li et al. 2022, "Exploring Plain Vision
  Transformer Backbones for Object Detection"): from the ViT's last patch-token map alone, four
  levels at strides 1/2, 1, 2 and 4 of the patch stride (a 2x2 stride-2 transposed convolution,
  the map itself, 2x2 and 4x4 max pooling), each projected to the decoder width (linear +
  LayerNorm, per token) (:class:`SimpleFeaturePyramid`). The decoder's cross-attention is dense
  over the concatenated levels' tokens; each level has its own sine position embedding (of its
  grid) plus a learned level embedding (Deformable DETR). ``cross_attn`` is still given over the
  patch grid: each level's weights are resampled to the grid and summed
  (:meth:`SimpleFeaturePyramid.to_patches`, mass-preserving).

Padded batches (images of different sizes, :meth:`~vision_attn.models.encoder.ViTEncoder.forward`
with ``image_sizes``): the encoder's ``patch_mask`` masks the padded memory tokens out of the
cross-attention and out of query selection, and the position embeddings (and query-selection
proposals) of each image are those of its own grid, so an image's detections do not depend on
the padding; boxes are fractions of each image's own (unpadded) size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.boxes import box_cxcywh_to_xyxy, box_xyxy_to_cxcywh
from vision_attn.models.encoder import EncoderOutput
from vision_attn.models.layers import MLP, DecoderLayer, sine_position_embedding_2d

__all__ = ["DETRConfig", "DETRHead", "PYRAMID_SCALES", "SimpleFeaturePyramid", "noise_boxes", "noise_labels",
           "post_process", "query_group_mask"]

O2M_MODES = ("group", "hybrid")


@dataclass(frozen=True)
class DETRConfig:
    """What a :class:`DETRHead` is built from: its architecture, its training aids (see the module
    docstring) and how many detections post-processing keeps. The defaults are a small head for
    the suite's detector; DETR's own is :data:`DEFAULT_DETR`.

    Attributes:
        num_queries: object queries ``Q`` (the most objects one image can have).
        hidden_dim: decoder width (divisible by 4).
        num_layers: decoder layers.
        num_heads: attention heads.
        mlp_ratio: feed-forward width relative to ``hidden_dim``.
        dropout: dropout in the decoder.
        focal: sigmoid classifier over ``C`` classes (no "no object" logit; trained with the focal
            loss) instead of softmax + no-object.
        box_refine: learned anchor boxes, box-conditioned positional queries and iterative
            per-layer box refinement (see the module docstring).
        dn_groups: denoising query groups while training (DN-DETR); 0 = off. Needs ``box_refine``.
        label_noise_ratio: DINO's ``label_noise_ratio``: a denoising query's label is redrawn
            uniformly from the ``C`` classes with probability ``label_noise_ratio / 2``
            (:func:`noise_labels`); the default 0.5 is DINO's (a quarter of the labels redrawn).
        box_noise_scale: denoising box noise, as a fraction of the box's half size
            (:func:`noise_boxes`).
        dn_negatives: add DINO's contrastive negatives (a second, noisier copy per group that
            must predict "no object").
        query_selection: DINO's mixed query selection (anchors from the top-``Q`` encoder tokens,
            with their own matched loss). Needs ``box_refine``.
        look_forward_twice: DINO's look-forward-twice box refinement. Needs ``box_refine``.
        o2m_groups: extra one-to-many query groups while training (Group DETR / H-DETR); 0 = off.
        o2m_mode: ``"group"`` (Group DETR: each group matched on its own) or ``"hybrid"`` (H-DETR:
            one set of extra queries matched to the targets repeated ``K`` times, the set loss's
            ``o2m_repeat``).
        pyramid: cross-attend over ViTDet's simple feature pyramid of the last patch map
            (:class:`SimpleFeaturePyramid`; strides 1/2, 1, 2, 4 patches) instead of the patch
            tokens alone.
        dense_encoder: also train every encoder token's class and box while training, one-to-many
            (``dense_outputs``: Co-DETR's auxiliary dense supervision with FCOS's assignment).
            Needs ``query_selection``; training only.
        top_k: detections kept per image by :func:`post_process`.
    """

    num_queries: int = 20
    hidden_dim: int = 128
    num_layers: int = 3
    num_heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    focal: bool = False
    box_refine: bool = False
    dn_groups: int = 0
    label_noise_ratio: float = 0.5
    box_noise_scale: float = 1.0
    dn_negatives: bool = False
    query_selection: bool = False
    look_forward_twice: bool = False
    o2m_groups: int = 0
    o2m_mode: str = "group"
    pyramid: bool = False
    dense_encoder: bool = False
    top_k: int = 100

    def __post_init__(self) -> None:
        if self.dense_encoder and not self.query_selection:
            raise ValueError("dense_encoder supervises the tokens query selection scores: set query_selection=True "
                             "(or switch dense_encoder off)")
        if self.hidden_dim % 4:
            raise ValueError(f"hidden_dim must be divisible by 4, got {self.hidden_dim}")
        for name, on in (("dn_groups", self.dn_groups > 0), ("query_selection", self.query_selection),
                         ("look_forward_twice", self.look_forward_twice)):
            if on and not self.box_refine:
                raise ValueError(f"{name} needs reference boxes: set box_refine=True (or switch {name} off)")
        if self.dn_groups < 0 or self.o2m_groups < 0:
            raise ValueError(f"dn_groups ({self.dn_groups}) and o2m_groups ({self.o2m_groups}) must be >= 0")
        if not 0 <= self.label_noise_ratio <= 1:
            raise ValueError(f"label_noise_ratio must lie in [0, 1], got {self.label_noise_ratio}")
        if self.box_noise_scale < 0:
            raise ValueError(f"box_noise_scale must be >= 0, got {self.box_noise_scale}")
        if self.o2m_mode not in O2M_MODES:
            raise ValueError(f"o2m_mode must be one of {O2M_MODES}, got {self.o2m_mode!r}")


DEFAULT_DETR = DETRConfig(num_queries=100, hidden_dim=256, num_layers=6, num_heads=8, dropout=0.1)
"""DETR's own head (Carion et al. 2020): 100 queries, width 256, 6 layers, 8 heads, dropout 0.1."""


def _inverse_sigmoid(x: Tensor, eps: float = 1e-5) -> Tensor:
    x = x.clamp(eps, 1 - eps)
    return torch.log(x / (1 - x))


def _box_sine_embedding(boxes: Tensor, dim: int, temperature: float = 10000.0) -> Tensor:
    """``[..., 4]`` boxes in [0, 1] -> ``[..., dim]`` sine/cosine features (dim/4 per coordinate)."""
    quarter = dim // 4
    freq = temperature ** (2 * (torch.arange(quarter, device=boxes.device) // 2) / quarter)
    pos = boxes[..., None] * 2 * math.pi / freq  # (..., 4, dim/4)
    pos = torch.stack([pos[..., 0::2].sin(), pos[..., 1::2].cos()], dim=-1).flatten(-2)
    return pos.flatten(-2)


def _grid_position(grid: tuple[int, int], valid: list[tuple[int, int]] | None, dim: int,
                   device: torch.device) -> Tensor:
    """Sine position embedding of a token grid: ``[1, h * w, dim]``, or with ``valid`` (per image
    its real rows and columns, top-left) ``[B, h * w, dim]``, each image's real cells embedded
    as its own grid (padding: zeros)."""
    if valid is None:
        return sine_position_embedding_2d(grid, dim, device=device).unsqueeze(0)
    h, w = grid
    out = torch.zeros(len(valid), h, w, dim, device=device)
    for size in set(valid):
        emb = sine_position_embedding_2d(size, dim, device=device).reshape(*size, dim)
        for i in (i for i, v in enumerate(valid) if v == size):
            out[i, : size[0], : size[1]] = emb
    return out.reshape(len(valid), h * w, dim)


def cell_centres(grid: tuple[int, int], real: tuple[int, int] | None = None,
                 device: torch.device | None = None) -> Tensor:
    """``[h * w, 2]`` ``(x, y)`` centres of a ``grid = (h, w)`` token grid's cells, row-major, as
    fractions of the ``real = (rows, cols)`` cells that hold the image (default: the whole grid)."""
    h, w = grid
    vh, vw = real or grid
    cy = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / vh
    cx = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / vw
    return torch.stack([cx[None, :].expand(h, w), cy[:, None].expand(h, w)], dim=-1).reshape(h * w, 2)


def _grid_proposals(grid: tuple[int, int], valid: list[tuple[int, int]] | None, device: torch.device) -> Tensor:
    """One box per cell, row-major: centred on it, two cells wide and high (``[1, h * w, 4]``);
    with ``valid`` ``[B, h * w, 4]``, each image's cells as fractions of its own real grid."""
    h, w = grid
    rows = [grid] if valid is None else valid
    out = []
    for vh, vw in rows:
        centres = cell_centres(grid, (vh, vw), device)
        size = torch.tensor([min(1.0, 2 / vw), min(1.0, 2 / vh)], device=device).expand(h * w, 2)
        out.append(torch.cat([centres, size], dim=-1))
    return torch.stack(out)


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


class DETRHead(nn.Module):
    """Object queries + transformer decoder over patch tokens + class and box heads.

    Args:
        in_dim: width of the encoder tokens.
        num_classes: ``C`` real classes.
        config: the architecture and the training aids (:class:`DETRConfig`; its defaults are
            DETR's: 100 queries, width 256, 6 layers, 8 heads, dropout 0.1).
    """

    def __init__(self, in_dim: int, num_classes: int, config: DETRConfig = DEFAULT_DETR) -> None:
        super().__init__()
        self.config = config
        c = config
        num_queries, hidden_dim, num_layers, focal, box_refine = (c.num_queries, c.hidden_dim, c.num_layers,
                                                                  c.focal, c.box_refine)
        dn_groups, query_selection, o2m_groups, pyramid = c.dn_groups, c.query_selection, c.o2m_groups, c.pyramid
        self.num_classes, self.num_queries, self.hidden_dim = num_classes, num_queries, hidden_dim
        self.focal, self.box_refine = focal, box_refine
        self.dn_groups, self.label_noise_ratio, self.box_noise_scale = dn_groups, c.label_noise_ratio, c.box_noise_scale
        self.dn_negatives, self.query_selection, self.look_forward_twice = (c.dn_negatives, query_selection,
                                                                            c.look_forward_twice)
        self.o2m_groups, self.o2m_mode, self.pyramid = o2m_groups, c.o2m_mode, bool(pyramid)
        self.dense_encoder = bool(c.dense_encoder)
        if not pyramid:  # (with it, each pyramid level has its own projection)
            self.input_proj = nn.Linear(in_dim, hidden_dim)
        self.layers = nn.ModuleList(DecoderLayer(hidden_dim, c.num_heads, c.mlp_ratio, c.dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_dim)
        n_out = num_classes if focal else num_classes + 1
        if box_refine:
            if not query_selection:  # (with it, the anchors come from the encoder tokens)
                self.anchors = nn.Parameter(torch.rand(num_queries, 4) * 0.8 + 0.1)  # cx, cy, w, h in [0, 1]
            self.pos_mlp = MLP(hidden_dim, hidden_dim, hidden_dim, 2)
            self.class_heads = nn.ModuleList(nn.Linear(hidden_dim, n_out) for _ in range(num_layers))
            self.box_heads = nn.ModuleList(MLP(hidden_dim, hidden_dim, 4, 3) for _ in range(num_layers))
            for head in self.box_heads:  # start as "keep the reference box"
                nn.init.zeros_(head.layers[-1].weight)
                nn.init.zeros_(head.layers[-1].bias)
        else:
            self.query_embed = nn.Embedding(num_queries, hidden_dim)
            self.class_heads = nn.ModuleList([nn.Linear(hidden_dim, n_out)])
            self.box_heads = nn.ModuleList([MLP(hidden_dim, hidden_dim, 4, 3)])
        if focal:  # prior probability 0.01 per class, as in RetinaNet
            for head in self.class_heads:
                nn.init.constant_(head.bias, -math.log((1 - 0.01) / 0.01))
        # The switches' own parameters, created after all of the above so that a head with the
        # switches off draws exactly the same initial weights as before they existed.
        if query_selection:
            self.query_content = nn.Embedding(num_queries, hidden_dim)  # learned contents (DINO: tgt_embed)
            self.enc_proj = nn.Linear(hidden_dim, hidden_dim)
            self.enc_norm = nn.LayerNorm(hidden_dim)
            self.enc_class_head = nn.Linear(hidden_dim, n_out)
            self.enc_box_head = MLP(hidden_dim, hidden_dim, 4, 3)
            nn.init.zeros_(self.enc_box_head.layers[-1].weight)  # start at the patch's proposal box
            nn.init.zeros_(self.enc_box_head.layers[-1].bias)
            if focal:
                nn.init.constant_(self.enc_class_head.bias, -math.log((1 - 0.01) / 0.01))
        if o2m_groups:
            if query_selection:  # the groups share the selected anchors, each has its own contents
                self.o2m_content = nn.Parameter(torch.randn(o2m_groups, num_queries, hidden_dim))
            elif box_refine:
                self.o2m_anchors = nn.Parameter(torch.rand(o2m_groups, num_queries, 4) * 0.8 + 0.1)
            else:
                self.o2m_query_embed = nn.Parameter(torch.randn(o2m_groups, num_queries, hidden_dim))
        if dn_groups:
            self.label_embed = nn.Embedding(num_classes, hidden_dim)  # content of a denoising query
        if pyramid:
            self.feature_pyramid = SimpleFeaturePyramid(in_dim, hidden_dim)

    def no_weight_decay(self) -> set[str]:
        """The switches' query embeddings (contents, anchors, label embedding) are not decayed,
        like the head's own ``query_embed`` and ``anchors``, nor the pyramid's level embedding
        (timm's convention: names relative to this module)."""
        names = {"query_content.weight", "o2m_content", "o2m_anchors", "o2m_query_embed", "label_embed.weight",
                 "feature_pyramid.level_embed"}
        own = {n for n, _ in self.named_parameters()}
        return names & own

    # ------------------------------------------------------------------ queries
    def _select_queries(self, memory: Tensor, proposals: Tensor, mask: Tensor | None = None
                        ) -> tuple[Tensor, dict, dict | None]:
        """DINO's mixed query selection: ``(anchors [B, Q, 4] detached, enc_outputs, dense_outputs)``
        (``dense_outputs``: every token's logits, box, centre and mask with ``dense_encoder`` while
        training, else ``None``).

        ``proposals``: ``[1 or B, N, 4]`` each memory token's proposal box; ``mask``: ``[B, N]``
        real tokens (padding is never selected)."""
        b, n, _ = memory.shape
        if n < self.num_queries:
            raise ValueError(f"query_selection picks num_queries={self.num_queries} of the {n} "
                             f"{'pyramid' if self.pyramid else 'patch'} tokens: "
                             "lower num_queries, use more patches, or switch query_selection off")
        out = self.enc_norm(self.enc_proj(memory))
        logits = self.enc_class_head(out)  # (B, N, C(+1))
        unsig = self.enc_box_head(out) + _inverse_sigmoid(proposals.to(memory.dtype))
        with torch.no_grad():
            score = logits.amax(-1) if self.focal else logits.softmax(-1)[..., :-1].amax(-1)
            if mask is not None:
                score = score.masked_fill(~mask, float("-inf"))
            top = score.topk(self.num_queries, dim=1).indices  # (B, Q)
        dense = None
        if self.dense_encoder and self.training:  # every token's class and box (one-to-many, training only)
            dense = {"pred_logits": logits, "pred_boxes": unsig.sigmoid(),
                     "centres": proposals[..., :2].to(memory.dtype).expand(b, -1, -1), "mask": mask}
        logits = torch.gather(logits, 1, top[..., None].expand(-1, -1, logits.shape[-1]))
        boxes = torch.gather(unsig, 1, top[..., None].expand(-1, -1, 4)).sigmoid()
        return boxes.detach(), {"pred_logits": logits, "pred_boxes": boxes}, dense

    def _denoising_queries(self, targets: list[dict[str, Tensor]],
                           device: torch.device) -> tuple[Tensor, Tensor, Tensor, dict]:
        """Noised ground truth as queries: ``(contents [B, D, hidden], boxes [B, D, 4], real [B, D], meta)``.

        A group holds ``P = max_b G_b`` positive slots (and, with negatives, ``P`` negative slots
        after them); image ``b`` fills the first ``G_b`` of each, the rest are padding (``real``
        is ``False``: hidden from every query and from the loss). ``meta["positive"]`` gives per
        image ``(query index, target index)`` (indices within the denoising queries, on the CPU),
        ``meta["negative"]`` the query indices that must predict "no object"; ``meta["groups"]``
        and ``meta["group_size"]`` the layout, ``meta["padded"]`` whether any slot is padding.
        """
        b = len(targets)
        pad = max((len(t["labels"]) for t in targets), default=0)
        size = pad * (2 if self.dn_negatives else 1)
        n = self.dn_groups
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
            negative_idx.append((starts + pad + slots).flatten() if self.dn_negatives else
                                torch.empty(0, dtype=torch.int64))
            for offset in (0, pad) if self.dn_negatives else (0,):
                labels[i, :, offset : offset + g] = t["labels"].to(device)
                boxes[i, :, offset : offset + g] = t["boxes"].to(device=device, dtype=boxes.dtype)
                real[i, :, offset : offset + g] = True
        noised_labels = noise_labels(labels, self.num_classes, self.label_noise_ratio)
        noised_boxes = noise_boxes(boxes, self.box_noise_scale, negative)
        contents = self.label_embed(noised_labels).reshape(b, n * size, self.hidden_dim)
        meta = {"groups": n, "group_size": size, "positive": positive_idx, "negative": negative_idx,
                "padded": any(len(t["labels"]) < pad for t in targets)}
        return contents, noised_boxes.reshape(b, n * size, 4), real.reshape(b, n * size), meta

    # ------------------------------------------------------------------ memory
    def _memory(self, enc: EncoderOutput) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """What the decoder reads: ``(memory [B, M, hidden], position [1 or B, M, hidden], key
        mask [B, M] or None, proposals [1 or B, M, 4] or None)`` (proposals: query selection only).

        Without the pyramid, the patch tokens projected (``M = h * w``); with it, the levels'
        tokens concatenated (:class:`SimpleFeaturePyramid`). With a padded batch (the encoder's
        ``patch_mask``) positions and proposals are per image, of its own grid."""
        mask = enc.patch_mask
        valid = None if mask is None else enc.valid_grids()
        device = enc.tokens.device
        if not self.pyramid:
            memory = self.input_proj(enc.patch_tokens)
            pos = _grid_position(enc.grid, valid, self.hidden_dim, device).to(memory.dtype)
            proposals = _grid_proposals(enc.grid, valid, device) if self.query_selection else None
            return memory, pos, mask, proposals
        levels = self.feature_pyramid(enc.patch_tokens, enc.grid, mask)
        grids = SimpleFeaturePyramid.level_grids(enc.grid)
        valid_levels = None if valid is None else [SimpleFeaturePyramid.level_grids(v) for v in valid]
        memory, pos, masks, proposals = [], [], [], []
        for lvl, ((tokens, keep), grid) in enumerate(zip(levels, grids, strict=True)):
            v = None if valid_levels is None else [g[lvl] for g in valid_levels]
            memory.append(tokens)
            pos.append(_grid_position(grid, v, self.hidden_dim, device).to(tokens.dtype)
                       + self.feature_pyramid.level_embed[lvl])
            masks.append(keep)
            if self.query_selection:
                proposals.append(_grid_proposals(grid, v, device))
        return (torch.cat(memory, 1), torch.cat(pos, 1), None if mask is None else torch.cat(masks, 1),
                torch.cat(proposals, 1) if proposals else None)

    def cross_attn_to_patches(self, weights: Tensor, grid: tuple[int, int], mask: Tensor | None = None) -> Tensor:
        """Cross-attention weights (or any values) over the memory ``[..., M]`` -> over the patch
        grid ``[..., h * w]`` (the identity without the pyramid); ``mask``: the encoder's
        ``patch_mask`` of a padded batch (:meth:`SimpleFeaturePyramid.to_patches`)."""
        return SimpleFeaturePyramid.to_patches(weights, grid, mask) if self.pyramid else weights

    # ------------------------------------------------------------------ forward
    def forward(self, enc: EncoderOutput, need_weights: bool = False,
                targets: list[dict[str, Tensor]] | None = None) -> dict:
        """Detections for encoder output ``enc`` (see the module docstring for the keys).

        Args:
            enc: the encoder's output.
            need_weights: also return the cross-attention weights (of the matching queries).
            targets: per image ``labels [G]`` and ``boxes [G, 4]`` (``cxcywh`` in ``[0, 1]``): the
                denoising queries' source; used only while training with ``dn_groups > 0``.
        """
        memory, memory_pos, memory_mask, proposals = self._memory(enc)  # (B, M, hidden), (1 or B, M, hidden)
        b = memory.shape[0]
        q = self.num_queries
        result: dict = {}
        if self.query_selection:
            reference, result["enc_outputs"], dense = self._select_queries(memory, proposals, memory_mask)
            if dense is not None:
                result["dense_outputs"] = dense
            x = self.query_content.weight.unsqueeze(0).expand(b, -1, -1)
        else:
            x = memory.new_zeros(b, q, self.hidden_dim)
            reference = self.anchors.unsqueeze(0).expand(b, -1, -1) if self.box_refine else None
        query_embed = None if self.box_refine else self.query_embed.weight.unsqueeze(0)
        # training-only extra queries: one-to-many groups, then denoising groups
        n_o2m = self.o2m_groups if self.training else 0
        if n_o2m:
            if self.query_selection:
                x = torch.cat([x, self.o2m_content.reshape(1, -1, self.hidden_dim).expand(b, -1, -1)], dim=1)
                reference = torch.cat([reference, reference.repeat(1, n_o2m, 1)], dim=1)
            elif self.box_refine:
                x = memory.new_zeros(b, q * (1 + n_o2m), self.hidden_dim)
                reference = torch.cat([reference, self.o2m_anchors.reshape(1, -1, 4).expand(b, -1, -1)], dim=1)
            else:
                x = memory.new_zeros(b, q * (1 + n_o2m), self.hidden_dim)
                query_embed = torch.cat([query_embed, self.o2m_query_embed.reshape(1, -1, self.hidden_dim)], dim=1)
        dn_meta, key_mask = None, None
        if self.dn_groups and self.training and targets is not None:
            contents, dn_boxes, real, dn_meta = self._denoising_queries(targets, memory.device)
            x = torch.cat([x, contents.to(x.dtype)], dim=1)
            reference = torch.cat([reference, dn_boxes.to(reference.dtype)], dim=1)
            if dn_meta["padded"]:  # (known on the CPU: no device synchronisation)
                key_mask = torch.cat([real.new_ones(b, x.shape[1] - real.shape[1]), real], dim=1)
        mask = None
        if x.shape[1] > q:
            mask = query_group_mask(q, n_o2m, self.o2m_mode, dn_meta["groups"] if dn_meta else 0,
                                    dn_meta["group_size"] if dn_meta else 0, memory.device)
        outputs, weights = [], []
        one_step = None  # look forward twice: the previous layer's box, differentiable through its own head
        for i, layer in enumerate(self.layers):
            query_pos = (self.pos_mlp(_box_sine_embedding(reference, self.hidden_dim)) if self.box_refine
                         else query_embed)
            x, w = layer(x, memory, query_pos=query_pos, memory_pos=memory_pos, need_weights=need_weights,
                         key_mask=key_mask, self_attn_mask=mask, memory_key_mask=memory_mask)
            weights.append(None if w is None else self.cross_attn_to_patches(w if mask is None else w[:, :, :q],
                                                                              enc.grid, enc.patch_mask))
            if self.box_refine:
                h = self.norm(x)
                logits, delta = self.class_heads[i](h), self.box_heads[i](h)
                boxes = (delta + _inverse_sigmoid(reference)).sigmoid()
                if self.look_forward_twice and one_step is not None:
                    # the same values; the gradient also reaches the previous layer's box head
                    one_step, boxes = boxes, (delta + _inverse_sigmoid(one_step)).sigmoid()
                else:
                    one_step = boxes
                outputs.append({"pred_logits": logits, "pred_boxes": boxes})
                reference = one_step.detach()  # each layer refines the previous one's boxes
            elif i == len(self.layers) - 1 or self.training:
                h = self.norm(x)
                outputs.append({"pred_logits": self.class_heads[0](h), "pred_boxes": self.box_heads[0](h).sigmoid()})

        def part(start: int, stop: int) -> dict:
            out = {k: v[:, start:stop] for k, v in outputs[-1].items()}
            out["aux_outputs"] = [{k: v[:, start:stop] for k, v in o.items()} for o in outputs[:-1]]
            return out

        result.update(part(0, q) if x.shape[1] > q else {**outputs[-1], "aux_outputs": outputs[:-1]})
        if n_o2m:
            sets = [(q, q * (1 + n_o2m))] if self.o2m_mode == "hybrid" else \
                [(q * (1 + g), q * (2 + g)) for g in range(n_o2m)]
            result["o2m_outputs"] = [part(s, e) for s, e in sets]
        if dn_meta is not None:
            result["dn_outputs"] = part(q * (1 + n_o2m), x.shape[1])
            result["dn_meta"] = dn_meta
        if need_weights:
            result["cross_attn"] = weights
        return result


@torch.no_grad()
def post_process(outputs: dict, image_sizes: Tensor, top_k: int = 100, focal: bool = False) -> list[dict[str, Tensor]]:
    """Turn head outputs into per-image detections in pixels of the *original* images.

    The head's boxes are fractions of the model input; the model input is the whole original
    image resized (no crop), so fractions scale directly to the original size. In a padded batch
    (aspect-preserving resize) they are fractions of each image's own unpadded input, which is
    still the whole original image resized.

    Two protocols, each the one its head was published with:

    - softmax head (``focal=False``, DETR): one detection per query: its most probable *real*
      class (argmax over the softmax without "no object") with that probability as score; the
      ``min(top_k, Q)`` best-scoring queries are kept.
    - sigmoid focal head (``focal=True``, Deformable DETR): the ``top_k`` highest-scoring
      (query, class) pairs over all queries and classes, so one query may give several
      detections with different classes.

    Args:
        outputs: the head's dict (``pred_logits``, ``pred_boxes``).
        image_sizes: ``[B, 2]`` original ``(height, width)`` in pixels.
        top_k: most detections kept per image.
        focal: the head is a sigmoid (focal) classifier.

    Returns:
        Per image ``{"scores": [K], "labels": [K] (0..C-1), "boxes": [K, 4] xyxy pixels,
        "queries": [K] query index}``, sorted by score.
    """
    logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
    b, q, _ = logits.shape
    if focal:
        probs = logits.sigmoid()  # (B, Q, C)
        c = probs.shape[-1]
        scores, flat = probs.reshape(b, -1).topk(min(top_k, q * c), dim=1)  # over (query, class) pairs
        queries, labels = flat // c, flat % c
    else:
        best, best_label = logits.softmax(-1)[..., :-1].max(-1)  # (B, Q): drop "no object", argmax
        scores, queries = best.topk(min(top_k, q), dim=1)
        labels = torch.gather(best_label, 1, queries)
    h, w = image_sizes[:, 0].to(boxes.dtype), image_sizes[:, 1].to(boxes.dtype)
    scale = torch.stack([w, h, w, h], dim=1)[:, None, :]  # (B, 1, 4)
    xyxy = box_cxcywh_to_xyxy(boxes).clamp(0, 1) * scale
    picked = torch.gather(xyxy, 1, queries[..., None].expand(-1, -1, 4))
    return [{"scores": scores[i], "labels": labels[i], "boxes": picked[i], "queries": queries[i]} for i in range(b)]
