"""Explaining a classifier's decisions: one call, every method of one registry, batched.

    maps = explain_classifier(task, images, methods=("rollout", "relevance"))
    maps.maps["rollout"]   # [B, h, w] in [0, 1]

**The registry.** :data:`METHODS` maps a method's name to a :class:`MethodSpec`: the function
that turns a :class:`MethodInputs` into ``[B, h, w]`` maps over the patch grid, and what it
needs from the forward pass (captured attention, the last block's output, their gradients).
Adding a method is one function and one :func:`register_method` decorator; the options of
``eval.py`` / ``predict``, their validation and the report read the registry::

    @register_method("my_method", needs=("block_output",))
    def my_method(inputs: MethodInputs) -> Tensor:
        return inputs.block_output[:, inputs.num_prefix_tokens:].abs().sum(-1).view(-1, *inputs.grid)

Built in: ``rollout`` (Abnar & Zuidema 2020), ``relevance`` (Chefer et al. 2021),
``attention`` (raw last layer), ``gradcam`` (Grad-CAM on the patch tokens the last block
reads),
``random`` (the baseline) and ``tokens`` (a diagnostic: the norm of each patch token at the last
block's output, which shows the high-norm artifact tokens that register tokens remove, Darcet
et al. 2023; it explains no class, so it gets no faithfulness numbers).

**Which row.** The maps explain what the classifier's head reads (``token="auto"``): the class
token's row with ``cls`` pooling, the mean of the patch tokens' rows with ``mean`` pooling, the
mixture of the patch tokens' rows with each image's pooling weights with ``seq`` pooling (CCT's
sequence pooling reads ``sum_i w_i x_i``, linear in the rows for given weights), the average of
the class and distillation rows for a distilled DeiT's head. ``token="cls"``,
``"dist"`` or ``"mean"`` choose for a distilled DeiT. Prefix tokens (class, distillation,
register) are never drawn as patches.

**Which class.** The prediction by default; ``target_class`` (a class name from
``task.class_names`` or an index) or ``target`` (one class per image) explain another.

**Which methods apply.** :func:`applicable_methods` says, per method, whether it applies to a
model and if not why (an attention-pooling head that no row of the attention describes, an
attention module AttnLRP has no rule for, ...); :func:`skip_inapplicable` drops those with a
warning naming each, so a run goes on with the methods that apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from vision_attn.errors import ConfigError
from vision_attn.explain.capture import attention_modules, capture_attention
from vision_attn.explain.faithfulness import auc, curve_ends, deletion_insertion_curve, end_probabilities
from vision_attn.explain.lrp import lrp_relevance, lrp_unsupported
from vision_attn.explain.lrp_decoder import gate_by_attention
from vision_attn.explain.rollout import (
    HeadFusion,
    TokenIndex,
    attention_rollout,
    gradient_relevance,
    last_layer_attention,
    normalize_maps,
    to_grid,
)
from vision_attn.explain.targets import (
    _MEAN_POOLING,
    _SEQ_POOLING,
    TOKENS,
    Token,
    _attention_pooled,
    explained_token,
    resolve_target_class,
    resolve_token,
)
from vision_attn.models.merging import merge_log

__all__ = [
    "METHODS", "TOKENS", "Explanation", "MethodInputs", "MethodSpec", "Need", "Token", "applicable_methods",
    "check_methods", "explain_classifier", "explained_token", "faithful_methods", "faithfulness", "register_method",
    "resolve_target_class", "resolve_token", "skip_inapplicable",
]

log = logging.getLogger(__name__)

Need = Literal["attention", "attention_grad", "block_input", "block_input_grad", "block_output"]
_NEEDS: frozenset[str] = frozenset({"attention", "attention_grad", "block_input", "block_input_grad",
                                    "block_output"})


@dataclass
class MethodInputs:
    """What a method's function receives (one batch).

    Attributes:
        images: ``[B, 3, H, W]`` model inputs.
        logits: ``[B, C]`` (detached).
        target: ``[B]`` the classes explained.
        grid: patch grid ``(h, w)``; maps are ``[B, h, w]``.
        num_prefix_tokens: ``P``: the class / distillation / register tokens in front of the
            ``h * w`` patch tokens of every ``T = P + h * w`` sequence.
        token_index: the row explained (see :mod:`vision_attn.explain.rollout`).
        attentions: per block ``[B, heads, T, T]`` (with the ``attention`` need).
        attention_grads: per block d(target logit)/d(attention) (``attention_grad``).
        block_input: ``[B, T, D]`` the tokens the encoder's last block reads, after its first
            LayerNorm (``norm1``'s output; the block's input without one) (``block_input``).
            The last block is the encoder's ``last_block`` (``blocks[-1]``; Cait's last
            class-attention block, which reads the class token and the patches).
        block_input_grad: d(target logit)/d(block_input) (``block_input_grad``).
        block_output: ``[B, T, D]`` output of the encoder's last block, before the final norm
            (``block_output``; Cait: the tokens entering the final norm).
        head_fusion, discard_ratio, start_layer: options of the attention methods.
        generator: randomness (the ``random`` baseline).
        task: the classifier explained (``encoder`` + ``head``), for methods that run their own
            passes through it (``lrp``).
        merges: for a token-merged encoder (:func:`vision_attn.merge_tokens`), per block the
            token maps after its attention (:func:`vision_attn.models.merging.merge_log`); ``None`` otherwise.
        shared: maps of one method that another reuses in the batch (``lrp`` in ``lrp_attention``).
    """

    images: Tensor
    logits: Tensor
    target: Tensor
    grid: tuple[int, int]
    num_prefix_tokens: int
    token_index: TokenIndex
    attentions: list[Tensor] = field(default_factory=list)
    attention_grads: list[Tensor] = field(default_factory=list)
    block_input: Tensor | None = None
    block_input_grad: Tensor | None = None
    block_output: Tensor | None = None
    head_fusion: HeadFusion = "mean"
    discard_ratio: float = 0.0
    start_layer: int = 0
    generator: torch.Generator | None = None
    task: object | None = None
    merges: list | None = None
    shared: dict[str, Tensor] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class MethodSpec:
    """A registered explanation method.

    Attributes:
        fn: ``MethodInputs -> [B, h, w]`` non-negative maps (the suite scales each to max 1).
        needs: what the forward pass must record (see :data:`Need`).
        faithfulness: whether deletion / insertion numbers make sense (the map explains a class).
        description: one line for help texts.
        applies: ``model -> None`` when the method applies to a model (an encoder, or a classifier
            with ``encoder`` and ``head``), else the reason it does not; checked by
            :func:`applicable_methods` on top of what ``needs`` asks of the model.
    """

    fn: Callable[[MethodInputs], Tensor]
    needs: frozenset[str] = frozenset()
    faithfulness: bool = True
    description: str = ""
    applies: Callable[[object], str | None] | None = None


METHODS: dict[str, MethodSpec] = {}
"""The registry: method name -> :class:`MethodSpec`, in the order methods were registered."""


def register_method(
    name: str, needs: Iterable[str] = (), faithfulness: bool = True, description: str = "",
    applies: Callable[[object], str | None] | None = None,
) -> Callable[[Callable[[MethodInputs], Tensor]], Callable[[MethodInputs], Tensor]]:
    """Decorator adding ``fn`` to :data:`METHODS` under ``name`` (replacing one of that name).

    Args:
        name: the method's name (``--methods NAME``).
        needs: any of ``attention``, ``attention_grad``, ``block_input``,
            ``block_input_grad``, ``block_output`` (see :class:`MethodInputs`).
        faithfulness: ``False`` for diagnostics that explain no class (no deletion / insertion).
        description: one line for help texts.
        applies: ``model -> reason or None``, what the method asks of a model beyond ``needs``
            (see :class:`MethodSpec`).
    """
    needs = frozenset(needs)
    if needs - _NEEDS:
        raise ValueError(f"method {name!r}: unknown needs {sorted(needs - _NEEDS)}; choose from {sorted(_NEEDS)}")

    def add(fn: Callable[[MethodInputs], Tensor]) -> Callable[[MethodInputs], Tensor]:
        METHODS[name] = MethodSpec(fn, needs, faithfulness, description, applies)
        return fn

    return add


def faithful_methods(methods: Iterable[str]) -> list[str]:
    """The methods of ``methods`` that get faithfulness numbers (unregistered names included)."""
    return [m for m in methods if m not in METHODS or METHODS[m].faithfulness]


def check_methods(methods: Sequence[str], what: str = "methods") -> None:
    """Raise :class:`~vision_attn.errors.ConfigError` for names not in :data:`METHODS`."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ConfigError(f"{what} {list(methods)} invalid: unknown {unknown}; choose one or more of "
                          f"{', '.join(METHODS)}")


# ---------------------------------------------------------------------------- the methods
@register_method("rollout", needs=("attention",), description="attention rollout (Abnar & Zuidema 2020)")
def _rollout(x: MethodInputs) -> Tensor:
    return attention_rollout(x.attentions, x.grid, x.num_prefix_tokens, x.head_fusion, x.discard_ratio,
                             x.start_layer, x.token_index, merges=x.merges)


@register_method("relevance", needs=("attention", "attention_grad"),
                 description="gradient-weighted relevance, class specific (Chefer et al. 2021)")
def _relevance(x: MethodInputs) -> Tensor:
    return gradient_relevance(x.attentions, x.attention_grads, x.grid, x.num_prefix_tokens, x.token_index,
                              x.start_layer, merges=x.merges)


@register_method("attention", needs=("attention",), description="raw attention of the last block")
def _attention(x: MethodInputs) -> Tensor:
    return last_layer_attention(x.attentions, x.grid, x.num_prefix_tokens, x.head_fusion, x.token_index,
                                merges=x.merges)


@register_method("gradcam", needs=("block_input", "block_input_grad"),
                 description="Grad-CAM on the last block's patch tokens, class specific")
def _gradcam(x: MethodInputs) -> Tensor:
    """``relu(sum_c w_c A_c)`` with ``A`` the patch tokens ``[B, N, D]`` the last block reads
    (after its ``norm1``: pytorch-grad-cam's ViT recipe, ``target_layers=[blocks[-1].norm1]``)
    and ``w_c`` the gradient of the target logit w.r.t. channel ``c`` averaged over the patches.

    Not the block's *output*: a class-token head reads only the class token of the last
    block's output, so the gradient w.r.t. its patch tokens is exactly zero.
    """
    p = x.num_prefix_tokens
    tokens = x.block_input[:, p:].float()  # (B, N, D): prefix tokens dropped
    weights = x.block_input_grad[:, p:].float().mean(dim=1, keepdim=True)  # (B, 1, D)
    cam = (weights * tokens).sum(dim=-1).clamp(min=0)  # (B, N)
    return to_grid(cam, x.grid, 0)


def _lrp_applies(model) -> str | None:
    reason = lrp_unsupported(model)
    return None if reason is None else f"AttnLRP's rules do not cover it: {reason}"


@register_method("lrp", description="conservative relevance, AttnLRP (Achtibat et al. 2024), class specific",
                 applies=_lrp_applies)
def _lrp(x: MethodInputs) -> Tensor:
    """AttnLRP relevance of the pixels summed per patch (:mod:`vision_attn.explain.lrp`); its own
    forward and backward pass with the LRP rules, explaining the logit (``token`` plays no role)."""
    if "lrp" not in x.shared:
        x.shared["lrp"] = lrp_relevance(x.task, x.images, x.target).maps
    return x.shared["lrp"]


@register_method("lrp_attention", needs=("attention",), applies=_lrp_applies,
                 description="lrp gated by the raw attention of the last block (their product), class specific")
def _lrp_attention(x: MethodInputs) -> Tensor:  # the relevant patches among those the explained row reads
    return gate_by_attention(_lrp(x), _attention(x))


@register_method("tokens", needs=("block_output",), faithfulness=False,
                 description="diagnostic: norm of each patch token at the last block (artifact tokens)")
def _token_norms(x: MethodInputs) -> Tensor:
    norms = x.block_output.float().norm(dim=-1)  # (B, T)
    return to_grid(norms, x.grid, x.num_prefix_tokens)


@register_method("random", description="uniform noise: the baseline of the faithfulness numbers")
def _random(x: MethodInputs) -> Tensor:
    rand = torch.rand((x.images.shape[0], *x.grid), generator=x.generator)
    return rand.to(x.images.device)


# ---------------------------------------------------------------------------- the result
@dataclass
class Explanation:
    """Saliency maps of a batch. ``maps[method]`` is ``[B, h, w]`` in ``[0, 1]``; ``attentions``
    the captured attention of every block ``[B, heads, T, T]`` (detached; empty when no method
    needed attention), ``num_prefix_tokens`` how many of the ``T`` tokens are not patches,
    ``token_index`` the row explained (a prefix token's index, a tuple of them — the mean of
    their rows —, ``"patches"``: the mean of the patch tokens' rows, or a ``[B, T]`` tensor of
    row weights: a sequence-pooling head's weights, per image)."""

    logits: Tensor
    target: Tensor
    grid: tuple[int, int]
    maps: dict[str, Tensor] = field(default_factory=dict)
    attentions: list[Tensor] = field(default_factory=list)
    num_prefix_tokens: int = 0
    token_index: TokenIndex = 0


# ---------------------------------------------------------------------------- which methods apply
_ROW_NEEDS = frozenset({"attention", "attention_grad"})  # the methods that explain a row of the attention
_TOKEN_NEEDS = frozenset({"block_input", "block_input_grad", "block_output"})


def _explained_row(task, num_prefix_tokens: int, token: str, out, needed: bool) -> TokenIndex:
    """:func:`resolve_token`; where no method reads a row (``needed`` false), a head that no row
    describes (attention pooling) is no error: ``"patches"`` stands in."""
    try:
        return resolve_token(task, num_prefix_tokens, token, out)
    except ConfigError:
        raise
    except ValueError:
        if needed:
            raise
        return "patches"


def _attention_reason(encoder) -> str | None:
    if isinstance(encoder, nn.Module) and attention_modules(encoder):
        return None
    return (f"{type(encoder).__name__} has no attention module that can be captured (a module with a "
            "`fused_attn` flag and an `attn_drop` sub-module)")


def _row_reason(encoder, head) -> str | None:
    """Why no row of the attention describes what ``head`` reads, or ``None``."""
    if head is None:
        return None
    pooling = getattr(head, "pooling", None) or getattr(head, "global_pool", None) or "auto"
    if pooling in _SEQ_POOLING or _attention_pooled(head):
        return None  # the row is the image's own pooling weights
    try:
        explained_token(head, getattr(encoder, "num_prefix_tokens", 1))
    except ValueError:
        return (f"the head pools the tokens with {pooling!r} (attention pooling), and no row of the encoder's "
                "attention describes what it reads")
    return _class_attention_reason(encoder, head)


def _class_attention_reason(encoder, head) -> str | None:
    """Why a class-attention model's last blocks (Cait's) do not explain ``head``: it reads the patch
    tokens, which they leave unchanged."""
    if head is None or not getattr(encoder, "class_attention", False):
        return None
    pooling = getattr(head, "pooling", None) or getattr(head, "global_pool", None) or "auto"
    if pooling not in _MEAN_POOLING:
        return None
    return ("the head averages the patch tokens, and the model's class-attention blocks (Cait's), whose attention "
            "and inputs these methods read, leave them unchanged")


def _token_reason(encoder, head, needs: frozenset[str]) -> str | None:
    try:
        _last_block(encoder)
    except ValueError as err:
        return str(err)
    return _class_attention_reason(encoder, head) if "block_input" in needs else None


def applicable_methods(model, methods: Sequence[str] | None = None) -> dict[str, str | None]:
    """Which explanation methods apply to ``model``: ``{method: None}`` for those that apply,
    ``{method: reason}`` for the others, for ``methods`` (default: every method of
    :data:`METHODS`, in its order).

    What each asks: the attention methods (``rollout``, ``relevance``, ``attention``, any method
    needing ``attention``) an attention module the capture records, and a row of the attention
    that describes what the head reads (not an attention-pooling head; not the patch tokens of a
    class-attention model, Cait, whose class attention leaves them unchanged); ``gradcam`` and
    ``tokens`` a last block over the token grid; ``lrp`` AttnLRP rules for every module (see
    :func:`~vision_attn.explain.lrp.lrp_unsupported`); ``random`` nothing.

    Args:
        model: an encoder (a :class:`~vision_attn.ViTEncoder`), or a classifier with ``encoder``
            and ``head`` (a task): then what the head reads counts too.
        methods: names of :data:`METHODS`.

    Raises:
        ConfigError: a name that is not a method.
    """
    names = list(METHODS) if methods is None else list(methods)
    check_methods(names)
    encoder = getattr(model, "encoder", model)
    head = getattr(model, "head", None) if encoder is not model else None
    found: dict[str, str | None] = {}
    for name in names:
        spec = METHODS[name]
        reason = None
        if spec.needs & _ROW_NEEDS:
            reason = _attention_reason(encoder) or _row_reason(encoder, head)
        if reason is None and spec.needs & _TOKEN_NEEDS:
            reason = _token_reason(encoder, head, spec.needs)
        if reason is None and spec.applies is not None:
            reason = spec.applies(model)
        found[name] = reason
    return found


def skip_inapplicable(model, methods: Sequence[str], what: str = "the model") -> list[str]:
    """``methods`` without those that do not apply to ``model`` (:func:`applicable_methods`), each
    skipped with a warning naming it and why; the order is kept.

    Raises:
        ConfigError: a name that is not a method.
    """
    reasons = applicable_methods(model, methods)
    for name, reason in reasons.items():
        if reason is not None:
            log.warning("method %r does not apply to %s, skipped: %s", name, what, reason)
    return [m for m in methods if reasons[m] is None]


def _last_block(encoder: nn.Module) -> nn.Module:
    """The last block that reads every token: the encoder's ``last_block`` (a
    :class:`~vision_attn.ViTEncoder`: Cait's last class-attention block), else ``blocks[-1]``."""
    last = getattr(encoder, "last_block", None)
    if isinstance(last, nn.Module):
        return last
    model = getattr(encoder, "model", encoder)
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ValueError(f"{type(model).__name__} has no `blocks`: gradcam / tokens need a ViT's last block")
    return blocks[-1]


def _record_last_block(encoder: nn.Module, needs: frozenset[str], seen: dict[str, Tensor]) -> list:
    """Hooks filling ``seen["block_input"]`` / ``seen["block_output"]`` (see :class:`MethodInputs`).
    With class attention (Cait: its last block returns the class token only) the tokens after the
    blocks are the input of the final norm, ``[B, P + N, D]`` as for the other models."""
    block = _last_block(encoder)
    handles = []
    if "block_input" in needs:
        norm1 = getattr(block, "norm1", None)
        if isinstance(norm1, nn.Module):
            handles.append(norm1.register_forward_hook(lambda _m, _i, out: seen.__setitem__("block_input", out)))
        else:
            handles.append(block.register_forward_pre_hook(lambda _m, i: seen.__setitem__("block_input", i[0])))
    if "block_output" in needs and getattr(encoder, "class_attention", False):
        norm = encoder.model.norm
        handles.append(norm.register_forward_pre_hook(lambda _m, i: seen.__setitem__("block_output", i[0])))
    elif "block_output" in needs:
        handles.append(block.register_forward_hook(lambda _m, _i, out: seen.__setitem__("block_output", out)))
    return handles


# ---------------------------------------------------------------------------- one call
def _recorded_forward(task, images: Tensor, needs: frozenset[str], seen: dict[str, Tensor]):
    """``(encoder output, logits, captured attention)`` of one forward pass, with what ``needs``
    asks recorded (the last block's tokens into ``seen``); gradients kept when a need asks for them."""
    handles = _record_last_block(task.encoder, needs, seen) if {"block_input", "block_output"} & needs else []
    try:
        with torch.set_grad_enabled(bool({"attention_grad", "block_input_grad"} & needs)):
            if {"attention", "attention_grad"} & needs:
                with capture_attention(task.encoder, keep_grad="attention_grad" in needs) as attn:
                    out = task.encoder(images)
            else:
                attn = []
                out = task.encoder(images)
            logits = task.head(out)
    finally:
        for handle in handles:
            handle.remove()
    return out, logits, attn


def _fill_gradients(inputs: MethodInputs, logits: Tensor, needs: frozenset[str]) -> None:
    """The gradients of the target logits the methods need (``attention_grad``, ``block_input_grad``)."""
    with torch.enable_grad():  # also under a caller's no_grad (Lightning's predict loop)
        score = logits.gather(1, inputs.target.view(-1, 1)).sum()
    wrt = list(inputs.attentions) if "attention_grad" in needs else []
    if "block_input_grad" in needs:
        wrt.append(inputs.block_input)
    grads = torch.autograd.grad(score, wrt)
    if "attention_grad" in needs:
        inputs.attention_grads = list(grads[: len(inputs.attentions)])
    if "block_input_grad" in needs:
        inputs.block_input_grad = grads[-1]


def _default_target(task, logits: Tensor) -> Tensor:
    """``[B]`` the output explained when none is asked: the head's ``target_column`` where it has one
    (an embedding model's score), else each image's predicted class."""
    column = getattr(getattr(task, "head", None), "target_column", None)
    if isinstance(column, int) and not isinstance(column, bool):
        return torch.full((logits.shape[0],), column, dtype=torch.long, device=logits.device)
    return logits.detach().argmax(dim=1)


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
    target_class: str | int | None = None,
    token: str = "auto",
) -> Explanation:
    """Saliency maps of a classification task for a batch of normalised images.

    Args:
        task: a classifier with ``encoder`` (a :class:`~vision_attn.ViTEncoder`) and ``head``
            (``EncoderOutput -> [B, C]`` logits), e.g. a
            :class:`~vision_attn.tasks.ClassificationTask`.
        images: ``[B, 3, H, W]`` model inputs.
        methods: names in :data:`METHODS` (``rollout``, ``relevance``, ``attention``,
            ``gradcam``, ``tokens``, ``random``, and any registered later).
        target: ``[B]`` classes to explain (default: the predicted ones; for a head with a
            ``target_column``, an embedding model's, that column: the score it explains).
        head_fusion: head fusion of ``rollout`` and ``attention``.
        discard_ratio: ``rollout``'s discard ratio.
        start_layer: first block used by ``rollout`` and ``relevance``.
        token_index: the row explained, overriding ``token``: a prefix token's index, a tuple
            of them, ``"patches"``, or ``[B, T]`` row weights.
        generator: randomness of the ``random`` baseline.
        target_class: one class for every image, by name (``task.class_names``) or index;
            excludes ``target``.
        token: ``auto`` (what the head reads), or for a distilled DeiT ``cls``, ``dist`` or
            ``mean`` (see :func:`resolve_token`). ``gradcam`` and ``tokens`` do not depend on it.

    Raises:
        ConfigError: unknown methods, target class or token.
    """
    check_methods(methods)
    if target is not None and target_class is not None:
        raise ConfigError("give either target (one class per image) or target_class, not both")
    specs = [METHODS[m] for m in methods]
    needs = frozenset().union(*(s.needs for s in specs))
    if "block_input_grad" in needs:
        needs |= {"block_input"}
    grad_inputs = {"attention_grad", "block_input_grad"} & needs
    seen: dict[str, Tensor] = {}
    out, logits, attn = _recorded_forward(task, images, needs, seen)
    if target_class is not None:
        index = resolve_target_class(target_class, getattr(task, "class_names", None), logits.shape[1])
        target = torch.full((logits.shape[0],), index, dtype=torch.long, device=logits.device)
    if target is None:
        target = _default_target(task, logits)
    p = out.num_prefix_tokens
    if token_index is None:
        token_index = _explained_row(task, p, token, out, bool(needs & _ROW_NEEDS))
    inputs = MethodInputs(images=images, logits=logits.detach(), target=target, grid=out.grid,
                          num_prefix_tokens=p, token_index=token_index, attentions=list(attn),
                          block_input=seen.get("block_input"), block_output=seen.get("block_output"),
                          head_fusion=head_fusion, discard_ratio=discard_ratio, start_layer=start_layer,
                          generator=generator, task=task, merges=merge_log(task.encoder))
    if grad_inputs:
        _fill_gradients(inputs, logits, needs)
    inputs.attentions = [a.detach() for a in inputs.attentions]
    for name in ("block_input", "block_output"):
        if getattr(inputs, name) is not None:
            setattr(inputs, name, getattr(inputs, name).detach())
    result = Explanation(logits=logits.detach(), target=target, grid=out.grid, attentions=inputs.attentions,
                         num_prefix_tokens=p, token_index=token_index)
    b, (h, w) = images.shape[0], out.grid
    for method, spec in zip(methods, specs, strict=True):
        sal = spec.fn(inputs)
        if tuple(sal.shape) != (b, h, w):
            raise ValueError(f"explanation method {method!r} returned maps of shape {tuple(sal.shape)}, "
                             f"expected [B, h, w] = {(b, h, w)}")
        result.maps[method] = normalize_maps(sal.detach().float())
    return result


def faithfulness(task, images: Tensor, explanation: Explanation, steps: int = 16) -> dict[str, dict[str, Tensor]]:
    """Per-image deletion and insertion AUC of every map in ``explanation`` that explains a
    class (not the ``tokens`` diagnostic: :func:`faithful_methods`).

    Args:
        task: the classifier explained (``images -> logits``).
        images: ``[B, 3, H, W]`` model inputs.
        explanation: what :func:`explain_classifier` returned for ``images``.
        steps: points of each curve after the first.

    Returns:
        ``{method: {"deletion_auc": [B], "insertion_auc": [B]}}`` for the class in
        ``explanation.target``.
    """

    def proba(x: Tensor) -> Tensor:
        return task(x).float().softmax(dim=-1)

    out: dict[str, dict[str, Tensor]] = {}
    target = explanation.target.to(images.device)
    rows = torch.arange(images.shape[0], device=images.device)
    shared = end_probabilities(proba, images)  # the curves' first and last points, the same for every map
    for method in faithful_methods(explanation.maps):
        sal = explanation.maps[method]
        out[method] = {
            f"{mode}_auc": auc(deletion_insertion_curve(proba, images, sal, target, mode, steps,
                                                        ends=curve_ends(shared, rows, target, mode)))
            for mode in ("deletion", "insertion")
        }
    return out
