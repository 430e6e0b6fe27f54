"""Hand-drawn stroke digits: a second generator of detection and captioning scenes, with masks.

The embedded digit scenes (:func:`~vision_attn.data.synthetic.ensure_digit_scenes_coco`) draw
font glyphs with one family of caption templates. These scenes differ on purpose, so that a
change tuned on one can be checked on the other: each digit is a polyline skeleton drawn as a
pen stroke (jittered points, random rotation, shear and thickness), on a two-colour gradient with
noise and stray pen lines, one to three digits in a row, a column or scattered, and captions from
other templates ("a handwritten 4 written above a 7" in words). Each object has a pixel mask.

Layout (the COCO 2017 one, as the other scene generators): ``ROOT/{train,val}/<id>.png``,
``ROOT/annotations/instances_{train,val}.json`` (categories "zero".."nine", ids 1..10; tight boxes
of the ink; ``segmentation`` as uncompressed RLE, column-major as pycocotools reads it) and
``ROOT/annotations/captions_{train,val}.json`` (five captions per image).

    vision-attn data strokes --num_train 1000 --num_val 200
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

from vision_attn.data.synthetic import DIGIT_WORDS, default_cache_dir

__all__ = ["SKELETONS", "StrokeSceneConfig", "describe_strokes", "ensure_stroke_scenes", "mask_to_rle",
           "render_stroke_scene"]

log = logging.getLogger(__name__)

_VERSION = 1
_SUPERSAMPLE = 4


def _loop(cx: float, cy: float, rx: float, ry: float, start: float = 0.0, end: float = 2 * np.pi,
          n: int = 16) -> list[tuple[float, float]]:
    t = np.linspace(start, end, n)
    return [(cx + rx * np.cos(a), cy + ry * np.sin(a)) for a in t]


SKELETONS: dict[int, list[list[tuple[float, float]]]] = {
    # digit -> pen strokes, each a polyline in the unit square (x right, y down)
    0: [_loop(0.5, 0.5, 0.3, 0.45)],
    1: [[(0.3, 0.25), (0.55, 0.05), (0.55, 0.95)]],
    2: [[(0.2, 0.25), (0.35, 0.07), (0.65, 0.07), (0.8, 0.3), (0.7, 0.5), (0.2, 0.95), (0.85, 0.95)]],
    3: [[(0.2, 0.1), (0.75, 0.1), (0.45, 0.45), (0.75, 0.55), (0.8, 0.8), (0.6, 0.95), (0.2, 0.9)]],
    4: [[(0.65, 0.95), (0.65, 0.05), (0.15, 0.65), (0.85, 0.65)]],
    5: [[(0.8, 0.05), (0.25, 0.05), (0.2, 0.45), (0.6, 0.4), (0.8, 0.6), (0.75, 0.85), (0.5, 0.95), (0.2, 0.88)]],
    6: [[(0.75, 0.08), (0.45, 0.1), (0.25, 0.4), (0.2, 0.75), (0.4, 0.95), (0.7, 0.9), (0.78, 0.7), (0.6, 0.52),
         (0.35, 0.55), (0.22, 0.7)]],
    7: [[(0.15, 0.08), (0.85, 0.08), (0.4, 0.95)]],
    8: [_loop(0.5, 0.28, 0.24, 0.2), _loop(0.5, 0.72, 0.3, 0.23)],
    9: [_loop(0.5, 0.3, 0.27, 0.22), [(0.77, 0.3), (0.7, 0.95)]],
}


@dataclass(frozen=True)
class StrokeSceneConfig:
    """What :func:`ensure_stroke_scenes` generates (the cache folder is named after it)."""

    image_size: int = 64
    num_train: int = 1000
    num_val: int = 200
    min_objects: int = 1
    max_objects: int = 3
    min_size: float = 0.28  # a digit's height as a share of the image side
    max_size: float = 0.45
    captions_per_image: int = 5
    seed: int = 0

    def key(self) -> str:
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]
        return f"strokes-coco-v{_VERSION}-{digest}"


def _stroke_mask(rng: np.random.Generator, digit: int, height: float, side: int) -> np.ndarray:
    """A float ink mask ``[side, side]`` of ``digit`` drawn as a pen stroke about ``height`` px tall,
    centred."""
    big = side * _SUPERSAMPLE
    canvas = np.zeros((big, big), np.uint8)
    angle = np.deg2rad(rng.uniform(-15, 15))
    shear = rng.uniform(-0.25, 0.25)
    scale = height * _SUPERSAMPLE
    width = scale * rng.uniform(0.55, 0.75)
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]) @ np.array([[1, shear], [0, 1]])
    thickness = max(1, int(round(scale * rng.uniform(0.07, 0.13))))
    for stroke in SKELETONS[digit]:
        pts = np.asarray(stroke, np.float64) + rng.normal(0, 0.025, (len(stroke), 2))
        pts = (pts - 0.5) * [width, scale]
        pts = pts @ rot.T + big / 2
        cv2.polylines(canvas, [np.round(pts).astype(np.int32)], False, 255, thickness, cv2.LINE_AA)
    return cv2.resize(canvas, (side, side), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    t = np.linspace(0, 1, size)[:, None, None]
    grad = a * (1 - t) + b * t
    img = np.broadcast_to(grad if rng.random() < 0.5 else grad.transpose(1, 0, 2), (size, size, 3)).copy()
    img += rng.normal(0, 8, img.shape)
    for _ in range(int(rng.integers(1, 4))):  # stray pen lines, fainter than the digits
        pts = rng.uniform(0, size, (3, 2)).astype(np.int32)
        colour = tuple(float(c) for c in rng.uniform(0, 255, 3))
        overlay = img.copy()
        cv2.polylines(overlay, [pts], False, colour, 1, cv2.LINE_AA)
        img = 0.6 * img + 0.4 * overlay
    return img


def _contrasting(rng: np.random.Generator, under: np.ndarray) -> np.ndarray:
    """An ink colour far from the mean colour ``under`` it."""
    for _ in range(20):
        colour = rng.uniform(0, 255, 3)
        if np.abs(colour - under).sum() > 220:
            return colour
    return 255.0 - under


def _place(rng: np.random.Generator, n: int, size: int, heights: list[float]) -> tuple[str, list[tuple[float, float]]]:
    """A layout (``row``, ``column`` or ``scatter``) and the centre of each of ``n`` digits."""
    layout = "single" if n == 1 else str(rng.choice(["row", "column", "scatter"]))
    for _ in range(100):
        if layout == "row":
            xs = np.sort(rng.uniform(0.2, 0.8, n)) * size
            centres = [(x, rng.uniform(0.4, 0.6) * size) for x in xs]
        elif layout == "column":
            ys = np.sort(rng.uniform(0.2, 0.8, n)) * size
            centres = [(rng.uniform(0.4, 0.6) * size, y) for y in ys]
        else:
            centres = [tuple(rng.uniform(0.2, 0.8, 2) * size) for _ in range(n)]
        boxes = [(cx - 0.4 * h, cy - 0.55 * h, cx + 0.4 * h, cy + 0.55 * h) for (cx, cy), h in zip(centres, heights,
                                                                                                   strict=True)]
        if all(a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
               for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            return layout, centres
    return layout, centres[:1]


def render_stroke_scene(rng: np.random.Generator, size: int, digits: list[int], min_size: float = 0.28,
                        max_size: float = 0.45) -> tuple[np.ndarray, list[tuple[int, np.ndarray]], str]:
    """A scene of ``digits`` (fewer when they do not fit): the RGB image ``[size, size, 3]`` uint8,
    ``(digit, boolean mask [size, size])`` of each drawn digit and the layout name."""
    heights = [rng.uniform(min_size, max_size) * size for _ in digits]
    layout, centres = _place(rng, len(digits), size, heights)
    img = _background(rng, size)
    placed = []
    for digit, height, (cx, cy) in zip(digits, heights, centres, strict=False):
        ink = _stroke_mask(rng, digit, height, size)
        shift = np.float32([[1, 0, cx - size / 2], [0, 1, cy - size / 2]])
        ink = cv2.warpAffine(ink, shift, (size, size), flags=cv2.INTER_LINEAR, borderValue=0.0)
        mask = ink > 0.5
        if mask.sum() < 4:
            continue
        colour = _contrasting(rng, img[mask].mean(0))
        img = img * (1 - ink[..., None]) + colour * ink[..., None]
        placed.append((digit, mask))
    return np.clip(img, 0, 255).astype(np.uint8), placed, layout


def _box(mask: np.ndarray) -> tuple[float, float, float, float]:
    ys, xs = np.nonzero(mask)
    return float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1)


def mask_to_rle(mask: np.ndarray) -> dict:
    """COCO's uncompressed RLE of a boolean mask ``[H, W]``: run lengths of the column-major
    pixels, starting with a run of zeros."""
    flat = np.asarray(mask, bool).flatten(order="F")
    change = np.flatnonzero(np.diff(flat.astype(np.int8))) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat.size and flat[0]:
        counts = [0, *counts]
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": [int(c) for c in counts]}


_ONE = ["a handwritten {a}", "a single {a} drawn in ink", "the number {a} on a noisy background",
        "a {a} written by hand", "just a {a}"]
_ROW = ["a {a} written to the left of a {b}", "a {b} drawn right of a {a}", "handwritten {a} and {b} side by side",
        "the number {a} beside the number {b}", "{a} then {b} in one line"]
_COLUMN = ["a {a} written above a {b}", "a {b} under a {a}", "the number {a} on top of the number {b}",
           "the number {b} beneath the number {a}", "{a} and {b} stacked"]
_MANY = ["the numbers {all} written by hand", "handwritten {all}", "a {first} and {rest}", "some ink digits: {all}",
         "{all} drawn in ink"]


def describe_strokes(rng: np.random.Generator, placed: list[tuple[int, np.ndarray]], num: int = 5) -> list[str]:
    """``num`` captions of a stroke scene: the digits as words, in reading order, and for two
    digits the relation along the axis they differ most on."""
    if not placed:
        return ["an empty page"] * num
    centres = [(d, *np.argwhere(m).mean(0)[::-1]) for d, m in placed]  # (digit, x, y)
    if len(centres) == 2:
        (da, xa, ya), (db, xb, yb) = centres
        horizontal = abs(xb - xa) >= abs(yb - ya)
        first_is_a = (xa <= xb) if horizontal else (ya <= yb)
        a, b = (da, db) if first_is_a else (db, da)
        pool = [t.format(a=DIGIT_WORDS[a], b=DIGIT_WORDS[b]) for t in (_ROW if horizontal else _COLUMN)]
    elif len(centres) == 1:
        pool = [t.format(a=DIGIT_WORDS[centres[0][0]]) for t in _ONE]
    else:
        words = [DIGIT_WORDS[d] for d, _, _ in sorted(centres, key=lambda c: (c[1], c[2]))]
        listing = ", ".join(words[:-1]) + " and " + words[-1]
        pool = [t.format(all=listing, first=words[0], rest=" and ".join(f"a {w}" for w in words[1:])) for t in _MANY]
    pool = [re.sub(r"\ba (?=eight\b)", "an ", text) for text in pool]
    order = rng.permutation(len(pool))
    return [pool[i] for i in (list(order) * (num // len(pool) + 1))[:num]]


def _write_split(root: Path, split: str, count: int, config: StrokeSceneConfig, rng: np.random.Generator,
                 ids: dict[str, int]) -> None:
    (root / split).mkdir()
    images, annotations, captions = [], [], []
    for _ in range(count):
        n = int(rng.integers(config.min_objects, config.max_objects + 1))
        digits = [int(d) for d in rng.integers(0, 10, n)]
        img, placed, _ = render_stroke_scene(rng, config.image_size, digits, config.min_size, config.max_size)
        image_id = ids["image"]
        name = f"{image_id:012d}.png"
        if not cv2.imwrite(str(root / split / name), cv2.cvtColor(img, cv2.COLOR_RGB2BGR)):
            raise OSError(f"OpenCV could not write {root / split / name}")
        images.append({"id": image_id, "file_name": name, "width": config.image_size, "height": config.image_size})
        for digit, mask in placed:
            annotations.append({"id": ids["ann"], "image_id": image_id, "category_id": digit + 1,
                                "bbox": list(_box(mask)), "area": float(mask.sum()), "iscrowd": 0,
                                "segmentation": mask_to_rle(mask)})
            ids["ann"] += 1
        for text in describe_strokes(rng, placed, config.captions_per_image):
            captions.append({"id": ids["caption"], "image_id": image_id, "caption": text})
            ids["caption"] += 1
        ids["image"] += 1
    info = {"description": "vision_attn hand-drawn stroke digit scenes", "config": asdict(config)}
    categories = [{"id": i + 1, "name": w, "supercategory": "digit"} for i, w in enumerate(DIGIT_WORDS)]
    (root / "annotations" / f"instances_{split}.json").write_text(
        json.dumps({"info": info, "images": images, "annotations": annotations, "categories": categories}))
    (root / "annotations" / f"captions_{split}.json").write_text(
        json.dumps({"info": info, "images": images, "annotations": captions}))


def ensure_stroke_scenes(config: StrokeSceneConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """The stroke scenes of ``config`` (generated on first use, in one rename, under ``cache_dir``,
    default ``$VISION_ATTN_DATA`` or ``~/.cache/vision_attn``); returns the dataset root."""
    config = config or StrokeSceneConfig()
    target = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / config.key()
    if (target / "manifest.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        log.info("generating stroke digit scenes into %s", target)
        (tmp / "annotations").mkdir()
        ids = {"image": 1, "ann": 1, "caption": 1}
        for offset, (split, count) in enumerate((("train", config.num_train), ("val", config.num_val))):
            _write_split(tmp, split, count, config, np.random.default_rng([config.seed, 900 + offset]), ids)
        (tmp / "manifest.json").write_text(json.dumps({"task": "coco", "config": asdict(config)}, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
