"""The objects a captioning split annotates, as the per-word explanations measure them: each
box with the words that name it (its category, and its colour when annotated) and, where the
instances file has a ``segmentation``, its mask."""

from __future__ import annotations

from vision_attn.data.detection import is_coco_id, load_coco_annotations
from vision_attn.data.masks import ImageMask, image_mask
from vision_attn.data.tokenizer import normalize_caption

__all__ = ["BoxMasks", "NamedBoxes"]

NamedBoxes = list[tuple[set[str], list[float]]]
"""An image's objects: ``[(words naming the box, [x0, y0, x1, y1] original pixels)]``."""
BoxMasks = dict[int, list[tuple[list[float], ImageMask]]]
"""``{image id: [(box, mask)]}``: the masks of the objects of an instances file that have one."""


def _is_box(value) -> bool:
    return (isinstance(value, list) and len(value) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))



def _split_boxes(dataset, masks: BoxMasks | None = None) -> dict[int, NamedBoxes] | None:
    """``{image id: [(words naming the box, [x0, y0, x1, y1] original pixels)]}`` from the
    split's instances file, if any; given a ``masks`` dict, it is filled with ``{image id:
    [(box, mask)]}`` for the objects that have a ``segmentation`` (and an image with a whole-number
    ``height`` and ``width``)."""
    path = dataset.root / "annotations" / f"instances_{dataset.split}.json"
    if not path.is_file():
        return None
    data = load_coco_annotations(path)
    names = {c.get("id"): normalize_caption(str(c.get("name", ""))) for c in data.get("categories") or []
             if isinstance(c, dict) and is_coco_id(c.get("id"))}
    sizes = {im.get("id"): (im.get("height"), im.get("width")) for im in data.get("images") or []
             if isinstance(im, dict) and is_coco_id(im.get("id"))}
    images = set(sizes)
    out: dict[int, NamedBoxes] = {}
    for a in data.get("annotations") or []:
        # localisation only reads well-formed boxes (the data reader counts the others)
        if not isinstance(a, dict) or not _is_box(a.get("bbox")) or min(a["bbox"][2:]) < 0:
            continue
        if not (is_coco_id(a.get("image_id")) and is_coco_id(a.get("category_id"))):
            continue
        if a.get("image_id") not in images or a.get("category_id") not in names:
            continue
        x, y, bw, bh = (float(v) for v in a["bbox"])
        colour = a.get("colour", a.get("color"))  # as content accuracy reads it
        words = {names[a["category_id"]]} | ({normalize_caption(colour)} if isinstance(colour, str) else set())
        out.setdefault(a["image_id"], []).append((words, [x, y, x + bw, y + bh]))
        if masks is not None and a.get("segmentation") is not None:
            mask = image_mask(a["segmentation"], *sizes[a["image_id"]], f"{path}: annotation id {a.get('id')}")
            if mask is not None:
                masks.setdefault(a["image_id"], []).append(([x, y, x + bw, y + bh], mask))
    return out
