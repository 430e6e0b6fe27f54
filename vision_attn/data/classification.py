"""ImageFolder classification data: ``ROOT/<split>/<class>/<image>``.

Class names and their number come from the folder names of the training split (sorted), never
from a config. Any image mode is accepted (see :mod:`vision_attn.data.imageio`). With no
``root`` the embedded synthetic shapes dataset is generated on first use and used.

Symbolic links inside a split folder (a file, or a class folder) that lead outside it are
refused unless ``follow_symlinks`` (``--data.layout.follow_symlinks true``): training skips them with
one counted warning, evaluation stops with an error naming one. The split folder itself may be
a symlink (it is resolved first).

No ``val/`` folder: ``--data.layout.val_fraction F`` holds out a stratified part of ``train/`` as the
validation split (:func:`stratified_holdout`): in every class of ``n`` images, the
``round(F * n)`` (Python's rounding; at least one when ``n >= 2``, never all of them) that come
first when the class's files are ordered by the SHA-256 of ``"<val_seed>/<class>/<file>"``. The
split depends only on the seed and the file names (not on the machine, the listing order or
where the root lies), so training and a later ``eval.py`` see the same held-out images; adding
an image to a class moves at most one other image of that class across. Both parts keep their
``train/...`` paths (``predictions.json`` names files relative to ``ROOT`` as always). Setting
``val_fraction`` while ``ROOT/val/`` exists is an error: say which validation set you mean
(drop the option, or move ``val/`` away).

Batch size from the data (``--data.batching.batch_size auto``): the number of optimizer steps, not of
epochs, sets how far a small model gets, and a fixed batch of 128 gives a 1k-image dataset 8
steps per epoch. With ``auto`` the training batch (per process) is the largest power of two that
leaves ``min_steps_per_epoch`` optimizer steps per epoch on every process, within
``[min_batch_size, max_batch_size]`` (:func:`~vision_attn.data.loading.auto_batch_size`; e.g.
with 40 steps, bounds 8..256: 500 images -> 8, 1.3k -> 32, 5k -> 64, 10k -> 128). It is
resolved when training starts (``setup("fit")``, before the learning-rate schedule is planned
from the loader's length), logged once, kept in :attr:`ImageFolderDataModule.resolved_batch_size`
and in the datamodule's ``hparams`` (``batch_size``, ``train_images``, ``batches_per_epoch``:
what the loggers record and the checkpoint holds). The rule's parameters are constructor
arguments, so ``--print_config`` and the saved ``config.yaml`` show them. Under DDP the rule
works per process: each process sees ``ceil(images / processes)`` images per epoch, so more
GPUs give a smaller per-process batch and the same number of steps (the global batch is the
per-process one times the processes). ``trainer.accumulate_grad_batches`` is counted: steps
are optimizer steps. The learning rate is used as given (no scaling rule with the batch).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vision_attn.data.imageio import DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, read_image
from vision_attn.data.layout import FOLDER_LAYOUT_LEGACY, FolderLayout
from vision_attn.data.loading import (
    BATCHING_LEGACY,
    Batching,
    PathRefusals,
    RepeatedAugmentationSampler,
    SkipUnreadable,
    SplitDataModule,
    image_path_inside,
)
from vision_attn.data.synthetic import ShapesConfig, embedded_data_warning, ensure_shapes_classification
from vision_attn.data.transforms import (
    AugmentPreset,
    build_eval_transform,
    build_train_transform,
    model_preprocess,
)
from vision_attn.errors import DataError

__all__ = ["DataError", "ImageAugment", "ImageFolderDataModule", "ImageFolderDataset", "find_classes",
           "stratified_holdout"]

log = logging.getLogger(__name__)


def find_classes(split_dir: Path) -> list[str]:
    """Sorted class-folder names of ``split_dir``; errors for a missing or empty split."""
    if not split_dir.is_dir():
        raise DataError(
            f"split folder {split_dir} does not exist. An ImageFolder root needs "
            f"{split_dir.parent}/train/<class>/*.png and {split_dir.parent}/val/<class>/*.png."
        )
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"split folder {split_dir} has no class sub-folders (expected {split_dir}/<class>/<image>)")
    return classes


def _list_images(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
    )


class _ScanReport:
    """Log lines of a split's folder scan that takes long (a large or remote dataset): the
    classes listed, the images found and the time left, first after ``quiet`` seconds, then at
    most every ``every`` seconds; nothing for a quick scan."""

    def __init__(self, split_dir: Path, classes: int, quiet: float = 3.0, every: float = 10.0) -> None:
        self.split_dir, self.classes, self.quiet, self.every = split_dir, classes, quiet, every
        self.start = time.monotonic()
        self.last = self.start - every

    def update(self, done: int, images: int) -> None:
        now = time.monotonic()
        if now - self.start < self.quiet or now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed * (self.classes - done) / max(1, done)
        log.info("scanning %s: %d/%d classes, %d images, %.0f s elapsed, about %.0f s left", self.split_dir, done,
                 self.classes, images, elapsed, left)


def stratified_holdout(files: Collection[str], fraction: float, seed: int) -> set[str]:
    """The held-out part of a split's images (see the module docstring).

    Args:
        files: image paths relative to the split folder, ``<class>/<file>`` with ``/``.
        fraction: share of each class to hold out, in ``(0, 1)``.
        seed: changes which images are held out.
    """
    by_class: dict[str, list[str]] = {}
    for f in files:
        by_class.setdefault(f.split("/", 1)[0], []).append(f)
    held: set[str] = set()
    for names in by_class.values():
        n = len(names)
        k = min(max(round(fraction * n), 1), n - 1) if n >= 2 else 0
        ranked = sorted(names, key=lambda f: (hashlib.sha256(f"{seed}/{f}".encode()).hexdigest(), f))
        held.update(ranked[:k])
    return held


@dataclass(frozen=True)
class ImageAugment:
    """The training augmentation of classification images (``--data.augment.*``).

    Attributes:
        preset: ``none``, ``small`` (from scratch, small images) or ``finetune`` (pretrained
            models at 224 px); see :mod:`vision_attn.data.transforms`.
        hflip: random horizontal flips (turn off for text and digits).
        randaugment_ops: RandAugment operations per training image (``0``: none); default: the
            preset's (``small``: 0, ``finetune``: 2).
        randaugment_magnitude: RandAugment magnitude (0..30, torchvision's bins).
        colour_jitter: ``small`` only: brightness and contrast factors drawn from
            ``[1 - j, 1 + j]`` per training image (0: none).
        repeated_augmentation: ``k``: every training epoch shows ``len / k`` distinct images
            ``k`` times each, in the same batch (differently augmented), keeping the epoch's
            length (DeiT's repeated augmentation;
            :class:`~vision_attn.data.loading.RepeatedAugmentationSampler`, seeded by
            ``seed_everything`` and the epoch). ``1``: off.
    """

    preset: AugmentPreset = "small"
    hflip: bool = True
    randaugment_ops: int | None = None
    randaugment_magnitude: int = 9
    colour_jitter: float = 0.2
    repeated_augmentation: int = 1

    def __post_init__(self) -> None:
        repeats = self.repeated_augmentation
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise DataError(f"--data.augment.repeated_augmentation must be a positive integer, got {repeats!r}")


FOLDER_BATCHING = Batching(batch_size=64, min_steps_per_epoch=40, min_batch_size=8, max_batch_size=256)
FOLDER_LAYOUT = FolderLayout()
SMALL_AUGMENT = ImageAugment()


class ImageFolderDataset(SkipUnreadable, Dataset):
    """Images of one split with integer labels.

    Items are ``(image, label, index)``; ``samples[index]`` is ``(path relative to root,
    label)``.

    Args:
        root: the dataset root.
        split: split folder name under ``root``.
        class_names: the label set (from the training split); a class folder of this split
            that is not in it is an error.
        transform: callable on an RGB ``uint8`` array.
        max_pixels: refuse images larger than this (decompression bombs).
        follow_symlinks: follow symbolic links inside the split folder that lead outside it.
        skip_unreadable: training: skip unreadable images and refused links (counted
            warnings); evaluation (``False``): stop with an error.
        files: keep only these images (paths relative to the split folder, ``<class>/<file>``
            with ``/``); ``None`` keeps all (the held-out validation part of ``train/`` and the
            rest are two such selections, see :func:`stratified_holdout`).
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        class_names: list[str],
        transform: Any = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        follow_symlinks: bool = False,
        skip_unreadable: bool = False,
        files: Collection[str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.split = split
        self.skip_unreadable = skip_unreadable
        self.class_names = list(class_names)
        self.transform = transform
        self.max_pixels = max_pixels
        split_dir = self.root / split
        present = find_classes(split_dir)
        unknown = sorted(set(present) - set(class_names))
        if unknown:
            raise DataError(
                f"{split_dir} has class folders {unknown} that the training split does not have; "
                f"the classes are {self.class_names}. Add them to train/ or remove them here."
            )
        index = {c: i for i, c in enumerate(self.class_names)}
        real_split = split_dir.resolve()
        refusals = PathRefusals(split_dir, skip=skip_unreadable)
        self.samples: list[tuple[str, int]] = []
        keep = None if files is None else set(files)
        scan = _ScanReport(split_dir, len(present))
        for done, cls in enumerate(present, 1):
            # rglob does not descend into linked folders: only a linked class folder or a linked
            # file can lead outside (checked without resolving every file of large datasets).
            cls_inside = (split_dir / cls).resolve().is_relative_to(real_split)
            if not cls_inside and not follow_symlinks:  # refused before anything outside is listed
                if keep is None or any(k.startswith(f"{cls}/") for k in keep):
                    _, why = image_path_inside(real_split, cls, follow_symlinks)
                    refusals.refuse(f"class folder {cls}", split_dir / cls, why or "outside the split folder")
                continue
            files = _list_images(split_dir / cls)
            if not files:
                raise DataError(
                    f"class folder {split_dir / cls} contains no images ({', '.join(IMAGE_EXTENSIONS)}); "
                    "add images or remove the folder"
                )
            if keep is not None:
                files = [f for f in files if f.relative_to(split_dir).as_posix() in keep]
            for f in files:
                why = None
                if not cls_inside or f.is_symlink():
                    _, why = image_path_inside(real_split, str(f.relative_to(split_dir)), follow_symlinks)
                if why is not None:
                    refusals.refuse(f"class {cls}", f, why)
                    continue
                self.samples.append((str(f.relative_to(self.root)), index[cls]))
            scan.update(done, len(self.samples))
        refusals.report()

    def __len__(self) -> int:
        return len(self.samples)

    def relative_file(self, index: int) -> str:
        """How outputs name image ``index``: its path relative to the root (``val/cat/1.png``)."""
        return self.samples[index][0]

    def _load(self, index: int) -> tuple[torch.Tensor, int, int]:
        rel, label = self.samples[index]
        img = self.cached_read(index, lambda: read_image(self.root / rel, max_pixels=self.max_pixels))
        if self.transform is not None:
            img = self.transform(img)
        return img, label, index


class ImageFolderDataModule(SplitDataModule):
    """ImageFolder data for classification.

    Preprocessing (size, mean, std, interpolation, crop) is the model's: when trained or
    evaluated through Lightning it is read from ``trainer.lightning_module.data_config``;
    otherwise set :attr:`preprocess` before :meth:`setup`.

    Args:
        root: dataset root with ``train/`` and ``val/`` (optional ``test/``) class folders.
            ``None`` uses the embedded shapes dataset (generated on first use).
        synthetic: parameters of the embedded dataset when ``root`` is ``None``.
        cache_dir: where the embedded dataset is generated (default ``$VISION_ATTN_DATA`` or
            ``~/.cache/vision_attn``).
        layout: the split folders, a validation split held out of ``train/``, the image size
            limit and symbolic links (:class:`~vision_attn.data.layout.FolderLayout`).
        batching: the training batch (fixed, or ``auto``: sized from the training set by the rule
            in the module docstring), the evaluation batch and the loader processes
            (:class:`~vision_attn.data.loading.Batching`; default batch 64).
        augment: the training augmentation (:class:`ImageAugment`).
    """

    legacy_arguments = {**FOLDER_LAYOUT_LEGACY, **BATCHING_LEGACY, "augment": "augment.preset",
                        **{k: f"augment.{k}" for k in ("hflip", "randaugment_ops", "randaugment_magnitude",
                                                       "colour_jitter", "repeated_augmentation")}}

    def __init__(
        self,
        root: str | None = None,
        synthetic: ShapesConfig | None = None,
        cache_dir: str | None = None,
        layout: FolderLayout = FOLDER_LAYOUT,
        batching: Batching = FOLDER_BATCHING,
        augment: ImageAugment = SMALL_AUGMENT,
    ) -> None:
        super().__init__()
        self._init_batching(batching)
        self.layout = layout
        self.follow_symlinks = layout.follow_symlinks
        if root is None:
            if synthetic is None:
                log.warning(embedded_data_warning("a folder holding train/<class>/ and val/<class>/ image folders"))
            root = str(ensure_shapes_classification(synthetic or ShapesConfig(), cache_dir))
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise DataError(
                f"data root {self.root} does not exist. Pass --data.root with a folder holding "
                "train/<class>/ and val/<class>/ image folders (or leave it unset for the embedded shapes data)."
            )
        train_split, val_split = layout.train_split, layout.val_split
        self.train_split, self.val_split, self.test_split = train_split, val_split, layout.test_split
        self.augment = augment.preset
        self.hflip = augment.hflip
        self.randaugment_ops, self.randaugment_magnitude = augment.randaugment_ops, augment.randaugment_magnitude
        self.colour_jitter = augment.colour_jitter
        self.repeated_augmentation = augment.repeated_augmentation
        self.max_pixels = layout.max_pixels
        self.class_names: list[str] = find_classes(self.root / train_split)
        val_fraction = layout.val_fraction
        if val_fraction is not None and (self.root / val_split).exists():
            raise DataError(
                f"{self.root / val_split} exists and --data.layout.val_fraction {val_fraction} is set: validate "
                f"on {val_split}/ (drop val_fraction) or on a held-out part of {train_split}/ (move "
                f"{val_split}/ away), not both"
            )
        self.val_fraction, self.val_seed = val_fraction, layout.val_seed
        self._holdout: tuple[set[str], set[str]] | None = None
        self.preprocess: dict[str, Any] | None = None
        self.datasets: dict[str, ImageFolderDataset] = {}

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def holdout(self) -> tuple[set[str], set[str]]:
        """``(training files, held-out validation files)`` of ``train/`` under ``val_fraction``
        (paths relative to the training split folder; computed once)."""
        if self._holdout is None:
            split_dir = self.root / self.train_split
            every = {f.relative_to(split_dir).as_posix()
                     for c in self.class_names for f in _list_images(split_dir / c)}
            held = stratified_holdout(every, self.val_fraction, self.val_seed)
            self._holdout = (every - held, held)
            log.info("validation: %d of the %d images of %s held out (val_fraction %s, val_seed %d)",
                     len(held), len(every), split_dir, self.val_fraction, self.val_seed)
        return self._holdout

    def dataset(self, split: str, train: bool = False) -> ImageFolderDataset:
        """The dataset of ``split`` with the training or the evaluation transform (with
        ``val_fraction``, the validation split is the held-out part of the training folder)."""
        pre = model_preprocess(self)
        transform = (build_train_transform(pre, self.augment, self.hflip, self.randaugment_ops,
                                           self.randaugment_magnitude, self.colour_jitter)
                     if train else build_eval_transform(pre))
        folder, files = split, None
        if self.val_fraction is not None and split in (self.train_split, self.val_split):
            folder, files = self.train_split, self.holdout()[split == self.val_split]
        elif split == self.val_split and not (self.root / split).is_dir():
            raise DataError(f"validation folder {self.root / split} does not exist: add it, or pass "
                            "--data.layout.val_fraction 0.1 to hold out part of the training images")
        # training skips unreadable or refused files; evaluation stops at the first
        return ImageFolderDataset(self.root, folder, self.class_names, transform, self.max_pixels,
                                  self.follow_symlinks, skip_unreadable=train, files=files)

    def setup(self, stage: str | None = None) -> None:
        if stage in ("fit", None):
            self.datasets["train"] = self.dataset(self.train_split, train=True)
            self.resolve_batch_size()  # before the schedule is planned from the loader's length
        if stage in ("fit", "validate", None):
            self.datasets["val"] = self.dataset(self.val_split)
        if stage in ("test", None) and (self.root / self.test_split).is_dir():
            self.datasets["test"] = self.dataset(self.test_split)

    def train_sampler(self, ds: Dataset) -> Sampler | None:
        """:class:`~vision_attn.data.loading.RepeatedAugmentationSampler` with
        ``repeated_augmentation > 1`` (seeded by ``seed_everything``'s seed, as Lightning seeds
        its own distributed sampler), else ``None`` (shuffled)."""
        if self.repeated_augmentation <= 1:
            return None
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return RepeatedAugmentationSampler(ds, self.repeated_augmentation, seed=seed)

    def test_dataloader(self) -> DataLoader:
        if "test" not in self.datasets:
            raise DataError(f"no test split: {self.root / self.test_split} does not exist")
        return self._loader(self.datasets["test"], train=False)
