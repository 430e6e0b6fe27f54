"""Deprecated: moved to :mod:`vision_attn.data.caption_objects` and
:mod:`vision_attn.metrics.caption_content` (this path works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.caption_content",
    {
        "COCO_SYNONYMS": "vision_attn.data.caption_objects",
        "GENERIC_NOUNS": "vision_attn.data.caption_objects",
        "NUMBER_WORDS": "vision_attn.data.caption_objects",
        "AnnotatedObjects": "vision_attn.data.caption_objects",
        "Mention": "vision_attn.data.caption_objects",
        "ObjectVocabulary": "vision_attn.data.caption_objects",
        "parse_mentions": "vision_attn.data.caption_objects",
        "content_accuracy": "vision_attn.metrics.caption_content",
    },
)
