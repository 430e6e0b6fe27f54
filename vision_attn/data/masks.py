"""Object masks of COCO instances files: a ``segmentation`` (polygons, uncompressed or compressed
RLE) decoded into the pixels of its image, through pycocotools, when it is needed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vision_attn.data.imageio import DEFAULT_MAX_PIXELS
from vision_attn.errors import DataError

__all__ = ["POLYGON_OUTLINE_LIMIT", "ImageMask", "compressed_counts", "decode_segmentation", "image_mask"]


def compressed_counts(counts: str) -> list[int]:
    """The run lengths of a compressed COCO RLE string (COCO's format: each run a variable-length
    group of characters ``'0' + 6 bits``, 5 value bits per character and ``0x20`` for "more", the
    last character's ``0x10`` a sign; from the third run on, each value is a difference to the run
    two before it).

    Raises:
        ValueError: a character outside ``'0'..'o'``, a run of over 64 bits or cut off at the end,
            or a negative run.
    """
    runs: list[int] = []
    value = shift = 0
    for ch in counts:
        code = ord(ch) - 48
        if not 0 <= code < 64:
            raise ValueError(f"{ch!r} is not a compressed RLE character ('0' to 'o')")
        value |= (code & 0x1F) << shift
        shift += 5
        if code & 0x20:
            if shift > 60:  # pycocotools' runs are 64-bit numbers
                raise ValueError("a run of the compressed RLE counts is longer than 64 bits")
            continue
        if code & 0x10:
            value -= 1 << shift
        if len(runs) > 2:
            value += runs[-2]
        if value < 0:
            raise ValueError(f"run {len(runs)} of the compressed RLE counts is negative")
        runs.append(value)
        value = shift = 0
    if shift:
        raise ValueError("the compressed RLE counts end inside a run")
    return runs


POLYGON_OUTLINE_LIMIT = 100
"""A segmentation's polygons may be at most this many times the image's ``height + width`` long."""


def _polygon_problem(polygons: list, height: int, width: int) -> str | None:
    """Why ``polygons`` are not rasterised in a ``height x width`` image (pycocotools' time and
    memory grow with the outline, not with the image): a vertex more than the image's size outside
    it, or an outline over :data:`POLYGON_OUTLINE_LIMIT` times ``height + width``; else ``None``."""
    extent, total = np.array([width, height], dtype=np.float64), 0.0
    for polygon in polygons:
        xy = np.asarray(polygon, dtype=np.float64).reshape(-1, 2)
        if (xy < -extent).any() or (xy > 2 * extent).any():
            return f"a polygon vertex lies more than the image's size ({width} x {height}) outside it"
        total += float(np.hypot(*(np.roll(xy, -1, axis=0) - xy).T).sum())
    if total > POLYGON_OUTLINE_LIMIT * (height + width):
        return (f"the polygons' outline ({total:.0f} px) is over {POLYGON_OUTLINE_LIMIT} times the image's "
                f"height + width")
    return None


def decode_segmentation(segmentation: Any, height: int, width: int, where: str = "annotation") -> np.ndarray:
    """``bool [height, width]``: the mask of a COCO ``segmentation`` (a list of polygons
    ``[[x0, y0, x1, y1, ...], ...]``, an uncompressed RLE ``{"size", "counts": [...]}`` or a
    compressed one ``{"size", "counts": "..."}``).

    Raises:
        DataError: a malformed segmentation, or an RLE of another size than the image's (naming ``where``).
    """
    from pycocotools import mask as coco_mask

    try:
        if isinstance(segmentation, list):
            if not segmentation or not all(isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0
                                           and all(isinstance(v, (int, float)) and np.isfinite(v) for v in p)
                                           for p in segmentation):
                raise ValueError("polygons must be lists of at least three finite x, y pairs")
            problem = _polygon_problem(segmentation, height, width)
            if problem:
                raise ValueError(problem)
            rle = coco_mask.merge(coco_mask.frPyObjects(segmentation, height, width))
        elif isinstance(segmentation, dict) and "counts" in segmentation and "size" in segmentation:
            size = segmentation["size"]
            if not (isinstance(size, list) and len(size) == 2 and [int(v) for v in size] == [height, width]):
                raise ValueError(f"its size {size!r} is not the image's [{height}, {width}]")
            counts = segmentation["counts"]
            if isinstance(counts, list):
                if not all(isinstance(c, int) and c >= 0 for c in counts) or sum(counts) != height * width:
                    raise ValueError("uncompressed RLE counts must be non-negative integers summing to height x width")
                rle = coco_mask.frPyObjects(segmentation, height, width)
            elif isinstance(counts, str):
                # checked here: pycocotools decodes runs that cover less than the image from memory it never wrote
                runs = compressed_counts(counts)
                if sum(runs) != height * width:
                    raise ValueError(f"compressed RLE counts cover {sum(runs)} pixels, not height x width = "
                                     f"{height * width}")
                rle = {"size": [height, width], "counts": counts.encode("ascii")}
            else:
                raise ValueError("RLE counts must be a list of integers or a string")
        else:
            raise ValueError("expected polygons or an RLE {'size', 'counts'}")
        return np.asarray(coco_mask.decode(rle), dtype=bool).reshape(height, width)
    except (ValueError, TypeError, UnicodeEncodeError, OverflowError) as err:
        raise DataError(f"{where}: cannot read its 'segmentation' ({err}); give COCO polygons or RLE") from None


@dataclass(frozen=True)
class ImageMask:
    """An object's COCO ``segmentation`` in an image of ``height x width`` pixels, decoded by
    :meth:`decode` (:func:`decode_segmentation`; ``where`` names it in errors)."""

    segmentation: Any
    height: int
    width: int
    where: str = "annotation"

    def decode(self, size: tuple[int, int] | None = None) -> np.ndarray:
        """``bool [height, width]``; given the image's ``size`` (``(H, W)``), a mask declared
        for another size is a :class:`~vision_attn.errors.DataError` naming :attr:`where`."""
        if size is not None and (self.height, self.width) != tuple(size):
            raise DataError(f"{self.where}: 'height' x 'width' {self.height}x{self.width} is not the image's "
                            f"{size[0]}x{size[1]}; its masks cannot be scored (give the image's size)")
        return decode_segmentation(self.segmentation, self.height, self.width, self.where)


def image_mask(segmentation: Any, height: Any, width: Any, where: str = "annotation") -> ImageMask | None:
    """The :class:`ImageMask` of ``segmentation`` in an image of the declared ``height`` and
    ``width``; ``None`` when they are not whole numbers of at least 1 whose product stays within
    :data:`~vision_attn.data.imageio.DEFAULT_MAX_PIXELS` (no mask of unknown or huge size is decoded)."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1 and float(v).is_integer()
               for v in (height, width)) or height * width > DEFAULT_MAX_PIXELS:
        return None
    return ImageMask(segmentation, int(height), int(width), where)
