"""One call from a model and images to saliency maps in image pixels.

    import vision_attn
    model = vision_attn.load_model("timm:vit_tiny_patch16_224", weights_file="W.safetensors")
    maps = explain_images(model, images, method="relevance")   # [B, H, W] in [0, 1]

The maps come from :func:`~vision_attn.explain.methods.explain_classifier` on the patch grid,
upsampled bilinearly to the input tensor's pixels and scaled to a maximum of 1 per image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.data.transforms import build_eval_transform
from vision_attn.errors import ConfigError
from vision_attn.explain.methods import applicable_methods, explain_classifier
from vision_attn.explain.rollout import normalize_maps

__all__ = ["explain_images"]


def _as_batch(model, images: Tensor | Sequence[Any]) -> Tensor:
    """``[B, 3, H, W]`` model inputs from a tensor, or from a list of RGB ``uint8 [H, W, 3]``
    arrays (or PIL images), preprocessed as the model expects."""
    if isinstance(images, Tensor):
        if images.dim() == 3:
            images = images.unsqueeze(0)
        if images.dim() != 4 or images.shape[1] != 3:
            raise ConfigError(f"images must be a preprocessed [B, 3, H, W] tensor, got shape {tuple(images.shape)}")
        return images
    transform = build_eval_transform(model.inference_data_config())
    batch = []
    for i, picture in enumerate(images):
        not_rgb = isinstance(picture, np.ndarray) and (picture.ndim != 3 or picture.shape[2] != 3)
        if isinstance(picture, np.ndarray) and (picture.dtype != np.uint8 or not_rgb):
            raise ConfigError(f"images[{i}]: expected an RGB uint8 array [H, W, 3], got {picture.dtype} "
                              f"{picture.shape}; convert it (e.g. vision_attn.data.imageio.read_image)")
        batch.append(transform(picture))
    if not batch:
        raise ConfigError("images is empty")
    sizes = {tuple(x.shape) for x in batch}
    if len(sizes) > 1:
        raise ConfigError(f"the preprocessed images have different sizes {sorted(sizes)}; explain them one by one")
    return torch.stack(batch)


def grid_to_pixels(grid_maps: Tensor, size: tuple[int, int], model: Any) -> Tensor:
    """Maps over the patch grid ``[B, C, h, w]`` as ``[B, C, H, W]`` over the input pixels: each
    cell covers one patch of the encoder (``model.encoder.patch_size``), so a grid padded beyond
    the image (``dynamic_img_pad``) is drawn at the padded size and cropped to the image."""
    h, w = grid_maps.shape[-2:]
    patch = getattr(getattr(model, "encoder", None), "patch_size", None)
    if patch is None:
        return F.interpolate(grid_maps, size=tuple(size), mode="bilinear", align_corners=False)
    padded = (h * int(patch[0]), w * int(patch[1]))  # (H', W'): the pixels the grid covers
    if padded[0] < size[0] or padded[1] < size[1]:  # a grid that drops the edge pixels: stretched over them
        return F.interpolate(grid_maps, size=tuple(size), mode="bilinear", align_corners=False)
    up = F.interpolate(grid_maps, size=padded, mode="bilinear", align_corners=False)
    return up[..., : size[0], : size[1]]


def _check_embedding_target(model, target: Any) -> None:
    """An embedding model (a head with a ``target_column``) takes no ``target``: its target is its own."""
    if target is not None and getattr(model.head, "target_column", None) is not None:
        raise ConfigError("an embedding model explains its embedding's norm, or the cosine with a target set by "
                          "model.set_inference_options(EmbeddingOptions(target_image=... or target_embedding=...)); "
                          "leave target=None")


def explain_images(
    model,
    images: Tensor | Sequence[Any],
    method: str = "relevance",
    target: int | str | Sequence[int] | Tensor | None = None,
    *,
    token: str = "auto",
    batch_size: int = 32,
    **options: Any,
) -> Tensor:
    """Saliency maps of a classifier for a batch of images, in image pixels.

    Args:
        model: a classifier as :func:`vision_attn.load_model` / :func:`vision_attn.load_task`
            return it (a task with ``encoder`` and ``head``, e.g. a ``ClassificationTask``, a
            timm model by name). It runs in eval mode (its mode is restored afterwards).
        images: a preprocessed ``[B, 3, H, W]`` (or ``[3, H, W]``) tensor, or a list of RGB
            ``uint8 [H, W, 3]`` arrays, preprocessed with the model's own evaluation transform.
        method: a name in :data:`~vision_attn.explain.methods.METHODS` (``rollout``,
            ``relevance``, ``attention``, ``gradcam``, ``tokens``, ``random``, ...).
        target: the class explained: ``None`` (the prediction), a class name or index for every
            image, or one index per image (a sequence or ``[B]`` tensor). An embedding model
            (:class:`~vision_attn.tasks.embedding.EmbeddingTask`, a timm model without a
            classifier) takes ``None``: it explains its embedding's norm, or the cosine with the
            target of its :class:`~vision_attn.tasks.embedding.EmbeddingOptions`.
        token: ``auto`` (what the head reads) or, for a distilled DeiT, ``cls``, ``dist``,
            ``mean``.
        batch_size: images per forward pass.
        **options: more keyword arguments of
            :func:`~vision_attn.explain.methods.explain_classifier` (``head_fusion``,
            ``discard_ratio``, ``start_layer``, ``generator``).

    Returns:
        ``[B, H, W]`` float maps on the images' device (the CPU for a list of arrays), each
        upsampled bilinearly from the patch grid and scaled to ``[0, 1]`` (maximum 1, zero maps
        stay zero), ``H, W`` the input tensor's size.

    Raises:
        ConfigError: a model that is no classifier, unknown method / class / token, a method that
            does not apply to the model (:func:`~vision_attn.explain.methods.applicable_methods`:
            the message says why, and which methods do), bad images.
    """
    if not (hasattr(model, "encoder") and callable(getattr(model, "head", None))):
        raise ConfigError(f"explain_images explains classifiers (a model with an encoder and a classification head, "
                          f"as load_model returns for a classification checkpoint or a timm model); got "
                          f"{type(model).__name__}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    reasons = applicable_methods(model)
    if reasons.get(method) is not None:
        usable = [m for m, r in reasons.items() if r is None]
        raise ConfigError(f"method {method!r} does not apply to this model: {reasons[method]}; the methods that "
                          f"apply: {', '.join(usable)}")
    _check_embedding_target(model, target)
    batch = _as_batch(model, images)
    device = next(model.parameters()).device
    per_image: Tensor | None = None
    target_class: int | str | None = None
    if isinstance(target, (int, str)) and not isinstance(target, bool):
        target_class = target
    elif target is not None:
        per_image = torch.as_tensor(target, dtype=torch.long).flatten()
        if per_image.numel() != batch.shape[0]:
            raise ConfigError(f"target has {per_image.numel()} classes for {batch.shape[0]} images")
    was_training = model.training
    model.eval()
    chunks = []
    try:
        for start in range(0, batch.shape[0], batch_size):
            x = batch[start : start + batch_size].to(device)
            t = None if per_image is None else per_image[start : start + batch_size].to(device)
            expl = explain_classifier(model, x, (method,), target=t, target_class=target_class, token=token,
                                      **options)
            grid_maps = expl.maps[method][:, None]  # (b, 1, h, w)
            chunks.append(normalize_maps(grid_to_pixels(grid_maps, x.shape[-2:], model)[:, 0]).to(batch.device))
    finally:
        model.train(was_training)
    return torch.cat(chunks)
