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
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

from vision_attn.data.glyphs import DIGIT_WORDS, GLYPHS, describe_digits, render_digit_scene, render_glyph
from vision_attn.data.scenes import COLOURS, SHAPES, Scene, SceneObject, object_polygon, random_scene, render_scene

__all__ = [
    "COLOURS",
    "DIGIT_WORDS",
    "DigitSceneConfig",
    "GLYPHS",
    "SHAPES",
    "Scene",
    "SceneObject",
    "ShapesConfig",
    "default_cache_dir",
    "SceneSetConfig",
    "describe_digits",
    "embedded_data_warning",
    "ensure_digit_scenes_coco",
    "ensure_glyphs_classification",
    "ensure_shapes_coco",
    "ensure_shapes_classification",
    "random_scene",
    "render_digit_scene",
    "render_glyph",
    "render_scene",
]

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1
# Per family: shapes 2 adds the boxes (ROOT/annotations/instances_<split>.json), 3 their outlines; glyphs stay 1.
_FAMILY_VERSIONS = {"shapes": 3}
_COCO_FORMAT_VERSION = 3  # 2: captions list objects left to right; 3: each object's outline ("segmentation")


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


def embedded_data_warning(what: str) -> str:
    """The warning of a data module built without ``--data.root`` for data of the user's (no
    ``synthetic`` settings given): the embedded shapes data is generated and used instead;
    ``what``: the folder ``--data.root`` would name."""
    return ("no --data.root was given: generating (on first use) and using the embedded synthetic shapes "
            f"dataset instead of your own data; pass --data.root ROOT with {what} to train on yours")


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
                                  "colour": obj.colour, "segmentation": [object_polygon(obj)]})
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


def manifest_annotations(root: str | Path, split: str) -> Path | None:
    """The annotation file a data root's ``manifest.json`` names for ``split`` under
    ``"annotations"`` (:func:`ensure_shapes_classification` writes it), or ``None``: no manifest,
    one that is not a regular file of JSON (or is nested too deeply), no such entry, or an entry
    that is not a file inside ``root`` (the manifest itself must lie inside it too)."""
    root = Path(root)
    manifest_path = root / "manifest.json"
    try:
        inside = root.resolve()
        if not manifest_path.is_file() or not manifest_path.resolve().is_relative_to(inside):
            return None
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest.get("annotations") if isinstance(manifest, dict) else None
        rel = files.get(split) if isinstance(files, dict) else None
        if not isinstance(rel, str):
            return None
        path = root / rel
        return path if path.is_file() and path.resolve().is_relative_to(inside) else None
    except (OSError, RuntimeError, ValueError, RecursionError):  # RuntimeError: a symbolic link loop
        return None


def ensure_shapes_classification(config: ShapesConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """The shapes classification dataset as an ImageFolder root, generated on first use.

    Layout: ``ROOT/{train,val[,test]}/<shape>/<index>.png`` with one main shape per image whose
    kind is the class, plus clutter lines, and ``ROOT/annotations/instances_<split>.json``: each
    image's shape box in COCO format (``file_name`` = the path relative to ``ROOT``, as
    ``predictions.json`` names it; categories 1..5 in the order of :data:`SHAPES`), named in
    ``manifest.json`` under ``"annotations"`` (``eval.py`` finds them there for the
    localisation metrics). Returns ``ROOT``.

    Args:
        config: the data's settings (default: :class:`ShapesConfig`'s).
        cache_dir: where generated data is kept (default: ``$VISION_ATTN_DATA``, else
            ``~/.cache/vision_attn``).
    """
    config = config or ShapesConfig()

    def render(rng: np.random.Generator, label: int) -> np.ndarray:
        size = config.image_size
        scene = random_scene(rng, size, size, 1, config.min_size, config.max_size, kinds=(SHAPES[label],))
        return render_scene(scene, rng, noise=config.noise, clutter=config.clutter), scene

    return _ensure_imagefolder(config, cache_dir, "shapes", list(SHAPES), render, seed_base=0)


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
                                                      each object's outline ("segmentation", a COCO
                                                      polygon) and "colour" (an extra key)
        ROOT/annotations/captions_{train,val}.json    several descriptions per image

    Category ids are 1..5 in the order of :data:`SHAPES`; image and annotation ids are unique
    across splits.

    Args:
        config: the scenes' settings (default: :class:`SceneSetConfig`'s).
        cache_dir: where generated data is kept (default: ``$VISION_ATTN_DATA``, else
            ``~/.cache/vision_attn``).
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
        objects = [(cat_id[o.kind], o.box_xywh, {"colour": o.colour, "segmentation": [object_polygon(o)]})
                   for o in scene.objects]
        return img, objects, scene.describe(rng, config.captions_per_image)

    def build(tmp: Path) -> None:
        log.info("generating shapes COCO data into %s", target)
        _write_coco_scenes(tmp, config, categories, "vision_attn synthetic shapes", 200, draw)

    return _atomic_dataset(target, build)


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
