"""Drawing saliency over images with OpenCV.

Conventions: images are ``uint8`` **RGB** arrays ``[H, W, 3]`` in and out (convert with
``cv2.cvtColor(img, cv2.COLOR_RGB2BGR)`` before encoding, or use :func:`save_png`, which writes
safely through :mod:`vision_attn.outputs`);
saliency maps are float arrays ``[h, w]`` of any resolution (the patch grid), values in
``[0, 1]``; they are resized to the image with bicubic interpolation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np
import torch

from vision_attn.outputs import safe_filename, write_png

__all__ = ["draw_box", "image_grid", "overlay_saliency", "put_text", "save_png"]


def _as_uint8_rgb(image: np.ndarray) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise TypeError(f"expected a uint8 image, got {image.dtype}")
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise ValueError(f"expected an RGB image [H, W, 3], got shape {image.shape}")
    return np.ascontiguousarray(image[..., :3])


def overlay_saliency(
    image: np.ndarray,
    saliency: np.ndarray | torch.Tensor,
    alpha: float = 0.5,
    colormap: int = cv2.COLORMAP_JET,
) -> np.ndarray:
    """Blend a colour-mapped saliency map over ``image``.

    Args:
        image: ``uint8`` RGB ``[H, W, 3]`` (grey ``[H, W]`` and RGBA are accepted).
        saliency: ``[h, w]`` in ``[0, 1]``; resized to ``H x W``. All-zero or constant maps
            give an evenly tinted image (no division by zero).
        alpha: weight of the heat map (0 = image only, 1 = heat map only).
        colormap: an OpenCV colormap (``cv2.COLORMAP_JET``, ``cv2.COLORMAP_INFERNO``, ...).

    Returns:
        ``uint8`` RGB ``[H, W, 3]``.
    """
    img = _as_uint8_rgb(image)
    sal = saliency.detach().float().cpu().numpy() if isinstance(saliency, torch.Tensor) else np.asarray(saliency)
    if sal.ndim != 2:
        raise ValueError(f"expected a saliency map [h, w], got shape {sal.shape}")
    sal = np.nan_to_num(sal.astype(np.float32), nan=0.0, posinf=1.0, neginf=0.0)
    h, w = img.shape[:2]
    sal = cv2.resize(sal, (w, h), interpolation=cv2.INTER_CUBIC)
    sal = np.clip(sal, 0.0, 1.0)
    heat_bgr = cv2.applyColorMap((sal * 255).round().astype(np.uint8), colormap)
    heat = cv2.cvtColor(heat_bgr, cv2.COLOR_BGR2RGB)
    return cv2.addWeighted(img, 1.0 - alpha, heat, alpha, 0.0)


def put_text(image: np.ndarray, text: str, origin: tuple[int, int] | None = None, scale: float | None = None) -> np.ndarray:
    """Write ``text`` on a copy of ``image`` (white on a dark band, readable on any picture)."""
    img = _as_uint8_rgb(image).copy()
    h, w = img.shape[:2]
    scale = scale if scale is not None else max(0.35, min(1.0, w / 400))
    thickness = max(1, int(round(scale * 1.5)))
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, thickness)
    x, y = origin if origin is not None else (3, th + 4)
    cv2.rectangle(img, (x - 2, y - th - 3), (min(w - 1, x + tw + 2), min(h - 1, y + base + 1)), (0, 0, 0), -1)
    cv2.putText(img, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, scale, (255, 255, 255), thickness, cv2.LINE_AA)
    return img


def draw_box(
    image: np.ndarray, box_xyxy: Sequence[float], colour: tuple[int, int, int] = (255, 255, 0), label: str | None = None
) -> np.ndarray:
    """Draw a box ``(x0, y0, x1, y1)`` in pixels (and an optional label) on a copy of ``image``."""
    img = _as_uint8_rgb(image).copy()
    x0, y0, x1, y1 = (int(round(v)) for v in box_xyxy)
    cv2.rectangle(img, (x0, y0), (x1, y1), colour, max(1, img.shape[1] // 200), cv2.LINE_AA)
    if label:
        img = put_text(img, label, origin=(max(2, x0 + 2), max(12, y0 - 3)))
    return img


def image_grid(images: Sequence[np.ndarray], titles: Sequence[str] | None = None, cols: int | None = None,
               cell: int | None = None, pad: int = 2) -> np.ndarray:
    """Tile images (e.g. several explanation methods side by side) with optional titles.

    Args:
        images: ``uint8`` RGB images, resized to a common ``cell x cell`` square (default:
            the largest side, at least 128 px so titles stay readable).
        titles: one title per image, written above it.
        cols: images per row (default: all in one row).
        cell: side of each tile in pixels.
        pad: white space between tiles.
    """
    if len(images) == 0:
        raise ValueError("image_grid needs at least one image")
    imgs = [_as_uint8_rgb(im) for im in images]
    cell = cell or max(128, max(max(im.shape[:2]) for im in imgs))
    cols = cols or len(imgs)
    rows = (len(imgs) + cols - 1) // cols
    title_h = 18 if titles else 0
    out = np.full((rows * (cell + title_h + pad) + pad, cols * (cell + pad) + pad, 3), 255, np.uint8)
    for i, im in enumerate(imgs):
        r, c = divmod(i, cols)
        y = pad + r * (cell + title_h + pad)
        x = pad + c * (cell + pad)
        out[y + title_h : y + title_h + cell, x : x + cell] = cv2.resize(im, (cell, cell), interpolation=cv2.INTER_NEAREST if max(im.shape[:2]) < cell else cv2.INTER_AREA)
        if titles:
            cv2.putText(out, str(titles[i])[: cell // 7], (x + 2, y + 13), cv2.FONT_HERSHEY_SIMPLEX, 0.42, (0, 0, 0), 1, cv2.LINE_AA)
    return out


def save_png(path: str | Path, image_rgb: np.ndarray, root: str | Path | None = None) -> Path:
    """Write an RGB ``uint8`` image as PNG, safely (see :mod:`vision_attn.outputs`).

    The file name is made safe and at most :data:`~vision_attn.outputs.MAX_NAME_BYTES` bytes
    long (:func:`~vision_attn.outputs.safe_filename`: a long name is truncated and hashed, never a
    failure); the file must resolve under ``root`` (the output folder; default: its own folder)
    and is written through a fresh temporary file and a rename, so a planted link is replaced,
    never followed, and no half-written PNG is left behind.

    Args:
        path: the file (``OUT / "overlays" / name``).
        image_rgb: ``uint8`` RGB ``[H, W, 3]`` (grey and RGBA accepted).
        root: the output folder the file must stay in.

    Returns:
        The path written (its name possibly shortened).

    Raises:
        OSError: OpenCV cannot encode the image (the message names the file) or the folder cannot
            be created; :class:`~vision_attn.outputs.OutputPathError` when the path leaves ``root``.
    """
    path = Path(path)
    path = path.with_name(safe_filename(path.name))
    return write_png(path, _as_uint8_rgb(image_rgb), root=root)
