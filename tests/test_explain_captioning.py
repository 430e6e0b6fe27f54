"""Per-word attention maps, strips and the pointing game (original image pixels), on hand-built cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vision_attn.data.caption_objects import AnnotatedObjects
from vision_attn.explain.captioning import (
    caption_strip,
    named_words,
    pointing_game,
    random_word_maps,
    word_attention_maps,
)
from vision_attn.explain.localisation import grid_to_image


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


def test_pointing_game_scores_maps_in_original_pixels():
    """Maps over a 40 x 60 original image; boxes in its pixels (x0, y0, x1, y1)."""
    maps = np.zeros((3, 40, 60), np.float32)
    maps[0, 5, 5] = 1  # "circle" peaks at pixel centre (5.5, 5.5): inside its box
    maps[1, 30, 45] = 1  # "red" peaks inside the square's box
    maps[2, 5, 5] = 1  # "and" names nothing: not counted
    boxes = [({"circle", "blue"}, [0.0, 0.0, 20.0, 20.0]), ({"square", "red"}, [30.0, 20.0, 60.0, 40.0])]
    hits, total, energy = pointing_game(["circle", "red", "and"], maps, boxes)
    assert (hits, total) == (2, 2) and energy == pytest.approx(2.0)  # all mass inside, both words
    hits, total, energy = pointing_game(["square", "blue", "and"], maps, boxes)  # peaks on the other objects
    assert (hits, total, energy) == (0, 2, 0.0)
    assert pointing_game(["circle"], maps[:1], []) == (0, 0, 0.0)


def test_pointing_game_first_maximum_and_one_pixel_tolerance():
    box = [({"circle"}, [10.0, 10.0, 20.0, 20.0])]
    flat = np.ones((1, 30, 30), np.float32)  # ties everywhere: the first index (0, 0) is the maximum
    assert pointing_game(["circle"], flat, box)[:2] == (0, 1)
    flat[0, :, :] = 0
    flat[0, 10, 20] = 1  # centre (20.5, 10.5): 0.5 px right of the box -> a hit
    assert pointing_game(["circle"], flat, box)[:2] == (1, 1)
    flat[0, 10, 20], flat[0, 10, 21] = 0, 1  # centre (21.5, 10.5): 1.5 px away -> a miss
    assert pointing_game(["circle"], flat, box)[:2] == (0, 1)
    half = np.zeros((1, 30, 30), np.float32)
    half[0, 10:20, 10:20], half[0, 0, 0] = 1.0, 100.0  # peak outside, 100 of 200 mass inside
    hits, total, energy = pointing_game(["circle"], half, box)
    assert (hits, total) == (0, 1) and energy == pytest.approx(0.5)


def test_named_words_lists_each_words_own_boxes():
    boxes = [({"circle", "red"}, [0, 0, 1, 1]), ({"circle", "blue"}, [2, 2, 3, 3])]
    assert named_words(["a", "red", "circle", "dog"], boxes) == [(1, [[0, 0, 1, 1]]),
                                                                 (2, [[0, 0, 1, 1], [2, 2, 3, 3]])]


def test_named_words_read_plurals_multi_word_names_and_synonyms_as_content_accuracy_does():
    """The content parser's matcher (:class:`~vision_attn.data.caption_objects.ObjectVocabulary`):
    "circles" names the circle, "man" a person (a COCO synonym), "traffic light" the traffic
    light (scored at its last word, "light"); the longest name wins ("teddy bear" is no bear)."""
    person, light, circle = [0.0, 0.0, 10.0, 10.0], [20.0, 0.0, 30.0, 10.0], [0.0, 20.0, 10.0, 30.0]
    bear, teddy = [20.0, 20.0, 30.0, 30.0], [12.0, 12.0, 18.0, 18.0]
    boxes = [({"person"}, person), ({"traffic light"}, light), ({"circle", "red"}, circle), ({"bear"}, bear),
             ({"teddy bear"}, teddy)]
    words = "a man near two red circles under a traffic light with a teddy bear and bears".split()
    assert named_words(words, boxes) == [(1, [person]), (4, [circle]), (5, [circle]), (9, [light]), (13, [teddy]),
                                         (15, [bear])]
    # the pointing game scores each of those words against its own object's box
    maps = np.zeros((len(words), 32, 32), np.float32)
    peaks = {1: (5, 5), 4: (25, 5), 5: (25, 5), 9: (5, 25), 13: (15, 15), 15: (25, 25)}  # (row, column)
    for t, (r, c) in peaks.items():
        maps[t, r, c] = 1.0
    assert pointing_game(words, maps, boxes) == (6, 6, pytest.approx(6.0))
    maps[5], maps[9] = maps[1], maps[13]  # "circles" on the person, "light" on the teddy bear: misses
    assert pointing_game(words, maps, boxes) == (4, 6, pytest.approx(4.0))
    # the split's vocabulary, as content accuracy builds it: in an image with a bear only, "teddy
    # bear" still names a teddy bear (nothing here), "bears" the bear; colours word for word
    split = AnnotatedObjects(["person", "bear", "teddy bear"], ["red"], {}).vocabulary()
    only = [({"bear", "red"}, bear)]
    assert named_words("a red teddy bear and two bears".split(), only, split) == [(1, [bear]), (6, [bear])]


def test_random_baseline_points_at_about_the_box_share():
    """The random map, mapped to original pixels, hits a box and puts mass in it at about the
    box's share of the image."""
    gen = torch.Generator().manual_seed(0)
    grid = random_word_maps(2000, (4, 4), gen)
    pre = {"input_size": (3, 32, 32), "crop_pct": 1.0, "crop_mode": "squash"}
    maps = grid_to_image(grid, (48, 48), pre)  # (2000, 48, 48)
    assert maps.shape == (2000, 48, 48)
    box = [({"circle"}, [0.0, 0.0, 24.0, 24.0])]  # a quarter of the image
    hit_rate = sum(pointing_game(["circle"], m[None], box)[0] for m in maps) / len(maps)
    share = sum(pointing_game(["circle"], m[None], box)[2] for m in maps) / len(maps)
    assert hit_rate == pytest.approx(0.25, abs=0.04)
    assert share == pytest.approx(0.25, abs=0.02)


def test_caption_strip_has_a_tile_per_word():
    rgb = np.zeros((32, 32, 3), np.uint8)
    maps = torch.rand(3, 4, 4)
    strip = caption_strip(rgb, ["a", "red", "circle"], maps, cols=8)
    assert strip.dtype == np.uint8 and strip.ndim == 3
    one = caption_strip(rgb, ["a"], maps[:1], cols=8)
    assert strip.shape[1] > one.shape[1]  # wider with more words
    wrapped = caption_strip(rgb, ["a", "red", "circle"], maps, cols=2)
    assert wrapped.shape[0] > strip.shape[0]  # wraps into rows
