"""Explaining a classifier's decisions: one call, several methods, batched.

    maps = explain_classifier(task, images, methods=("rollout", "relevance"))
    maps.maps["rollout"]   # [B, h, w] in [0, 1]

The maps explain what the classifier's head reads: the class token's row with ``cls``
pooling, the mean of the patch tokens' rows with ``mean`` pooling (also when the encoder has a
class token, which a mean-pooling head never reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from vision_attn.explain.capture import capture_attention
from vision_attn.explain.faithfulness import auc, deletion_insertion_curve
from vision_attn.explain.rollout import (
    HeadFusion,
    TokenIndex,
    attention_rollout,
    gradient_relevance,
    last_layer_attention,
)

__all__ = ["METHODS", "Explanation", "Method", "explain_classifier", "explained_token", "faithfulness"]

Method = Literal["rollout", "relevance", "attention", "random"]
METHODS: tuple[str, ...] = ("rollout", "relevance", "attention", "random")


@dataclass
class Explanation:
    """Saliency maps of a batch. ``maps[method]`` is ``[B, h, w]`` in ``[0, 1]``; ``attentions``
    the captured attention of every block ``[B, heads, T, T]`` (detached), ``num_prefix_tokens``
    how many of the ``T`` tokens are not patches, ``token_index`` the row explained (a prefix
    token's index, or ``"patches"``: the mean of the patch tokens' rows)."""

    logits: Tensor
    target: Tensor
    grid: tuple[int, int]
    maps: dict[str, Tensor] = field(default_factory=dict)
    attentions: list[Tensor] = field(default_factory=list)
    num_prefix_tokens: int = 0
    token_index: TokenIndex = 0


_CLS_POOLING = ("cls", "token")  # ClassificationHead's and timm's names
_MEAN_POOLING = ("mean", "avg")


def explained_token(head, num_prefix_tokens: int) -> TokenIndex:
    """The row that explains what ``head`` reads: ``0`` (the class token) for ``cls`` pooling,
    ``"patches"`` (the mean of the patch tokens' rows) for ``mean`` pooling; ``auto`` and heads
    without a ``pooling`` attribute read the class token when there is one, else the mean.

    Raises:
        ValueError: a pooling no row describes (e.g. attention pooling).
    """
    pooling = getattr(head, "pooling", None) or getattr(head, "global_pool", None) or "auto"
    if pooling == "auto":
        pooling = "cls" if num_prefix_tokens > 0 else "mean"
    if pooling in _CLS_POOLING:
        return 0
    if pooling in _MEAN_POOLING:
        return "patches"
    raise ValueError(
        f"cannot explain a head with pooling {pooling!r}: the explanations follow a class token ('cls') or the "
        "mean of the patch tokens ('mean'); pass token_index= to explain_classifier to choose a row"
    )


def explain_classifier(
    task,
    images: Tensor,
    methods: Sequence[str] = ("rollout",),
    target: Tensor | None = None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    token_index: TokenIndex | None = None,
    generator: torch.Generator | None = None,
) -> Explanation:
    """Saliency maps of a classification task for a batch of normalised images.

    Args:
        task: a :class:`~vision_attn.tasks.ClassificationTask` (``encoder`` + ``head``).
        images: ``[B, 3, H, W]`` model inputs.
        methods: any of ``rollout``, ``relevance`` (gradient-weighted, class specific),
            ``attention`` (raw last-layer attention) and ``random`` (a baseline).
        target: ``[B]`` classes to explain for ``relevance`` (default: the predicted ones).
        head_fusion: head fusion of ``rollout`` and ``attention``.
        discard_ratio: ``rollout``'s discard ratio.
        start_layer: first block used by ``rollout`` and ``relevance``.
        token_index: the row explained: default what the head reads (see
            :func:`explained_token`: the class token for ``cls`` pooling, the mean of the patch
            tokens' rows for ``mean`` pooling); or a prefix token's index, or ``"patches"``.
        generator: randomness of the ``random`` baseline.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown explanation methods {unknown}; choose from {', '.join(METHODS)}")
    need_grad = "relevance" in methods
    with torch.set_grad_enabled(need_grad), capture_attention(task.encoder, keep_grad=need_grad) as attn:
        out = task.encoder(images)
        logits = task.head(out)
    if target is None:
        target = logits.detach().argmax(dim=1)
    p = out.num_prefix_tokens
    if token_index is None:
        token_index = explained_token(task.head, p)
    result = Explanation(logits=logits.detach(), target=target, grid=out.grid,
                         attentions=[a.detach() for a in attn], num_prefix_tokens=p, token_index=token_index)
    if need_grad:
        with torch.enable_grad():  # also under a caller's no_grad (Lightning's predict loop)
            score = logits.gather(1, target.view(-1, 1)).sum()
        grads = torch.autograd.grad(score, attn)
        result.maps["relevance"] = gradient_relevance(attn, grads, out.grid, p, token_index, start_layer)
    for method in methods:
        if method == "rollout":
            result.maps[method] = attention_rollout(attn, out.grid, p, head_fusion, discard_ratio, start_layer, token_index)
        elif method == "attention":
            result.maps[method] = last_layer_attention(attn, out.grid, p, head_fusion, token_index)
        elif method == "random":
            rand = torch.rand((images.shape[0], *out.grid), generator=generator)
            result.maps[method] = rand.to(images.device)
    result.maps = {m: result.maps[m] for m in methods}  # in the order asked for
    return result


def faithfulness(task, images: Tensor, explanation: Explanation, steps: int = 16) -> dict[str, dict[str, Tensor]]:
    """Per-image deletion and insertion AUC of every map in ``explanation``.

    Returns ``{method: {"deletion_auc": [B], "insertion_auc": [B]}}`` for the class in
    ``explanation.target``.
    """

    def proba(x: Tensor) -> Tensor:
        return task(x).float().softmax(dim=-1)

    out: dict[str, dict[str, Tensor]] = {}
    for method, sal in explanation.maps.items():
        out[method] = {
            f"{mode}_auc": auc(deletion_insertion_curve(proba, images, sal, explanation.target, mode, steps))
            for mode in ("deletion", "insertion")
        }
    return out
