"""The AttnLRP rule of each layer kind, as the forward hooks :func:`~vision_attn.explain.lrp.lrp_rules`
installs (the rules themselves: :mod:`vision_attn.explain.lrp`).

- the attention classes the rules cover, by where Q, K and V leave a module (timm's and the
  suite's), and :func:`_attention_hooks`, which halves the gradient of each factor of Q Kᵀ and A V
  there and records the attention weights;
- the gradient surgery: an output replaced by a tensor of the same value whose gradient follows
  the rule (:func:`_with_gradient_of`, :class:`_ScaleGradient`);
- :func:`_layer_hooks`: the identity rule of norms and activations, the uniform rule of gated
  MLPs, the relative position biases shared by blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vision_attn.attention import MultiHeadAttention

__all__ = ["LRPTrace"]


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


# ---------------------------------------------------------------------------- what the rules record
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



# ---------------------------------------------------------------------------- the hooks
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
