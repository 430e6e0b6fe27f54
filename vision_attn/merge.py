"""Deprecated: moved to :mod:`vision_attn.models.merging` (this path works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.merge",
    {
        "MergeState": "vision_attn.models.merging",
        "TokenExpand": "vision_attn.models.merging",
        "TokenMerge": "vision_attn.models.merging",
        "grid_attention": "vision_attn.models.merging",
        "merge_log": "vision_attn.models.merging",
        "merge_state": "vision_attn.models.merging",
        "merge_tokens": "vision_attn.models.merging",
        "token_merging": "vision_attn.models.merging",
        "unmerge_tokens": "vision_attn.models.merging",
    },
)
