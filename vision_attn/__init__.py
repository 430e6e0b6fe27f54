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

import logging

from vision_attn.attention import KVCache, MultiHeadAttention, scaled_dot_product_attention
from vision_attn.explain.api import explain_images
from vision_attn.explain.capture import AttentionCaptureError, capture_attention
from vision_attn.explain.rollout import attention_rollout, gradient_relevance, last_layer_attention
from vision_attn.models.encoder import EncoderOutput, ViTEncoder, create_encoder
from vision_attn.models.merging import merge_tokens, token_merging, unmerge_tokens
from vision_attn.tasks.base import load_task
from vision_attn.tasks.sources import load_model

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AttentionCaptureError",
    "EncoderOutput",
    "attention_rollout",
    "gradient_relevance",
    "last_layer_attention",
    "KVCache",
    "MultiHeadAttention",
    "ViTEncoder",
    "capture_attention",
    "create_encoder",
    "explain_images",
    "load_model",
    "load_task",
    "merge_tokens",
    "scaled_dot_product_attention",
    "token_merging",
    "unmerge_tokens",
]
