"""COCO detection data: sparse ids, faulty annotations dropped and counted, clear errors."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from PIL import Image

from vision_attn.data.detection import (
    DETECTION_BATCHING,
    CocoDetection,
    DetectionDataModule,
    build_detection_transform,
)
from vision_attn.data.loading import Batching
from vision_attn.errors import DataError

PRE = {"input_size": (3, 32, 48), "mean": (0.0,) * 3, "std": (1.0,) * 3, "interpolation": "bilinear", "crop_pct": 1.0}


def _coco(root, split="val", anns=None, images=None, cats=None):
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    images = images or [{"id": 7, "file_name": "a.png", "width": 80, "height": 40},
                        {"id": 9, "file_name": "b.png", "width": 80, "height": 40}]
    for im in images:
        Image.new("RGB", (im["width"], im["height"])).save(root / split / im["file_name"])
    cats = cats or [{"id": 90, "name": "toothbrush"}, {"id": 1, "name": "person"}, {"id": 18, "name": "dog"}]
    anns = anns if anns is not None else [
        {"id": 1, "image_id": 7, "category_id": 18, "bbox": [10, 10, 20, 10]},
        {"id": 2, "image_id": 7, "category_id": 90, "bbox": [40, 0, 40, 40]},
    ]
    data = {"images": images, "annotations": anns, "categories": cats}
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
    return root


def test_sparse_category_ids_map_to_contiguous_labels_and_back(tmp_path):
    ds = CocoDetection(_coco(tmp_path), "val", build_detection_transform(PRE, train=False))
    assert ds.category_ids == [1, 18, 90] and ds.class_names == ["person", "dog", "toothbrush"]
    image, target = ds[0]
    assert image.shape == (3, 32, 48)
    assert target["labels"].tolist() == [1, 2] and target["image_id"] == 7
    assert target["orig_size"].tolist() == [40, 80]
    # (10, 10, 30, 20) in an 80 x 40 image -> cx 20/80, cy 15/40, w 20/80, h 10/40 (resize keeps fractions)
    assert torch.allclose(target["boxes"][0], torch.tensor([0.25, 0.375, 0.25, 0.25]), atol=1e-3)
    _, empty = ds[1]  # an image with no annotations is kept
    assert empty["labels"].numel() == 0 and empty["boxes"].shape == (0, 4)


def test_faulty_annotations_are_dropped_and_counted(tmp_path, caplog):
    anns = [
        {"id": 1, "image_id": 7, "category_id": 1, "bbox": [0, 0, 0, 5]},             # zero size
        {"id": 2, "image_id": 7, "category_id": 1, "bbox": [0, 0, -3, 5]},            # negative
        {"id": 3, "image_id": 7, "category_id": 1, "bbox": [float("nan"), 0, 3, 3]},  # NaN
        {"id": 4, "image_id": 7, "category_id": 1, "bbox": [200, 200, 5, 5]},         # outside
        {"id": 5, "image_id": 12345, "category_id": 1, "bbox": [0, 0, 5, 5]},         # unknown image
        {"id": 6, "image_id": 7, "category_id": 55, "bbox": [0, 0, 5, 5]},            # unknown category
        {"id": 7, "image_id": 7, "category_id": 1, "bbox": [70, 30, 20, 20]},         # sticks out: clipped
    ]
    with caplog.at_level(logging.WARNING):
        ds = CocoDetection(_coco(tmp_path, anns=anns), "val")
    assert ds.annotations[7] == [([70.0, 30.0, 80.0, 40.0], 0)]
    for reason, example in [("zero or negative size", 1), ("non-finite box", 3), ("outside the image", 4),
                            ("unknown image id", 5), ("unknown category id", 6)]:
        assert reason in caplog.text and f"annotation id {example}" in caplog.text


def test_missing_file_duplicate_ids_and_malformed_json_are_clear_errors(tmp_path):
    root = _coco(tmp_path / "a")
    (root / "val" / "b.png").unlink()
    with pytest.raises(DataError, match=r"image id 9 has no file .*b.png"):
        CocoDetection(root, "val")
    images = [{"id": 3, "file_name": "a.png", "width": 8, "height": 8},
              {"id": 3, "file_name": "b.png", "width": 8, "height": 8}]
    with pytest.raises(DataError, match="image id 3 appears twice"):
        CocoDetection(_coco(tmp_path / "b", images=images, anns=[]), "val")
    bad = _coco(tmp_path / "c")
    (bad / "annotations" / "instances_val.json").write_text('{"images": [1, 2,, 3]}')
    with pytest.raises(DataError, match=r"instances_val.json is not valid JSON: .* line 1, column"):
        CocoDetection(bad, "val")


def test_training_transform_keeps_boxes_valid(tmp_path):
    torch.manual_seed(0)
    ds = CocoDetection(_coco(tmp_path), "val", build_detection_transform(PRE, train=True, scale_jitter=(0.2, 0.5)))
    for _ in range(20):
        _, t = ds[0]
        assert len(t["labels"]) == len(t["boxes"])
        assert torch.all((t["boxes"] >= 0) & (t["boxes"] <= 1)) and torch.all(t["boxes"][:, 2:] > 0)


def test_datamodule_on_embedded_scenes():
    from vision_attn.data.synthetic import SceneSetConfig

    dm = DetectionDataModule(synthetic=SceneSetConfig(num_train=8, num_val=4, image_size=48),
                             batching=Batching(batch_size=4, num_workers=0))
    assert dm.class_names == ["circle", "square", "triangle", "star", "cross"] and dm.category_ids == [1, 2, 3, 4, 5]
    dm.preprocess = {**PRE, "input_size": (3, 48, 48)}
    dm.setup("fit")
    images, targets = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 48, 48) and len(targets) == 4


def test_only_evaluation_items_carry_the_scored_ground_truth(tmp_path):
    """Training items leave the scored ground truth out (each extra tensor crosses the loader's
    worker pipe); validation items carry it, equal to the dataset's ``scoring_target``."""
    from vision_attn.data.synthetic import SceneSetConfig

    dm = DetectionDataModule(synthetic=SceneSetConfig(image_size=32, num_train=4, num_val=2), cache_dir=str(tmp_path),
                             batching=replace(DETECTION_BATCHING, num_workers=0))
    train, val = dm.dataset(dm.train_split, train=True), dm.dataset(dm.val_split)
    assert "scored" not in train[0][1]
    scored = val[0][1]["scored"]
    expected = val.scoring_target(val.images[0]["id"])
    assert scored.keys() == expected.keys() and all(torch.equal(scored[k], expected[k]) for k in scored)


def test_auto_batch_size_sizes_detection_from_the_training_set(tmp_path):
    """``batch_size: auto`` works for detection as for classification: the largest power of two
    leaving ``min_steps_per_epoch`` steps, recorded in the hyper-parameters; evaluation batches
    at ``max_batch_size``."""
    from vision_attn.data.synthetic import SceneSetConfig

    dm = DetectionDataModule(synthetic=SceneSetConfig(image_size=32, num_train=40, num_val=4), cache_dir=str(tmp_path),
                             batching=replace(DETECTION_BATCHING, num_workers=0, batch_size="auto",
                                              min_steps_per_epoch=8, min_batch_size=2, max_batch_size=16))
    dm.preprocess = {**PRE, "input_size": (3, 32, 32)}
    dm.setup("fit")
    # 40 images / 8 steps = 5 -> 4; 40 // 4 = 10 batches
    assert dm.train_dataloader().batch_size == 4 and len(dm.train_dataloader()) == 10
    assert dm.hparams["batch_size"] == 4 and dm.hparams["batch_size_rule"] == "auto"
    assert dm.val_dataloader().batch_size == 16
    with pytest.raises(DataError, match="--data.batching.min_batch_size"):
        DetectionDataModule(synthetic=SceneSetConfig(image_size=32, num_train=40, num_val=4), cache_dir=str(tmp_path),
                            batching=replace(DETECTION_BATCHING, batch_size="auto", min_batch_size=0))


@pytest.mark.parametrize("images, batch, steps, processes, expected", [
    (300, 8, 90, 1, 3),    # 37 batches a pass: three passes make 112
    (1500, 16, 90, 1, 1),  # one pass already makes 93
    (300, 8, 90, 2, 5),    # 150 images per process
    (100, 8, 10, 1, 1),
    (10, 8, 3, 1, 3),      # ceil(24 / 10) = 3 passes: 30 images, 3 batches
])
def test_epoch_repeats_hand_cases(images, batch, steps, processes, expected):
    from vision_attn.data.loading import epoch_repeats

    k = epoch_repeats(images, batch, steps, processes)
    assert k == expected
    assert -(-k * images // processes) // batch >= steps  # enough batches...
    assert k == 1 or -(-(k - 1) * images // processes) // batch < steps  # ...with the fewest passes


def test_fill_epoch_shows_a_small_training_set_several_times(tmp_path):
    """``fill_epoch``: 40 images at the smallest batch of 8 make 5 batches; 12 are wanted, so an
    epoch shows each image 3 times (15 batches), every index once per pass; off, 5 batches."""
    from vision_attn.data.synthetic import SceneSetConfig

    def module(fill: bool) -> DetectionDataModule:
        dm = DetectionDataModule(synthetic=SceneSetConfig(image_size=32, num_train=40, num_val=4),
                                 cache_dir=str(tmp_path),
                                 batching=replace(DETECTION_BATCHING, num_workers=0, batch_size="auto",
                                                  min_steps_per_epoch=12, min_batch_size=8, max_batch_size=16,
                                                  fill_epoch=fill))
        dm.preprocess = {**PRE, "input_size": (3, 32, 32)}
        dm.setup("fit")
        return dm

    dm = module(True)
    loader = dm.train_dataloader()
    assert loader.batch_size == 8 and len(loader) == 15
    assert dm.hparams["epoch_repeats"] == 3 and dm.hparams["batches_per_epoch"] == 15
    ids = [int(t["image_id"]) for _, targets in loader for t in targets]
    assert len(ids) == 120 and all(ids.count(i) == 3 for i in set(ids)) and len(set(ids)) == 40
    plain = module(False)
    assert len(plain.train_dataloader()) == 5 and "epoch_repeats" not in plain.hparams


def _v2_pipeline(train: bool, scale, size=(24, 32)):
    """The torchvision v2 pipeline that ``SquareDetectionTransform`` computes in one call."""
    from torchvision.transforms import v2 as T

    ops = [T.RandomHorizontalFlip(), T.RandomResizedCrop(size, scale=scale, ratio=(0.75, 1.333), antialias=True,
                                                         interpolation=T.InterpolationMode.BICUBIC)] if train else \
        [T.Resize(size, interpolation=T.InterpolationMode.BICUBIC, antialias=True)]
    ops += [T.ClampBoundingBoxes(), T.SanitizeBoundingBoxes(min_size=1.0, labels_getter=lambda s: s[2]),
            T.ToDtype(torch.float32, scale=True), T.Normalize(mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.3])]
    return T.Compose(ops)


@pytest.mark.parametrize("train", [True, False])
def test_square_transform_equals_torchvisions_v2_pipeline(train):
    """The same draws (the flip, then the crop, from the same generator state) and the same
    kernels as the v2 pipeline: equal images, boxes and labels, boxes pushed out by the crop
    dropped alike."""
    from torchvision import tv_tensors

    from vision_attn.data.detection import SquareDetectionTransform

    fast = SquareDetectionTransform((24, 32), train, (0.2, 0.9), mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))
    slow = _v2_pipeline(train, (0.2, 0.9))
    g = torch.Generator().manual_seed(1)
    dropped = flipped = 0
    for seed in range(40):
        image = torch.randint(0, 256, (3, 40, 52), dtype=torch.uint8, generator=g)
        xy = torch.rand(6, 2, generator=g) * torch.tensor([46.0, 34.0])
        wh = torch.rand(6, 2, generator=g) * 12 + 0.5
        xyxy = torch.cat([xy, xy + wh], 1)
        labels = torch.arange(6)
        torch.manual_seed(seed)
        a = slow(tv_tensors.Image(image), tv_tensors.BoundingBoxes(xyxy, format="XYXY", canvas_size=(40, 52)), labels)
        torch.manual_seed(seed)
        params = fast.draw(image)
        torch.manual_seed(seed)
        b = fast(tv_tensors.Image(image), tv_tensors.BoundingBoxes(xyxy, format="XYXY", canvas_size=(40, 52)), labels)
        assert a[0].shape == b[0].shape == (3, 24, 32)
        assert torch.allclose(a[0], b[0], atol=1e-6)
        assert torch.allclose(a[1].as_subclass(torch.Tensor), b[1].as_subclass(torch.Tensor), atol=1e-5)
        assert torch.equal(a[2], b[2]) and b[1].canvas_size == (24, 32)
        dropped += len(b[2]) < 6
        flipped += params[0]
    if train:  # the cases above covered flips, no flips and dropped boxes
        assert 0 < flipped < 40 and dropped > 5
    else:
        assert flipped == 0


@pytest.mark.parametrize("resize", ["square", "aspect"])
def test_hflip_off_and_no_crop_leave_training_images_as_in_evaluation(resize):
    """``scale_jitter [1, 1]`` and ``hflip False``: training reads every image as evaluation does;
    with flips on, about half come out mirrored (the boxes with them)."""
    from torchvision import tv_tensors

    g = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8, generator=g)
    boxes = torch.tensor([[2.0, 3.0, 9.0, 12.0]])
    kw = dict(resize=resize, train_sizes=(24,), eval_size=24, max_size=None) if resize == "aspect" else {}
    pre = {**PRE, "input_size": (3, 24, 24)}
    ref = build_detection_transform(pre, train=False, **kw)
    still = build_detection_transform(pre, train=True, scale_jitter=(1.0, 1.0), hflip=False, **kw)
    flips = build_detection_transform(pre, train=True, scale_jitter=(1.0, 1.0), **kw)

    def run(tf):
        return tf(tv_tensors.Image(image), tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(24, 24)),
                  torch.tensor([1]))

    expected = run(ref)
    mirrored = 0
    torch.manual_seed(0)
    for _ in range(20):
        a = run(still)
        assert torch.equal(a[0], expected[0]) and torch.equal(a[1], expected[1])
        b = run(flips)
        if not torch.equal(b[0], expected[0]):
            mirrored += 1
            assert torch.equal(b[0], expected[0].flip(-1))
            assert torch.allclose(b[1].as_subclass(torch.Tensor), torch.tensor([[15.0, 3.0, 22.0, 12.0]]))
    assert 3 < mirrored < 17


def test_decoded_images_are_cached_and_items_unchanged(tmp_path, monkeypatch):
    """The second epoch reads no file (the decoded pixels are kept) and, under the same seed,
    gives the items that reading every file gives, through the random training transform; an
    EXIF-turned image is read twice once (turned, then as stored) and never again."""
    import vision_attn.data.detection as detection

    from .conftest import assert_same_items, cached_and_uncached_epochs, write_exif_rotated_jpeg

    root = _coco(tmp_path / "coco")
    Image.new("RGB", (80, 40), (200, 30, 60)).save(root / "val" / "a.png")
    calls = []
    real = detection.read_image
    monkeypatch.setattr(detection, "read_image", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    tf = build_detection_transform(PRE, train=True, scale_jitter=(0.2, 0.5))
    on, off = cached_and_uncached_epochs(lambda: CocoDetection(root, "val", tf), monkeypatch)
    assert len(calls) == 2 + 2  # cached: one read per image over two epochs; uncached: one epoch
    assert_same_items(on, off)

    (tmp_path / "exif").mkdir()
    write_exif_rotated_jpeg(tmp_path / "exif")  # 40x20 stored, displayed 20x40; annotated as stored
    image = {"id": 1, "file_name": "a.jpg", "width": 40, "height": 20}
    (tmp_path / "exif" / "annotations" / "instances_val.json").write_text(json.dumps(
        {"images": [image], "categories": [{"id": 3, "name": "square"}],
         "annotations": [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [28, 2, 8, 8]}]}))
    monkeypatch.delenv("VISION_ATTN_DECODED_CACHE_MB")
    calls.clear()
    ds = CocoDetection(tmp_path / "exif", "val", build_detection_transform(PRE, train=False))
    first, second = ds[0], ds[0]
    assert len(calls) == 2 and first[1]["orig_size"].tolist() == [20, 40]  # the stored orientation, kept
    assert_same_items(first, second)


def test_a_bad_decoded_cache_setting_stops_the_data_module(monkeypatch):
    from vision_attn.data.synthetic import SceneSetConfig

    monkeypatch.setenv("VISION_ATTN_DECODED_CACHE_MB", "inf")
    with pytest.raises(DataError, match="VISION_ATTN_DECODED_CACHE_MB must be a number of MiB >= 0"):
        DetectionDataModule(synthetic=SceneSetConfig(num_train=4, num_val=2, image_size=32),
                            batching=replace(DETECTION_BATCHING, num_workers=0))
