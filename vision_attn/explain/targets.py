"""Which row of the attention and which class an explanation explains.

- :func:`explained_token`: the row that describes what a classifier's head reads (the class
  token, the mean of the patch tokens, a distilled DeiT's two rows, a sequence-pooling head's
  weights); :func:`resolve_token` the row asked for by name (:data:`TOKENS`);
- :func:`resolve_target_class`: a class given by name or index, checked against the model's.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from vision_attn.errors import ConfigError
from vision_attn.explain.rollout import TokenIndex, prefix_attention

__all__ = ["TOKENS", "Token", "explained_token", "register_shares", "resolve_target_class", "resolve_token"]

Token = Literal["auto", "cls", "dist", "mean"]
TOKENS: tuple[str, ...] = ("auto", "cls", "dist", "mean")

_CLS_POOLING = ("cls", "token")  # ClassificationHead's and timm's names
_MEAN_POOLING = ("mean", "avg")
_SEQ_POOLING = ("seq",)  # ClassificationHead's sequence pooling (CCT)


def _attention_pooled(head) -> bool:
    """A timm head with attention pooling (``map``) that gives its weights (``token_weights``)."""
    pooling = getattr(head, "pooling", None) or getattr(head, "global_pool", None)
    return pooling == "map" and callable(getattr(head, "token_weights", None))


def explained_token(head, num_prefix_tokens: int, out=None) -> TokenIndex:
    """The row that explains what ``head`` reads: ``0`` (the class token) for ``cls`` pooling,
    ``(0, 1)`` (the mean of the class and distillation rows) for a distilled head
    (``head.distilled``: a DeiT's head averages its two classifiers), ``"patches"`` (the mean of
    the patch tokens' rows) for ``mean`` pooling; ``auto`` and heads without a ``pooling``
    attribute read the class token when there is one, else the mean.

    ``seq`` pooling (:class:`~vision_attn.models.smalldata.SequencePooling`) reads
    ``sum_i w_i x_i`` with weights ``w`` that depend on the image: its row is the ``[B, T]``
    tensor ``head.token_weights(out)`` (detached; 0 on the prefix tokens), the weighted mixture
    of the patch tokens' rows, so ``out`` (the batch's
    :class:`~vision_attn.models.EncoderOutput`) is needed. timm's attention pooling (``map``:
    SigLIP, Perception Encoder) reads the tokens with its latent queries' attention: its row is
    that attention, ``head.token_weights(out)``
    (:func:`~vision_attn.models.classifier.attention_pool_weights`), the same way.

    Raises:
        ValueError: a pooling no row describes (e.g. attention pooling), or ``seq`` pooling
            without ``out``.
    """
    pooling = getattr(head, "pooling", None) or getattr(head, "global_pool", None) or "auto"
    if pooling == "auto":
        pooling = "cls" if num_prefix_tokens > 0 else "mean"
    if pooling in _CLS_POOLING:
        return (0, 1) if getattr(head, "distilled", False) and num_prefix_tokens >= 2 else 0
    if pooling in _MEAN_POOLING:
        return "patches"
    if pooling in _SEQ_POOLING or _attention_pooled(head):
        if out is None:
            raise ValueError("a sequence- or attention-pooling head's row depends on the image (its pooling weights): "
                             "pass the encoder output, explained_token(head, num_prefix_tokens, out)")
        return head.token_weights(out).detach()
    raise ValueError(
        f"cannot explain a head with pooling {pooling!r}: the explanations follow a class token ('cls') or the "
        "mean of the patch tokens ('mean'); pass token_index= to explain_classifier to choose a row"
    )


def _prefix_layout(encoder: nn.Module, num_prefix_tokens: int) -> tuple[bool, bool]:
    """``(has_class_token, distilled)`` of a timm ViT (a ViTEncoder's ``model``): timm puts the
    class token first, then a DeiT's distillation token, then the register tokens."""
    model = getattr(encoder, "model", encoder)
    has_cls = getattr(model, "cls_token", None) is not None if hasattr(model, "cls_token") else num_prefix_tokens > 0
    distilled = getattr(model, "dist_token", None) is not None
    return has_cls, distilled


def resolve_token(task, num_prefix_tokens: int, token: str = "auto", out=None) -> TokenIndex:
    """The row explained for ``token``: ``auto`` (what the head reads, :func:`explained_token`;
    ``out``, the batch's encoder output, is needed for a sequence-pooling head),
    ``cls`` (the class token), ``dist`` (a distilled DeiT's distillation token) or ``mean`` (the
    average of the class and distillation rows).

    Raises:
        ConfigError: an unknown ``token``, or one the model does not have.
    """
    if token not in TOKENS:
        raise ConfigError(f"token {token!r} invalid; choose one of {', '.join(TOKENS)}")
    if token == "auto":
        return explained_token(task.head, num_prefix_tokens, out)
    has_cls, distilled = _prefix_layout(task.encoder, num_prefix_tokens)
    if token == "cls":
        if not has_cls:
            raise ConfigError(f"token='cls': this model has no class token ({num_prefix_tokens} prefix tokens); "
                              "use token='auto'")
        return 0
    if not distilled:
        raise ConfigError(f"token={token!r} needs a distilled model (DeiT *_distilled_*: class and distillation "
                          "tokens); this one has none: use token='auto' or 'cls'")
    return 1 if token == "dist" else (0, 1)


def resolve_target_class(target_class: str | int, class_names: Sequence[str] | None, num_classes: int) -> int:
    """The index of ``target_class``: a class name (from ``class_names``), an index, or a string
    of digits that is not a class name (an index given on the command line).

    Raises:
        ConfigError: an unknown name (close names suggested) or an index out of range.
    """
    names = list(class_names or [])
    if isinstance(target_class, str):
        if names.count(target_class) > 1:  # ImageNet-1k has two "crane"s (bird and machine)
            where = [i for i, n in enumerate(names) if n == target_class]
            raise ConfigError(f"target_class {target_class!r} names several classes of this model (indices "
                              f"{where}); give the index instead")
        if target_class in names:
            return names.index(target_class)
        if not target_class.strip().lstrip("-").isdigit():
            close = difflib.get_close_matches(target_class, names, n=3, cutoff=0.6)
            hint = f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"target_class {target_class!r} is not a class name of this model "
                              f"({len(names)} classes: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})."
                              f"{hint} Give a class name or an index 0..{num_classes - 1}.")
        target_class = int(target_class)
    if isinstance(target_class, bool) or not isinstance(target_class, int) or not 0 <= target_class < num_classes:
        raise ConfigError(f"target_class {target_class!r} is not a class index 0..{num_classes - 1} of this model")
    return target_class


def register_shares(encoder, expl) -> torch.Tensor | None:
    """``[B]``: the share of the explained row's last-block attention that the encoder's register
    tokens take (Darcet et al. 2023: registers absorb the attention a ViT would otherwise spend on
    high-norm background patches), or ``None`` for a model without registers or when no attention
    was captured (:func:`~vision_attn.explain.rollout.prefix_attention`)."""
    registers = int(getattr(getattr(encoder, "model", encoder), "num_reg_tokens", 0) or 0)
    if not registers or not expl.attentions or len({a.shape[-1] for a in expl.attentions}) > 1:
        return None
    return prefix_attention(expl.attentions, expl.num_prefix_tokens, expl.token_index)[:, -registers:].sum(1)
