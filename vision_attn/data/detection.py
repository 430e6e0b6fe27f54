"""COCO-format detection data: ``ROOT/<split>/`` images, ``ROOT/annotations/instances_<split>.json``.

- Category ids may be sparse (COCO's 1..90): they are mapped to contiguous labels
  ``0..C-1`` in id order (``category_ids[label]`` maps back); names come from the file.
- Faulty annotations never crash training: boxes with non-finite values, zero or negative size,
  or entirely outside the image are dropped, boxes sticking out are clipped, annotations of
  unknown images or categories are dropped — each kind counted in one warning that names an
  example id. Images with zero annotations are kept (they teach "no object").
- A missing image file is an error naming the image id and the path.
- Targets: ``labels [G]``, ``boxes [G, 4]`` as ``(cx, cy, w, h)`` fractions of the model
  input (normalised in one place, :func:`_to_target`), ``image_id``, ``orig_size (h, w)``.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2 as T

from vision_attn.boxes import box_xyxy_to_cxcywh
from vision_attn.data.imageio import DEFAULT_MAX_PIXELS, read_image
from vision_attn.data.loading import SkipUnreadable, SplitDataModule
from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco
from vision_attn.data.transforms import _interp, model_preprocess
from vision_attn.errors import DataError

__all__ = ["CocoDetection", "DetectionDataModule", "coco_root", "detection_collate", "load_coco_annotations"]

log = logging.getLogger(__name__)


def load_coco_annotations(path: Path) -> dict[str, Any]:
    """Read an annotation file; malformed JSON is an error naming the file, line and column."""
    if not path.is_file():
        raise DataError(f"annotation file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"annotation file {path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from err
    except UnicodeDecodeError as err:
        raise DataError(f"annotation file {path} is not UTF-8 text: {err}") from err
    for key in ("images", "annotations"):
        if not isinstance(data.get(key), list):
            raise DataError(f"annotation file {path} has no {key!r} list (is it COCO format?)")
    return data


def coco_root(root: str | None, synthetic: SceneSetConfig | None, cache_dir: str | None, what: str) -> Path:
    """The data root: ``root``, or the embedded shape scenes (generated on first use) when unset."""
    if root is None:
        root = str(ensure_shapes_coco(synthetic or SceneSetConfig(), cache_dir))
    path = Path(root).expanduser()
    if not path.is_dir():
        raise DataError(f"data root {path} does not exist; pass --data.root with {what}")
    return path


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
        split: image folder name (``val``, ``val2017``, ...).
        transform: a torchvision v2 transform taking ``(image, BoundingBoxes)``.
        categories: category list to use (default: the file's); for val, pass train's.
        max_pixels: refuse larger images.
        annotations: the already parsed annotation file (it is read from disk otherwise).
    """

    def __init__(self, root: str | Path, split: str, transform: Any = None, categories: list[dict] | None = None,
                 max_pixels: int = DEFAULT_MAX_PIXELS, annotations: dict[str, Any] | None = None) -> None:
        self.root, self.split = Path(root), split
        self.ann_file = self.root / "annotations" / f"instances_{split}.json"
        data = annotations if annotations is not None else load_coco_annotations(self.ann_file)
        cats = categories if categories is not None else data.get("categories") or []
        if not cats:
            raise DataError(f"annotation file {self.ann_file} has no categories")
        self.categories = sorted(cats, key=lambda c: c["id"])
        self.category_ids = [int(c["id"]) for c in self.categories]
        self.class_names = [str(c.get("name", c["id"])) for c in self.categories]
        label_of = {cid: i for i, cid in enumerate(self.category_ids)}
        self.transform = transform
        self.max_pixels = max_pixels
        self._raw_orientation: set[int] = set()
        self.images: list[dict] = []
        seen: set[int] = set()
        for im in data["images"]:
            if im["id"] in seen:
                raise DataError(f"{self.ann_file}: image id {im['id']} appears twice")
            seen.add(im["id"])
            self.images.append(im)
        by_image: dict[int, list[tuple[list[float], int]]] = {im["id"]: [] for im in self.images}
        sizes = {im["id"]: (im.get("height"), im.get("width")) for im in self.images}
        dropped: Counter = Counter()
        example: dict[str, Any] = {}
        for a in data["annotations"]:
            reason = None
            if a.get("image_id") not in by_image:
                reason = "unknown image id"
            elif a.get("category_id") not in label_of:
                reason = "unknown category id"
            elif a.get("iscrowd", 0):
                reason = "crowd"
            else:
                x, y, w, h = (float(v) for v in a.get("bbox", [math.nan] * 4))
                if not all(math.isfinite(v) for v in (x, y, w, h)):
                    reason = "non-finite box"
                elif w <= 0 or h <= 0:
                    reason = "zero or negative size"
                else:
                    ih, iw = sizes[a["image_id"]]
                    x0, y0, x1, y1 = x, y, x + w, y + h
                    if ih and iw:
                        x0, y0, x1, y1 = max(0.0, x0), max(0.0, y0), min(float(iw), x1), min(float(ih), y1)
                        if x1 <= x0 or y1 <= y0:
                            reason = "outside the image"
            if reason:
                dropped[reason] += 1
                example.setdefault(reason, a.get("id"))
                continue
            by_image[a["image_id"]].append(([x0, y0, x1, y1], label_of[a["category_id"]]))
        for reason, n in dropped.items():
            if reason != "crowd":
                log.warning("%s: dropped %d annotations (%s), e.g. annotation id %s", self.ann_file, n, reason, example[reason])
        self.annotations = by_image
        for im in self.images:
            path = self.root / split / im["file_name"]
            if not path.is_file():
                raise DataError(f"{self.ann_file}: image id {im['id']} has no file {path}")

    def __len__(self) -> int:
        return len(self.images)

    def _load(self, index: int):
        im = self.images[index]
        path = self.root / self.split / im["file_name"]
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
            h, w = rgb.shape[:2]
        anns = self.annotations[im["id"]]
        xyxy = torch.tensor([a[0] for a in anns], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor([a[1] for a in anns], dtype=torch.int64)
        image = tv_tensors.Image(torch.from_numpy(rgb).permute(2, 0, 1))
        boxes = tv_tensors.BoundingBoxes(xyxy, format="XYXY", canvas_size=(h, w))
        if self.transform is not None:
            image, boxes, labels = self.transform(image, boxes, labels)
        size = tuple(image.shape[-2:])
        target = {"labels": labels, "boxes": _to_target(boxes.as_subclass(torch.Tensor), size),
                  "image_id": int(im["id"]), "orig_size": torch.tensor([h, w])}
        return image, target


def detection_collate(batch):
    images, targets = zip(*batch, strict=True)
    return torch.stack(images), list(targets)


def build_detection_transform(pre: dict[str, Any], train: bool, scale_jitter: tuple[float, float] = (0.6, 1.0)):
    """Paired image + box transforms. Evaluation: resize the whole image to the input size (no
    crop, so predicted fractions map straight back to the original). Training adds flips and
    a scale-jittered random crop, then clamps and drops boxes that vanished."""
    _, h, w = pre["input_size"]
    interp = _interp(pre.get("interpolation", "bicubic"))
    ops: list = []
    if train:
        ops += [T.RandomHorizontalFlip(), T.RandomResizedCrop((h, w), scale=scale_jitter, ratio=(0.75, 1.333),
                                                               interpolation=interp, antialias=True)]
    else:
        ops += [T.Resize((h, w), interpolation=interp, antialias=True)]
    ops += [T.ClampBoundingBoxes(), T.SanitizeBoundingBoxes(min_size=1.0, labels_getter=lambda s: s[2]),
            T.ToDtype(torch.float32, scale=True), T.Normalize(mean=list(pre["mean"]), std=list(pre["std"]))]
    return T.Compose(ops)


class DetectionDataModule(SplitDataModule):
    """COCO-layout detection data (the embedded shapes scenes when ``root`` is unset).

    Args:
        root: dataset root (``ROOT/<split>/``, ``ROOT/annotations/instances_<split>.json``).
        synthetic: parameters of the embedded scenes when ``root`` is ``None``.
        cache_dir: where the embedded data is generated.
        train_split: training split name (COCO users: ``train2017``).
        val_split: validation split name (COCO users: ``val2017``).
        batch_size: images per batch.
        num_workers: loader processes.
        scale_jitter: area range of the training random-resized crop.
        max_pixels: refuse larger images.
    """

    def __init__(
        self,
        root: str | None = None,
        synthetic: SceneSetConfig | None = None,
        cache_dir: str | None = None,
        train_split: str = "train",
        val_split: str = "val",
        batch_size: int = 16,
        num_workers: int = 2,
        scale_jitter: tuple[float, float] = (0.6, 1.0),
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        super().__init__()
        self.root = coco_root(root, synthetic, cache_dir, "a COCO-layout folder")
        self.train_split, self.val_split = train_split, val_split
        self.batch_size, self.num_workers, self.scale_jitter, self.max_pixels = batch_size, num_workers, scale_jitter, max_pixels
        ann = load_coco_annotations(self.root / "annotations" / f"instances_{train_split}.json")
        self._train_annotations: dict[str, Any] | None = ann  # parsed once; handed to the train dataset
        self.categories = sorted(ann.get("categories") or [], key=lambda c: c["id"])
        if not self.categories:
            raise DataError(f"{self.root / 'annotations' / f'instances_{train_split}.json'} has no categories")
        self.class_names = [str(c.get("name", c["id"])) for c in self.categories]
        self.category_ids = [int(c["id"]) for c in self.categories]
        self.preprocess: dict[str, Any] | None = None
        self.datasets: dict[str, CocoDetection] = {}

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def dataset(self, split: str, train: bool = False) -> CocoDetection:
        tf = build_detection_transform(model_preprocess(self), train, self.scale_jitter)
        parsed = None
        if split == self.train_split and self._train_annotations is not None:
            parsed, self._train_annotations = self._train_annotations, None  # used once, then freed
        ds = CocoDetection(self.root, split, tf, self.categories, self.max_pixels, parsed)
        ds.skip_unreadable = train  # training skips unreadable files; evaluation stops at the first
        return ds

    def collate_fn(self):
        return detection_collate
