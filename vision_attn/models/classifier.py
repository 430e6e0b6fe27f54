"""Classification heads: pool the encoder's tokens, then a linear layer.

Pooling: the class token (``cls``), the mean of the patch tokens (``mean``) or sequence pooling
(``seq``: a learned, input-dependent weighted mean of the patch tokens, Hassani et al. 2021,
:class:`~vision_attn.models.smalldata.SequencePooling`).

:class:`ClassificationHead` is the suite's own (trained with the task); :class:`TimmHead` runs
the timm model's own pooling and classifier (``forward_head``), so a pretrained timm ViT
predicts exactly as timm does (class or mean pooling, ``fc_norm``, the averaged class and
distillation heads of a distilled DeiT, register tokens left out of the mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from vision_attn.errors import EncoderError
from vision_attn.models.encoder import EncoderOutput, ViTEncoder
from vision_attn.models.smalldata import SequencePooling

__all__ = ["POOLINGS", "ClassificationHead", "ClassifierConfig", "HeadKind", "Pooling", "TimmHead"]

Pooling = Literal["auto", "cls", "mean", "seq"]
POOLINGS: tuple[str, ...] = ("auto", "cls", "mean", "seq")
HeadKind = Literal["linear", "timm"]


@dataclass(frozen=True)
class ClassifierConfig:
    """Which classification head reads the encoder's tokens, and how.

    Attributes:
        kind: ``linear`` (the suite's :class:`ClassificationHead`, built from the data) or
            ``timm`` (the timm model's own pooling and classifier, :class:`TimmHead`: a
            pretrained timm ViT as timm runs it; the task's ``num_classes`` is then the
            encoder's classifier size, and ``pooling`` is timm's).
        pooling: ``auto`` (class token if any, else mean), ``cls``, ``mean`` (over the patch
            tokens) or ``seq`` (CCT's sequence pooling, see :class:`ClassificationHead`). The
            explanations explain what the head reads: the class token's row, or the pooling's
            mixture of the patch tokens' rows.
        dropout: dropout before the classifier (``linear`` head).
    """

    kind: HeadKind = "linear"
    pooling: Pooling = "auto"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "timm"):
            raise ValueError(f"head.kind must be 'linear' or 'timm', got {self.kind!r}")


class ClassificationHead(nn.Module):
    """Logits ``[B, C]`` from encoder tokens.

    Args:
        embed_dim: token width ``D``.
        num_classes: ``C``.
        pooling: ``cls`` takes the first prefix token, ``mean`` averages the patch tokens
            (prefix tokens left out, as timm's ``avg`` pool), ``seq`` is CCT's sequence pooling
            over the patch tokens (prefix tokens left out; :attr:`seq_pool` learns the weights),
            ``auto`` is ``cls`` when the encoder has prefix tokens and ``mean`` otherwise.
            Explanations follow it (:func:`~vision_attn.explain.methods.explained_token`): the
            class token's row, the mean of the patch tokens' rows, or for ``seq`` their mixture
            with each image's pooling weights (:meth:`token_weights`).
        dropout: dropout before the linear layer.
    """

    def __init__(self, embed_dim: int, num_classes: int, pooling: Pooling = "auto", dropout: float = 0.0) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.pooling = pooling
        self.seq_pool = SequencePooling(embed_dim) if pooling == "seq" else None
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.fc.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)

    def pool(self, out: EncoderOutput) -> Tensor:
        """``[B, D]`` pooled features."""
        mode = self.pooling
        if mode == "auto":
            mode = "cls" if out.num_prefix_tokens > 0 else "mean"
        if mode == "cls":
            if out.num_prefix_tokens == 0:
                raise ValueError("pooling='cls' needs an encoder with a class token; use pooling='mean'")
            return out.tokens[:, 0]
        if mode == "seq":
            return self.seq_pool(out.patch_tokens)
        return out.patch_tokens.mean(dim=1)

    def token_weights(self, out: EncoderOutput) -> Tensor:
        """``[B, T]``: how much of each token the pooled feature holds, ``pool(out) = w @ tokens``
        (0 for the tokens it does not read): one-hot on the class token for ``cls``, uniform over
        the patch tokens for ``mean``, the pooling weights for ``seq``. The row an explanation
        of this head follows."""
        b, t = out.tokens.shape[:2]
        p = out.num_prefix_tokens
        mode = self.pooling if self.pooling != "auto" else ("cls" if p > 0 else "mean")
        weights = out.tokens.new_zeros(b, t)
        if mode == "cls":
            if p == 0:
                raise ValueError("pooling='cls' needs an encoder with a class token; use pooling='mean'")
            weights[:, 0] = 1.0
        elif mode == "seq":
            weights[:, p:] = self.seq_pool.weights(out.patch_tokens)
        else:
            weights[:, p:] = 1.0 / (t - p)
        return weights

    def forward(self, out: EncoderOutput) -> Tensor:
        return self.fc(self.dropout(self.pool(out)))


def attention_pool_attention(model: nn.Module, tokens: Tensor) -> tuple[Tensor, int]:
    """The attention of a timm model's attention pooling (``global_pool='map'``: SigLIP, Perception
    Encoder), recomputed from its weights as timm's ``AttentionPoolLatent`` computes it:
    ``([B, heads, latents, N], offset)``, the softmax of its latent queries against the ``N``
    tokens it reads, which are ``tokens[:, offset:]`` (the prefix tokens left out where the model
    pools the patch tokens only).

    Raises:
        ValueError: the model has no attention pooling.
    """
    pool = getattr(model, "attn_pool", None)
    if pool is None or not hasattr(pool, "latent"):
        raise ValueError(f"{type(model).__name__} has no attention pooling (attn_pool)")
    offset = 0 if getattr(model, "pool_include_prefix", True) else int(getattr(model, "num_prefix_tokens", 0))
    x = tokens[:, offset:]
    b, n, c = x.shape
    if getattr(pool, "pos_embed", None) is not None:
        x = x + pool.pos_embed.unsqueeze(0).to(x.dtype)
    heads, dim = pool.num_heads, pool.head_dim
    q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, pool.latent_len, heads, dim).transpose(1, 2)
    k = pool.kv(x).reshape(b, n, 2, heads, dim).permute(2, 0, 3, 1, 4)[0]
    q, k = pool.q_norm(q), pool.k_norm(k)
    return ((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1), offset


def attention_pool_weights(model: nn.Module, tokens: Tensor) -> Tensor:
    """``[B, T]``: what the attention pooling of ``model`` reads of each of the ``T`` ``tokens``,
    its attention (:func:`attention_pool_attention`) averaged over the heads and over the latent
    queries it keeps (the first alone where it pools with ``token``); 0 for tokens it does not read."""
    attn, offset = attention_pool_attention(model, tokens)
    kept = attn[:, :, :1] if getattr(model.attn_pool, "pool", "token") == "token" else attn
    weights = tokens.new_zeros(tokens.shape[:2])
    weights[:, offset:] = kept.mean(dim=(1, 2)).to(weights.dtype)
    return weights


class TimmHead(nn.Module):
    """Logits ``[B, C]`` from encoder tokens through the timm model's own ``forward_head``.

    The classifier's weights stay where timm keeps them, in the encoder's timm model
    (``encoder.model.head`` ...), so a timm state dict loads into the encoder unchanged; this
    module holds no parameters and only a plain (unregistered) reference to the encoder.

    Attributes:
        pooling: timm's ``global_pool``: ``token`` (the class token; a distilled DeiT averages
            the class and distillation heads), ``avg`` (the mean of the patch tokens, prefix and
            register tokens left out), or ``map`` (attention pooling: explanations follow its
            attention weights, :meth:`token_weights`).
        distilled: a distilled DeiT: the logits are the mean of the class-token head and the
            distillation-token head (prefix tokens 0 and 1).
        num_classes: ``C``.

    Args:
        encoder: a :class:`~vision_attn.models.ViTEncoder` built with timm's classifier
            (``num_classes > 0``).

    Raises:
        EncoderError: the encoder has no timm classifier.
    """

    def __init__(self, encoder: ViTEncoder) -> None:
        super().__init__()
        model = encoder.model
        num_classes = int(getattr(model, "num_classes", 0) or 0)
        if num_classes < 1 or not hasattr(model, "forward_head"):
            raise EncoderError(
                f"head='timm' needs the timm model's own classifier, but encoder {encoder.name!r} was built "
                "with num_classes=0; build it with the pretrained classifier's size (e.g. num_classes=1000)"
            )
        self.num_classes = num_classes
        self.pooling: str = str(getattr(model, "global_pool", "token") or "")
        self.distilled: bool = hasattr(model, "head_dist")
        # A plain attribute (not a sub-module): the weights are the encoder's, saved once.
        self.__dict__["_timm_model"] = model

    @property
    def global_pool(self) -> str:
        """timm's name of :attr:`pooling`."""
        return self.pooling

    def token_weights(self, out: EncoderOutput) -> Tensor:
        """``[B, T]``: an attention-pooling (``map``) head's weights over the tokens, the row its
        explanations follow (:func:`attention_pool_weights`)."""
        return attention_pool_weights(self._timm_model, out.tokens)

    def forward(self, out: EncoderOutput) -> Tensor:
        return self._timm_model.forward_head(out.tokens)  # (B, C)
