"""``report.html``: the self-contained page of an evaluation or a folder run (:func:`write_report`)."""

from vision_attn.report.page import read_training_curves, script_json, write_report

__all__ = ["read_training_curves", "script_json", "write_report"]
