"""COCO-captions data: layout, sampling, padding, and bad annotation files."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vision_attn.data.captioning import (
    CAPTIONING_BATCHING,
    CaptioningDataModule,
    CaptionOptions,
    CocoCaptions,
    caption_collate,
    read_captions,
)
from vision_attn.data.loading import Batching
from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco
from vision_attn.data.tokenizer import WordTokenizer
from vision_attn.errors import DataError

PRE = {"input_size": (3, 32, 32), "interpolation": "bicubic", "mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0}


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory) -> Path:
    return ensure_shapes_coco(SceneSetConfig(image_size=32, num_train=12, num_val=6), tmp_path_factory.mktemp("cap"))


def _copy_with(root: Path, tmp: Path, edit) -> Path:
    import shutil

    new = tmp / "data"
    shutil.copytree(root, new)
    path = new / "annotations" / "captions_val.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return new


def test_synthetic_captions_name_every_object_left_to_right(coco_root):
    inst = json.loads((coco_root / "annotations" / "instances_val.json").read_text())
    caps = json.loads((coco_root / "annotations" / "captions_val.json").read_text())
    kinds = {c["id"]: c["name"] for c in inst["categories"]}
    for im in inst["images"]:
        anns = sorted((a for a in inst["annotations"] if a["image_id"] == im["id"]),
                      key=lambda a: a["bbox"][0] + a["bbox"][2] / 2)
        texts = [c["caption"] for c in caps["annotations"] if c["image_id"] == im["id"]]
        assert len(texts) == 5 and len(set(texts)) >= 4  # varied phrasings
        plain = min(texts, key=len)  # the plain list: "a red circle, a blue star and ..."
        positions = [plain.find(kinds[a["category_id"]]) for a in anns]
        assert all(p >= 0 for p in positions) and positions == sorted(positions), (plain, positions)


def test_dataset_items_and_collate(coco_root):
    images, captions = read_captions(coco_root, "train")
    tok = WordTokenizer.train(c for cs in captions.values() for c in cs)
    from vision_attn.data.transforms import build_eval_transform

    ds = CocoCaptions(coco_root, "train", build_eval_transform(PRE), tok, sample="random", max_length=12)
    assert len(ds) == 12 and all(len(r) == 5 for r in ds.references)
    image, tokens, index = ds[3]
    assert image.shape == (3, 32, 32) and index == 3
    assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id and len(tokens) <= 12
    # training samples among all references of the image
    seen = Counter(tok.decode(ds[0][1].tolist()) for _ in range(60))
    assert len(seen) >= 3
    ds.sample = "first"
    assert all(tok.decode(ds[0][1].tolist()) == tok.decode(tok.encode(ds.references[0][0], 12)) for _ in range(3))
    imgs, toks, idx = caption_collate([ds[0], ds[1]], tok.pad_id)
    assert imgs.shape == (2, 3, 32, 32) and idx.tolist() == [0, 1]
    lens = [len(ds[i][1]) for i in (0, 1)]
    assert toks.shape == (2, max(lens)) and (toks[lens.index(min(lens)), min(lens):] == tok.pad_id).all()


def test_datamodule_trains_tokenizer_and_accepts_the_models(coco_root):
    dm = CaptioningDataModule(root=str(coco_root), batching=Batching(batch_size=4, num_workers=0),
                              captions=CaptionOptions(max_length=16))
    dm.preprocess = PRE
    assert {"circle", "square", "triangle", "star", "cross"} <= set(dm.tokenizer.vocab)
    dm.setup("fit")
    images, tokens, idx = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and tokens.dtype == torch.int64 and tokens.shape[1] <= 16
    other = WordTokenizer.train(["completely different words"])
    dm.tokenizer = other  # a checkpoint's tokenizer wins, also in already built datasets
    assert dm.datasets["train"].tokenizer is other



def test_several_captions_per_image_are_distinct_references_image_by_image(coco_root):
    dm = CaptioningDataModule(root=str(coco_root), batching=Batching(batch_size=4, num_workers=0),
                              captions=CaptionOptions(max_length=32, per_image=3))
    dm.preprocess = PRE
    dm.setup("fit")
    tok = dm.tokenizer
    images, tokens, idx = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and tokens.shape[0] == 12
    train = dm.datasets["train"]
    for row in range(12):  # rows 3i .. 3i+2 caption image i, each one of its own references
        i = int(idx[row // 3])
        refs = {tok.decode(tok.encode(r, 32)) for r in train.references[i]}
        assert tok.decode(tokens[row].tolist()) in refs
    for i in range(4):  # drawn without replacement: three different references per image
        refs = [tok.decode(tok.encode(r, 32)) for r in train.references[int(idx[i])]]  # generated: may repeat
        repeats = len(refs) - len(set(refs))  # a repeated text drawn twice is one caption
        drawn = len({tuple(tokens[3 * i + j].tolist()) for j in range(3)})
        assert min(3, len(set(refs))) - repeats <= drawn <= 3 and (repeats or drawn == 3)
    # more than an image has: every reference, then drawn again
    train.captions_per_item = 7
    item = train[0][1]
    assert len(item) == 7 and len({tuple(t.tolist()) for t in item}) == len(set(train.references[0]))
    # validation keeps one caption per image
    dm.setup("validate")
    assert dm.datasets["val"].captions_per_item == 1 and next(iter(dm.val_dataloader()))[1].ndim == 2
    with pytest.raises(DataError, match="captions.per_image"):
        CaptioningDataModule(root=str(coco_root), captions=CaptionOptions(per_image=0))

def test_missing_image_ids_empty_and_non_text_captions_are_counted_warnings(coco_root, tmp_path, caplog):
    def edit(data):
        first = data["images"][0]["id"]
        data["annotations"].append({"id": 9001, "image_id": 424242, "caption": "a red circle"})
        data["annotations"].append({"id": 9002, "image_id": first, "caption": "  ... "})
        data["annotations"].append({"id": 9003, "image_id": first, "caption": None})
        for a in data["annotations"]:  # image 2 keeps no usable caption
            if a["image_id"] == data["images"][1]["id"]:
                a["caption"] = ""

    root = _copy_with(coco_root, tmp_path, edit)
    with caplog.at_level(logging.WARNING):
        images, captions = read_captions(root, "val")
    text = caplog.text
    assert "dropped 1 captions (unknown image id), e.g. annotation id 9001" in text
    assert "dropped 6 captions (empty caption)" in text  # 1 + the 5 of image 2
    assert "dropped 1 captions (caption is not text), e.g. annotation id 9003" in text
    assert "skipped 1 images without a usable caption" in text
    assert len(images) == 5 and len(captions[images[0]["id"]]) == 5


def test_unreadable_files_are_clear_errors(coco_root, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(coco_root, root)
    ann = root / "annotations" / "captions_val.json"
    ann.write_bytes(json.dumps({"images": [], "annotations": []}).encode().replace(b"[]", b'["\xff\xfe"]', 1))
    with pytest.raises(DataError, match=f"annotation file {ann} is not UTF-8"):
        read_captions(root, "val")
    ann.write_text("{not json")
    with pytest.raises(DataError, match="is not valid JSON"):
        read_captions(root, "val")
    shutil.copy(coco_root / "annotations" / "captions_val.json", ann)
    victim = sorted((root / "val").iterdir())[0]
    victim.unlink()
    with pytest.raises(DataError, match=f"has no file {victim}"):
        read_captions(root, "val")
    with pytest.raises(DataError, match="captions_test.json does not exist"):
        read_captions(root, "test")
    with pytest.raises(DataError, match="does not exist; pass --data.root"):
        CaptioningDataModule(root=str(tmp_path / "absent"))


def _boxes_dataset(coco_root, transform):
    images, captions = read_captions(coco_root, "train")
    tok = WordTokenizer.train(c for cs in captions.values() for c in cs)
    return CocoCaptions(coco_root, "train", transform, tok, sample="first", max_length=12)


def test_attached_boxes_are_the_instance_files(coco_root):
    """Items carry each image's annotated boxes (normalised) and kinds; the collate keeps them."""
    from vision_attn.data.transforms import build_train_transform

    ds = _boxes_dataset(coco_root, build_train_transform(PRE, "none"))
    assert len(ds[0]) == 3  # nothing attached: the plain items
    classes = ds.attach_boxes()
    inst = json.loads(ds.instances_file.read_text())
    assert classes == [c["name"] for c in inst["categories"]]
    for index in range(len(ds)):
        image, tokens, i, (boxes, labels) = ds[index]
        im = ds.images[index]
        size = next(x for x in inst["images"] if x["id"] == im["id"])
        anns = [a for a in inst["annotations"] if a["image_id"] == im["id"]]
        want = torch.tensor([[x / size["width"], y / size["height"], (x + w) / size["width"], (y + h) / size["height"]]
                             for x, y, w, h in (a["bbox"] for a in anns)])
        names = {c["id"]: c["name"] for c in inst["categories"]}
        assert i == index and len(boxes) == len(anns) >= 1
        torch.testing.assert_close(boxes, want.clamp(0, 1))
        assert [classes[c] for c in labels.tolist()] == [names[a["category_id"]] for a in anns]
    *_, boxes = caption_collate([ds[0], ds[1]], 0)
    assert len(boxes) == 2 and torch.equal(boxes[1][1], ds[1][3][1])
    # categories outside the given list are left out; the labels index the given list
    only = [classes[1]]
    ds.attach_boxes(only)
    for index in range(len(ds)):
        assert ds[index][3][1].tolist() == [0] * len(ds[index][3][1])


def test_attached_boxes_follow_the_small_augmentation(tmp_path):
    """Under the crop of ``augment small`` the boxes move with the objects: every object pixel
    lies in a box (away from the margin the reflect padding may mirror objects into), and
    each box is filled by its object."""
    from vision_attn.data.transforms import build_train_transform

    plain = ensure_shapes_coco(SceneSetConfig(image_size=32, num_train=12, num_val=2, noise=0, clutter=0), tmp_path)
    pre = {**PRE, "mean": (0.0,) * 3, "std": (1.0,) * 3}
    ds = _boxes_dataset(plain, build_train_transform(pre, "small", hflip=False))
    ds.attach_boxes()
    aug = ds.transform.transforms[0]
    aug.jitter = 0.0  # the background stays one colour
    torch.manual_seed(0)
    for index in range(len(ds)):
        image, _, _, (boxes, _) = ds[index]
        h, w = image.shape[1:]
        values, counts = image.reshape(3, -1).T.unique(dim=0, return_counts=True)
        background = values[counts.argmax()].reshape(3, 1, 1)
        foreground = (image - background).abs().amax(0) > 0.1
        covered = torch.zeros(h, w, dtype=torch.bool)
        for b in boxes:
            x0, y0, x1, y1 = (b * torch.tensor([w, h, w, h])).tolist()
            x0, y0, x1, y1 = int(x0) - 1, int(y0) - 1, int(x1 + 0.999) + 1, int(y1 + 0.999) + 1  # 1 px of antialiasing
            covered[max(0, y0):y1, max(0, x0):x1] = True
            assert foreground[max(0, y0):y1, max(0, x0):x1].float().mean() > 0.25  # the object fills its box
        m = aug.pad
        assert not (foreground & ~covered)[m:h - m, m:w - m].any()


def test_attach_boxes_needs_a_transform_boxes_can_follow(coco_root, tmp_path):
    from vision_attn.data.transforms import build_train_transform

    ds = _boxes_dataset(coco_root, build_train_transform(PRE, "small", randaugment_ops=2))
    with pytest.raises(DataError, match=r"instances_train.json.*augment none or small"):
        ds.attach_boxes()
    import shutil

    copy = tmp_path / "no_instances"
    shutil.copytree(coco_root, copy)
    (copy / "annotations" / "instances_train.json").unlink()
    assert _boxes_dataset(copy, build_train_transform(PRE, "none")).attach_boxes() is None


@pytest.mark.parametrize("read_before", [False, True])
def test_attached_boxes_stay_on_the_stored_pixels_of_an_exif_rotated_image(tmp_path, read_before):
    """Boxes are drawn on the stored pixels (as the detection data reads them): with boxes
    attached, the image is not turned by its EXIF orientation, so the box stays on the object —
    also when the dataset already read (and cached) the turned image before the boxes came."""
    from vision_attn.data.transforms import build_train_transform

    from .conftest import write_exif_rotated_jpeg

    write_exif_rotated_jpeg(tmp_path)  # val/a.jpg: 40x20 stored, white square at x 28..36, y 2..10
    image = {"id": 1, "file_name": "a.jpg", "width": 40, "height": 20}
    (tmp_path / "annotations" / "captions_val.json").write_text(json.dumps(
        {"images": [image], "annotations": [{"id": 1, "image_id": 1, "caption": "a white square"}]}))
    (tmp_path / "annotations" / "instances_val.json").write_text(json.dumps(
        {"images": [image], "categories": [{"id": 3, "name": "square"}],
         "annotations": [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [28, 2, 8, 8], "area": 64, "iscrowd": 0}]}))
    tok = WordTokenizer.train(["a white square"])
    ds = CocoCaptions(tmp_path, "val", build_train_transform(PRE, "none"), tok)
    if read_before:
        ds[0]
    assert ds.attach_boxes() == ["square"]
    picture, _, _, (boxes, labels) = ds[0]
    torch.testing.assert_close(boxes, torch.tensor([[0.7, 0.1, 0.9, 0.5]]))
    x0, y0, x1, y1 = (boxes[0] * 32).round().int().tolist()
    bright = picture.mean(0) > 0
    assert bright[y0:y1, x0:x1].float().mean() > 0.8 and bright.sum() <= 1.2 * (x1 - x0) * (y1 - y0)


def test_auto_batch_size_for_captions(coco_root):
    dm = CaptioningDataModule(root=str(coco_root), batching=replace(CAPTIONING_BATCHING, batch_size="auto",
                                                                    min_steps_per_epoch=2, min_batch_size=1,
                                                                    max_batch_size=64, num_workers=0),
                              captions=CaptionOptions(max_length=16))
    dm.preprocess = PRE
    dm.setup("fit")
    images = len(dm.datasets["train"])
    expected = 1 << ((images // 2).bit_length() - 1)  # largest power of two <= images / 2 steps
    assert dm.train_dataloader().batch_size == expected and len(dm.train_dataloader()) >= 2
    assert dm.hparams["train_images"] == images and dm.val_dataloader().batch_size == 64


def test_decoded_images_are_read_once_across_epochs(coco_root, monkeypatch):
    """Cached or not, the same items under the same seed, boxes attached and the training
    transform drawing crops and colours; each image decoded once."""
    import vision_attn.data.captioning as captioning
    from vision_attn.data.transforms import build_train_transform

    from .conftest import assert_same_items, cached_and_uncached_epochs

    calls = []
    real = captioning.read_image
    monkeypatch.setattr(captioning, "read_image", lambda *a, **k: calls.append(a[0]) or real(*a, **k))

    def make():
        ds = _boxes_dataset(coco_root, build_train_transform(PRE, "small", hflip=False))
        ds.attach_boxes()
        return ds

    on, off = cached_and_uncached_epochs(make, monkeypatch)
    assert len(calls) == 2 * len(on) and len(set(calls)) == len(on)
    assert_same_items(on, off)
