"""Digits drawn in Hershey fonts: single glyphs (the small-image classification set) and digit
scenes with their tight ink boxes and template captions (the digit COCO scenes of
:mod:`vision_attn.data.synthetic`)."""

from __future__ import annotations

import cv2
import numpy as np

from vision_attn.data.scenes import _SUPERSAMPLE, COLOURS, _overlap

__all__ = ["DIGIT_WORDS", "GLYPHS", "describe_digits", "render_digit_scene", "render_glyph"]

GLYPHS: tuple[str, ...] = tuple("0123456789")
_FONTS = (
    cv2.FONT_HERSHEY_SIMPLEX,
    cv2.FONT_HERSHEY_DUPLEX,
    cv2.FONT_HERSHEY_COMPLEX,
    cv2.FONT_HERSHEY_TRIPLEX,
    cv2.FONT_HERSHEY_COMPLEX_SMALL,
    cv2.FONT_HERSHEY_SCRIPT_SIMPLEX,
    cv2.FONT_HERSHEY_PLAIN,
)


def render_glyph(rng: np.random.Generator, char: str, size: int, noise: float = 6.0, clutter: int = 3) -> np.ndarray:
    """One digit in a random Hershey font, scale, stroke, colour, slant and position (RGB uint8)."""
    s = _SUPERSAMPLE
    side = size * s
    bg = int(rng.integers(10, 90))
    canvas = np.full((side, side, 3), bg, np.uint8)
    for _ in range(clutter):
        p0 = tuple(int(v) for v in rng.integers(0, side, 2))
        p1 = tuple(int(v) for v in rng.integers(0, side, 2))
        level = int(rng.integers(60, 140))
        cv2.line(canvas, p0, p1, (level,) * 3, max(1, s // 2), cv2.LINE_AA)
    font = int(rng.choice(_FONTS))
    thickness = int(rng.integers(1, 3)) * s
    target = rng.uniform(0.5, 0.85) * side
    (tw, th), _ = cv2.getTextSize(char, font, 1.0, thickness)
    scale = target / max(th, 1)
    (tw, th), base = cv2.getTextSize(char, font, scale, thickness)
    x = int(rng.uniform(0, max(1, side - tw)))
    y = int(rng.uniform(th, max(th + 1, side - base)))
    colour = COLOURS[str(rng.choice(list(COLOURS)))]
    layer = np.zeros_like(canvas)
    cv2.putText(layer, char, (x, y), font, scale, colour, thickness, cv2.LINE_AA)
    angle = float(rng.uniform(-20, 20))
    rot = cv2.getRotationMatrix2D((side / 2, side / 2), angle, 1.0)
    layer = cv2.warpAffine(layer, rot, (side, side), flags=cv2.INTER_LINEAR)
    ink = layer.max(axis=-1, keepdims=True) > 0
    canvas = np.where(ink, layer, canvas)
    img = cv2.resize(canvas, (size, size), interpolation=cv2.INTER_AREA)
    if noise > 0:
        img = np.clip(img.astype(np.float32) + rng.normal(0, noise, img.shape), 0, 255).astype(np.uint8)
    return img


DIGIT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _digit_layer(rng: np.random.Generator, char: str, height: float, side: int) -> np.ndarray:
    """A ``[side, side]`` uint8 ink mask of one digit of about ``height`` pixels, drawn at the
    centre in a random Hershey font, stroke and slant."""
    font = int(rng.choice(_FONTS))
    thickness = max(1, int(round(height * rng.uniform(0.06, 0.14))))
    (_, th), _ = cv2.getTextSize(char, font, 1.0, thickness)
    scale = height / max(th, 1)
    (tw, th), base = cv2.getTextSize(char, font, scale, thickness)
    layer = np.zeros((side, side), np.uint8)
    cv2.putText(layer, char, (int((side - tw) / 2), int((side + th) / 2)), font, scale, 255, thickness, cv2.LINE_AA)
    rot = cv2.getRotationMatrix2D((side / 2, side / 2), float(rng.uniform(-15, 15)), 1.0)
    return cv2.warpAffine(layer, rot, (side, side), flags=cv2.INTER_LINEAR)


def render_digit_scene(rng: np.random.Generator, size: int, digits: list[int], min_size: float, max_size: float,
                       noise: float = 8.0, clutter: int = 2) -> tuple[np.ndarray, list[tuple[int, tuple[float, ...]]]]:
    """Grey digits on a dark, noisy picture. Returns the RGB ``uint8`` image and, per placed
    digit, ``(digit, (x0, y0, x1, y1))``: the tight box of its ink in pixels of the image."""
    s = _SUPERSAMPLE
    side = size * s
    canvas = np.full((side, side), int(rng.integers(0, 60)), np.float32)
    for _ in range(clutter):
        p0 = tuple(int(v) for v in rng.integers(0, side, 2))
        p1 = tuple(int(v) for v in rng.integers(0, side, 2))
        cv2.line(canvas, p0, p1, float(rng.integers(50, 110)), max(1, s // 2), cv2.LINE_AA)
    placed: list[tuple[int, tuple[float, ...]]] = []
    for digit in digits:
        for _attempt in range(30):
            height = rng.uniform(min_size, max_size) * side
            cell = int(2 * height)
            mask = _digit_layer(rng, GLYPHS[digit], height, cell)
            ys, xs = np.nonzero(mask > 64)
            if len(xs) == 0:
                continue
            x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
            ox = int(rng.integers(-x0, max(-x0 + 1, side - x1)))
            oy = int(rng.integers(-y0, max(-y0 + 1, side - y1)))
            box = ((x0 + ox) / s, (y0 + oy) / s, (x1 + ox) / s, (y1 + oy) / s)
            if all(_overlap(box, other) <= 0.05 for _, other in placed):
                break
        else:
            continue
        # paste the mask at the offset, clipped to the canvas
        sx0, sy0 = max(0, ox), max(0, oy)
        sx1, sy1 = min(side, ox + cell), min(side, oy + cell)
        alpha = mask[sy0 - oy:sy1 - oy, sx0 - ox:sx1 - ox].astype(np.float32) / 255.0
        ink = float(rng.integers(150, 256))
        region = canvas[sy0:sy1, sx0:sx1]
        canvas[sy0:sy1, sx0:sx1] = region * (1 - alpha) + ink * alpha
        placed.append((digit, box))
    img = cv2.resize(canvas, (size, size), interpolation=cv2.INTER_AREA)
    if noise > 0:
        img = img + rng.normal(0, noise, img.shape)
    grey = np.clip(img, 0, 255).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=-1), placed


def describe_digits(rng: np.random.Generator, placed: list[tuple[int, tuple[float, ...]]], num: int = 5) -> list[str]:
    """``num`` template captions of a digit scene: the digits as words in reading order, and the
    relation of the first two ("a two above a zero")."""
    items = sorted(placed, key=lambda p: ((p[1][0] + p[1][2]) / 2, (p[1][1] + p[1][3]) / 2))
    if not items:
        return ["an empty picture"] * num
    words = [DIGIT_WORDS[d] for d, _ in items]
    named = [f"a {w}" for w in words]

    def listing(parts: list[str]) -> str:
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]

    # No count words: in a set of digits "two" names a digit (as content accuracy reads it).
    noun = "digit" if len(items) == 1 else "digits"
    candidates = [listing(named), f"a picture of {listing(named)}", f"the {noun} {listing(words)}",
                  f"there is {listing(named)}" if len(items) == 1 else f"there are {listing(named)}"]
    if len(items) >= 2:
        a, b = items[0][1], items[1][1]
        dx = (b[0] + b[2]) / 2 - (a[0] + a[2]) / 2
        dy = (b[1] + b[3]) / 2 - (a[1] + a[3]) / 2
        if abs(dx) >= abs(dy):
            rel, inv = ("to the left of", "to the right of") if dx > 0 else ("to the right of", "to the left of")
        else:
            rel, inv = ("above", "below") if dy > 0 else ("below", "above")
        rest = f" and {listing(named[2:])}" if len(items) > 2 else ""
        candidates += [f"{named[0]} {rel} {named[1]}{rest}", f"{named[1]} {inv} {named[0]}{rest}"]
    else:
        candidates.append(f"a single {words[0]}")
    order = rng.permutation(len(candidates))
    return [candidates[i] for i in (list(order) * (num // len(order) + 1))[:num]]
