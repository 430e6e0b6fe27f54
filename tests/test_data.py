"""ImageFolder data: classes from folders, clear errors for bad roots, model-driven preprocessing."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vision_attn.data.classification import DataError, ImageFolderDataModule, ImageFolderDataset
from vision_attn.data.imageio import ImageReadError
from vision_attn.data.synthetic import SHAPES
from vision_attn.data.transforms import build_eval_transform, build_train_transform

PRE = {"input_size": (3, 32, 32), "interpolation": "bicubic", "mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0}


def _folder(root, layout):
    for split, classes in layout.items():
        for cls, n in classes.items():
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (40, 30), (i * 20, 0, 0)).save(d / f"{i}.png")
    return root


def test_class_names_come_from_the_train_folders(shapes_root):
    dm = ImageFolderDataModule(root=str(shapes_root), num_workers=0, batch_size=8)
    assert dm.class_names == sorted(SHAPES) and dm.num_classes == 5
    dm.preprocess = PRE
    dm.setup("fit")
    x, y, idx = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and idx.shape == (8,)
    ds = dm.datasets["val"]
    rel, label = ds.samples[0]
    assert rel.startswith("val/") and dm.class_names[label] in rel


def test_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"data root .*nowhere does not exist.*--data.root"):
        ImageFolderDataModule(root=str(tmp_path / "nowhere"))
    (tmp_path / "r").mkdir()
    with pytest.raises(DataError, match="train.*does not exist"):
        ImageFolderDataModule(root=str(tmp_path / "r"))


def test_empty_class_folder_is_named(tmp_path):
    root = _folder(tmp_path, {"train": {"cat": 2, "dog": 2}, "val": {"cat": 1, "dog": 1}})
    for f in (root / "train" / "dog").iterdir():
        f.unlink()
    with pytest.raises(DataError, match=r"train/dog contains no images"):
        ImageFolderDataset(root, "train", ["cat", "dog"])


def test_val_class_unknown_to_train_is_an_error(tmp_path):
    root = _folder(tmp_path, {"train": {"cat": 2}, "val": {"cat": 1, "cow": 1}})
    with pytest.raises(DataError, match="cow"):
        ImageFolderDataset(root, "val", ["cat"])


def test_val_may_lack_a_class_and_labels_stay_those_of_train(tmp_path):
    root = _folder(tmp_path, {"train": {"a": 1, "b": 1, "c": 1}, "val": {"c": 2}})
    ds = ImageFolderDataset(root, "val", ["a", "b", "c"])
    assert {label for _, label in ds.samples} == {2}


def test_corrupt_image_names_the_file(tmp_path):
    root = _folder(tmp_path, {"train": {"a": 1}, "val": {"a": 1}})
    (root / "train" / "a" / "bad.png").write_bytes(b"\x89PNG garbage")
    ds = ImageFolderDataset(root, "train", ["a"])
    bad = [i for i, (rel, _) in enumerate(ds.samples) if rel.endswith("bad.png")][0]
    with pytest.raises(ImageReadError, match="bad.png"):
        ds[bad]


def test_corrupt_image_in_a_worker_process_keeps_type_and_path(tmp_path):
    from torch.utils.data import DataLoader

    from vision_attn.cli import one_line

    root = _folder(tmp_path, {"train": {"a": 1}})
    (root / "train" / "a" / "zz_bad.png").write_bytes(b"garbage")
    ds = ImageFolderDataset(root, "train", ["a"], transform=lambda im: torch.zeros(1))
    with pytest.raises(ImageReadError) as info:
        list(DataLoader(ds, batch_size=2, num_workers=1))
    msg = one_line(info.value)
    assert msg.startswith("cannot read image") and "zz_bad.png" in msg and "\n" not in msg


def test_preprocessing_comes_from_the_model(shapes_root):
    dm = ImageFolderDataModule(root=str(shapes_root), num_workers=0)
    dm.preprocess = {**PRE, "input_size": (3, 48, 48), "mean": (0.1, 0.2, 0.3)}
    dm.setup("validate")
    x, _, _ = dm.datasets["val"][0]
    assert x.shape == (3, 48, 48)


def test_transforms_shapes_and_normalisation():
    img = np.full((30, 50, 3), 255, np.uint8)
    x = build_eval_transform(PRE)(img)
    assert x.shape == (3, 32, 32) and torch.allclose(x, torch.ones_like(x), atol=1e-5)
    pre = {**PRE, "input_size": (3, 224, 224), "crop_pct": 0.875}
    assert build_eval_transform(pre)(np.zeros((300, 400, 3), np.uint8)).shape == (3, 224, 224)
    for aug in ("none", "small", "finetune"):
        assert build_train_transform(PRE, aug)(img).shape == (3, 32, 32)
    with pytest.raises(ValueError, match="augment"):
        build_train_transform(PRE, "heavy")


def test_embedded_data_is_used_when_no_root(tmp_path, monkeypatch):
    from vision_attn.data.synthetic import ShapesConfig

    dm = ImageFolderDataModule(root=None, synthetic=ShapesConfig(num_train=10, num_val=5), cache_dir=str(tmp_path))
    assert dm.root.parent == tmp_path and dm.class_names == sorted(SHAPES)
    shutil.rmtree(dm.root)
