"""Loading a timm state dict into a :class:`~vision_attn.models.encoder.ViTEncoder`: wrapper
prefixes stripped (a vision_attn checkpoint of any task gives its encoder's weights), timm's
checkpoint filter (position embeddings resampled), a classifier of
another size dropped, and a clear error for weights of another architecture, stem, attention or
feed-forward kind than the encoder's."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from torch import Tensor

from vision_attn.errors import EncoderError
from vision_attn.models.smalldata import LSA_TEMPERATURE_KEY

__all__ = ["TASK_ENCODER_PREFIX", "check_stem_and_lsa", "load_state"]

TASK_ENCODER_PREFIX = "encoder.model."
"""How a vision_attn task's checkpoint names its encoder's timm weights."""

# the encoder's messages keep the encoder's logger name, wherever the code that logs them lives
log = logging.getLogger("vision_attn.models.encoder")


def load_state(encoder: Any, state: dict[str, Tensor], path: str = "weights") -> None:
    """Load a timm state dict already read into ``encoder`` (a
    :class:`~vision_attn.models.encoder.ViTEncoder`; see its ``load_weights``; ``path`` names the
    weights in messages)."""
    own = encoder.model.state_dict()
    task_keys = [k for k in state if k.startswith(TASK_ENCODER_PREFIX)]
    if task_keys and not any(k in own for k in state):
        # a vision_attn checkpoint of any task (pretraining, classification, ...): its encoder's weights
        left = len(state) - len(task_keys)
        if left:
            log.info("weights %s: a vision_attn checkpoint; its encoder's %d tensors are read, the other %d "
                     "(the task's head) are not", path, len(task_keys), left)
        state = {k[len(TASK_ENCODER_PREFIX):]: state[k] for k in task_keys}
    for prefix in ("module.", "model.", "encoder.model."):
        if state and not any(k in own for k in state) and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    check_stem_and_lsa(encoder, state, path)
    filter_fn = getattr(importlib.import_module(type(encoder.model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        state = filter_fn(state, encoder.model)
    heads = encoder.classifier_keys()
    for key in list(state):
        if key.split(".")[0] not in heads:
            continue
        if key not in own:  # the encoder has no classifier (num_classes=0): nothing to warn
            log.info("weights %s: classifier tensor %s not used by this encoder", path, key)
            del state[key]
        elif own[key].shape != state[key].shape:
            log.warning(
                "weights %s: classifier tensor %s has shape %s, the model %s; it is re-initialised",
                path, key, tuple(state[key].shape), tuple(own[key].shape),
            )
            del state[key]
    wrong = [f"{k} {tuple(v.shape)} (model {tuple(own[k].shape)})"
             for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        raise EncoderError(
            f"weights file {path} does not fit timm model {encoder.name!r}: shapes differ for {len(wrong)} tensors, "
            f"e.g. {'; '.join(wrong[:3])}. Check that the file was saved from the same architecture and sizes."
        )
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        log.warning("weights %s: %d tensors hold NaN or infinite values (e.g. %s); predictions will not be "
                    "meaningful", path, len(bad), bad[0])
    missing, unexpected = encoder.model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.split(".")[0] not in heads]
    lsa_missing = [k for k in missing if k.endswith("." + LSA_TEMPERATURE_KEY)]
    if lsa_missing:  # a plain ViT's weights in an LSA encoder: the temperatures start at timm's scale
        log.info("weights %s: no locality encoder-attention temperatures; %d blocks start at 1/sqrt(d_head)",
                 path, len(lsa_missing))
        missing = [k for k in missing if k not in lsa_missing]
    if missing or unexpected:
        raise EncoderError(
            f"weights file {path} does not fit timm model {encoder.name!r}: "
            f"missing keys {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}. "
            "Check that the file was saved from the same architecture and sizes."
        )
    log.info("loaded encoder weights from %s", path)


def check_stem_and_lsa(encoder: Any, state: dict[str, Tensor], path: str) -> None:
    """Clear errors for weights of another stem, attention or feed-forward kind than ``encoder``'s."""
    stem = getattr(encoder, "stem", "patch")
    has_linear_patch = any(k.endswith("patch_embed.proj.weight") for k in state)
    if stem != "patch" and has_linear_patch:
        raise EncoderError(
            f"weights file {path} holds timm's linear patch embedding (patch_embed.proj.weight), but this encoder "
            f"was built with stem={stem!r}, which replaces it. Build it with stem='patch' to use these weights, "
            f"or give a weights file saved from an encoder with stem={stem!r}."
        )
    if stem == "patch" and any(k.startswith("patch_embed.proj.") for k in state) and not has_linear_patch:
        raise EncoderError(
            f"weights file {path} holds a replaced patch embedding (patch_embed.proj.* without timm's "
            "patch_embed.proj.weight): it was saved from an encoder with stem='conv', 'cnn' or 'spt'; build this one "
            "with the same stem."
        )
    if not getattr(encoder, "lsa", False) and any(k.endswith("." + LSA_TEMPERATURE_KEY) for k in state):
        raise EncoderError(
            f"weights file {path} holds locality encoder-attention temperatures (*.attn.{LSA_TEMPERATURE_KEY}): it "
            "was saved from an encoder with lsa=True; build this one with lsa=True too."
        )
    has_dwconv = any(".mlp.dwconv." in k for k in state)
    if getattr(encoder, "local_mlp", False) and not has_dwconv:
        raise EncoderError(
            f"weights file {path} has no local feed-forward convolutions (blocks.N.mlp.dwconv.*), but this "
            "encoder was built with local_mlp=True; build it with local_mlp=False to use these weights."
        )
    if not getattr(encoder, "local_mlp", False) and has_dwconv:
        raise EncoderError(
            f"weights file {path} holds local feed-forward convolutions (blocks.N.mlp.dwconv.*): it was saved "
            "from an encoder with local_mlp=True; build this one with local_mlp=True too."
        )
