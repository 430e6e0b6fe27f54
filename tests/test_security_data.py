"""Data-side attacks: reads outside the data root, non-integer image ids, deeply
nested or malformed annotation files. Each is refused with a clear DataError (evaluation) or a
counted warning (training), never followed and never a traceback."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import pytest
from PIL import Image

from vision_attn.data.captioning import CAPTIONING_BATCHING, CaptioningDataModule, read_captions
from vision_attn.data.classification import ImageFolderDataModule, ImageFolderDataset
from vision_attn.data.detection import (
    DETECTION_BATCHING,
    CocoDetection,
    DetectionDataModule,
    load_coco_annotations,
)
from vision_attn.data.layout import FolderLayout, SplitLayout
from vision_attn.data.loading import Batching
from vision_attn.errors import DataError

CATS = [{"id": 1, "name": "thing"}]


def _png(path, colour=(0, 0, 0)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)
    return path


def _coco_split(root, file_names, kind="instances", split="val", ids=None):
    """A COCO split whose images have ``file_names`` (the files themselves are made by the test)."""
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    ids = ids or list(range(1, len(file_names) + 1))
    images = [{"id": i, "file_name": f, "width": 8, "height": 8} for i, f in zip(ids, file_names, strict=True)]
    if kind == "instances":
        anns = [{"id": k, "image_id": i, "category_id": 1, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 0}
                for k, i in enumerate(ids)]
    else:
        anns = [{"id": k, "image_id": i, "caption": "a black square"} for k, i in enumerate(ids)]
    data = {"images": images, "annotations": anns, "categories": CATS}
    (root / "annotations" / f"{kind}_{split}.json").write_text(json.dumps(data))
    return root


@pytest.fixture
def outside(tmp_path):
    """A secret image outside the data root, and the data root."""
    secret = _png(tmp_path / "secret" / "outside.png", (255, 0, 0))
    root = tmp_path / "data" / "root"
    root.mkdir(parents=True)
    return secret, root


def _escaping_names(secret):
    return ["../../../secret/outside.png", str(secret)]  # climbs out with .., absolute path


# --- 15.6: COCO file_name values that leave the split folder --------------------------------------


@pytest.mark.parametrize("which", [0, 1], ids=["dotdot", "absolute"])
def test_detection_file_name_outside_the_split_is_refused(outside, which, caplog):
    secret, root = outside
    name = _escaping_names(secret)[which]
    _png(root / "val" / "ok.png")
    _coco_split(root, ["ok.png", name])
    assert (root / "val" / name).resolve() == secret.resolve()  # the path would reach the secret
    with pytest.raises(DataError, match=r"instances_val.json: image id 2 names .*refused"):
        CocoDetection(root, "val")  # evaluation: an error
    with caplog.at_level(logging.WARNING):
        ds = CocoDetection(root, "val", skip_unreadable=True)  # training: a counted warning
    assert [im["id"] for im in ds.images] == [1]
    assert "skipped 1 images or folders whose path leaves the split folder, e.g. image id 2" in caplog.text
    dm = DetectionDataModule(root=str(root), layout=SplitLayout(train_split="val", val_split="val"),
                             batching=replace(DETECTION_BATCHING, num_workers=0))
    dm.preprocess = {"input_size": (3, 8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3}
    assert len(dm.dataset("val", train=True)) == 1
    with pytest.raises(DataError, match="image id 2"):
        dm.dataset("val")


@pytest.mark.parametrize("which", [0, 1], ids=["dotdot", "absolute"])
def test_captioning_file_name_outside_the_split_is_refused(outside, which, caplog):
    secret, root = outside
    _png(root / "val" / "ok.png")
    _coco_split(root, ["ok.png", _escaping_names(secret)[which]], kind="captions")
    with pytest.raises(DataError, match=r"captions_val.json: image id 2 names .*refused"):
        read_captions(root, "val")
    with caplog.at_level(logging.WARNING):
        images, captions = read_captions(root, "val", skip_refused=True)
    assert [im["id"] for im in images] == [1] and set(captions) == {1}
    assert "skipped 1 images or folders whose path leaves the split folder" in caplog.text
    dm = CaptioningDataModule(root=str(root), layout=SplitLayout(train_split="val", val_split="val"),
                              batching=replace(CAPTIONING_BATCHING, num_workers=0))
    dm.preprocess = {"input_size": (3, 8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3}
    assert len(dm.dataset("val", train=True)) == 1  # training (tokenizer included) skips it
    with pytest.raises(DataError, match="image id 2"):
        dm.dataset("val")


def test_coco_symlinked_file_is_followed_only_when_asked(outside):
    secret, root = outside
    (root / "val").mkdir()
    os.symlink(secret, root / "val" / "link.png")
    _coco_split(root, ["link.png"])
    with pytest.raises(DataError, match=r"symbolic link .*follow_symlinks true"):
        CocoDetection(root, "val")
    assert len(CocoDetection(root, "val", follow_symlinks=True)) == 1
    _coco_split(root, ["link.png"], kind="captions")
    with pytest.raises(DataError, match="symbolic link"):
        read_captions(root, "val")
    assert len(read_captions(root, "val", follow_symlinks=True)[0]) == 1


def test_a_loop_of_symbolic_links_is_a_refused_image_not_a_crash(tmp_path):
    (tmp_path / "val").mkdir()
    os.symlink("b.png", tmp_path / "val" / "a.png")
    os.symlink("a.png", tmp_path / "val" / "b.png")
    _coco_split(tmp_path, ["a.png"])
    with pytest.raises(DataError, match="a.png.*a loop of symbolic links"):
        CocoDetection(tmp_path, "val")


def test_a_split_folder_that_is_a_symlink_is_fine(tmp_path):
    real = tmp_path / "elsewhere" / "val"
    _png(real / "a.png")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(real, root / "val")
    _coco_split(root, ["a.png"])
    assert len(CocoDetection(root, "val")) == 1
    _png(real / "cls" / "b.png")
    os.symlink(real, root / "train")
    assert len(ImageFolderDataset(root, "train", ["cls"])) == 1


def test_a_class_folder_linked_outside_is_refused_before_its_files_are_listed(outside, caplog):
    secret, root = outside
    _png(root / "train" / "cls" / "a.png")
    os.symlink(secret.parent, root / "train" / "linked")
    with pytest.raises(DataError, match=r"class folder linked names .*linked, a symbolic link to .*secret") as info:
        ImageFolderDataset(root, "train", ["cls", "linked"])
    assert "outside.png" not in str(info.value)  # nothing in the folder outside was listed
    with caplog.at_level(logging.WARNING):
        ds = ImageFolderDataset(root, "train", ["cls", "linked"], skip_unreadable=True)
    assert len(ds) == 1 and "skipped 1 images or folders" in caplog.text and "outside.png" not in caplog.text
    assert len(ImageFolderDataset(root, "train", ["cls", "linked"], files=["cls/a.png"])) == 1  # not asked for


# --- 15.6: ImageFolder files that are symlinks to elsewhere --------------------------------------


def test_imagefolder_symlinks_outside_are_followed_only_with_follow_symlinks(outside, caplog):
    secret, root = outside
    _png(root / "train" / "cls" / "a.png")
    os.symlink(secret, root / "train" / "cls" / "b.png")  # a file link
    os.symlink(secret.parent, root / "train" / "linked")  # a class folder link
    with pytest.raises(DataError, match=r"names .*b.png, a symbolic link to .*outside.png"):
        ImageFolderDataset(root, "train", ["cls", "linked"])  # evaluation: an error
    with caplog.at_level(logging.WARNING):
        ds = ImageFolderDataset(root, "train", ["cls", "linked"], skip_unreadable=True)
    assert [s for s, _ in ds.samples] == [os.path.join("train", "cls", "a.png")]
    assert "skipped 2 images or folders whose path leaves the split folder" in caplog.text
    ds = ImageFolderDataset(root, "train", ["cls", "linked"], follow_symlinks=True)
    assert len(ds) == 3
    dm = ImageFolderDataModule(root=str(root), layout=FolderLayout(val_split="train", follow_symlinks=True),
                               batching=Batching(num_workers=0))
    dm.preprocess = {"input_size": (3, 8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0}
    assert len(dm.dataset("train")) == 3


@pytest.mark.parametrize("module", [ImageFolderDataModule, DetectionDataModule, CaptioningDataModule])
def test_follow_symlinks_is_a_command_line_option_of_every_data_module(module):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(module, "data")
    assert parser.parse_args(["--data.layout.follow_symlinks", "true"]).data.layout.follow_symlinks is True
    assert parser.parse_args([]).data.layout.follow_symlinks is False


# --- 15.5 (read side): image ids are integers ---------------------------------------------------


@pytest.mark.parametrize("kind", ["instances", "captions"])
@pytest.mark.parametrize("bad_id", ["../../../../tmp/x", 1.5, True, None])
def test_non_integer_image_ids_are_clear_errors(tmp_path, kind, bad_id):
    _png(tmp_path / "val" / "a.png")
    _coco_split(tmp_path, ["a.png"], kind=kind, ids=[bad_id])
    with pytest.raises(DataError, match=rf"{kind}_val.json: image id .* is not an integer"):
        CocoDetection(tmp_path, "val") if kind == "instances" else read_captions(tmp_path, "val")


@pytest.mark.parametrize("kind", ["instances", "captions"])
@pytest.mark.parametrize("bad_id", [-1, 10**30, 2**63], ids=["negative", "10**30", "2**63"])
def test_image_ids_outside_what_coco_tools_accept_are_clear_errors(tmp_path, kind, bad_id):
    """COCO ids are non-negative 64-bit integers: 0 <= id < 2**63."""
    _png(tmp_path / "val" / "a.png")
    _coco_split(tmp_path, ["a.png"], kind=kind, ids=[bad_id])
    with pytest.raises(DataError, match=rf"{kind}_val.json: image id {bad_id} is not an integer from 0 to 2\*\*63 - 1"):
        CocoDetection(tmp_path, "val") if kind == "instances" else read_captions(tmp_path, "val")
    _coco_split(tmp_path, ["a.png"], kind=kind, ids=[2**63 - 1])  # the largest id is accepted
    assert len(CocoDetection(tmp_path, "val") if kind == "instances" else read_captions(tmp_path, "val")[0]) == 1


@pytest.mark.parametrize("bad_id", [-1, 10**30, True], ids=["negative", "10**30", "true"])
def test_category_ids_outside_what_coco_tools_accept_are_clear_errors(tmp_path, bad_id):
    from vision_attn.data.captioning import read_annotated_objects

    _png(tmp_path / "val" / "a.png")
    _coco_split(tmp_path, ["a.png"])
    path = tmp_path / "annotations" / "instances_val.json"
    data = json.loads(path.read_text())
    data["categories"] = [{"id": bad_id, "name": "thing"}]
    data["annotations"][0]["category_id"] = bad_id
    path.write_text(json.dumps(data))
    match = rf"instances_val.json: category id {json.dumps(bad_id)} is not an integer from 0 to 2\*\*63 - 1"
    with pytest.raises(DataError, match=match):
        CocoDetection(tmp_path, "val")
    with pytest.raises(DataError, match=match):
        read_annotated_objects(path)  # captioning's content accuracy reads the categories too


def test_an_annotation_whose_image_id_is_true_is_not_attached_to_image_1(tmp_path, caplog):
    """``true`` equals ``1`` in Python: it must not attach a caption (or object) to image 1."""
    bad_id = True
    from vision_attn.data.captioning import read_annotated_objects

    _png(tmp_path / "val" / "a.png")
    path = _coco_split(tmp_path, ["a.png"], kind="captions") / "annotations" / "captions_val.json"
    data = json.loads(path.read_text())
    data["annotations"].append({"id": 7, "image_id": bad_id, "caption": "a hidden caption"})
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        _, captions = read_captions(tmp_path, "val")
    assert captions == {1: ["a black square"]}
    assert "dropped 1 captions (unknown image id), e.g. annotation id 7" in caplog.text
    path = _coco_split(tmp_path, ["a.png"]) / "annotations" / "instances_val.json"
    data = json.loads(path.read_text())
    data["annotations"].append({"id": 7, "image_id": bad_id, "category_id": 1, "bbox": [0, 0, 2, 2]})
    path.write_text(json.dumps(data))
    assert len(CocoDetection(tmp_path, "val").annotations[1]) == 1
    assert len(read_annotated_objects(path).objects[1]) == 1


# --- 15.11 (part): deeply nested and malformed annotation files ---------------------------------


@pytest.mark.parametrize("text", [
    "[" * 200_000 + "]" * 200_000,
    '{"images": ' + "[" * 200_000 + "]" * 200_000 + ', "annotations": []}',
    '{"images": [], "annotations": [], "x": ' + "1" * 5000 + "}",
    "[1, 2, 3]",
], ids=["nested-list", "nested-in-object", "huge-integer", "not-an-object"])
def test_deeply_nested_or_odd_json_is_a_data_error_naming_the_file(tmp_path, text):
    path = tmp_path / "annotations" / "instances_val.json"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(DataError, match="instances_val.json"):
        load_coco_annotations(path)


def test_malformed_entries_are_dropped_or_named_not_tracebacks(tmp_path, caplog):
    _png(tmp_path / "val" / "a.png")
    _coco_split(tmp_path, ["a.png"])
    path = tmp_path / "annotations" / "instances_val.json"
    data = json.loads(path.read_text())
    data["annotations"] += [
        "not an object",
        {"id": 11, "image_id": [1], "category_id": 1, "bbox": [0, 0, 2, 2]},  # unhashable id
        {"id": 12, "image_id": 1, "category_id": {"a": 1}, "bbox": [0, 0, 2, 2]},
        {"id": 13, "image_id": 1, "category_id": 1, "bbox": ["0", 0, 2, 2]},
        {"id": 14, "image_id": 1, "category_id": 1, "bbox": [0, 0, 2]},
        {"id": 15, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10**400, 2]},  # no float holds it
        {"id": 16, "image_id": 1, "category_id": 1, "bbox": [1e308, 0, 1e308, 2]},  # finite, its corner is not
        {"id": 17, "image_id": 1, "category_id": 1, "bbox": [0, 0, 2, 2], "area": 10**400},
    ]
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        ds = CocoDetection(tmp_path, "val")
    assert len(ds.annotations[1]) == 2
    assert ds.scoring_target(1)["area"].tolist()[-1] == 4.0  # the box's area instead
    for text in ("(not an object)", "annotation id 11", "annotation id 12", "bbox is not four numbers",
                 "dropped 2 annotations (non-finite box), e.g. annotation id 15"):
        assert text in caplog.text
    for images, cats, match in [
        ([{"id": 1, "file_name": ["a.png"]}], CATS, "file_name that is not text"),
        ([{"id": 1, "file_name": "a.png", "width": "8"}], CATS, "width that is not a finite number"),
        ([{"id": 1, "file_name": "a.png", "height": 10**400}], CATS, "id 1 has a height that is not a finite"),
        (["a.png"], CATS, "needs 'id' and 'file_name'"),
        ([{"id": 1, "file_name": "a.png"}], [{"id": "1"}], "needs an integer 'id'"),
    ]:
        path.write_text(json.dumps({"images": images, "annotations": [], "categories": cats}))
        with pytest.raises(DataError, match=match):
            CocoDetection(tmp_path, "val")
    captions = tmp_path / "annotations" / "captions_val.json"
    captions.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png"}],
                                    "annotations": [{"id": 1, "image_id": [1], "caption": "x"},
                                                    {"id": 2, "image_id": 1, "caption": "a square"}]}))
    images, caps = read_captions(tmp_path, "val")
    assert caps == {1: ["a square"]}


def test_a_data_roots_manifest_names_annotations_only_inside_the_root(tmp_path):
    """``manifest.json`` (where eval.py finds the embedded data's boxes) is untrusted: a file
    inside the root is found; odd JSON, a FIFO, links and names leading out of the root give none."""
    import os

    from vision_attn.data.synthetic import manifest_annotations

    root = tmp_path / "root"
    (root / "annotations").mkdir(parents=True)
    (root / "annotations" / "instances_val.json").write_text("{}")
    (tmp_path / "outside.json").write_text("{}")
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({"annotations": {"val": "annotations/instances_val.json"}}))
    assert manifest_annotations(root, "val") == root / "annotations" / "instances_val.json"
    assert manifest_annotations(root, "train") is None
    for text in ('{"annotations": "x"}', '{"annotations": {"val": 3}}', "[" * 100000, "not json", "[]",
                 json.dumps({"annotations": {"val": "../outside.json"}}),
                 json.dumps({"annotations": {"val": str(tmp_path / "outside.json")}})):
        manifest.write_text(text)
        assert manifest_annotations(root, "val") is None, text[:40]
    (root / "link.json").symlink_to(tmp_path / "outside.json")
    manifest.write_text(json.dumps({"annotations": {"val": "link.json"}}))
    assert manifest_annotations(root, "val") is None
    elsewhere = tmp_path / "manifest_elsewhere.json"
    elsewhere.write_text(json.dumps({"annotations": {"val": "annotations/instances_val.json"}}))
    manifest.unlink()
    manifest.symlink_to(elsewhere)  # the manifest itself outside the root
    assert manifest_annotations(root, "val") is None
    manifest.unlink()
    os.mkfifo(manifest)  # would block a plain read
    assert manifest_annotations(root, "val") is None
    manifest.unlink()
    manifest.symlink_to(root / "loop.json")
    (root / "loop.json").symlink_to(manifest)
    assert manifest_annotations(root, "val") is None


def test_sizes_a_dataset_sets_are_bounded_with_clear_messages(tmp_path, caplog, monkeypatch):
    """What a file sizes is bounded: the categories (the heads are built from them), the training
    targets of one image (the matching's cost grows with them) and a caption's length (tokenised
    whole each time its image is drawn)."""
    _png(tmp_path / "val" / "a.png")
    _coco_split(tmp_path, ["a.png"])
    path = tmp_path / "annotations" / "instances_val.json"
    data = json.loads(path.read_text())
    monkeypatch.setenv("VISION_ATTN_MAX_NUM_CLASSES", "3")
    path.write_text(json.dumps({**data, "categories": [{"id": i, "name": str(i)} for i in range(1, 5)]}))
    with pytest.raises(DataError, match=r"instances_val.json has 4 categories, over the limit of 3"):
        CocoDetection(tmp_path, "val")
    path.write_text(json.dumps({**data, "categories": [{"id": 1, "name": "a"}, {"id": 1, "name": "b"}]}))
    with pytest.raises(DataError, match="lists category id 1 twice"):
        CocoDetection(tmp_path, "val")
    monkeypatch.setenv("VISION_ATTN_MAX_OBJECTS", "5")
    boxes = [{"id": k, "image_id": 1, "category_id": 1, "bbox": [0, 0, 4, 4]} for k in range(100, 112)]
    path.write_text(json.dumps({**data, "annotations": boxes}))
    with caplog.at_level(logging.WARNING):
        ds = CocoDetection(tmp_path, "val")
    assert len(ds.annotations[1]) == 5 and len(ds.scoring_target(1)["boxes"]) == 12  # scored as written
    assert "dropped 7 annotations (over 5 objects in its image), e.g. annotation id 105" in caplog.text
    captions = tmp_path / "annotations" / "captions_val.json"
    captions.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png"}],
                                    "annotations": [{"id": 7, "image_id": 1, "caption": "dog " * 5000},
                                                    {"id": 8, "image_id": 1, "caption": "a black square"}]}))
    with caplog.at_level(logging.WARNING):
        _, caps = read_captions(tmp_path, "val")
    assert caps == {1: ["a black square"]}
    assert "dropped 1 captions (caption longer than 10000 characters), e.g. annotation id 7" in caplog.text
