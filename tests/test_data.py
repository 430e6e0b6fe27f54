"""ImageFolder data: classes from folders, clear errors for bad roots, model-driven preprocessing."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vision_attn.data.classification import DataError, ImageFolderDataModule, ImageFolderDataset
from vision_attn.data.imageio import ImageReadError
from vision_attn.data.loading import Batching
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
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(num_workers=0, batch_size=8))
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

    from vision_attn.commands.args import one_line

    root = _folder(tmp_path, {"train": {"a": 1}})
    (root / "train" / "a" / "zz_bad.png").write_bytes(b"garbage")
    ds = ImageFolderDataset(root, "train", ["a"], transform=lambda im: torch.zeros(1))
    with pytest.raises(ImageReadError) as info:
        list(DataLoader(ds, batch_size=2, num_workers=1))
    msg = one_line(info.value)
    assert msg.startswith("cannot read image") and "zz_bad.png" in msg and "\n" not in msg


def test_preprocessing_comes_from_the_model(shapes_root):
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(num_workers=0))
    dm.preprocess = {**PRE, "input_size": (3, 48, 48), "mean": (0.1, 0.2, 0.3)}
    dm.setup("validate")
    x, _, _ = dm.datasets["val"][0]
    assert x.shape == (3, 48, 48)


@pytest.mark.parametrize("crop_mode", ["center", "squash", "border"])
@pytest.mark.parametrize("size", [(224, 224), (160, 224)])
def test_eval_transform_is_timms_evaluation_transform(crop_mode, size):
    """Same tensor as ``timm.data.create_transform(**data_config)`` on the same decoded image:
    ``center`` resizes the shorter side to ``size / crop_pct`` and centre-crops (not a squash)."""
    import timm.data

    from vision_attn.data.transforms import build_display_transform

    rng = np.random.default_rng(0)
    cfg = {"input_size": (3, *size), "interpolation": "bicubic", "mean": (0.485, 0.456, 0.406),
           "std": (0.229, 0.224, 0.225), "crop_pct": 0.875, "crop_mode": crop_mode}
    reference = timm.data.create_transform(**cfg)
    for shape in ((300, 451, 3), (97, 33, 3)):
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        expected = reference(Image.fromarray(img))
        x = build_eval_transform(cfg)(img)
        assert x.shape == expected.shape == (3, *size)
        assert (x - expected).abs().max() < 1e-6
        shown = build_display_transform(cfg)(img)  # the same pixels, before normalisation
        mean, std = torch.tensor(cfg["mean"])[:, None, None], torch.tensor(cfg["std"])[:, None, None]
        assert torch.allclose(torch.from_numpy(shown).permute(2, 0, 1) / 255, expected * std + mean, atol=1e-5)


def test_crop_modes_keep_or_cut_the_borders():
    """A wide image whose left and right fifths are white: ``center`` cuts them off (shorter side
    resized), ``squash`` and configs without a crop_mode (older checkpoints) keep the whole
    image, which :func:`whole_image` asks for."""
    from vision_attn.data.transforms import build_display_transform, whole_image

    img = np.zeros((30, 150, 3), np.uint8)
    img[:, :30] = img[:, 120:] = 255
    centre = build_display_transform({**PRE, "crop_mode": "center"})(img)
    assert centre.max() == 0  # only the black middle is left
    for pre in ({**PRE, "crop_mode": "squash"}, PRE, whole_image({**PRE, "crop_mode": "center", "crop_pct": 0.5})):
        whole = build_display_transform(pre)(img)
        assert whole.shape == (32, 32, 3) and whole[:, :2].min() >= 250 and whole[:, -2:].min() >= 250
    with pytest.raises(ValueError, match="crop_mode"):
        build_eval_transform({**PRE, "crop_mode": "zoom"})


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


@pytest.mark.parametrize(("cores", "local", "expected"), [(1, 1, 0), (2, 1, 0), (3, 1, 1), (4, 1, 2), (16, 1, 8),
                                                          (64, 1, 8), (16, 4, 2), (8, 4, 0)])
def test_auto_num_workers_leaves_two_cores_per_training_process(monkeypatch, cores, local, expected):
    from vision_attn.data import loading

    monkeypatch.setattr(loading, "usable_cpus", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    assert loading.resolve_num_workers("auto") == expected
    assert loading.resolve_num_workers(3) == 3  # a number is taken as given


def test_auto_num_workers_reaches_the_loaders(shapes_root, monkeypatch):
    from vision_attn.data import loading

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: False)
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=8))  # the default is auto
    assert dm.num_workers == "auto"
    dm.preprocess = PRE
    dm.setup("fit")
    monkeypatch.setattr(loading, "usable_cpus", lambda: 2)
    assert dm.train_dataloader().num_workers == 0 and dm.val_dataloader().num_workers == 0
    monkeypatch.setattr(loading, "usable_cpus", lambda: 3)
    assert dm.train_dataloader().num_workers == 1 and dm.val_dataloader().num_workers == 1


@pytest.mark.parametrize("bad", ["many", -1, True, 1.5])
def test_bad_num_workers_is_a_clear_error(shapes_root, bad):
    from vision_attn.data.captioning import CaptioningDataModule
    from vision_attn.data.detection import DetectionDataModule

    for module in (ImageFolderDataModule, DetectionDataModule, CaptioningDataModule):
        with pytest.raises(DataError, match="--data.batching.num_workers must be"):
            module(root=str(shapes_root), batching=Batching(num_workers=bad))


def test_decoded_images_are_read_once_across_epochs(tmp_path, monkeypatch):
    """Cached or not, the same items under the same seed through the random training transform;
    each image decoded once."""
    import vision_attn.data.classification as classification

    from .conftest import assert_same_items, cached_and_uncached_epochs

    root = _folder(tmp_path, {"train": {"a": 2, "b": 1}, "val": {"a": 1}})
    calls = []
    real = classification.read_image
    monkeypatch.setattr(classification, "read_image", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    tf = build_train_transform(PRE, "small")
    on, off = cached_and_uncached_epochs(lambda: ImageFolderDataset(root, "train", ["a", "b"], tf), monkeypatch)
    assert len(calls) == 3 + 3
    assert_same_items(on, off)
