"""Localisation against ground truth: back-mapping to original pixels, pointing game, energy."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vision_attn.data.transforms import build_display_transform
from vision_attn.errors import DataError
from vision_attn.explain.localisation import (
    energy_share,
    eval_geometry,
    grid_to_image,
    load_image_boxes,
    localisation,
    pointing_hit,
)

PRE = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3, "interpolation": "bicubic"}


# ---------------------------------------------------------------------------- pointing and energy
def test_pointing_first_index_on_ties_and_one_pixel_tolerance():
    m = np.zeros((10, 20), np.float32)
    m[2, 5] = m[7, 15] = 1.0  # a tie: the first in row-major order (row 2, col 5; centre 5.5, 2.5) counts
    assert pointing_hit(m, [[5, 2, 6, 3]])
    assert not pointing_hit(m, [[15, 7, 16, 8]])  # the second maximum's box: not the one that counts
    # within 1 px: the centre (5.5, 2.5) is 1.0 px right of a box ending at x = 4.5 -> a hit ...
    assert pointing_hit(m, [[0, 0, 4.5, 9]])
    assert not pointing_hit(m, [[0, 0, 4.49, 9]])  # ... 1.01 px -> a miss
    # the distance is Euclidean: 0.8 px right and 0.8 px below a corner is 1.13 px away
    assert not pointing_hit(m, [[0, 0, 4.7, 1.7]])
    assert pointing_hit(m, [[0, 0, 4.7, 1.9]])  # 0.8 and 0.6: exactly 1.0
    assert pointing_hit(m, [[30, 30, 40, 40], [5, 2, 6, 3]])  # any of several boxes
    assert not pointing_hit(m, [])
    assert pointing_hit(np.zeros((4, 4)), [[0, 0, 1, 1]])  # a flat map points at its first pixel


def test_energy_share_counts_pixel_centres_inside_the_union_of_boxes():
    m = np.zeros((4, 6))
    m[1, 1] = 3.0  # centre (1.5, 1.5)
    m[2, 4] = 1.0  # centre (4.5, 2.5)
    m[0, 0] = -5.0  # negative values carry no mass
    assert energy_share(m, [[1, 1, 2, 2]]) == pytest.approx(0.75)
    assert energy_share(m, [[1, 1, 2, 2], [0, 0, 2, 2]]) == pytest.approx(0.75)  # overlap counted once
    assert energy_share(m, [[0, 0, 6, 4]]) == pytest.approx(1.0)
    assert energy_share(m, [[4.6, 0, 6, 4]]) == 0.0  # the centre 4.5 lies outside [4.6, 6]
    assert energy_share(np.zeros((3, 3)), [[0, 0, 3, 3]]) == 0.0
    assert localisation(m, [[1, 1, 2, 2]]) == (True, pytest.approx(0.75))


def test_concentrated_map_scores_one_and_random_map_the_box_area_share():
    rng = np.random.default_rng(0)
    box = [[16, 8, 40, 24]]  # 24 x 16 of a 64 x 32 image: area share 0.1875
    conc = np.zeros((32, 64))
    conc[10:22, 20:36] = rng.uniform(0.5, 1, (12, 16))
    assert localisation(conc, box) == (True, pytest.approx(1.0))
    pre = {**PRE, "input_size": (3, 32, 64), "crop_pct": 1.0, "crop_mode": "squash"}
    energies, hits = [], []
    for _ in range(200):
        mapped = grid_to_image(rng.uniform(size=(4, 8)), (32, 64), pre)
        hit, energy = localisation(mapped, box)
        energies.append(energy)
        hits.append(hit)
    assert np.mean(energies) == pytest.approx(24 * 16 / (32 * 64), abs=0.02)
    assert 0.05 < np.mean(hits) < 0.45  # chance: about the box's share of the image


# ---------------------------------------------------------------------------- back-mapping
def test_geometry_by_hand_center_crop_non_square():
    # 30 x 60 image, input 32, crop_pct 0.8: the shorter side to floor(32 / 0.8) = 40 -> 40 x 80,
    # centre crop 32: top round(8 / 2) = 4, left round(48 / 2) = 24.
    geo = eval_geometry((30, 60), {**PRE, "crop_pct": 0.8, "crop_mode": "center"})
    assert (geo.resized, geo.offset, geo.input) == ((40, 80), (4, 24), (32, 32))
    # squash: both sides to 40, crop (4, 4); border: the longer side to 40 -> 20 x 40, pad 6 rows
    assert eval_geometry((30, 60), {**PRE, "crop_pct": 0.8, "crop_mode": "squash"}).offset == (4, 4)
    border = eval_geometry((30, 60), {**PRE, "crop_pct": 0.8, "crop_mode": "border"})
    assert (border.resized, border.offset) == ((20, 40), (-6, 4))


def test_known_patch_lands_where_it_belongs_in_original_pixels():
    # Patch (row 1, col 2) of a 4 x 4 grid (8 px patches) covers input y 8..16, x 16..24 -> resized
    # y 12..20, x 40..48 -> original y 9..15, x 30..36 (scale 30/40 = 60/80 = 0.75): rows 9..14 and
    # columns 30..35 have their centre there. Input rows 0..32 come from original y 3..27 and
    # columns from x 18..42: everything else was cut off and is 0.
    pre = {**PRE, "crop_pct": 0.8, "crop_mode": "center"}
    grid = np.zeros((4, 4))
    grid[1, 2] = 1.0
    mapped = grid_to_image(grid, (30, 60), pre, mode="nearest")
    expected = np.zeros((30, 60), np.float32)
    expected[9:15, 30:36] = 1.0
    assert mapped.shape == (30, 60) and mapped.dtype == np.float32
    np.testing.assert_array_equal(mapped, expected)
    covered = grid_to_image(np.ones((4, 4)), (30, 60), pre, mode="nearest")
    expected_cover = np.zeros((30, 60), np.float32)
    expected_cover[3:27, 18:42] = 1.0
    np.testing.assert_array_equal(covered, expected_cover)
    bilinear = grid_to_image(grid, (30, 60), pre)  # peaks at the patch centre: input (12, 20) -> (12, 33)
    r, c = np.unravel_index(np.argmax(bilinear), bilinear.shape)
    assert (r, c) == (11, 32)  # the first of the tied pixels around the centre (11.5..12.5, 32.5..33.5)
    assert bilinear[3:27, 18:42].sum() == pytest.approx(bilinear.sum()) and bilinear.max() <= 1.0


def test_bilinear_equals_torch_interpolate_without_crop():
    # squash at crop_pct 1 and an original of the input's size: the map is F.interpolate's exactly
    pre = {**PRE, "input_size": (3, 24, 40), "crop_pct": 1.0, "crop_mode": "squash"}
    grid = torch.rand(3, 3, 5, generator=torch.Generator().manual_seed(0))
    ref = F.interpolate(grid[:, None], size=(24, 40), mode="bilinear", align_corners=False)[:, 0]
    np.testing.assert_allclose(grid_to_image(grid, (24, 40), pre), ref.numpy(), atol=1e-6)


@pytest.mark.parametrize("mode", ["center", "squash", "border"])
@pytest.mark.parametrize("size", [(30, 60), (61, 23)])
@pytest.mark.parametrize("input_size", [(3, 32, 32), (3, 24, 40)])
def test_geometry_matches_the_real_eval_transform(mode, size, input_size):
    """Every model-input pixel of the real (timm) transform, with nearest interpolation, shows
    the original pixel whose centre our mapping sends there (to within half a resized pixel)."""
    h, w = size
    pre = {**PRE, "input_size": input_size, "crop_pct": 0.8, "crop_mode": mode, "interpolation": "nearest"}
    img = np.zeros((h, w, 3), np.uint8)
    yy, xx = np.mgrid[:h, :w]
    img[..., 0], img[..., 1], img[..., 2] = xx * 3, yy * 3, 200  # each pixel names its coordinates
    seen = build_display_transform(pre)(img)
    geo = eval_geometry(size, pre)
    assert seen.shape[:2] == geo.input
    v, u = np.nonzero(seen[..., 2] == 200)  # not padding
    y, x = seen[v, u, 1] // 3, seen[v, u, 0] // 3
    iy, ix = geo.to_input(y + 0.5, x + 0.5)
    scale = max(geo.resized[0] / h, geo.resized[1] / w, 1.0)
    assert np.abs(iy - (v + 0.5)).max() <= scale / 2 + 1e-6
    assert np.abs(ix - (u + 0.5)).max() <= scale / 2 + 1e-6


# ---------------------------------------------------------------------------- COCO boxes
def test_load_image_boxes_reads_xywh_and_names_bad_entries(tmp_path):
    coco = {"images": [{"id": 1, "file_name": "val/circle/000001.png"}, {"id": 2, "file_name": "b.png"}],
            "annotations": [{"id": 5, "image_id": 1, "category_id": 3, "bbox": [1, 2, 3, 4]}],
            "categories": [{"id": 3, "name": "circle"}]}
    path = tmp_path / "a.json"
    path.write_text(json.dumps(coco))
    assert load_image_boxes(path) == {"val/circle/000001.png": [("circle", (1.0, 2.0, 4.0, 6.0))], "b.png": []}
    coco["annotations"][0]["bbox"] = [1, 2, -3, 4]
    path.write_text(json.dumps(coco))
    with pytest.raises(DataError, match=r"a\.json: annotation id 5 has bbox"):
        load_image_boxes(path)
    coco["annotations"][0].update(bbox=[1, 2, 3, 4], category_id=9)
    path.write_text(json.dumps(coco))
    with pytest.raises(DataError, match="category_id 9"):
        load_image_boxes(path)
    with pytest.raises(DataError, match="does not exist"):
        load_image_boxes(tmp_path / "missing.json")


# ---------------------------------------------------------------------------- eval integration
def _non_square_folder(root, masks: bool = False):
    """``root/val/{a,b}/*.png``: dark non-square images (30 x 60 and 61 x 23) with one bright
    rectangle inside the part the centre crop keeps, and its box in ``root/boxes.json`` (with
    ``masks``: its pixels as a COCO polygon too)."""
    import cv2

    # (H, W) -> a box (x0, y0, x1, y1) inside the kept part (see test_known_patch_lands...)
    layouts = {(30, 60): [(22, 8, 34, 20), (28, 12, 40, 24)], (61, 23): [(6, 25, 17, 36), (4, 22, 16, 33)]}
    images, anns, k = [], [], 0
    for cls in ("a", "b"):
        (root / "val" / cls).mkdir(parents=True)
        for (h, w), boxes in layouts.items():
            for x0, y0, x1, y1 in boxes:
                img = np.full((h, w, 3), 20, np.uint8)
                img[y0:y1, x0:x1] = 230
                rel = f"val/{cls}/{k:02d}.png"
                cv2.imwrite(str(root / rel), img)
                images.append({"id": k, "file_name": rel, "width": w, "height": h})
                anns.append({"id": k, "image_id": k, "category_id": 1 + (cls == "b"),
                             "bbox": [x0, y0, x1 - x0, y1 - y0]})
                if masks:  # the rectangle's pixels [x0, x1) x [y0, y1)
                    anns[-1]["segmentation"] = [[x0, y0, x1, y0, x1, y1, x0, y1]]
                k += 1
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    (root / "boxes.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root / "boxes.json", {im["file_name"]: (im["height"], im["width"]) for im in images}


@contextlib.contextmanager
def _brightness_on_a_cropping_classifier(root: Path):
    """A tiny classifier that centre-crops (crop_pct 0.8) the images of ``root`` (``val/{a,b}``), its
    validation set, and a ``brightness`` method (each patch's mean brightness of the model input,
    registered for the block only)."""
    from vision_attn import create_encoder
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.methods import METHODS, register_method
    from vision_attn.tasks import ClassificationTask

    from .conftest import TINY_VIT

    @register_method("brightness", description="test: the mean brightness of each patch of the input")
    def _bright(x):
        return F.avg_pool2d(x.images.mean(dim=1, keepdim=True), 8)[:, 0]  # (B, 4, 4)

    try:
        torch.manual_seed(0)
        crop = {"crop_pct": 0.8, "crop_mode": "center"}
        encoder = create_encoder("vit_tiny_patch16_224", **TINY_VIT, preprocess=crop)
        task = ClassificationTask(encoder, class_names=["a", "b"]).eval()
        yield task, ImageFolderDataset(root, "val", ["a", "b"], build_eval_transform(task.data_config))
    finally:
        METHODS.pop("brightness")


def test_eval_split_localises_through_a_centre_crop_and_saves_maps(tmp_path):
    """A method that follows the bright pixels of the model input points into the object's box
    in the original, non-square image (crop_pct 0.8, centre crop): the grid is mapped back
    where the transform took it from. It ignores the weights: sanity correlation 1."""
    from vision_attn.explain.evaluate import ExplainOptions, explain_eval_split

    box_file, sizes = _non_square_folder(tmp_path / "data")
    with _brightness_on_a_cropping_classifier(tmp_path / "data") as (task, ds):
        options = ExplainOptions(methods=["brightness", "attention"], num_overlays=0, faithfulness=False,
                                 faithfulness_images=8, batch_size=3, report=False, annotations=str(box_file),
                                 save_maps=True, sanity=True)
        out = tmp_path / "out"
        metrics = explain_eval_split(task, ds, options, out)
    assert metrics["pointing_brightness"] == 1.0 and metrics["energy_brightness"] > 0.5
    assert metrics["energy_random"] < metrics["energy_brightness"]
    assert metrics["sanity_brightness"] == pytest.approx(1.0) and metrics["sanity_random"] == pytest.approx(1.0)
    assert metrics["explain_images"] == 8.0 and {"pointing_attention", "energy_attention"} <= set(metrics)
    index = json.loads((out / "maps" / "index.json").read_text())
    assert [e["index"] for e in index] == list(range(8))
    assert [e["file"] for e in index] == [ds.samples[i][0] for i in range(8)]
    for method in ("brightness", "attention", "random"):
        for e in index:
            saved = np.load(out / "maps" / method / f"{e['index']:05d}.npy")
            assert saved.dtype == np.float32 and saved.shape == sizes[e["file"]]
    curve = json.loads((out / "sanity.json").read_text())
    assert curve["steps"] == ["head", "block1", "block0", "all"]
    assert curve["methods"]["brightness"]["all"] == pytest.approx(1.0)


def test_annotations_that_name_no_explained_image_are_a_clear_error(tmp_path, shapes_root):
    from vision_attn import create_encoder
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import ExplainOptions, explain_eval_split
    from vision_attn.tasks import ClassificationTask

    from .conftest import TINY_VIT

    names = ["circle", "cross", "square", "star", "triangle"]
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=names).eval()
    ds = ImageFolderDataset(shapes_root, "val", names, build_eval_transform(task.data_config))
    coco = json.loads((shapes_root / "annotations" / "instances_val.json").read_text())
    for im in coco["images"]:
        im["file_name"] = im["file_name"].split("/", 1)[1]  # relative to the split folder: wrong
    (tmp_path / "bad.json").write_text(json.dumps(coco))
    options = ExplainOptions(methods=["attention"], num_overlays=0, faithfulness=False, faithfulness_images=3,
                             report=False, annotations=str(tmp_path / "bad.json"))
    with pytest.raises(DataError, match=r"bad\.json: none of the 3 explained images.*'val/\w+/0\d+\.png'"):
        explain_eval_split(task, ds, options, tmp_path / "out")


def test_eval_main_writes_localisation_sanity_and_maps(shapes_root, tmp_path):
    """eval.py end to end on a tiny trained classifier and the embedded shapes data: its own
    boxes are found without --explain.annotations; the maps match predictions.json's files."""
    from vision_attn.commands.evaluate import eval_main
    from vision_attn.commands.train import train_main

    from .conftest import REPO

    enc = "--model.init_args.encoder.init_args."
    common = ["--config", str(REPO / "configs" / "classification" / "shapes.yaml"),
              "--data.init_args.root", str(shapes_root), "--data.init_args.batching.num_workers", "0"]
    train_main([*common, "--data.init_args.batching.batch_size", "20", f"{enc}embed_dim", "32", f"{enc}depth", "2",
                f"{enc}num_heads", "2", f"{enc}patch_size", "8", "--trainer.max_epochs", "1",
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--trainer.default_root_dir", str(tmp_path / "run")])
    out = tmp_path / "eval"
    metrics = eval_main([*common, "--ckpt_path", str(tmp_path / "run" / "checkpoints" / "last.ckpt"),
                         "--output_dir", str(out), "--explain.num_overlays", "0", "--explain.report", "false",
                         "--explain.faithfulness_images", "6", "--explain.steps", "2",
                         "--explain.save_maps", "true", "--explain.sanity", "true"])
    saved = json.loads((out / "metrics.json").read_text())
    assert saved == metrics
    methods = ("rollout", "relevance", "attention", "random")
    for m in methods:
        assert 0.0 <= saved[f"pointing_{m}"] <= 1.0 and 0.0 <= saved[f"energy_{m}"] <= 1.0
        assert -1.0 <= saved[f"sanity_{m}"] <= 1.0
    assert saved["sanity_random"] == pytest.approx(1.0)
    preds = json.loads((out / "predictions.json").read_text())
    index = json.loads((out / "maps" / "index.json").read_text())
    assert len(index) == 6 and all(e["file"] == preds[e["index"]]["file"] for e in index)
    assert all(e["label"] == preds[e["index"]]["label"] for e in index)
    for m in methods:
        assert np.load(out / "maps" / m / f"{index[0]['index']:05d}.npy").shape == (32, 32)


def test_eval_split_scores_maps_against_masks_as_chefer_does(tmp_path):
    """With masks in the annotation file, the classification evaluation adds pixel accuracy,
    mIoU and mAP per method: a map that follows the bright object scores near 1, the random
    baseline near chance, and a method that ignores the object in between."""
    from vision_attn.explain.evaluate import ExplainOptions, explain_eval_split

    box_file, _ = _non_square_folder(tmp_path / "data", masks=True)
    with _brightness_on_a_cropping_classifier(tmp_path / "data") as (task, ds):
        options = ExplainOptions(methods=["brightness"], num_overlays=0, faithfulness=False, faithfulness_images=8,
                                 batch_size=4, report=False, annotations=str(box_file))
        metrics = explain_eval_split(task, ds, options, tmp_path / "out")
    assert {"pixel_acc_brightness", "miou_brightness", "map_mask_brightness", "miou_random"} <= set(metrics)
    assert metrics["miou_brightness"] > 0.6 and metrics["map_mask_brightness"] > 0.8
    assert metrics["pixel_acc_brightness"] > 0.8
    assert metrics["miou_random"] < metrics["miou_brightness"] - 0.2
    assert metrics["map_mask_random"] < metrics["map_mask_brightness"] - 0.2
