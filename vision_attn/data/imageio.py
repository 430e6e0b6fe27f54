"""Safe image decoding: any file, any mode, one RGB ``uint8`` result or one clear error.

- EXIF orientation is applied, so pixels (and boxes drawn on them) are upright;
- every mode becomes RGB: L / LA / P (with transparency) / RGBA / CMYK / I;16 ...; 16-bit
  images are *scaled* to 8 bits (not clipped); transparent pixels are composited on black, in
  integer arithmetic over blocks of rows (no float copy of the image: a 36-megapixel RGBA image
  costs its decoded bytes and the result, not gigabytes);
- images declaring more than ``max_pixels`` pixels, or whose decoded pixels would take more
  than ``max_bytes`` bytes (width x height x bytes per pixel of the decoded mode), are refused
  from the header, before decoding (decompression bombs);
- only regular files are opened: a FIFO (opening one blocks), a device or a folder is refused
  from its file type;
- anything that cannot be decoded raises :class:`ImageReadError` naming the file.

:class:`DecodedCache` keeps a dataset's decoded images in memory for the next epochs when the
whole split fits in its budget (small sets of small pictures), and nothing otherwise.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from vision_attn.errors import VisionAttnError

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "DecodedCache",
    "cache_budget",
    "IMAGE_EXTENSIONS",
    "ImageReadError",
    "READ_FORMATS",
    "decoded_bytes",
    "not_regular_reason",
    "read_image",
    "to_rgb_array",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
READ_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "TIFF", "WEBP", "PPM")
"""The decoders :func:`read_image` lets Pillow use, by the file's content: those of
:data:`IMAGE_EXTENSIONS` (JPEG's includes a camera's multi-picture JPEG). No other decoder is tried,
so a file named ``.png`` that holds, say, PostScript is refused instead of handed to Ghostscript."""
DEFAULT_MAX_PIXELS = 178_956_970  # PIL's own default bomb limit
# Decoded bytes (PIL keeps RGB in 4 bytes a pixel): an 80-megapixel RGB photo or a 36-megapixel
# RGBA PNG fits; PIL's own bomb check refuses more than 89 M pixels in any case.
DEFAULT_MAX_BYTES = 320 * 2**20
# per dataset, shared out among its loader workers; VISION_ATTN_DECODED_CACHE_MB overrides
DEFAULT_CACHE_BYTES = 256 * 2**20
_BLOCK_PIXELS = 1 << 20  # pixels converted at a time (bounds the temporaries of to_rgb_array)


class ImageReadError(VisionAttnError, OSError):
    """An image file that cannot be used. ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str | Path, reason: str | None = None) -> None:
        self.path = str(path)
        self.reason = reason
        if reason is None:  # re-raised from a DataLoader worker: ``path`` is the whole message
            super().__init__(self.path)
        else:
            super().__init__(f"cannot read image {self.path}: {reason}. Check the file (re-save or remove it).")


def _convert_by_rows(img: Image.Image, convert) -> np.ndarray:
    """RGB ``uint8`` ``[H, W, 3]`` from ``img``, ``convert`` applied to about
    :data:`_BLOCK_PIXELS` pixels at a time (arrays of rows cropped from PIL), so that besides
    PIL's decoded image and the result, memory stays small (no full-size copy, float or not)."""
    w, h = img.size
    out = np.empty((h, w, 3), np.uint8)
    rows = max(1, _BLOCK_PIXELS // max(1, w))
    for y in range(0, h, rows):
        block = np.asarray(img.crop((0, y, w, min(h, y + rows))))  # (r, W) or (r, W, C)
        converted = convert(block)
        out[y : y + rows] = converted if converted.ndim == 3 else converted[..., None]  # grey: over 3 channels
    return out


def _composite_on_black(block: np.ndarray) -> np.ndarray:
    """RGBA ``uint8`` ``[r, W, 4]`` -> RGB ``round(rgb * alpha / 255)``, in integers: ``uint16``
    products (at most 65025), exact rounding (``x / 255`` is never halfway for an integer)."""
    prod = block[..., :3].astype(np.uint16) * block[..., 3:4]  # (r, W, 3)
    prod += 127
    prod //= 255
    return prod.astype(np.uint8)


def _scale_16_bit(block: np.ndarray) -> np.ndarray:
    """0..65535 -> 0..255 rounded: ``(x + 128) // 257 == round(x / 257)`` (never halfway)."""
    return ((np.clip(block, 0, 65535).astype(np.uint32) + 128) // 257).astype(np.uint8)


def to_rgb_array(img: Image.Image) -> np.ndarray:
    """Convert a PIL image of any mode to an RGB ``uint8`` array ``[H, W, 3]``.

    16-bit data (``I;16*``, ``I``) is scaled from 0..65535 to 0..255 (never clipped at 255);
    float data (``F``) from 0..1 (or 0..255 when larger values occur); transparency is
    composited on black. These conversions run per block of rows in integer (or ``float32``)
    arithmetic: a 36-megapixel RGBA image costs PIL's decoded image and the result, not a float
    copy of it.
    """
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        return _convert_by_rows(img, _scale_16_bit)
    if mode == "F":
        peak = img.getextrema()[1]
        hi = np.float32(1.0 if not peak > 1.0 else 255.0)  # NaN peaks count as 0..1 data
        return _convert_by_rows(img, lambda b: np.clip(np.nan_to_num(b) / hi * 255.0, 0, 255).round().astype(np.uint8))
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return _convert_by_rows(img.convert("RGBA"), _composite_on_black)
    if mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img, dtype=np.uint8).copy()


def decoded_bytes(mode: str, width: int, height: int) -> int:
    """Bytes PIL needs for a decoded ``width x height`` image of ``mode`` (1 per pixel for
    ``1``, ``L``, ``P``; 2 for ``I;16*``; 4 for every other mode, as PIL stores them)."""
    per_pixel = 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
    return width * height * per_pixel


_FILE_TYPES = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def not_regular_reason(st_mode: int) -> str | None:
    """Why a file of this ``st_mode`` is not read as an image (``None`` for a regular file)."""
    if stat.S_ISREG(st_mode):
        return None
    kind = next((name for test, name in _FILE_TYPES if test(st_mode)), "not a regular file")
    return f"not a regular file ({kind}); only regular image files are read"


def _open_regular(path: Path):
    """Open ``path`` for reading only when it is a regular, non-empty file; never blocks (a FIFO
    is refused from its type before any open, and opened non-blocking in case it was swapped in)."""
    try:
        reason = not_regular_reason(os.stat(path).st_mode)
    except FileNotFoundError:
        raise ImageReadError(path, "no such file") from None
    except OSError as err:
        raise ImageReadError(path, f"cannot access it ({err.strerror or err})") from err
    if reason:
        raise ImageReadError(path, reason)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ImageReadError(path, f"cannot open it ({err.strerror or err})") from err
    try:
        st = os.fstat(fd)
        reason = not_regular_reason(st.st_mode)
        if reason:
            raise ImageReadError(path, reason)
        if st.st_size == 0:
            raise ImageReadError(path, "the file is empty (0 bytes)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_image(path: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS, apply_exif: bool = True,
               max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Decode ``path`` to an upright RGB ``uint8`` array ``[H, W, 3]``.

    ``apply_exif=False`` keeps the stored pixel order (for annotations made on it).

    Args:
        path: the image file.
        max_pixels: refuse images declaring more pixels.
        apply_exif: turn the pixels upright as the EXIF orientation says.
        max_bytes: refuse images whose decoded pixels would take more bytes
            (:func:`decoded_bytes`); checked from the header, before decoding.

    Raises:
        ImageReadError: missing, empty, not a regular file (FIFO, device, folder), truncated or
            non-image file, a format outside :data:`READ_FORMATS`, or more than ``max_pixels``
            pixels or ``max_bytes`` decoded bytes.
    """
    path = Path(path)
    fh = _open_regular(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with fh, Image.open(fh, formats=READ_FORMATS) as img:
                w, h = img.size
                if w * h > max_pixels:
                    raise ImageReadError(path, f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}")
                need = decoded_bytes(img.mode, w, h)
                if need > max_bytes:
                    raise ImageReadError(
                        path, f"a {w}x{h} {img.mode} image takes {need / 2**20:.0f} MiB decoded, which exceeds "
                        f"the limit of {max_bytes / 2**20:.0f} MiB (max_bytes); shrink the image")
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


class DecodedCache:
    """The decoded images of one dataset, kept in memory so that later epochs skip the file and
    the decoder (on 2 CPU cores the PNG decode was about two thirds of the captioner's data time).

    Turned on when the split looks small enough: the first image decides, ``items`` times its
    bytes must stay within ``max_bytes``. A few thousand small pictures are kept; COCO is not,
    and then nothing is held. Whatever the later images weigh, the cache never holds more than
    ``max_bytes`` (each entry counted with :data:`ENTRY_OVERHEAD` bytes of bookkeeping): once
    full, the rest are read from their files every time. It hands out copies, so a transform that
    writes into its input cannot change it.

    ``max_bytes`` defaults to :func:`cache_budget`, split evenly between a loader's worker
    processes (each has its own copy of the dataset, hence of its cache; workers are persistent,
    so it lasts across epochs).
    """

    def __init__(self, items: int, max_bytes: int | None = None) -> None:
        if max_bytes is None:
            max_bytes = cache_budget() // _loader_processes()
        self.items, self.max_bytes, self.used = int(items), max(0, int(max_bytes)), 0
        self.enabled: bool | None = None if self.max_bytes > 0 else False  # None: decided by the first image
        self._arrays: dict = {}

    def get(self, key, read) -> np.ndarray:
        """The array ``read()`` returns for ``key``, decoded once while the cache is on."""
        kept = self._arrays.get(key)
        if kept is not None:
            return kept.copy()
        arr = read()
        cost = arr.nbytes + ENTRY_OVERHEAD
        if self.enabled is None:
            self.enabled = cost * self.items <= self.max_bytes
        if self.enabled and self.used + cost <= self.max_bytes:
            self._arrays[key] = arr
            self.used += cost
            return arr.copy()
        return arr

    def __len__(self) -> int:
        return len(self._arrays)


ENTRY_OVERHEAD = 256  # bytes of an array object and its dictionary slot, counted with each kept image


def cache_budget() -> int:
    """Bytes of decoded images one dataset may keep (:class:`DecodedCache`):
    :data:`DEFAULT_CACHE_BYTES`, or ``VISION_ATTN_DECODED_CACHE_MB`` MiB (0 turns the cache off).

    Raises:
        ValueError: the variable is not a finite number >= 0.
    """
    env = os.environ.get("VISION_ATTN_DECODED_CACHE_MB", "").strip()
    if not env:
        return DEFAULT_CACHE_BYTES
    try:
        mib = float(env)
    except ValueError:
        mib = float("nan")
    if not (0 <= mib < 2**40):  # also refuses nan and inf
        raise ValueError(f"VISION_ATTN_DECODED_CACHE_MB must be a number of MiB >= 0 (0 = off), got {env!r}")
    return int(mib * 2**20)


def _loader_processes() -> int:
    """The number of loader workers when called inside one, else 1."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return max(1, info.num_workers) if info is not None else 1
