"""Record attention probabilities while a model runs.

Fused attention kernels never materialise the ``T x T`` weights, so a naive forward hook on a
timm ViT records nothing. :func:`capture_attention` finds every attention module *by type*
(timm's ``Attention`` and the suite's :class:`~vision_attn.attention.MultiHeadAttention` —
anything with a ``fused_attn`` flag and an ``attn_drop`` sub-module), turns the fused path off
only inside the ``with`` block, hooks ``attn_drop`` (whose input is the softmax output) and
restores every flag and removes every hook on exit, even after an exception.

The timm attention classes it records (each checked against the attention recomputed from the
block's weights in ``tests/test_timm_families.py``): ``Attention`` (VisionTransformer,
NaFlexVit), ``RelPosAttention`` (relative position bias), ``EvaAttention`` and ``AttentionRope``
(rotary embeddings), Beit's ``Attention`` (relative position bias) and Cait's ``ClassAttn``
(class attention: ``[B, heads, 1, T]``, the class token's row). Cait's talking-heads
self-attention has no ``fused_attn`` flag and is not recorded: it mixes the heads after the
softmax, so what it applies to the values is no probability.

    with capture_attention(encoder) as attn:
        encoder(images)
    attn[0]  # first block: [B, heads, T, T] (T includes the prefix tokens)

Keeping every block's ``[B, heads, T, T]`` costs ``L * heads * T^2`` floats per image (0.5 GB for
a ViT-L/16 at 384 px). :func:`observe_attention` hands each map to a callback and keeps nothing;
:func:`streaming_rollout` and :func:`streaming_relevance` use it to compute rollout during the
forward (one running ``[B, T, T]`` product) and gradient relevance during the backward (one
``[B, T]`` row), equal to :func:`~vision_attn.explain.rollout.attention_rollout` /
:func:`~vision_attn.explain.rollout.gradient_relevance` on the stored capture. Both follow token
merges (:func:`vision_attn.merge_tokens`) as they happen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from vision_attn.attention import explicit_attention
from vision_attn.explain.rollout import HeadFusion, RelevanceStream, RolloutStream
from vision_attn.models.merging import merge_state

__all__ = [
    "AttentionCaptureError",
    "attention_modules",
    "capture_attention",
    "extract_attention",
    "observe_attention",
    "streaming_relevance",
    "streaming_rollout",
]

log = logging.getLogger(__name__)


class AttentionCaptureError(RuntimeError):
    """Raised when a capture recorded nothing (no attention module ran, or none was found)."""


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module that :func:`capture_attention` can record (a
    module with a ``fused_attn`` flag and an ``attn_drop`` sub-module), in module order.

    Args:
        model: any module (a timm ViT, a :class:`~vision_attn.ViTEncoder`, a task).
    """
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "fused_attn") and isinstance(getattr(module, "attn_drop", None), nn.Module):
            found.append((name, module))
    return found


def _selected(model: nn.Module, names: list[str] | None) -> list[tuple[str, nn.Module]]:
    modules = attention_modules(model)
    if names is not None:
        modules = [(n, m) for n, m in modules if any(n.startswith(p) for p in names)]
    if not modules:
        raise AttentionCaptureError(
            f"{type(model).__name__} has no attention module that can be captured (looked for "
            "modules with a `fused_attn` flag and an `attn_drop` sub-module, as in timm's ViT "
            "Attention and vision_attn.MultiHeadAttention)."
        )
    return modules


@contextmanager
def observe_attention(
    model: nn.Module,
    callback: Callable[[Tensor], None],
    names: list[str] | None = None,
) -> Iterator[list[tuple[str, nn.Module]]]:
    """Context manager calling ``callback(probs)`` with each attention module's probabilities
    ``[B, heads, Tq, Tk]`` (before attention dropout, still in the autograd graph), in execution
    order, and keeping none of them. Fused attention is off inside the block; every flag and
    hook is restored on exit, even after an exception. Yields the observed ``(name, module)``
    pairs.

    Args:
        model: any module containing attention modules.
        callback: called once per attention call, during the forward pass.
        names: restrict to modules whose qualified name starts with one of these prefixes.

    Raises:
        AttentionCaptureError: the model has no capturable attention module, or none ran
            inside the block.
    """
    modules = _selected(model, names)
    calls = [0]

    def hook(_module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        calls[0] += 1
        callback(inputs[0])

    handles = []
    with explicit_attention(m for _, m in modules):
        try:
            for _, m in modules:
                handles.append(m.attn_drop.register_forward_pre_hook(hook))
            yield modules
        finally:
            for handle in handles:
                handle.remove()
    if not calls[0]:
        raise AttentionCaptureError(
            f"the attention capture recorded nothing: none of the {len(modules)} attention modules "
            "of the model ran inside the `with` block. Call the model inside it."
        )


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
    records: list[Tensor] = []

    def record(probs: Tensor) -> None:
        if keep_grad and probs.requires_grad:
            probs.retain_grad()
            records.append(probs)
        else:
            records.append(probs.detach())

    with observe_attention(model, record, names):
        yield records


def _merge_events(model: nn.Module) -> Callable[[], list]:
    """A function returning the token maps recorded so far in the current forward of a
    token-merged model (``[]`` for any other model)."""
    state = merge_state(model)
    return (lambda: state.events) if state is not None else list


@contextmanager
def streaming_rollout(
    model: nn.Module,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    num_prefix_tokens: int | None = None,
    names: list[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Iterator[RolloutStream]:
    """Context manager computing attention rollout during one forward pass, block by block:
    only a running ``[B, T, T]`` product is kept, not the blocks' attention.

        with torch.no_grad(), streaming_rollout(encoder) as stream:
            out = encoder(images)
        maps = stream.maps(out.grid, out.num_prefix_tokens, token_index=0)  # [B, h, w]

    Equal to ``attention_rollout(attn, ...)`` on ``capture_attention``'s list (to float rounding).
    On a token-merged model (:func:`vision_attn.merge_tokens`) the merges are folded in as they
    happen, and the maps are over the original patch grid.

    Args:
        model: the encoder (or a module containing it); one forward pass inside the block.
        head_fusion, discard_ratio, start_layer: as in
            :func:`~vision_attn.explain.rollout.attention_rollout`.
        num_prefix_tokens: ``P`` for ``discard_ratio`` (default: the model's
            ``num_prefix_tokens``, else 1).
        names: restrict to attention modules under these name prefixes.
        dtype: of the running product (see :class:`~vision_attn.explain.rollout.RolloutStream`).

    Raises:
        AttentionCaptureError: no attention ran, or an attention module ran twice (a second
            forward pass: use one block per pass).
    """
    if num_prefix_tokens is None:
        num_prefix_tokens = _num_prefix_tokens(model)
    stream = RolloutStream(head_fusion, discard_ratio, start_layer, num_prefix_tokens, dtype)
    with _follow(model, stream, stream.update, names):
        yield stream


@contextmanager
def streaming_relevance(model: nn.Module, start_layer: int = 0,
                        names: list[str] | None = None) -> Iterator[RelevanceStream]:
    """Context manager preparing gradient relevance (Chefer et al. 2021) that is computed
    during the backward pass, one ``[B, T]`` row carried from the last block to the first; no
    block's gradient is kept. Run the forward with gradients enabled inside the block, then ask
    the stream for maps of a target score (it runs the backward)::

        with torch.enable_grad(), streaming_relevance(encoder) as rel:
            logits = head(encoder(images))
        maps = rel.maps(logits.gather(1, target[:, None]).sum(), grid, num_prefix_tokens, token_index)

    Equal to :func:`~vision_attn.explain.rollout.gradient_relevance` on
    ``capture_attention(keep_grad=True)`` (to float rounding); token merges are followed.

    Args:
        model: a timm ViT or a :class:`~vision_attn.ViTEncoder`.
        start_layer: the first block whose attention counts.
        names: follow only these attention modules (their qualified names); default: all.

    Yields:
        The :class:`RelevanceStream`, whose ``maps(...)`` runs the backward and returns the maps.
    """
    stream = RelevanceStream(start_layer)
    with _follow(model, stream, stream.record, names):
        yield stream


@contextmanager
def _follow(model: nn.Module, stream: RolloutStream | RelevanceStream, consume: Callable[[Tensor], None],
            names: list[str] | None) -> Iterator[None]:
    """Feeds ``stream`` what happens in ``model``'s forward, in order: each attention map
    (``consume(probs)``) and, before it, the token merges since the previous one
    (``stream.apply``); the merges after the last attention (and the expansion back to the
    grid) when the block ends. One forward pass per block."""
    events = _merge_events(model)
    applied, per_pass = [0], [0]

    def catch_up() -> None:
        pending = events()
        for token_map in pending[applied[0]:]:
            stream.apply(token_map)
        applied[0] = len(pending)

    def observe(probs: Tensor) -> None:
        _one_pass(stream.blocks, per_pass[0])
        catch_up()
        consume(probs)

    with observe_attention(model, observe, names) as modules:
        per_pass[0] = len(modules)
        yield
    catch_up()


def _num_prefix_tokens(model: nn.Module) -> int:
    for m in (model, getattr(model, "encoder", None), getattr(model, "model", None)):
        if m is not None and isinstance(getattr(m, "num_prefix_tokens", None), int):
            return m.num_prefix_tokens
    return 1


def _one_pass(seen: int, per_pass: int) -> None:
    """Raise when more attention calls arrive than one forward pass makes: a stream follows
    exactly one pass."""
    if seen >= per_pass:
        raise AttentionCaptureError(
            f"streaming rollout / relevance follows one forward pass ({per_pass} attention calls), and more "
            "attention ran inside the block: open one `with` block per forward pass"
        )


class _LastAttentionDone(Exception):
    """Raised inside the forward pass once the last attention map is recorded."""


def extract_attention(model: nn.Module, *inputs, names: list[str] | None = None) -> list[Tensor]:
    """Attention maps of every block for ``model(*inputs)``, without finishing the forward pass.

    The pass stops right after the last attention module's softmax — the model's output is
    not computed (what timm's ``AttentionExtract`` returns, at the same cost). For maps *and*
    outputs use :func:`capture_attention`. Runs without gradients.

    Args:
        model: a timm ViT, a :class:`~vision_attn.ViTEncoder` or any module with capturable
            attention (:func:`attention_modules`).
        *inputs: what ``model`` is called with (e.g. an image batch ``[B, 3, H, W]``).
        names: capture only these attention modules (their qualified names); default: all.

    Returns:
        One ``[B, heads, Tq, Tk]`` tensor per attention call, first block first.
    """

    modules = _selected(model, names)

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
