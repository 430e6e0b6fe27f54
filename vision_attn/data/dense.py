"""Denser training images for a DETR: mosaic and copy-paste (dense one-to-one matching).

A DETR matches each object to one query, so an image with two objects trains two queries and
leaves the rest as background. DEIM (Huang et al. 2025, "DEIM: DETR with Improved Matching for
Fast Convergence") raises the number of positives without extra heads by raising the number of
objects per training image: mosaic (four images in one, as YOLOv4, Bochkovskiy et al. 2020, does)
during most of the schedule, and plain images for the last epochs so that the model ends on the
statistics of the data it will see. Copy-paste (Ghiasi et al. 2021, "Simple Copy-Paste") adds
objects cut from other training images.

How a mosaic is made (:func:`mosaic`): the four images are resized to the model's input size
``(h, w)`` and laid out around a centre drawn in the middle half of a canvas of ``scale`` times
that size: the first image up and left of the centre (its bottom-right corner at the centre), the
second up and right, the third down and left, the fourth down and right, each cut at the canvas'
edge (what no image covers is black). With ``scale`` 1 every object keeps its size and a corner of
each image shows (YOLOv4's mosaic); with ``scale`` 2 each image can show whole, and the training
crop that resizes the canvas to the input size about halves the objects (DEIM's, whose tiles are
half the input). The boxes are shifted and cut at the canvas' edge; an object of which less than
``min_visible`` of the box's area stays in view is dropped (its visible part stays in the image as
background, as in YOLO's mosaic, whose threshold is 0.1). Where the annotation file gives the
objects a ``segmentation`` (``--data.mosaic.masks``, on by default), the share in view is that of
the mask's pixels and the box is the tight box of the visible ones. The canvas then goes through the usual
training transform (flip, random resized crop to the input size).

How objects are pasted (:func:`copy_paste`): each of up to ``objects`` boxes, one from each of
as many other training images, is cut out and pasted at its own size at a random place of the
image where it overlaps no box already there (up to 10 places tried; an object that fits nowhere
is left out), with its box and category. Where the annotation file gives the object a
``segmentation`` (``--data.copy_paste.masks``, on by default), only the object's own pixels are
pasted and its box is the tight box of those pixels, as Simple Copy-Paste does; without one, the
box's pixels, background included.

Switched on by ``--data.mosaic.prob`` / ``--data.copy_paste.prob`` (the share of training
images that get one) and off for the last ``off_fraction`` of the epochs by :class:`DenseSchedule`
(a callback of the detection task). Training only: evaluation never sees either. Detection data
in the ``square`` resize mode (``aspect`` batches images of different shapes, which a mosaic of
the input size would not keep).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from lightning.pytorch.callbacks import Callback

from vision_attn.boxes import box_area
from vision_attn.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["CopyPasteConfig", "DenseAugment", "DenseSchedule", "MosaicConfig", "copy_paste", "mosaic",
           "scheduled_epochs"]

Item = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(uint8 image [3, H, W], XYXY boxes [n, 4] in its pixels, labels [n])``."""


@dataclass(frozen=True)
class MosaicConfig:
    """Mosaic augmentation of detection training images (``--data.mosaic.*``; see
    :mod:`vision_attn.data.dense`).

    Attributes:
        prob: the share of training images made as a mosaic of four (``0``: off).
        off_fraction: the last share of the epochs trained on plain images (DEIM's schedule).
        min_visible: an object is kept when at least this share of its box's area is left in
            the mosaic.
        scale: the mosaic's side in input sizes, 1 to 2, before the training crop resizes it to
            the input size: ``1`` keeps the objects' size and shows a corner of each image
            (YOLOv4's); ``2`` can show each image whole at about half its size, four times the
            objects per training image (DEIM's dense scenes).
        masks: where the annotation file gives objects a ``segmentation``, measure what stays in
            view on the mask and box the visible pixels tightly (else the box, cut).
    """

    prob: float = 0.0
    off_fraction: float = 0.1
    min_visible: float = 0.25
    scale: float = 2.0
    masks: bool = True

    def __post_init__(self) -> None:
        _check_shares("mosaic", prob=self.prob, off_fraction=self.off_fraction, min_visible=self.min_visible)
        if not (isinstance(self.scale, int | float) and 1.0 <= float(self.scale) <= 2.0):
            raise ConfigError(f"--data.mosaic.scale must be a number in [1, 2], got {self.scale!r}")
        _check_flag("mosaic", self.masks)

    @property
    def enabled(self) -> bool:
        return self.prob > 0.0


@dataclass(frozen=True)
class CopyPasteConfig:
    """Objects of other training images pasted into detection training images
    (``--data.copy_paste.*``; see :mod:`vision_attn.data.dense`).

    Attributes:
        prob: the share of training images that get pasted objects (``0``: off).
        objects: the most objects pasted into one image (one from each of as many images).
        off_fraction: the last share of the epochs trained without pasting.
        masks: paste an object's segmentation mask (its own pixels) where the annotation file
            has one, else its box's pixels.
    """

    prob: float = 0.0
    objects: int = 3
    off_fraction: float = 0.1
    masks: bool = True

    def __post_init__(self) -> None:
        _check_shares("copy_paste", prob=self.prob, off_fraction=self.off_fraction)
        if not (isinstance(self.objects, int) and not isinstance(self.objects, bool) and self.objects >= 1):
            raise ConfigError(f"--data.copy_paste.objects must be a whole number >= 1, got {self.objects!r}")
        _check_flag("copy_paste", self.masks)

    @property
    def enabled(self) -> bool:
        return self.prob > 0.0


def _check_flag(group: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"--data.{group}.masks must be true or false, got {value!r}")


def _check_shares(group: str, **values: float) -> None:
    for key, value in values.items():
        if not (isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0):
            raise ConfigError(f"--data.{group}.{key} must be a number in [0, 1], got {value!r}")


def scheduled_epochs(max_epochs: int, off_fraction: float) -> int:
    """How many of ``max_epochs`` epochs (the first ones) train with an augmentation that is off
    for the last ``off_fraction`` of them."""
    return max(0, max_epochs - math.ceil(max_epochs * off_fraction))


def mosaic(images: Sequence[torch.Tensor], boxes: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
           size: tuple[int, int], centre: tuple[int, int], min_visible: float = 0.25, scale: float = 1.0,
           masks: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four images in one (see the module docstring).

    Args:
        images: four ``uint8 [3, H_i, W_i]`` images.
        boxes: per image ``[n_i, 4]`` ``XYXY`` boxes in its pixels.
        labels: per image ``[n_i]`` labels.
        size: ``(h, w)`` each image is resized to (the model's input size).
        centre: ``(cy, cx)`` where the four images meet, inside the mosaic.
        min_visible: the least share of a box's area (at the input size) left in the mosaic for
            the object to be kept.
        scale: the mosaic's side in input sizes (``1`` to ``2``): ``round(scale * h)`` by
            ``round(scale * w)``; what no image covers is black.
        masks: per image ``bool [n_i, H_i, W_i]`` its objects' masks, or ``None``: an object with
            a mask is kept when ``min_visible`` of its mask's pixels stay in view, and its box is
            the tight box of those pixels (an object whose mask is empty falls back to its box).

    Returns:
        ``(image uint8 [3, H, W], boxes [n, 4] XYXY in its pixels, labels [n])``.
    """
    if not (len(images) == len(boxes) == len(labels) == 4):
        raise ValueError(f"a mosaic is made of 4 images, got {len(images)} images, {len(boxes)} box sets "
                         f"and {len(labels)} label sets")
    h, w = int(size[0]), int(size[1])
    ch, cw = round(scale * h), round(scale * w)
    cy, cx = int(centre[0]), int(centre[1])
    if not (0 < cy < ch and 0 < cx < cw):
        raise ValueError(f"the mosaic's centre {centre} is not inside its size {(ch, cw)}")
    out = torch.zeros(3, ch, cw, dtype=torch.uint8)
    corners = [(cy - h, cx - w), (cy - h, cx), (cy, cx - w), (cy, cx)]  # each image's top-left in the mosaic
    kept_boxes, kept_labels = [], []
    for n, (image, b, lab, (top, left)) in enumerate(zip(images, boxes, labels, corners, strict=True)):
        ih, iw = image.shape[-2:]
        y0, y1, x0, x1 = max(top, 0), min(top + h, ch), max(left, 0), min(left + w, cw)  # the part in view
        resized = TF.resize_image(image, [h, w], antialias=True)
        out[:, y0:y1, x0:x1] = resized[:, y0 - top : y1 - top, x0 - left : x1 - left]
        b = b.reshape(-1, 4).float() * torch.tensor([w / iw, h / ih, w / iw, h / ih])
        area = box_area(b)
        moved = b + torch.tensor([left, top, left, top], dtype=torch.float32)
        cut = torch.stack([moved[:, 0].clamp(x0, x1), moved[:, 1].clamp(y0, y1),
                           moved[:, 2].clamp(x0, x1), moved[:, 3].clamp(y0, y1)], dim=1)
        cut_w, cut_h = cut[:, 2] - cut[:, 0], cut[:, 3] - cut[:, 1]
        keep = (cut_w >= 1) & (cut_h >= 1) & (cut_w * cut_h >= min_visible * area.clamp(min=1e-9))
        m = masks[n] if masks is not None else None
        if m is not None and len(m) == len(b) and tuple(m.shape[-2:]) == (ih, iw):
            cut, keep = _visible_masks(m, (h, w), (y0 - top, y1 - top, x0 - left, x1 - left), (y0, x0),
                                       min_visible, cut, keep)
        kept_boxes.append(cut[keep])
        kept_labels.append(lab.reshape(-1)[keep])
    return out, torch.cat(kept_boxes), torch.cat(kept_labels)


def _visible_masks(masks: torch.Tensor, size: tuple[int, int], view: tuple[int, int, int, int],
                   origin: tuple[int, int], min_visible: float, boxes: torch.Tensor, keep: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mosaic boxes and the kept flags of one tile's objects from their masks: ``masks``
    ``bool [n, H, W]`` resized to the tile ``size`` (nearest), cut to the tile's rows and columns
    in view ``view = (r0, r1, c0, c1)``, which lie at ``origin = (y, x)`` of the mosaic. An object
    whose mask has no pixel at the tile's size keeps its box-based ``boxes`` / ``keep``."""
    resized = F.interpolate(masks[:, None].float(), size=size, mode="nearest")[:, 0] > 0.5
    r0, r1, c0, c1 = view
    seen = resized[:, r0:r1, c0:c1]
    total, shown = resized.flatten(1).sum(1), seen.flatten(1).sum(1)
    boxes, keep = boxes.clone(), keep.clone()
    for i in range(len(masks)):
        if int(total[i]) == 0:
            continue
        keep[i] = bool(shown[i] >= 1 and shown[i] >= min_visible * total[i])
        if keep[i]:
            ys, xs = seen[i].any(1).nonzero()[:, 0], seen[i].any(0).nonzero()[:, 0]
            boxes[i] = torch.tensor([origin[1] + int(xs[0]), origin[0] + int(ys[0]),
                                     origin[1] + int(xs[-1]) + 1, origin[0] + int(ys[-1]) + 1], dtype=boxes.dtype)
    return boxes, keep


def draw_centre(size: tuple[int, int], generator: torch.Generator | None = None, scale: float = 1.0
                ) -> tuple[int, int]:
    """A centre drawn uniformly in the middle half of a mosaic of ``scale`` times ``size``
    (rows ``[H/4, 3H/4]``, ``H = round(scale * h)``)."""
    h, w = round(scale * int(size[0])), round(scale * int(size[1]))
    ys = torch.randint(max(1, h // 4), max(2, (3 * h) // 4 + 1), (1,), generator=generator)
    xs = torch.randint(max(1, w // 4), max(2, (3 * w) // 4 + 1), (1,), generator=generator)
    return min(int(ys), h - 1), min(int(xs), w - 1)


MaskOf = Callable[[int, tuple[int, int]], "torch.Tensor | None"]
"""The mask of object ``k`` of a donor read at ``size`` ``(H, W)``: ``bool [H, W]`` in the donor's
pixels, or ``None`` (also for a mask declared at another size: it is not decoded)."""


def copy_paste(image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, donors: Sequence[Item],
               generator: torch.Generator | None = None, tries: int = 10,
               masks: Sequence[MaskOf | None] | None = None) -> Item:
    """Paste one object of each donor into ``image`` (see the module docstring).

    Args:
        image: ``uint8 [3, H, W]``; ``boxes`` its ``[n, 4]`` XYXY boxes, ``labels`` ``[n]``.
        donors: ``(image, boxes, labels)`` of other images; a random box of each is pasted (a
            donor without boxes gives none).
        generator: the random draws (the box of each donor, the places).
        tries: places tried per object before it is left out.
        masks: per donor, its objects' masks (:data:`MaskOf`) or ``None``: an object with a mask
            that covers part of its box pastes only those pixels, with their tight box.

    Returns:
        the image with the objects pasted, its boxes and labels (the pasted ones appended).
    """
    out = image.clone()
    h, w = out.shape[-2:]
    boxes, labels = boxes.reshape(-1, 4).float(), labels.reshape(-1)
    new_boxes, new_labels = [boxes], [labels]
    taken = boxes
    for n, (d_image, d_boxes, d_labels) in enumerate(donors):
        d_boxes = d_boxes.reshape(-1, 4)
        if len(d_boxes) == 0:
            continue
        k = int(torch.randint(len(d_boxes), (1,), generator=generator))
        dh, dw = d_image.shape[-2:]
        x0, y0 = int(max(0.0, math.floor(float(d_boxes[k, 0])))), int(max(0.0, math.floor(float(d_boxes[k, 1]))))
        x1, y1 = int(min(dw, math.ceil(float(d_boxes[k, 2])))), int(min(dh, math.ceil(float(d_boxes[k, 3]))))
        bw, bh = x1 - x0, y1 - y0
        if bw < 1 or bh < 1 or bw > w or bh > h:
            continue
        cut = _cut_mask(masks[n] if masks else None, k, d_image.shape[-2:], (y0, y1, x0, x1))
        for _ in range(tries):
            x = int(torch.randint(w - bw + 1, (1,), generator=generator))
            y = int(torch.randint(h - bh + 1, (1,), generator=generator))
            placed = torch.tensor([[x, y, x + bw, y + bh]], dtype=torch.float32)
            across = torch.minimum(taken[:, 2], placed[0, 2]) - torch.maximum(taken[:, 0], placed[0, 0])
            down = torch.minimum(taken[:, 3], placed[0, 3]) - torch.maximum(taken[:, 1], placed[0, 1])
            if bool(((across > 0) & (down > 0)).any()):  # overlaps a box already there
                continue
            if cut is None:
                out[:, y : y + bh, x : x + bw] = d_image[:, y0:y1, x0:x1]
            else:  # the object's own pixels, boxed tightly
                region = out[:, y : y + bh, x : x + bw]
                out[:, y : y + bh, x : x + bw] = torch.where(cut, d_image[:, y0:y1, x0:x1], region)
                rows, cols = cut.any(1).nonzero()[:, 0], cut.any(0).nonzero()[:, 0]
                placed = torch.tensor([[x + int(cols[0]), y + int(rows[0]), x + int(cols[-1]) + 1,
                                        y + int(rows[-1]) + 1]], dtype=torch.float32)
            taken = torch.cat([taken, placed])
            new_boxes.append(placed)
            new_labels.append(d_labels.reshape(-1)[k : k + 1])
            break
    return out, torch.cat(new_boxes), torch.cat(new_labels)


def _cut_mask(mask_of: MaskOf | None, k: int, size: tuple[int, int], crop: tuple[int, int, int, int]
                 ) -> torch.Tensor | None:
    """Object ``k``'s mask inside its cut-out ``crop = (y0, y1, x0, x1)``, or ``None`` (no mask,
    a mask of another size than the image's, or one that leaves the box empty)."""
    mask = mask_of(k, (int(size[0]), int(size[1]))) if mask_of is not None else None
    if mask is None or tuple(mask.shape) != tuple(size):
        return None
    y0, y1, x0, x1 = crop
    cut = mask[y0:y1, x0:x1].bool()
    return cut if bool(cut.any()) else None


def _stacked_masks(mask_of: Callable[[int, int, tuple[int, int]], torch.Tensor | None], index: int, n: int,
                   size: tuple[int, int]) -> torch.Tensor | None:
    """``bool [n, H, W]``: the masks of image ``index``'s ``n`` objects (read at ``size``), or ``None`` unless all
    have one of the same size."""
    masks = [mask_of(index, k, size) for k in range(n)]
    if n == 0 or any(m is None or m.shape != masks[0].shape for m in masks):
        return None
    return torch.stack(masks)


class DenseAugment:
    """A detection training dataset's mosaic and copy-paste (:meth:`__call__` on an item as
    read), each made with its probability while its switch (a shared one-element tensor the
    loader processes read, set by :class:`DenseSchedule`) is on.

    Args:
        size: the model's input size ``(h, w)`` (a mosaic's tiles).
        mosaic, copy_paste: the settings (either may be off).
        switches: ``{"mosaic": tensor, "copy_paste": tensor}``.
    """

    def __init__(self, size: tuple[int, int], mosaic: MosaicConfig, copy_paste: CopyPasteConfig,
                 switches: dict[str, torch.Tensor]) -> None:
        self.size = (int(size[0]), int(size[1]))
        self.mosaic, self.copy_paste, self.switches = mosaic, copy_paste, switches

    def _draw(self, name: str, config: MosaicConfig | CopyPasteConfig) -> bool:
        return config.enabled and bool(self.switches[name][0]) and float(torch.rand(1)) < config.prob

    def __call__(self, item: Item, read: Callable[[int], Item], count: int,
                 mask_of: Callable[[int, int, tuple[int, int]], torch.Tensor | None] | None = None,
                 index: int | None = None) -> Item:
        """``item`` (image ``index`` as read) made a mosaic and / or given pasted objects; ``read(i)``
        reads image ``i`` of the ``count`` images of the split (the other tiles, the donors);
        ``mask_of(i, k, size)``: the mask of object ``k`` of image ``i`` read at ``size`` ``(H, W)``,
        or ``None`` (one declared at another size is not decoded)."""
        if self._draw("mosaic", self.mosaic):
            others = [int(i) for i in torch.randint(count, (3,))]
            parts = [item] + [read(i) for i in others]
            masks = None
            if self.mosaic.masks and mask_of is not None and index is not None:
                masks = [_stacked_masks(mask_of, i, len(p[1]), (int(p[0].shape[-2]), int(p[0].shape[-1])))
                         for i, p in zip([index, *others], parts, strict=True)]
            item = mosaic(*zip(*parts, strict=True), self.size, draw_centre(self.size, scale=self.mosaic.scale),
                          self.mosaic.min_visible, self.mosaic.scale, masks)
        if self._draw("copy_paste", self.copy_paste):
            picked = [int(i) for i in torch.randint(count, (self.copy_paste.objects,))]
            masks = None
            if self.copy_paste.masks and mask_of is not None:
                masks = [lambda k, size, i=i: mask_of(i, k, size) for i in picked]
            item = copy_paste(*item, [read(i) for i in picked], masks=masks)
        return item


class DenseSchedule(Callback):
    """Turns the datamodule's mosaics and pasting off for the last ``off_fraction`` of the epochs.

    Reads the datamodule's ``mosaic`` / ``copy_paste`` settings and their ``dense_switches``
    (:class:`DenseAugment`); does nothing for a datamodule without them or with both off. The
    switches are set before each epoch's loader starts (at the start of training and at the end
    of every epoch, for the next one).
    """

    def on_train_start(self, trainer, pl_module) -> None:
        self._set(trainer, trainer.current_epoch)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._set(trainer, trainer.current_epoch + 1)

    @staticmethod
    def _set(trainer, epoch: int) -> None:
        dm = getattr(trainer, "datamodule", None)
        switches = getattr(dm, "dense_switches", None) or {}
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        for name, switch in switches.items():
            config = getattr(dm, name, None)
            if not isinstance(config, MosaicConfig | CopyPasteConfig) or not config.enabled:
                continue
            on = max_epochs is None or epoch < scheduled_epochs(max_epochs, config.off_fraction)
            if bool(switch[0]) != on:
                log.info("%s %s from epoch %d", name.replace("_", "-"), "on" if on else "off to the end", epoch)
            switch[0] = int(on)
