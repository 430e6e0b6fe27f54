"""Per-word attention maps, strips and the pointing game, on hand-built cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vision_attn.explain.captioning import caption_strip, pointing_game, word_attention_maps


def test_word_maps_pick_the_layer_and_normalise():
    att = torch.zeros(4, 2, 6)  # (T, L, N) for a 2 x 3 grid
    att[0, 1, 5] = 1.0  # word 0, last layer: bottom-right patch
    att[0, 0, 0] = 1.0  # word 0, first layer: top-left patch
    att[1, :, 2] = 0.5
    maps = word_attention_maps(att, 2, (2, 3), "last")
    assert maps.shape == (2, 2, 3)
    assert maps[0, 1, 2] == 1 and maps[0].sum() == 1
    assert maps[1, 0, 2] == 1  # scaled to maximum 1
    mean = word_attention_maps(att, 2, (2, 3), "mean")
    assert mean[0, 0, 0] == pytest.approx(1.0) and mean[0, 1, 2] == pytest.approx(1.0)


def test_pointing_game_hits_misses_and_chance():
    maps = torch.zeros(3, 4, 4)
    maps[0, 0, 0] = 1  # "circle" peaks in the top-left patch
    maps[1, 3, 3] = 1  # "red" peaks bottom-right
    maps[2, 0, 0] = 1  # "and" names nothing: not counted
    boxes = [({"circle", "blue"}, [0.0, 0.0, 0.5, 0.5]), ({"square", "red"}, [0.5, 0.5, 1.0, 1.0])]
    hits, total, chance = pointing_game(["circle", "red", "and"], maps, boxes)
    assert (hits, total) == (2, 2)
    assert chance == pytest.approx(4 / 16 + 4 / 16)  # each box covers 4 of 16 patch centres
    hits, total, _ = pointing_game(["square", "blue", "and"], maps, boxes)  # peaks on the other objects
    assert (hits, total) == (0, 2)
    assert pointing_game(["circle"], maps[:1], []) == (0, 0, 0.0)


def test_caption_strip_has_a_tile_per_word():
    rgb = np.zeros((32, 32, 3), np.uint8)
    maps = torch.rand(3, 4, 4)
    strip = caption_strip(rgb, ["a", "red", "circle"], maps, cols=8)
    assert strip.dtype == np.uint8 and strip.ndim == 3
    one = caption_strip(rgb, ["a"], maps[:1], cols=8)
    assert strip.shape[1] > one.shape[1]  # wider with more words
    wrapped = caption_strip(rgb, ["a", "red", "circle"], maps, cols=2)
    assert wrapped.shape[0] > strip.shape[0]  # wraps into rows
