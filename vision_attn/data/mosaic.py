"""Mosaic: four training images in one, for more objects per image (dense one-to-one matching).

A DETR matches each object to one query, so an image with two objects trains two queries and
leaves the rest as background. DEIM (Huang et al. 2025, "DEIM: DETR with Improved Matching for
Fast Convergence") raises the number of positives without extra heads by raising the number of
objects per training image: mosaic (four images in one, as YOLOv4, Bochkovskiy et al. 2020, does)
during most of the schedule, and plain images for the last epochs so that the model ends on the
statistics of the data it will see.

How a mosaic is made (:func:`mosaic`): the four images are resized to the model's input size
``(h, w)`` and laid out around a centre drawn in the middle half of a canvas of ``scale`` times
that size: the first image up and left of the centre (its bottom-right corner at the centre), the
second up and right, the third down and left, the fourth down and right, each cut at the canvas'
edge (what no image covers is black). With ``scale`` 1 every object keeps its size and a corner of
each image shows (YOLOv4's mosaic); with ``scale`` 2 each image can show whole, and the training
crop that resizes the canvas to the input size about halves the objects (DEIM's, whose tiles are
half the input). The boxes are shifted and cut at the canvas' edge; an object of which less than
``min_visible`` of the box's area stays in view is dropped (its visible part stays in the image as
background, as in YOLO's mosaic, whose threshold is 0.1). The canvas then goes through the usual
training transform (flip, random resized crop to the input size).

Switched on by ``--data.mosaic.prob`` (the share of training images made as a mosaic) and off
for the last ``--data.mosaic.off_fraction`` of the epochs by :class:`MosaicSchedule` (a callback
of the detection task). Training only: evaluation never sees a mosaic. Detection data in the
``square`` resize mode (``aspect`` batches images of different shapes, which a mosaic of the
input size would not keep).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torchvision.transforms.v2.functional as TF
from lightning.pytorch.callbacks import Callback

from vision_attn.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["MosaicConfig", "MosaicSchedule", "mosaic", "mosaic_epochs"]


@dataclass(frozen=True)
class MosaicConfig:
    """Mosaic augmentation of detection training images (``--data.mosaic.*``; see
    :mod:`vision_attn.data.mosaic`).

    Attributes:
        prob: the share of training images made as a mosaic of four (``0``: off).
        off_fraction: the last share of the epochs trained on plain images (DEIM's schedule).
        min_visible: an object is kept when at least this share of its box's area is left in
            the mosaic.
        scale: the mosaic's side in input sizes, 1 to 2, before the training crop resizes it to
            the input size: ``1`` keeps the objects' size and shows a corner of each image
            (YOLOv4's); ``2`` can show each image whole at about half its size, four times the
            objects per training image (DEIM's dense scenes).
    """

    prob: float = 0.0
    off_fraction: float = 0.1
    min_visible: float = 0.25
    scale: float = 2.0

    def __post_init__(self) -> None:
        for key, value in (("prob", self.prob), ("off_fraction", self.off_fraction),
                           ("min_visible", self.min_visible)):
            if not (isinstance(value, int | float) and 0.0 <= float(value) <= 1.0):
                raise ConfigError(f"--data.mosaic.{key} must be a number in [0, 1], got {value!r}")
        if not (isinstance(self.scale, int | float) and 1.0 <= float(self.scale) <= 2.0):
            raise ConfigError(f"--data.mosaic.scale must be a number in [1, 2], got {self.scale!r}")

    @property
    def enabled(self) -> bool:
        return self.prob > 0.0


def mosaic_epochs(max_epochs: int, off_fraction: float) -> int:
    """How many of ``max_epochs`` epochs (the first ones) train with mosaics."""
    return max(0, max_epochs - math.ceil(max_epochs * off_fraction))


def mosaic(images: Sequence[torch.Tensor], boxes: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
           size: tuple[int, int], centre: tuple[int, int], min_visible: float = 0.25, scale: float = 1.0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    for image, b, lab, (top, left) in zip(images, boxes, labels, corners, strict=True):
        ih, iw = image.shape[-2:]
        y0, y1, x0, x1 = max(top, 0), min(top + h, ch), max(left, 0), min(left + w, cw)  # the part in view
        resized = TF.resize_image(image, [h, w], antialias=True)
        out[:, y0:y1, x0:x1] = resized[:, y0 - top : y1 - top, x0 - left : x1 - left]
        b = b.reshape(-1, 4).float() * torch.tensor([w / iw, h / ih, w / iw, h / ih])
        area = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
        moved = b + torch.tensor([left, top, left, top], dtype=torch.float32)
        cut = torch.stack([moved[:, 0].clamp(x0, x1), moved[:, 1].clamp(y0, y1),
                           moved[:, 2].clamp(x0, x1), moved[:, 3].clamp(y0, y1)], dim=1)
        cut_w, cut_h = cut[:, 2] - cut[:, 0], cut[:, 3] - cut[:, 1]
        keep = (cut_w >= 1) & (cut_h >= 1) & (cut_w * cut_h >= min_visible * area.clamp(min=1e-9))
        kept_boxes.append(cut[keep])
        kept_labels.append(lab.reshape(-1)[keep])
    return out, torch.cat(kept_boxes), torch.cat(kept_labels)


def draw_centre(size: tuple[int, int], generator: torch.Generator | None = None, scale: float = 1.0
                ) -> tuple[int, int]:
    """A centre drawn uniformly in the middle half of a mosaic of ``scale`` times ``size``
    (rows ``[H/4, 3H/4]``, ``H = round(scale * h)``)."""
    h, w = round(scale * int(size[0])), round(scale * int(size[1]))
    ys = torch.randint(max(1, h // 4), max(2, (3 * h) // 4 + 1), (1,), generator=generator)
    xs = torch.randint(max(1, w // 4), max(2, (3 * w) // 4 + 1), (1,), generator=generator)
    return min(int(ys), h - 1), min(int(xs), w - 1)


class MosaicSchedule(Callback):
    """Turns the datamodule's mosaics off for the last ``off_fraction`` of the epochs.

    Reads the datamodule's ``mosaic`` (:class:`MosaicConfig`) and ``mosaic_on`` (a shared
    one-element tensor the training datasets of every loader process read); does nothing for a
    datamodule without them or with mosaics off. The switch is set before each epoch's loader
    starts (at the start of training and at the end of every epoch, for the next one).
    """

    def on_train_start(self, trainer, pl_module) -> None:
        self._set(trainer, trainer.current_epoch)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._set(trainer, trainer.current_epoch + 1)

    @staticmethod
    def _set(trainer, epoch: int) -> None:
        dm = getattr(trainer, "datamodule", None)
        config, switch = getattr(dm, "mosaic", None), getattr(dm, "mosaic_on", None)
        if not isinstance(config, MosaicConfig) or not config.enabled or switch is None:
            return
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        on = max_epochs is None or epoch < mosaic_epochs(max_epochs, config.off_fraction)
        if bool(switch[0]) != on:
            log.info("mosaic %s from epoch %d", "on" if on else "off (plain images to the end)", epoch)
        switch[0] = int(on)
