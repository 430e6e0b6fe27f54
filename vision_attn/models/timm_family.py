"""Which timm models the encoder reads: the timm classes with global attention over one patch
grid (:data:`READABLE_CLASSES`), those refused and why (:data:`UNREADABLE_CLASSES`,
:func:`refusal`), the keyword arguments a class takes (:func:`constructor_arguments`) and where
a model keeps its patch embedding and its attention blocks."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing

import timm
import torch
from torch import nn

from vision_attn.errors import EncoderError

__all__ = [
    "READABLE_CLASSES",
    "UNREADABLE_CLASSES",
    "constructor_arguments",
    "model_family",
    "patch_embedding",
    "refusal",
    "suggest_model_names",
    "timm_attention_blocks",
    "unreadable_reason",
]


def suggest_model_names(name: str) -> str:
    """" Did you mean: ...?" with close timm model names (ViT family first), and where to list them."""
    vit_family = timm.list_models("vit_*") + timm.list_models("deit*")
    close = difflib.get_close_matches(name, vit_family, n=3, cutoff=0.5)
    close = close or difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return hint + " List the available names with `timm.list_models('vit_*')`."


# ---------------------------------------------------------------------------- timm model classes
# The timm classes whose attention vision_attn reads: global self-attention over one patch grid
# (with Cait, the class attention over it). A subclass reads as its base (DeiT's distilled model).
READABLE_CLASSES = ("VisionTransformer", "VisionTransformerRelPos", "Eva", "Beit", "Cait", "NaFlexVit")

# Classes that are refused, and why: their attention does not relate the image's patches to one
# another over one grid (or they have none). Gradient and relevance methods on feature maps
# (Grad-CAM, LRP) would apply to them; attention maps would not.
_WINDOWED = ("windowed attention: each token attends only within a local window of the grid, so no "
             "attention map covers the image")
_POOLED = "pooling attention: keys and values are pooled and the token grid shrinks from stage to stage"
UNREADABLE_CLASSES: dict[str, str] = {
    "SwinTransformer": _WINDOWED,
    "SwinTransformerV2": _WINDOWED,
    "SwinTransformerV2Cr": _WINDOWED,
    "PoolingVisionTransformer": _POOLED,
    "MultiScaleVit": _POOLED,
    "Xcit": "channel attention (cross-covariance): its attention maps relate feature channels, not image patches",
}
_READABLE_EXAMPLES = ("vit_small_patch16_224, eva02_small_patch14_224, beit_base_patch16_224, cait_xxs24_224, "
                      "vit_relpos_small_patch16_224 or naflexvit_base_patch16_gap")


def model_family(model: nn.Module | type) -> str | None:
    """The timm class of :data:`READABLE_CLASSES` that ``model`` (a module or a class) is, or ``None``."""
    cls = model if isinstance(model, type) else type(model)
    return next((k.__name__ for k in cls.__mro__ if k.__name__ in READABLE_CLASSES), None)


def unreadable_reason(model: nn.Module | type) -> str | None:
    """Why vision_attn cannot explain a timm model (a module or a class), or ``None`` when it can
    (a class of :data:`READABLE_CLASSES`, or a class it does not know that looks like a ViT)."""
    cls = model if isinstance(model, type) else type(model)
    if model_family(cls) is not None:
        return None
    reason = next((UNREADABLE_CLASSES[k.__name__] for k in cls.__mro__ if k.__name__ in UNREADABLE_CLASSES), None)
    if reason is not None:
        return reason
    if isinstance(model, nn.Module):
        attention = any(hasattr(m, "fused_attn") or "attention" in type(m).__name__.lower()
                        or "attn" in type(m).__name__.lower() for m in model.modules())
        looks_like_vit = all(hasattr(model, a) for a in ("patch_embed", "blocks", "num_prefix_tokens"))
        if not attention:
            return "a convolutional network (or another model without attention): it has no attention maps"
        if not looks_like_vit:
            return ("its attention does not run over one grid of patch tokens with prefix tokens in front "
                    "(no patch_embed, blocks and num_prefix_tokens), the layout vision_attn reads")
    return None


def refusal(name: str, model: nn.Module | type, reason: str) -> EncoderError:
    """The one error for a timm model that cannot be explained: the model, why, which methods would
    apply, and which models to use instead."""
    cls = model if isinstance(model, type) else type(model)
    return EncoderError(
        f"timm model {name!r} is not a Vision Transformer with global attention that vision_attn can explain "
        f"({cls.__name__}: {reason}). The attention methods (rollout, relevance, attention) need global "
        "attention over the patch grid; gradient and relevance methods on feature maps (gradcam, lrp) would "
        "apply to it, and vision_attn runs them on the Vision Transformers it reads "
        f"({', '.join(READABLE_CLASSES)}), e.g. {_READABLE_EXAMPLES}."
    )


def constructor_arguments(cls: type) -> frozenset[str]:
    """The keyword arguments a timm model class takes: its constructor's, its bases' where it passes
    ``**kwargs`` on (DeiT's distilled model), and the fields of a config dataclass it takes
    (NaFlexVit's ``cfg``)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names |= {n for n, p in params.items() if p.kind in keyword and n != "self"}
        try:
            hints = typing.get_type_hints(klass.__init__)
        except (NameError, TypeError):
            hints = {}
        for hint in hints.values():
            for option in (hint, *typing.get_args(hint)):
                if isinstance(option, type) and dataclasses.is_dataclass(option):
                    names |= {f.name for f in dataclasses.fields(option)}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return frozenset(names)


def _meta_model(name: str) -> nn.Module | None:
    """timm's model for ``name`` with its own arguments, built on the ``meta`` device (nothing is
    allocated), or ``None`` when it cannot be built there."""
    try:
        with torch.device("meta"):
            return timm.create_model(name, pretrained=False)
    except Exception:  # noqa: BLE001 - any failure only means the class stays unknown
        return None


def patch_embedding(model: nn.Module) -> nn.Module:
    """The module that turns pixels into patch tokens (``patch_embed``; NaFlexVit's ``embeds``)."""
    embed = getattr(model, "patch_embed", None)
    return embed if embed is not None else model.embeds


def timm_attention_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks whose attention vision_attn reads, first first: every block, or for Cait the
    class-attention blocks (``blocks_token_only``: the class token attends to itself and every
    patch; Cait's talking-heads self-attention mixes the heads after the softmax, so its
    weights are no probabilities)."""
    if model_family(model) == "Cait":
        return list(model.blocks_token_only)
    return list(model.blocks)


def _check_readable(name: str, model: nn.Module) -> str:
    """The family (timm class) of a built model, or the refusal of one vision_attn cannot read."""
    reason = unreadable_reason(model)
    if reason is not None:
        raise refusal(name, model, reason)
    required = ("blocks", "num_prefix_tokens", "forward_features")
    missing = [a for a in required if not hasattr(model, a)]
    if not hasattr(model, "patch_embed") and not hasattr(model, "embeds"):
        missing.insert(0, "patch_embed")
    if missing:
        raise refusal(name, model, f"it is not a Vision Transformer that vision_attn reads (it has no "
                                   f"{', '.join(missing)})")
    return model_family(model) or type(model).__name__
