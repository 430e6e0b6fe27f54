"""The embedded synthetic "shapes" data: seeded scenes of coloured shapes, in standard layouts.

Nothing can be downloaded at run time, so the suite carries its own data: scenes of simple
shapes (circle, square, triangle, star, cross) in several colours, sizes, positions and
rotations, on noisy backgrounds with optional clutter. Every scene knows its objects (kind,
colour, box in pixels) and can describe itself in words, so the same generator serves
classification (ImageFolder, class = the shape), detection (COCO boxes) and captioning (COCO
captions).

Datasets are written once into a cache folder (``$VISION_ATTN_DATA`` or
``~/.cache/vision_attn``) whose name encodes every generation parameter, atomically (a
half-written folder is never used), and reused afterwards.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import cv2
import numpy as np

__all__ = [
    "COLOURS",
    "DIGIT_WORDS",
    "DigitSceneConfig",
    "SHAPES",
    "Scene",
    "SceneObject",
    "ShapesConfig",
    "default_cache_dir",
    "SceneSetConfig",
    "describe_digits",
    "ensure_digit_scenes_coco",
    "ensure_glyphs_classification",
    "ensure_shapes_coco",
    "ensure_shapes_classification",
    "random_scene",
    "render_digit_scene",
    "render_scene",
]

log = logging.getLogger(__name__)

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
_FORMAT_VERSION = 1
# Per family: shapes 2 adds the boxes (ROOT/annotations/instances_<split>.json); glyphs stay 1.
_FAMILY_VERSIONS = {"shapes": 2}
_COCO_FORMAT_VERSION = 2  # 2: captions list objects left to right


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


@dataclass
class ShapesConfig:
    """Parameters of the embedded shapes dataset (each value is part of the cache key).

    Args:
        image_size: side of the square images in pixels.
        num_train: training images.
        num_val: validation images.
        num_test: test images (0 = no test split).
        seed: generator seed.
        noise: Gaussian pixel-noise standard deviation.
        clutter: distractor line segments per image.
        min_size: smallest shape, fraction of the image side.
        max_size: largest shape, fraction of the image side.
    """

    image_size: int = 32
    num_train: int = 2000
    num_val: int = 500
    num_test: int = 0
    seed: int = 0
    noise: float = 6.0
    clutter: int = 3
    min_size: float = 0.4
    max_size: float = 0.8

    def key(self, task: str, family: str = "shapes") -> str:
        c = self
        return (
            f"{family}-{task}-v{_FAMILY_VERSIONS.get(family, _FORMAT_VERSION)}-s{c.image_size}"
            f"-n{c.num_train}-{c.num_val}-{c.num_test}"
            f"-seed{c.seed}-noise{c.noise:g}-clutter{c.clutter}-size{c.min_size:g}-{c.max_size:g}"
        )


def default_cache_dir() -> Path:
    """``$VISION_ATTN_DATA`` if set, else ``~/.cache/vision_attn``."""
    env = os.environ.get("VISION_ATTN_DATA")
    return Path(env) if env else Path.home() / ".cache" / "vision_attn"


def _write_png(path: Path, rgb: np.ndarray) -> None:
    if not cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)):
        raise OSError(f"OpenCV could not write {path}")


def _atomic_dataset(target: Path, build) -> Path:
    """Run ``build(tmp_dir)`` and move the result to ``target`` in one rename."""
    if (target / "manifest.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (or a stale folder without manifest is there).
            if (target / "manifest.json").is_file():
                return target
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _ensure_imagefolder(
    config: ShapesConfig,
    cache_dir: str | Path | None,
    family: str,
    classes: list[str],
    render,
    seed_base: int,
) -> Path:
    """Write ``ROOT/<split>/<class>/<index>.png`` once (atomically); image ``i`` has class
    ``i % len(classes)`` (balanced) and pixels ``render(rng, class_index)``. A ``render`` that
    returns ``(pixels, scene)`` also gets ``ROOT/annotations/instances_<split>.json``: the
    scene's boxes in COCO format, ``file_name`` = the image's path relative to ``ROOT``."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / config.key("cls", family=family)
    categories = [{"id": i + 1, "name": name, "supercategory": family} for i, name in enumerate(classes)]

    def build(tmp: Path) -> None:
        log.info("generating %s classification data into %s", family, target)
        splits = {"train": config.num_train, "val": config.num_val, "test": config.num_test}
        annotation_files: dict[str, str] = {}
        image_id, ann_id = 1, 1
        for offset, (split, count) in enumerate(splits.items()):
            if count <= 0:
                continue
            rng = np.random.default_rng([config.seed, seed_base + offset])
            for name in classes:
                (tmp / split / name).mkdir(parents=True, exist_ok=True)
            images, boxes = [], []
            for i in range(count):
                label = i % len(classes)
                rendered = render(rng, label)
                pixels, scene = rendered if isinstance(rendered, tuple) else (rendered, None)
                rel = f"{split}/{classes[label]}/{i:06d}.png"
                _write_png(tmp / rel, pixels)
                if scene is None:
                    continue
                images.append({"id": image_id, "file_name": rel, "width": scene.width, "height": scene.height})
                for obj in scene.objects:
                    x, y, w, h = (round(v, 2) for v in obj.box_xywh)
                    boxes.append({"id": ann_id, "image_id": image_id, "category_id": classes.index(obj.kind) + 1,
                                  "bbox": [x, y, w, h], "area": round(w * h, 2), "iscrowd": 0,
                                  "colour": obj.colour})
                    ann_id += 1
                image_id += 1
            if images:
                info = {"description": f"vision_attn synthetic {family}: boxes of the classification images",
                        "config": asdict(config)}
                annotation_files[split] = f"annotations/instances_{split}.json"
                (tmp / "annotations").mkdir(exist_ok=True)
                coco = {"info": info, "images": images, "annotations": boxes, "categories": categories}
                (tmp / annotation_files[split]).write_text(json.dumps(coco))
        manifest = {"task": "classification", "classes": classes, "config": asdict(config)}
        if annotation_files:
            manifest["annotations"] = annotation_files
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))

    return _atomic_dataset(target, build)


def ensure_shapes_classification(config: ShapesConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """The shapes classification dataset as an ImageFolder root, generated on first use.

    Layout: ``ROOT/{train,val[,test]}/<shape>/<index>.png`` with one main shape per image whose
    kind is the class, plus clutter lines, and ``ROOT/annotations/instances_<split>.json``: each
    image's shape box in COCO format (``file_name`` = the path relative to ``ROOT``, as
    ``predictions.json`` names it; categories 1..5 in the order of :data:`SHAPES`), named in
    ``manifest.json`` under ``"annotations"`` (``eval.py`` finds them there for the
    localisation metrics). Returns ``ROOT``.
    """
    config = config or ShapesConfig()

    def render(rng: np.random.Generator, label: int) -> np.ndarray:
        size = config.image_size
        scene = random_scene(rng, size, size, 1, config.min_size, config.max_size, kinds=(SHAPES[label],))
        return render_scene(scene, rng, noise=config.noise, clutter=config.clutter), scene

    return _ensure_imagefolder(config, cache_dir, "shapes", list(SHAPES), render, seed_base=0)


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


def ensure_glyphs_classification(config: ShapesConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """A second small-image dataset: ten digit classes drawn in seven fonts (ImageFolder root).

    Harder than the shapes (fonts, slant, stroke width, colours, clutter): a CIFAR-sized test
    bed for ``configs/classification/small.yaml``. Uses ``config``'s sizes, seed and noise.
    """
    config = config or ShapesConfig(num_train=10000, num_val=2000)

    def render(rng: np.random.Generator, label: int) -> np.ndarray:
        return render_glyph(rng, GLYPHS[label], config.image_size, config.noise, config.clutter)

    classes = [f"digit_{c}" for c in GLYPHS]
    return _ensure_imagefolder(config, cache_dir, "glyphs", classes, render, seed_base=100)



@dataclass
class SceneSetConfig:
    """Parameters of the embedded multi-object scenes (COCO detection + captions layout).

    Args:
        image_size: side of the square images in pixels.
        num_train: training images.
        num_val: validation images.
        min_objects: fewest shapes per image.
        max_objects: most shapes per image.
        min_size: smallest shape, fraction of the image side.
        max_size: largest shape, fraction of the image side.
        max_overlap: largest intersection over the smaller box between two shapes.
        captions_per_image: reference captions written per image.
        seed: generator seed.
        noise: Gaussian pixel-noise standard deviation.
        clutter: distractor line segments per image.
    """

    image_size: int = 64
    num_train: int = 2000
    num_val: int = 200
    min_objects: int = 1
    max_objects: int = 4
    min_size: float = 0.15
    max_size: float = 0.45
    max_overlap: float = 0.3
    captions_per_image: int = 5
    seed: int = 0
    noise: float = 6.0
    clutter: int = 2

    def key(self) -> str:
        c = self
        return (
            f"shapes-coco-v{_COCO_FORMAT_VERSION}-s{c.image_size}-n{c.num_train}-{c.num_val}"
            f"-obj{c.min_objects}-{c.max_objects}"
            f"-size{c.min_size:g}-{c.max_size:g}-ov{c.max_overlap:g}-cap{c.captions_per_image}-seed{c.seed}"
            f"-noise{c.noise:g}-clutter{c.clutter}"
        )


def _write_coco_scenes(tmp: Path, config: SceneSetConfig, categories: list[dict], description: str, seed_base: int,
                       draw) -> None:
    """Write ``tmp/{train,val}/<id>.png`` and ``tmp/annotations/{instances,captions}_<split>.json``:
    each image is ``draw(rng) -> (pixels, [(category id, (x, y, w, h), extra keys)], captions)``;
    image, box and caption ids unique across splits."""
    (tmp / "annotations").mkdir(parents=True)
    image_id, ann_id, cap_id = 1, 1, 1
    for offset, (split, count) in enumerate((("train", config.num_train), ("val", config.num_val))):
        rng = np.random.default_rng([config.seed, seed_base + offset])
        (tmp / split).mkdir()
        images, boxes, captions = [], [], []
        for _ in range(count):
            img, objects, texts = draw(rng)
            name = f"{image_id:012d}.png"
            _write_png(tmp / split / name, img)
            images.append({"id": image_id, "file_name": name, "width": img.shape[1], "height": img.shape[0]})
            for category, box, extra in objects:
                x, y, w, h = (round(v, 2) for v in box)
                boxes.append({"id": ann_id, "image_id": image_id, "category_id": category, "bbox": [x, y, w, h],
                              "area": round(w * h, 2), "iscrowd": 0, **extra})
                ann_id += 1
            for text in texts:
                captions.append({"id": cap_id, "image_id": image_id, "caption": text})
                cap_id += 1
            image_id += 1
        info = {"description": description, "config": asdict(config)}
        instances = {"info": info, "images": images, "annotations": boxes, "categories": categories}
        (tmp / "annotations" / f"instances_{split}.json").write_text(json.dumps(instances))
        caps = {"info": info, "images": images, "annotations": captions}
        (tmp / "annotations" / f"captions_{split}.json").write_text(json.dumps(caps))
    (tmp / "manifest.json").write_text(json.dumps({"task": "coco", "config": asdict(config)}, indent=2))


def ensure_shapes_coco(config: SceneSetConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """Multi-object shape scenes in the COCO 2017 layouts, generated on first use.

    Layout (``ROOT`` is returned)::

        ROOT/{train,val}/<image id>.png
        ROOT/annotations/instances_{train,val}.json   boxes (xywh pixels), categories = shape kinds,
                                                      plus each object's "colour" (an extra key)
        ROOT/annotations/captions_{train,val}.json    several descriptions per image

    Category ids are 1..5 in the order of :data:`SHAPES`; image and annotation ids are unique
    across splits.
    """
    config = config or SceneSetConfig()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / config.key()
    categories = [{"id": i + 1, "name": k, "supercategory": "shape"} for i, k in enumerate(SHAPES)]
    cat_id = {k: i + 1 for i, k in enumerate(SHAPES)}

    def draw(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, tuple[float, ...], dict]], list[str]]:
        n = int(rng.integers(config.min_objects, config.max_objects + 1))
        side = config.image_size
        scene = random_scene(rng, side, side, n, config.min_size, config.max_size, max_overlap=config.max_overlap)
        img = render_scene(scene, rng, noise=config.noise, clutter=config.clutter)
        objects = [(cat_id[o.kind], o.box_xywh, {"colour": o.colour}) for o in scene.objects]
        return img, objects, scene.describe(rng, config.captions_per_image)

    def build(tmp: Path) -> None:
        log.info("generating shapes COCO data into %s", target)
        _write_coco_scenes(tmp, config, categories, "vision_attn synthetic shapes", 200, draw)

    return _atomic_dataset(target, build)


DIGIT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass
class DigitSceneConfig(SceneSetConfig):
    """Parameters of the embedded digit scenes: glyph digits placed in a larger picture (COCO
    detection + captions layout). A second scene family, unlike the shapes in content (ten
    digit classes told apart by their strokes, grey ink, no colour cue) and in the words of its
    captions ("a two above a zero"): the stand-in here for a small real dataset that the
    detection and captioning recipes were not tuned on (``python -m benchmarks.holdout``).
    Arguments as :class:`SceneSetConfig`, but ``min_size`` / ``max_size`` are digit heights
    (fractions of the image side) and digits never overlap (``max_overlap`` is unused).
    """

    image_size: int = 96
    num_train: int = 1500
    num_val: int = 300
    min_size: float = 0.2
    max_size: float = 0.45
    noise: float = 8.0

    def key(self) -> str:
        c = self
        return (
            f"digits-coco-v1-s{c.image_size}-n{c.num_train}-{c.num_val}-obj{c.min_objects}-{c.max_objects}"
            f"-size{c.min_size:g}-{c.max_size:g}-cap{c.captions_per_image}-seed{c.seed}-noise{c.noise:g}"
            f"-clutter{c.clutter}"
        )


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


def ensure_digit_scenes_coco(config: DigitSceneConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """Digit scenes in the COCO 2017 layouts (as :func:`ensure_shapes_coco`), generated on first
    use: ``ROOT/{train,val}/<id>.png``, ``ROOT/annotations/instances_{train,val}.json`` (ten
    categories named as the captions name them, "zero".."nine", ids 1..10; tight ink boxes) and
    ``captions_{train,val}.json``."""
    config = config or DigitSceneConfig()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / config.key()
    categories = [{"id": i + 1, "name": w, "supercategory": "digit"} for i, w in enumerate(DIGIT_WORDS)]

    def draw(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, tuple[float, ...], dict]], list[str]]:
        n = int(rng.integers(config.min_objects, config.max_objects + 1))
        digits = [int(d) for d in rng.integers(0, len(GLYPHS), n)]
        img, placed = render_digit_scene(rng, config.image_size, digits, config.min_size, config.max_size,
                                         config.noise, config.clutter)
        objects = [(d + 1, (x0, y0, x1 - x0, y1 - y0), {}) for d, (x0, y0, x1, y1) in placed]
        return img, objects, describe_digits(rng, placed, config.captions_per_image)

    def build(tmp: Path) -> None:
        log.info("generating digit scenes into %s", target)
        _write_coco_scenes(tmp, config, categories, "vision_attn synthetic digit scenes", 300, draw)

    return _atomic_dataset(target, build)
