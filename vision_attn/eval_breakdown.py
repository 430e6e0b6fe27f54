"""Deprecated: moved to :mod:`vision_attn.metrics.breakdown` (this path works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.eval_breakdown",
    {
        "COCO_SUMMARY_KEYS": "vision_attn.metrics.breakdown",
        "DetectionBreakdown": "vision_attn.metrics.breakdown",
        "classification_breakdown": "vision_attn.metrics.breakdown",
        "coco_map_metric": "vision_attn.metrics.breakdown",
        "confusion_counts": "vision_attn.metrics.breakdown",
        "detection_breakdown": "vision_attn.metrics.breakdown",
        "pr_curves_from_precision": "vision_attn.metrics.breakdown",
    },
)
