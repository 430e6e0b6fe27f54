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

- **Fine-grained distribution refinement** (``fdr``; D-FINE, Peng et al. 2025,
  :mod:`vision_attn.models.fdr`): the first layer's box is an initial box; every layer predicts
  a distribution over offsets for each edge of it, adding its logits to the previous layer's.
  Extra output keys per layer: ``pred_corners`` (``[B, Q, 4, N + 1]`` edge logits) and
  ``fdr_initial`` (the initial boxes, detached), which the set criterion's localisation and
  self-distillation terms read. Needs ``box_refine``; replaces ``look_forward_twice``.

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
from torch import Tensor, nn

from vision_attn.boxes import box_cxcywh_to_xyxy
from vision_attn.models.denoising import O2M_MODES, denoising_slots, noise_boxes, noise_labels, query_group_mask
from vision_attn.models.encoder import EncoderOutput
from vision_attn.models.fdr import decode_edges, edge_offsets
from vision_attn.models.layers import MLP, DecoderLayer, sine_position_embedding_2d
from vision_attn.models.pyramid import PYRAMID_SCALES, SimpleFeaturePyramid

__all__ = ["DETRConfig", "DETRHead", "O2M_MODES", "PYRAMID_SCALES", "SimpleFeaturePyramid", "cell_centres",
           "noise_boxes", "noise_labels", "post_process", "query_group_mask"]

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
        fdr: D-FINE's fine-grained distribution refinement of the box edges (Peng et al. 2025,
            :mod:`vision_attn.models.fdr`). Needs ``box_refine``, not with ``look_forward_twice``.
        fdr_bins: ``N``, the offsets per edge minus one (even; D-FINE's 32).
        fdr_up: the largest inner offset, as a fraction of the initial box's size (D-FINE's 0.5).
        fdr_curvature: how closely the offsets gather around 0 (smaller: closer; D-FINE's 0.25).
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
    fdr: bool = False
    fdr_bins: int = 32
    fdr_up: float = 0.5
    fdr_curvature: float = 0.25
    top_k: int = 100

    def __post_init__(self) -> None:
        if self.dense_encoder and not self.query_selection:
            raise ValueError("dense_encoder supervises the tokens query selection scores: set query_selection=True "
                             "(or switch dense_encoder off)")
        if self.hidden_dim % 4:
            raise ValueError(f"hidden_dim must be divisible by 4, got {self.hidden_dim}")
        for name, on in (("dn_groups", self.dn_groups > 0), ("query_selection", self.query_selection),
                         ("look_forward_twice", self.look_forward_twice), ("fdr", self.fdr)):
            if on and not self.box_refine:
                raise ValueError(f"{name} needs reference boxes: set box_refine=True (or switch {name} off)")
        if self.dn_groups < 0 or self.o2m_groups < 0:
            raise ValueError(f"dn_groups ({self.dn_groups}) and o2m_groups ({self.o2m_groups}) must be >= 0")
        if not 0 <= self.label_noise_ratio <= 1:
            raise ValueError(f"label_noise_ratio must lie in [0, 1], got {self.label_noise_ratio}")
        if self.box_noise_scale < 0:
            raise ValueError(f"box_noise_scale must be >= 0, got {self.box_noise_scale}")
        if self.fdr and self.look_forward_twice:
            raise ValueError("fdr refines each layer's edge distributions, not its box: switch look_forward_twice off")
        if self.fdr:
            edge_offsets(self.fdr_bins, self.fdr_up, self.fdr_curvature)  # (raises on bad values)
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
            # with fdr, only the first layer regresses a box (the initial box)
            self.box_heads = nn.ModuleList(MLP(hidden_dim, hidden_dim, 4, 3) for _ in range(1 if c.fdr else num_layers))
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
        # switches off draws exactly the same initial weights as the plain head.
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
        if c.fdr:
            self.fdr_heads = nn.ModuleList(MLP(hidden_dim, hidden_dim, 4 * (c.fdr_bins + 1), 3)
                                           for _ in range(num_layers))
            for head in self.fdr_heads:  # start uniform: expectation 0, the initial box
                nn.init.zeros_(head.layers[-1].weight)
                nn.init.zeros_(head.layers[-1].bias)
            self.register_buffer("fdr_offsets", edge_offsets(c.fdr_bins, c.fdr_up, c.fdr_curvature), persistent=False)

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
        """Noised ground truth as queries: ``(contents [B, D, hidden], boxes [B, D, 4], real [B, D], meta)``
        (the slots and ``meta``: :func:`~vision_attn.models.denoising.denoising_slots`)."""
        labels, boxes, real, negative, meta = denoising_slots(targets, self.dn_groups, self.dn_negatives, device)
        b, total = len(targets), meta["groups"] * meta["group_size"]
        noised_labels = noise_labels(labels, self.num_classes, self.label_noise_ratio)
        noised_boxes = noise_boxes(boxes, self.box_noise_scale, negative)
        contents = self.label_embed(noised_labels).reshape(b, total, self.hidden_dim)
        return contents, noised_boxes.reshape(b, total, 4), real.reshape(b, total), meta

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
        q = self.num_queries
        result: dict = {}
        x, reference, query_embed = self._matching_queries(memory, proposals, memory_mask, result)
        # training-only extra queries: one-to-many groups, then denoising groups
        n_o2m = self.o2m_groups if self.training else 0
        if n_o2m:
            x, reference, query_embed = self._add_o2m_queries(x, reference, query_embed, memory, n_o2m)
        dn_meta, key_mask = None, None
        if self.dn_groups and self.training and targets is not None:
            x, reference, dn_meta, key_mask = self._add_denoising_queries(x, reference, targets, memory.device)
        mask = None
        if x.shape[1] > q:
            mask = query_group_mask(q, n_o2m, self.o2m_mode, dn_meta["groups"] if dn_meta else 0,
                                    dn_meta["group_size"] if dn_meta else 0, memory.device)
        outputs, weights = self._decode(enc, x, reference, query_embed, (memory, memory_pos, memory_mask),
                                        key_mask, mask, need_weights)

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

    def _matching_queries(self, memory: Tensor, proposals: Tensor | None, memory_mask: Tensor | None,
                          result: dict) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The ``Q`` matching queries: ``(contents [B, Q, hidden], reference boxes [B, Q, 4] or
        None, positional embedding [1, Q, hidden] or None)``. With query selection the anchors come
        from the memory tokens, and ``enc_outputs`` (and ``dense_outputs``) are put in ``result``."""
        b = memory.shape[0]
        if self.query_selection:
            reference, result["enc_outputs"], dense = self._select_queries(memory, proposals, memory_mask)
            if dense is not None:
                result["dense_outputs"] = dense
            x = self.query_content.weight.unsqueeze(0).expand(b, -1, -1)
        else:
            x = memory.new_zeros(b, self.num_queries, self.hidden_dim)
            reference = self.anchors.unsqueeze(0).expand(b, -1, -1) if self.box_refine else None
        query_embed = None if self.box_refine else self.query_embed.weight.unsqueeze(0)
        return x, reference, query_embed

    def _add_o2m_queries(self, x: Tensor, reference: Tensor | None, query_embed: Tensor | None, memory: Tensor,
                         n_o2m: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The queries with ``n_o2m`` one-to-many groups of ``Q`` appended (training only)."""
        b, q = memory.shape[0], self.num_queries
        if self.query_selection:
            x = torch.cat([x, self.o2m_content.reshape(1, -1, self.hidden_dim).expand(b, -1, -1)], dim=1)
            reference = torch.cat([reference, reference.repeat(1, n_o2m, 1)], dim=1)
        elif self.box_refine:
            x = memory.new_zeros(b, q * (1 + n_o2m), self.hidden_dim)
            reference = torch.cat([reference, self.o2m_anchors.reshape(1, -1, 4).expand(b, -1, -1)], dim=1)
        else:
            x = memory.new_zeros(b, q * (1 + n_o2m), self.hidden_dim)
            query_embed = torch.cat([query_embed, self.o2m_query_embed.reshape(1, -1, self.hidden_dim)], dim=1)
        return x, reference, query_embed

    def _add_denoising_queries(self, x: Tensor, reference: Tensor, targets: list[dict[str, Tensor]],
                               device: torch.device) -> tuple[Tensor, Tensor, dict, Tensor | None]:
        """The queries with the denoising groups appended (training only): ``(contents, reference
        boxes, dn_meta, key mask [B, T] or None)`` (the key mask hides padded denoising slots)."""
        contents, dn_boxes, real, dn_meta = self._denoising_queries(targets, device)
        x = torch.cat([x, contents.to(x.dtype)], dim=1)
        reference = torch.cat([reference, dn_boxes.to(reference.dtype)], dim=1)
        key_mask = None
        if dn_meta["padded"]:  # (known on the CPU: no device synchronisation)
            key_mask = torch.cat([real.new_ones(x.shape[0], x.shape[1] - real.shape[1]), real], dim=1)
        return x, reference, dn_meta, key_mask

    def _decode(self, enc: EncoderOutput, x: Tensor, reference: Tensor | None, query_embed: Tensor | None,
                memory: tuple[Tensor, Tensor, Tensor | None], key_mask: Tensor | None, mask: Tensor | None,
                need_weights: bool) -> tuple[list[dict], list[Tensor | None]]:
        """Run the decoder layers: per layer (every layer with box refinement or while training,
        else the last only) the logits and boxes of all queries, and per layer the cross-attention
        weights of the matching queries over the patch grid (``None`` without ``need_weights``).
        ``memory``: ``(tokens, positions, key mask)`` as :meth:`_memory` gives them."""
        memory, memory_pos, memory_mask = memory
        q = self.num_queries
        outputs, weights = [], []
        one_step = None  # look forward twice: the previous layer's box, differentiable through its own head
        initial, corners = None, None  # fdr: the first layer's box and the running edge logits
        for i, layer in enumerate(self.layers):
            query_pos = (self.pos_mlp(_box_sine_embedding(reference, self.hidden_dim)) if self.box_refine
                         else query_embed)
            x, w = layer(x, memory, query_pos=query_pos, memory_pos=memory_pos, need_weights=need_weights,
                         key_mask=key_mask, self_attn_mask=mask, memory_key_mask=memory_mask)
            weights.append(None if w is None else self.cross_attn_to_patches(w if mask is None else w[:, :, :q],
                                                                              enc.grid, enc.patch_mask))
            if self.config.fdr:
                h = self.norm(x)
                if initial is None:
                    initial = (self.box_heads[0](h) + _inverse_sigmoid(reference)).sigmoid()
                step = self.fdr_heads[i](h).unflatten(-1, (4, self.config.fdr_bins + 1))
                corners = step if corners is None else corners + step
                boxes = decode_edges(initial, corners.softmax(-1), self.fdr_offsets)
                outputs.append({"pred_logits": self.class_heads[i](h), "pred_boxes": boxes, "pred_corners": corners,
                                "fdr_initial": initial.detach()})
                reference = boxes.detach()
            elif self.box_refine:
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
        return outputs, weights



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
