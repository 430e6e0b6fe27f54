"""Deprecated: moved to :mod:`vision_attn.metrics.caption` (this path works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.caption_metrics",
    {
        "CiderD": "vision_attn.metrics.caption",
        "bleu_scores": "vision_attn.metrics.caption",
        "caption_metrics": "vision_attn.metrics.caption",
        "caption_metrics_per_image": "vision_attn.metrics.caption",
        "cider_d": "vision_attn.metrics.caption",
        "derangement": "vision_attn.metrics.caption",
        "image_dependence": "vision_attn.metrics.caption",
        "java_metrics": "vision_attn.metrics.caption",
        "rouge_l": "vision_attn.metrics.caption",
    },
)
