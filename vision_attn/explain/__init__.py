"""Explanations: capture attention, turn it into maps, draw them, measure their faithfulness."""

from vision_attn.explain.api import explain_images
from vision_attn.explain.capture import (
    AttentionCaptureError,
    attention_modules,
    capture_attention,
    extract_attention,
)
from vision_attn.explain.faithfulness import auc, deletion_insertion_curve
from vision_attn.explain.methods import (
    METHODS,
    Explanation,
    MethodSpec,
    explain_classifier,
    faithfulness,
    register_method,
)
from vision_attn.explain.overlay import image_grid, overlay_saliency, put_text, save_png
from vision_attn.explain.rollout import attention_rollout, gradient_relevance, last_layer_attention

__all__ = [
    "METHODS",
    "AttentionCaptureError",
    "Explanation",
    "MethodSpec",
    "attention_modules",
    "attention_rollout",
    "auc",
    "capture_attention",
    "deletion_insertion_curve",
    "explain_classifier",
    "explain_images",
    "extract_attention",
    "faithfulness",
    "gradient_relevance",
    "image_grid",
    "last_layer_attention",
    "overlay_saliency",
    "put_text",
    "register_method",
    "save_png",
]
