"""Deprecated: moved to :mod:`vision_attn.losses.scst` (this path works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.scst",
    {
        "BASELINES": "vision_attn.losses.scst",
        "baselines": "vision_attn.losses.scst",
        "sample_rewards": "vision_attn.losses.scst",
        "scst_loss": "vision_attn.losses.scst",
        "sequence_mask": "vision_attn.losses.scst",
    },
)
