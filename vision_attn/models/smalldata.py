"""Small-data techniques for ViTs trained from scratch, on top of timm's blocks.

A plain ViT has no locality prior: on a few thousand images it learns slowly where a CNN does
not. Five published remedies, each an option of the suite's models (all off by default, so a
pretrained timm ViT stays exactly timm's):

- **Convolutional stems** (Xiao et al. 2021, "Early convolutions help transformers see
  better"): a few 3x3 convolutions turn pixels into the patch tokens, strided
  (``ViTEncoder(stem="conv")``) or with max pooling (``stem="cnn"``): :class:`ConvStem`.
- **Shifted patch tokenization** (SPT; Lee, Lee & Song 2021, "Vision Transformer for Small-Size
  Datasets"): each patch token also sees the neighbouring half patches. The image is shifted by
  half a patch in the four diagonal directions (zeros fill in), the four shifted copies are
  concatenated with the image along the channels (``5 * C`` channels), and that stack is cut
  into ``p x p`` patches, flattened, layer-normalised and projected linearly to ``D``:
  :class:`ShiftedPatchTokenizer`, ``ViTEncoder(stem="spt")``. The token grid is that of the
  linear ``p x p`` patch embedding.
- **Locality self-attention** (LSA; same paper): two changes to every block's attention that
  sharpen it. A *learnable temperature* per block replaces the fixed ``1 / sqrt(d_head)`` that
  scales the scores (here ``temperature = exp(g) / sqrt(d_head)`` with ``g`` learned, starting at
  0: the usual scale at first, positive always), and the *diagonal* of the score matrix is masked
  to ``-inf`` before the softmax, so a token spreads its attention over the *other* tokens
  instead of mostly itself: :class:`LocalitySelfAttention`, ``ViTEncoder(lsa=True)``.
- **Local feed-forward** (LocalViT, Li et al. 2021; CeiT's locally-enhanced feed-forward, Yuan
  et al. 2021; PVTv2's convolutional feed-forward, Wang et al. 2022): a depthwise 3x3
  convolution over the patch grid between the two linear layers of every block's MLP, so each
  block mixes a token with its eight neighbours: :class:`LocalMlp`,
  ``ViTEncoder(local_mlp=True)``.
- **Sequence pooling** (Hassani et al. 2021, "Escaping the Big Data Paradigm with Compact
  Transformers", CCT): instead of a class token, the head reads a weighted mean of the output
  tokens whose weights the model learns: ``w = softmax_i(Linear(x_i))``, ``z = sum_i w_i x_i``:
  :class:`SequencePooling`, ``ClassificationHead(pooling="seq")``.

What the suite's observability relies on is kept: :class:`LocalitySelfAttention` *is* a timm
``Attention`` (a subclass with the same ``fused_attn`` flag, the same ``qkv`` / ``proj`` /
``attn_drop`` sub-modules, and ``attn_drop`` still receiving the softmax output), so attention
capture, rollout, gradient relevance and AttnLRP (:mod:`vision_attn.explain`) work unchanged.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.errors import EncoderError

try:  # timm >= 1.0.?: the ViT attention lives in timm.layers
    from timm.layers import Attention as TimmAttention
except ImportError:  # pragma: no cover - older timm
    from timm.models.vision_transformer import Attention as TimmAttention

__all__ = [
    "DIAGONAL_SHIFTS",
    "STEM_NORMS",
    "ConvStem",
    "LSA_TEMPERATURE_KEY",
    "LocalMlp",
    "LocalitySelfAttention",
    "SequencePooling",
    "ShiftedPatchTokenizer",
    "apply_local_mlp",
    "apply_locality_self_attention",
    "shift_image",
]

log = logging.getLogger(__name__)

DIAGONAL_SHIFTS: tuple[tuple[int, int], ...] = ((-1, -1), (-1, 1), (1, -1), (1, 1))
"""``(dy, dx)`` signs of SPT's four shifts (up-left, up-right, down-left, down-right), each
multiplied by half the patch size; the concatenation order of the shifted copies after the image."""

LSA_TEMPERATURE_KEY = "log_temperature_gain"
"""Name of :class:`LocalitySelfAttention`'s learned parameter (``blocks.N.attn.<this>`` in a
timm state dict): a weights file without it (a plain ViT) loads into an LSA encoder with the
temperature at its initial value."""


# ---------------------------------------------------------------------------- SPT
def shift_image(x: Tensor, dy: int, dx: int) -> Tensor:
    """``x`` ``[..., H, W]`` translated by ``dy`` rows down and ``dx`` columns right (negative:
    up / left), same size, zeros where nothing moved in: ``out[..., i, j] = x[..., i - dy, j - dx]``."""
    # F.pad with a negative amount crops: pad one side by the shift, crop the other by as much.
    return F.pad(x, (dx, -dx, dy, -dy))



STEM_NORMS = ("layer", "instance")
""":class:`ConvStem`'s normalisation: ``layer`` (one group: each image's whole feature map) or
``instance`` (one group per channel: each channel of each image on its own)."""


class ConvStem(nn.Module):
    """Convolutional patch embedding ("Early convolutions help transformers see better",
    Xiao et al. 2021), ``ViTEncoder(stem="conv")``: a 3x3 conv, then ``log2(patch)`` stride-2
    3x3 convs, then a 1x1 conv to ``embed_dim``. Same token grid as a ``patch x patch`` linear
    embedding, but it gives small from-scratch ViTs the locality they lack, so they train in
    far fewer steps. Batch-norm free (GroupNorm), so results do not depend on the per-process
    batch.

    ``pool`` (``ViTEncoder(stem="cnn")``): a small CNN instead, each of the ``log2(patch)``
    stages a stride-1 3x3 conv at the stage's resolution followed by 2x2 max pooling, then a
    3x3 conv at the token grid and the 1x1 conv: about twice the stem's compute, and far quicker
    to learn what small objects are from weak labels (docs/results/captioning.md).

    ``norm`` (:data:`STEM_NORMS`): ``layer`` normalises each image's whole feature map at once;
    ``instance`` each channel on its own, which removes each image's colour and brightness per
    channel (for pictures whose colours vary more between images than their objects differ).

    ``channels`` is the width of the first (full-resolution) conv; it doubles at every stage up
    to ``embed_dim``. Default: ``embed_dim / patch_size`` (at least 8), so the width reaches
    ``embed_dim`` at the last conv. A wider start (``channels = embed_dim``) costs about as much
    compute again as a depth-4 dim-64 ViT at 32 px and was worth about 2 points of top-1 on
    small grey glyph sets (docs/results/classification.md).
    """

    def __init__(self, patch_size: int, embed_dim: int, in_chans: int = 3, channels: int | None = None,
                 norm: str = "layer", pool: bool = False) -> None:
        super().__init__()
        if norm not in STEM_NORMS:
            raise EncoderError(f"stem_norm must be one of {', '.join(STEM_NORMS)}, got {norm!r}")
        if patch_size < 2 or patch_size & (patch_size - 1):
            raise EncoderError(f"stem={'cnn' if pool else 'conv'!r} needs a power-of-two patch_size >= 2, "
                               f"got {patch_size}")
        if channels is not None and not 1 <= int(channels) <= 4096:
            raise EncoderError(f"stem_channels must lie in 1..4096 (or be unset), got {channels}")
        n_down = patch_size.bit_length() - 1
        if channels is None:
            widths = [max(8, embed_dim >> (n_down - i)) for i in range(n_down + 1)]
        else:
            widths = [min(max(embed_dim, int(channels)), int(channels) << i) for i in range(n_down + 1)]

        def unit(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, stride, 1), nn.GroupNorm(1 if norm == "layer" else c_out, c_out),
                    nn.GELU()]

        layers: list[nn.Module] = []
        if pool:
            for c_in, c_out in zip([in_chans, *widths[:-2]], widths[:-1], strict=True):
                layers += [*unit(c_in, c_out, 1), nn.MaxPool2d(2)]
            layers += unit(widths[-2], widths[-1], 1)
        else:
            layers += unit(in_chans, widths[0], 1)
            for c_in, c_out in zip(widths[:-1], widths[1:], strict=True):
                layers += unit(c_in, c_out, 2)
        layers.append(nn.Conv2d(widths[-1], embed_dim, 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":
            # oneDNN's channels-last convolutions: the stem's training step (batch 16, 64 px,
            # 2 threads) 27 vs 33 ms; the same values up to rounding
            x = x.contiguous(memory_format=torch.channels_last)
        return self.layers(x)  # (B, D, H/p, W/p)


class ShiftedPatchTokenizer(nn.Module):
    """Shifted patch tokenization (Lee et al. 2021) as a drop-in for timm's patch projection.

    ``[B, C, H, W] -> [B, D, H / p, W / p]``, the contract of ``patch_embed.proj`` (a ``p x p``
    stride-``p`` conv), so timm's ``PatchEmbed`` flattens it, and the grid, the position
    embeddings and dynamic image sizes are unchanged:

    1. the image and its four diagonal shifts by ``s = p // 2`` pixels (:data:`DIAGONAL_SHIFTS`,
       :func:`shift_image`): ``[B, 5C, H, W]``;
    2. cut into ``p x p`` patches, each flattened to ``5 * C * p * p`` values (channel-major:
       ``F.pixel_unshuffle``'s order);
    3. LayerNorm over that vector, then a linear layer to ``D``.

    Args:
        patch_size: ``p`` (>= 2: a 1-pixel patch has no half to shift by).
        embed_dim: ``D``.
        in_chans: ``C``.
    """

    def __init__(self, patch_size: int, embed_dim: int, in_chans: int = 3) -> None:
        super().__init__()
        if patch_size < 2:
            raise EncoderError(f"stem='spt' needs patch_size >= 2 (it shifts by half a patch), got {patch_size}")
        self.patch_size = patch_size
        self.shift = patch_size // 2
        patch_dim = (1 + len(DIAGONAL_SHIFTS)) * in_chans * patch_size * patch_size
        self.norm = nn.LayerNorm(patch_dim)
        self.linear = nn.Linear(patch_dim, embed_dim)

    def shifted_stack(self, x: Tensor) -> Tensor:
        """``[B, C, H, W] -> [B, 5C, H, W]``: the image, then its four shifted copies."""
        s = self.shift
        return torch.cat([x, *(shift_image(x, sy * s, sx * s) for sy, sx in DIAGONAL_SHIFTS)], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        p = self.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise EncoderError(f"stem='spt': image size {tuple(x.shape[-2:])} is not a multiple of the patch "
                               f"size {p}; resize or pad the images (timm's dynamic_img_pad pads them)")
        patches = F.pixel_unshuffle(self.shifted_stack(x), p)  # (B, 5C*p*p, h, w)
        tokens = self.linear(self.norm(patches.permute(0, 2, 3, 1)))  # (B, h, w, D)
        return tokens.permute(0, 3, 1, 2)  # (B, D, h, w)


# ---------------------------------------------------------------------------- LSA
class LocalitySelfAttention(TimmAttention):
    """Locality self-attention (Lee et al. 2021): timm's ``Attention`` with a learned temperature
    and the diagonal of the attention scores masked.

    ``softmax(T * q kᵀ + M) v`` with ``T = exp(g) / sqrt(d_head)`` (``g`` =
    :data:`LSA_TEMPERATURE_KEY`, one scalar per block, initialised to 0 so the block starts as
    timm's; the exponential keeps ``T`` positive) and ``M`` an additive mask that is ``-inf`` on
    the diagonal (a token does not attend to itself) and 0 elsewhere. A mask from the caller
    (``attn_mask``) is added to it. A single-token sequence keeps its diagonal (it has no other
    token to attend to).

    Both of timm's paths are kept: the explicit one (``fused_attn=False``: scores, softmax,
    ``attn_drop`` — whose input :func:`~vision_attn.explain.capture_attention` records — and the
    product with ``v``) and the fused ``F.scaled_dot_product_attention`` (``q`` pre-multiplied by
    ``T``, ``scale=1``, the same additive mask). Build one from a trained timm module with
    :meth:`from_attention`.

    Args:
        dim: token width.
        num_heads: attention heads.
        mask_diagonal: mask the diagonal (``False`` leaves only the learned temperature: the
            ablation of the mask).
        **kwargs: further arguments of timm's ``Attention`` (``qkv_bias``, ...).
    """

    def __init__(self, dim: int, num_heads: int = 8, mask_diagonal: bool = True, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self._init_locality(mask_diagonal)

    def _init_locality(self, mask_diagonal: bool) -> None:
        self.mask_diagonal = mask_diagonal
        ref = self.qkv.weight
        setattr(self, LSA_TEMPERATURE_KEY, nn.Parameter(torch.zeros((), device=ref.device, dtype=ref.dtype)))

    @classmethod
    def from_attention(cls, attn: nn.Module, mask_diagonal: bool = True) -> LocalitySelfAttention:
        """An LSA module holding a copy of ``attn``'s weights and settings (``qkv``, ``proj``,
        norms, dropouts, ``fused_attn``), with the temperature at its initial value.

        Raises:
            EncoderError: ``attn`` is not timm's plain ViT ``Attention`` (subclasses with another
                forward, rotary or pooling attention have no LSA form here).
        """
        if type(attn) is not TimmAttention:
            raise EncoderError(f"lsa=True replaces timm's ViT Attention, but this block's attention is "
                               f"{type(attn).__module__}.{type(attn).__qualname__}; use a vit_* / deit_* model "
                               "with standard attention, or lsa=false")
        new = copy.deepcopy(attn)
        new.__class__ = cls  # same attributes and sub-modules: only forward and the temperature are added
        new._init_locality(mask_diagonal)
        new.train(attn.training)
        return new

    @property
    def temperature(self) -> Tensor:
        """The scale of the scores, ``exp(g) * head_dim ** -0.5`` (a 0-d tensor)."""
        return getattr(self, LSA_TEMPERATURE_KEY).exp() * self.scale

    def score_mask(self, n: int, like: Tensor, attn_mask: Tensor | None = None) -> Tensor | None:
        """Additive mask ``[N, N]`` (or broadcast with ``attn_mask``): ``-inf`` on the diagonal
        when masking, plus the caller's mask (boolean ``True`` = may attend, or additive)."""
        mask = None
        if self.mask_diagonal and n > 1:
            eye = torch.eye(n, dtype=torch.bool, device=like.device)
            mask = torch.zeros(n, n, dtype=like.dtype, device=like.device).masked_fill(eye, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=like.dtype).masked_fill(~attn_mask, float("-inf"))
            mask = attn_mask if mask is None else mask + attn_mask
        return mask

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        if is_causal:
            raise EncoderError("locality self-attention (lsa=True) is for encoders: is_causal=True would leave "
                               "the first token nothing to attend to")
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        attn_dim = getattr(self, "attn_dim", self.num_heads * self.head_dim)
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q * self.temperature.to(q.dtype)
        mask = self.score_mask(n, q, attn_mask)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = q @ k.transpose(-2, -1)  # (B, H, N, N)
            if mask is not None:
                attn = attn + mask
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v  # (B, H, N, d)
        x = x.transpose(1, 2).reshape(b, n, attn_dim)  # (B, N, H*d)
        x = getattr(self, "norm", nn.Identity())(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


def apply_locality_self_attention(model: nn.Module, mask_diagonal: bool = True) -> int:
    """Replace the attention of every block of a timm ViT (``model.blocks[i].attn``) by
    :meth:`LocalitySelfAttention.from_attention` (weights kept). Returns the number replaced.

    Raises:
        EncoderError: the model has no ``blocks`` or a block's attention is not timm's ViT
            ``Attention``.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise EncoderError(f"lsa=True needs a ViT with transformer blocks; {type(model).__name__} has none")
    for block in blocks:
        if not isinstance(block.attn, LocalitySelfAttention):
            block.attn = LocalitySelfAttention.from_attention(block.attn, mask_diagonal)
    return len(blocks)


# ---------------------------------------------------------------------------- sequence pooling
class SequencePooling(nn.Module):
    """Sequence pooling (Hassani et al. 2021, CCT): an attention-weighted mean of tokens.

    ``w = softmax_i(u · x_i + c)`` over the ``N`` tokens (``u, c``: a ``Linear(D, 1)``), then
    ``z = sum_i w_i x_i``. A one-query attention whose values are the tokens themselves: the
    model learns which tokens the classifier reads, instead of routing everything through a
    class token.

    Two identity sub-modules mark the factors of the product ``w x`` for hooks, as ``attn_drop``
    does in an attention module: ``weights_point`` receives the softmax output ``w`` ``[B, N]``,
    ``values_point`` the tokens on the value path ``[B, N, D]`` (an AttnLRP rule halves the
    gradient at both: the uniform rule for a bilinear product).

    Args:
        embed_dim: ``D``.
    """

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.score = nn.Linear(embed_dim, 1)
        self.weights_point = nn.Identity()
        self.values_point = nn.Identity()

    def weights(self, tokens: Tensor) -> Tensor:
        """``[B, N, D] -> [B, N]`` pooling weights (each row sums to 1)."""
        return self.score(tokens).squeeze(-1).softmax(dim=-1)

    def forward(self, tokens: Tensor) -> Tensor:
        """``[B, N, D] -> [B, D]``."""
        weights = self.weights_point(self.weights(tokens)).unsqueeze(1)  # (B, 1, N)
        return (weights @ self.values_point(tokens)).squeeze(1)  # (B, 1, N) @ (B, N, D) -> (B, D)


# ---------------------------------------------------------------------------- local MLP
class LocalMlp(nn.Module):
    """A timm ``Mlp`` with a depthwise 3x3 convolution over the patch grid between its two
    linear layers (the "locally-enhanced feed-forward" of LocalViT, Li et al. 2021, CeiT, Yuan
    et al. 2021, and PVTv2's convolutional feed-forward, Wang et al. 2022): ``fc1 -> dwconv ->
    act -> fc2``, the prefix tokens skipping the convolution. Every block then mixes each
    token with its 8 neighbours, the locality a small from-scratch ViT otherwise learns slowly.

    The patch grid is not part of the tokens: :class:`~vision_attn.models.encoder.ViTEncoder`
    sets :attr:`grid` (and, for a padded batch, :attr:`valid`: per image its real rows and
    columns; padded cells enter the convolution as zeros, so a real token sees what it would see
    alone) before each forward.
    """

    def __init__(self, mlp: nn.Module, num_prefix_tokens: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = mlp.fc1, mlp.act, mlp.fc2
        self.drop1 = getattr(mlp, "drop1", nn.Identity())
        self.norm = getattr(mlp, "norm", nn.Identity())
        self.drop2 = getattr(mlp, "drop2", nn.Identity())
        hidden = self.fc1.out_features
        self.dwconv = nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.grid: tuple[int, int] | None = None
        self.valid: Tensor | None = None  # [B, h, w] bool, or None when every cell is real

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        p = self.num_prefix_tokens
        prefix, cells = h[:, :p], h[:, p:]
        b, n, c = cells.shape
        gh, gw = self.grid if self.grid is not None else (int(round(n ** 0.5)),) * 2
        if gh * gw != n:
            raise EncoderError(f"LocalMlp: {n} patch tokens do not fill the {gh}x{gw} grid it was given "
                               "(token merging or dropping cannot be combined with local_mlp)")
        img = cells.transpose(1, 2).reshape(b, c, gh, gw)
        if self.valid is not None:
            img = img * self.valid.unsqueeze(1).to(img.dtype)
        cells = self.dwconv(img).reshape(b, c, n).transpose(1, 2)
        h = torch.cat([prefix, cells], dim=1) if p else cells
        h = self.drop1(self.act(h))
        return self.drop2(self.fc2(self.norm(h)))


def apply_local_mlp(model: nn.Module) -> int:
    """Replace every block's ``mlp`` of a timm ViT by a :class:`LocalMlp`; returns the count."""
    count = 0
    for block in model.blocks:
        block.mlp = LocalMlp(block.mlp, model.num_prefix_tokens)
        count += 1
    return count
