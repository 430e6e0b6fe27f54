"""Data layouts: annotation files and image folders per split for COCO-layout data,
and a seeded stratified validation split of an ImageFolder without ``val/``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter

import pytest
from PIL import Image

from vision_attn.data.captioning import CaptioningDataModule, read_captions
from vision_attn.data.classification import ImageFolderDataModule, stratified_holdout
from vision_attn.data.detection import CocoDetection, DetectionDataModule
from vision_attn.data.layout import FolderLayout, SplitLayout
from vision_attn.data.loading import Batching
from vision_attn.errors import DataError

PRE = {"input_size": (3, 8, 8), "interpolation": "bilinear", "mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0}
CATS = [{"id": 3, "name": "thing"}]


def _png(path, colour=(0, 0, 0)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)
    return path


def _split(ann_file, images_dir, names, kind="instances", make_files=True):
    """A COCO split: ``names`` as file names in ``ann_file``, the images in ``images_dir``."""
    images = [{"id": i + 1, "file_name": n, "width": 8, "height": 8} for i, n in enumerate(names)]
    if kind == "instances":
        anns = [{"id": i, "image_id": im["id"], "category_id": 3, "bbox": [1, 1, 4, 4]} for i, im in enumerate(images)]
    else:
        anns = [{"id": i, "image_id": im["id"], "caption": f"a {kind} picture"} for i, im in enumerate(images)]
    if make_files:
        for n in names:
            _png(images_dir / n)
    ann_file.parent.mkdir(parents=True, exist_ok=True)
    ann_file.write_text(json.dumps({"images": images, "annotations": anns, "categories": CATS}))


@pytest.mark.parametrize(("module", "kind"), [(DetectionDataModule, "instances"), (CaptioningDataModule, "captions")])
def test_annotation_files_and_image_folders_per_split(tmp_path, module, kind):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _split(root / "annotations" / f"{kind}_train.json", root / "train", ["a.png", "sub/b.png"], kind)  # default
    _split(elsewhere / "my_val.json", elsewhere / "pictures", ["c.png"], kind)  # absolute, outside ROOT
    _split(root / "labels" / "test.json", root / "imgs" / "test", ["d.png", "e.png"], kind)  # relative: under ROOT
    dm = module(root=str(root), batching=Batching(num_workers=0),
                layout=SplitLayout(val_annotations=str(elsewhere / "my_val.json"),
                                   val_images=str(elsewhere / "pictures"), test_annotations="labels/test.json",
                                   test_images="imgs/test"))
    dm.preprocess = PRE
    train, val, test = dm.dataset("train", train=True), dm.dataset("val"), dm.eval_dataloader("test").dataset
    assert (len(train), len(val), len(test)) == (2, 1, 2)
    assert val.ann_file == elsewhere / "my_val.json" and test.ann_file == root / "labels" / "test.json"
    assert val.image_path(0) == (elsewhere / "pictures" / "c.png").resolve()
    # output names: relative to ROOT (as today), or to the images folder when it lies outside ROOT
    assert [train.relative_file(i) for i in range(2)] == ["train/a.png", "train/sub/b.png"]
    assert val.relative_file(0) == "c.png"
    assert test.relative_file(1) == "imgs/test/e.png"
    if kind == "captions":
        assert "captions" in dm.tokenizer.vocab  # trained from the training captions


@pytest.mark.parametrize(("module", "kind"), [(DetectionDataModule, "instances"), (CaptioningDataModule, "captions")])
def test_every_path_given_needs_no_root_and_generates_nothing(tmp_path, monkeypatch, module, kind):
    import vision_attn.data.detection as detection

    monkeypatch.setattr(detection, "ensure_shapes_coco", lambda *a: pytest.fail("generated the embedded data"))
    monkeypatch.chdir(tmp_path)
    _split(tmp_path / "tr.json", tmp_path / "tr", ["a.png"], kind)
    _split(tmp_path / "va.json", tmp_path / "va", ["b.png"], kind)
    dm = module(batching=Batching(num_workers=0),
                layout=SplitLayout(train_annotations="tr.json", train_images="tr", val_annotations="va.json",
                                   val_images="va"))
    dm.preprocess = PRE
    assert len(dm.dataset("val")) == 1 and dm.dataset("val").relative_file(0) == "va/b.png"


def test_a_missing_images_folder_names_it_and_the_option(tmp_path):
    _split(tmp_path / "val.json", tmp_path / "nowhere", ["a.png"], make_files=False)
    with pytest.raises(DataError, match=r"images folder .*nowhere of split 'val' does not exist.*_images"):
        CocoDetection(tmp_path, "val", ann_file=tmp_path / "val.json", images_dir=tmp_path / "nowhere")


# --- the path rules (no path outside the folder, no symbolic links) hold for given image folders ---


@pytest.mark.parametrize("kind", ["instances", "captions"])
def test_given_images_folder_keeps_files_inside_it(tmp_path, kind, caplog):
    secret = _png(tmp_path / "secret.png", (255, 0, 0))
    folder = tmp_path / "data" / "pictures"
    _png(folder / "ok.png")
    os.symlink(secret, folder / "link.png")
    ann = tmp_path / "data" / "ann.json"
    _split(ann, folder, ["ok.png", "../../secret.png"], kind, make_files=False)
    paths = {"images_dir": folder, "ann_file": ann}

    def load(**kw):
        if kind == "instances":
            return [im["id"] for im in CocoDetection(tmp_path, "val", **paths, **kw).images]
        return [im["id"] for im in read_captions(tmp_path, "val", **paths, **kw)[0]]

    with pytest.raises(DataError, match=r"ann.json: image id 2 names .*secret.png, a path outside the split folder"):
        load()  # evaluation: an error
    with caplog.at_level(logging.WARNING):
        kept = load(**({"skip_unreadable": True} if kind == "instances" else {"skip_refused": True}))
    assert kept == [1] and "skipped 1 images or folders whose path leaves the split folder" in caplog.text
    _split(ann, folder, ["link.png"], kind, make_files=False)
    with pytest.raises(DataError, match=r"symbolic link .*secret.png.*follow_symlinks true"):
        load()
    assert load(follow_symlinks=True) == [1]
    os.symlink(folder, tmp_path / "linked_folder")  # the given folder itself may be a link
    paths["images_dir"] = tmp_path / "linked_folder"
    _split(ann, folder, ["ok.png"], kind, make_files=False)
    assert load() == [1]


@pytest.mark.parametrize("module", [DetectionDataModule, CaptioningDataModule, ImageFolderDataModule])
def test_layout_options_are_on_the_command_line(module):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(module, "data")
    if module is ImageFolderDataModule:
        cfg = parser.parse_args(["--data.layout.val_fraction", "0.2", "--data.layout.val_seed", "3"]).data.layout
        assert (cfg.val_fraction, cfg.val_seed) == (0.2, 3)
        return
    args = [f"--data.layout.{s}_{what}={s}.{what}" for s in ("train", "val", "test")
            for what in ("annotations", "images")]
    cfg = parser.parse_args(args).data.layout
    assert (cfg.train_annotations, cfg.val_images, cfg.test_annotations) == ("train.annotations", "val.images",
                                                                           "test.annotations")
    assert parser.parse_args([]).data.layout.val_annotations is None


# --- ImageFolder without val/: a seeded stratified held-out part of train/ ------------------------


def _train_only(root, counts):
    for cls, n in counts.items():
        for i in range(n):
            _png(root / "train" / cls / f"{i:02d}.png", (i * 10, 0, 0))
    return root


def test_val_fraction_holds_out_a_seeded_stratified_part_of_train(tmp_path):
    root = _train_only(tmp_path, {"a": 10, "b": 4, "c": 1})
    dm = ImageFolderDataModule(root=str(root), batching=Batching(num_workers=0),
                               layout=FolderLayout(val_fraction=0.3, val_seed=5))
    dm.preprocess = PRE
    dm.setup("fit")
    train, val = dm.datasets["train"], dm.datasets["val"]
    val_files = {f for f, _ in val.samples}
    train_files = {f for f, _ in train.samples}
    assert not val_files & train_files and len(val_files | train_files) == 15
    assert all(f.startswith("train/") for f in val_files)  # predictions name files relative to ROOT
    assert val.relative_file(0) == val.samples[0][0]
    # per class: round(0.3 n), at least one of a class of two or more, never a whole class
    assert Counter(dm.class_names[label] for _, label in val.samples) == {"a": 3, "b": 1}
    # the rule, computed by hand: first by SHA-256 of "<seed>/<class>/<file>"
    ranked = sorted((f"a/{i:02d}.png" for i in range(10)), key=lambda f: hashlib.sha256(f"5/{f}".encode()).hexdigest())
    assert {f for f in val_files if f.startswith("train/a/")} == {f"train/{f}" for f in ranked[:3]}
    # deterministic: the same seed, the same split (also for eval.py); another seed, another
    again = ImageFolderDataModule(root=str(root), batching=Batching(num_workers=0),
                                  layout=FolderLayout(val_fraction=0.3, val_seed=5))
    again.preprocess = PRE
    assert {f for f, _ in again.eval_dataloader("val").dataset.samples} == val_files
    assert any(stratified_holdout({f"a/{i:02d}.png" for i in range(10)}, 0.3, s) != set(ranked[:3]) for s in (6, 7))
    # labels are those of the folders
    assert all(dm.class_names[label] == f.split("/")[1] for f, label in val.samples)


def test_val_fraction_and_a_val_folder_or_neither_are_clear_errors(tmp_path):
    root = _train_only(tmp_path, {"a": 3})
    dm = ImageFolderDataModule(root=str(root), batching=Batching(num_workers=0))
    dm.preprocess = PRE
    with pytest.raises(DataError, match=r"val does not exist: add it, or pass --data.layout.val_fraction"):
        dm.setup("fit")
    with pytest.raises(DataError, match="strictly between 0 and 1"):
        ImageFolderDataModule(root=str(root), layout=FolderLayout(val_fraction=1.0))
    _png(root / "val" / "a" / "x.png")
    with pytest.raises(DataError, match=r"val exists and --data.layout.val_fraction 0.2 is set"):
        ImageFolderDataModule(root=str(root), layout=FolderLayout(val_fraction=0.2))
