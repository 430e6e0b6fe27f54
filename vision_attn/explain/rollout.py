"""From captured attention to saliency maps over the patch grid: pure, batched tensor functions.

All functions take the list that :func:`vision_attn.capture_attention` fills (one
``[B, heads, T, T]`` tensor per block, first block first, ``T = P + h * w`` with ``P`` prefix
tokens in front) and return maps ``[B, h, w]`` in ``[0, 1]``, each scaled to a maximum of 1
(an all-zero map stays zero).

- :func:`attention_rollout` — Abnar & Zuidema 2020: per layer fuse the heads, add the identity
  for the residual path, re-normalise the rows and multiply through the layers.
- :func:`gradient_relevance` — Chefer, Gur & Wolf 2021 ("Generic attention-model
  explainability"): per block ``Ā = mean_h relu(∂y/∂A ⊙ A)`` and ``R ← R + Ā R``; class specific.
- :func:`last_layer_attention` — the raw attention of the chosen token in the last block.

Which row is explained (``token_index``): a prefix token's (0 = the class token, what a
``cls``-pooling head reads; 1 = a distilled DeiT's distillation token), a tuple of prefix
tokens (the mean of their rows: ``(0, 1)`` is what a distilled DeiT's head reads, the average
of its class and distillation heads) or ``"patches"``, the mean of the patch tokens' rows — what
a mean-pooling head reads, since the mean of the patch tokens' outputs is linear in the rows
(the rollout / relevance of the mean is the mean of the rows) — or a ``[B, T]`` tensor of row
weights, one mixture of the rows per image (what a sequence-pooling head reads: its pooling
weights, 0 on the prefix tokens). Without prefix tokens the mean row is explained unless
``token_index`` is such a tensor.

Prefix tokens (class, distillation, register tokens) are never drawn as patches: the maps hold
the ``h * w`` patch tokens only, and rollout's ``discard_ratio`` never discards attention *to*
a prefix token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "HeadFusion",
    "TokenIndex",
    "attention_rollout",
    "fuse_heads",
    "gradient_relevance",
    "last_layer_attention",
    "normalize_maps",
    "to_grid",
]

HeadFusion = Literal["mean", "max", "min"]
TokenIndex = int | tuple[int, ...] | Literal["patches"] | Tensor


def fuse_heads(attn: Tensor, head_fusion: HeadFusion = "mean") -> Tensor:
    """``[B, H, T, T] -> [B, T, T]`` by mean, max or min over the heads."""
    if attn.dim() != 4:
        raise ValueError(f"expected attention [B, heads, T, T], got shape {tuple(attn.shape)}")
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    if head_fusion == "min":
        return attn.amin(dim=1)
    raise ValueError(f"head_fusion must be 'mean', 'max' or 'min', got {head_fusion!r}")


def normalize_maps(maps: Tensor) -> Tensor:
    """Scale each map of ``[B, ...]`` to maximum 1 (negative values clipped; zero maps stay zero)."""
    maps = maps.clamp(min=0)
    peak = maps.flatten(1).amax(dim=1).view(-1, *([1] * (maps.dim() - 1)))
    return torch.where(peak > 0, maps / peak.clamp(min=torch.finfo(maps.dtype).tiny), torch.zeros_like(maps))


def to_grid(row: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> Tensor:
    """``[B, T]`` scores of all tokens -> normalised ``[B, h, w]`` map of the patch tokens."""
    h, w = grid
    patches = row[:, num_prefix_tokens:]
    if patches.shape[1] != h * w:
        raise ValueError(
            f"{patches.shape[1]} patch tokens after {num_prefix_tokens} prefix tokens do not fill the grid {h}x{w}; "
            "pass the encoder output's grid and num_prefix_tokens"
        )
    return normalize_maps(patches.reshape(-1, h, w))


def _check(attentions: Sequence[Tensor], token_index: TokenIndex, num_prefix_tokens: int) -> None:
    if len(attentions) == 0:
        raise ValueError("no attention maps given (capture_attention recorded nothing?)")
    if isinstance(token_index, Tensor):
        b, t = attentions[0].shape[0], attentions[0].shape[-1]
        if tuple(token_index.shape) != (b, t):
            raise ValueError(f"token_index as row weights must be [B, T] = {(b, t)}, got {tuple(token_index.shape)}")
        return
    if token_index == "patches":
        return
    rows = token_index if isinstance(token_index, tuple) else (token_index,)
    if not rows or any(isinstance(r, str) or not 0 <= r < max(1, num_prefix_tokens) for r in rows):
        raise ValueError(
            f"token_index {token_index} is not a prefix token (the model has {num_prefix_tokens}); "
            "for models without prefix tokens use token_index=0 with mean-pooled explanations; "
            "token_index='patches' explains the mean of the patch tokens (mean pooling)"
        )


def _explains_patches(token_index: TokenIndex, num_prefix_tokens: int) -> bool:
    if isinstance(token_index, Tensor):
        return False
    return token_index == "patches" or num_prefix_tokens == 0


def _discard_lowest(fused: Tensor, ratio: float, num_prefix_tokens: int) -> Tensor:
    """Zero the ``ratio`` lowest entries of each image's ``[T, T]`` map, never in prefix columns."""
    if ratio <= 0:
        return fused
    if ratio >= 1:
        raise ValueError(f"discard_ratio must be in [0, 1), got {ratio}")
    b, t, _ = fused.shape
    protected = torch.zeros(t, t, dtype=torch.bool, device=fused.device)
    protected[:, :num_prefix_tokens] = True  # attention *to* prefix tokens is kept
    candidates = int((~protected).sum())
    k = int(candidates * ratio)
    if k == 0:
        return fused
    scores = fused.masked_fill(protected, float("inf")).flatten(1)  # (B, T*T)
    idx = scores.topk(k, dim=1, largest=False).indices
    return fused.flatten(1).scatter(1, idx, 0.0).view(b, t, t)


def _row_through(layers: list[Tensor], like: Tensor, token_index: TokenIndex, num_prefix_tokens: int) -> Tensor:
    """Row ``token_index`` (the mean of the patch rows for ``"patches"`` or ``P = 0``; the
    weighted mixture of the rows for a ``[B, T]`` tensor) of ``layers[-1] @ ... @ layers[0]``:
    ``[B, T]``."""
    b, t = like.shape[0], like.shape[-1]
    row = torch.zeros(b, 1, t, device=like.device, dtype=torch.float32)
    if isinstance(token_index, Tensor):
        row = token_index.detach().to(device=like.device, dtype=torch.float32).unsqueeze(1)  # (B, 1, T)
    elif _explains_patches(token_index, num_prefix_tokens):
        row[:, 0, num_prefix_tokens:] = 1.0 / (t - num_prefix_tokens)
    else:
        rows = list(token_index) if isinstance(token_index, tuple) else [token_index]
        row[:, 0, rows] = 1.0 / len(rows)  # the mean of these rows (the chain is linear)
    for m in reversed(layers):
        row = row @ m  # (B, 1, T)
    return row[:, 0]


def attention_rollout(
    attentions: Sequence[Tensor],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    token_index: TokenIndex = 0,
) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020) as ``[B, h, w]`` maps scaled to max 1.

    Args:
        attentions: per-block ``[B, heads, T, T]`` probabilities, first block first.
        grid: patch grid ``(h, w)`` of the input (``EncoderOutput.grid``); non-square works.
        num_prefix_tokens: ``P`` (cls, distillation, register tokens).
        head_fusion: ``mean``, ``max`` or ``min`` over heads.
        discard_ratio: share of the lowest fused attentions zeroed per layer and image (the
            columns of prefix tokens — class, distillation and register tokens — are never
            discarded).
        start_layer: skip the blocks before this one.
        token_index: which prefix token's row to explain (0 = class token; 1 = DeiT's
            distillation token; a tuple: the mean of those rows), or ``"patches"``: the mean of
            the patch tokens' rows (a mean-pooling head), or a ``[B, T]`` tensor of row weights
            (per image, e.g. a sequence-pooling head's weights). With ``P = 0`` and no tensor the
            mean over all token rows is explained.
    """
    _check(attentions, token_index, num_prefix_tokens)
    if not 0 <= start_layer < len(attentions):
        raise ValueError(f"start_layer {start_layer} out of range for {len(attentions)} blocks")
    first = attentions[start_layer]
    t = first.shape[-1]
    eye = torch.eye(t, device=first.device, dtype=torch.float32)
    layers = []
    for attn in attentions[start_layer:]:
        fused = fuse_heads(attn.float(), head_fusion)
        fused = _discard_lowest(fused, discard_ratio, num_prefix_tokens)
        a = fused + eye  # the residual connection
        layers.append(a / a.sum(dim=-1, keepdim=True))
    # rollout = A_L ... A_1; only one row is needed: e_t^T A_L ... A_1, a chain of
    # vector-matrix products (O(L T^2) instead of O(L T^3) for the full product).
    return to_grid(_row_through(layers, first, token_index, num_prefix_tokens), grid, num_prefix_tokens)


def gradient_relevance(
    attentions: Sequence[Tensor],
    gradients: Sequence[Tensor] | None,
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    token_index: TokenIndex = 0,
    start_layer: int = 0,
) -> Tensor:
    """Class-specific relevance (Chefer et al. 2021) as ``[B, h, w]`` maps scaled to max 1.

    Args:
        attentions: per-block ``[B, heads, T, T]`` probabilities, captured with
            ``capture_attention(model, keep_grad=True)``.
        gradients: per-block d(target score)/d(attention); default ``a.grad`` of each tensor
            after ``target.backward()``.
        grid: patch grid ``(h, w)``.
        num_prefix_tokens: ``P``.
        token_index: which prefix token's row to explain, or ``"patches"`` (see
            :func:`attention_rollout`).
        start_layer: skip the blocks before this one.
    """
    _check(attentions, token_index, num_prefix_tokens)
    if gradients is None:
        gradients = [a.grad for a in attentions]
        if any(g is None for g in gradients):
            raise ValueError(
                "attention tensors have no gradients: capture with keep_grad=True and call backward() on the "
                "target score first, or pass gradients="
            )
    t = attentions[0].shape[-1]
    eye = torch.eye(t, device=attentions[0].device, dtype=torch.float32)
    # R_l = R_{l-1} + Ā_l R_{l-1} = (I + Ā_l) R_{l-1}: the same chain as rollout, one row needed.
    layers = [
        eye + (grad.detach().float() * attn.detach().float()).clamp(min=0).mean(dim=1)  # (B, T, T)
        for attn, grad in list(zip(attentions, gradients, strict=True))[start_layer:]
    ]
    return to_grid(_row_through(layers, attentions[0], token_index, num_prefix_tokens), grid, num_prefix_tokens)


def last_layer_attention(
    attentions: Sequence[Tensor],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    head_fusion: HeadFusion = "mean",
    token_index: TokenIndex = 0,
) -> Tensor:
    """The last block's (head-fused) attention of one prefix token over the patches (or, with
    ``token_index="patches"``, the mean of the patch tokens' attention rows; with ``[B, T]`` row
    weights, their mixture of the rows)."""
    _check(attentions, token_index, num_prefix_tokens)
    fused = fuse_heads(attentions[-1].float(), head_fusion)
    if isinstance(token_index, Tensor):
        row = (token_index.detach().to(fused).unsqueeze(1) @ fused)[:, 0]  # (B, 1, T) @ (B, T, T) -> (B, T)
    elif _explains_patches(token_index, num_prefix_tokens):
        row = fused[:, num_prefix_tokens:].mean(dim=1)
    else:
        rows = list(token_index) if isinstance(token_index, tuple) else [token_index]
        row = fused[:, rows].mean(dim=1)
    return to_grid(row, grid, num_prefix_tokens)
