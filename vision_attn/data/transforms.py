"""Image transforms built from the encoder's preprocessing (timm data config).

The preprocessing that a model was trained with — input size, mean, std, interpolation,
crop fraction — belongs to the model and travels in its checkpoint. These builders turn that
dict into torchvision v2 pipelines, ``uint8 [H, W, 3]`` numpy in, normalised ``float32
[3, H, W]`` tensor out.

Augmentation presets:

- ``none``: the evaluation pipeline;
- ``small``: for small images trained from scratch (CIFAR-style): reflect-pad + random crop,
  horizontal flip, light colour jitter;
- ``finetune``: for fine-tuning pretrained models at 224 px: random-resized crop, flip,
  RandAugment (timm/DeiT style).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T

__all__ = [
    "AugmentPreset",
    "DEFAULT_PREPROCESS",
    "build_display_transform",
    "build_eval_transform",
    "build_train_transform",
    "model_preprocess",
]

AugmentPreset = Literal["none", "small", "finetune"]

log = logging.getLogger(__name__)

DEFAULT_PREPROCESS: dict[str, Any] = {
    "input_size": (3, 224, 224),
    "interpolation": "bicubic",
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "crop_pct": 0.9,
}


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


def _interp(name: str) -> InterpolationMode:
    try:
        return InterpolationMode(name)
    except ValueError:
        return InterpolationMode.BICUBIC


def _size(pre: dict[str, Any]) -> tuple[int, int]:
    _, h, w = pre["input_size"]
    return int(h), int(w)


def _tail(pre: dict[str, Any]) -> list:
    return [T.ToDtype(torch.float32, scale=True), T.Normalize(mean=list(pre["mean"]), std=list(pre["std"]))]


def _eval_geometry(pre: dict[str, Any]) -> list:
    h, w = _size(pre)
    crop_pct = float(pre.get("crop_pct", 1.0))
    interp = _interp(pre.get("interpolation", "bicubic"))
    if crop_pct >= 1.0:
        return [T.Resize((h, w), interpolation=interp, antialias=True)]
    scale = (math.floor(h / crop_pct), math.floor(w / crop_pct))
    return [T.Resize(scale, interpolation=interp, antialias=True), T.CenterCrop((h, w))]


def build_eval_transform(pre: dict[str, Any]) -> T.Compose:
    """Resize to ``size / crop_pct`` (shorter side) then centre-crop ``size``, as timm evaluates."""
    return T.Compose([T.ToImage()] + _eval_geometry(pre) + _tail(pre))


def build_display_transform(pre: dict[str, Any]):
    """The evaluation geometry without normalisation: RGB ``uint8 [H, W, 3]`` in and out, so
    saliency maps of the model input can be drawn on exactly the pixels the model saw."""
    geometry = T.Compose([T.ToImage()] + _eval_geometry(pre))

    def display(image):
        return geometry(image).permute(1, 2, 0).contiguous().numpy()

    return display


def build_train_transform(pre: dict[str, Any], augment: AugmentPreset = "small", hflip: bool = True) -> T.Compose:
    """Training pipeline for ``augment`` (see the module docstring); ``hflip=False`` for
    data whose mirror image is another class (text, digits)."""
    h, w = _size(pre)
    interp = _interp(pre.get("interpolation", "bicubic"))
    if augment == "none":
        return build_eval_transform({**pre, "crop_pct": 1.0})
    if augment == "small":
        pad = max(1, h // 8)
        ops = [
            T.Resize((h, w), interpolation=interp, antialias=True),
            T.RandomCrop((h, w), padding=pad, padding_mode="reflect"),
            T.RandomHorizontalFlip(0.5 if hflip else 0.0),
            T.ColorJitter(brightness=0.2, contrast=0.2),
        ]
    elif augment == "finetune":
        ops = [
            T.RandomResizedCrop((h, w), scale=(0.08, 1.0), interpolation=interp, antialias=True),
            T.RandomHorizontalFlip(0.5 if hflip else 0.0),
            T.RandAugment(num_ops=2, magnitude=9),
        ]
    else:
        raise ValueError(f"unknown augment preset {augment!r}; use 'none', 'small' or 'finetune'")
    return T.Compose([T.ToImage()] + ops + _tail(pre))
