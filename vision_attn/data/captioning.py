"""COCO-captions data: ``ROOT/<split>/`` images, ``ROOT/annotations/captions_<split>.json``.

- Layout: that is the default of every split; a split's caption file and images folder can be
  given instead (``--data.layout.train_annotations``, ``--data.layout.train_images``, likewise ``val_`` and
  ``test_``), exactly as for detection (:func:`vision_attn.data.detection.split_layout`).

- Every image has several reference captions. Training samples one of them at random each
  time the image is drawn (so every caption is seen over the epochs); evaluation keeps all of
  them as references.
- Faulty annotations never crash training: captions of unknown image ids, captions that are
  not text, longer than :data:`MAX_CAPTION_CHARS` or empty after normalisation are dropped, and
  images left without a caption
  are skipped — each kind counted in one warning naming an example id. A file that is not
  UTF-8 or not JSON, or an image file that is missing, is an error naming the file or id.
- Image ids must be what COCO tools accept (they end up in output file names and results files:
  :func:`~vision_attn.data.coco.is_coco_id`, integers from 0 to 2**63 - 1, never ``true``
  or ``false``), else an error naming the file and the id; ``file_name`` must stay inside the
  split folder (see :func:`vision_attn.data.loading.image_path_inside`):
  a refused path is a counted warning in training, an error in evaluation.
- Images are never flipped: captions say "left" and "right".
- Instance annotations: when ``instances_<split>.json`` lies next to the caption file (the
  embedded scenes write it; COCO ships it), :meth:`CocoCaptions.annotated_objects` reads each
  image's objects (category, and ``colour`` where annotated) for content accuracy
  (:mod:`vision_attn.metrics.caption_content`). It is read on first use only (evaluation). In training
  it is read only when the model asks for box supervision of its encoder
  (:meth:`CocoCaptions.attach_boxes`, ``CaptioningTask(grounding_weight=...)``).

Items: ``(image [3, H, W], token ids [T], index)``, plus ``(boxes [N, 4], labels [N])`` when
boxes are attached (normalised ``x0, y0, x1, y1`` of the transformed image, moved with its
crop); all references of an item are in ``dataset.references[index]`` (normalised, for the
training split: :meth:`CaptioningDataModule.train_references`).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from vision_attn.data.caption_objects import AnnotatedObjects, Mention
from vision_attn.data.coco import (
    annotation_problem,
    category_names,
    is_coco_id,
    load_coco_annotations,
    read_image_entries,
    shown_value,
)
from vision_attn.data.detection import CocoDetection, CocoLayout
from vision_attn.data.imageio import DEFAULT_MAX_PIXELS, read_image
from vision_attn.data.layout import SPLIT_LAYOUT_LEGACY, SplitLayout
from vision_attn.data.loading import BATCHING_LEGACY, Batching, SkipUnreadable, SplitDataModule, relative_file
from vision_attn.data.synthetic import SceneSetConfig
from vision_attn.data.tokenizer import WordTokenizer, normalize_caption
from vision_attn.data.transforms import (
    AugmentPreset,
    box_transform,
    build_eval_transform,
    build_train_transform,
    model_preprocess,
    whole_image,
)
from vision_attn.errors import DataError

__all__ = ["CaptionOptions", "CaptioningDataModule", "CocoCaptions", "caption_collate", "instances_file_for",
           "read_annotated_objects",
           "read_captions"]

log = logging.getLogger(__name__)


MAX_CAPTION_CHARS = 10_000
"""Captions longer than this are dropped when read (a warning counts them): every caption is
tokenised whole each time its image is drawn, and references are scored whole."""


def read_captions(root: Path, split: str, follow_symlinks: bool = False, skip_refused: bool = False,
                  images_dir: str | Path | None = None,
                  ann_file: str | Path | None = None) -> tuple[list[dict], dict[int, list[str]]]:
    """``(images, captions by image id)`` of one split, cleaned as the module docstring says.

    Caption strings are kept as written (normalised only where they are used). Each image
    entry gains ``"path"``: its checked file path inside the split folder.

    Args:
        root: dataset root.
        split: split name.
        follow_symlinks: follow symbolic links inside the split folder that lead outside it.
        skip_refused: training: skip images whose path is refused (one counted warning);
            otherwise a refused path is an error.
        images_dir: the split's images folder, as it is (default ``ROOT/<split>/``).
        ann_file: the split's caption file, as it is (default
            ``ROOT/annotations/captions_<split>.json``).
    """
    root = Path(root)
    images_dir = Path(images_dir) if images_dir is not None else root / split
    ann_file = Path(ann_file) if ann_file is not None else root / "annotations" / f"captions_{split}.json"
    data = load_coco_annotations(ann_file)
    entries = read_image_entries(data, ann_file, images_dir, split, follow_symlinks, skip_refused=skip_refused)
    images: list[dict] = [{**im, "path": path} for im, path in entries]
    captions: dict[int, list[str]] = {im["id"]: [] for im in images}
    dropped: Counter = Counter()
    example: dict[str, Any] = {}
    for a in data["annotations"]:
        text = a.get("caption") if isinstance(a, dict) else None
        image_id = a.get("image_id") if isinstance(a, dict) else None
        if not is_coco_id(image_id) or image_id not in captions:
            reason = "unknown image id"
        elif not isinstance(text, str):
            reason = "caption is not text"
        elif len(text) > MAX_CAPTION_CHARS:
            reason = f"caption longer than {MAX_CAPTION_CHARS} characters"
        elif not normalize_caption(text):
            reason = "empty caption"
        else:
            captions[image_id].append(text)
            continue
        dropped[reason] += 1
        example.setdefault(reason, shown_value(a.get("id") if isinstance(a, dict) else a))
    for reason, n in dropped.items():
        log.warning("%s: dropped %d captions (%s), e.g. annotation id %s", ann_file, n, reason, example[reason])
    without = [im["id"] for im in images if not captions[im["id"]]]
    if without:
        log.warning("%s: skipped %d images without a usable caption, e.g. image id %s", ann_file, len(without),
                    without[0])
        images = [im for im in images if captions[im["id"]]]
        for i in without:
            del captions[i]
    if not images:
        raise DataError(f"{ann_file} has no image with a usable caption")
    for im in images:
        if not im["path"].is_file():
            raise DataError(f"{ann_file}: image id {im['id']} has no file {images_dir / im['file_name']}")
    return images, captions


def instances_file_for(captions_file: Path) -> Path:
    """Where a caption file's instance annotations would be: ``captions_<split>.json`` ->
    ``instances_<split>.json`` in the same folder (another name: ``instances_<name>``)."""
    name = captions_file.name
    stem = name[len("captions_"):] if name.startswith("captions_") else name
    return captions_file.with_name(f"instances_{stem}")


def read_annotated_objects(path: Path) -> AnnotatedObjects:
    """Each image's objects ``[(colour or None, category name)]`` from a COCO instances file.

    Category names are normalised like captions. Crowd regions (``iscrowd``: a group of
    objects, not one) are left out; annotations of unknown images or categories are dropped
    with one counted warning. An object's colour is its ``"colour"`` (or ``"color"``) value;
    when no object has one, colours are not compared (all ``None``).
    """
    data = load_coco_annotations(path)
    missing = f"instances file {path} has no categories list; content accuracy needs the category names"
    names = {i: normalize_caption(n) for i, n in category_names(data.get("categories"), path, missing).items()}
    objects: dict[int, list[Mention]] = {
        im["id"]: [] for im in data["images"] if isinstance(im, dict) and is_coco_id(im.get("id"))}
    dropped, example = 0, None
    for a in data["annotations"]:
        if annotation_problem(a, objects, names, check_box=False)[0] is not None:
            dropped += 1
            example = example or shown_value(a.get("id") if isinstance(a, dict) else a)
            continue
        if a.get("iscrowd"):
            continue
        colour = a.get("colour", a.get("color"))
        colour = (normalize_caption(colour) or None) if isinstance(colour, str) else None
        objects[a["image_id"]].append((colour, names[a["category_id"]]))
    if dropped:
        log.warning("%s: %d annotations of unknown images or categories left out of content accuracy, e.g. id %s",
                    path, dropped, example)
    colours = sorted({c for objs in objects.values() for c, _ in objs if c is not None})
    if not colours:
        objects = {i: [(None, kind) for _, kind in objs] for i, objs in objects.items()}
    return AnnotatedObjects(categories=list(dict.fromkeys(names.values())), colours=colours, objects=dict(objects))


class CocoCaptions(SkipUnreadable, Dataset):
    """One split of a COCO-captions dataset.

    Items are ``(image [3, H, W], token ids [T], index)``; the tokens are those of a random
    reference (``sample="random"``, training) or of the first one (``"first"``, evaluation:
    a teacher-forced loss). All references of item ``index`` are ``references[index]``.

    Args:
        root: dataset root.
        split: split name (``val``, ``val2017``, ...): the image folder under ``root`` unless
            ``images_dir`` is given.
        transform: image transform (``uint8 [H, W, 3]`` numpy in, tensor out).
        tokenizer: encodes the captions.
        sample: ``random`` or ``first`` (see above).
        max_length: longest token sequence (with ``<bos>``/``<eos>``).
        max_pixels: refuse larger images.
        parsed: the split's ``read_captions`` result when already read (it is read otherwise).
        follow_symlinks: follow symbolic links inside the split folder that lead outside it.
        skip_unreadable: training: skip unreadable images and refused paths (counted
            warnings); evaluation (``False``): stop with an error.
        images_dir: the split's images folder, as it is (default ``ROOT/<split>/``).
        ann_file: the split's caption file, as it is (default
            ``ROOT/annotations/captions_<split>.json``).
        captions_per_item: captions per item (``>= 1``, checked by the datamodule's
            ``captions_per_image``); above 1 an item's tokens are a tuple of that many.
    """

    def __init__(self, root: str | Path, split: str, transform: Any, tokenizer: WordTokenizer,
                 sample: str = "first", max_length: int = 32, max_pixels: int = DEFAULT_MAX_PIXELS,
                 parsed: tuple[list[dict], dict[int, list[str]]] | None = None, follow_symlinks: bool = False,
                 skip_unreadable: bool = False, images_dir: str | Path | None = None,
                 ann_file: str | Path | None = None, captions_per_item: int = 1) -> None:
        self.root, self.split = Path(root), split
        self.captions_per_item = captions_per_item
        self.skip_unreadable = skip_unreadable
        self.images_dir = Path(images_dir) if images_dir is not None else self.root / split
        default_ann = self.root / "annotations" / f"captions_{split}.json"
        self.ann_file = Path(ann_file) if ann_file is not None else default_ann
        self.images, captions = parsed if parsed is not None else read_captions(
            self.root, split, follow_symlinks, skip_unreadable, self.images_dir, self.ann_file)
        self.references = [captions[im["id"]] for im in self.images]
        self.transform, self.tokenizer, self.sample = transform, tokenizer, sample
        self.max_length, self.max_pixels = max_length, max_pixels
        self._objects: AnnotatedObjects | None = None
        self.boxes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # image id -> (xyxy px, labels)
        self._with_boxes = None

    @property
    def instances_file(self) -> Path:
        """``instances_<split>.json`` next to the caption file (it may not exist)."""
        return instances_file_for(self.ann_file)

    def annotated_objects(self) -> AnnotatedObjects | None:
        """The split's annotated objects by image id (read once, on first use), or ``None``
        when there is no instances file next to the captions."""
        if self._objects is None and self.instances_file.is_file():
            self._objects = read_annotated_objects(self.instances_file)
        return self._objects

    def attach_boxes(self, classes: list[str] | None = None) -> list[str] | None:
        """Make training items carry each image's object boxes from the instances file.

        The file is read with the detection data's checks (crowd regions, boxes of zero size,
        outside the image or of unknown images / categories are left out, with counted
        warnings). ``classes``: the category names the labels index (normalised like captions;
        default: the file's, in its order); objects of other categories are left out.

        Returns:
            the category names the labels index, or ``None`` (nothing attached) when the split
            has no instances file.

        Raises:
            DataError: when the training transform moves pixels in a way the boxes cannot follow
                (RandAugment, the ``finetune`` preset's random resized crops).
        """
        if not self.instances_file.is_file():
            return None
        self._with_boxes = box_transform(self.transform)
        if self._with_boxes is None:
            raise DataError(f"{self.instances_file}: box supervision of the encoder (model.grounding_weight) needs a "
                            "training transform the boxes can follow: --data.augment none or small (without "
                            "RandAugment); or set --model.grounding_weight 0")
        det = CocoDetection(self.root, self.split, images_dir=self.images_dir, ann_file=self.instances_file,
                            skip_unreadable=True, scored_targets=False)
        names = [normalize_caption(n) for n in det.class_names]
        classes = list(dict.fromkeys(names)) if classes is None else list(classes)
        index = {c: i for i, c in enumerate(classes)}
        remap = [index.get(n, -1) for n in names]
        self.boxes, left_out = {}, 0
        for image_id, anns in det.annotations.items():
            kept = [(box, remap[label]) for box, label in anns if remap[label] >= 0]
            left_out += len(anns) - len(kept)
            self.boxes[image_id] = (torch.tensor([b for b, _ in kept], dtype=torch.float32).reshape(-1, 4),
                                    torch.tensor([c for _, c in kept], dtype=torch.int64))
        if left_out:
            log.warning("%s: %d objects of categories outside the model's %d left out of the box supervision",
                        self.instances_file, left_out, len(classes))
        log.info("box supervision of the encoder: %d objects of %d categories from %s",
                 sum(len(v[1]) for v in self.boxes.values()), len(classes), self.instances_file)
        return classes

    def __len__(self) -> int:
        return len(self.images)

    def image_path(self, index: int) -> Path:
        """The checked path of image ``index`` (inside the split folder, see :func:`read_captions`)."""
        return self.images[index]["path"]

    def relative_file(self, index: int) -> str:
        """How outputs name image ``index``: relative to the root, or to the images folder when
        that lies outside the root (see :func:`vision_attn.data.loading.relative_file`)."""
        return relative_file(self.root, self.images_dir, self.images[index]["file_name"])

    def _load(self, index: int):
        # boxes are drawn on the stored pixels (as the detection data reads them): no EXIF turn then
        exif = self.boxes is None
        image = self.cached_read((index, exif), lambda: read_image(self.image_path(index), self.max_pixels,
                                                                    apply_exif=exif))
        boxes = None
        if self.boxes is not None:
            none = (torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))
            xyxy, labels = self.boxes.get(self.images[index]["id"], none)
            h, w = image.shape[:2]
            image, moved = self._with_boxes(image, xyxy / torch.tensor([w, h, w, h], dtype=torch.float32))
            keep = (moved[:, 2] > moved[:, 0]) & (moved[:, 3] > moved[:, 1])  # cropped away: gone
            boxes = (moved[keep], labels[keep])
        elif self.transform is not None:
            image = self.transform(image)
        refs = self.references[index]
        # one caption per draw (DataLoader workers are seeded by Lightning); several: drawn
        # without replacement while the image has enough, then again from all of them
        if self.sample != "random":
            texts = [refs[0]] * self.captions_per_item
        else:
            k = self.captions_per_item
            texts = random.sample(refs, min(k, len(refs))) + [random.choice(refs) for _ in range(k - len(refs))]
        seqs = [torch.tensor(self.tokenizer.encode(t, self.max_length), dtype=torch.int64) for t in texts]
        tokens = seqs[0] if self.captions_per_item == 1 else tuple(seqs)
        return (image, tokens, index) if boxes is None else (image, tokens, index, boxes)


def caption_collate(batch, pad_id: int = 0):
    """``(images [B, 3, H, W], tokens [B, T] padded with pad_id, indices [B])``, plus the list of
    each image's ``(boxes, labels)`` when the items carry boxes. Items with ``K`` captions each
    (a tuple of token tensors, ``captions_per_image``) give ``tokens [B * K, T]``, image by image:
    rows ``i * K .. i * K + K - 1`` caption image ``i``."""
    images, seqs, indices, *boxes = zip(*batch, strict=True)
    if isinstance(seqs[0], tuple):
        seqs = [s for group in seqs for s in group]
    tokens = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    out = (torch.stack(images), tokens, torch.tensor(indices, dtype=torch.int64))
    return (*out, list(boxes[0])) if boxes else out


class _Collate:
    """Picklable collate with the tokenizer's pad id (DataLoader workers need to pickle it)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch):
        return caption_collate(batch, self.pad_id)


@dataclass(frozen=True)
class CaptionOptions:
    """What the captions become: token sequences of a vocabulary learned from the training
    captions, and how many of an image's captions a training step reads (``--data.captions.*``).

    Attributes:
        max_length: longest caption in tokens, ``<bos>`` and ``<eos>`` included.
        min_word_freq: words seen fewer times in the training captions become ``<unk>``.
        max_vocab: most words in the vocabulary (``None`` = all).
        per_image: training only: how many of an image's reference captions each step trains on
            (drawn without replacement; the image is encoded once and the decoder reads each
            caption), as ``seq_per_img`` in self-critical.pytorch. 1 = one caption drawn per
            image and epoch.
    """

    max_length: int = 32
    min_word_freq: int = 1
    max_vocab: int | None = None
    per_image: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.per_image, int) or self.per_image < 1:
            raise DataError(f"--data.captions.per_image must be an integer >= 1, got {self.per_image!r}")


CAPTIONING_BATCHING = Batching(batch_size=32, min_steps_per_epoch=100, min_batch_size=8, max_batch_size=64)
CAPTIONING_LAYOUT = SplitLayout()
CAPTIONS = CaptionOptions()


class CaptioningDataModule(CocoLayout, SplitDataModule):
    """COCO-captions data (the embedded shapes scenes when ``root`` is unset).

    The tokenizer is trained from the training captions unless the model brings its own
    (a checkpoint's vocabulary always wins: token ids must mean what they meant in training).

    Args:
        root: dataset root (``ROOT/<split>/``, ``ROOT/annotations/captions_<split>.json``);
            the base of relative ``layout.*_images`` / ``layout.*_annotations`` paths.
        synthetic: parameters of the embedded scenes when ``root`` is ``None``.
        cache_dir: where the embedded data is generated.
        layout: split names, each split's caption file and images folder when not the layout's,
            the image size limit and symbolic links (:class:`~vision_attn.data.layout.SplitLayout`).
        batching: the training batch (fixed, or ``auto``: sized from the training set), the
            evaluation batch and the loader processes (:class:`~vision_attn.data.loading.Batching`;
            default batch 32, ``auto`` with at least 100 steps per epoch in 8..64).
        augment: training augmentation preset (``none``, ``small``, ``finetune``; never flips).
        captions: the captions' longest length, the vocabulary and the captions per training
            image (:class:`CaptionOptions`).
    """

    annotation_kind = "captions"
    legacy_arguments = {**SPLIT_LAYOUT_LEGACY, **BATCHING_LEGACY,
                        **{k: f"captions.{k}" for k in ("max_length", "min_word_freq", "max_vocab")},
                        "captions_per_image": "captions.per_image"}

    def __init__(
        self,
        root: str | None = None,
        synthetic: SceneSetConfig | None = None,
        cache_dir: str | None = None,
        layout: SplitLayout = CAPTIONING_LAYOUT,
        batching: Batching = CAPTIONING_BATCHING,
        augment: AugmentPreset = "none",
        captions: CaptionOptions = CAPTIONS,
    ) -> None:
        super().__init__()
        self.captions_per_image = captions.per_image
        self._init_layout(root, synthetic, cache_dir, "a COCO-captions folder", layout)
        self._init_batching(batching)
        self.augment, self.captions = augment, captions
        self.max_length, self.min_word_freq, self.max_vocab = (captions.max_length, captions.min_word_freq,
                                                               captions.max_vocab)
        self.preprocess: dict[str, Any] | None = None
        self._tokenizer: WordTokenizer | None = None
        self._train_captions: tuple[list[dict], dict[int, list[str]]] | None = None
        self.datasets: dict[str, CocoCaptions] = {}

    @property
    def tokenizer(self) -> WordTokenizer:
        """The model's tokenizer once set; else trained from the training captions (once)."""
        if self._tokenizer is None:
            self._train_captions = self._train_captions or read_captions(
                self.root, self.train_split, self.follow_symlinks, True, *self.split_paths(self.train_split))
            _, captions = self._train_captions
            self._tokenizer = WordTokenizer.train((c for caps in captions.values() for c in caps),
                                                  self.min_word_freq, self.max_vocab)
            log.info("caption vocabulary: %d words from %s", len(self._tokenizer) - 4, self.train_split)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: WordTokenizer) -> None:
        self._tokenizer = value
        for ds in self.datasets.values():
            ds.tokenizer = value

    def dataset(self, split: str, train: bool = False) -> CocoCaptions:
        pre = model_preprocess(self)
        tf = build_train_transform(pre, self.augment, hflip=False) if train else build_eval_transform(whole_image(pre))
        tokenizer, parsed = self.tokenizer, None
        if split == self.train_split:  # read once for the tokenizer; handed over, then freed
            parsed, self._train_captions = self._train_captions, None
        # training skips unreadable or refused files; evaluation stops at the first
        images_dir, ann_file = self.split_paths(split)
        return CocoCaptions(self.root, split, tf, tokenizer, "random" if train else "first", self.max_length,
                            self.max_pixels, parsed, self.follow_symlinks, skip_unreadable=train,
                            images_dir=images_dir, ann_file=ann_file,
                            captions_per_item=self.captions_per_image if train else 1)

    def collate_fn(self):
        return _Collate(self.tokenizer.pad_id)

    def train_references(self) -> list[list[str]]:
        """Every reference caption of the training split, normalised
        (:func:`~vision_attn.data.tokenizer.normalize_caption`), per dataset index: the third
        element of a training item indexes this list. Self-critical training scores its samples
        against them and takes CIDEr-D's document frequencies from them; every process reads
        the whole split, so under DDP they are the same everywhere."""
        dataset = self.datasets.get("train")
        if dataset is None:
            raise DataError("the training split is not set up yet: call setup('fit') first "
                            "(self-critical training reads its references when training starts)")
        return [[normalize_caption(c) for c in refs] for refs in dataset.references]
