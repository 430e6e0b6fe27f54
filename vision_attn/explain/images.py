"""Resizing the small images that explanation panels show, without smoothing."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

__all__ = ["dataset_picture", "enlarge", "resize_nearest"]


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


def dataset_picture(dataset, i: int) -> np.ndarray:
    """Image ``i`` of a split as the explanations draw on it: ``dataset.read_rgb(i)`` when the
    dataset has it (the read its model input and boxes come from), else its file under
    ``dataset.root`` (``dataset.relative_file(i)``)."""
    if hasattr(dataset, "read_rgb"):
        return dataset.read_rgb(i)
    from vision_attn.data.imageio import read_image

    return read_image(Path(dataset.root) / str(dataset.relative_file(i)))
