"""Building a timm model for the encoder: the keyword arguments a config or a checkpoint may
give timm (:data:`CHECKPOINT_TIMM_KWARGS`, :func:`checked_timm_kwargs`), the model built on the
``meta`` device first (sized and classified before anything is allocated or downloaded), and
pretrained weights fetched from the hub only when it can be reached."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

import timm
from torch import nn

from vision_attn.errors import EncoderError
from vision_attn.models.timm_family import (
    _READABLE_EXAMPLES,
    _meta_model,
    constructor_arguments,
    refusal,
    unreadable_reason,
)
from vision_attn.schema import JSONValue, check_model_bytes, check_value

__all__ = [
    "CHECKPOINT_TIMM_KWARGS",
    "HUB_PROBE_SECONDS",
    "TIMM_SOURCE_KWARGS",
    "checked_timm_kwargs",
    "hub_offline_when_unreachable",
    "hub_reachable",
]

# the encoder's messages keep the encoder's logger name, wherever the code that logs them lives
log = logging.getLogger("vision_attn.models.encoder")


# timm keyword arguments a checkpoint may store in ``timm_kwargs``: sizes and switches of the
# architecture only. Not ``pretrained_cfg(_overlay)``, ``checkpoint_path``, ``cache_dir`` (they
# make timm read files or download) nor layer classes (code).
CHECKPOINT_TIMM_KWARGS = frozenset({
    "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth",
    "num_heads", "mlp_ratio", "qkv_bias", "qk_norm", "scale_attn_norm", "scale_mlp_norm",
    "proj_bias", "init_values", "class_token", "pos_embed", "no_embed_class", "reg_tokens",
    "pre_norm", "final_norm", "fc_norm", "pool_include_prefix", "dynamic_img_size",
    "dynamic_img_pad", "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate",
    "attn_drop_rate", "drop_path_rate", "weight_init", "fix_init", "distilled",
    # Eva (EVA-02, RoPE ViTs, Perception Encoder)
    "num_kv_heads", "qkv_fused", "swiglu_mlp", "swiglu_align_to", "scale_mlp", "scale_attn_inner",
    "attn_type", "attn_only_layer_scale", "num_reg_tokens", "use_abs_pos_emb", "use_rot_pos_emb",
    "rope_type", "rope_grid_offset", "rope_grid_indexing", "rope_temperature", "rope_rotate_half",
    "use_post_norm", "use_pre_transformer_norm", "use_post_transformer_norm", "use_fc_norm",
    "attn_pool_num_heads", "attn_pool_mlp_ratio", "ref_feat_shape", "head_init_scale",
    # Beit, Cait, VisionTransformerRelPos, NaFlexVit
    "use_rel_pos_bias", "use_shared_rel_pos_bias", "depth_token_only", "mlp_ratio_token_only",
    "rel_pos_type", "rel_pos_dim", "shared_rel_pos", "pos_embed_grid_size", "embed_proj_type",
    "scale_attn_inner_norm",
})


# timm keyword arguments that tell timm where weights come from (a file, a download, a cache):
# refused in ``timm_kwargs`` everywhere (``pretrained`` and ``weights_file`` say it instead).
TIMM_SOURCE_KWARGS = frozenset({
    "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "cache_dir",
    "pretrained_strict", "feature_cfg", "kwargs_filter",
})


def checked_timm_kwargs(timm_kwargs: Any, what: str = "ViTEncoder") -> dict[str, Any]:
    """``timm_kwargs`` as a dict, after checking that it holds JSON scalars or lists of them under
    string keys, none of :data:`TIMM_SOURCE_KWARGS`.

    Raises:
        EncoderError: naming the key, for anything else (a nested mapping, a class path, an object).
    """
    if timm_kwargs is None:
        return {}
    check_value(timm_kwargs, dict[str, JSONValue], "timm_kwargs", what, EncoderError)
    sources = sorted(k for k in timm_kwargs if k in TIMM_SOURCE_KWARGS)
    if sources:
        raise EncoderError(
            f"{what}: timm_kwargs {sources} would make timm read or download weights; give the weights "
            "with pretrained=true or weights_file=PATH instead"
        )
    return dict(timm_kwargs)


def _short_args(kwargs: dict[str, Any], width: int = 200) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))
    return text if len(text) <= width else text[: width - 3] + "..."


def _plain_data(value: Any) -> bool:
    """Whether ``value`` is JSON-like data (no objects a builder could call)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_data(v) for k, v in value.items())
    return False



HUB_PROBE_SECONDS = 3.0


def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """Whether a TCP connection to the Hugging Face hub (``HF_ENDPOINT``) opens within ``timeout``."""
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def hub_offline_when_unreachable() -> Iterator[None]:
    """Download nothing, and retry nothing, when the hub cannot be reached: one connection attempt
    (:func:`hub_reachable`), then the local hub cache only, so an offline machine gets its answer
    in seconds (the weights when cached, else the advice to pass a weights file)."""
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE or hub_reachable():
        yield
        return
    log.info("the Hugging Face hub is not reachable: looking for the weights in the local cache only")
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = False


def _build_timm_model(name: str, pretrained: bool, explicit: dict[str, Any], defaults: dict[str, Any]) -> nn.Module:
    """timm's model for ``name`` with the ``explicit`` arguments and those of the suite's
    ``defaults`` (dropout, dynamic image size) that its class takes.

    The model is first built on the ``meta`` device (sized there: nothing is allocated for one
    beyond the limit), which also tells its class: a class vision_attn cannot read is refused
    before anything is downloaded.
    """
    built: list[nn.Module] = []

    def build_on_meta() -> nn.Module:
        built.append(timm.create_model(name, pretrained=False, **explicit))
        return built[-1]

    kwargs = dict(explicit)  # what timm is given (a refusal names those it does not take)
    try:
        check_model_bytes(build_on_meta, f"encoder {name}", EncoderError)
        kwargs = {**explicit, **defaults}
        if built:
            reason = unreadable_reason(built[0])
            if reason is not None:
                raise refusal(name, built[0], reason)
            accepted = constructor_arguments(type(built[0]))
            kwargs = {**explicit, **{k: v for k, v in defaults.items() if k in accepted}}
            dropped = {k: v for k, v in defaults.items() if k not in accepted and v}
            if dropped:
                log.info("timm model %s (%s) takes no %s: built without", name, type(built[0]).__name__,
                         ", ".join(sorted(dropped)))
        with hub_offline_when_unreachable() if pretrained else contextlib.nullcontext():
            return timm.create_model(name, pretrained=pretrained, **kwargs)
    except TypeError as err:
        raise _refused_arguments(name, kwargs, err) from err
    except EncoderError:
        raise
    except (AssertionError, ValueError, ZeroDivisionError, OverflowError, MemoryError) as err:
        raise EncoderError(
            f"timm model {name!r} cannot be built with {_short_args(kwargs)}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}"
        ) from err
    except (OSError, RuntimeError) as err:
        if not pretrained:
            raise EncoderError(
                f"timm model {name!r} cannot be built with {_short_args(kwargs)}: "
                f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}"
            ) from err
        raise EncoderError(
            f"could not get pretrained weights for timm model {name!r} ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). Offline? Download them once where "
            "the hub is reachable and pass weights_file=PATH (.safetensors / .pth) with pretrained=false."
        ) from err


def _refused_arguments(name: str, kwargs: dict[str, Any], err: TypeError) -> EncoderError:
    """The error for arguments timm's class refused: which ones, and what the class takes."""
    model = _meta_model(name)
    if model is None:
        return EncoderError(
            f"timm model {name!r} is not a Vision Transformer that vision_attn can read: "
            f"timm.create_model refused the arguments {sorted(kwargs)} ({err}). Use a ViT such as "
            f"{_READABLE_EXAMPLES} (list them with timm.list_models('vit_*'))."
        )
    reason = unreadable_reason(model)
    if reason is not None:
        return refusal(name, model, reason)
    cls = type(model)
    accepted = constructor_arguments(cls)
    refused = sorted(k for k in kwargs if k not in accepted) or sorted(kwargs)
    takes = sorted(a for a in accepted if a not in ("device", "dtype", "cfg"))
    return EncoderError(
        f"timm model {name!r} ({cls.__name__}) does not take the arguments {refused} ({err}); "
        f"{cls.__name__} takes: {', '.join(takes)}"
    )
