"""The embedded shapes generator: seeded, balanced, boxes that fit the pixels, atomic cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vision_attn.data.synthetic import (
    COLOURS,
    SHAPES,
    ShapesConfig,
    ensure_shapes_classification,
    random_scene,
    render_scene,
)


def test_same_seed_same_scene_and_pixels():
    a = render_scene(random_scene(np.random.default_rng(5), 48, 32, 3), np.random.default_rng(1))
    b = render_scene(random_scene(np.random.default_rng(5), 48, 32, 3), np.random.default_rng(1))
    c = render_scene(random_scene(np.random.default_rng(6), 48, 32, 3), np.random.default_rng(1))
    assert a.shape == (32, 48, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("kind", SHAPES)
def test_box_encloses_the_drawn_shape(kind):
    rng = np.random.default_rng(0)
    scene = random_scene(rng, 64, 64, 1, kinds=(kind,))
    obj = scene.objects[0]
    img = render_scene(scene, rng, noise=0, clutter=0).astype(int)
    diff = np.abs(img - np.array(scene.background)).sum(-1) > 60  # clearly shape-coloured pixels
    ys, xs = np.nonzero(diff)
    x0, y0, x1, y1 = obj.box
    assert xs.min() >= x0 - 1 and xs.max() <= x1 + 1
    assert ys.min() >= y0 - 1 and ys.max() <= y1 + 1
    # ...and is tight: the shape reaches close to every side of its box.
    assert xs.min() <= x0 + 2 and xs.max() >= x1 - 3 and ys.min() <= y0 + 2 and ys.max() >= y1 - 3
    assert obj.colour in COLOURS
    assert obj.box_xywh[2] > 0 and obj.box_xywh[3] > 0


def test_classification_layout_balanced_and_cached(tmp_path):
    cfg = ShapesConfig(image_size=32, num_train=20, num_val=10, num_test=5, seed=1)
    root = ensure_shapes_classification(cfg, tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["classes"] == list(SHAPES)
    for split, n in (("train", 20), ("val", 10), ("test", 5)):
        counts = {k: len(list((root / split / k).glob("*.png"))) for k in SHAPES}
        assert sum(counts.values()) == n
        assert max(counts.values()) - min(counts.values()) <= 1
    stamp = (root / "train" / "circle" / "000000.png").stat().st_mtime_ns
    assert ensure_shapes_classification(cfg, tmp_path) == root  # reused, not regenerated
    assert (root / "train" / "circle" / "000000.png").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no leftovers
    other = ensure_shapes_classification(ShapesConfig(image_size=32, num_train=20, num_val=10, seed=2), tmp_path)
    assert other != root


def test_descriptions_name_every_object():
    rng = np.random.default_rng(4)
    for n in (1, 2, 3):
        scene = random_scene(rng, 64, 64, n)
        captions = scene.describe(np.random.default_rng(0), num=5)
        assert len(captions) == 5 and len(set(captions)) >= 3
        for c in captions:
            for o in scene.objects:
                assert o.colour in c and o.kind in c
    one = random_scene(np.random.default_rng(1), 64, 64, 1)
    one.objects[0].center = (8.0, 8.0)
    assert any("in the top left" in c for c in one.describe(np.random.default_rng(0), num=6))


def test_data_command_writes_and_prints_root(tmp_path, capsys):
    from vision_attn.commands.data import main

    main(["glyphs", "--cache_dir", str(tmp_path), "--num_train", "10", "--num_val", "10"])
    root = capsys.readouterr().out.strip()
    assert root.startswith(str(tmp_path)) and "glyphs" in root
    counts = {d.name: len(list(d.glob("*.png"))) for d in (tmp_path / root.split("/")[-1] / "train").iterdir()}
    assert len(counts) == 10 and set(counts.values()) == {1}


def test_coco_layout_is_valid_for_pycocotools_style_readers(tmp_path):
    from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco

    root = ensure_shapes_coco(SceneSetConfig(num_train=6, num_val=4, image_size=48), tmp_path)
    inst = json.loads((root / "annotations" / "instances_val.json").read_text())
    caps = json.loads((root / "annotations" / "captions_val.json").read_text())
    assert [c["name"] for c in inst["categories"]] == list(SHAPES)
    assert len(inst["images"]) == 4 and len(caps["annotations"]) == 4 * 5
    ids = {im["id"] for im in inst["images"]}
    train_ids = {im["id"] for im in json.loads((root / "annotations" / "instances_train.json").read_text())["images"]}
    assert not ids & train_ids  # unique across splits
    per_image = {}
    for a in inst["annotations"]:
        x, y, w, h = a["bbox"]
        assert a["image_id"] in ids and w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= 48.01 and y + h <= 48.01
        per_image[a["image_id"]] = per_image.get(a["image_id"], 0) + 1
    assert all(1 <= n <= 4 for n in per_image.values()) and set(per_image) == ids
    for im in inst["images"]:
        assert (root / "val" / im["file_name"]).is_file()
    kinds = {c["id"]: c["name"] for c in inst["categories"]}
    for im in inst["images"]:  # every caption names each object's kind
        names = [kinds[a["category_id"]] for a in inst["annotations"] if a["image_id"] == im["id"]]
        for c in (c["caption"] for c in caps["annotations"] if c["image_id"] == im["id"]):
            assert all(n in c for n in names)


@pytest.mark.parametrize("kind", SHAPES)
def test_the_outline_is_the_drawn_shape(kind):
    """``object_polygon`` (the instances files' ``segmentation``) is the shape: every mask pixel
    is coloured by it, and the mask covers the clearly coloured pixels but for an edge of about a
    pixel (pycocotools rasterises a polygon's border pixels conservatively)."""
    from vision_attn.data.masks import decode_segmentation
    from vision_attn.data.scenes import object_polygon

    for seed in range(3):
        rng = np.random.default_rng(seed)
        scene = random_scene(rng, 64, 64, 1, kinds=(kind,))
        img = render_scene(scene, rng, noise=0, clutter=0).astype(int)
        diff = np.abs(img - np.array(scene.background)).sum(-1)
        drawn = diff > 60
        mask = decode_segmentation([object_polygon(scene.objects[0])], 64, 64)
        assert (diff[mask] > 0).all(), (kind, seed)
        assert (drawn & mask).sum() / (drawn | mask).sum() > 0.78, (kind, seed)


def test_classification_data_writes_the_boxes_of_every_image(tmp_path):
    """ROOT/annotations/instances_<split>.json: one box per image of its class's shape, file_name
    relative to ROOT (as predictions.json names images), loadable by the localisation reader."""
    from vision_attn.explain.localisation import load_image_boxes

    cfg = ShapesConfig(image_size=32, num_train=10, num_val=5, num_test=0, seed=1, noise=0, clutter=0)
    root = ensure_shapes_classification(cfg, tmp_path)
    assert "-v3-" in root.name  # a v1 cache (no boxes) or v2 (no outlines) is not reused
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["annotations"] == {"train": "annotations/instances_train.json",
                                       "val": "annotations/instances_val.json"}
    coco = json.loads((root / "annotations" / "instances_val.json").read_text())
    assert [c["name"] for c in coco["categories"]] == list(SHAPES)
    files = sorted(p.relative_to(root).as_posix() for p in (root / "val").rglob("*.png"))
    assert sorted(im["file_name"] for im in coco["images"]) == files
    boxes = load_image_boxes(root / manifest["annotations"]["val"])
    from vision_attn.data.imageio import read_image

    for rel in files:
        (kind, (x0, y0, x1, y1)), = boxes[rel]
        assert kind == rel.split("/")[1]  # the class folder
        img = read_image(root / rel).astype(int)
        bg = np.median(img.reshape(-1, 3), axis=0)
        ys, xs = np.nonzero(np.abs(img - bg).sum(-1) > 60)  # the shape's pixels lie in its box
        assert xs.min() >= x0 - 1 and xs.max() <= x1 + 1 and ys.min() >= y0 - 1 and ys.max() <= y1 + 1


def test_digit_scene_boxes_are_the_ink_of_each_digit():
    """Noise and clutter off: every bright pixel lies in a box, and each box is tight (its ink
    reaches every side); same seed, same pixels."""
    from vision_attn.data.synthetic import render_digit_scene

    for seed in range(4):
        img, placed = render_digit_scene(np.random.default_rng(seed), 96, [1, 7, 0], 0.2, 0.45, noise=0, clutter=0)
        again, _ = render_digit_scene(np.random.default_rng(seed), 96, [1, 7, 0], 0.2, 0.45, noise=0, clutter=0)
        assert np.array_equal(img, again) and img.shape == (96, 96, 3)
        assert [d for d, _ in placed] == [1, 7, 0][: len(placed)] and len(placed) >= 2
        ink = img[..., 0].astype(int) > img[..., 0].min() + 60
        inside = np.zeros_like(ink)
        for _, (x0, y0, x1, y1) in placed:
            assert 0 <= x0 < x1 <= 96 and 0 <= y0 < y1 <= 96
            inside[int(y0) - 1:int(np.ceil(y1)) + 1, int(x0) - 1:int(np.ceil(x1)) + 1] = True
            ys, xs = np.nonzero(ink[int(y0):int(np.ceil(y1)), int(x0):int(np.ceil(x1))])
            assert xs.min() <= 2 and ys.min() <= 2  # tight on the left and top ...
            assert xs.max() >= int(np.ceil(x1)) - int(x0) - 3 and ys.max() >= int(np.ceil(y1)) - int(y0) - 3
        assert not (ink & ~inside).any()


def test_digit_scenes_captions_name_the_annotated_digits(tmp_path):
    """The COCO layout of the digit scenes: categories named as the captions name them, and every
    reference caption, read by content accuracy, names exactly the annotated digits; relations
    agree with the boxes."""
    from vision_attn.data.captioning import read_annotated_objects
    from vision_attn.data.synthetic import DIGIT_WORDS, DigitSceneConfig, ensure_digit_scenes_coco
    from vision_attn.metrics.caption_content import content_accuracy

    root = ensure_digit_scenes_coco(DigitSceneConfig(image_size=64, num_train=4, num_val=12, min_objects=1,
                                                     max_objects=3), tmp_path)
    inst = json.loads((root / "annotations" / "instances_val.json").read_text())
    caps = json.loads((root / "annotations" / "captions_val.json").read_text())
    assert [c["name"] for c in inst["categories"]] == list(DIGIT_WORDS)
    assert all((root / "val" / im["file_name"]).is_file() for im in inst["images"])
    annotated = read_annotated_objects(root / "annotations" / "instances_val.json")
    by_image: dict[int, list[str]] = {}
    for c in caps["annotations"]:
        by_image.setdefault(c["image_id"], []).append(c["caption"])
    assert set(by_image) == {im["id"] for im in inst["images"]} and all(len(v) == 5 for v in by_image.values())
    for k in range(5):
        scores = content_accuracy({i: v[k] for i, v in by_image.items()}, annotated)
        assert scores["kinds_exact"] == 1.0 and scores["count_acc"] == 1.0
    boxes = {}
    for a in inst["annotations"]:
        x, y, w, h = a["bbox"]
        boxes.setdefault(a["image_id"], []).append((DIGIT_WORDS[a["category_id"] - 1], x + w / 2, y + h / 2))
    checked = 0
    for i, texts in by_image.items():
        for text in texts:
            if " above " not in text:
                continue
            first, second = (part.split()[1] for part in text.split(" above "))
            assert any(a[0] == first and b[0] == second and a[2] < b[2] for a in boxes[i] for b in boxes[i])
            checked += 1
    assert checked > 0


def test_more_training_scenes_keep_the_first_ones_and_the_validation_scenes(tmp_path):
    """configs/captioning/shapes.yaml draws 5500 training scenes where a smaller set draws 2000, and
    the results compare their validation numbers: a larger num_train must only append training
    scenes (the first ones unchanged) and leave the validation scenes and their captions as they were."""
    from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco

    small = ensure_shapes_coco(SceneSetConfig(num_train=3, num_val=3, image_size=32), tmp_path / "a")
    large = ensure_shapes_coco(SceneSetConfig(num_train=7, num_val=3, image_size=32), tmp_path / "b")

    def split(root, name):
        caps = json.loads((root / "annotations" / f"captions_{name}.json").read_text())
        images = sorted(caps["images"], key=lambda im: im["id"])
        texts = [[c["caption"] for c in caps["annotations"] if c["image_id"] == im["id"]] for im in images]
        return [(root / name / im["file_name"]).read_bytes() for im in images], texts

    (small_train, small_train_caps), (large_train, large_train_caps) = split(small, "train"), split(large, "train")
    assert len(large_train) == 7 and large_train[:3] == small_train and large_train_caps[:3] == small_train_caps
    assert large_train[3] not in small_train  # the extra scenes are new ones
    assert split(small, "val") == split(large, "val")
