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

**Class attention** (Cait's last blocks: ``[B, heads, 1, T]``, only the class token attends,
the other tokens pass through unchanged) enters the chain as a ``[B, T, T]`` matrix whose other
rows are the identity's (:func:`square_rows`): rollout, relevance and the last block's row then
read it as any block.

Prefix tokens (class, distillation, register tokens) are never drawn as patches: the maps hold
the ``h * w`` patch tokens only, and rollout's ``discard_ratio`` never discards attention *to*
a prefix token.

**Streaming.** :class:`RolloutStream` computes the same rollout block by block while the forward
runs (:func:`vision_attn.explain.capture.streaming_rollout` feeds it), keeping one running
``[B, T, T]`` product per batch instead of every block's ``[B, heads, T, T]`` attention;
:class:`RelevanceStream` does the same for :func:`gradient_relevance` during the backward (one
``[B, T]`` row, the blocks' gradients arrive last block first).

**Token-merged models** (:func:`vision_attn.merge_tokens`): each block's attention covers fewer
tokens than the one before. ``merges`` (:func:`vision_attn.models.merging.merge_log`: per block, the token
maps applied after its attention — a size-weighted merge, and after the last block the
expansion back to the patch grid) put the chain back together: every map is a linear map of the
tokens (a merged token is the size-weighted mean of the tokens it holds), so rollout runs through
them and ends on the original ``T = P + h * w`` tokens, rows still summing to 1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
from torch import Tensor

from vision_attn.errors import ConfigError

__all__ = [
    "HeadFusion",
    "RelevanceStream",
    "RolloutStream",
    "TokenIndex",
    "TokenMap",
    "attention_rollout",
    "check_head_fusion",
    "fuse_heads",
    "gradient_relevance",
    "last_layer_attention",
    "normalize_maps",
    "prefix_attention",
    "relevance_layer",
    "rollout_layer",
    "rollout_scores",
    "square_rows",
    "to_grid",
]

HeadFusion = str
"""``mean``, ``max``, ``min`` (over the heads) or ``head<K>`` (head ``K`` alone)."""
TokenIndex = int | tuple[int, ...] | Literal["patches"] | Tensor


class TokenMap(Protocol):
    """A linear map ``M [B, t_out, t_in]`` between token sets (a token merge, or the expansion of
    merged tokens back to the patch grid: :mod:`vision_attn.models.merging`), applied without building
    ``M``."""

    t_in: int
    t_out: int
    batch_size: int
    device: torch.device

    def left(self, m: Tensor) -> Tensor:
        """``M @ m``: ``[B, t_in, C] -> [B, t_out, C]``."""
        ...

    def right(self, v: Tensor) -> Tensor:
        """``v @ M``: ``[B, t_out] -> [B, t_in]``."""
        ...


Merges = Sequence[Sequence[TokenMap]]


def check_head_fusion(head_fusion: str) -> None:
    """Raise :class:`~vision_attn.errors.ConfigError` (a ``ValueError``) unless ``head_fusion`` is
    ``mean``, ``max``, ``min`` or ``head<K>``."""
    if head_fusion not in ("mean", "max", "min") and re.fullmatch(r"head\d{1,4}", str(head_fusion)) is None:
        raise ConfigError(f"head_fusion must be 'mean', 'max', 'min' or 'head<K>' (one head, e.g. head0), "
                         f"got {head_fusion!r}")


def fuse_heads(attn: Tensor, head_fusion: HeadFusion = "mean") -> Tensor:
    """``[B, H, T, T] -> [B, T, T]`` by mean, max or min over the heads, or ``head<K>``: head ``K``
    alone (the per-head maps people draw of a class token)."""
    if attn.dim() != 4:
        raise ValueError(f"expected attention [B, heads, T, T], got shape {tuple(attn.shape)}")
    check_head_fusion(head_fusion)
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    if head_fusion == "min":
        return attn.amin(dim=1)
    k = int(str(head_fusion)[4:])
    if k >= attn.shape[1]:
        raise ConfigError(f"head_fusion {head_fusion!r}: this attention has {attn.shape[1]} heads "
                         f"(head0 .. head{attn.shape[1] - 1})")
    return attn[:, k]


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


def _output_tokens(attentions: Sequence[Tensor], merges: Merges | None) -> int:
    """``T`` of the tokens whose rows are explained: the last block's, or after its token maps."""
    if merges is not None and merges[-1]:
        return merges[-1][-1].t_out
    return attentions[-1].shape[-1]


def _check(attentions: Sequence[Tensor], token_index: TokenIndex, num_prefix_tokens: int,
           merges: Merges | None = None) -> None:
    if len(attentions) == 0:
        raise ValueError("no attention maps given (capture_attention recorded nothing?)")
    if merges is None:
        sizes = sorted({a.shape[-1] for a in attentions})
        if len(sizes) > 1:
            raise ValueError(
                f"the blocks' attention maps cover different numbers of tokens {sizes}: a token-merged model "
                "(vision_attn.merge_tokens)? Pass merges=vision_attn.models.merging.merge_log(model) from the same "
                "forward"
            )
    elif len(merges) != len(attentions):
        raise ValueError(f"merges has {len(merges)} entries, one per block is needed ({len(attentions)} blocks)")
    if isinstance(token_index, Tensor):
        b, t = attentions[0].shape[0], _output_tokens(attentions, merges)
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
    """Zero the ``ratio`` lowest entries of each image's ``[Tq, T]`` map, never in prefix columns."""
    if ratio <= 0:
        return fused
    if ratio >= 1:
        raise ValueError(f"discard_ratio must be in [0, 1), got {ratio}")
    b, tq, t = fused.shape
    protected = torch.zeros(tq, t, dtype=torch.bool, device=fused.device)
    protected[:, :num_prefix_tokens] = True  # attention *to* prefix tokens is kept
    candidates = int((~protected).sum())
    k = int(candidates * ratio)
    if k == 0:
        return fused
    scores = fused.masked_fill(protected, float("inf")).flatten(1)  # (B, Tq*T)
    idx = scores.topk(k, dim=1, largest=False).indices
    return fused.flatten(1).scatter(1, idx, 0.0).view(b, tq, t)


def square_rows(rows: Tensor, identity: bool = False) -> Tensor:
    """Class attention's ``[B, Tq, T]`` rows (the first ``Tq`` tokens attend; a class-attention
    block, Cait's, leaves the other tokens unchanged) as a ``[B, T, T]`` matrix: the other tokens'
    rows are zero, or with ``identity`` their own unit row (a token that does not attend keeps
    itself). A square ``[B, T, T]`` input is returned as it is."""
    b, tq, t = rows.shape
    if tq == t:
        return rows
    if tq > t:
        raise ValueError(f"attention of {tq} queries over {t} keys: more queries than tokens")
    full = torch.zeros(b, t, t, dtype=rows.dtype, device=rows.device)
    if identity:
        full.diagonal(dim1=-2, dim2=-1)[:, tq:] = 1.0
    full[:, :tq] = rows
    return full


def _initial_row(b: int, t: int, device: torch.device, token_index: TokenIndex, num_prefix_tokens: int) -> Tensor:
    """``[B, 1, T]`` weights of the explained row over the ``T`` output tokens: one prefix token,
    the mean of several, the mean of the patch rows (``"patches"`` or ``P = 0``) or per-image
    weights (a ``[B, T]`` tensor)."""
    row = torch.zeros(b, 1, t, device=device, dtype=torch.float32)
    if isinstance(token_index, Tensor):
        row = token_index.detach().to(device=device, dtype=torch.float32).unsqueeze(1)  # (B, 1, T)
    elif _explains_patches(token_index, num_prefix_tokens):
        row[:, 0, num_prefix_tokens:] = 1.0 / (t - num_prefix_tokens)
    else:
        rows = list(token_index) if isinstance(token_index, tuple) else [token_index]
        row[:, 0, rows] = 1.0 / len(rows)  # the mean of these rows (the chain is linear)
    return row


def prefix_attention(attentions: Sequence[Tensor], num_prefix_tokens: int, token_index: TokenIndex = 0,
                     head_fusion: HeadFusion = "mean") -> Tensor:
    """``[B, P]``: how much of the explained row's last-block attention (heads fused) goes to each
    of the ``P`` prefix tokens (class, distillation, register tokens), which the patch maps leave out.

    Args:
        attentions: every block's ``[B, heads, T, T]`` attention (the last one is read; one token
            count throughout, i.e. no token merging).
        num_prefix_tokens: ``P``.
        token_index: the row explained (as :func:`last_layer_attention` takes it).
        head_fusion: ``mean``, ``max`` or ``min``.
    """
    fused = square_rows(fuse_heads(attentions[-1].float(), head_fusion), identity=True)  # (B, T, T)
    row = _initial_row(fused.shape[0], fused.shape[-1], fused.device, token_index, num_prefix_tokens) @ fused
    return row[:, 0, :num_prefix_tokens]


def _row_through(ops: Sequence[Tensor | TokenMap], row: Tensor) -> Tensor:
    """``row @ ops[-1] @ ... @ ops[0]`` for a ``[B, 1, T]`` row: ``[B, T0]`` (float32). Dense ops
    are ``[B, T, T]`` matrices; token maps (merges) act through their ``right``. The row is
    carried in float64 (``O(L T^2)``, cheap), so the result is within float32 rounding of the
    exact chain, whichever order a streaming computation multiplies in."""
    row = row.double()
    for m in reversed(ops):
        row = row @ m.double() if isinstance(m, Tensor) else m.right(row[:, 0]).unsqueeze(1)  # (B, 1, T)
    return row[:, 0].float()


def _chain(layers: Sequence[Tensor | None], merges: Merges | None) -> list[Tensor | TokenMap]:
    """The chain in forward order: each block's matrix (``None``: skipped) then its token maps."""
    ops: list[Tensor | TokenMap] = []
    for i, layer in enumerate(layers):
        if layer is not None:
            ops.append(layer)
        if merges is not None:
            ops.extend(merges[i])
    return ops


def rollout_layer(attn: Tensor, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0,
                  num_prefix_tokens: int = 1) -> Tensor:
    """One block's rollout matrix ``[B, T, T]``: heads fused, the lowest entries discarded, the
    identity added for the residual path, rows re-normalised to sum to 1. Class attention
    (``[B, heads, Tq, T]``, ``Tq < T``: only the first ``Tq`` tokens attend) leaves the other
    tokens' rows at the identity."""
    fused = fuse_heads(attn.float(), head_fusion)  # a new tensor: the steps below work in place
    fused = square_rows(_discard_lowest(fused, discard_ratio, num_prefix_tokens))  # (B, T, T)
    fused.diagonal(dim1=-2, dim2=-1).add_(1.0)  # + I: the residual connection
    return fused.div_(fused.sum(dim=-1, keepdim=True))


def rollout_scores(
    attentions: Sequence[Tensor],
    num_prefix_tokens: int = 1,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    token_index: TokenIndex = 0,
    merges: Merges | None = None,
) -> Tensor:
    """The explained row of the rollout, ``[B, T]`` over all input tokens (prefix tokens
    included), not normalised: rows sum to 1. :func:`attention_rollout` draws it on the grid."""
    _check(attentions, token_index, num_prefix_tokens, merges)
    if not 0 <= start_layer < len(attentions):
        raise ValueError(f"start_layer {start_layer} out of range for {len(attentions)} blocks")
    layers = [None if i < start_layer else rollout_layer(a, head_fusion, discard_ratio, num_prefix_tokens)
              for i, a in enumerate(attentions)]
    # rollout = A_L ... A_1; only one row is needed: e_t^T A_L ... A_1, a chain of
    # vector-matrix products (O(L T^2) instead of O(L T^3) for the full product).
    first = attentions[start_layer]
    row = _initial_row(first.shape[0], _output_tokens(attentions, merges), first.device, token_index,
                       num_prefix_tokens)
    return _row_through(_chain(layers, merges), row)


def attention_rollout(
    attentions: Sequence[Tensor],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    token_index: TokenIndex = 0,
    merges: Merges | None = None,
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
        merges: for a token-merged model, :func:`vision_attn.models.merging.merge_log` of the same forward
            (per block, the token maps after its attention); the map is then over the original
            patch grid.
    """
    row = rollout_scores(attentions, num_prefix_tokens, head_fusion, discard_ratio, start_layer, token_index, merges)
    return to_grid(row, grid, num_prefix_tokens)


def relevance_layer(attn: Tensor, grad: Tensor) -> Tensor:
    """One block's relevance matrix ``I + mean_h relu(grad ⊙ A)``: ``[B, T, T]`` (class attention,
    ``[B, heads, Tq, T]``: the rows of the tokens that do not attend are the identity's)."""
    t = attn.shape[-1]
    eye = torch.eye(t, device=attn.device, dtype=torch.float32)
    return eye + square_rows((grad.detach().float() * attn.detach().float()).clamp(min=0).mean(dim=1))  # (B, T, T)


def gradient_relevance(
    attentions: Sequence[Tensor],
    gradients: Sequence[Tensor] | None,
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    token_index: TokenIndex = 0,
    start_layer: int = 0,
    merges: Merges | None = None,
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
        merges: token maps of a token-merged model (see :func:`attention_rollout`).
    """
    _check(attentions, token_index, num_prefix_tokens, merges)
    if gradients is None:
        gradients = [a.grad for a in attentions]
        if any(g is None for g in gradients):
            raise ValueError(
                "attention tensors have no gradients: capture with keep_grad=True and call backward() on the "
                "target score first, or pass gradients="
            )
    # R_l = R_{l-1} + Ā_l R_{l-1} = (I + Ā_l) R_{l-1}: the same chain as rollout, one row needed.
    layers = [None if i < start_layer else relevance_layer(attn, grad)
              for i, (attn, grad) in enumerate(zip(attentions, gradients, strict=True))]
    row = _initial_row(attentions[0].shape[0], _output_tokens(attentions, merges), attentions[0].device, token_index,
                       num_prefix_tokens)
    return to_grid(_row_through(_chain(layers, merges), row), grid, num_prefix_tokens)


def last_layer_attention(
    attentions: Sequence[Tensor],
    grid: tuple[int, int],
    num_prefix_tokens: int = 1,
    head_fusion: HeadFusion = "mean",
    token_index: TokenIndex = 0,
    merges: Merges | None = None,
) -> Tensor:
    """The last block's (head-fused) attention of one prefix token over the patches (or, with
    ``token_index="patches"``, the mean of the patch tokens' attention rows; with ``[B, T]`` row
    weights, their mixture of the rows). With ``merges`` (a token-merged model) the rows and
    columns of merged tokens are mapped back to the original patches: a merged token's share is
    split evenly over the patches it holds, so the scores keep their sum.

    Args:
        attentions: every block's ``[B, heads, T, T]`` attention (the last one is read).
        grid: the patch grid ``(h, w)``.
        num_prefix_tokens: tokens before the patches (class, distillation, registers).
        head_fusion: how the heads are fused: ``mean``, ``max`` or ``min``.
        token_index: the row explained (a prefix token's index, a tuple of them, ``"patches"``,
            or ``[B, T]`` row weights).
        merges: a token-merged model's merge record, or ``None``.

    Returns:
        ``[B, h, w]`` maps.
    """
    _check(attentions, token_index, num_prefix_tokens, merges)
    fused = square_rows(fuse_heads(attentions[-1].float(), head_fusion), identity=True)  # (B, T, T)
    if merges is not None:
        layers: list[Tensor | None] = [None] * (len(attentions) - 1) + [fused]
        row = _initial_row(fused.shape[0], _output_tokens(attentions, merges), fused.device, token_index,
                           num_prefix_tokens)
        return to_grid(_row_through(_chain(layers, merges), row), grid, num_prefix_tokens)
    if isinstance(token_index, Tensor):
        row = (token_index.detach().to(fused).unsqueeze(1) @ fused)[:, 0]  # (B, 1, T) @ (B, T, T) -> (B, T)
    elif _explains_patches(token_index, num_prefix_tokens):
        row = fused[:, num_prefix_tokens:].mean(dim=1)
    else:
        rows = list(token_index) if isinstance(token_index, tuple) else [token_index]
        row = fused[:, rows].mean(dim=1)
    return to_grid(row, grid, num_prefix_tokens)


# ---------------------------------------------------------------------------- streaming
class RolloutStream:
    """Attention rollout computed block by block as the forward runs: one running product
    ``R = A_l ... A_1`` (``[B, T_l, T]``; ``T_l = T`` unless tokens are merged) instead of every
    block's attention. Equal to :func:`attention_rollout` on the same blocks (up to float
    rounding: the product is taken in another order).

    Feed it with :func:`vision_attn.explain.capture.streaming_rollout`, or by hand::

        stream = RolloutStream()
        for attn in attentions: stream.update(attn)
        maps = stream.maps(grid, num_prefix_tokens)

    Args:
        head_fusion, discard_ratio, start_layer: as in :func:`attention_rollout`.
        num_prefix_tokens: ``P``: the prefix columns that ``discard_ratio`` never discards.
        dtype: of the running product. ``float32`` (default) costs ``O(T^3)`` per block in the
            fastest kernel (about 2 % of a ViT-B/16 forward) and agrees with the stored rollout
            (whose row chain is carried in float64) to about 1e-6 — the rounding of a product
            taken in another order; ``float64`` agrees to float32 rounding of the result, at
            about 4x the product's time and twice its memory on CPU.
    """

    def __init__(self, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0, start_layer: int = 0,
                 num_prefix_tokens: int = 1, dtype: torch.dtype = torch.float32) -> None:
        self.head_fusion, self.discard_ratio, self.start_layer = head_fusion, discard_ratio, start_layer
        self.num_prefix_tokens, self.dtype = num_prefix_tokens, dtype
        self.product: Tensor | None = None
        self.blocks = 0

    def update(self, attn: Tensor) -> None:
        """Fold in the next block's ``[B, heads, T, T]`` attention (blocks before ``start_layer``
        only count)."""
        index, self.blocks = self.blocks, self.blocks + 1
        if index < self.start_layer:
            return
        layer = rollout_layer(attn.detach(), self.head_fusion, self.discard_ratio, self.num_prefix_tokens)
        layer = layer.to(self.dtype)
        if self.product is not None and self.product.shape[1] != layer.shape[-1]:
            raise ValueError(f"block {index} attends over {layer.shape[-1]} tokens, the rollout so far ends on "
                             f"{self.product.shape[1]}: a token merge between the blocks was not applied")
        self.product = layer if self.product is None else layer @ self.product  # (B, T_l, T)

    def apply(self, token_map: TokenMap) -> None:
        """Fold in a token map (a merge after a block, the expansion back to the grid)."""
        if self.product is None:  # nothing rolled out yet: the product so far is the identity
            eye = torch.eye(token_map.t_in, device=token_map.device, dtype=self.dtype)
            self.product = token_map.left(eye.expand(token_map.batch_size, -1, -1))
        else:
            self.product = token_map.left(self.product)

    def scores(self, token_index: TokenIndex = 0, num_prefix_tokens: int | None = None) -> Tensor:
        """The explained row ``[B, T]`` over the input tokens, not normalised (rows sum to 1)."""
        if self.product is None:
            raise ValueError(f"the rollout saw no block at or after start_layer {self.start_layer} "
                             f"({self.blocks} blocks ran): run the model inside streaming_rollout")
        p = self.num_prefix_tokens if num_prefix_tokens is None else num_prefix_tokens
        b, t = self.product.shape[0], self.product.shape[1]
        if isinstance(token_index, Tensor) and tuple(token_index.shape) != (b, t):
            raise ValueError(f"token_index as row weights must be [B, T] = {(b, t)}, got {tuple(token_index.shape)}")
        if not isinstance(token_index, Tensor):
            _check([self.product.unsqueeze(1)], token_index, p)
        row = _initial_row(b, t, self.product.device, token_index, p).to(self.dtype)
        return (row @ self.product)[:, 0].float()  # (B, 1, T_L) @ (B, T_L, T) -> (B, T)

    def maps(self, grid: tuple[int, int], num_prefix_tokens: int | None = None,
             token_index: TokenIndex = 0) -> Tensor:
        """``[B, h, w]`` maps scaled to max 1, as :func:`attention_rollout` returns them."""
        p = self.num_prefix_tokens if num_prefix_tokens is None else num_prefix_tokens
        return to_grid(self.scores(token_index, p), grid, p)


class RelevanceStream:
    """Gradient relevance (:func:`gradient_relevance`) computed during the backward: the blocks'
    gradients arrive last block first, so one ``[B, T]`` row ``r ← r (I + Ā_l)`` is carried
    through them and no block's gradient is kept. The attention probabilities themselves are
    held by the autograd graph anyway (the backward of ``A @ V`` needs them).

    Use :func:`vision_attn.explain.capture.streaming_relevance`::

        with torch.enable_grad(), streaming_relevance(encoder) as rel:
            logits = head(encoder(images))
        score = logits.gather(1, target[:, None]).sum()
        maps = rel.maps(score, grid, num_prefix_tokens, token_index)

    Args:
        start_layer: skip the blocks before this one.
    """

    def __init__(self, start_layer: int = 0) -> None:
        self.start_layer = start_layer
        self._probs: list[Tensor] = []
        self._marks: list[int] = []  # token maps recorded before each block's attention
        self._maps: list[TokenMap] = []
        self._row: Tensor | None = None
        self._cursor = 0
        self._next = -1

    @property
    def blocks(self) -> int:
        return len(self._probs)

    def record(self, probs: Tensor) -> None:
        """Forward: the next block's ``[B, heads, T, T]`` probabilities, still in the graph."""
        index = len(self._probs)
        self._probs.append(probs)
        self._marks.append(len(self._maps))
        if index > self.start_layer and probs.requires_grad:
            probs.register_hook(lambda grad, i=index: self._backward_block(i, grad))

    def apply(self, token_map: TokenMap) -> None:
        """Forward: a token map (merge) after the current block."""
        self._maps.append(token_map)

    def _step(self, index: int, grad: Tensor) -> None:
        if index != self._next:
            raise RuntimeError(f"relevance stream: block {index}'s gradient arrived, block {self._next}'s was expected "
                               "(one backward per stream, last block first)")
        for m in reversed(self._maps[self._marks[index]: self._cursor]):  # the merges after this block
            self._row = m.right(self._row[:, 0]).unsqueeze(1)
        self._cursor = self._marks[index]
        self._row = self._row @ relevance_layer(self._probs[index], grad).double()  # (B, 1, T_l)
        self._next = index - 1

    def _backward_block(self, index: int, grad: Tensor) -> None:
        if self._row is not None:
            self._step(index, grad)

    def scores(self, score: Tensor, token_index: TokenIndex = 0, num_prefix_tokens: int = 1) -> Tensor:
        """Run the backward of ``score`` (a scalar: the summed target logits) and return the
        explained row ``[B, T]`` over the input tokens, not normalised."""
        if not self._probs:
            raise ValueError("the relevance stream saw no attention: run the model inside streaming_relevance")
        if not 0 <= self.start_layer < len(self._probs):
            raise ValueError(f"start_layer {self.start_layer} out of range for {len(self._probs)} blocks")
        first = self._probs[self.start_layer]
        if not first.requires_grad:
            raise ValueError("the attention is not in the autograd graph: run the forward with gradients enabled")
        t_out = self._maps[-1].t_out if len(self._maps) > self._marks[-1] else self._probs[-1].shape[-1]
        if isinstance(token_index, Tensor) and tuple(token_index.shape) != (first.shape[0], t_out):
            raise ValueError(f"token_index as row weights must be [B, T] = {(first.shape[0], t_out)}, "
                             f"got {tuple(token_index.shape)}")
        if not isinstance(token_index, Tensor):
            _check([first], token_index, num_prefix_tokens)
        self._row = _initial_row(first.shape[0], t_out, first.device, token_index, num_prefix_tokens).double()
        self._cursor, self._next = len(self._maps), len(self._probs) - 1
        try:
            (grad,) = torch.autograd.grad(score, first)  # the hooks of the later blocks run on the way
            self._step(self.start_layer, grad)
            for m in reversed(self._maps[: self._cursor]):  # the merges before start_layer: to the input tokens
                self._row = m.right(self._row[:, 0]).unsqueeze(1)
            return self._row[:, 0].float()
        finally:
            self._probs, self._row = [], None

    def maps(self, score: Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1,
             token_index: TokenIndex = 0) -> Tensor:
        """``[B, h, w]`` maps scaled to max 1, as :func:`gradient_relevance` returns them."""
        return to_grid(self.scores(score, token_index, num_prefix_tokens), grid, num_prefix_tokens)
