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

Supported: timm's ViT ``Attention`` (the suite's encoders; DeiT, distilled DeiT, register
models) and the suite's :class:`~vision_attn.attention.MultiHeadAttention` without a key /
value cache or additive float mask. Other attention modules (attention pooling, rotary or gated
attention) and gated MLPs raise :class:`~vision_attn.errors.ConfigError`. Run the model in
``eval()`` mode: dropout is not a rule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.attention import MultiHeadAttention, explicit_attention
from vision_attn.errors import ConfigError
from vision_attn.models.smalldata import SequencePooling

__all__ = ["LRPResult", "LRPTrace", "lrp_relevance", "lrp_rules", "relevance_budget"]

log = logging.getLogger(__name__)


def _timm_attention_types() -> tuple[type, ...]:
    """timm's ViT attention class(es) (moved from ``models.vision_transformer`` to ``layers``)."""
    found: list[type] = []
    try:
        from timm.layers import Attention as LayerAttention

        found.append(LayerAttention)
    except ImportError:  # older timm
        pass
    try:
        from timm.models.vision_transformer import Attention as VitAttention

        found.append(VitAttention)
    except ImportError:
        pass
    return tuple(dict.fromkeys(found))


def _timm_types(*names: str) -> tuple[type, ...]:
    """Classes of ``timm.layers`` by name (the ones this timm version has)."""
    import timm.layers

    return tuple(getattr(timm.layers, n) for n in names if isinstance(getattr(timm.layers, n, None), type))


def _activation_types() -> tuple[type, ...]:
    """Elementwise activations with ``f(0) = 0``: the identity rule conserves their relevance."""
    import timm.layers.activations as acts

    timm_acts = tuple(
        getattr(acts, n) for n in ("GELU", "GELUTanh", "QuickGELU", "Swish", "Mish", "Tanh") if hasattr(acts, n)
    )
    return (nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.ReLU, nn.LeakyReLU, *timm_acts)


_TIMM_ATTENTION = _timm_attention_types()
_ACTIVATIONS = _activation_types()
_RMS_NORMS = _timm_types("RmsNorm") + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_GATED_MLPS = _timm_types("GluMlp", "SwiGLU", "SwiGLUPacked")
_PREFIX_PARAMETERS = ("pos_embed", "cls_token", "dist_token", "reg_token")


# ---------------------------------------------------------------------------- gradient surgery
class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale`` (a number or a tensor
    broadcast over the last dimension)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        (scale,) = ctx.saved_tensors
        return grad * scale, None


def _with_gradient_of(value: Tensor, proxy: Tensor) -> Tensor:
    """``value`` exactly in the forward pass; the gradient of ``proxy`` in the backward pass.

    ``proxy - proxy.detach()`` is exactly zero, so the output is bit-for-bit ``value``.
    """
    return value.detach() + (proxy - proxy.detach())


def _layer_norm_proxy(m: nn.LayerNorm, x: Tensor) -> Tensor:
    dims = tuple(range(-len(m.normalized_shape), 0))
    mean = x.mean(dim=dims, keepdim=True)
    var = x.var(dim=dims, unbiased=False, keepdim=True)
    y = (x - mean) / torch.sqrt(var + m.eps).detach()
    if m.weight is not None:
        y = y * m.weight
    if m.bias is not None:
        y = y + m.bias
    return y


def _group_norm_proxy(m: nn.GroupNorm, x: Tensor) -> Tensor:
    b, c = x.shape[:2]
    groups = x.reshape(b, m.num_groups, -1)  # (B, G, C/G * spatial)
    mean = groups.mean(dim=-1, keepdim=True)
    var = groups.var(dim=-1, unbiased=False, keepdim=True)
    y = ((groups - mean) / torch.sqrt(var + m.eps).detach()).reshape(x.shape)  # (B, C, *spatial)
    affine_shape = (1, c) + (1,) * (x.dim() - 2)
    if m.weight is not None:
        y = y * m.weight.view(affine_shape)
    if m.bias is not None:
        y = y + m.bias.view(affine_shape)
    return y


def _rms_norm_proxy(m: nn.Module, x: Tensor) -> Tensor:
    shape = m.normalized_shape
    dims = tuple(range(-(len(shape) if isinstance(shape, (tuple, list)) else 1), 0))
    eps = m.eps if m.eps is not None else torch.finfo(x.dtype).eps
    y = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps).detach()
    weight = getattr(m, "weight", None)
    return y * weight if weight is not None else y


def _identity_rule_proxy(x: Tensor, y: Tensor) -> Tensor:
    """``x * (f(x) / x)`` with the ratio constant: gradient x input gives ``f(x) * grad``.
    At ``x = 0`` the ratio is taken as 0 (``f(0) = 0``, so nothing is lost)."""
    ratio = y / torch.where(x == 0, torch.ones_like(x), x)
    return x * ratio.detach()


# ---------------------------------------------------------------------------- the rules
@dataclass
class LRPTrace:
    """What :func:`lrp_rules` records when ``trace=True``.

    Attributes:
        probabilities: per attention call the softmax output ``[B, heads, Tq, Tk]``, kept in
            the autograd graph (for the softmax's share in :func:`relevance_budget`); a
            sequence-pooling head (``pooling="seq"``) adds its pooling weights ``[B, N]`` last.
    """

    probabilities: list[Tensor] = field(default_factory=list)


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


def _check_supported(modules: list[nn.Module]) -> None:
    for m in modules:
        kind = type(m).__name__
        if isinstance(m, _GATED_MLPS):
            raise ConfigError(f"method 'lrp' has no rule for the gated MLP {kind} (an elementwise product of two "
                              "branches); use another method (relevance, rollout, gradcam)")
        if hasattr(m, "fused_attn") and not isinstance(m, (*_TIMM_ATTENTION, MultiHeadAttention)):
            raise ConfigError(f"method 'lrp' supports timm's ViT Attention and vision_attn.MultiHeadAttention, not "
                              f"{kind} (attention pooling, rotary attention, ...); use another method (relevance, "
                              "rollout, gradcam)")
        if isinstance(m, _TIMM_ATTENTION) and getattr(m, "gate", None) is not None:
            raise ConfigError("method 'lrp' has no rule for gated attention (timm Attention with gated=True); use "
                              "another method")


def _qk_norms(attention: nn.Module) -> tuple[nn.Module, ...]:
    """``(q_norm, k_norm)`` of a timm attention module (``nn.Identity`` without ``qk_norm``), else ``()``."""
    if not isinstance(attention, _TIMM_ATTENTION):
        return ()
    norms = (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None))
    return norms if all(isinstance(n, nn.Module) for n in norms) else ()


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
        ConfigError: a module without an LRP rule here (gated MLP, other attention kinds).
    """
    modules = _modules(task)
    _check_supported(modules)
    record = LRPTrace()
    handles = []
    attention = [m for m in modules if isinstance(m, (*_TIMM_ATTENTION, MultiHeadAttention))]

    def replace(proxy_fn):
        def hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
            return _with_gradient_of(output, proxy_fn(module, inputs[0]))

        return hook

    def activation(_module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        return _with_gradient_of(output, _identity_rule_proxy(inputs[0], output))

    def scaled(scale_fn):
        def hook(_module: nn.Module, _inputs: tuple, output: Tensor) -> Tensor:
            return _ScaleGradient.apply(output, scale_fn(output))

        return hook

    def half(out: Tensor) -> Tensor:
        return torch.tensor(0.5, dtype=out.dtype, device=out.device)

    def value_third_half(out: Tensor) -> Tensor:  # timm's qkv output [..., 3 * dim]: q | k | v
        scale = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
        scale[2 * out.shape[-1] // 3 :] = 0.5
        return scale

    def weights(_module: nn.Module, inputs: tuple) -> tuple | None:
        # The softmax output A, before it meets V in A V: recorded, and halved when rules apply.
        if trace:
            record.probabilities.append(inputs[0])
        return (_ScaleGradient.apply(inputs[0], half(inputs[0])), *inputs[1:]) if rules else None

    with explicit_attention(attention):
        try:
            for m in modules:
                is_attention = isinstance(m, (*_TIMM_ATTENTION, MultiHeadAttention))
                if is_attention and (trace or rules):
                    handles.append(m.attn_drop.register_forward_pre_hook(weights))
                if isinstance(m, SequencePooling) and (trace or rules):  # w of w x: recorded, halved
                    handles.append(m.weights_point.register_forward_pre_hook(weights))
                if not rules:
                    continue
                if isinstance(m, SequencePooling):  # x of w x: half
                    handles.append(m.values_point.register_forward_hook(scaled(half)))
                elif is_attention and _qk_norms(m):  # V (of A V) at qkv; Q, K at their norms, below
                    handles.append(m.qkv.register_forward_hook(scaled(value_third_half)))
                elif is_attention:  # Q, K (of Q Kᵀ) and V (of A V): half each
                    projections = (m.qkv,) if isinstance(m, _TIMM_ATTENTION) else (m.q_proj, m.k_proj, m.v_proj)
                    handles.extend(proj.register_forward_hook(scaled(half)) for proj in projections)
                elif isinstance(m, nn.LayerNorm) and type(m).__name__ != "LayerNorm2d":
                    handles.append(m.register_forward_hook(replace(_layer_norm_proxy)))
                elif isinstance(m, nn.GroupNorm):
                    handles.append(m.register_forward_hook(replace(_group_norm_proxy)))
                elif isinstance(m, _RMS_NORMS):
                    handles.append(m.register_forward_hook(replace(_rms_norm_proxy)))
                elif isinstance(m, _ACTIVATIONS) and not isinstance(m, nn.ReLU):  # ReLU's gradient already is the rule
                    handles.append(m.register_forward_hook(activation))
            if rules:  # Q, K of Q Kᵀ after a q / k norm: half, applied after the norm's own rule
                for m in attention:
                    handles.extend(norm.register_forward_hook(scaled(half)) for norm in _qk_norms(m))
            yield record
        finally:
            for handle in handles:
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


def relevance_budget(task, images: Tensor, target: Tensor | None = None) -> dict[str, float]:
    """Where the explained logits' relevance went, summed over the batch (the conservation check).

    Returns:
        ``{"score", "pixels", "biases", "embeddings", "softmax", "total"}``: the explained
        logits' sum; the input relevance; what the biases of the linear, convolution and norm
        layers kept (``b * d score / d b``); what the position embeddings and class /
        distillation / register tokens kept; what the softmaxes kept (the bias term of their
        Taylor expansion); and ``pixels + biases + embeddings + softmax``, which equals
        ``score`` up to rounding when the rules conserve relevance.
    """
    model_params = {}
    for m in _modules(task):
        for name, p in m.named_parameters(recurse=False):
            if p.requires_grad and (name == "bias" or name in _PREFIX_PARAMETERS):
                model_params[id(p)] = (name, p)
    names = [n for n, _ in model_params.values()]
    params = [p for _, p in model_params.values()]
    with torch.inference_mode(False), torch.enable_grad():
        x, _, _, _, score, record = _forward(task, images, target, rules=True, trace=True)
        grads = torch.autograd.grad(score, [x, *params, *record.probabilities], allow_unused=True)
    grad_x, grad_params, grad_probs = grads[0], grads[1 : 1 + len(params)], grads[1 + len(params) :]

    def kept(keep) -> float:
        return float(sum((p.detach().double() * g.double()).sum() for n, p, g in zip(names, params, grad_params, strict=True)
                         if g is not None and keep(n)))

    softmax = sum((_softmax_share(s, g) for s, g in zip(record.probabilities, grad_probs, strict=True)
                   if g is not None), torch.zeros((), dtype=torch.float64))
    budget = {
        "score": float(score.detach()),
        "pixels": float((x.detach().double() * grad_x.double()).sum()),
        "biases": kept(lambda n: n == "bias"),
        "embeddings": kept(lambda n: n in _PREFIX_PARAMETERS),
        "softmax": float(softmax.detach()),
    }
    budget["total"] = budget["pixels"] + budget["biases"] + budget["embeddings"] + budget["softmax"]
    return budget
