"""Scenes of coloured shapes: what a scene holds (its objects, their boxes, its descriptions in
words) and how it is drawn. The embedded datasets (:mod:`vision_attn.data.synthetic`) write them
in the classification, detection and captioning layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import cv2
import numpy as np

__all__ = ["COLOURS", "SHAPES", "Scene", "SceneObject", "random_scene", "render_scene"]

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {  # RGB
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "magenta": (220, 50, 220),
    "cyan": (40, 220, 230),
    "white": (245, 245, 245),
}
_SUPERSAMPLE = 4  # draw at 4x and downsample: smooth edges at 32 px


@dataclass
class SceneObject:
    """One shape in a scene. ``box`` is ``(x0, y0, x1, y1)`` in pixels of the rendered image."""

    kind: str
    colour: str
    center: tuple[float, float]
    size: float  # diameter of the circumscribed circle, pixels
    angle: float  # degrees
    box: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @property
    def box_xywh(self) -> tuple[float, float, float, float]:
        x0, y0, x1, y1 = self.box
        return (x0, y0, x1 - x0, y1 - y0)


_NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass
class Scene:
    """A scene: image size and its objects, drawn in list order (later objects on top)."""

    width: int
    height: int
    objects: list[SceneObject] = field(default_factory=list)
    background: tuple[int, int, int] = (40, 40, 40)

    def _size_word(self, obj: SceneObject) -> str:
        rel = obj.size / min(self.width, self.height)
        return "small " if rel < 0.3 else ("large " if rel > 0.6 else "")

    def _where(self, obj: SceneObject) -> str:
        col = ("left", "center", "right")[min(2, int(3 * obj.center[0] / self.width))]
        row = ("top", "middle", "bottom")[min(2, int(3 * obj.center[1] / self.height))]
        if row == "middle" and col == "center":
            return "in the center"
        if row == "middle":
            return f"on the {col}"
        if col == "center":
            return f"at the {row}"
        return f"in the {row} {col}"

    @staticmethod
    def _relation(a: SceneObject, b: SceneObject) -> str:
        dx, dy = b.center[0] - a.center[0], b.center[1] - a.center[1]
        if abs(dx) >= abs(dy):
            return "to the left of" if dx > 0 else "to the right of"
        return "above" if dy > 0 else "below"

    def describe(self, rng: np.random.Generator, num: int = 5) -> list[str]:
        """``num`` different captions of the scene: kinds, colours, sizes, counts, positions.

        Every caption names each object's colour and kind (so they can be learned and
        checked); phrasings vary: plain lists, counts, absolute and relative positions.
        """
        # Objects in reading order (left to right, then top to bottom): a caption's order must
        # be something one can see in the image, not the order in which shapes were drawn.
        objs = sorted(self.objects, key=lambda o: (o.center[0], o.center[1]))
        if not objs:
            return ["an empty picture"] * num
        names = [f"a {o.colour} {o.kind}" for o in objs]
        sized = [f"a {self._size_word(o)}{o.colour} {o.kind}" for o in objs]
        placed = [f"{n} {self._where(o)}" for n, o in zip(sized, objs, strict=True)]

        def listing(items: list[str]) -> str:
            return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

        count = _NUMBERS[len(objs)] if len(objs) < len(_NUMBERS) else str(len(objs))
        noun = "shape" if len(objs) == 1 else "shapes"
        candidates = [
            listing(names),
            listing(sized),
            listing(placed),
            f"{count} {noun}: {listing(names)}",
            f"there is {listing(placed)}" if len(objs) == 1 else f"there are {listing(names)}",
        ]
        if len(objs) >= 2:
            a, b = objs[0], objs[1]
            candidates.append(f"{names[0]} {self._relation(a, b)} {names[1]}" + (
                f" and {listing(names[2:])}" if len(objs) > 2 else ""))
        order = rng.permutation(len(candidates))
        return [candidates[i] for i in (list(order) * (num // len(order) + 1))[:num]]


def _polygon(kind: str, cx: float, cy: float, size: float, angle: float) -> np.ndarray | None:
    """Vertices ``[K, 2]`` of a shape (``None`` for the circle)."""
    r = size / 2.0
    if kind == "circle":
        return None
    if kind == "square":
        pts = [(math.cos(math.radians(45 + 90 * i)), math.sin(math.radians(45 + 90 * i))) for i in range(4)]
    elif kind == "triangle":
        pts = [(math.cos(math.radians(-90 + 120 * i)), math.sin(math.radians(-90 + 120 * i))) for i in range(3)]
    elif kind == "star":
        pts = []
        for i in range(10):
            rad = 1.0 if i % 2 == 0 else 0.45
            a = math.radians(-90 + 36 * i)
            pts.append((rad * math.cos(a), rad * math.sin(a)))
    elif kind == "cross":
        w = 0.33
        base = [(-w, -1), (w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w), (-1, w), (-1, -w),
                (-w, -w)]
        pts = [(x / math.sqrt(1 + w * w), y / math.sqrt(1 + w * w)) for x, y in base]
    else:
        raise ValueError(f"unknown shape kind {kind!r}; known: {', '.join(SHAPES)}")
    t = math.radians(angle)
    rot = np.array([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])
    return (np.array(pts) @ rot.T) * r + np.array([cx, cy])


def object_polygon(obj: SceneObject, circle_vertices: int = 32) -> list[float]:
    """The shape's outline as a COCO polygon ``[x1, y1, x2, y2, ...]`` in pixels of the rendered
    image (a circle as a regular polygon of ``circle_vertices``); the whole shape, also where a
    later object covers it."""
    poly = _polygon(obj.kind, obj.center[0], obj.center[1], obj.size, obj.angle)
    if poly is None:
        a = np.arange(circle_vertices) * (2 * math.pi / circle_vertices)
        poly = np.stack([np.cos(a), np.sin(a)], 1) * (obj.size / 2.0) + np.array(obj.center)
    return [round(float(v), 2) for v in poly.reshape(-1)]


def _object_box(obj: SceneObject, width: int, height: int) -> tuple[float, float, float, float]:
    poly = _polygon(obj.kind, obj.center[0], obj.center[1], obj.size, obj.angle)
    if poly is None:
        r = obj.size / 2.0
        x0, y0, x1, y1 = obj.center[0] - r, obj.center[1] - r, obj.center[0] + r, obj.center[1] + r
    else:
        x0, y0 = poly.min(axis=0)
        x1, y1 = poly.max(axis=0)
    return (max(0.0, float(x0)), max(0.0, float(y0)), min(float(width), float(x1)), min(float(height), float(y1)))


def random_scene(
    rng: np.random.Generator,
    width: int,
    height: int,
    num_objects: int = 1,
    min_size: float = 0.35,
    max_size: float = 0.75,
    kinds: tuple[str, ...] = SHAPES,
    max_overlap: float = 0.3,
    rotate: bool = True,
) -> Scene:
    """Draw a random scene.

    Args:
        rng: numpy random generator (the only source of randomness: same seed, same scene).
        width: image width in pixels.
        height: image height in pixels.
        num_objects: shapes to place.
        min_size: smallest shape diameter as a fraction of ``min(width, height)``.
        max_size: largest shape diameter as a fraction of ``min(width, height)``.
        kinds: shape kinds to draw from.
        max_overlap: largest allowed intersection-over-smaller-box between two objects
            (placement is retried a few times, then accepted).
        rotate: rotate each shape by a random angle.
    """
    side = min(width, height)
    bg_level = int(rng.integers(10, 90))
    tint = rng.integers(-12, 13, size=3)
    background = tuple(int(np.clip(bg_level + t, 0, 255)) for t in tint)
    scene = Scene(width=width, height=height, background=background)
    for _ in range(num_objects):
        for _attempt in range(20):
            size = float(rng.uniform(min_size, max_size) * side)
            r = size / 2.0
            cx = float(rng.uniform(r, width - r)) if width > size else width / 2.0
            cy = float(rng.uniform(r, height - r)) if height > size else height / 2.0
            obj = SceneObject(
                kind=str(rng.choice(kinds)),
                colour=str(rng.choice(list(COLOURS))),
                center=(cx, cy),
                size=size,
                angle=float(rng.uniform(0, 360)) if rotate else 0.0,
            )
            obj.box = _object_box(obj, width, height)
            if all(_overlap(obj.box, other.box) <= max_overlap for other in scene.objects):
                break
        scene.objects.append(obj)
    return scene


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return (ix * iy) / smaller if smaller > 0 else 0.0


def render_scene(scene: Scene, rng: np.random.Generator, noise: float = 6.0, clutter: int = 3) -> np.ndarray:
    """Render a scene to an RGB ``uint8`` array ``[H, W, 3]``.

    Args:
        scene: what to draw.
        rng: randomness for noise and clutter.
        noise: standard deviation of the Gaussian pixel noise (0 for none).
        clutter: number of thin random line segments drawn under the shapes (distractors that
            belong to no class).
    """
    s = _SUPERSAMPLE
    h, w = scene.height * s, scene.width * s
    canvas = np.empty((h, w, 3), np.uint8)
    canvas[:] = scene.background
    for _ in range(clutter):
        p0 = tuple(int(v) for v in rng.integers(0, [w, h]))
        p1 = tuple(int(v) for v in rng.integers(0, [w, h]))
        level = int(rng.integers(60, 140))
        cv2.line(canvas, p0, p1, (level, level, level), thickness=max(1, s // 2), lineType=cv2.LINE_AA)
    for obj in scene.objects:
        colour = COLOURS[obj.colour]
        poly = _polygon(obj.kind, obj.center[0] * s, obj.center[1] * s, obj.size * s, obj.angle)
        if poly is None:
            center = (int(round(obj.center[0] * s)), int(round(obj.center[1] * s)))
            cv2.circle(canvas, center, int(round(obj.size * s / 2)), colour, thickness=-1, lineType=cv2.LINE_AA)
        else:
            cv2.fillPoly(canvas, [np.round(poly).astype(np.int32)], colour, lineType=cv2.LINE_AA)
    img = cv2.resize(canvas, (scene.width, scene.height), interpolation=cv2.INTER_AREA)
    if noise > 0:
        img = np.clip(img.astype(np.float32) + rng.normal(0, noise, img.shape), 0, 255).astype(np.uint8)
    return img
