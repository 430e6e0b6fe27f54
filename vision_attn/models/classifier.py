"""Classification head: pool the encoder's tokens, then a linear layer."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from vision_attn.models.encoder import EncoderOutput

__all__ = ["ClassificationHead", "Pooling"]

Pooling = Literal["auto", "cls", "mean"]


class ClassificationHead(nn.Module):
    """Logits ``[B, C]`` from encoder tokens.

    Args:
        embed_dim: token width ``D``.
        num_classes: ``C``.
        pooling: ``cls`` takes the first prefix token, ``mean`` averages the patch tokens
            (prefix tokens left out, as timm's ``avg`` pool), ``auto`` is ``cls`` when the
            encoder has prefix tokens and ``mean`` otherwise. Explanations follow it
            (:func:`~vision_attn.explain.methods.explained_token`): the class token's row, or
            the mean of the patch tokens' rows.
        dropout: dropout before the linear layer.
    """

    def __init__(self, embed_dim: int, num_classes: int, pooling: Pooling = "auto", dropout: float = 0.0) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if pooling not in ("auto", "cls", "mean"):
            raise ValueError(f"pooling must be 'auto', 'cls' or 'mean', got {pooling!r}")
        self.pooling = pooling
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
        return out.patch_tokens.mean(dim=1)

    def forward(self, out: EncoderOutput) -> Tensor:
        return self.fc(self.dropout(self.pool(out)))
