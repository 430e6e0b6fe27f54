"""Image transforms built from the encoder's preprocessing (timm data config).

The preprocessing that a model was trained with (input size, mean, std, interpolation, crop
fraction, crop mode) belongs to the model and travels in its checkpoint. These builders turn that
dict into pipelines, ``uint8 [H, W, 3]`` numpy (or a PIL image) in, normalised ``float32
[3, H, W]`` tensor out.

Evaluation geometry is timm's own (``timm.data.create_transform(is_training=False)``, applied
to the PIL image, so the tensor equals timm's to float rounding), chosen by ``crop_mode``:

- ``center`` (timm's default): resize the *shorter side* to ``floor(size / crop_pct)`` keeping
  the aspect ratio, then centre-crop ``size``: the borders of the longer side are cut off, even
  at ``crop_pct = 1``;
- ``squash``: resize *both sides* to ``floor(size / crop_pct)`` (aspect ratio not kept), then
  centre-crop; with ``crop_pct = 1`` the whole image, resized to the input size;
- ``border``: resize the *longer side*, pad with the mean colour, then centre-crop.

A config without ``crop_mode`` (checkpoints written before it was stored) means ``squash``: the
geometry those models were trained and evaluated with. Encoders built now store timm's
``crop_mode`` (``center`` for nearly every model). Tasks that must see the whole image
(detection, captioning: a crop would cut objects off, and boxes are mapped back to the original
pixels axis by axis) use :func:`whole_image`: ``crop_pct = 1`` and ``squash``.

Augmentation presets (training; ``small`` and ``none`` resize the whole image to the input
size, like ``squash``):

- ``none``: :func:`whole_image` evaluation geometry, no augmentation;
- ``small``: for small images trained from scratch (CIFAR-style): reflect-pad + random crop,
  horizontal flip, light colour jitter; optionally RandAugment after the flip
  (``randaugment_ops > 0``, off by default);
- ``finetune``: for fine-tuning pretrained models at 224 px: random-resized crop, flip,
  RandAugment (timm/DeiT style; 2 operations unless ``randaugment_ops`` says otherwise).

Detection on real datasets (:class:`AspectResize`, DETR's recipe): resize keeping the aspect
ratio, the shorter side to a size drawn from a list (training: DETR's multi-scale sizes) and
the longer side at most ``max_size``; the batch is then padded (see
:func:`vision_attn.data.detection.detection_collate`), not squashed to a square.

RandAugment is torchvision's (``T.RandAugment(num_ops, magnitude)``, 31 magnitude bins, on the
``uint8`` image; its translations scale with the image size, so it suits 32 px images too).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import timm.data
import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

__all__ = [
    "AspectResize",
    "AugmentPreset",
    "DETR_EVAL_SIZE",
    "DETR_MAX_SIZE",
    "DETR_TRAIN_SIZES",
    "CROP_MODES",
    "DEFAULT_PREPROCESS",
    "RANDAUGMENT_OPS",
    "SmallAugment",
    "build_display_transform",
    "build_eval_transform",
    "build_train_transform",
    "aspect_resize_size",
    "model_preprocess",
    "whole_image",
]

AugmentPreset = Literal["none", "small", "finetune"]
CROP_MODES = ("center", "squash", "border")
LEGACY_CROP_MODE = "squash"  # the geometry of configs that do not name one (see the module docstring)

log = logging.getLogger(__name__)

DEFAULT_PREPROCESS: dict[str, Any] = {
    "input_size": (3, 224, 224),
    "interpolation": "bicubic",
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "crop_pct": 0.9,
    "crop_mode": "center",
}


DETR_TRAIN_SIZES = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)
"""DETR's multi-scale training sizes of the shorter side (Carion et al. 2020)."""
DETR_EVAL_SIZE = 800
"""DETR's evaluation size of the shorter side."""
DETR_MAX_SIZE = 1333
"""DETR's cap on the longer side."""


def aspect_resize_size(height: int, width: int, short: int, max_size: int | None = None) -> tuple[int, int]:
    """``(new_height, new_width)`` keeping the aspect ratio: the shorter side ``short``, unless
    the longer side would then exceed ``max_size``, in which case the longer side is
    ``max_size`` (both sides scaled by one factor, rounded to the nearest pixel, at least 1).

    E.g. ``480 x 640`` with ``short=800, max_size=1333`` -> ``800 x 1067``; ``400 x 1200`` ->
    ``444 x 1333`` (the cap wins: ``800 / 400 * 1200 = 2400 > 1333``).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if short <= 0 or (max_size is not None and max_size <= 0):
        raise ValueError(f"resize sizes must be positive, got short side {short}, max_size {max_size}")
    scale = short / min(height, width)
    if max_size is not None:
        scale = min(scale, max_size / max(height, width))
    return max(1, round(height * scale)), max(1, round(width * scale))


class AspectResize:
    """Paired ``(image, boxes, labels)`` transform: resize keeping the aspect ratio
    (:func:`aspect_resize_size`), the shorter side drawn uniformly from ``sizes`` (torch's
    generator, so DataLoader workers are seeded), the longer side capped at ``max_size``.
    Boxes (torchvision ``BoundingBoxes``) are resized with the image."""

    def __init__(self, sizes: int | list[int] | tuple[int, ...], max_size: int | None = DETR_MAX_SIZE,
                 interpolation: InterpolationMode = InterpolationMode.BILINEAR) -> None:
        self.sizes = (int(sizes),) if isinstance(sizes, int) else tuple(int(s) for s in sizes)
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError(f"resize sizes must be positive side lengths, got {sizes!r}")
        if max_size is not None and max_size < max(self.sizes):
            raise ValueError(f"max_size {max_size} is below the largest shorter-side size {max(self.sizes)}")
        self.max_size, self.interpolation = max_size, interpolation

    def __call__(self, image: Tensor, boxes: Any, labels: Any) -> tuple[Tensor, Any, Any]:
        short = self.sizes[int(torch.randint(len(self.sizes), ()))] if len(self.sizes) > 1 else self.sizes[0]
        size = list(aspect_resize_size(int(image.shape[-2]), int(image.shape[-1]), short, self.max_size))
        image = T.functional.resize(image, size, interpolation=self.interpolation, antialias=True)
        return image, T.functional.resize(boxes, size), labels

    def __repr__(self) -> str:
        return f"AspectResize(sizes={self.sizes}, max_size={self.max_size})"


def model_preprocess(datamodule: Any) -> dict[str, Any]:
    """The preprocessing a DataModule must apply: the attached model's ``data_config`` when
    Lightning runs it, else ``datamodule.preprocess`` (set by hand or by ``eval.py``), else the
    ViT default (with a warning)."""
    module = getattr(getattr(datamodule, "trainer", None), "lightning_module", None)
    if module is not None and getattr(module, "data_config", None):
        return module.data_config
    if getattr(datamodule, "preprocess", None) is not None:
        return datamodule.preprocess
    log.warning("no model preprocessing available; using the ViT default %s", DEFAULT_PREPROCESS)
    return DEFAULT_PREPROCESS


def whole_image(pre: dict[str, Any]) -> dict[str, Any]:
    """``pre`` for tasks that must see the whole image: both sides resized to the input size
    (``crop_pct = 1``, ``crop_mode = squash``), so nothing is cut off and a box maps back to
    the original pixels by scaling each axis."""
    return {**pre, "crop_pct": 1.0, "crop_mode": "squash"}


def _interp(name: str) -> InterpolationMode:
    try:
        return InterpolationMode(name)
    except ValueError:
        return InterpolationMode.BICUBIC


def _size(pre: dict[str, Any]) -> tuple[int, int]:
    _, h, w = pre["input_size"]
    return int(h), int(w)


def _crop_mode(pre: dict[str, Any]) -> str:
    mode = pre.get("crop_mode") or LEGACY_CROP_MODE
    if mode not in CROP_MODES:
        raise ValueError(f"preprocessing crop_mode must be one of {', '.join(CROP_MODES)}, got {mode!r}")
    return mode


def _to_float(image: Tensor) -> Tensor:
    """uint8 ``[3, H, W]`` -> float32 in ``[0, 1]``, as ``ToTensor`` divides (bit-identical to timm)."""
    return image.to(torch.float32).div(255)


class _ToFloat(torch.nn.Module):
    """uint8 image tensor -> float32 in ``[0, 1]`` (divided by 255, exactly as ``ToTensor``)."""

    def forward(self, image: Tensor) -> Tensor:
        return _to_float(torch.as_tensor(image))


def _tail(pre: dict[str, Any]) -> list:
    return [_ToFloat(), T.Normalize(mean=list(pre["mean"]), std=list(pre["std"]))]


class _ToPIL:
    """uint8 ``[H, W, 3]`` numpy, uint8 ``[3, H, W]`` tensor or a PIL image -> an RGB PIL image."""

    def __call__(self, image: Any) -> Image.Image:
        if isinstance(image, Image.Image):
            return image if image.mode == "RGB" else image.convert("RGB")
        if isinstance(image, Tensor):
            image = image.permute(1, 2, 0).numpy() if image.dim() == 3 else image.numpy()
        array = np.asarray(image)
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
            raise ValueError(f"expected an RGB uint8 image [H, W, 3], got {array.dtype} {array.shape}")
        return Image.fromarray(np.ascontiguousarray(array))


def _eval_geometry(pre: dict[str, Any]) -> T.Compose:
    """Decoded image -> uint8 ``[3, h, w]`` tensor by timm's evaluation resize and crop (on the
    PIL image, as timm does), per ``crop_mode`` (see the module docstring)."""
    h, w = _size(pre)
    timm_geometry = timm.data.create_transform(
        input_size=(3, h, w),
        is_training=False,
        interpolation=str(pre.get("interpolation", "bicubic")),
        mean=tuple(pre["mean"]),
        std=tuple(pre["std"]),
        crop_pct=float(pre.get("crop_pct", 1.0)),
        crop_mode=_crop_mode(pre),
        use_prefetcher=True,  # geometry only: resize, crop, uint8 tensor (no normalisation)
    )
    return T.Compose([_ToPIL(), timm_geometry])


def build_eval_transform(pre: dict[str, Any]) -> T.Compose:
    """The evaluation pipeline: timm's resize and crop for ``crop_mode`` (``center``: shorter side
    to ``size / crop_pct``, then centre-crop ``size``), then ``/ 255`` and normalisation. On the
    same decoded image it gives the tensor of ``timm.data.create_transform(**data_config)``."""
    return T.Compose([_eval_geometry(pre), *_tail(pre)])


def build_display_transform(pre: dict[str, Any]):
    """The evaluation geometry without normalisation: RGB ``uint8 [H, W, 3]`` in and out, so
    saliency maps of the model input can be drawn on exactly the pixels the model saw."""
    geometry = _eval_geometry(pre)

    def display(image):
        return geometry(image).permute(1, 2, 0).contiguous().numpy()

    return display


GREY_WEIGHTS = (0.2989, 0.587, 0.114)
"""torchvision's ``rgb_to_grayscale`` weights (the contrast jitter blends with this mean)."""


class SmallAugment(torch.nn.Module):
    """The ``small`` preset (without RandAugment) in one step, a few times cheaper per image than
    the equivalent chain of torchvision transforms (which cost about as much as the model's own
    step for a small ViT at 32 px on a 2-core machine; figures in the README's performance section).

    Per image: resize to ``size`` (only when the image has another size; torchvision's resize with
    ``interpolation``, antialiased), reflect-pad by ``pad`` and crop ``size`` back at a random
    offset, flip horizontally with probability 0.5 (``hflip``), then brightness and contrast
    factors drawn from ``[0.8, 1.2]`` applied in random order as torchvision's ``ColorJitter``
    (brightness: ``x * b``; contrast: ``c * x + (1 - c) * mean(grey(x))``; clamped to
    ``[0, 1]``), computed on the float image (torchvision's chain rounds to ``uint8`` between
    the two), then normalised. Randomness from torch's generator, so the DataLoader's
    per-worker seeding applies. :meth:`apply` is the deterministic part (tested against
    torchvision's functional ops).
    """

    def __init__(self, size: tuple[int, int], pad: int, hflip: bool, mean, std,
                 interpolation: InterpolationMode = InterpolationMode.BICUBIC, jitter: float = 0.2) -> None:
        super().__init__()
        self.size, self.pad = (int(size[0]), int(size[1])), int(pad)
        self.hflip, self.jitter = bool(hflip), float(jitter)
        self.interpolation = interpolation
        self.register_buffer("mean", torch.tensor([float(v) for v in mean]).view(3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor([float(v) for v in std]).view(3, 1, 1), persistent=False)
        self.register_buffer("grey", torch.tensor(GREY_WEIGHTS).view(3, 1, 1), persistent=False)

    def _uint8(self, image: Any) -> Tensor:
        if isinstance(image, Image.Image):
            image = np.asarray(image.convert("RGB"))
        x = torch.as_tensor(np.ascontiguousarray(image)) if not isinstance(image, Tensor) else image
        if x.dim() == 3 and x.shape[-1] == 3 and x.shape[0] != 3:
            x = x.permute(2, 0, 1)  # [H, W, 3] -> [3, H, W]
        if tuple(x.shape[-2:]) != self.size:
            x = T.functional.resize(x, list(self.size), interpolation=self.interpolation, antialias=True)
        return x

    def apply(self, image: Tensor, top: int, left: int, flip: bool, factors: tuple[float, float],
              order: tuple[int, int]) -> Tensor:
        """uint8 ``[3, h, w]`` (already ``size``) -> normalised float32 with the given crop
        offsets into the padded image, flip, ``(brightness, contrast)`` factors and order
        (``0`` = brightness, ``1`` = contrast)."""
        x = image.to(torch.float32).div(255)
        h, w = self.size
        if self.pad:
            x = torch.nn.functional.pad(x[None], (self.pad,) * 4, mode="reflect")[0]
            x = x[:, top : top + h, left : left + w]
        if flip:
            x = x.flip(-1)
        for k in order:
            if k == 0:
                x = (x * factors[0]).clamp(0, 1)
            else:
                grey_mean = (x * self.grey).sum(0).mean()
                x = (factors[1] * x + (1 - factors[1]) * grey_mean).clamp(0, 1)
        return (x - self.mean) / self.std

    def forward(self, image: Any, boxes: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """The augmented image; with ``boxes`` (``[N, 4]`` normalised ``x0, y0, x1, y1`` of the
        input image) also the boxes moved with the crop and flip, clipped to the output."""
        x = self._uint8(image)
        top, left = (int(v) for v in torch.randint(0, 2 * self.pad + 1, (2,)))
        flip = self.hflip and bool(torch.rand(()) < 0.5)
        lo, hi = 1 - self.jitter, 1 + self.jitter
        factors = tuple(float(v) for v in torch.empty(2).uniform_(lo, hi))
        order = tuple(int(v) for v in torch.randperm(2))
        out = self.apply(x, top, left, flip, factors, order)
        if boxes is None:
            return out
        return out, self.move_boxes(boxes, top, left, flip)

    def move_boxes(self, boxes: Tensor, top: int, left: int, flip: bool) -> Tensor:
        """Normalised ``x0, y0, x1, y1`` boxes through the crop at ``(top, left)`` of the padded
        image and the flip of :meth:`apply` (the resize keeps normalised coordinates)."""
        h, w = self.size
        b = boxes.to(torch.float32).reshape(-1, 4).clone()
        b[:, 0::2] = (b[:, 0::2] * w + self.pad - left) / w
        b[:, 1::2] = (b[:, 1::2] * h + self.pad - top) / h
        if flip:
            b[:, 0::2] = 1 - b[:, [2, 0]]
        return b.clamp(0, 1)

    def extra_repr(self) -> str:
        return f"size={self.size}, pad={self.pad}, hflip={self.hflip}, jitter={self.jitter}"


def box_transform(transform: Any):
    """``fn(image, boxes) -> (tensor, boxes)`` applying ``transform`` to an image and moving
    normalised ``x0, y0, x1, y1`` boxes with it, for the training transforms whose geometry is
    known (``augment`` ``none``: a resize of both sides; ``small`` without RandAugment: the crop
    and flip of :class:`SmallAugment`); ``None`` for any other transform."""
    if getattr(transform, "keeps_normalised_boxes", False):
        return _KeepBoxes(transform)
    steps = getattr(transform, "transforms", None)
    if steps is not None and len(steps) == 1 and isinstance(steps[0], SmallAugment):
        return steps[0]
    return None


class _KeepBoxes:
    """Picklable ``(image, boxes) -> (transform(image), boxes)``."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, image: Any, boxes: Tensor) -> tuple[Tensor, Tensor]:
        return self.transform(image), boxes


RANDAUGMENT_OPS = {"none": 0, "small": 0, "finetune": 2}
"""Each preset's RandAugment operations per image when ``randaugment_ops`` is ``None``."""


def _randaugment(ops: int, magnitude: int) -> list:
    if ops < 0:
        raise ValueError(f"--data.augment.randaugment_ops must be >= 0 (0 = off), got {ops}")
    if not 0 <= magnitude <= 30:
        raise ValueError(f"--data.augment.randaugment_magnitude must lie in 0..30 (torchvision's 31 bins), "
                         f"got {magnitude}")
    return [T.RandAugment(num_ops=ops, magnitude=magnitude)] if ops else []


def build_train_transform(pre: dict[str, Any], augment: AugmentPreset = "small", hflip: bool = True,
                          randaugment_ops: int | None = None, randaugment_magnitude: int = 9,
                          colour_jitter: float = 0.2) -> T.Compose:
    """Training pipeline for ``augment`` (see the module docstring); ``hflip=False`` for
    data whose mirror image is another class (text, digits).

    Args:
        pre: the model's preprocessing (timm data config).
        augment: the preset.
        hflip: random horizontal flips.
        randaugment_ops: RandAugment operations per image (``0``: none); ``None``: the
            preset's own (:data:`RANDAUGMENT_OPS`). Not allowed with ``none``.
        randaugment_magnitude: RandAugment's magnitude (0..30).
        colour_jitter: ``small`` only: brightness and contrast factors drawn from
            ``[1 - j, 1 + j]`` (0: none).
    """
    if not 0 <= colour_jitter < 1:
        raise ValueError(f"--data.augment.colour_jitter must lie in [0, 1) (factors 1 - j .. 1 + j), "
                         f"got {colour_jitter}")
    h, w = _size(pre)
    interp = _interp(pre.get("interpolation", "bicubic"))
    if augment not in RANDAUGMENT_OPS:
        raise ValueError(f"unknown augment preset {augment!r}; use 'none', 'small' or 'finetune'")
    ra_ops = RANDAUGMENT_OPS[augment] if randaugment_ops is None else int(randaugment_ops)
    if augment == "none":
        if ra_ops:
            raise ValueError(f"--data.augment.randaugment_ops {ra_ops} needs an augmenting preset: "
                             "--data.augment.preset small (or finetune), or drop randaugment_ops")
        tf = build_eval_transform(whole_image(pre))
        tf.keeps_normalised_boxes = True  # both sides resized: a box's fractions of the image stay
        return tf
    randaugment = _randaugment(ra_ops, int(randaugment_magnitude))
    if augment == "small" and not randaugment:
        return T.Compose([SmallAugment((h, w), max(1, h // 8), hflip, pre["mean"], pre["std"], interp,
                                       jitter=colour_jitter)])
    if augment == "small":
        pad = max(1, h // 8)
        ops = [
            T.Resize((h, w), interpolation=interp, antialias=True),
            T.RandomCrop((h, w), padding=pad, padding_mode="reflect"),
            T.RandomHorizontalFlip(0.5 if hflip else 0.0),
            *randaugment,
            T.ColorJitter(brightness=colour_jitter, contrast=colour_jitter),
        ]
    else:  # finetune
        ops = [
            T.RandomResizedCrop((h, w), scale=(0.08, 1.0), interpolation=interp, antialias=True),
            T.RandomHorizontalFlip(0.5 if hflip else 0.0),
            *randaugment,
        ]
    return T.Compose([T.ToImage()] + ops + [T.ToDtype(torch.float32, scale=True),
                                             T.Normalize(mean=list(pre["mean"]), std=list(pre["std"]))])
