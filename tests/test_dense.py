"""Denser detection training images. Mosaic (four images in one): each quadrant shows the right
corner of its image, every kept box lies inside the mosaic over its own object and keeps its
category. Copy-paste: each pasted object is its donor's box, pixel for pixel, over no other box.
The schedule turns both off for the last epochs; the data module makes them in training only."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vision_attn.data.dense import (
    CopyPasteConfig,
    DenseSchedule,
    MosaicConfig,
    _stacked_masks,
    copy_paste,
    draw_centre,
    mosaic,
    scheduled_epochs,
)
from vision_attn.errors import ConfigError

PRE = {"input_size": (3, 48, 48), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "interpolation": "bilinear",
       "crop_pct": 1.0, "crop_mode": "squash"}


def _flat(value: int, size: int = 32) -> torch.Tensor:
    return torch.full((3, size, size), value, dtype=torch.uint8)


def test_each_quadrant_shows_its_images_corner_and_moves_its_boxes():
    images = [_flat(10), _flat(20), _flat(30), _flat(40)]
    boxes = [torch.tensor([[20.0, 20, 30, 30], [0, 0, 8, 8]]),  # image 0: bottom-right kept, top-left out of view
             torch.tensor([[2.0, 20, 12, 30]]),                  # image 1: its bottom-left corner
             torch.tensor([[20.0, 2, 30, 12]]),                  # image 2: its top-right corner
             torch.tensor([[2.0, 2, 12, 12], [10, 10, 22, 14]])]  # image 3: top-left; one a quarter in view
    labels = [torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3]), torch.tensor([4, 5])]
    image, out, lab = mosaic(images, boxes, labels, (32, 32), (16, 16), min_visible=0.5)
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    assert image[:, :16, :16].eq(10).all() and image[:, :16, 16:].eq(20).all()
    assert image[:, 16:, :16].eq(30).all() and image[:, 16:, 16:].eq(40).all()
    # label 5's box [10, 10, 22, 14] shows [10, 10, 16, 14] of it: 24 of 48 px, exactly the half
    assert lab.tolist() == [0, 2, 3, 4, 5]
    assert out.tolist() == [[4, 4, 14, 14], [18, 4, 28, 14], [4, 18, 14, 28], [18, 18, 28, 28], [26, 26, 32, 30]]
    _, _, fewer = mosaic(images, boxes, labels, (32, 32), (16, 16), min_visible=0.6)
    assert fewer.tolist() == [0, 2, 3, 4]


@pytest.mark.parametrize(("seed", "scale"), [(0, 1.0), (1, 1.0), (2, 1.5), (3, 2.0), (4, 2.0)])
def test_random_mosaics_keep_every_box_inside_over_its_own_object(seed, scale):
    """Images of other sizes than the mosaic's, random boxes, random centres: every kept box lies
    inside the mosaic, is its object's box scaled, shifted and cut to its quadrant (each object
    has its own label here), and exactly the objects with at least ``min_visible`` in view stay."""
    g = torch.Generator().manual_seed(seed)
    size = (40, 56)
    images, boxes, labels, n = [], [], [], 0
    for _ in range(4):
        ih, iw = (int(v) for v in torch.randint(20, 90, (2,), generator=g))
        images.append(torch.randint(0, 255, (3, ih, iw), generator=g, dtype=torch.uint8))
        k = int(torch.randint(0, 6, (1,), generator=g))
        xy = torch.rand(k, 2, generator=g) * torch.tensor([iw, ih])
        wh = torch.rand(k, 2, generator=g) * torch.tensor([iw, ih]) / 2 + 1
        boxes.append(torch.cat([xy, (xy + wh).minimum(torch.tensor([iw, ih]))], 1))
        labels.append(torch.arange(n, n + k))
        n += k
    h, w = size
    ch, cw = round(scale * h), round(scale * w)
    centre = draw_centre(size, g, scale)
    assert ch // 4 <= centre[0] <= 3 * ch // 4 and cw // 4 <= centre[1] <= 3 * cw // 4
    image, out, lab = mosaic(images, boxes, labels, size, centre, min_visible=0.3, scale=scale)
    assert image.shape == (3, ch, cw)
    cy, cx = centre
    assert len(set(lab.tolist())) == len(lab)  # no object twice
    assert (out[:, 0] >= 0).all() and (out[:, 2] <= cw).all() and (out[:, 1] >= 0).all() and (out[:, 3] <= ch).all()
    assert ((out[:, 2] - out[:, 0]) >= 1).all() and ((out[:, 3] - out[:, 1]) >= 1).all()
    shifts = [(cx - w, cy - h), (cx, cy - h), (cx - w, cy), (cx, cy)]  # each image's top-left corner
    regions = [(max(dx, 0), max(dy, 0), min(dx + w, cw), min(dy + h, ch)) for dx, dy in shifts]
    expected = {}
    for image, b, ls, (dx, dy), (x0, y0, x1, y1) in zip(images, boxes, labels, shifts, regions, strict=True):
        ih, iw = image.shape[-2:]
        scaled = b * torch.tensor([w / iw, h / ih, w / iw, h / ih])
        moved = scaled + torch.tensor([dx, dy, dx, dy])
        cut = torch.stack([moved[:, 0].clamp(x0, x1), moved[:, 1].clamp(y0, y1),
                           moved[:, 2].clamp(x0, x1), moved[:, 3].clamp(y0, y1)], 1)
        for label, box, full in zip(ls.tolist(), cut, scaled, strict=True):
            bw, bh = float(box[2] - box[0]), float(box[3] - box[1])
            full_area = float((full[2] - full[0]) * (full[3] - full[1]))
            if bw >= 1 and bh >= 1 and bw * bh >= 0.3 * full_area:
                expected[label] = box
    assert sorted(lab.tolist()) == sorted(expected)
    for label, box in zip(lab.tolist(), out, strict=True):
        assert torch.allclose(box, expected[label], atol=1e-4)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="--data.mosaic.prob"):
        MosaicConfig(prob=1.5)
    with pytest.raises(ConfigError, match="--data.mosaic.off_fraction"):
        MosaicConfig(prob=0.5, off_fraction=-0.1)
    with pytest.raises(ConfigError, match="--data.mosaic.scale"):
        MosaicConfig(prob=0.5, scale=3)
    with pytest.raises(ConfigError, match="--data.copy_paste.objects"):
        CopyPasteConfig(prob=0.5, objects=0)
    with pytest.raises(ConfigError, match="--data.copy_paste.prob"):
        CopyPasteConfig(prob=True)
    with pytest.raises(ValueError, match="4 images"):
        mosaic([_flat(1)] * 3, [torch.zeros(0, 4)] * 3, [torch.zeros(0)] * 3, (32, 32), (16, 16))
    with pytest.raises(ValueError, match="not inside"):
        mosaic([_flat(1)] * 4, [torch.zeros(0, 4)] * 4, [torch.zeros(0)] * 4, (32, 32), (0, 16))


def test_the_schedule_turns_mosaics_off_for_the_last_epochs():
    assert scheduled_epochs(10, 0.2) == 8 and scheduled_epochs(40, 0.1) == 36 and scheduled_epochs(3, 0.0) == 3
    switch, pasting = torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    dm = SimpleNamespace(mosaic=MosaicConfig(prob=0.5, off_fraction=0.2),
                         copy_paste=CopyPasteConfig(prob=0.5, off_fraction=0.5),
                         dense_switches={"mosaic": switch, "copy_paste": pasting})
    trainer = SimpleNamespace(datamodule=dm, max_epochs=10, current_epoch=0)
    schedule = DenseSchedule()
    seen = []
    schedule.on_train_start(trainer, None)
    for epoch in range(10):
        seen.append((int(switch[0]), int(pasting[0])))
        trainer.current_epoch = epoch
        schedule.on_train_epoch_end(trainer, None)
    assert seen == [(1, 1)] * 5 + [(1, 0)] * 3 + [(0, 0)] * 2
    trainer.current_epoch = 9  # resumed in the last epochs: off from the start
    switch[0] = 1
    schedule.on_train_start(trainer, None)
    assert int(switch[0]) == 0
    off = SimpleNamespace(datamodule=SimpleNamespace(mosaic=MosaicConfig(), copy_paste=CopyPasteConfig(),
                                                     dense_switches={"mosaic": switch, "copy_paste": pasting}),
                          max_epochs=10, current_epoch=0)
    schedule.on_train_start(off, None)  # neither asked for: the switches are not touched
    assert int(switch[0]) == 0 and int(pasting[0]) == 0


def test_the_data_module_makes_mosaics_in_training_only(tmp_path):
    from vision_attn.data.detection import DETECTION_BATCHING, DetectionDataModule, DetectionTransform
    from vision_attn.data.synthetic import SceneSetConfig

    data = SceneSetConfig(image_size=48, num_train=12, num_val=4)
    batching = replace(DETECTION_BATCHING, num_workers=0)
    plain = DetectionDataModule(synthetic=data, cache_dir=str(tmp_path), batching=batching)
    dm = DetectionDataModule(synthetic=data, cache_dir=str(tmp_path), batching=batching,
                             mosaic=MosaicConfig(prob=1.0))
    for module in (plain, dm):
        module.preprocess = PRE
    torch.manual_seed(0)
    train, base = dm.dataset(dm.train_split, train=True), plain.dataset(plain.train_split, train=True)
    items = [train[i] for i in range(len(train))]
    assert all(image.shape == (3, 48, 48) for image, _ in items)
    for _, target in items:
        b = target["boxes"]  # (cx, cy, w, h) fractions of the image
        assert ((b[:, :2] - b[:, 2:] / 2) >= -1e-6).all() and ((b[:, :2] + b[:, 2:] / 2) <= 1 + 1e-6).all()
        assert set(target["labels"].tolist()) <= set(range(dm.num_classes))
    objects = sum(len(t["labels"]) for _, t in items)
    assert objects > 1.5 * sum(len(base[i][1]["labels"]) for i in range(len(base)))  # denser scenes
    dm.dense_switches["mosaic"][0] = 0  # switched off (the schedule's last epochs): plain images
    assert train[0][1]["image_id"] == train.images[0]["id"]
    val = dm.dataset(dm.val_split)
    assert val.dense is None
    pasting = DetectionDataModule(synthetic=data, cache_dir=str(tmp_path), batching=batching,
                                  transform=DetectionTransform(scale_jitter=(1.0, 1.0), hflip=False),
                                  copy_paste=CopyPasteConfig(prob=1.0, objects=2))
    pasting.preprocess = PRE
    pasted = pasting.dataset(pasting.train_split, train=True)
    assert sum(len(pasted[i][1]["labels"]) for i in range(len(pasted))) > len(pasted) + sum(
        len(base[i][1]["labels"]) for i in range(len(base)))  # most images get at least one more object
    for name, config in (("mosaic", MosaicConfig(prob=0.5)), ("copy_paste", CopyPasteConfig(prob=0.5))):
        with pytest.raises(ConfigError, match=f"--data.{name}.prob > 0 needs --data.transform.resize square"):
            DetectionDataModule(synthetic=data, cache_dir=str(tmp_path), transform=DetectionTransform(resize="aspect"),
                                **{name: config})


def test_a_pasted_object_is_its_donors_box_over_no_other_box():
    image = torch.zeros(3, 32, 32, dtype=torch.uint8)
    donor = torch.randint(0, 255, (3, 20, 24), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    out, boxes, labels = copy_paste(image, torch.tensor([[0.0, 0, 10, 10]]), torch.tensor([1]),
                                    [(donor, torch.tensor([[2.0, 3, 8, 7]]), torch.tensor([3]))],
                                    torch.Generator().manual_seed(0))
    assert labels.tolist() == [1, 3] and boxes[0].tolist() == [0, 0, 10, 10]
    x0, y0, x1, y1 = (int(v) for v in boxes[1])
    assert (x1 - x0, y1 - y0) == (6, 4) and not (x0 < 10 and y0 < 10)  # its size, clear of the first box
    assert torch.equal(out[:, y0:y1, x0:x1], donor[:, 3:7, 2:8])
    rest = torch.ones(32, 32, dtype=torch.bool)
    rest[y0:y1, x0:x1] = False
    assert out[:, rest].eq(0).all()  # nothing else changed
    assert image.eq(0).all()  # the input is left as it was


def test_a_masked_object_pastes_its_own_pixels_with_their_tight_box():
    image = torch.full((3, 32, 32), 7, dtype=torch.uint8)
    donor = torch.randint(0, 255, (3, 20, 24), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    mask = torch.zeros(20, 24, dtype=torch.bool)
    mask[4:7, 3:6] = True  # an L inside the box (2, 3)-(8, 8): rows 4..6 of columns 3..5, and row 6 to column 7
    mask[6, 3:8] = True
    asked = []

    def mask_of(k, size):
        asked.append((k, size))
        return mask

    out, boxes, labels = copy_paste(image, torch.tensor([[0.0, 0, 10, 10]]), torch.tensor([1]),
                                    [(donor, torch.tensor([[2.0, 3, 8, 8]]), torch.tensor([3]))],
                                    torch.Generator().manual_seed(0), masks=[mask_of])
    assert asked == [(0, (20, 24))] and labels.tolist() == [1, 3]
    x0, y0, x1, y1 = (int(v) for v in boxes[1])
    assert (x1 - x0, y1 - y0) == (5, 3)  # the mask's tight box: columns 3..7, rows 4..6
    # the box's placement: the cut-out (2, 3)-(8, 8) went to (x0 - 1, y0 - 1)
    px, py = x0 - 1, y0 - 1
    pasted = torch.zeros(32, 32, dtype=torch.bool)
    pasted[py : py + 5, px : px + 6] = mask[3:8, 2:8]
    assert torch.equal(out[:, pasted], donor[:, 3:8, 2:8][:, mask[3:8, 2:8]])
    assert out[:, ~pasted].eq(7).all()  # the box's background is not pasted
    # a mask of another size than the donor's, or an empty one, pastes the box as before
    for bad in (torch.ones(5, 5, dtype=torch.bool), torch.zeros(20, 24, dtype=torch.bool)):
        out, boxes, _ = copy_paste(image, torch.tensor([[0.0, 0, 10, 10]]), torch.tensor([1]),
                                   [(donor, torch.tensor([[2.0, 3, 8, 8]]), torch.tensor([3]))],
                                   torch.Generator().manual_seed(0), masks=[lambda k, size, m=bad: m])
        x0, y0, x1, y1 = (int(v) for v in boxes[1])
        assert (x1 - x0, y1 - y0) == (6, 5) and torch.equal(out[:, y0:y1, x0:x1], donor[:, 3:8, 2:8])


def test_a_mosaic_measures_and_boxes_what_it_shows_of_each_mask():
    """Tile 0 (top left; its tile rows and columns 10..20 in view at scale 1, centre (10, 10)).
    Object A: box (8, 8)-(16, 16), its mask an L (column 8, rows 8..15; row 15, columns 8..15):
    6 of its 15 pixels in view (>= 0.25), boxed tightly (0, 5)-(6, 6), where the box rule gives
    (0, 0)-(6, 6). Object B: box (12, 2)-(18, 14), its mask in rows 2..9 only: a third of its box
    but none of its mask in view: dropped (the box rule keeps it)."""
    image = torch.zeros(3, 20, 20, dtype=torch.uint8)
    boxes = torch.tensor([[8.0, 8, 16, 16], [12, 2, 18, 14]])
    masks = torch.zeros(2, 20, 20, dtype=torch.bool)
    masks[0, 8:16, 8] = True
    masks[0, 15, 8:16] = True
    masks[1, 2:10, 12:18] = True
    empty = (torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    args = ([image] * 4, [boxes, *[empty[0]] * 3], [torch.tensor([1, 2]), *[empty[1]] * 3], (20, 20), (10, 10))
    _, by_box, lab_box = mosaic(*args, min_visible=0.25)
    assert by_box.tolist() == [[0, 0, 6, 6], [2, 0, 8, 4]] and lab_box.tolist() == [1, 2]
    _, by_mask, lab_mask = mosaic(*args, min_visible=0.25, masks=[masks, None, None, None])
    assert by_mask.tolist() == [[0, 5, 6, 6]] and lab_mask.tolist() == [1]
    # masks that do not fit the image (another size, another count) are not used
    _, other, _ = mosaic(*args, min_visible=0.25, masks=[masks[:1], None, None, None])
    assert torch.equal(other, by_box)


def test_the_data_module_pastes_the_scene_objects_masks(tmp_path):
    """The generated scenes have segmentations: pasted objects bring their own pixels only, so
    an image gets fewer changed pixels than with boxes (same draws)."""
    from vision_attn.data.detection import DETECTION_BATCHING, DetectionDataModule
    from vision_attn.data.synthetic import SceneSetConfig

    data = SceneSetConfig(image_size=48, num_train=12, num_val=4)
    changed = {}
    for masks in (True, False):
        dm = DetectionDataModule(synthetic=data, cache_dir=str(tmp_path),
                                 batching=replace(DETECTION_BATCHING, num_workers=0),
                                 copy_paste=CopyPasteConfig(prob=1.0, objects=2, masks=masks))
        dm.preprocess = PRE
        ds = dm.dataset("train", train=True)
        ds.transform = None
        raw = ds._raw(0)
        size = tuple(raw[0].shape[-2:])
        assert ds._object_mask(0, 0, size) is not None and ds._object_mask(0, 0, size).shape == size
        torch.manual_seed(0)
        image = ds.dense(raw, ds._raw, len(ds), ds._object_mask)[0]
        changed[masks] = int((image != raw[0]).any(0).sum())
    assert 0 < changed[True] < changed[False]


@pytest.mark.parametrize("seed", range(4))
def test_pasted_objects_stay_inside_and_never_overlap(seed):
    g = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 255, (3, 40, 48), generator=g, dtype=torch.uint8)
    boxes, labels = torch.tensor([[5.0, 5, 15, 20], [30, 10, 44, 30]]), torch.tensor([0, 1])
    donors = []
    for d in range(6):
        dh, dw = (int(v) for v in torch.randint(20, 60, (2,), generator=g))
        xy = torch.rand(3, 2, generator=g) * torch.tensor([dw - 4, dh - 4])
        wh = torch.rand(3, 2, generator=g) * 14 + 2
        donors.append((torch.randint(0, 255, (3, dh, dw), generator=g, dtype=torch.uint8),
                       torch.cat([xy, (xy + wh).minimum(torch.tensor([dw, dh]))], 1), torch.tensor([0, 1, 2]) + 10 * d))
    donors.append((torch.zeros(3, 8, 8, dtype=torch.uint8), torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)))
    donors.append((torch.zeros(3, 90, 90, dtype=torch.uint8), torch.tensor([[0.0, 0, 80, 80]]), torch.tensor([99])))
    out, b, lab = copy_paste(image, boxes, labels, donors, g)
    assert torch.equal(b[:2], boxes) and lab[:2].tolist() == [0, 1]
    assert 99 not in lab.tolist() and len(lab) > 2  # larger than the image: left out
    assert (b[:, 0] >= 0).all() and (b[:, 2] <= 48).all() and (b[:, 1] >= 0).all() and (b[:, 3] <= 40).all()
    for i in range(len(b)):
        for j in range(i + 1, len(b)):
            across = min(b[i, 2], b[j, 2]) - max(b[i, 0], b[j, 0])
            down = min(b[i, 3], b[j, 3]) - max(b[i, 1], b[j, 1])
            assert not (across > 0 and down > 0), (b[i], b[j])
    for box, label in zip(b[2:], lab[2:].tolist(), strict=True):  # each the pixels of its donor's box
        d_image, d_boxes, _ = donors[label // 10]
        x0, y0, x1, y1 = (int(v) for v in box)
        src = d_boxes[label % 10]
        sx, sy = int(src[0].floor()), int(src[1].floor())
        assert torch.equal(out[:, y0:y1, x0:x1], d_image[:, sy : sy + y1 - y0, sx : sx + x1 - x0])


def test_a_mask_declared_at_another_size_than_the_image_is_not_decoded(tmp_path, caplog, monkeypatch):
    """An instances file that declares a 4000 x 4000 image for an 8 x 8 one: its objects' masks
    are refused before decoding (no [n, 4000, 4000] stack from a 1 KB file), with a warning naming
    the image, and the objects are pasted with their boxes."""
    import json
    import logging

    from PIL import Image

    import vision_attn.data.masks as masks_module
    from vision_attn.data.detection import CocoDetection

    (tmp_path / "train").mkdir()
    (tmp_path / "annotations").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "a.png")
    anns = [{"id": k + 1, "image_id": 7, "category_id": 1, "bbox": [1, 1, 4, 4],
             "segmentation": [[1, 1, 5, 1, 5, 5]]} for k in range(3)]
    (tmp_path / "annotations" / "instances_train.json").write_text(json.dumps(
        {"images": [{"id": 7, "file_name": "a.png", "height": 4000, "width": 4000}], "annotations": anns,
         "categories": [{"id": 1, "name": "c"}]}))
    ds = CocoDetection(tmp_path, "train", scored_targets=False)
    size = tuple(ds._raw(0)[0].shape[-2:])
    assert size == (8, 8)
    with caplog.at_level(logging.WARNING):
        assert ds._object_mask(0, 0, (4000, 4000)) is not None  # declared and read sizes agree: decoded
        monkeypatch.setattr(masks_module, "decode_segmentation", lambda *a, **k: pytest.fail("decoded"))
        assert _stacked_masks(ds._object_mask, 0, 3, size) is None
    assert "image id 7" in caplog.text and "4000x4000 is not the image's 8x8" in caplog.text
