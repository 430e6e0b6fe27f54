"""Building blocks shared by the DETR head and the caption decoder.

- :class:`MLP`: a few linear layers with ReLU in between (DETR's box head);
- :func:`sine_position_embedding_2d`: DETR's fixed 2-D sine/cosine embedding of a patch grid;
- :class:`DecoderLayer`: self-attention among the queries/words, cross-attention over the
  image's patch tokens, feed-forward — pre-norm, with the suite's
  :class:`~vision_attn.attention.MultiHeadAttention` (masks, weights, key/value cache).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vision_attn.attention import KVCache, MultiHeadAttention
from vision_attn.distributed import register_fsdp_block

__all__ = ["DecoderLayer", "LayerCache", "MLP", "sine_position_embedding_2d"]


class MLP(nn.Module):
    """``num_layers`` linear layers, ReLU between them (not after the last)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int) -> None:
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def sine_position_embedding_2d(
    grid: tuple[int, int], dim: int, temperature: float = 10000.0, device: torch.device | None = None
) -> Tensor:
    """Fixed ``[h * w, dim]`` embedding of a patch grid, row-major (as the encoder's tokens).

    Half of the channels encode the row, half the column, each as sines and cosines of the
    normalised coordinate (in ``(0, 2π]``) at geometrically spaced frequencies (DETR).
    """
    if dim % 4 != 0:
        raise ValueError(f"sine position embedding needs dim divisible by 4, got {dim}")
    h, w = grid
    quarter = dim // 4
    scale = 2 * math.pi
    y = (torch.arange(h, device=device, dtype=torch.float32) + 1) / h * scale
    x = (torch.arange(w, device=device, dtype=torch.float32) + 1) / w * scale
    freq = temperature ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    py = y[:, None] / freq  # (h, dim/4)
    px = x[:, None] / freq  # (w, dim/4)
    py = torch.cat([py.sin(), py.cos()], dim=1)  # (h, dim/2)
    px = torch.cat([px.sin(), px.cos()], dim=1)  # (w, dim/2)
    return torch.cat([py[:, None, :].expand(h, w, -1), px[None, :, :].expand(h, w, -1)], dim=-1).reshape(h * w, dim)


class LayerCache:
    """Key/value caches of one decoder layer: a growing self-attention cache and a static
    cross-attention cache (the image tokens are projected once)."""

    def __init__(self) -> None:
        self.self_attn = KVCache()
        self.cross_attn = KVCache(static=True)

    def reorder(self, index: Tensor) -> None:
        self.self_attn.reorder(index)
        self.cross_attn.reorder(index)


@register_fsdp_block
class DecoderLayer(nn.Module):
    """Pre-norm transformer decoder layer: self-attention, cross-attention, feed-forward.

    Args:
        dim: width of the queries / words.
        num_heads: attention heads.
        mlp_ratio: hidden width of the feed-forward block relative to ``dim``.
        dropout: dropout on attention weights and residual branches.
        memory_dim: width of the memory (image tokens); default ``dim``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 memory_dim: int | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.self_attn = MultiHeadAttention(dim, num_heads, dropout=dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.cross_attn = MultiHeadAttention(dim, num_heads, kdim=memory_dim or dim, vdim=memory_dim or dim,
                                             dropout=dropout)
        self.norm3 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim))
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        query_pos: Tensor | None = None,
        memory_pos: Tensor | None = None,
        causal: bool = False,
        key_mask: Tensor | None = None,
        memory_key_mask: Tensor | None = None,
        need_weights: bool = False,
        cache: LayerCache | None = None,
        self_attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``x [B, T, dim]`` attends to itself and to ``memory [B, N, memory_dim]``.

        Args:
            x: queries or word embeddings.
            memory: image tokens.
            query_pos: added to the queries and keys of both attentions (DETR's object queries).
            memory_pos: added to the memory's keys (not values) in cross-attention.
            causal: causal self-attention (captioning).
            key_mask: ``[B, T]`` ``True`` for real tokens (self-attention padding).
            memory_key_mask: ``[B, N]`` ``True`` for real image tokens.
            need_weights: return the cross-attention weights ``[B, heads, T, N]``.
            cache: incremental decoding (feed only the new tokens in ``x``).
            self_attn_mask: keep-mask of the self-attention (``True`` = query ``i`` may attend to
                query ``j``), ``[T, T]`` or ``[B, 1, T, T]``: DETR's denoising and auxiliary query
                groups use it to hide groups from each other. Combined with ``key_mask`` and
                ``causal``.

        Returns:
            ``(x, cross-attention weights or None)``.
        """
        h = self.norm1(x)
        q = h if query_pos is None else h + query_pos
        a, _ = self.self_attn(q, q, h, attn_mask=self_attn_mask, key_mask=key_mask, is_causal=causal,
                              cache=cache.self_attn if cache is not None else None)
        x = x + self.drop(a)
        h = self.norm2(x)
        q = h if query_pos is None else h + query_pos
        k = memory if memory_pos is None else memory + memory_pos
        a, w = self.cross_attn(q, k, memory, key_mask=memory_key_mask, need_weights=need_weights,
                               cache=cache.cross_attn if cache is not None else None)
        x = x + self.drop(a)
        x = x + self.drop(self.mlp(self.norm3(x)))
        return x, w
