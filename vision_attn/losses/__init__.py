"""Losses: Hungarian matching and the DETR set criterion."""

from vision_attn.losses.matcher import HungarianMatcher

__all__ = ["HungarianMatcher"]
