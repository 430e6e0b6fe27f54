"""Images without labels: every image under ``ROOT/<split>/`` (any depth), for self-supervised
pretraining (:class:`~vision_attn.tasks.PretrainTask`).

Any of the suite's layouts works as it is: an ImageFolder root (``ROOT/train/<class>/*.png``; the
class folders are ignored) and a COCO root (``ROOT/train/*.png``; the annotation files are not
read), so the images a classifier, detector or captioner trains on pretrain its encoder first::

    vision-attn fit --config configs/pretrain/mae.yaml --data.root ROOT

Validation reads ``ROOT/val/`` when it exists, else a share of the training images
(``--data.layout.val_fraction``, default 0.05 when there is no ``val/``: chosen by the SHA-256 of
the file's path, so a later run holds out the same images). Symbolic links that lead outside the
split folder are refused as in the other data modules (training skips them with one warning).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from vision_attn.data.classification import (
    FOLDER_BATCHING,
    FOLDER_LAYOUT,
    SMALL_AUGMENT,
    ImageAugment,
    _list_images,
    stratified_holdout,
)
from vision_attn.data.imageio import DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, read_image
from vision_attn.data.layout import FolderLayout
from vision_attn.data.loading import Batching, PathRefusals, SkipUnreadable, SplitDataModule, image_path_inside
from vision_attn.data.transforms import build_eval_transform, build_train_transform, model_preprocess
from vision_attn.errors import DataError

__all__ = ["ImagesDataModule", "UnlabeledImages", "DEFAULT_VAL_FRACTION"]

log = logging.getLogger(__name__)

DEFAULT_VAL_FRACTION = 0.05
"""The share of the training images held out for validation when the root has no ``val/``."""


def _check_split_name(name: str, key: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise DataError(f"--data.layout.{key} {name!r} must be the name of a folder directly under the data root")


class UnlabeledImages(SkipUnreadable, Dataset):
    """Every image under ``root/split`` (sorted by path); items are ``(image, index)``.

    Args:
        root: the data root.
        split: a folder directly under ``root``.
        transform: callable on an RGB ``uint8`` array.
        max_pixels: refuse images larger than this (decompression bombs).
        follow_symlinks: follow symbolic links that lead outside the split folder.
        skip_unreadable: training: skip unreadable images and refused links; evaluation: stop.
        files: keep only these images (paths relative to the split folder, with ``/``).
    """

    def __init__(self, root: str | Path, split: str, transform: Any = None, max_pixels: int = DEFAULT_MAX_PIXELS,
                 follow_symlinks: bool = False, skip_unreadable: bool = False,
                 files: Collection[str] | None = None) -> None:
        self.root, self.split, self.transform = Path(root), split, transform
        self.max_pixels, self.skip_unreadable = max_pixels, skip_unreadable
        split_dir = self.root / split
        if not split_dir.is_dir():
            raise DataError(f"image folder {split_dir} does not exist; pretraining reads the images under "
                            f"{self.root}/<split>/ (any depth)")
        real_split = split_dir.resolve()
        keep = None if files is None else set(files)
        refusals = PathRefusals(split_dir, skip=skip_unreadable)
        self.files: list[str] = []
        for f in _list_images(split_dir):
            rel = f.relative_to(split_dir).as_posix()
            if keep is not None and rel not in keep:
                continue
            _, why = image_path_inside(real_split, rel, follow_symlinks)
            if why is not None:
                refusals.refuse("image", f, why)
                continue
            self.files.append(f.relative_to(self.root).as_posix())
        refusals.report()
        if not self.files:
            raise DataError(f"{split_dir} holds no images ({', '.join(IMAGE_EXTENSIONS)}) at any depth; "
                            "is --data.root the right folder?")

    def __len__(self) -> int:
        return len(self.files)

    def relative_file(self, index: int) -> str:
        """Image ``index``'s path relative to the root (``train/cat/1.png``)."""
        return self.files[index]

    def _load(self, index: int) -> tuple[torch.Tensor, int]:
        img = self.cached_read(index, lambda: read_image(self.root / self.files[index], max_pixels=self.max_pixels))
        if self.transform is not None:
            img = self.transform(img)
        return img, index


class ImagesDataModule(SplitDataModule):
    """Unlabelled images of any root for pretraining (see the module docstring).

    Args:
        root: the data root (``ROOT/train/`` and, optionally, ``ROOT/val/``).
        layout: the split folders, the validation share held out of ``train/`` when there is no
            ``val/`` (default :data:`DEFAULT_VAL_FRACTION`), the image size limit and symbolic links.
        batching: the training batch (fixed, or ``auto`` as for classification) and loader processes.
        augment: the training augmentation (as for classification: ``small``, ``finetune``, ``none``).
    """

    class_names = None  # no labels: the pretraining head does not depend on the data

    def __init__(self, root: str | None = None, layout: FolderLayout = FOLDER_LAYOUT,
                 batching: Batching = FOLDER_BATCHING, augment: ImageAugment = SMALL_AUGMENT) -> None:
        super().__init__()
        self._init_batching(batching)
        if root is None:
            raise DataError("pretraining needs images: pass --data.root ROOT (a folder holding train/)")
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise DataError(f"data root {self.root} does not exist; pass --data.root with a folder holding train/")
        for key in ("train_split", "val_split", "test_split"):
            _check_split_name(getattr(layout, key), key)
        self.layout, self.augment = layout, augment
        self.train_split, self.val_split, self.test_split = layout.train_split, layout.val_split, layout.test_split
        has_val = (self.root / self.val_split).is_dir()
        if layout.val_fraction is not None and has_val:
            raise DataError(f"{self.root / self.val_split} exists and --data.layout.val_fraction is set: validate on "
                            f"{self.val_split}/ (drop val_fraction) or on a part of {self.train_split}/, not both")
        self.val_fraction = layout.val_fraction if layout.val_fraction is not None else (
            None if has_val else DEFAULT_VAL_FRACTION)
        self._holdout: tuple[set[str], set[str]] | None = None
        self.preprocess: dict[str, Any] | None = None
        self.datasets: dict[str, UnlabeledImages] = {}

    def holdout(self) -> tuple[set[str], set[str]]:
        """``(training files, held-out files)`` of the training folder under ``val_fraction``."""
        if self._holdout is None:
            split_dir = self.root / self.train_split
            if not split_dir.is_dir():
                raise DataError(f"image folder {split_dir} does not exist; pretraining reads {self.root}/"
                                f"{self.train_split}/")
            every = {f.relative_to(split_dir).as_posix() for f in _list_images(split_dir)}
            # one stratum: the same seeded, name-only rule as classification's held-out split
            held = {f[2:] for f in stratified_holdout({f"_/{f}" for f in every}, self.val_fraction,
                                                      self.layout.val_seed)}
            self._holdout = (every - held, held)
            log.info("validation: %d of the %d images of %s held out (val_fraction %s)", len(held), len(every),
                     split_dir, self.val_fraction)
        return self._holdout

    def dataset(self, split: str, train: bool = False) -> UnlabeledImages:
        pre = model_preprocess(self)
        a = self.augment
        transform = (build_train_transform(pre, a.preset, a.hflip, a.randaugment_ops, a.randaugment_magnitude,
                                           a.colour_jitter) if train else build_eval_transform(pre))
        folder, files = split, None
        if self.val_fraction is not None and split in (self.train_split, self.val_split):
            folder, files = self.train_split, self.holdout()[split == self.val_split]
        return UnlabeledImages(self.root, folder, transform, self.layout.max_pixels, self.layout.follow_symlinks,
                               skip_unreadable=train, files=files)
