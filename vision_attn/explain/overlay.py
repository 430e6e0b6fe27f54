"""Drawing saliency over images with OpenCV.

Conventions: images are ``uint8`` **RGB** arrays ``[H, W, 3]`` in and out (convert with
``cv2.cvtColor(img, cv2.COLOR_RGB2BGR)`` before encoding, or use :func:`save_png`, which writes
safely through :mod:`vision_attn.outputs`);
saliency maps are float arrays ``[h, w]`` of any resolution (the patch grid), values in
``[0, 1]``; they are resized to the image with bicubic interpolation.

:func:`explanation_figure` draws one image's explanations as people read them: every map on the
original photo (where the model saw only a centre crop, the map covers the crop and the crop is
outlined), one colour scale for the whole figure by default (``normalize="shared"``: a method
whose map is flat looks flat, not saturated; ``"per_map"``: each map to its own maximum), a
colour bar with the scale's ends, and titles and captions wrapped or shrunk to fit their panel.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import cv2
import numpy as np
import torch

from vision_attn.explain.localisation import eval_geometry, grid_to_image
from vision_attn.outputs import safe_filename, write_png

__all__ = ["NORMALIZE", "attach_colour_bar", "colour_bar", "crop_box", "draw_box", "explanation_figure", "fit_text",
           "image_grid", "overlay_saliency", "put_text", "save_png", "scale_maps"]

Normalize = Literal["shared", "per_map"]
NORMALIZE: tuple[str, ...] = ("shared", "per_map")
"""How the maps of one figure are scaled to colours (``--overlay.normalize``): ``shared`` (one
scale, the largest value of any map at the top) or ``per_map`` (each map to its own maximum)."""

_FONT = cv2.FONT_HERSHEY_SIMPLEX


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


def fit_text(text: str, width: int, scale: float = 0.45, min_scale: float = 0.32,
             max_lines: int = 3) -> tuple[list[str], float]:
    """``text`` as lines that fit ``width`` pixels in OpenCV's simplex font: at ``scale`` when it
    fits on one line, else shrunk towards ``min_scale``, else wrapped at spaces (a word longer
    than the width is broken) on at most ``max_lines`` lines (the last one ending in ``...``
    when the text is longer still). Returns ``(lines, scale)``."""
    text = " ".join(str(text).split())

    def fits(line: str, sc: float) -> bool:
        return cv2.getTextSize(line, _FONT, sc, 1)[0][0] <= width

    sc = scale
    while not fits(text, sc) and sc > min_scale:
        sc = max(min_scale, sc - 0.03)
    if fits(text, sc):
        return [text], sc
    per_line = max(1, width // max(1, cv2.getTextSize("n", _FONT, sc, 1)[0][0]))
    while per_line > 1:
        lines = textwrap.wrap(text, per_line, break_long_words=True, break_on_hyphens=False)
        if all(fits(line, sc) for line in lines):
            break
        per_line -= 1
    lines = textwrap.wrap(text, per_line, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and not fits(last + "...", sc):
            last = last[:-1]
        lines[-1] = last + "..."
    return lines, sc


def _line_height(scale: float) -> int:
    (_, th), base = cv2.getTextSize("Ag", _FONT, scale, 1)
    return th + base + 3


def put_text(image: np.ndarray, text: str, origin: tuple[int, int] | None = None,
             scale: float | None = None) -> np.ndarray:
    """Write ``text`` on a copy of ``image`` (white on a dark band, readable on any picture),
    shrunk and wrapped to fit the image's width (:func:`fit_text`).

    Args:
        image: ``[H, W, 3]`` RGB picture (``uint8``, or floats in ``[0, 1]``).
        text: what to write.
        origin: ``(x, y)`` of the band's top-left corner (default: the top of the image).
        scale: OpenCV font scale (default: from the image's width).

    Returns:
        The written copy, ``uint8``.
    """
    img = _as_uint8_rgb(image).copy()
    h, w = img.shape[:2]
    scale = scale if scale is not None else max(0.35, min(1.0, w / 400))
    x, y = origin if origin is not None else (3, 0)
    lines, scale = fit_text(text, max(8, w - x - 4), scale, min(scale, 0.3))
    thickness = max(1, int(round(scale * 1.5)))
    (_, th), base = cv2.getTextSize("Ag", _FONT, scale, thickness)
    step = th + base + 2
    y = y if origin is not None else th + 4
    for k, line in enumerate(lines):
        (tw, _), _ = cv2.getTextSize(line, _FONT, scale, thickness)
        yk = y + k * step
        cv2.rectangle(img, (max(0, x - 2), yk - th - 3), (min(w - 1, x + tw + 2), min(h - 1, yk + base + 1)),
                      (0, 0, 0), -1)
        cv2.putText(img, line, (x, yk), _FONT, scale, (255, 255, 255), thickness, cv2.LINE_AA)
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
        interpolation = cv2.INTER_NEAREST if max(im.shape[:2]) < cell else cv2.INTER_AREA
        out[y + title_h : y + title_h + cell, x : x + cell] = cv2.resize(im, (cell, cell), interpolation=interpolation)
        if titles:
            lines, sc = fit_text(str(titles[i]), cell - 4, 0.42, 0.3, max_lines=1)
            cv2.putText(out, lines[0], (x + 2, y + 13), _FONT, sc, (0, 0, 0), 1, cv2.LINE_AA)
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


def scale_maps(maps: Sequence[np.ndarray | torch.Tensor],
               normalize: Normalize = "shared") -> tuple[list[np.ndarray], list[float]]:
    """Maps (any shapes) on a colour scale in ``[0, 1]``, and the value each scale's top stands for.

    ``shared``: every map divided by the largest value of all of them (a map whose values are a
    tenth of another's is drawn a tenth as hot); ``per_map``: each map divided by its own
    maximum. Negative and non-finite values count as ``0``; an all-zero map stays ``0``.
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"overlay normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    arrays = [np.clip(np.nan_to_num(m.detach().float().cpu().numpy() if isinstance(m, torch.Tensor)
                                    else np.asarray(m, np.float32), nan=0.0, posinf=0.0, neginf=0.0), 0.0, None)
              for m in maps]
    peaks = [float(a.max()) if a.size else 0.0 for a in arrays]
    if normalize == "shared":
        top = max(peaks, default=0.0)
        peaks = [top] * len(arrays)
    return [a / p if p > 0 else np.zeros_like(a) for a, p in zip(arrays, peaks, strict=True)], peaks


def crop_box(original_hw: tuple[int, int], pre: Mapping[str, Any] | None) -> tuple[int, int, int, int] | None:
    """``(x0, y0, x1, y1)`` in original pixels of the part of the image the model sees after its
    evaluation resize and centre crop (``pre``: the preprocessing, ``task.inference_data_config()``);
    ``None`` when it sees all of it (or ``pre`` is ``None``)."""
    if pre is None:
        return None
    geo = eval_geometry(original_hw, dict(pre))
    (h0, w0), (rh, rw), (top, left), (ih, iw) = geo.original, geo.resized, geo.offset, geo.input
    y0, y1 = max(0.0, top * h0 / rh), min(float(h0), (top + ih) * h0 / rh)
    x0, x1 = max(0.0, left * w0 / rw), min(float(w0), (left + iw) * w0 / rw)
    box = (int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1)))
    return None if box[0] <= 0 and box[1] <= 0 and box[2] >= w0 and box[3] >= h0 else box


def colour_bar(height: int, top: float | None = None, colormap: int = cv2.COLORMAP_JET, width: int = 14) -> np.ndarray:
    """A vertical colour bar ``[height, W, 3]`` (uint8 RGB, white background): the colormap's
    hottest colour at the top, ``0`` at the bottom, labelled with the value the top stands for
    (``top``; ``max`` when not given; integers written as integers)."""
    height = max(24, int(height))
    ramp = np.linspace(255, 0, height).round().astype(np.uint8)[:, None].repeat(width, 1)
    bar = cv2.cvtColor(cv2.applyColorMap(ramp, colormap), cv2.COLOR_BGR2RGB)
    label = "max" if top is None else (str(int(top)) if float(top).is_integer() else f"{top:.3g}")
    label_w = max(cv2.getTextSize(t, _FONT, 0.35, 1)[0][0] for t in (label, "0")) + 6
    out = np.full((height, width + label_w, 3), 255, np.uint8)
    out[:, :width] = bar
    cv2.putText(out, label, (width + 3, 10), _FONT, 0.35, (0, 0, 0), 1, cv2.LINE_AA)
    cv2.putText(out, "0", (width + 3, height - 3), _FONT, 0.35, (0, 0, 0), 1, cv2.LINE_AA)
    return out


def attach_colour_bar(figure: np.ndarray, top: float | None = None, colormap: int = cv2.COLORMAP_JET,
                      pad: int = 4) -> np.ndarray:
    """``figure`` (uint8 RGB) with a :func:`colour_bar` on its right, as tall as the figure less
    ``pad`` at the top and bottom, on white (``top``: the value the bar's top stands for)."""
    fig = _as_uint8_rgb(figure)
    h = fig.shape[0]
    bar = colour_bar(max(24, h - 2 * pad), top, colormap)
    out = np.full((max(h, bar.shape[0] + 2 * pad), fig.shape[1] + bar.shape[1] + 2 * pad, 3), 255, np.uint8)
    out[:h, : fig.shape[1]] = fig
    out[pad : pad + bar.shape[0], fig.shape[1] + pad : fig.shape[1] + pad + bar.shape[1]] = bar
    return out


def _on_photo(picture: np.ndarray, grid_map: np.ndarray, pre: Mapping[str, Any] | None, alpha: float,
              colormap: int) -> np.ndarray:
    """``grid_map`` (``[h, w]`` over the model input, in ``[0, 1]``) blended over the original
    ``picture``: over the part the model saw (all of it without ``pre``)."""
    if pre is None:
        return overlay_saliency(picture, grid_map, alpha, colormap)
    h, w = picture.shape[:2]
    on_image = np.clip(grid_to_image(grid_map, (h, w), dict(pre)), 0.0, 1.0)
    heat = cv2.cvtColor(cv2.applyColorMap((on_image * 255).round().astype(np.uint8), colormap), cv2.COLOR_BGR2RGB)
    blended = cv2.addWeighted(picture, 1.0 - alpha, heat, alpha, 0.0)
    box = crop_box((h, w), pre)
    if box is None:
        return blended
    out = picture.copy()
    x0, y0, x1, y1 = box
    out[y0:y1, x0:x1] = blended[y0:y1, x0:x1]
    return out


def _outline(image: np.ndarray, box: tuple[int, int, int, int] | None) -> np.ndarray:
    """The model's crop outlined (white over black, visible on any picture)."""
    if box is None:
        return image
    img = image.copy()
    t = max(1, max(img.shape[:2]) // 200)
    x0, y0, x1, y1 = box
    cv2.rectangle(img, (x0, y0), (x1 - 1, y1 - 1), (0, 0, 0), t + 2)
    cv2.rectangle(img, (x0, y0), (x1 - 1, y1 - 1), (255, 255, 255), t)
    return img


def explanation_figure(picture: np.ndarray, maps: Mapping[str, np.ndarray | torch.Tensor],
                       pre: Mapping[str, Any] | None = None, caption: str = "", alpha: float = 0.5,
                       normalize: Normalize = "shared", side: int = 224, colormap: int = cv2.COLORMAP_JET,
                       pad: int = 4) -> np.ndarray:
    """One image's explanations on its original photo: the photo (the model's crop outlined
    when it crops), then one overlay per method, then a colour bar; titles above the panels and
    ``caption`` on top, each wrapped or shrunk to fit (uint8 RGB).

    Args:
        picture: the original photo, uint8 RGB ``[H, W, 3]``; every panel keeps its aspect
            ratio (a tall photo keeps its full height), its longer side ``side`` pixels.
        maps: per method a map ``[h, w]`` over the model input's patch grid (any scale).
        pre: the preprocessing that made the model input (``task.inference_data_config()``):
            each map covers the part of the photo the model saw; ``None``: the whole photo.
        caption: e.g. ``truth -> pred 0.93``.
        alpha: heat-map opacity.
        normalize: ``shared`` (default: one colour scale for the figure) or ``per_map``
            (:func:`scale_maps`).
        side: the panels' longer side in pixels.
        colormap: an OpenCV colormap.
        pad: white space between panels.
    """
    photo = _as_uint8_rgb(picture)
    h0, w0 = photo.shape[:2]
    f = side / max(h0, w0)
    ph, pw = max(1, round(h0 * f)), max(1, round(w0 * f))
    small = cv2.resize(photo, (pw, ph), interpolation=cv2.INTER_AREA if f < 1 else cv2.INTER_NEAREST)
    scaled, peaks = scale_maps(list(maps.values()), normalize)
    box = crop_box((ph, pw), pre)  # the crop depends on the aspect ratio alone (up to rounding)
    tiles = [_outline(small, box)] + [_outline(_on_photo(small, m, pre, alpha, colormap), box) for m in scaled]
    titles = ["input" + (" (outline: the model's crop)" if box is not None else ""), *maps]
    fitted = [fit_text(t, pw, 0.42, 0.3) for t in titles]
    title_h = max(len(lines) * _line_height(sc) for lines, sc in fitted) + 2
    bar = colour_bar(ph, peaks[0] if normalize == "shared" and peaks and peaks[0] > 0 else None, colormap)
    width = pad + len(tiles) * (pw + pad) + bar.shape[1] + pad
    cap_lines, cap_sc = fit_text(caption, width - 2 * pad, 0.5, 0.32) if caption else ([], 0.5)
    cap_h = len(cap_lines) * _line_height(cap_sc) + (pad if cap_lines else 0)
    out = np.full((pad + cap_h + title_h + ph + pad, width, 3), 255, np.uint8)
    _write_lines(out, cap_lines, cap_sc, pad, pad)
    top = pad + cap_h
    for k, (tile, (lines, sc)) in enumerate(zip(tiles, fitted, strict=True)):
        x = pad + k * (pw + pad)
        _write_lines(out, lines, sc, x, top)
        out[top + title_h : top + title_h + ph, x : x + pw] = tile
    x = pad + len(tiles) * (pw + pad)
    out[top + title_h : top + title_h + ph, x : x + bar.shape[1]] = bar
    return out


def _write_lines(out: np.ndarray, lines: list[str], scale: float, x: int, top: int) -> None:
    step = _line_height(scale)
    for k, line in enumerate(lines):
        (_, th), _ = cv2.getTextSize("Ag", _FONT, scale, 1)
        cv2.putText(out, line, (x, top + k * step + th + 1), _FONT, scale, (0, 0, 0), 1, cv2.LINE_AA)
