"""What the explanation code hands on: one explained image, and what ``report.html`` collects.

:class:`Explained` is a task's answer for one image (:meth:`~vision_attn.tasks.VisionTask.explain_batch`);
:class:`Report` collects the report items and curves of an evaluation; the encoders turn
pictures and attention maps into what the page embeds (``data:`` URIs, quantised arrays).
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import torch

from vision_attn.explain.images import resize_nearest

__all__ = ["Explained", "Report", "compact_data_uri", "png_data_uri", "quantise"]


@dataclasses.dataclass
class Explained:
    """One explained image (:meth:`VisionTask.explain_batch`).

    Attributes:
        record: its ``predictions.json`` record of the folder commands (without ``file``).
        panel: the overlay picture (uint8 RGB) written as a PNG.
        report_item: its entry of ``report.html`` (see :func:`vision_attn.report.write_report`).
        extras: what a task's own metrics need (e.g. captioning's words and maps).
    """

    record: dict[str, Any]
    panel: Any = None
    report_item: dict[str, Any] | None = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)



@dataclass
class Report:
    """What the explanation code collects for ``report.html`` (see :func:`vision_attn.report.write_report`)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    curves: dict[str, list[float]] | None = None

    @staticmethod
    def display_image(rgb: np.ndarray, side: int = 256) -> str:
        """The image the interactive canvas draws on, as a data URI: at its own resolution when
        its longer side is at most ``side`` (the canvas enlarges it without smoothing, so a
        64 px input costs 64 px of PNG, not 256), else shrunk to ``side`` x ``side``."""
        rgb = np.ascontiguousarray(rgb)
        h, w = rgb.shape[:2]
        if max(h, w) > side:
            rgb = cv2.resize(rgb, (side, side), interpolation=cv2.INTER_AREA)
        elif h != w:  # the canvas is square: make the image square at its longer side
            rgb = resize_nearest(rgb, max(h, w), max(h, w))
        return png_data_uri(rgb)


def png_data_uri(rgb: np.ndarray) -> str:
    """An RGB ``uint8`` image as a ``data:image/png;base64,`` URI."""
    ok, buf = cv2.imencode(".png", cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR))
    if not ok:
        raise OSError("OpenCV could not encode a report image as PNG")
    return "data:image/png;base64," + base64.b64encode(buf.tobytes()).decode("ascii")


_PNG_PREFIX = "data:image/png;base64,"


def compact_data_uri(uri: str, max_bytes: int = 48_000, quality: int = 85, max_side: int = 1400) -> str:
    """A PNG data URI of more than ``max_bytes`` re-encoded as JPEG (``quality``), its longer
    side first shrunk to ``max_side``; the PNG is kept when it is small, not a PNG, cannot be
    decoded, or the JPEG would not be smaller. Overlay panels (smooth heat maps over photos)
    shrink 5-8x this way at no visible cost; small pixel images stay lossless."""
    if not uri.startswith(_PNG_PREFIX) or len(uri) - len(_PNG_PREFIX) <= max_bytes * 4 // 3:
        return uri
    try:
        raw = base64.b64decode(uri[len(_PNG_PREFIX):], validate=True)
    except ValueError:
        return uri
    img = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
    if img is None:
        return uri
    h, w = img.shape[:2]
    if max(h, w) > max_side:
        scale = max_side / max(h, w)
        img = cv2.resize(img, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok or len(buf) >= len(raw):
        return uri
    return "data:image/jpeg;base64," + base64.b64encode(buf.tobytes()).decode("ascii")


def quantise(maps: torch.Tensor | np.ndarray) -> str:
    """Maps ``[..., N]`` -> base64 of uint8, each last-axis row scaled to its maximum (0..255)."""
    a = maps.detach().float().cpu().numpy() if isinstance(maps, torch.Tensor) else np.asarray(maps, np.float32)
    a = np.clip(np.nan_to_num(a), 0, None)
    peak = a.max(axis=-1, keepdims=True)
    a = np.where(peak > 0, a / np.where(peak > 0, peak, 1), 0)
    return base64.b64encode((a * 255).round().astype(np.uint8).tobytes()).decode("ascii")
