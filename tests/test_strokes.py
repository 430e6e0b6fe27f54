"""The hand-drawn stroke scenes: masks that pycocotools decodes to the ink, boxes and captions
that agree with them, and captions whose content a template cannot guess."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from vision_attn.data.strokes import StrokeSceneConfig, ensure_stroke_scenes, mask_to_rle, render_stroke_scene
from vision_attn.data.synthetic import DIGIT_WORDS
from vision_attn.metrics.reference_content import reference_content

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools on numpy 2


def test_rle_is_what_pycocotools_decodes():
    rng = np.random.default_rng(0)
    for shape in [(5, 7), (16, 16), (1, 1)]:
        mask = rng.random(shape) > 0.6
        mask[0, 0] = bool(rng.integers(2))
        rle = mask_to_rle(mask)
        decoded = mask_utils.decode(mask_utils.frPyObjects(rle, *shape))
        assert np.array_equal(decoded.astype(bool), mask)
        assert sum(rle["counts"]) == mask.size


def test_scenes_follow_the_coco_layout_with_masks_boxes_and_captions(tmp_path):
    config = StrokeSceneConfig(num_train=12, num_val=6)
    root = ensure_stroke_scenes(config, tmp_path)
    assert ensure_stroke_scenes(config, tmp_path) == root  # generated once
    inst = json.loads((root / "annotations" / "instances_val.json").read_text())
    caps = json.loads((root / "annotations" / "captions_val.json").read_text())
    assert [c["name"] for c in inst["categories"]] == list(DIGIT_WORDS)
    assert len(inst["images"]) == 6 and len(caps["annotations"]) == 6 * config.captions_per_image
    by_image: dict[int, list[dict]] = {}
    for ann in inst["annotations"]:
        by_image.setdefault(ann["image_id"], []).append(ann)
        m = mask_utils.decode(mask_utils.frPyObjects(ann["segmentation"], 64, 64)).astype(bool)
        assert m.sum() == ann["area"] > 0
        ys, xs = np.nonzero(m)
        x, y, w, h = ann["bbox"]
        assert (x, y, x + w - 1, y + h - 1) == (xs.min(), ys.min(), xs.max(), ys.max())
        assert 0 <= x and x + w <= 64 and 0 <= y and y + h <= 64
    for cap in caps["annotations"]:  # every caption names the image's digits, and only those
        names = {DIGIT_WORDS[a["category_id"] - 1] for a in by_image.get(cap["image_id"], [])}
        said = {w for w in cap["caption"].replace(",", " ").split() if w in DIGIT_WORDS}
        assert said == names, cap
    assert (root / "val" / inst["images"][0]["file_name"]).is_file()


def test_the_ink_is_where_the_mask_says():
    rng = np.random.default_rng(3)
    img, placed, _ = render_stroke_scene(rng, 64, [1, 8])
    for _, mask in placed:
        around = np.zeros_like(mask)
        ys, xs = np.nonzero(mask)
        around[max(ys.min() - 3, 0):ys.max() + 4, max(xs.min() - 3, 0):xs.max() + 4] = True
        background = around & ~mask
        # the ink differs from the pixels right around it
        assert np.abs(img[mask].mean(0) - img[background].mean(0)).sum() > 40


def test_a_template_captioner_scores_near_chance_on_its_captions(tmp_path):
    root = ensure_stroke_scenes(StrokeSceneConfig(num_train=1, num_val=150, max_objects=2, min_objects=2), tmp_path)
    caps = json.loads((root / "annotations" / "captions_val.json").read_text())["annotations"]
    refs: dict[int, list[str]] = {}
    for c in caps:
        refs.setdefault(c["image_id"], []).append(c["caption"])
    held_out = {i: r[0] for i, r in refs.items()}
    rest = {i: r[1:] for i, r in refs.items()}
    good = reference_content(held_out, rest)
    assert good["objects_exact"] > 0.95 and good["hallucination_rate"] < 0.02
    template = dict.fromkeys(refs, "a six written above a seven")
    blind = {i: "a {} written above a {}".format(*random.Random(i).sample(DIGIT_WORDS, 2)) for i in refs}
    for captions in (template, blind):
        scores = reference_content(captions, rest)
        assert scores["objects_exact"] < 0.1 and scores["hallucination_rate"] > 0.6
