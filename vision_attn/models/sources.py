"""Deprecated: moved to :mod:`vision_attn.tasks.sources` (this path works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.models.sources",
    {
        "TIMM_PREFIX": "vision_attn.tasks.sources",
        "ClassNames": "vision_attn.tasks.sources",
        "imagenet_class_names": "vision_attn.tasks.sources",
        "load_model": "vision_attn.tasks.sources",
        "load_timm_model": "vision_attn.tasks.sources",
        "resolve_class_names": "vision_attn.tasks.sources",
    },
)
