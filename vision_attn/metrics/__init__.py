"""Metrics: caption scores (BLEU, CIDEr-D, ...), caption content checks, and the per-class and
COCO size breakdowns of evaluations."""
