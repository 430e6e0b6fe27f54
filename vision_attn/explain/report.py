"""Deprecated: moved to :mod:`vision_attn.report` and :mod:`vision_attn.explain.records` (this path
works for one more version, with a warning)."""

from vision_attn._deprecated import moved

__getattr__ = moved(
    "vision_attn.explain.report",
    {
        "read_training_curves": "vision_attn.report.page",
        "script_json": "vision_attn.report.page",
        "write_report": "vision_attn.report.page",
        "Report": "vision_attn.explain.records",
        "compact_data_uri": "vision_attn.explain.records",
        "png_data_uri": "vision_attn.explain.records",
        "quantise": "vision_attn.explain.records",
    },
)
