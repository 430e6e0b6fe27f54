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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vision_attn.boxes import box_cxcywh_to_xyxy
from vision_attn.models.encoder import EncoderOutput
from vision_attn.models.layers import MLP, DecoderLayer, sine_position_embedding_2d

__all__ = ["DETRHead", "post_process"]


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


class DETRHead(nn.Module):
    """Object queries + transformer decoder over patch tokens + class and box heads.

    Args:
        in_dim: width of the encoder tokens.
        num_classes: ``C`` real classes.
        num_queries: object queries ``Q`` (the most objects one image can have).
        hidden_dim: decoder width.
        num_layers: decoder layers.
        num_heads: attention heads.
        mlp_ratio: feed-forward width relative to ``hidden_dim``.
        dropout: dropout in the decoder.
        focal: sigmoid classifier over ``C`` classes (no "no object" logit).
        box_refine: learned anchor boxes, box-conditioned positional queries and iterative
            per-layer box refinement (see the module docstring).
    """

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        num_queries: int = 100,
        hidden_dim: int = 256,
        num_layers: int = 6,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        dropout: float = 0.1,
        focal: bool = False,
        box_refine: bool = False,
    ) -> None:
        super().__init__()
        if hidden_dim % 4:
            raise ValueError(f"hidden_dim must be divisible by 4, got {hidden_dim}")
        self.num_classes, self.num_queries, self.hidden_dim = num_classes, num_queries, hidden_dim
        self.focal, self.box_refine = focal, box_refine
        self.input_proj = nn.Linear(in_dim, hidden_dim)
        self.layers = nn.ModuleList(DecoderLayer(hidden_dim, num_heads, mlp_ratio, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_dim)
        n_out = num_classes if focal else num_classes + 1
        if box_refine:
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

    def _predict(self, i: int, h: Tensor, reference: Tensor | None) -> tuple[Tensor, Tensor]:
        k = i if self.box_refine else 0
        logits = self.class_heads[k](h)
        delta = self.box_heads[k](h)
        boxes = (delta + _inverse_sigmoid(reference)).sigmoid() if reference is not None else delta.sigmoid()
        return logits, boxes

    def forward(self, enc: EncoderOutput, need_weights: bool = False) -> dict:
        """Detections for encoder output ``enc`` (see the module docstring for the keys)."""
        memory = self.input_proj(enc.patch_tokens)  # (B, N, hidden)
        b = memory.shape[0]
        memory_pos = sine_position_embedding_2d(enc.grid, self.hidden_dim, device=memory.device).to(memory.dtype)
        memory_pos = memory_pos.unsqueeze(0)  # (1, N, hidden)
        x = memory.new_zeros(b, self.num_queries, self.hidden_dim)
        reference = self.anchors.unsqueeze(0).expand(b, -1, -1) if self.box_refine else None
        outputs, weights = [], []
        for i, layer in enumerate(self.layers):
            if self.box_refine:
                query_pos = self.pos_mlp(_box_sine_embedding(reference, self.hidden_dim))
            else:
                query_pos = self.query_embed.weight.unsqueeze(0)
            x, w = layer(x, memory, query_pos=query_pos, memory_pos=memory_pos, need_weights=need_weights)
            weights.append(w)
            if self.box_refine or i == len(self.layers) - 1 or self.training:
                logits, boxes = self._predict(i, self.norm(x), reference)
                outputs.append({"pred_logits": logits, "pred_boxes": boxes})
                if self.box_refine:
                    reference = boxes.detach()  # each layer refines the previous one's boxes
        result = dict(outputs[-1])
        result["aux_outputs"] = outputs[:-1]
        if need_weights:
            result["cross_attn"] = weights
        return result


@torch.no_grad()
def post_process(outputs: dict, image_sizes: Tensor, top_k: int = 100, focal: bool = False) -> list[dict[str, Tensor]]:
    """Turn head outputs into per-image detections in pixels of the *original* images.

    The head's boxes are fractions of the model input; the model input is the whole original
    image resized (no crop), so fractions scale directly to the original size.

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
