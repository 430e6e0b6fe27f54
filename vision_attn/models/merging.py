"""Token merging (ToMe, Bolya et al. 2023) for the suite's timm ViT encoders, with explanations.

    merge_tokens(task, r=8)      # or a ViTEncoder, or a bare timm VisionTransformer
    logits = task(images)        # ~r fewer tokens after every block
    unmerge_tokens(task)         # exactly the model it was
    with token_merging(encoder, 8): ...

**What runs.** In every block, after the attention and before the MLP, the ``r`` most similar
pairs of patch tokens are merged (bipartite soft matching: the patch tokens alternate between
sets ``A`` and ``B``; each ``A`` token's most similar ``B`` token by cosine similarity of the
block's keys, averaged over the heads; the ``r`` best-matched ``A`` tokens are merged into their
``B`` match). A merged token is the size-weighted mean of the tokens it absorbs, and its size
(how many original patches it holds) enters every later attention as ``+ log(size)`` on the
logits (proportional attention), so a token of size ``s`` weighs as its ``s`` patches would.
Prefix tokens (class, distillation, register tokens) are never merged and stay in front. At
most half the patch tokens merge in one block. ``r = 0`` runs exactly the unmerged model.

**The grid is kept.** After the last block every original patch takes the value of the merged
token that holds it, so the encoder still returns ``[B, P + h * w, D]`` tokens on the patch grid:
the heads, ``EncoderOutput.grid`` and mean pooling (then weighted by size, as the merged tokens
stand for their patches) work unchanged. Only the blocks' compute shrinks.

**Explanations.** :class:`MergeState` tracks, for every original token, which current token
holds it (:meth:`MergeState.source`: the ``[B, T_now, T]`` 0/1 source matrix), and logs each
merge as a linear map of the tokens (:class:`TokenMerge`; :class:`TokenExpand` for the return
to the grid). :func:`merge_log` hands those maps to
:func:`~vision_attn.explain.rollout.attention_rollout`, ``last_layer_attention`` and
``gradient_relevance`` (``merges=``) so their maps come back on the ``[h, w]`` patch grid, and
:func:`~vision_attn.explain.capture.streaming_rollout` folds them in as they happen.

Supported: timm's ``VisionTransformer`` family with plain ``Block`` s and timm's ``Attention``
(``vit_*``, ``deit_*`` incl. distilled, register-token models, the suite's locality
self-attention); other block types are refused with an error naming them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from timm.layers import Attention as TimmAttention
from timm.models.vision_transformer import Block as TimmBlock
from torch import Tensor, nn

from vision_attn.errors import EncoderError
from vision_attn.models.smalldata import LocalMlp

__all__ = [
    "MergeState",
    "TokenExpand",
    "TokenMerge",
    "grid_attention",
    "merge_log",
    "merge_state",
    "merge_tokens",
    "token_merging",
    "unmerge_tokens",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- token maps
@dataclass
class TokenMerge:
    """One merge as a linear map ``M [B, t_out, t_in]`` of the tokens: input token ``j`` goes
    into output token ``dst[j]`` with weight ``weight[j] = size_j / size_dst[j]`` (a merged
    token is the size-weighted mean of its inputs; every row of ``M`` sums to 1).

    Attributes:
        dst: ``[B, t_in]`` long, the output token of each input token.
        weight: ``[B, t_in]`` float.
        t_out: number of output tokens.
    """

    dst: Tensor
    weight: Tensor
    t_out: int

    @property
    def t_in(self) -> int:
        return self.dst.shape[1]

    @property
    def batch_size(self) -> int:
        return self.dst.shape[0]

    @property
    def device(self) -> torch.device:
        return self.dst.device

    def left(self, m: Tensor) -> Tensor:
        """``M @ m``: ``[B, t_in, C] -> [B, t_out, C]``."""
        b, _, c = m.shape
        weighted = (m * self.weight.unsqueeze(-1).to(m)).reshape(-1, c)
        return _rows_added(weighted, self.dst, b, self.t_out)

    def right(self, v: Tensor) -> Tensor:
        """``v @ M``: ``[B, t_out] -> [B, t_in]``."""
        return v.gather(1, self.dst) * self.weight.to(v)

    def matrix(self) -> Tensor:
        """The dense ``[B, t_out, t_in]`` matrix (for tests and small cases)."""
        m = self.weight.new_zeros(self.batch_size, self.t_out, self.t_in)
        return m.scatter(1, self.dst.unsqueeze(1), self.weight.unsqueeze(1))


@dataclass
class TokenExpand:
    """The return to the patch grid as a linear map ``E [B, t_out, t_in]``: original token
    ``j`` takes the value of the merged token ``index[j]`` (``E`` is the transposed source
    matrix; every row holds one 1).

    Attributes:
        index: ``[B, t_out]`` long, the merged token holding each original token.
        t_in: number of merged tokens.
    """

    index: Tensor
    t_in: int

    @property
    def t_out(self) -> int:
        return self.index.shape[1]

    @property
    def batch_size(self) -> int:
        return self.index.shape[0]

    @property
    def device(self) -> torch.device:
        return self.index.device

    def left(self, m: Tensor) -> Tensor:
        """``E @ m``: ``[B, t_in, C] -> [B, t_out, C]``."""
        return _rows_taken(m, self.index)

    def right(self, v: Tensor) -> Tensor:
        """``v @ E``: ``[B, t_out] -> [B, t_in]`` (a merged token collects its patches' scores)."""
        return v.new_zeros(v.shape[0], self.t_in).scatter_add(1, self.index, v)

    def matrix(self) -> Tensor:
        """The dense ``[B, t_out, t_in]`` matrix."""
        m = torch.zeros(self.batch_size, self.t_out, self.t_in, device=self.device)
        return m.scatter(2, self.index.unsqueeze(-1), 1.0)


# ---------------------------------------------------------------------------- the state
@dataclass
class MergeState:
    """What a merged model carries from block to block during one forward pass (reset when
    the first block runs), shared by all its blocks.

    Attributes:
        r: tokens merged per block (at most half the patch tokens of the block).
        num_prefix_tokens: ``P``, never merged.
        depth: number of blocks.
        size: ``[B, T_now, 1]`` how many original tokens each current token holds (``None``
            until the first merge: all ones).
        assignment: ``[B, T]`` the current token holding each original token (``None`` until
            the first merge: the identity).
        steps: per block, the token maps applied after its attention in the last forward
            (:func:`merge_log`).
        events: the same maps in order, flat (what the streaming explanations follow).
    """

    r: int
    num_prefix_tokens: int
    depth: int
    size: Tensor | None = None
    assignment: Tensor | None = None
    steps: list[list[TokenMerge | TokenExpand]] = field(default_factory=list)
    events: list[TokenMerge | TokenExpand] = field(default_factory=list)
    keys: Tensor | None = None
    tokens_in: int = 0

    def start(self, x: Tensor) -> None:
        """A new forward pass: ``x`` is the first block's input ``[B, T, D]``."""
        self.size = self.assignment = self.keys = None
        self.steps = [[] for _ in range(self.depth)]
        self.events = []
        self.tokens_in = x.shape[1]

    def source(self) -> Tensor:
        """``[B, T_now, T]``: 1 where current token ``i`` holds original token ``j`` (ToMe's
        source matrix; the identity before any merge)."""
        if self.assignment is None:
            raise ValueError("no merge happened in the last forward pass (r=0, or the model has not run)")
        b, t = self.assignment.shape
        t_now = self.size.shape[1]
        return torch.zeros(b, t_now, t, device=self.assignment.device).scatter(1, self.assignment.unsqueeze(1), 1.0)

    def attention_bias(self, attn_mask: Tensor | None, like: Tensor) -> Tensor | None:
        """Proportional attention: ``log(size)`` added to the logits of every key (``None``
        before any merge, so an unmerged forward is left exactly as it was)."""
        if self.size is None:
            return attn_mask
        if attn_mask is not None:
            raise EncoderError("token merging does not combine with an attention mask; run without merge_tokens")
        return self.size.log().to(like.dtype).squeeze(-1)[:, None, None, :]  # (B, 1, 1, T_now)

    def merge(self, x: Tensor, index: int) -> Tensor:
        """Bipartite soft matching on this block's keys, then the size-weighted merge of ``x``."""
        keys, self.keys = self.keys, None
        p = self.num_prefix_tokens
        b, t, d = x.shape
        n = t - p
        r = min(self.r, n // 2)
        if r <= 0:
            return x
        if keys is None:
            raise EncoderError(f"token merging: block {index}'s attention produced no keys (k_norm did not run)")
        metric = keys.detach().mean(dim=1)[:, p:]  # (B, H, T, d) -> (B, N, d): mean over heads, patches only
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, bb = metric[:, ::2], metric[:, 1::2]  # (B, Na, d), (B, Nb, d)
        na, nb = a.shape[1], bb.shape[1]
        best, match = (a @ bb.transpose(1, 2)).max(dim=-1)  # (B, Na): best B partner of each A token
        order = best.argsort(dim=-1, descending=True)
        kept = order[:, r:].sort(dim=-1).values  # (B, Na - r): unmerged A tokens, in image order
        arange = torch.arange(max(na, nb, p), device=x.device)
        a_dst = p + (na - r) + match  # (B, Na): merged A tokens go to their partner
        a_dst = a_dst.scatter(1, kept, (p + arange[: na - r]).expand(b, -1))  # kept A tokens: in front
        dst = torch.empty(b, t, dtype=torch.long, device=x.device)  # (B, T): output token of each token
        dst[:, :p] = arange[:p]
        dst[:, p::2] = a_dst
        dst[:, p + 1 :: 2] = p + (na - r) + arange[:nb]
        t_out = t - r
        size = self.size if self.size is not None else x.new_ones(b, t, 1)
        new_size = _rows_added(size.reshape(-1, 1), dst, b, t_out)  # (B, T - r, 1)
        out = _rows_added((x * size).reshape(-1, d), dst, b, t_out) / new_size  # (B, T - r, D)
        weight = (size / new_size.gather(1, dst.unsqueeze(-1))).squeeze(-1)  # (B, T)
        step = TokenMerge(dst, weight.detach().float(), t_out)
        self.steps[index].append(step)
        self.events.append(step)
        base = self.assignment if self.assignment is not None else arange_like(b, self.tokens_in, x.device)
        self.assignment = dst.gather(1, base)
        self.size = new_size
        return out

    def restore(self, x: Tensor, index: int) -> Tensor:
        """Every original token takes the value of the merged token holding it: ``[B, T, D]``."""
        if self.assignment is None:
            return x
        step = TokenExpand(self.assignment, x.shape[1])
        self.steps[index].append(step)
        self.events.append(step)
        return _rows_taken(x, self.assignment)


def _rows_added(rows: Tensor, dst: Tensor, b: int, t_out: int) -> Tensor:
    """``[B * T, C]`` rows summed into ``[B, t_out, C]`` by ``dst [B, T]`` (per image). One flat
    ``index_add`` with per-image offsets: several times faster on CPU than ``scatter_add`` over
    an index expanded to ``[B, T, C]``."""
    flat = (dst + torch.arange(b, device=dst.device).unsqueeze(1) * t_out).flatten()  # (B * T)
    return rows.new_zeros(b * t_out, rows.shape[-1]).index_add(0, flat, rows).view(b, t_out, -1)


def _rows_taken(m: Tensor, index: Tensor) -> Tensor:
    """``m[i, index[i, j]]``: ``[B, T, C]`` by ``index [B, T_out]`` -> ``[B, T_out, C]`` (a flat
    ``index_select``, faster on CPU than ``gather`` with an expanded index)."""
    b, t, c = m.shape
    flat = (index + torch.arange(b, device=index.device).unsqueeze(1) * t).flatten()  # (B * T_out)
    return m.reshape(b * t, c).index_select(0, flat).view(b, index.shape[1], c)


def arange_like(b: int, t: int, device: torch.device) -> Tensor:
    """``[B, T]`` long: ``0 .. T-1`` in every row."""
    return torch.arange(t, device=device).expand(b, -1)


# ---------------------------------------------------------------------------- the blocks
class MergingBlock(TimmBlock):
    """timm's ``Block`` with a token merge between attention and MLP (set on a block by
    :func:`merge_tokens` through its class; :func:`unmerge_tokens` sets timm's back). The
    forward is timm's, line for line, plus the merge: with nothing merged it computes exactly
    what timm's does."""

    _merge_state: MergeState
    _merge_index: int

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        state, index = self._merge_state, self._merge_index
        if index == 0:
            state.start(x)
        bias = state.attention_bias(attn_mask, x)
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=bias, is_causal=is_causal)))
        x = state.merge(x, index)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        if index == state.depth - 1:
            x = state.restore(x, index)
        return x


def _vit(model: nn.Module) -> nn.Module:
    """The timm VisionTransformer inside ``model`` (itself, a ViTEncoder's ``model``, a task's
    ``encoder.model``)."""
    seen = model
    for _ in range(4):
        if isinstance(getattr(seen, "blocks", None), nn.Sequential | nn.ModuleList) and hasattr(
                seen, "num_prefix_tokens"):
            return seen
        nxt = getattr(seen, "model", None) if isinstance(getattr(seen, "model", None), nn.Module) else None
        nxt = nxt or (getattr(seen, "encoder", None) if isinstance(getattr(seen, "encoder", None), nn.Module) else None)
        if nxt is None:
            break
        seen = nxt
    raise EncoderError(
        f"token merging needs a timm Vision Transformer (a ViTEncoder, a task with an `encoder`, or a timm "
        f"VisionTransformer); {type(model).__name__} holds none"
    )


def merge_state(model: nn.Module) -> MergeState | None:
    """The :class:`MergeState` of a merged model (``None`` when it is not merged)."""
    try:
        vit = _vit(model)
    except EncoderError:
        return None
    return getattr(vit, "_merge_state", None)


def merge_log(model: nn.Module) -> list[list[TokenMerge | TokenExpand]] | None:
    """Per block, the token maps applied after its attention in the model's last forward
    (``merges=`` of :func:`~vision_attn.explain.rollout.attention_rollout`); ``None`` when the
    model is not merged or nothing was merged (the explanations need no maps then)."""
    state = merge_state(model)
    if state is None or not state.events:
        return None
    return [list(s) for s in state.steps]


def grid_attention(attentions: list[Tensor], merges: list[list[TokenMerge | TokenExpand]] | None) -> list[Tensor]:
    """Each block's attention of a merged model mapped back to the original tokens:
    ``[B, heads, T, T]`` per block, as an unmerged model's capture has them (e.g. for a per-patch
    attention view). Original token ``i`` gets the row of the merged token holding it, and a
    merged key's probability is split evenly over the original tokens it holds, so rows still
    sum to 1 (and a model whose merged tokens were exact duplicates gets its unmerged attention).

    Args:
        attentions: ``capture_attention``'s list from a merged model's forward.
        merges: :func:`merge_log` of the same forward (``None``: returned unchanged).
    """
    if merges is None:
        return list(attentions)
    out: list[Tensor] = []
    assign: Tensor | None = None  # (B, T): the current token holding each original token
    for attn, steps in zip(attentions, merges, strict=True):
        if assign is None:
            out.append(attn)
        else:
            b, h, t, _ = attn.shape
            t0 = assign.shape[1]
            count = attn.new_zeros(b, t).scatter_add(1, assign, attn.new_ones(b, t0))  # originals per token
            rows = attn.gather(2, assign[:, None, :, None].expand(b, h, t0, t))  # (B, H, T0, t)
            full = rows.gather(3, assign[:, None, None, :].expand(b, h, t0, t0))  # (B, H, T0, T0)
            out.append(full / count.gather(1, assign)[:, None, None, :])
        for step in steps:
            if isinstance(step, TokenMerge):
                assign = step.dst if assign is None else step.dst.gather(1, assign)
    return out


def merge_tokens(model: nn.Module, r: int) -> nn.Module:
    """Merge ``r`` tokens per block in ``model``'s timm ViT, in place; returns ``model``.

    Calling it again changes ``r``; :func:`unmerge_tokens` restores the model exactly.

    Args:
        model: a :class:`~vision_attn.ViTEncoder`, a task with an ``encoder`` (classification,
            detection, captioning: the encoder still returns tokens on the patch grid), or a timm
            ``VisionTransformer``.
        r: tokens merged per block (``0``: the unmerged model's computation exactly).

    Raises:
        EncoderError: ``r < 0``, or a block / attention type that merging does not support.
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise EncoderError(f"merge_r must be an integer >= 0 (tokens merged per block), got {r!r}")
    vit = _vit(model)
    state = getattr(vit, "_merge_state", None)
    if state is not None:
        state.r = r
        return model
    blocks = list(vit.blocks)
    for i, blk in enumerate(blocks):
        if isinstance(getattr(blk, "mlp", None), LocalMlp):
            raise EncoderError(
                f"token merging cannot run with local_mlp=True (block {i}'s feed-forward convolves the patch grid, "
                "which merged tokens no longer form): use merge_r=0 with this encoder"
            )
        if type(blk) is not TimmBlock or not isinstance(getattr(blk, "attn", None), TimmAttention):
            raise EncoderError(
                f"token merging supports timm's ViT Block with timm's Attention; block {i} is "
                f"{type(blk).__module__}.{type(blk).__qualname__} with "
                f"{type(getattr(blk, 'attn', None)).__qualname__} attention. Use a vit_* / deit_* model, or merge_r=0"
            )
    state = MergeState(r=r, num_prefix_tokens=int(vit.num_prefix_tokens), depth=len(blocks))
    for i, blk in enumerate(blocks):
        blk.__class__ = MergingBlock
        blk._merge_state, blk._merge_index = state, i
        blk.attn.k_norm._merge_state = state
        blk.attn.k_norm.register_forward_hook(_keep_keys)
    vit._merge_state = state
    log.info("token merging: r=%d per block over %d blocks", r, len(blocks))
    return model


def _keep_keys(module: nn.Module, _inputs, keys: Tensor) -> None:
    """Forward hook on an attention's ``k_norm``: hand the block's keys ``[B, H, T, d]`` (as its
    attention uses them) to the merge. A plain function reaching the state through the module,
    so that a deep copy of a merged model feeds its own state."""
    module._merge_state.keys = keys


def unmerge_tokens(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_tokens`: timm's blocks back, hooks removed.

    Args:
        model: a timm ViT or a :class:`~vision_attn.ViTEncoder` (unmerged models are returned as they are).

    Returns:
        ``model`` itself.
    """
    vit = _vit(model)
    if getattr(vit, "_merge_state", None) is None:
        return model
    for blk in vit.blocks:
        hooks = blk.attn.k_norm._forward_hooks
        for key in [k for k, fn in hooks.items() if fn is _keep_keys]:
            del hooks[key]
        blk.__class__ = TimmBlock
        del blk._merge_state, blk._merge_index, blk.attn.k_norm._merge_state
    del vit._merge_state
    return model


@contextmanager
def token_merging(model: nn.Module, r: int) -> Iterator[nn.Module]:
    """Context manager: ``model`` merges ``r`` tokens per block inside, and is restored on exit
    (to its earlier ``r`` if it was already merged, else unmerged), even after an exception.

    Args:
        model: a timm ViT or a :class:`~vision_attn.ViTEncoder`.
        r: tokens merged per block (ToMe, Bolya et al. 2023).

    Yields:
        ``model``, merging.
    """
    before = merge_state(model)
    old_r = before.r if before is not None else None
    merge_tokens(model, r)
    try:
        yield model
    finally:
        if old_r is None:
            unmerge_tokens(model)
        else:
            merge_tokens(model, old_r)
