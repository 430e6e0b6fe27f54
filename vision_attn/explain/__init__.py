"""Explanations: capture attention, turn it into maps, draw them, measure their faithfulness."""

from vision_attn.explain.api import explain_images
from vision_attn.explain.capture import (
    AttentionCaptureError,
    attention_modules,
    capture_attention,
    extract_attention,
    observe_attention,
    streaming_relevance,
    streaming_rollout,
)
from vision_attn.explain.decoder_relevance import caption_relevance, detection_relevance
from vision_attn.explain.faithfulness import auc, deletion_insertion_curve
from vision_attn.explain.localisation import grid_to_image, load_image_boxes, localisation
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
from vision_attn.explain.sanity import sanity_check, spearman

__all__ = [
    "spearman",
    "sanity_check",
    "localisation",
    "load_image_boxes",
    "grid_to_image",
    "detection_relevance",
    "caption_relevance",
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
    "observe_attention",
    "streaming_relevance",
    "streaming_rollout",
    "faithfulness",
    "gradient_relevance",
    "image_grid",
    "last_layer_attention",
    "overlay_saliency",
    "put_text",
    "register_method",
    "save_png",
]
