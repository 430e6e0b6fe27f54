"""vision_attn: Vision Transformers for classification, detection and captioning, with every
attention map visible.

Public API::

    from vision_attn import create_encoder, capture_attention, MultiHeadAttention

    encoder = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2)
    with capture_attention(encoder) as attn:
        out = encoder(images)        # out.tokens, out.num_prefix_tokens, out.grid
    attn[0].shape                    # [B, heads, T, T], first block first
    maps = attention_rollout(attn, out.grid, out.num_prefix_tokens)   # [B, h, w] in [0, 1]
    merge_tokens(encoder, r=8)       # token merging (ToMe): faster, same [B, P + h*w, D] output
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

# The public API, imported when first used: ``import vision_attn`` (and the console script's
# listing) does not load torch, timm or Lightning.
_PUBLIC = {
    "KVCache": "vision_attn.attention",
    "MultiHeadAttention": "vision_attn.attention",
    "scaled_dot_product_attention": "vision_attn.attention",
    "explain_images": "vision_attn.explain.api",
    "AttentionCaptureError": "vision_attn.explain.capture",
    "capture_attention": "vision_attn.explain.capture",
    "attention_rollout": "vision_attn.explain.rollout",
    "gradient_relevance": "vision_attn.explain.rollout",
    "last_layer_attention": "vision_attn.explain.rollout",
    "EncoderOutput": "vision_attn.models.encoder",
    "ViTEncoder": "vision_attn.models.encoder",
    "create_encoder": "vision_attn.models.encoder",
    "merge_tokens": "vision_attn.models.merging",
    "token_merging": "vision_attn.models.merging",
    "unmerge_tokens": "vision_attn.models.merging",
    "load_task": "vision_attn.tasks.base",
    "load_model": "vision_attn.tasks.sources",
}

__all__ = [
    "AttentionCaptureError",
    "EncoderOutput",
    "KVCache",
    "MultiHeadAttention",
    "ViTEncoder",
    "attention_rollout",
    "capture_attention",
    "create_encoder",
    "explain_images",
    "gradient_relevance",
    "last_layer_attention",
    "load_model",
    "load_task",
    "merge_tokens",
    "scaled_dot_product_attention",
    "token_merging",
    "unmerge_tokens",
]

if TYPE_CHECKING:
    from vision_attn.attention import KVCache, MultiHeadAttention, scaled_dot_product_attention
    from vision_attn.explain.api import explain_images
    from vision_attn.explain.capture import AttentionCaptureError, capture_attention
    from vision_attn.explain.rollout import (
        attention_rollout,
        gradient_relevance,
        last_layer_attention,
    )
    from vision_attn.models.encoder import EncoderOutput, ViTEncoder, create_encoder
    from vision_attn.models.merging import merge_tokens, token_merging, unmerge_tokens
    from vision_attn.tasks.base import load_task
    from vision_attn.tasks.sources import load_model


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vision_attn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
