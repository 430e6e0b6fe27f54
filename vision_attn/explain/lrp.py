"""Conservative relevance for ViT classifiers: AttnLRP (Achtibat et al. 2024) in one backward pass.

Layer-wise relevance propagation hands the explained logit back through the network, layer by
layer, so that what a layer receives it passes on (minus what biases keep). AttnLRP gives the
rules for a transformer's operations; each rule is what ``gradient x input`` computes once the
operation's backward is modified, so one autograd pass yields the relevance of every pixel
(Ali et al. 2022 show the same "gradient x input with rules" view):

- **LayerNorm / GroupNorm / RMSNorm** — identity rule: the normalising standard deviation is
  treated as a constant (its gradient stopped), which makes the norm linear in its input.
- **GELU, SiLU, tanh and other elementwise activations with** ``f(0) = 0`` — identity rule: the
  relevance passes through unchanged, ``R_in = R_out``; its gradient is ``f(x) / x``.
- **Softmax** — AttnLRP's rule ``R_in = x * (R_out - s * sum(R_out))`` (a first-order Taylor
  expansion at the input). This is *exactly* the ordinary gradient times the input, so the
  softmax keeps its ordinary backward; the part of the relevance it does not pass on is the
  expansion's bias term (:func:`relevance_budget` measures it).
- **The bilinear products** ``Q Kᵀ`` and ``A V`` — uniform rule: each factor receives half of
  the product's relevance, i.e. half the gradient. The gradient is halved where the factors
  are made: at the query / key / value projections' outputs and at the attention weights
  (where :func:`~vision_attn.explain.capture.capture_attention` records them). With timm's
  ``qk_norm`` (norms ``q_norm`` / ``k_norm`` on each head's query and key) the factors of
  ``Q Kᵀ`` are the norms' outputs: the gradient is halved there (the norms' biases keep their
  share of the halved relevance), and at the ``qkv`` projection only the value third is halved.
- **Sequence pooling** (CCT's ``sum_i w_i x_i`` with ``w = softmax(Linear(x))``) — a one-query
  attention: its softmax keeps its ordinary backward (recorded for the ledger) and the product
  ``w x`` gets the uniform rule, half the gradient to the weights and half to the tokens.
- **Linear layers, convolutions, residual sums, pooling** — epsilon rule with epsilon -> 0,
  i.e. the plain gradient times the input; biases (and position embeddings, class / register
  tokens, which the network adds in) keep their share.

The rules are installed by :func:`lrp_rules` as forward hooks that replace each output by a
tensor with the *same value* whose gradient follows the rule (``value.detach() + proxy -
proxy.detach()``), so the logits are bit-for-bit those of the untouched model. Every hook is
removed and every ``fused_attn`` flag restored on exit, even after an exception; no weight is
ever changed.

    result = lrp_relevance(task, images)     # task: encoder + head, e.g. ClassificationTask
    result.pixels   # [B, 3, H, W] signed relevance of every input value
    result.maps     # [B, h, w] summed over each patch's pixels (the ``lrp`` method's map)

The patches are the encoder's: ``patch_size`` pixels a side on the grid the encoder reports;
with timm's ``dynamic_img_pad`` the last row / column of patches overhangs the image (the
padding holds no relevance).

**Conservation.** With the rules on, the input relevance plus what the biases, the additive
embeddings and the softmaxes kept sums to the explained logit (to rounding):
:func:`relevance_budget` returns the ledger. Without the rules (``rules=False``) the result is
the plain gradient x input.

**Where the rule reaches Q, K and V** depends on the attention class. Where they leave
projection modules (timm's ViT ``Attention``, ``RelPosAttention``, Cait's ``ClassAttn`` and
talking heads, the suite's MultiHeadAttention) they are halved there and ``A`` at
``attn_drop``. ``EvaAttention`` and ``AttentionRope`` (a fused projection applied with
``F.linear``, rotary embeddings after it) halve Q and K as they leave ``q_norm`` / ``k_norm``
(identities without QK-norm) and ``A V`` at the output projection's input. Beit's attention
exposes neither: ``A V`` is halved at the output projection's input and Q Kᵀ's half is taken
above the softmax (the gradient through it is linear), with its relative position bias's
gradient doubled back at its source so the bias keeps its whole share. Rotations, position
biases and talking heads' head mixing are linear: epsilon rule. **Gated MLPs** (SwiGLU,
GLU: ``act(a) * b``) get the uniform rule, half to each factor.

Supported: timm's ViT ``Attention`` (VisionTransformer, NaFlexVit; DeiT, registers, QK-norm),
``RelPosAttention``, ``EvaAttention``, ``AttentionRope``, Beit's and Cait's attention modules
(:func:`lrp_unsupported` says why a model is not covered), and the suite's
:class:`~vision_attn.attention.MultiHeadAttention` without a key / value cache or additive float
mask. Other attention modules (attention pooling) and gated attention raise
:class:`~vision_attn.errors.ConfigError`. Run the model in ``eval()`` mode: dropout is not a rule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.attention import MultiHeadAttention, explicit_attention
from vision_attn.errors import ConfigError
from vision_attn.explain.lrp_layers import (
    _NORM_QK_ATTENTION,
    _OTHER_ATTENTION,
    _PREFIX_PARAMETERS,
    _REL_POS_BIASES,
    _SCORE_ATTENTION,
    _TIMM_ATTENTION,
    LRPTrace,
    _attention_hooks,
    _half,
    _layer_hooks,
    _qk_norms,
    _scaled,
    _score_bias_recorded,
    _weights_hook,
)
from vision_attn.models.smalldata import SequencePooling

__all__ = ["LRPResult", "LRPTrace", "lrp_relevance", "lrp_rules", "lrp_unsupported", "relevance_budget",
           "relevance_ledger"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the rules
def _modules(task) -> list[nn.Module]:
    """Every module of ``task`` (an ``nn.Module``, or an object with ``encoder`` and ``head``)."""
    roots = [task] if isinstance(task, nn.Module) else [getattr(task, "encoder", None), getattr(task, "head", None)]
    seen: dict[int, nn.Module] = {}
    for root in roots:
        if isinstance(root, nn.Module):
            for m in root.modules():
                seen.setdefault(id(m), m)
    if not seen:
        raise ConfigError(f"lrp needs a torch module (or an object with encoder / head modules), got {type(task)}")
    return list(seen.values())


_ATTENTION_KINDS = ("timm's ViT Attention, EvaAttention, AttentionRope, Beit's Attention, RelPosAttention, Cait's "
                    "ClassAttn and TalkingHeadAttn, and vision_attn.MultiHeadAttention")


def lrp_unsupported(task) -> str | None:
    """Why the AttnLRP rules of :func:`lrp_rules` do not cover ``task`` (a module, or an object with
    ``encoder`` and ``head`` modules), or ``None`` when they cover every module it has."""
    return _unsupported(_modules(task))


def _unsupported(modules: list[nn.Module]) -> str | None:
    for m in modules:
        kind = type(m).__name__
        known = isinstance(m, (*_TIMM_ATTENTION, *_OTHER_ATTENTION, MultiHeadAttention))
        if hasattr(m, "fused_attn") and not known:
            return (f"it has no rule for the attention module {kind} (attention pooling, ...); it reads "
                    f"{_ATTENTION_KINDS}")
        if known and getattr(m, "gate", None) is not None:
            return f"it has no rule for gated attention ({kind} with gated=True)"
        if isinstance(m, _NORM_QK_ATTENTION + _SCORE_ATTENTION) and not isinstance(getattr(m, "proj", None), nn.Module):
            return f"the attention module {kind} has no output projection `proj` where its rule applies"
    return None


def _check_supported(modules: list[nn.Module]) -> None:
    reason = _unsupported(modules)
    if reason is not None:
        raise ConfigError(f"method 'lrp' does not apply to this model: {reason}; use another method (relevance, "
                          "rollout, gradcam)")


@contextmanager
def lrp_rules(task, rules: bool = True, trace: bool = False) -> Iterator[LRPTrace]:
    """Context manager installing the AttnLRP rules on every module of ``task`` (see the module
    docstring); afterwards ``gradient x input`` of any output is its LRP relevance.

    The forward values are unchanged. Attention runs on its explicit path (``fused_attn``
    off) inside the block. Every hook is removed and every flag restored on exit, also when
    the block raises.

    Args:
        task: the model (an ``nn.Module``, or an object with ``encoder`` and ``head`` modules).
        rules: ``False`` installs nothing but the tracing: plain gradient x input.
        trace: record the softmax probabilities (see :class:`LRPTrace`).

    Yields:
        An :class:`LRPTrace`, filled during the forward pass when ``trace`` is set.

    Raises:
        ConfigError: a module without an LRP rule here (attention pooling, gated attention).
    """
    modules = _modules(task)
    _check_supported(modules)
    record = LRPTrace()
    handles = []
    attention = [m for m in modules if isinstance(m, (*_TIMM_ATTENTION, *_OTHER_ATTENTION, MultiHeadAttention))]
    attention_ids = {id(m) for m in attention}
    with explicit_attention(m for m in attention if hasattr(m, "fused_attn")):
        try:
            for m in modules:
                if id(m) in attention_ids:
                    handles.extend(_attention_hooks(m, record, rules, trace))
                elif isinstance(m, SequencePooling) and (trace or rules):  # w of w x: recorded, halved
                    handles.append(m.weights_point.register_forward_pre_hook(_weights_hook(record, trace, rules, True)))
                    if rules:  # x of w x: half
                        handles.append(m.values_point.register_forward_hook(_scaled(_half)))
                elif rules:
                    handles.extend(_layer_hooks(m))
                if trace and isinstance(m, _REL_POS_BIASES):
                    handles.extend(_score_bias_recorded(m, record))
            if rules:  # Q, K of Q Kᵀ after a q / k norm: half, applied after the norm's own rule
                for m in attention:
                    handles.extend(norm.register_forward_hook(_scaled(_half)) for norm in _qk_norms(m))
            yield record
        finally:
            for handle in reversed(handles):
                handle.remove()


# ---------------------------------------------------------------------------- relevance
@dataclass
class LRPResult:
    """Relevance of one batch.

    Attributes:
        pixels: ``[B, 3, H, W]`` signed relevance of every input value (the model's normalised
            input).
        maps: ``[B, h, w]`` the pixels' relevance summed over the channels and over each
            patch's pixels (signed; the ``lrp`` method shows its positive part).
        logits: ``[B, C]`` (detached).
        target: ``[B]`` the classes explained.
    """

    pixels: Tensor
    maps: Tensor
    logits: Tensor
    target: Tensor


def _patch_size(encoder: nn.Module) -> tuple[int, int] | None:
    """The encoder's patch ``(height, width)`` in pixels, when it says (a ViTEncoder or a timm ViT)."""
    size = getattr(encoder, "patch_size", None)
    if size is None:
        size = getattr(getattr(getattr(encoder, "model", encoder), "patch_embed", None), "patch_size", None)
    if isinstance(size, int):
        return size, size
    return (int(size[0]), int(size[1])) if isinstance(size, (tuple, list)) and len(size) == 2 else None


def _patch_sums(pixels: Tensor, grid: tuple[int, int], patch: tuple[int, int] | None = None) -> Tensor:
    """``[B, H, W]`` -> ``[B, h, w]`` sums over each patch's pixels.

    ``patch``: the patch ``(height, width)``; the cells are ``patch`` pixels a side from the top
    left, the last row / column zero-padded where it overhangs the image (timm's
    ``dynamic_img_pad``); pixels right of / below the grid (which a patch embedding without
    padding never reads) are left out. ``None``: the image divided evenly into the grid's cells.
    """
    b, height, width = pixels.shape
    h, w = grid
    ph, pw = patch if patch is not None else (math.ceil(height / h), math.ceil(width / w))
    pixels = F.pad(pixels, (0, w * pw - width, 0, h * ph - height))  # (B, h * ph, w * pw): padded or cut
    return pixels.reshape(b, h, ph, w, pw).sum(dim=(2, 4))  # (B, h, w)


def _forward(task, images: Tensor, target: Tensor | None, rules: bool, trace: bool):
    if not (isinstance(getattr(task, "encoder", None), nn.Module) and callable(getattr(task, "head", None))):
        raise ConfigError(f"lrp explains a classifier with `encoder` and `head` modules (a ClassificationTask); "
                          f"got {type(task).__name__}")
    x = images.detach().clone().requires_grad_(True)
    with lrp_rules(task, rules=rules, trace=trace) as record:
        out = task.encoder(x)
        logits = task.head(out)
    if target is None:
        target = logits.detach().argmax(dim=1)
    target = target.to(logits.device).long().clone()  # a normal tensor, also from inference mode
    score = logits.gather(1, target.view(-1, 1)).sum()
    return x, out, logits, target, score, record


def lrp_relevance(task, images: Tensor, target: Tensor | None = None, rules: bool = True) -> LRPResult:
    """AttnLRP relevance of the input for the target logits, one forward and one backward pass.

    Args:
        task: a classifier with ``encoder`` (a :class:`~vision_attn.ViTEncoder`: returns
            tokens and their ``grid``) and ``head`` (encoder output -> ``[B, C]`` logits).
        images: ``[B, 3, H, W]`` model inputs.
        target: ``[B]`` classes explained (default: the predicted ones).
        rules: ``False`` gives the plain gradient x input (the check of the rules).

    Returns:
        An :class:`LRPResult`. Works under a caller's ``no_grad`` / ``inference_mode``.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x, out, logits, target, score, _ = _forward(task, images, target, rules, trace=False)
        (grad,) = torch.autograd.grad(score, x)
    pixels = (x * grad).detach()
    maps = _patch_sums(pixels.sum(dim=1), out.grid, _patch_size(task.encoder))
    return LRPResult(pixels=pixels, maps=maps, logits=logits.detach(), target=target)


def _softmax_share(probs: Tensor, grad: Tensor) -> Tensor:
    """Relevance a softmax keeps: ``sum(s * g)`` reaches its output, ``sum(x * dx)`` its input.

    The input ``x`` equals ``log(s)`` up to a constant per row, and the input gradient
    ``dx = s * (g - sum(s * g))`` sums to zero per row, so ``log(s)`` stands in for ``x``.
    """
    s, g = probs.double(), grad.double()
    dx = s * (g - (s * g).sum(dim=-1, keepdim=True))
    log_s = torch.where(s > 0, s.clamp(min=torch.finfo(s.dtype).tiny).log(), torch.zeros_like(s))
    return (s * g).sum() - (log_s * dx).sum()


def _is_bias(name: str) -> bool:
    """Whether a parameter of this name is added in (a layer's ``bias``, Eva's and Beit's
    ``q_bias`` / ``v_bias``, a relative position bias table)."""
    return name == "bias" or name.endswith("_bias") or name == "relative_position_bias_table"


def relevance_budget(task, images: Tensor, target: Tensor | None = None) -> dict[str, float]:
    """Where the explained logits' relevance went, summed over the batch (the conservation check).

    Returns:
        ``{"score", "pixels", "biases", "embeddings", "softmax", "total"}``: the explained
        logits' sum; the input relevance; what the biases of the linear, convolution and norm
        layers, the attention's ``q_bias`` / ``v_bias`` and the relative position biases on the
        attention scores kept (``b * d score / d b``); what the position embeddings and class /
        distillation / register tokens kept; what the softmaxes kept (the bias term of their
        Taylor expansion); and ``pixels + biases + embeddings + softmax``, which equals
        ``score`` up to rounding when the rules conserve relevance.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x, _, _, _, score, record = _forward(task, images, target, rules=True, trace=True)
        return relevance_ledger(task, x, score, record)


def relevance_ledger(task, x: Tensor, score: Tensor, record: LRPTrace,
                     sources: dict[str, list[Tensor]] | None = None) -> dict[str, float]:
    """The ledger of :func:`relevance_budget` for a ``score`` computed from the input ``x`` (a
    leaf) inside :func:`lrp_rules` with ``trace=True`` (which filled ``record``).

    ``sources``: further leaves the score was computed from, by name (a decoder's query contents
    and position embeddings); each adds ``{name: sum(leaf * d score / d leaf)}`` to the ledger
    and to its ``total``.
    """
    sources = sources or {}
    model_params = {}
    for m in _modules(task):
        for name, p in m.named_parameters(recurse=False):
            if p.requires_grad and (_is_bias(name) or name in _PREFIX_PARAMETERS):
                model_params[id(p)] = (name, p)
    names = [n for n, _ in model_params.values()]
    params = [p for _, p in model_params.values()]
    extra = [(name, t) for name, leaves in sources.items() for t in leaves]
    leaves = [x, *params, *record.probabilities, *record.score_biases, *(t for _, t in extra)]
    grads = torch.autograd.grad(score, leaves, allow_unused=True)
    first_prob = 1 + len(params)
    first_bias = first_prob + len(record.probabilities)
    first_extra = first_bias + len(record.score_biases)
    grad_x, grad_params = grads[0], grads[1:first_prob]
    grad_probs, grad_score_biases = grads[first_prob:first_bias], grads[first_bias:first_extra]
    score_biases = sum(float((b.detach().double() * g.double()).sum())
                       for b, g in zip(record.score_biases, grad_score_biases, strict=True) if g is not None)

    def kept(keep) -> float:
        return float(sum((p.detach().double() * g.double()).sum()
                         for n, p, g in zip(names, params, grad_params, strict=True) if g is not None and keep(n)))

    softmax = sum((_softmax_share(s, g) for s, g in zip(record.probabilities, grad_probs, strict=True)
                   if g is not None), torch.zeros((), dtype=torch.float64))
    budget = {
        "score": float(score.detach()),
        "pixels": float((x.detach().double() * grad_x.double()).sum()),
        "biases": kept(_is_bias) + score_biases,
        "embeddings": kept(lambda n: n in _PREFIX_PARAMETERS),
        "softmax": float(softmax.detach()),
    }
    for name in sources:
        budget[name] = 0.0
    for (name, t), g in zip(extra, grads[first_extra:], strict=True):
        if g is not None:
            budget[name] += float((t.detach().double() * g.double()).sum())
    budget["total"] = sum(v for k, v in budget.items() if k != "score")
    return budget
