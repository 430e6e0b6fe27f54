"""Safe image decoding: any file, any mode, one RGB ``uint8`` result or one clear error.

- EXIF orientation is applied, so pixels (and boxes drawn on them) are upright;
- every mode becomes RGB: L / LA / P (with transparency) / RGBA / CMYK / I;16 ...; 16-bit
  images are *scaled* to 8 bits (not clipped); transparent pixels are composited on black;
- images declaring more than ``max_pixels`` pixels are refused before decoding (decompression
  bombs);
- anything that cannot be decoded raises :class:`ImageReadError` naming the file.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from vision_attn.errors import VisionAttnError

__all__ = ["DEFAULT_MAX_PIXELS", "IMAGE_EXTENSIONS", "ImageReadError", "read_image", "to_rgb_array"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
DEFAULT_MAX_PIXELS = 178_956_970  # PIL's own default bomb limit


class ImageReadError(VisionAttnError, OSError):
    """An image file that cannot be used. ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str | Path, reason: str | None = None) -> None:
        self.path = str(path)
        self.reason = reason
        if reason is None:  # re-raised from a DataLoader worker: ``path`` is the whole message
            super().__init__(self.path)
        else:
            super().__init__(f"cannot read image {self.path}: {reason}. Check the file (re-save or remove it).")


def to_rgb_array(img: Image.Image) -> np.ndarray:
    """Convert a PIL image of any mode to an RGB ``uint8`` array ``[H, W, 3]``."""
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(img).astype(np.float64)
        # 16-bit data: scale the full 0..65535 range to 0..255 (never clip at 255).
        arr = np.clip(arr / 257.0, 0, 255).round().astype(np.uint8)
        return np.repeat(arr[..., None], 3, axis=-1)
    if mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        hi = 1.0 if arr.max(initial=0) <= 1.0 else 255.0
        arr = np.clip(arr / hi * 255.0, 0, 255).round().astype(np.uint8)
        return np.repeat(arr[..., None], 3, axis=-1)
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        img = img.convert("RGBA")
        arr = np.asarray(img).astype(np.float32)
        alpha = arr[..., 3:4] / 255.0
        return (arr[..., :3] * alpha).round().astype(np.uint8)  # composite on black
    if mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img, dtype=np.uint8).copy()


def read_image(path: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS, apply_exif: bool = True) -> np.ndarray:
    """Decode ``path`` to an upright RGB ``uint8`` array ``[H, W, 3]``.

    ``apply_exif=False`` keeps the stored pixel order (for annotations made on it).

    Raises:
        ImageReadError: missing, empty, truncated or non-image file, or more than
            ``max_pixels`` pixels.
    """
    path = Path(path)
    if not path.is_file():
        raise ImageReadError(path, "no such file")
    if path.stat().st_size == 0:
        raise ImageReadError(path, "the file is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                w, h = img.size
                if w * h > max_pixels:
                    raise ImageReadError(path, f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}")
                img.load()
                if apply_exif:
                    img = ImageOps.exif_transpose(img)
                return to_rgb_array(img)
    except ImageReadError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageReadError(path, f"not a readable image ({err})") from err
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageReadError(path, f"corrupt or truncated image data ({err})") from err
