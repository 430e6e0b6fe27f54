"""Scaled dot-product attention and multi-head attention, written out as the mechanism reads.

Attention lets every query look at a set of keys and take a weighted average of their values:

1. project the inputs into queries, keys and values: ``Q = x W_Q``, ``K = m W_K``, ``V = m W_V``
   (``m = x`` for self-attention; another sequence for cross-attention);
2. score every query against every key with a dot product, scaled by ``sqrt(d_k)`` so the
   scores keep unit variance whatever the head size;
3. exclude masked positions (a mask entry that is ``False``/``0`` is never attended);
4. softmax over the keys turns the scores into weights that sum to 1;
5. the output is the weighted sum of the values.

Multi-head attention runs this in ``num_heads`` subspaces of size ``d = embed_dim / num_heads``
in parallel, concatenates the heads and mixes them with an output projection ``W_O``.

Mask convention (one for the whole suite): boolean masks are *keep* masks — ``True`` means
"may attend", ``False`` means "excluded" — the same convention as
:func:`torch.nn.functional.scaled_dot_product_attention`. Floating-point masks are added to
the scores. A query whose keys are all excluded gets an all-zero output and all-zero weights
(never NaN).

Whenever the attention weights are not needed the fused kernel
(:func:`torch.nn.functional.scaled_dot_product_attention`) computes the same result without
materialising the ``T x T`` weights; set ``need_weights=True`` (or turn the module's
``fused_attn`` flag off, as :func:`vision_attn.capture_attention` does) for the explicit path.
One exception, for speed: on the CPU, short sequences (at least :data:`EXPLICIT_MIN_QUERIES`
queries, at most :data:`EXPLICIT_MAX_SCORES` scores per head) take the explicit path
(:func:`explicit_is_faster`), which is faster there on some processors and not on others
(``python -m benchmarks.cpu_paths`` times both on yours; the performance results page lists
the processors measured). ``vision_attn.attention.EXPLICIT_MAX_SCORES = 0`` sends every call to
the fused kernel.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "EXPLICIT_MAX_SCORES",
    "EXPLICIT_MIN_QUERIES",
    "KVCache",
    "MultiHeadAttention",
    "causal_mask",
    "explicit_attention",
    "explicit_is_faster",
    "scaled_dot_product_attention",
]

# On some CPUs the explicit path (matmul, softmax, matmul) is faster than PyTorch's fused kernel
# for attention of at least EXPLICIT_MIN_QUERIES queries with at most EXPLICIT_MAX_SCORES scores
# per head (64 x 64 or 30 x 30 tokens, forward + backward), on others slower; longer sequences
# (256 x 256) and one query at a time (incremental decoding) favour the fused kernel everywhere
# measured. `python -m benchmarks.cpu_paths` times both paths at these sizes
# (docs/results/performance.md).
EXPLICIT_MAX_SCORES = 128 * 128
EXPLICIT_MIN_QUERIES = 8


def explicit_is_faster(device: torch.device, num_queries: int, num_keys: int) -> bool:
    """Whether attention of ``num_queries`` queries over ``num_keys`` keys on ``device`` runs
    faster on the explicit path than in the fused kernel: on the CPU, for at least
    :data:`EXPLICIT_MIN_QUERIES` queries and at most :data:`EXPLICIT_MAX_SCORES` scores per head.
    The result is the same up to rounding."""
    return (device.type == "cpu" and num_queries >= EXPLICIT_MIN_QUERIES
            and num_queries * num_keys <= EXPLICIT_MAX_SCORES)


@contextlib.contextmanager
def explicit_attention(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Turn the ``fused_attn`` flag off on the given attention modules (timm's ``Attention`` and
    :class:`MultiHeadAttention` have one) for the ``with`` block; every flag is restored on
    exit, even after an error."""
    saved = [(m, m.fused_attn) for m in modules]
    try:
        for m, _ in saved:
            m.fused_attn = False
        yield
    finally:
        for m, flag in saved:
            m.fused_attn = flag


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> Tensor:
    """Keep-mask ``[num_queries, num_keys]`` for causal attention.

    The queries are the *last* ``num_queries`` positions of a sequence of ``num_keys``
    tokens (so it also serves incremental decoding, where earlier keys come from a cache):
    query ``i`` may attend to keys ``0 .. num_keys - num_queries + i``.
    """
    offset = num_keys - num_queries
    if offset < 0:
        raise ValueError(f"causal_mask: more queries ({num_queries}) than keys ({num_keys})")
    q_pos = torch.arange(num_queries, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    return k_pos <= q_pos


def _combine_masks(
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    is_causal: bool,
    num_queries: int,
    num_keys: int,
    device: torch.device,
) -> Tensor | None:
    """Merge an attention mask, a per-key mask and causality into one mask for ``[B, H, Tq, Tk]``.

    Returns ``None`` (no masking), a boolean keep-mask or an additive float mask, broadcastable
    to ``[B, H, Tq, Tk]``.
    """
    mask = attn_mask
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        mask = mask != 0  # integer 0/1 masks: 0 means excluded
    if key_mask is not None:
        if key_mask.dim() != 2 or key_mask.shape[1] != num_keys:
            raise ValueError(
                f"key_mask must have shape [batch, {num_keys}] (True = real token), "
                f"got {tuple(key_mask.shape)}"
            )
        km = key_mask.bool()[:, None, None, :]  # (B, 1, 1, Tk)
        if mask is None:
            mask = km
        elif mask.dtype == torch.bool:
            mask = mask & km
        else:
            mask = mask.masked_fill(~km, float("-inf"))
    if is_causal:
        cm = causal_mask(num_queries, num_keys, device)
        if mask is None:
            mask = cm
        elif mask.dtype == torch.bool:
            mask = mask & cm
        else:
            mask = mask.masked_fill(~cm, float("-inf"))
    return mask


def _fully_masked_rows(mask: Tensor | None) -> Tensor | None:
    """Boolean ``[..., Tq, 1]``: rows in which every key is excluded (or ``None`` if none can be)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    scale: float | None = None,
    attn_drop: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``softmax(Q Kᵀ / sqrt(d_k) + mask) V`` for tensors laid out ``[B, H, T, d]``.

    Args:
        q: queries ``[B, H, Tq, d_k]``.
        k: keys ``[B, H, Tk, d_k]``.
        v: values ``[B, H, Tk, d_v]``.
        attn_mask: keep-mask (bool, ``True`` = attend; integer ``0`` = excluded) or additive
            float mask, broadcastable to ``[B, H, Tq, Tk]``.
        key_mask: ``[B, Tk]`` boolean, ``True`` for real keys and ``False`` for padding.
        is_causal: query ``i`` only sees keys up to its own position (aligned at the end when
            ``Tq < Tk``, as in incremental decoding).
        dropout_p: dropout on the attention weights (pass ``0.0`` in evaluation).
        need_weights: also return the weights ``[B, H, Tq, Tk]``; forces the explicit path.
        scale: score scale, default ``1 / sqrt(d_k)``.
        attn_drop: optional module applied to the weights on the explicit path instead of
            functional dropout (this is where attention capture hooks in).

    Returns:
        ``(output [B, H, Tq, d_v], weights [B, H, Tq, Tk] or None)``. The weights are the
        softmax probabilities before dropout. Rows whose keys are all excluded give zeros.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = _combine_masks(attn_mask, key_mask, is_causal, tq, tk, q.device)
    dead = _fully_masked_rows(mask)
    if dead is not None:
        if not bool(dead.any()):
            dead = None
        elif mask.dtype == torch.bool:
            # Let dead rows attend everywhere (finite maths, finite gradients), zero them after.
            mask = mask | dead
        else:
            mask = mask.masked_fill(dead, 0.0)

    if not need_weights and attn_drop is None and not explicit_is_faster(q.device, tq, tk):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        weights = None
    else:
        scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask
        weights = scores.softmax(dim=-1)
        if dead is not None:
            weights = weights.masked_fill(dead, 0.0)
        if attn_drop is not None:
            dropped = attn_drop(weights)
        else:
            dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
        out = dropped @ v  # (B, H, Tq, d_v)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return out, (weights if need_weights else None)


@dataclass
class KVCache:
    """Keys and values already projected, for incremental decoding.

    ``k`` and ``v`` are ``[B, H, T, d]``. A *self-attention* cache grows by the new tokens at
    every step; a *static* cache (cross-attention over a fixed memory such as image patch
    tokens) is computed once and reused. :meth:`reorder` follows beam search's selection.
    """

    k: Tensor | None = None
    v: Tensor | None = None
    static: bool = False

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=-2)
            self.v = torch.cat([self.v, v], dim=-2)
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Select batch rows ``index`` (e.g. the surviving beams)."""
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """Multi-head attention: project, split into heads, attend, concatenate, project.

    Works as self-attention (``forward(x)``) or cross-attention (``forward(x, memory)``),
    batch first. Parameters ``q_proj`` (W_Q), ``k_proj`` (W_K), ``v_proj`` (W_V) and
    ``out_proj`` (W_O) are plain :class:`~torch.nn.Linear` layers.

    Args:
        embed_dim: model width of the queries (and of the output).
        num_heads: number of heads; ``embed_dim`` must be divisible by it.
        kdim: width of the key/memory sequence (default ``embed_dim``).
        vdim: width of the value sequence (default ``kdim``).
        dropout: dropout on the attention weights during training.
        bias: learn biases in the four projections.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        kdim = kdim or embed_dim
        vdim = vdim or kdim
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        # Same hook points as timm's Attention, so one capture mechanism serves both:
        # with ``fused_attn = False`` the weights pass through ``attn_drop``.
        self.attn_drop = nn.Dropout(dropout)
        self.fused_attn = True

    def _split(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = False,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` over ``key``/``value`` (default: ``query`` itself).

        Args:
            query: ``[B, Tq, embed_dim]``.
            key: ``[B, Tk, kdim]``; ``None`` for self-attention.
            value: ``[B, Tk, vdim]``; default ``key``.
            attn_mask: keep-mask (``True`` = attend) or additive float mask, broadcastable to
                ``[B, H, Tq, Tk]`` (``[Tq, Tk]`` works).
            key_mask: ``[B, Tk]``, ``True`` for real tokens, ``False`` for padding.
            is_causal: causal self-attention (with a cache, new tokens see all cached ones).
            need_weights: also return the attention weights.
            average_attn_weights: average the returned weights over heads
                (``[B, Tq, Tk]`` instead of ``[B, H, Tq, Tk]``).
            cache: a :class:`KVCache`. For self-attention the new keys/values are appended
                and attention runs over everything cached; for a ``static`` cache the memory
                is projected once on the first call and reused afterwards.

        Returns:
            ``(output [B, Tq, embed_dim], weights or None)``.
        """
        self_attn = key is None
        if self_attn:
            key = query
        if value is None:
            value = key
        q = self._split(self.q_proj(query))
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            k = self._split(self.k_proj(key))
            v = self._split(self.v_proj(value))
            if cache is not None:
                if cache.static:
                    cache.k, cache.v = k, v
                else:
                    k, v = cache.append(k, v)
        dropout_p = self.attn_drop.p if self.training else 0.0
        explicit = need_weights or not self.fused_attn
        out, weights = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            key_mask=key_mask,
            is_causal=is_causal,
            dropout_p=dropout_p,
            need_weights=need_weights,
            scale=self.scale,
            attn_drop=self.attn_drop if explicit else None,
        )
        b, _, tq, _ = out.shape
        out = out.transpose(1, 2).reshape(b, tq, self.embed_dim)  # (B, Tq, H*d)
        out = self.out_proj(out)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights
