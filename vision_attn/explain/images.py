"""Resizing the small images that explanation panels show, without smoothing."""

from __future__ import annotations

import cv2
import numpy as np

__all__ = ["enlarge", "resize_nearest"]


def resize_nearest(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """``rgb`` resized to ``width`` x ``height`` pixels by nearest neighbour (no new colours)."""
    return cv2.resize(rgb, (width, height), interpolation=cv2.INTER_NEAREST)


def enlarge(rgb: np.ndarray, side: int) -> np.ndarray:
    """``rgb`` enlarged by the smallest integer factor that makes its longer side at least
    ``side`` pixels (nearest neighbour: every pixel becomes a square block), so labels are
    readable and heat maps visible; ``rgb`` itself when it is that large already."""
    longer = max(rgb.shape[:2])
    if longer >= side:
        return rgb
    f = int(np.ceil(side / longer))
    return resize_nearest(rgb, rgb.shape[1] * f, rgb.shape[0] * f)
