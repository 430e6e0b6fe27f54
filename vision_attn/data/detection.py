"""COCO-format detection data: ``ROOT/<split>/`` images, ``ROOT/annotations/instances_<split>.json``.

- Layout: that is the default of every split; a split's annotation file and images folder can
  be given instead (``--data.layout.train_annotations``, ``--data.layout.train_images``, likewise ``val_`` and
  ``test_``; see :func:`split_layout`): a relative path is taken under ``ROOT``, an absolute one
  as it is. ``file_name`` values are relative to the split's images folder, which is the folder
  they must stay inside. With every train and val path given and no ``root``, the root is the
  current folder (no embedded data is generated).

- Category ids may be sparse (COCO's 1..90): they are mapped to contiguous labels
  ``0..C-1`` in id order (``category_ids[label]`` maps back); names come from the file.
- Faulty annotations never crash training: boxes with non-finite values or zero or negative
  size, annotations of unknown images or categories and malformed entries are dropped; boxes
  entirely outside the image are dropped from the training targets and boxes sticking out are
  clipped — each kind counted in one warning that names an example id. Images with zero
  annotations are kept (they teach "no object").
- Crowd regions (``iscrowd: 1``) are not training targets, but they are scored as pycocotools
  scores them (a detection on a crowd region is ignored, not a false positive):
  :meth:`CocoDetection.scoring_target` gives the ground truth that validation and evaluation
  both score, in pixels of the original image, boxes as written in the file (not clipped, not
  resized: objects smaller than an input pixel are scored too), crowd regions flagged.
- A missing image file is an error naming the image id and the path. Image and category ids must
  be what COCO tools accept (:func:`is_coco_id`: integers from 0 to 2**63 - 1, never ``true``
  or ``false``): anything else is an error naming the file and the id; annotations naming such
  an image or category id are dropped like those of unknown ids. ``file_name`` must stay inside
  the split folder (see
  :func:`vision_attn.data.loading.image_path_inside`): refused with a counted warning in
  training, an error in evaluation.
- Targets: ``labels [G]``, ``boxes [G, 4]`` as ``(cx, cy, w, h)`` fractions of the model
  input (normalised in one place, :func:`_to_target`), ``image_id``, ``orig_size (h, w)``, and
  ``scored`` (the :meth:`~CocoDetection.scoring_target` dict; evaluation datasets only).
- Input size (``transform.resize``): ``square`` (default) resizes every image to the model's input size
  (squashed); ``aspect`` (real datasets, DETR's recipe) keeps the aspect ratio
  (:class:`~vision_attn.data.transforms.AspectResize`: shorter side from ``train_sizes`` in
  training, ``eval_size`` in evaluation, longer side at most ``max_size``), adds each image's
  resized ``size (h, w)`` to its target, and :func:`detection_collate` pads the batch at the
  bottom and right (zeros: the mean colour); the task masks the padding out of the encoder and
  the decoder. Boxes are fractions of each image's own resized size either way, so predictions
  map back to the original pixels by its ``orig_size``.
- EXIF: when the annotation file declares the stored (un-rotated) size of an image whose EXIF
  rotation swaps its sides, its boxes were drawn on the stored pixels, which are then read
  (:meth:`CocoDetection.read_rgb`, also used for overlays, so boxes and pictures agree).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from vision_attn.boxes import box_xyxy_to_cxcywh
from vision_attn.data.coco import (
    COCO_ID_LIMIT,
    annotation_problem,
    check_category_id,
    check_images_dir,
    coco_id_error,
    finite_number,
    is_coco_id,
    load_coco_annotations,
    read_image_entries,
    shown_value,
    sorted_categories,
    validate_image_entry,
)
from vision_attn.data.dense import CopyPasteConfig, DenseAugment, MosaicConfig
from vision_attn.data.imageio import DEFAULT_MAX_PIXELS, read_image
from vision_attn.data.layout import SPLIT_LAYOUT_LEGACY, SplitLayout
from vision_attn.data.loading import BATCHING_LEGACY, Batching, SkipUnreadable, SplitDataModule, relative_file
from vision_attn.data.masks import ImageMask, image_mask
from vision_attn.data.synthetic import SceneSetConfig, embedded_data_warning, ensure_shapes_coco
from vision_attn.data.transforms import (
    DETR_EVAL_SIZE,
    DETR_MAX_SIZE,
    DETR_TRAIN_SIZES,
    AspectResize,
    _interp,
    model_preprocess,
)
from vision_attn.errors import ConfigError, DataError
from vision_attn.schema import limit

__all__ = ["COCO_ID_LIMIT", "CocoDetection", "CocoLayout", "DetectionDataModule", "DetectionTransform",
           "SquareDetectionTransform", "check_category_id", "check_images_dir", "coco_id_error", "coco_root",
           "detection_collate", "is_coco_id", "load_coco_annotations", "split_layout", "validate_image_entry"]

log = logging.getLogger(__name__)


def coco_root(root: str | None, synthetic: SceneSetConfig | None, cache_dir: str | None, what: str,
              all_given: bool = False) -> Path:
    """The data root: ``root``; when unset, the current folder if ``all_given`` (every train and
    val path was given), else the embedded shape scenes (generated on first use; with a warning
    unless ``synthetic`` asks for them)."""
    if root is None and all_given:
        root = "."
    if root is None:
        if synthetic is None:
            log.warning(embedded_data_warning(what))
        root = str(ensure_shapes_coco(synthetic or SceneSetConfig(), cache_dir))
    path = Path(root).expanduser()
    if not path.is_dir():
        raise DataError(f"data root {path} does not exist; pass --data.root with {what}")
    return path


def split_layout(root: Path, split: str, kind: str, images: str | Path | None = None,
                 annotations: str | Path | None = None) -> tuple[Path, Path]:
    """``(images folder, annotation file)`` of one split.

    Args:
        root: the data root.
        split: the split name.
        kind: the annotation file's kind: ``instances`` or ``captions``.
        images: the split's images folder if given (relative: under ``root``), else
            ``ROOT/<split>/``.
        annotations: the split's annotation file if given (relative: under ``root``), else
            ``ROOT/annotations/<kind>_<split>.json``.
    """
    folder = root / Path(images).expanduser() if images is not None else root / split
    if annotations is None:
        return folder, root / "annotations" / f"{kind}_{split}.json"
    return folder, root / Path(annotations).expanduser()


class CocoLayout:
    """What the COCO-layout data modules share: the paths of each split (:meth:`split_paths`).
    Subclasses set ``root``, ``annotation_kind``, the ``*_split`` names and the ``*_images`` /
    ``*_annotations`` paths (``None`` = the default layout)."""

    annotation_kind = "instances"
    root: Path
    train_split: str
    val_split: str
    test_split: str
    train_images = val_images = test_images = None
    train_annotations = val_annotations = test_annotations = None

    def _init_layout(self, root: str | None, synthetic: SceneSetConfig | None, cache_dir: str | None, what: str,
                     layout: SplitLayout) -> None:
        """Set the root and the split paths of ``layout``; the root may be left out when every
        train and val path is given."""
        all_given = None not in (*layout.annotations[:2], *layout.images[:2])
        self.root = coco_root(root, synthetic, cache_dir, what, all_given)
        self.layout = layout
        self.follow_symlinks, self.max_pixels = layout.follow_symlinks, layout.max_pixels
        self.train_split, self.val_split, self.test_split = layout.splits
        self.train_annotations, self.val_annotations, self.test_annotations = layout.annotations
        self.train_images, self.val_images, self.test_images = layout.images

    def split_paths(self, split: str) -> tuple[Path, Path]:
        """``(images folder, annotation file)`` of ``split`` (see :func:`split_layout`)."""
        rows = [(self.train_split, self.train_images, self.train_annotations),
                (self.val_split, self.val_images, self.val_annotations),
                (self.test_split, self.test_images, self.test_annotations)]
        images = next((i for name, i, _ in rows if name == split and i is not None), None)
        ann = next((a for name, _, a in rows if name == split and a is not None), None)
        return split_layout(self.root, split, self.annotation_kind, images, ann)


def _to_target(boxes_xyxy: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """The one place where boxes become normalised ``cxcywh``."""
    h, w = size_hw
    scale = torch.tensor([w, h, w, h], dtype=torch.float32)
    return box_xyxy_to_cxcywh(boxes_xyxy.float() / scale).clamp(0, 1)


class CocoDetection(SkipUnreadable, Dataset):
    """One split of a COCO-format detection dataset.

    Items are ``(image [3, H, W], target dict)``.

    Args:
        root: dataset root.
        split: split name (``val``, ``val2017``, ...): the image folder under ``root`` unless
            ``images_dir`` is given.
        transform: a torchvision v2 transform taking ``(image, BoundingBoxes)``.
        categories: category list to use (default: the file's); for val, pass train's.
        max_pixels: refuse larger images.
        annotations: the already parsed annotation file (it is read from disk otherwise).
        follow_symlinks: follow symbolic links inside the split folder that lead outside it.
        skip_unreadable: training: skip unreadable images and images whose path leaves the
            split folder (counted warnings); evaluation (``False``): stop with an error.
        images_dir: the split's images folder, as it is (default ``ROOT/<split>/``).
        ann_file: the split's annotation file, as it is (default
            ``ROOT/annotations/instances_<split>.json``).
    """

    def __init__(self, root: str | Path, split: str, transform: Any = None, categories: list[dict] | None = None,
                 max_pixels: int = DEFAULT_MAX_PIXELS, annotations: dict[str, Any] | None = None,
                 follow_symlinks: bool = False, skip_unreadable: bool = False,
                 images_dir: str | Path | None = None, ann_file: str | Path | None = None,
                 scored_targets: bool = True, with_size: bool = False) -> None:
        self.root, self.split = Path(root), split
        self.with_size = with_size  # targets carry the resized size (padded batches)
        # the scored ground truth travels with each item for validation only: four more tensors
        # per image, each crossing the worker pipe, slowed training on the shapes config from
        # 2.16 to 1.60 steps/s
        self.scored_targets = scored_targets
        self.skip_unreadable = skip_unreadable
        self.images_dir = Path(images_dir) if images_dir is not None else self.root / split
        default_ann = self.root / "annotations" / f"instances_{split}.json"
        self.ann_file = Path(ann_file) if ann_file is not None else default_ann
        data = annotations if annotations is not None else load_coco_annotations(self.ann_file)
        if data["images"]:  # a missing images folder is the first error
            check_images_dir(self.images_dir, self.ann_file, split)
        self.categories = sorted_categories(categories if categories is not None else data.get("categories"),
                                            self.ann_file)
        self.category_ids = [int(c["id"]) for c in self.categories]
        self.class_names = [str(c.get("name", c["id"])) for c in self.categories]
        self.transform = transform
        self.max_pixels = max_pixels
        self._raw_orientation: set[int] = set()
        self._bad_masks: set[int] = set()  # image ids whose masks could not be read (warned once)
        entries = read_image_entries(data, self.ann_file, self.images_dir, split, follow_symlinks,
                                     skip_refused=skip_unreadable, require_files=True)
        self.images: list[dict] = [im for im, _ in entries]
        self._paths: list[Path] = [path for _, path in entries]
        self.annotations, self.scored = self._read_annotations(data["annotations"])

    def _read_annotations(self, annotations: list) -> tuple[dict[int, list], dict[int, list]]:
        """``(training targets, scored ground truth)`` by image id: the training targets
        (non-crowd, clipped to the image) and the scored ground truth (crowd included and flagged,
        boxes as written, as pycocotools scores them). Unusable annotations are dropped, each kind
        counted in one warning, and so are the training targets of an image beyond its first
        ``VISION_ATTN_MAX_OBJECTS`` (1000)."""
        label_of = {cid: i for i, cid in enumerate(self.category_ids)}
        by_image: dict[int, list[tuple[list[float], int]]] = {im["id"]: [] for im in self.images}
        scored: dict[int, list[tuple[list[float], int, int, float]]] = {im["id"]: [] for im in self.images}
        # each scored object's segmentation (None without one), kept for evaluation datasets only
        self._segmentations: dict[int, list[Any]] = {im["id"]: [] for im in self.images}
        self._object_segmentations: dict[int, list[Any]] = {im["id"]: [] for im in self.images}  # of the targets
        self._sizes = sizes = {im["id"]: (im.get("height"), im.get("width")) for im in self.images}
        dropped, example, most = Counter(), {}, limit("objects")
        for a in annotations:
            reason, box = annotation_problem(a, by_image, label_of)
            if not reason:
                x, y, w, h = box
                label, crowd = label_of[a["category_id"]], int(bool(a.get("iscrowd", 0)))
                area = float(a["area"]) if finite_number(a.get("area")) else w * h
                scored[a["image_id"]].append(([x, y, x + w, y + h], label, crowd, area))
                self._segmentations[a["image_id"]].append(a.get("segmentation") if self.scored_targets else None)
                if crowd:
                    continue
                (ih, iw), (x0, y0, x1, y1) = sizes[a["image_id"]], (x, y, x + w, y + h)
                if ih and iw:
                    x0, y0, x1, y1 = max(0.0, x0), max(0.0, y0), min(float(iw), x1), min(float(ih), y1)
                reason = ("outside the image" if x1 <= x0 or y1 <= y0 else  # VISION_ATTN_MAX_OBJECTS:
                          f"over {most} objects in its image" if len(by_image[a["image_id"]]) >= most else None)
            if reason:
                dropped[reason] += 1
                example.setdefault(reason, shown_value(a.get("id") if isinstance(a, dict) else a))
                continue
            by_image[a["image_id"]].append(([x0, y0, x1, y1], label))
            self._object_segmentations[a["image_id"]].append(a.get("segmentation"))
        for reason, n in dropped.items():
            log.warning("%s: dropped %d annotations (%s), e.g. annotation id %s", self.ann_file, n, reason,
                        example[reason])
        return by_image, scored

    def __len__(self) -> int:
        return len(self.images)

    def image_path(self, index: int) -> Path:
        """The checked path of image ``index`` (inside the split folder)."""
        return self._paths[index]

    def relative_file(self, index: int) -> str:
        """How outputs name image ``index``: relative to the root, or to the images folder when
        that lies outside the root (see :func:`vision_attn.data.loading.relative_file`)."""
        return relative_file(self.root, self.images_dir, self.images[index]["file_name"])

    def read_rgb(self, index: int) -> np.ndarray:
        """RGB ``uint8 [H, W, 3]`` of image ``index`` in the orientation its annotations
        describe (see the module docstring): the one image read of the dataset and overlays."""
        im = self.images[index]
        path = self.image_path(index)
        rgb = read_image(path, self.max_pixels)
        h, w = rgb.shape[:2]
        if (im.get("width"), im.get("height")) == (h, w) and h != w:
            # The file's EXIF rotation swaps the sides the annotation file declares: its boxes
            # were drawn on the stored pixels, so read those (boxes and overlays stay aligned).
            if im["id"] not in self._raw_orientation:
                self._raw_orientation.add(im["id"])
                log.warning("%s: image id %s is %dx%d as stored but %dx%d after its EXIF rotation; using the stored "
                            "orientation the annotations describe", self.ann_file, im["id"], w, h, h, w)
            rgb = read_image(path, self.max_pixels, apply_exif=False)
        return rgb

    def scoring_target(self, image_id: int) -> dict[str, torch.Tensor]:
        """The ground truth scored for ``image_id`` (validation and evaluation alike), in the
        format of torchmetrics' ``MeanAveragePrecision``: ``boxes [G, 4]`` xyxy in pixels of the
        original image (as written in the file, not clipped), ``labels [G]``, ``iscrowd [G]``
        (crowd regions: matched detections are ignored) and ``area [G]`` (the file's ``area``,
        else the box area)."""
        anns = self.scored[image_id]
        return {"boxes": torch.tensor([a[0] for a in anns], dtype=torch.float32).reshape(-1, 4),
                "labels": torch.tensor([a[1] for a in anns], dtype=torch.int64),
                "iscrowd": torch.tensor([a[2] for a in anns], dtype=torch.int64),
                "area": torch.tensor([a[3] for a in anns], dtype=torch.float32)}

    def scoring_masks(self, image_id: int) -> list[ImageMask | None]:
        """The pixel mask of each object of :meth:`scoring_target` (same order), decoded when
        asked for (:class:`~vision_attn.data.masks.ImageMask`); ``None`` for an object without a
        ``segmentation``, or in an image without a whole-number ``height`` and ``width``."""
        height, width = self._sizes[image_id]
        where = f"{self.ann_file}: image id {image_id}"
        return [image_mask(seg, height, width, where) if seg is not None else None
                for seg in self._segmentations[image_id]]

    dense: DenseAugment | None = None
    """Training: mosaics and pasted objects (:mod:`vision_attn.data.dense`), when set."""

    def _raw(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(uint8 [3, H, W], XYXY boxes [n, 4], labels [n])`` of an image as read."""
        rgb = self.cached_read(index, lambda: self.read_rgb(index))
        anns = self.annotations[self.images[index]["id"]]
        xyxy = torch.tensor([a[0] for a in anns], dtype=torch.float32).reshape(-1, 4)
        return torch.from_numpy(rgb).permute(2, 0, 1), xyxy, torch.tensor([a[1] for a in anns], dtype=torch.int64)

    def _object_mask(self, index: int, k: int, size: tuple[int, int]) -> torch.Tensor | None:
        """``bool [H, W]``: object ``k``'s segmentation (:meth:`_raw`'s order) in the image read at ``size``, or
        ``None`` (none, unreadable, or declared at another size: never decoded; the object is pasted with its box)."""
        im = self.images[index]
        seg = self._object_segmentations[im["id"]][k]
        mask = None if seg is None else image_mask(seg, im.get("height"), im.get("width"),
                                                   f"{self.ann_file}: image id {im['id']}")
        try:
            return None if mask is None else torch.from_numpy(mask.decode(size))
        except DataError as err:
            if im["id"] not in self._bad_masks:
                self._bad_masks.add(im["id"])
                log.warning("%s; pasting its box instead", err)
            return None

    def _load(self, index: int):
        im = self.images[index]
        rgb, xyxy, labels = self._raw(index)
        if self.dense is not None:
            rgb, xyxy, labels = self.dense((rgb, xyxy, labels), self._raw, len(self), self._object_mask, index)
        h, w = rgb.shape[-2:]
        image = tv_tensors.Image(rgb)
        boxes = tv_tensors.BoundingBoxes(xyxy, format="XYXY", canvas_size=(h, w))
        if self.transform is not None:
            image, boxes, labels = self.transform(image, boxes, labels)
        size = tuple(image.shape[-2:])
        target = {"labels": labels, "boxes": _to_target(boxes.as_subclass(torch.Tensor), size),
                  "image_id": int(im["id"]), "orig_size": torch.tensor([h, w])}
        if self.with_size:
            target["size"] = torch.tensor(size)
        if self.scored_targets:
            target["scored"] = self.scoring_target(im["id"])
        return image, target


def detection_collate(batch):
    """``(images [B, 3, H, W], targets)``. Images of one size are stacked; images of different
    sizes are padded at the bottom and on the right with zeros (the mean colour, after
    normalisation) to the largest height and width (the task pads further to a multiple of the
    patch size), their own sizes staying in the targets' ``size``."""
    images, targets = zip(*batch, strict=True)
    if all(im.shape == images[0].shape for im in images):
        return torch.stack(images), list(targets)
    if any("size" not in t for t in targets):
        raise DataError("images of different sizes in one batch, but their targets have no 'size': "
                        "use --data.transform.resize aspect (which records it) or a fixed input size")
    h, w = max(im.shape[-2] for im in images), max(im.shape[-1] for im in images)
    out = images[0].new_zeros(len(images), images[0].shape[0], h, w)
    for i, im in enumerate(images):
        out[i, :, : im.shape[-2], : im.shape[-1]] = im
    return out, list(targets)


RESIZE_MODES = ("square", "aspect")


@dataclass(frozen=True)
class DetectionTransform:
    """How detection images are resized and augmented (``--data.transform.*``; see the module
    docstring and :func:`build_detection_transform`).

    Attributes:
        resize: ``square`` (resize to the model's input size) or ``aspect`` (keep the aspect
            ratio and pad the batch: real datasets).
        train_sizes: ``aspect``: the shorter side's sizes drawn in training (DETR's by default).
        eval_size: ``aspect``: the shorter side in evaluation.
        max_size: ``aspect``: the most pixels of the longer side.
        scale_jitter: ``square``: area range of the training random-resized crop (``[1.0, 1.0]``:
            the whole image, no crop).
        hflip: random horizontal flips in training (off for digits, text, or any class that a
            mirror image changes).
    """

    resize: str = "square"
    train_sizes: tuple[int, ...] = DETR_TRAIN_SIZES
    eval_size: int = DETR_EVAL_SIZE
    max_size: int | None = DETR_MAX_SIZE
    scale_jitter: tuple[float, float] = (0.6, 1.0)
    hflip: bool = True

    def __post_init__(self) -> None:
        if self.resize not in RESIZE_MODES:
            raise DataError(f"--data.transform.resize must be one of {', '.join(RESIZE_MODES)}, got {self.resize!r}")
        try:  # the sizes checked now (a clear error here, not in a loader worker)
            if self.resize == "aspect":
                AspectResize(tuple(self.train_sizes), self.max_size)
                AspectResize(self.eval_size, self.max_size)
        except (TypeError, ValueError) as err:
            raise DataError(f"--data.transform.train_sizes / eval_size / max_size: {err}") from err

    def build(self, pre: dict[str, Any], train: bool):
        """This transform for the model's preprocessing ``pre`` (:func:`build_detection_transform`)."""
        return build_detection_transform(pre, train, tuple(self.scale_jitter), self.resize, tuple(self.train_sizes),
                                         self.eval_size, self.max_size, self.hflip)


def build_detection_transform(pre: dict[str, Any], train: bool, scale_jitter: tuple[float, float] = (0.6, 1.0),
                              resize: str = "square", train_sizes: tuple[int, ...] = DETR_TRAIN_SIZES,
                              eval_size: int = DETR_EVAL_SIZE, max_size: int | None = DETR_MAX_SIZE,
                              hflip: bool = True):
    """Paired image + box transforms.

    ``resize="square"``: evaluation resizes the whole image to the input size (no crop, so
    predicted fractions map straight back to the original); training adds flips and a
    scale-jittered random crop. ``resize="aspect"``: keep the aspect ratio (shorter side
    ``eval_size``, or in training one of ``train_sizes`` with a random flip; longer side at most
    ``max_size``; :class:`~vision_attn.data.transforms.AspectResize`). Both then clamp and drop
    boxes that vanished. ``hflip=False``: no random flip in training (digits, text, any class a
    mirror image changes)."""
    if resize not in RESIZE_MODES:
        raise ValueError(f"--data.transform.resize must be one of {', '.join(RESIZE_MODES)}, got {resize!r}")
    _, h, w = pre["input_size"]
    interp = _interp(pre.get("interpolation", "bicubic"))
    if resize == "square":
        return SquareDetectionTransform((h, w), train, scale_jitter, interp, pre["mean"], pre["std"], hflip)
    ops: list = [T.RandomHorizontalFlip()] if train and hflip else []
    ops += [AspectResize(tuple(train_sizes) if train else eval_size, max_size, interp)]
    ops += [T.ClampBoundingBoxes(), T.SanitizeBoundingBoxes(min_size=1.0, labels_getter=lambda s: s[2]),
            T.ToDtype(torch.float32, scale=True), T.Normalize(mean=list(pre["mean"]), std=list(pre["std"]))]
    return T.Compose(ops)


class SquareDetectionTransform:
    """The ``resize="square"`` transform of :func:`build_detection_transform`, in one call.

    Training: a random horizontal flip (unless ``hflip=False``), then a random resized crop (area
    ``scale`` of the image, aspect ratio 3/4 to 4/3) to ``size``; evaluation: the whole image resized to ``size``. Then
    boxes clamped to the image, boxes under 1 px (side or area) dropped with their labels, the
    image converted to float and normalised. The same operations and kernels as torchvision's v2
    pipeline of ``RandomHorizontalFlip``, ``RandomResizedCrop`` (or ``Resize``),
    ``ClampBoundingBoxes``, ``SanitizeBoundingBoxes``, ``ToDtype`` and ``Normalize`` (tested equal
    for the same draws), called on plain tensors: on small images the pipeline's per-transform
    dispatch is a large part of its time (``python -m benchmarks.cpu_paths``).

    Called as ``transform(image, boxes, labels)`` with a ``uint8 [3, H, W]`` image and ``XYXY``
    pixel boxes; returns the same three (boxes as ``tv_tensors.BoundingBoxes``).
    """

    def __init__(self, size: tuple[int, int], train: bool, scale: tuple[float, float] = (0.6, 1.0),
                 interpolation: Any = T.InterpolationMode.BICUBIC, mean: Any = (0.5, 0.5, 0.5),
                 std: Any = (0.5, 0.5, 0.5), hflip: bool = True) -> None:
        self.size, self.train, self.hflip = [int(size[0]), int(size[1])], train, hflip
        self.crop = T.RandomResizedCrop(self.size, scale=tuple(scale), ratio=(0.75, 1.333), interpolation=interpolation,
                                        antialias=True)
        self.interpolation, self.mean, self.std = interpolation, list(mean), list(std)

    def draw(self, image: torch.Tensor) -> tuple[bool, int, int, int, int]:
        """``(flip, top, left, height, width)`` for one call: drawn in training (the flip first,
        then the crop, as the v2 pipeline draws them), the whole image in evaluation."""
        h, w = image.shape[-2:]
        if not self.train:
            return False, 0, 0, int(h), int(w)
        flip = bool(torch.rand(1) < 0.5) if self.hflip else False
        p = self.crop.make_params([image])
        return flip, p["top"], p["left"], p["height"], p["width"]

    def apply(self, image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor,
              params: tuple[bool, int, int, int, int]) -> tuple[torch.Tensor, tv_tensors.BoundingBoxes, torch.Tensor]:
        """The transform for given :meth:`draw` parameters."""
        flip, top, left, height, width = params
        fmt = tv_tensors.BoundingBoxFormat.XYXY
        img, b = image.as_subclass(torch.Tensor), boxes.as_subclass(torch.Tensor)
        if flip:
            b = TF.horizontal_flip_bounding_boxes(b, fmt, tuple(img.shape[-2:]))
            img = TF.horizontal_flip_image(img)
        img = TF.resized_crop_image(img, top, left, height, width, self.size, self.interpolation, antialias=True)
        b, canvas = TF.resized_crop_bounding_boxes(b, fmt, top, left, height, width, self.size)
        b = TF.clamp_bounding_boxes(b, fmt, canvas, clamping_mode="soft")
        bw, bh = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
        keep = (bw >= 1) & (bh >= 1) & (bw * bh >= 1) & (b >= 0).all(-1)  # SanitizeBoundingBoxes' rule
        keep &= (b[:, 0] <= canvas[1]) & (b[:, 2] <= canvas[1]) & (b[:, 1] <= canvas[0]) & (b[:, 3] <= canvas[0])
        img = TF.normalize_image(TF.to_dtype_image(img, torch.float32, scale=True), self.mean, self.std)
        return img, tv_tensors.BoundingBoxes(b[keep], format=fmt, canvas_size=canvas), labels[keep]

    def __call__(self, image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor):
        return self.apply(image, boxes, labels, self.draw(image))


DETECTION_BATCHING = Batching(batch_size=16, min_steps_per_epoch=200, min_batch_size=8, max_batch_size=64)
DETECTION_LAYOUT = SplitLayout()
SQUARE_TRANSFORM = DetectionTransform()
NO_MOSAIC = MosaicConfig()
NO_COPY_PASTE = CopyPasteConfig()


class DetectionDataModule(CocoLayout, SplitDataModule):
    """COCO-layout detection data (the embedded shapes scenes when ``root`` is unset).

    Args:
        root: dataset root (``ROOT/<split>/``, ``ROOT/annotations/instances_<split>.json``);
            the base of relative ``layout.*_images`` / ``layout.*_annotations`` paths.
        synthetic: parameters of the embedded scenes when ``root`` is ``None``.
        cache_dir: where the embedded data is generated.
        layout: split names, each split's annotation file and images folder when not the
            layout's, the image size limit and symbolic links
            (:class:`~vision_attn.data.layout.SplitLayout`).
        batching: the training batch (fixed, or ``auto``: sized from the training set), the
            evaluation batch and the loader processes (:class:`~vision_attn.data.loading.Batching`;
            default batch 16, ``auto`` with at least 200 steps per epoch in 8..64).
        transform: the resize (``square``, or ``aspect`` with DETR's sizes), the random crop and
            the flips (:class:`DetectionTransform`).
        mosaic: four training images in one for more objects per image, off for the last epochs
            (:class:`~vision_attn.data.dense.MosaicConfig`; off by default).
        copy_paste: objects of other training images pasted in, off for the last epochs
            (:class:`~vision_attn.data.dense.CopyPasteConfig`; off by default).
    """

    legacy_arguments = {**SPLIT_LAYOUT_LEGACY, **BATCHING_LEGACY,
                        **{k: f"transform.{k}" for k in ("resize", "train_sizes", "eval_size", "max_size",
                                                         "scale_jitter", "hflip")}}

    def __init__(
        self,
        root: str | None = None,
        synthetic: SceneSetConfig | None = None,
        cache_dir: str | None = None,
        layout: SplitLayout = DETECTION_LAYOUT,
        batching: Batching = DETECTION_BATCHING,
        transform: DetectionTransform = SQUARE_TRANSFORM,
        mosaic: MosaicConfig = NO_MOSAIC,
        copy_paste: CopyPasteConfig = NO_COPY_PASTE,
    ) -> None:
        super().__init__()
        for name, config in (("mosaic", mosaic), ("copy_paste", copy_paste)):
            if config.enabled and transform.resize != "square":
                raise ConfigError(f"--data.{name}.prob > 0 needs --data.transform.resize square (made at the model's "
                                  f"input size), got resize {transform.resize!r}")
        self.mosaic, self.copy_paste = mosaic, copy_paste
        self.dense_switches = {name: torch.ones(1, dtype=torch.int32).share_memory_()  # DenseSchedule's
                               for name in ("mosaic", "copy_paste")}
        self.transform_config = transform
        self.resize, self.train_sizes, self.eval_size, self.max_size = (
            transform.resize, tuple(transform.train_sizes), transform.eval_size, transform.max_size)
        self._init_layout(root, synthetic, cache_dir, "a COCO-layout folder", layout)
        self._init_batching(batching)
        self.scale_jitter = transform.scale_jitter
        self.hflip = bool(transform.hflip)
        train_split = layout.train_split
        train_ann_file = self.split_paths(train_split)[1]
        ann = load_coco_annotations(train_ann_file)
        self._train_annotations: dict[str, Any] | None = ann  # parsed once; handed to the train dataset
        self.categories = sorted_categories(ann.get("categories"), train_ann_file)
        self.class_names = [str(c.get("name", c["id"])) for c in self.categories]
        self.category_ids = [int(c["id"]) for c in self.categories]
        self.preprocess: dict[str, Any] | None = None
        self.datasets: dict[str, CocoDetection] = {}

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def dataset(self, split: str, train: bool = False) -> CocoDetection:
        tf = self.transform_config.build(model_preprocess(self), train)
        parsed = None
        if split == self.train_split and self._train_annotations is not None:
            parsed, self._train_annotations = self._train_annotations, None  # used once, then freed
        # training skips unreadable or refused files; evaluation stops at the first
        images_dir, ann_file = self.split_paths(split)
        ds = CocoDetection(self.root, split, tf, self.categories, self.max_pixels, parsed,
                           follow_symlinks=self.follow_symlinks, skip_unreadable=train,
                           images_dir=images_dir, ann_file=ann_file, scored_targets=not train,
                           with_size=self.resize == "aspect")
        if train and (self.mosaic.enabled or self.copy_paste.enabled):
            ds.dense = DenseAugment(tuple(model_preprocess(self)["input_size"][1:]), self.mosaic, self.copy_paste,
                                    self.dense_switches)
        return ds

    def collate_fn(self):
        return detection_collate
