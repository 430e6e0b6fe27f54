"""Explanation maps against object masks (vision_attn.explain.segmentation): Chefer et al.'s pixel
accuracy, mIoU and mAP, checked by hand and against scikit-learn; COCO masks decoded in every form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vision_attn.data.masks import compressed_counts
from vision_attn.data.strokes import mask_to_rle
from vision_attn.errors import DataError
from vision_attn.explain.localisation import load_image_boxes, load_image_objects
from vision_attn.explain.measures import Localisation
from vision_attn.explain.segmentation import (
    SegmentationScores,
    average_precision,
    decode_segmentation,
    segmentation_counts,
)


def test_average_precision_equals_scikit_learn_with_ties():
    from sklearn.metrics import average_precision_score

    rng = np.random.default_rng(0)
    for _ in range(20):
        labels = rng.random(200) < rng.uniform(0.05, 0.6)
        scores = np.round(rng.random(200) + labels * rng.uniform(0, 1), 1)  # many ties
        assert average_precision(scores, labels) == pytest.approx(average_precision_score(labels, scores), abs=1e-12)
    assert np.isnan(average_precision(np.arange(4.0), np.zeros(4, bool)))


def test_counts_of_a_hand_made_case():
    image_map = np.array([[0.0, 1.0, 2.0, 3.0]] * 2)  # scaled to 0, 1/3, 2/3, 1; mean 0.5
    mask = np.array([[False, False, True, True], [False, True, True, True]])
    c = segmentation_counts(image_map, mask)
    # predicted object: columns 2 and 3 (above the mean), in both rows
    assert c["correct"] == 7 and c["labeled"] == 8  # only (row 1, column 1) is wrong
    assert c["inter"].tolist() == [3, 4] and c["union"].tolist() == [4, 5]
    # AP of the object: scores 1, 2/3 (4 object pixels), then 1/3 (1 object, 1 not), then 0 (2 not)
    ap_object = 0.8 * 1.0 + 0.2 * (5 / 6)
    # AP of the background (scores 1 - map): 1 (2 background), then 2/3 (1 bg, 1 object), ...
    ap_background = (2 / 3) * 1.0 + (1 / 3) * (3 / 4)
    assert c["ap"] == pytest.approx((ap_object + ap_background) / 2)


def test_scores_over_items_a_perfect_an_inverted_and_a_random_map():
    rng = np.random.default_rng(1)
    masks = []
    for _ in range(10):
        m = np.zeros((16, 16), bool)
        y, x = rng.integers(0, 8, 2)
        m[y:y + 8, x:x + 8] = True
        masks.append(m)
    perfect, inverted, noise = SegmentationScores(), SegmentationScores(), SegmentationScores()
    for m in masks:
        perfect.update({"m": m.astype(float)}, [m])
        inverted.update({"m": (~m).astype(float)}, [m])
        noise.update({"m": rng.random((8, 16, 16))}, [m])  # eight draws of a random map
    assert perfect.compute() == {"pixel_acc_m": 1.0, "miou_m": 1.0, "map_mask_m": 1.0}
    inv = inverted.compute()
    # a binary map gives two scores: AP falls to the share of each class, 0.5 in the mean here
    assert inv["pixel_acc_m"] == 0.0 and inv["miou_m"] == 0.0 and inv["map_mask_m"] == pytest.approx(0.5)
    rnd = noise.compute()
    assert 0.4 < rnd["pixel_acc_m"] < 0.6 and 0.25 < rnd["miou_m"] < 0.45 and 0.4 < rnd["map_mask_m"] < 0.6
    # by hand over two items: pixel accuracy sums the pixels first, mIoU the intersections and unions
    two = SegmentationScores()
    inverted_map = (~masks[1]).astype(float)
    a, b = segmentation_counts(masks[0].astype(float), masks[0]), segmentation_counts(inverted_map, masks[1])
    two.update({"m": masks[0].astype(float)}, [masks[0]])
    two.update({"m": inverted_map}, [masks[1]])
    out = two.compute()
    assert out["pixel_acc_m"] == (a["correct"] + b["correct"]) / 512
    assert out["miou_m"] == pytest.approx(np.mean((a["inter"] + b["inter"]) / (a["union"] + b["union"])))
    assert not two.update({"m": masks[0].astype(float)}, []) and not two.update({"m": masks[0]}, [np.zeros((16, 16))])


def test_localisation_adds_the_mask_scores_when_given_masks():
    m = np.zeros((10, 10), bool)
    m[2:6, 3:8] = True
    loc = Localisation(progress=False)
    loc.update({"a": m.astype(float)}, [(3, 2, 8, 6)], [m])
    out = loc.compute()
    assert out["pointing_a"] == 1.0 and out["miou_a"] == 1.0
    plain = Localisation(progress=False)
    plain.update({"a": m.astype(float)}, [(3, 2, 8, 6)])
    assert set(plain.compute()) == {"pointing_a", "energy_a"}


def test_every_coco_mask_form_decodes_to_the_same_pixels():
    from pycocotools import mask as coco_mask

    m = np.zeros((7, 9), bool)
    m[1:5, 2:7] = True
    polygon = [[2, 1, 7, 1, 7, 5, 2, 5]]  # the rectangle's corners, pixels [2, 7) x [1, 5)
    compressed = coco_mask.encode(np.asfortranarray(m.astype(np.uint8)))
    compressed["counts"] = compressed["counts"].decode("ascii")
    for form in (polygon, mask_to_rle(m), compressed):
        assert np.array_equal(decode_segmentation(form, 7, 9), m), form
    wide = np.zeros((7, 9), bool)
    wide[1:5, 2:] = True  # vertices off the image (within its size of it) are fine
    assert np.array_equal(decode_segmentation([[2, 1, 17.9, 1, 17.9, 5, 2, 5]], 7, 9), wide)
    for bad, match in (([[1, 2, 3]], "polygons"), ({"size": [8, 9], "counts": [63]}, "size"),
                       ({"size": [7, 9], "counts": [5, -1]}, "non-negative"), ("x", "polygons or an RLE"),
                       ([[0, 0, float("nan"), 1, 2, 2]], "polygons"),
                       ([[0, 0, 10**6, 0, 10**6, 10**6]], "vertex lies more than the image's size"),
                       ([[0, 0, 9, 7] * 200], "outline .* is over 100 times")):  # 200 trips corner to corner
        with pytest.raises(DataError, match=match):
            decode_segmentation(bad, 7, 9, "ann 3")


def test_compressed_rle_runs_equal_pycocotools_and_must_cover_the_image():
    """Runs of pycocotools' own strings (deltas, long runs, empty and full masks) read back as the
    column-major runs of the mask; a string whose runs cover less or more than the image is refused
    (pycocotools would fill the rest of a short one from memory it never wrote)."""
    from pycocotools import mask as coco_mask

    rng = np.random.default_rng(0)
    for h, w, p in ((7, 9, 0.0), (7, 9, 1.0), (40, 33, 0.5), (50, 60, 0.05), (1, 1, 1.0)):
        m = rng.random((h, w)) < p
        counts = coco_mask.encode(np.asfortranarray(m.astype(np.uint8)))["counts"].decode("ascii")
        flat = m.flatten(order="F")
        edges = np.flatnonzero(np.diff(flat.astype(int))) + 1
        runs = np.diff(np.r_[0, edges, flat.size]).tolist()
        expected = runs if not flat[0] else [0, *runs]
        assert compressed_counts(counts) == expected
        assert np.array_equal(decode_segmentation({"size": [h, w], "counts": counts}, h, w), m)
    two_by_two = coco_mask.encode(np.asfortranarray(np.ones((2, 2), np.uint8)))["counts"].decode("ascii")
    for counts, match in ((two_by_two, "cover 4 pixels, not height x width = 63"), ("", "cover 0 pixels"),
                          ("0z", "not a compressed RLE character"), ("0P", "end inside a run"),
                          ("351F", "run 3 .* is negative"),
                          ("o" * 10**6, "longer than 64 bits")):
        with pytest.raises(DataError, match=match):
            decode_segmentation({"size": [7, 9], "counts": counts}, 7, 9, "ann 4")


def test_instances_file_objects_with_masks(tmp_path):
    m = np.zeros((6, 8), bool)
    m[1:4, 2:5] = True
    coco = {"images": [{"id": 1, "file_name": "val/a.png", "height": 6, "width": 8}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 1, 3, 3],
                             "segmentation": mask_to_rle(m)},
                            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [0, 0, 1, 1]}],
            "categories": [{"id": 1, "name": "a"}]}
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(coco))
    objects = load_image_objects(path)["val/a.png"]
    assert [(n, b) for n, b, _ in objects] == load_image_boxes(path)["val/a.png"]
    assert np.array_equal(objects[0][2].decode(), m) and objects[1][2] is None
    del coco["images"][0]["height"]
    path.write_text(json.dumps(coco))
    with pytest.raises(DataError, match="annotation id 1 has a 'segmentation'.*'height' and 'width'"):
        load_image_objects(path)
    coco["images"][0].update(height=10**6, width=10**6)  # no mask of a trillion pixels is decoded
    path.write_text(json.dumps(coco))
    with pytest.raises(DataError, match="at most"):
        load_image_objects(path)
