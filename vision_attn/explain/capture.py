"""Record attention probabilities while a model runs.

Fused attention kernels never materialise the ``T x T`` weights, so a naive forward hook on a
timm ViT records nothing. :func:`capture_attention` finds every attention module *by type*
(timm's ``Attention`` and the suite's :class:`~vision_attn.attention.MultiHeadAttention` —
anything with a ``fused_attn`` flag and an ``attn_drop`` sub-module), turns the fused path off
only inside the ``with`` block, hooks ``attn_drop`` (whose input is the softmax output) and
restores every flag and removes every hook on exit, even after an exception.

    with capture_attention(encoder) as attn:
        encoder(images)
    attn[0]  # first block: [B, heads, T, T] (T includes the prefix tokens)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

__all__ = ["AttentionCaptureError", "attention_modules", "capture_attention", "extract_attention"]

log = logging.getLogger(__name__)


class AttentionCaptureError(RuntimeError):
    """Raised when a capture recorded nothing (no attention module ran, or none was found)."""


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module that :func:`capture_attention` can record."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "fused_attn") and isinstance(getattr(module, "attn_drop", None), nn.Module):
            found.append((name, module))
    return found


@contextmanager
def capture_attention(
    model: nn.Module,
    keep_grad: bool = False,
    names: list[str] | None = None,
) -> Iterator[list[Tensor]]:
    """Context manager that records each attention module's probabilities, in execution order.

    Args:
        model: any module containing attention modules (a :class:`~vision_attn.ViTEncoder`, a
            bare timm ViT, a whole task).
        keep_grad: keep the recorded tensors in the autograd graph and retain their gradients,
            so that after ``loss.backward()`` each ``attn[i].grad`` holds d loss / d attention
            (for gradient-weighted explanations). Otherwise the tensors are detached.
        names: restrict the capture to modules whose qualified name starts with one of these
            prefixes (e.g. ``["model.blocks"]``).

    Yields:
        A list filled during the forward pass with one ``[B, heads, Tq, Tk]`` tensor per
        attention call (for a ViT: one per block, first block first). Probabilities are taken
        before attention dropout, so every row sums to 1.

    Raises:
        AttentionCaptureError: the model has no capturable attention module, or none ran
            inside the block.
    """
    modules = attention_modules(model)
    if names is not None:
        modules = [(n, m) for n, m in modules if any(n.startswith(p) for p in names)]
    if not modules:
        raise AttentionCaptureError(
            f"{type(model).__name__} has no attention module that can be captured (looked for "
            "modules with a `fused_attn` flag and an `attn_drop` sub-module, as in timm's ViT "
            "Attention and vision_attn.MultiHeadAttention)."
        )
    records: list[Tensor] = []

    def hook(_module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        probs = inputs[0]
        if keep_grad and probs.requires_grad:
            probs.retain_grad()
            records.append(probs)
        else:
            records.append(probs.detach())

    saved_flags = [(m, m.fused_attn) for _, m in modules]
    handles = []
    try:
        for _, m in modules:
            m.fused_attn = False
            handles.append(m.attn_drop.register_forward_pre_hook(hook))
        yield records
    except BaseException:
        raise
    else:
        if not records:
            raise AttentionCaptureError(
                f"capture_attention recorded nothing: none of the {len(modules)} attention modules "
                "of the model ran inside the `with` block. Call the model inside it."
            )
    finally:
        for handle in handles:
            handle.remove()
        for m, flag in saved_flags:
            m.fused_attn = flag


class _LastAttentionDone(Exception):
    """Raised inside the forward pass once the last attention map is recorded."""


def extract_attention(model: nn.Module, *inputs, names: list[str] | None = None) -> list[Tensor]:
    """Attention maps of every block for ``model(*inputs)``, without finishing the forward pass.

    The pass stops right after the last attention module's softmax — the model's output is
    not computed (what timm's ``AttentionExtract`` returns, at the same cost). For maps *and*
    outputs use :func:`capture_attention`. Runs without gradients.

    Returns:
        One ``[B, heads, Tq, Tk]`` tensor per attention call, first block first.
    """
    import torch

    modules = attention_modules(model)
    if names is not None:
        modules = [(n, m) for n, m in modules if any(n.startswith(p) for p in names)]
    if not modules:
        raise AttentionCaptureError(f"{type(model).__name__} has no attention module that can be captured")

    def stop(_module: nn.Module, _inputs, _output) -> None:
        raise _LastAttentionDone

    with torch.no_grad(), capture_attention(model, names=names) as attn:
        handle = modules[-1][1].attn_drop.register_forward_hook(stop)
        try:
            model(*inputs)
        except _LastAttentionDone:
            pass
        finally:
            handle.remove()
    return list(attn)
