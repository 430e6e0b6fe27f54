"""Where a data module finds each split: the argument groups ``--data.layout.*``.

:class:`FolderLayout` is the ImageFolder layout of classification (``ROOT/<split>/<class>/``,
optionally a validation split held out of ``train/``); :class:`SplitLayout` the COCO layout of
detection and captioning (images in ``ROOT/<split>/``, annotations in
``ROOT/annotations/<kind>_<split>.json``, or any folder and file given per split). Both say how
large an image may be and whether symbolic links that leave a split folder are followed
(:func:`~vision_attn.data.loading.image_path_inside`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vision_attn.data.imageio import DEFAULT_MAX_PIXELS
from vision_attn.errors import DataError

__all__ = ["FolderLayout", "SplitLayout"]


@dataclass(frozen=True)
class FolderLayout:
    """The splits of an ImageFolder root.

    Attributes:
        train_split: training split folder name.
        val_split: validation split folder name.
        test_split: test split folder name (used when it exists).
        val_fraction: with no ``val/`` folder, hold out this share of every class of ``train/``
            as the validation split (seeded, stratified:
            :func:`~vision_attn.data.classification.stratified_holdout`); an error when ``val/``
            exists.
        val_seed: the seed of that held-out split.
        max_pixels: images declaring more pixels are refused.
        follow_symlinks: follow symbolic links inside a split folder that lead outside it
            (refused by default: training skips such images, evaluation stops).
    """

    train_split: str = "train"
    val_split: str = "val"
    test_split: str = "test"
    val_fraction: float | None = None
    val_seed: int = 0
    max_pixels: int = DEFAULT_MAX_PIXELS
    follow_symlinks: bool = False

    def __post_init__(self) -> None:
        if self.val_fraction is not None and not 0 < self.val_fraction < 1:
            raise DataError(f"--data.layout.val_fraction {self.val_fraction} must lie strictly between 0 and 1")


@dataclass(frozen=True)
class SplitLayout:
    """The splits of a COCO-layout root: their names, and their images folder and annotation file
    when they are not where the layout puts them. Relative paths are under the data root.

    Attributes:
        train_split: training split name (COCO users: ``train2017``).
        val_split: validation split name (COCO users: ``val2017``).
        test_split: name of the test split (``eval.py --split test``).
        train_annotations: the training annotation file (default
            ``ROOT/annotations/<kind>_<train_split>.json``, ``kind`` ``instances`` or ``captions``).
        val_annotations: the validation annotation file (likewise).
        test_annotations: the annotation file of ``test_split``.
        train_images: the training images folder (default ``ROOT/<train_split>/``).
        val_images: the validation images folder (likewise).
        test_images: the images folder of ``test_split``.
        max_pixels: refuse larger images.
        follow_symlinks: follow symbolic links inside a split folder that lead outside it
            (refused by default: training skips such images, evaluation stops).
    """

    train_split: str = "train"
    val_split: str = "val"
    test_split: str = "test"
    train_annotations: str | None = None
    val_annotations: str | None = None
    test_annotations: str | None = None
    train_images: str | None = None
    val_images: str | None = None
    test_images: str | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    follow_symlinks: bool = False

    @property
    def splits(self) -> tuple[str, str, str]:
        """``(train, val, test)`` split names."""
        return self.train_split, self.val_split, self.test_split

    @property
    def annotations(self) -> tuple[str | None, str | None, str | None]:
        """``(train, val, test)`` annotation files given (``None``: the layout's)."""
        return self.train_annotations, self.val_annotations, self.test_annotations

    @property
    def images(self) -> tuple[str | None, str | None, str | None]:
        """``(train, val, test)`` images folders given (``None``: the layout's)."""
        return self.train_images, self.val_images, self.test_images


FOLDER_LAYOUT_LEGACY = {k: f"layout.{k}" for k in (
    "train_split", "val_split", "test_split", "val_fraction", "val_seed", "max_pixels", "follow_symlinks")}
"""Where the flat layout arguments of the older ImageFolder data module went."""
SPLIT_LAYOUT_LEGACY = {k: f"layout.{k}" for k in (
    "train_split", "val_split", "test_split", "train_annotations", "val_annotations", "test_annotations",
    "train_images", "val_images", "test_images", "max_pixels", "follow_symlinks")}
"""Where the flat layout arguments of the older COCO-layout data modules went."""
