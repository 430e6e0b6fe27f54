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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.attention import MultiHeadAttention, explicit_attention
from vision_attn.errors import ConfigError
from vision_attn.models.smalldata import SequencePooling

__all__ = ["LRPResult", "LRPTrace", "lrp_relevance", "lrp_rules", "lrp_unsupported", "relevance_budget"]

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


def _timm_class(module: str, name: str) -> type | None:
    """``module.name`` when this timm has that class, else ``None``."""
    import importlib

    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:  # a timm without that model family
        return None
    return cls if isinstance(cls, type) else None


def _classes(*found: type | None) -> tuple[type, ...]:
    return tuple(dict.fromkeys(c for c in found if c is not None))


_TIMM_ATTENTION = _timm_attention_types()
# Where the rule reaches the factors of Q Kᵀ and A V, by attention class:
# - Q, K, V are outputs of projection modules (qkv, or q / k / v): halved there, A at attn_drop;
_QKV_ATTENTION = _classes(_timm_class("timm.models.vision_transformer_relpos", "RelPosAttention"),
                          _timm_class("timm.models.cait", "TalkingHeadAttn"))
_SPLIT_QKV_ATTENTION = _classes(_timm_class("timm.models.cait", "ClassAttn"))
# - Q, K leave q_norm / k_norm (run even as identities), V does not leave a module (a fused qkv
#   applied with F.linear and separate biases): Q, K halved at the norms, A V at proj's input;
_NORM_QK_ATTENTION = _classes(_timm_class("timm.models.eva", "EvaAttention"),
                              _timm_class("timm.layers", "AttentionRope"))
# - no factor leaves a module (Beit's F.linear qkv): A V halved at proj's input, Q Kᵀ through
#   the softmax (the weights' gradient halved once more above them), and the relative position
#   bias added to the scores has its gradient doubled back at its source.
_SCORE_ATTENTION = _classes(_timm_class("timm.models.beit", "Attention"))
_SCORE_BIAS_MODULES = _classes(_timm_class("timm.models.beit", "RelativePositionBias"))
_REL_POS_BIASES = _timm_types("RelPosMlp", "RelPosBias", "RelPosBiasTf")  # get_bias(): added to the scores
_TALKING_HEADS = _classes(_timm_class("timm.models.cait", "TalkingHeadAttn"))
_OTHER_ATTENTION = _QKV_ATTENTION + _SPLIT_QKV_ATTENTION + _NORM_QK_ATTENTION + _SCORE_ATTENTION
_ACTIVATIONS = _activation_types()
_RMS_NORMS = _timm_types("RmsNorm") + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_PACKED_GLU = _timm_types("GluMlp")  # fc1 -> (a, b) -> act(a) * b (or a * act(b))
_SPLIT_GLU = _timm_types("SwiGLU")  # act(fc1_g(x)) * fc1_x(x)
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
        score_biases: the relative position biases that timm's ``RelPosMlp`` / ``RelPosBias``
            modules add to the attention scores, each a leaf of the graph (what they keep is
            their share in :func:`relevance_budget`; nothing flows into the modules computing
            them, which the input does not reach).
    """

    probabilities: list[Tensor] = field(default_factory=list)
    score_biases: list[Tensor] = field(default_factory=list)


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


def _qk_norms(attention: nn.Module) -> tuple[nn.Module, ...]:
    """``(q_norm, k_norm)`` of an attention module whose Q and K leave them (``nn.Identity`` without
    ``qk_norm``; timm's ViT Attention, EvaAttention, AttentionRope), else ``()``."""
    if not isinstance(attention, _TIMM_ATTENTION + _NORM_QK_ATTENTION):
        return ()
    norms = (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None))
    return norms if all(isinstance(n, nn.Module) for n in norms) else ()


def _half(t: Tensor) -> Tensor:
    return torch.tensor(0.5, dtype=t.dtype, device=t.device)


def _twice(t: Tensor) -> Tensor:
    return torch.tensor(2.0, dtype=t.dtype, device=t.device)


def _value_third_half(out: Tensor) -> Tensor:
    """Gradient scale of timm's qkv output ``[..., 3 * dim]`` (``q | k | v``): half on ``v`` only."""
    scale = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
    scale[2 * out.shape[-1] // 3 :] = 0.5
    return scale


def _scaled(scale_fn):
    """Forward hook: the output, its gradient multiplied by ``scale_fn(output)``."""
    def hook(_module: nn.Module, _inputs: tuple, output: Tensor) -> Tensor:
        return _ScaleGradient.apply(output, scale_fn(output))

    return hook


def _input_halved(_module: nn.Module, inputs: tuple) -> tuple:
    """Forward pre-hook: the first input, its gradient halved."""
    return (_ScaleGradient.apply(inputs[0], _half(inputs[0])), *inputs[1:])


def _replace(proxy_fn):
    """Forward hook: the output, with the gradient of ``proxy_fn(module, input)``."""
    def hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        return _with_gradient_of(output, proxy_fn(module, inputs[0]))

    return hook


def _activation(_module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    return _with_gradient_of(output, _identity_rule_proxy(inputs[0], output))


def _weights_hook(record: LRPTrace, trace: bool, rules: bool, own: bool, above: bool = False,
                  heads_last: bool = False):
    """Forward pre-hook at the attention weights ``A`` (the softmax output). ``own``: halve the
    gradient that reaches ``A`` from ``A V`` (the product's other factor is halved elsewhere);
    ``above``: halve it once more *above* the recorded tensor (Q Kᵀ's rule, reaching Q and K
    through the softmax). ``heads_last``: the weights arrive ``[B, Tq, Tk, heads]`` (talking heads'
    ``proj_w`` input); they are recorded ``[B, heads, Tq, Tk]``."""
    def hook(_module: nn.Module, inputs: tuple) -> tuple | None:
        a = inputs[0]
        if rules and above:
            a = _ScaleGradient.apply(a, _half(a))
        if heads_last:
            a = a.permute(0, 3, 1, 2)  # (B, heads, Tq, Tk)
        if trace:
            record.probabilities.append(a)
        if rules and own:
            a = _ScaleGradient.apply(a, _half(a))
        if heads_last:
            a = a.permute(0, 2, 3, 1)  # (B, Tq, Tk, heads): as proj_w reads it
        return (a, *inputs[1:]) if (rules and (own or above)) or heads_last else None

    return hook


def _attention_hooks(m: nn.Module, record: LRPTrace, rules: bool, trace: bool) -> list:
    """The hooks of one attention module: its weights recorded (``trace``) and the uniform rule of
    Q Kᵀ and A V (``rules``), placed where the module's class lets them act (see the class sets
    above)."""
    handles = []
    weights = m.attn_drop
    if isinstance(m, _TALKING_HEADS):  # the softmax output enters proj_w (heads mixed); A V reads its output
        handles.append(m.proj_w.register_forward_pre_hook(_weights_hook(record, trace, rules, False, heads_last=True)))
        if rules:
            handles.append(m.attn_drop.register_forward_pre_hook(_input_halved))
        weights = None
    elif isinstance(m, _NORM_QK_ATTENTION + _SCORE_ATTENTION):
        above = isinstance(m, _SCORE_ATTENTION)
        handles.append(m.attn_drop.register_forward_pre_hook(_weights_hook(record, trace, rules, False, above)))
        weights = None
    if weights is not None and (trace or rules):
        handles.append(weights.register_forward_pre_hook(_weights_hook(record, trace, rules, True)))
    if not rules:
        return handles
    if isinstance(m, _NORM_QK_ATTENTION + _SCORE_ATTENTION):  # A V at the output projection's input
        handles.append(m.proj.register_forward_pre_hook(_input_halved))
        if isinstance(m, _SCORE_ATTENTION):
            handles.extend(_score_bias_doubled(m))
        return handles  # Eva's, AttentionRope's Q and K: halved as they leave their norms (lrp_rules)
    if _qk_norms(m):  # V (of A V) at qkv; Q, K at their norms (lrp_rules)
        handles.append(m.qkv.register_forward_hook(_scaled(_value_third_half)))
    else:  # Q, K (of Q Kᵀ) and V (of A V): half each
        if isinstance(m, MultiHeadAttention):
            projections = (m.q_proj, m.k_proj, m.v_proj)
        elif isinstance(m, _SPLIT_QKV_ATTENTION):
            projections = (m.q, m.k, m.v)
        else:
            projections = (m.qkv,)
        handles.extend(proj.register_forward_hook(_scaled(_half)) for proj in projections)
    return handles


class _InstanceOverride:
    """A removable handle restoring a method overridden on one instance."""

    def __init__(self, owner: nn.Module, name: str) -> None:
        self.owner, self.name = owner, name

    def remove(self) -> None:
        self.owner.__dict__.pop(self.name, None)


def _score_bias_doubled(m: nn.Module) -> list:
    """Beit's own relative position bias, with its gradient doubled: Q Kᵀ's half is taken above the
    softmax, where it would halve the bias's share too."""
    if getattr(m, "relative_position_bias_table", None) is None:
        return []
    own = m._get_rel_pos_bias

    def doubled() -> Tensor:
        bias = own()
        return _ScaleGradient.apply(bias, _twice(bias))

    m.__dict__["_get_rel_pos_bias"] = doubled
    return [_InstanceOverride(m, "_get_rel_pos_bias")]


def _score_bias_recorded(m: nn.Module, record: LRPTrace) -> list:
    """A timm relative position bias module whose ``get_bias()`` returns a recorded leaf (the same
    values), so :func:`relevance_budget` finds what the bias keeps."""
    own = m.get_bias

    def recorded() -> Tensor:
        bias = own().detach().requires_grad_(True)
        record.score_biases.append(bias)
        return bias

    m.__dict__["get_bias"] = recorded
    return [_InstanceOverride(m, "get_bias")]


def _layer_hooks(m: nn.Module) -> list:
    """The rules of the layers that are not attention: norms (identity rule), activations
    (identity rule), gated MLPs (uniform rule on the product), score biases shared by blocks."""
    if isinstance(m, nn.LayerNorm) and type(m).__name__ != "LayerNorm2d":
        return [m.register_forward_hook(_replace(_layer_norm_proxy))]
    if isinstance(m, nn.GroupNorm):
        return [m.register_forward_hook(_replace(_group_norm_proxy))]
    if isinstance(m, _RMS_NORMS):
        return [m.register_forward_hook(_replace(_rms_norm_proxy))]
    if isinstance(m, _ACTIVATIONS) and not isinstance(m, nn.ReLU):  # ReLU's gradient already is the rule
        return [m.register_forward_hook(_activation)]
    if isinstance(m, _PACKED_GLU):  # both factors of act(a) * b come out of fc1: half each
        return [m.fc1.register_forward_hook(_scaled(_half))]
    if isinstance(m, _SPLIT_GLU):
        return [fc.register_forward_hook(_scaled(_half)) for fc in (m.fc1_g, m.fc1_x)]
    if isinstance(m, _SCORE_BIAS_MODULES):  # Beit's shared relative position bias (see _score_bias_doubled)
        return [m.register_forward_hook(_scaled(_twice))]
    return []


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
    model_params = {}
    for m in _modules(task):
        for name, p in m.named_parameters(recurse=False):
            if p.requires_grad and (_is_bias(name) or name in _PREFIX_PARAMETERS):
                model_params[id(p)] = (name, p)
    names = [n for n, _ in model_params.values()]
    params = [p for _, p in model_params.values()]
    with torch.inference_mode(False), torch.enable_grad():
        x, _, _, _, score, record = _forward(task, images, target, rules=True, trace=True)
        leaves = [x, *params, *record.probabilities, *record.score_biases]
        grads = torch.autograd.grad(score, leaves, allow_unused=True)
    first_prob = 1 + len(params)
    first_bias = first_prob + len(record.probabilities)
    grad_x, grad_params = grads[0], grads[1:first_prob]
    grad_probs, grad_score_biases = grads[first_prob:first_bias], grads[first_bias:]
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
    budget["total"] = budget["pixels"] + budget["biases"] + budget["embeddings"] + budget["softmax"]
    return budget
