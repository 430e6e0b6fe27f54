"""Explanations: capture attention and turn it into maps."""

from vision_attn.explain.capture import AttentionCaptureError, attention_modules, capture_attention

__all__ = ["AttentionCaptureError", "attention_modules", "capture_attention"]
