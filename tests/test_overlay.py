"""OpenCV overlays: RGB uint8 in/out, the heat sits where the saliency is, edge cases handled."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from vision_attn.explain.overlay import draw_box, image_grid, overlay_saliency, put_text, save_png


def test_heat_sits_where_the_saliency_is_and_rgb_order():
    img = np.full((64, 96, 3), 128, np.uint8)
    sal = np.zeros((4, 6), np.float32)
    sal[0, 5] = 1.0  # top-right patch
    out = overlay_saliency(img, sal, alpha=0.6)
    assert out.shape == (64, 96, 3) and out.dtype == np.uint8
    top_right, bottom_left = out[:16, 80:].reshape(-1, 3).mean(0), out[48:, :16].reshape(-1, 3).mean(0)
    # JET: high = red, low = blue; RGB order, so channel 0 is red.
    assert top_right[0] > top_right[2] + 40
    assert bottom_left[2] > bottom_left[0] + 40


def test_edge_cases_zero_constant_grey_rgba_tensor_and_nan():
    grey = np.zeros((20, 30), np.uint8)
    for sal in (np.zeros((2, 3)), np.full((2, 3), 0.5), np.array([[np.nan, 1.0, 0.2], [0.0, 0.0, 0.0]])):
        out = overlay_saliency(grey, sal)
        assert out.shape == (20, 30, 3) and out.dtype == np.uint8
    rgba = np.zeros((20, 30, 4), np.uint8)
    assert overlay_saliency(rgba, torch.rand(2, 3)).shape == (20, 30, 3)
    with pytest.raises(TypeError, match="uint8"):
        overlay_saliency(np.zeros((4, 4, 3), np.float32), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="saliency"):
        overlay_saliency(grey, np.zeros((2, 2, 2)))


def test_text_box_grid_and_png_roundtrip(tmp_path):
    img = np.zeros((40, 60, 3), np.uint8)
    labelled = put_text(img, "circle 0.98")
    assert labelled[:15].max() == 255 and img.max() == 0  # drawn on a copy
    boxed = draw_box(img, (5, 5, 30, 30), label="a")
    r, g, b = boxed[20, 5].tolist()  # on the left edge: yellow (anti-aliased)
    assert r > 200 and g > 200 and b < 50
    grid = image_grid([img, labelled, boxed], titles=["input", "rollout", "relevance"])
    assert grid.shape[1] > 3 * 128 and grid.dtype == np.uint8
    path = save_png(tmp_path / "sub" / "g.png", grid)
    back = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
    assert np.array_equal(back, grid)
    with pytest.raises(OSError, match="could not write"):
        save_png(tmp_path / "bad.unknownext", grid)
