"""Reading COCO annotation files (instances and captions): the one place that parses and checks them.

- :func:`load_coco_annotations`: the file as JSON, with ``images`` and ``annotations`` lists
  (malformed JSON, not UTF-8, nested too deeply, not a COCO object: a :class:`DataError`
  naming the file).
- Ids must be what COCO tools accept (:func:`is_coco_id`: integers from 0 to 2**63 - 1, never
  ``true`` or ``false``); :func:`coco_id_error` is the error naming the file and the id.
- ``images`` entries: :func:`validate_image_entry`, and :func:`read_image_entries` for a split's
  images (no id twice, ``file_name`` inside the split folder, optionally the files present).
- ``categories``: :func:`check_category_id`, :func:`sorted_categories` (the detection labels'
  order) and :func:`category_names` (``{id: name}``).
- ``annotations`` of an instances file: :func:`annotation_problem` says why one is unusable
  (not an object, an unknown image or category, a box that is not four finite numbers of
  positive size) or returns its box; each reader decides whether that drops it (training data,
  counted warnings) or is an error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vision_attn.data.loading import PathRefusals, image_path_inside
from vision_attn.errors import DataError
from vision_attn.schema import limit

__all__ = ["COCO_ID_LIMIT", "annotation_problem", "category_names", "check_category_id", "check_images_dir",
           "coco_box", "coco_id_error", "is_coco_id", "load_coco_annotations", "read_image_entries",
           "sorted_categories", "validate_image_entry"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite_number(value: Any) -> bool:
    """A JSON number (not a boolean) that is a finite float: not NaN or infinity, and not an
    integer too large for a float (JSON has no limit on digits)."""
    try:
        return _is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


COCO_ID_LIMIT = 2**63
"""Image, annotation and category ids lie in ``0 .. COCO_ID_LIMIT - 1``: the non-negative
64-bit integers that pycocotools and other COCO tools (NumPy ``int64`` arrays) accept."""


def is_coco_id(value: Any) -> bool:
    """Whether ``value`` is an id COCO tools accept: an ``int`` (not a ``bool``) from 0 to 2**63 - 1."""
    return _is_int(value) and 0 <= value < COCO_ID_LIMIT


def shown_value(value: Any, width: int = 60) -> str:
    """``value`` as the file writes it, for a message: JSON with every control and non-ASCII
    character escaped (an id cannot start a forged log line or move the cursor), at most
    ``width`` characters."""
    try:
        shown = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        shown = ascii(value)
    return shown if len(shown) <= width else shown[: width - 3] + "..."


def coco_id_error(ann_file: Path, what: str, value: Any, fix: str = "fix the annotation file") -> DataError:
    """The error for an id that is not a COCO id (:func:`is_coco_id`), naming the file and the
    id as the file writes it (``what``: ``"image id"``, ``"category id"``), ending with ``fix``."""
    shown = shown_value(value)
    return DataError(f"{ann_file}: {what} {shown} is not an integer from 0 to 2**63 - 1 (COCO ids are "
                     f"non-negative 64-bit integers); {fix}")


def load_coco_annotations(path: Path) -> dict[str, Any]:
    """Read an annotation file; malformed JSON (invalid, not UTF-8, nested too deeply, not a
    COCO object) is a :class:`DataError` naming the file (and line and column where known)."""
    if not path.is_file():
        raise DataError(f"annotation file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"annotation file {path} is not valid JSON: {err.msg} at line {err.lineno}, "
                        f"column {err.colno}") from err
    except UnicodeDecodeError as err:
        raise DataError(f"annotation file {path} is not UTF-8 text: {err}") from err
    except RecursionError as err:
        raise DataError(f"annotation file {path} is nested too deeply to be a COCO annotation file") from err
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise DataError(f"annotation file {path} is not usable JSON: {err}") from err
    if not isinstance(data, dict):
        raise DataError(f"annotation file {path} is a JSON {type(data).__name__}, not an object (is it COCO format?)")
    for key in ("images", "annotations"):
        if not isinstance(data.get(key), list):
            raise DataError(f"annotation file {path} has no {key!r} list (is it COCO format?)")
    return data


def validate_image_entry(im: Any, ann_file: Path) -> None:
    """Check one ``images`` entry: an object with an ``id`` COCO tools accept (:func:`is_coco_id`),
    a string ``file_name`` and, if present, numeric ``width`` / ``height``."""
    if not isinstance(im, dict) or "id" not in im or "file_name" not in im:
        raise DataError(f"{ann_file}: image entry {str(im)[:80]} needs 'id' and 'file_name'")
    if not is_coco_id(im["id"]):
        raise coco_id_error(ann_file, "image id", im["id"])
    if not isinstance(im["file_name"], str):
        raise DataError(f"{ann_file}: image id {im['id']} has a file_name that is not text: "
                        f"{str(im['file_name'])[:80]}")
    for key in ("width", "height"):
        if im.get(key) is not None and not finite_number(im[key]):
            raise DataError(f"{ann_file}: image id {im['id']} has a {key} that is not a finite number: "
                            f"{str(im[key])[:80]}")


def check_images_dir(images_dir: Path, ann_file: Path, split: str) -> None:
    """A clear error when the images folder of a split is missing."""
    if not images_dir.is_dir():
        raise DataError(f"{ann_file}: the images folder {images_dir} of split {split!r} does not exist; "
                        f"pass --data.root (images in ROOT/{split}/) or the split's --data.layout.<split>_images")


def read_image_entries(data: dict[str, Any], ann_file: Path, images_dir: Path, split: str,
                       follow_symlinks: bool = False, skip_refused: bool = False,
                       require_files: bool = False) -> list[tuple[dict, Path]]:
    """The ``images`` of one split's annotation file: per accepted entry ``(entry, checked path)``.

    Every entry is checked (:func:`validate_image_entry`; an id twice is an error); a
    ``file_name`` that leaves the split folder (see
    :func:`vision_attn.data.loading.image_path_inside`) is refused: skipped with one counted
    warning when ``skip_refused`` (training), else an error. With ``require_files`` a missing
    image file is an error naming the image id and the path.
    """
    if data["images"]:
        check_images_dir(images_dir, ann_file, split)
    split_dir = images_dir.resolve()
    refusals = PathRefusals(ann_file, skip=skip_refused)
    entries: list[tuple[dict, Path]] = []
    seen: set[int] = set()
    for im in data["images"]:
        validate_image_entry(im, ann_file)
        if im["id"] in seen:
            raise DataError(f"{ann_file}: image id {im['id']} appears twice")
        seen.add(im["id"])
        path, why = image_path_inside(split_dir, im["file_name"], follow_symlinks)
        if why is not None:
            refusals.refuse(f"image id {im['id']}", images_dir / im["file_name"], why)
            continue
        if require_files and not path.is_file():
            raise DataError(f"{ann_file}: image id {im['id']} has no file {images_dir / im['file_name']}")
        entries.append((im, path))
    refusals.report()
    return entries


def check_category_id(category: Any, ann_file: Path) -> None:
    """Check one ``categories`` entry: an object whose ``id`` COCO tools accept (:func:`is_coco_id`)."""
    if not isinstance(category, dict) or "id" not in category:
        raise DataError(f"{ann_file}: category {str(category)[:80]} needs an integer 'id'")
    if not is_coco_id(category["id"]):
        raise coco_id_error(ann_file, "category id", category["id"],
                            "every category needs an integer 'id': fix the annotation file")


def sorted_categories(cats: Any, ann_file: Path) -> list[dict]:
    """The ``categories`` list checked (:func:`check_category_id`, each id once, at most
    ``VISION_ATTN_MAX_NUM_CLASSES`` of them: the heads are sized from it) and sorted by id: the
    order of the detection labels ``0..C-1``."""
    if not isinstance(cats, list) or not cats:
        raise DataError(f"annotation file {ann_file} has no categories")
    if len(cats) > limit("num_classes"):
        raise DataError(f"annotation file {ann_file} has {len(cats)} categories, over the limit of "
                        f"{limit('num_classes')} (VISION_ATTN_MAX_NUM_CLASSES)")
    seen: set[int] = set()
    for c in cats:
        check_category_id(c, ann_file)
        if c["id"] in seen:
            raise DataError(f"annotation file {ann_file} lists category id {shown_value(c['id'])} twice")
        seen.add(c["id"])
    return sorted(cats, key=lambda c: c["id"])


def category_names(cats: Any, path: Path, missing: str, invalid: str | None = None) -> dict[int, str]:
    """``{category id: name}`` of a ``categories`` list, in the file's order.

    Args:
        cats: the file's ``categories`` value.
        path: the file (errors name it).
        missing: the error when there is no (non-empty) categories list.
        invalid: when given, any faulty entry (not an object, an id COCO tools refuse, a name
            that is not text) is the one error ``"{path}: category {entry} {invalid}"``; else the
            id is checked by :func:`check_category_id` and a name that is not text is the error
            ``"... needs an integer 'id' and a text 'name'"``.
    """
    if not isinstance(cats, list) or not cats:
        raise DataError(missing)
    names: dict[int, str] = {}
    for c in cats:
        if invalid is not None:
            if not isinstance(c, dict) or not is_coco_id(c.get("id")) or not isinstance(c.get("name"), str):
                raise DataError(f"{path}: category {str(c)[:80]} {invalid}")
        else:
            check_category_id(c, path)
            if not isinstance(c.get("name"), str):
                raise DataError(f"{path}: category {str(c)[:80]} needs an integer 'id' and a text 'name'")
        names[c["id"]] = c["name"]
    return names


def coco_box(a: dict) -> tuple[float, float, float, float] | None:
    """``(x, y, w, h)`` of an annotation, or ``None`` if its ``bbox`` is not four numbers (a number
    that is not a finite float reads as infinity)."""
    box = a.get("bbox")
    if not isinstance(box, list) or len(box) != 4 or not all(_is_number(v) for v in box):
        return None
    return tuple(float(v) if finite_number(v) else math.inf for v in box)


def annotation_problem(a: Any, image_ids: Any, category_ids: Any, check_box: bool = True
                       ) -> tuple[str | None, tuple[float, float, float, float] | None]:
    """``(reason, box)`` for one entry of an instances file's ``annotations``: ``reason`` is
    ``None`` for a usable annotation, else ``"not an object"``, ``"unknown image id"`` (not one
    of ``image_ids``), ``"unknown category id"`` (not one of ``category_ids``) or, with
    ``check_box``, ``"bbox is not four numbers"``, ``"non-finite box"`` or ``"zero or negative
    size"``; ``box`` is its ``(x, y, w, h)`` once read (see :func:`coco_box`)."""
    if not isinstance(a, dict):
        return "not an object", None
    if not is_coco_id(a.get("image_id")) or a["image_id"] not in image_ids:
        return "unknown image id", None
    if not is_coco_id(a.get("category_id")) or a["category_id"] not in category_ids:
        return "unknown category id", None
    if not check_box:
        return None, None
    box = coco_box(a)
    if box is None:
        return "bbox is not four numbers", None
    if not all(math.isfinite(v) for v in (*box, box[0] + box[2], box[1] + box[3])):  # corners too
        return "non-finite box", box
    if box[2] <= 0 or box[3] <= 0:
        return "zero or negative size", box
    return None, box
