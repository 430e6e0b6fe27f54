"""Every mistake of a detector's evaluation with the evidence the model used: ``OUT/mistakes.html``.

From ``results_per_image.json`` (:mod:`~vision_attn.tasks.detection_results`) every false
positive (a detection scoring at least ``--explain.score_threshold`` that took no object: TIDE's
``cls``, ``loc``, ``both``, ``dupe`` or ``bkg``) and every missed object (a box no detection
scoring at least the threshold took) becomes a card. Each card gets the explanation map of the
head's first method (``lrp_attention`` by default):

- a false positive: the map of the query that made it (the model re-run on the image as
  ``predict`` sees it, the query whose box of that class overlaps the detection most);
- a missed object: the map of the query whose box overlaps the object most (any class), for the
  class the object has: what that query saw of it.

**Looked at the object?** The map's maximum lies within 1 px of the object (the missed box; for a
false positive the box it is confused with: of another class for ``cls``, the one it misplaced
for ``loc``, the one already taken for ``dupe``) — the pointing test of the explanation measures
(:func:`~vision_attn.explain.localisation.pointing_hit`). Background and ``both`` detections have
no such object: no flag.

The page itself (:mod:`vision_attn.report.mistakes`) filters the cards by class, kind of mistake,
object size and whether the map looked at the object.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vision_attn.explain.detection import decoder_methods, detection_maps, relevance_rule
from vision_attn.explain.localisation import grid_to_image, pointing_hit
from vision_attn.explain.progress import Progress
from vision_attn.explain.records import quantise
from vision_attn.metrics.tide import TIDE_ERRORS

__all__ = ["DETECTION_INTRO", "MAX_FALSE_PER_IMAGE", "MISTAKE_KINDS", "MistakesBrowser", "detection_mistakes",
           "explain_mistakes", "map_fields", "mistake_cards"]

log = logging.getLogger(__name__)

MISTAKE_KINDS = {"cls": "wrong class", "loc": "box off", "both": "class and box", "dupe": "duplicate",
                 "bkg": "background", "miss": "missed", "misclassified": "misclassified",
                 "hallucinated": "word no reference has"}
"""The kinds of mistake a card can be (a detector's: TIDE's names; a classifier's; a captioner's),
as the page's filter shows them."""
DETECTION_INTRO = ("Looked at the object: the map's maximum lies on the missed object or on the object the detection "
                   "is confused with. Green: that object; red: the detection or the missed object.")


def map_fields(grid_map: torch.Tensor) -> dict[str, Any]:
    """A card's map: ``grid`` ``[h, w]`` and ``map``, the values as quantised bytes (base64)."""
    return {"grid": list(grid_map.shape), "map": quantise(grid_map.flatten())}


def _xyxy(box: list[float]) -> list[float]:
    x, y, w, h = box
    return [x, y, x + w, y + h]


MAX_FALSE_PER_IMAGE = 20
"""Most false positives of one image shown (its best-scoring ones; as the explanation measures cap
the detections of an image), so that a low threshold does not make a card of every query."""


def mistake_cards(per_image: list[dict[str, Any]], score_threshold: float,
                  max_false_per_image: int = MAX_FALSE_PER_IMAGE) -> list[dict[str, Any]]:
    """The cards of ``results_per_image.json``'s entries: every false positive scoring at least
    ``score_threshold`` (at most ``max_false_per_image`` per image, the best-scoring ones) and
    every object not found at it (see the module docstring), best-scoring false positives first,
    then the missed objects in image order. Each card: ``image_id``,
    ``kind`` (``cls`` ... ``miss``), ``category``, ``confused`` (the category of the object a
    ``cls`` detection took the place of), ``score``, ``size``, ``box`` (the detection's or the
    missed object's, xyxy pixels) and ``object`` (the object the map should point at, or None)."""
    false, missed, left_out = [], [], 0
    for entry in per_image:
        truths = entry["truths"]
        wrong = sorted((d for d in entry["detections"]
                        if d["score"] >= score_threshold and d["outcome"] in TIDE_ERRORS), key=lambda d: -d["score"])
        left_out += max(0, len(wrong) - max_false_per_image)
        for d in wrong[:max_false_per_image]:
            other = truths[d["truth"]] if d["truth"] is not None and d["outcome"] != "bkg" else None
            pointed = other if d["outcome"] in ("cls", "loc", "dupe") else None
            false.append({"image_id": entry["image_id"], "kind": d["outcome"], "category": d["category"],
                          "confused": other["category"] if other is not None and d["outcome"] == "cls" else None,
                          "score": d["score"], "size": d["size"], "box": _xyxy(d["bbox"]),
                          "object": None if pointed is None else _xyxy(pointed["bbox"])})
        for t in truths:
            found = t["outcome"] == "tp" and t["score"] is not None and t["score"] >= score_threshold
            if t["outcome"] in ("tp", "fn") and not found:
                missed.append({"image_id": entry["image_id"], "kind": "miss", "category": t["category"],
                               "confused": None, "score": t["score"], "size": t["size"], "box": _xyxy(t["bbox"]),
                               "object": _xyxy(t["bbox"])})
    if left_out:
        log.info("mistakes browser: %d false positives beyond the best %d of their image left out", left_out,
                 max_false_per_image)
    false.sort(key=lambda c: -c["score"])
    for c in false:
        c["note"] = f"is {c['confused']}" if c["confused"] else ""
    for c in missed:
        c["note"] = ""
    return false + missed


def _iou(box: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    from torchvision.ops import box_iou

    return box_iou(box.reshape(1, 4).float(), boxes.reshape(-1, 4).float()).flatten()


def explain_mistakes(task, dataset, cards: list[dict[str, Any]], options) -> dict[int, np.ndarray]:
    """Adds to each card its ``query``, ``map`` (quantised, over ``grid``), ``grid`` and ``looked``
    (True / False / None); returns the pictures of the images with a card ``{image_id: RGB}``."""
    by_image: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for card in cards:
        by_image[card["image_id"]].append(card)
    index = {im["id"]: i for i, im in enumerate(dataset.images)}
    names = list(task.class_names or [])
    label_of = {n: k for k, n in enumerate(names)}
    method = decoder_methods(options, model=task)[0]
    pre = task.inference_data_config()
    device = next(task.parameters()).device
    pictures: dict[Any, np.ndarray] = {}
    ids = list(by_image)
    progress = Progress(f"mistakes browser: {method} maps", len(ids), "image")
    for start in range(0, len(ids), options.batch_size):
        chunk = ids[start : start + options.batch_size]
        idx = [index[i] for i in chunk]
        items = [dataset[i] for i in idx]
        images = torch.stack([it[0] for it in items]).to(device)
        sizes = [(int(it[1]["orig_size"][0]), int(it[1]["orig_size"][1])) for it in items]
        with torch.no_grad():
            dets = task.detect(task(images), torch.tensor(sizes))
        queries, labels = [], []
        for image_id, det in zip(chunk, dets, strict=True):
            q, lab = [], []
            for card in by_image[image_id]:
                box = torch.tensor(card["box"])
                overlap = _iou(box, det["boxes"].cpu()) if len(det["boxes"]) else torch.zeros(0)
                label = label_of.get(card["category"], 0)
                if card["kind"] != "miss":  # the detection itself: a query of its class
                    overlap = overlap * (det["labels"].cpu() == label)
                k = int(overlap.argmax()) if overlap.numel() else 0
                card["query"] = int(det["queries"][k]) if len(det["queries"]) else 0
                q.append(card["query"])
                lab.append(label)
            queries.append(torch.tensor(q, dtype=torch.long))
            labels.append(torch.tensor(lab, dtype=torch.long))
        maps = detection_maps(task, images, queries, labels, [method], options.query_layers, options.seed,
                              relevance_rule(options))[method]
        for image_id, i, size, grid_maps in zip(chunk, idx, sizes, maps, strict=True):
            pictures[image_id] = dataset.read_rgb(i)
            for card, grid_map in zip(by_image[image_id], grid_maps, strict=True):
                card.update(map_fields(grid_map))
                card["looked"] = (None if card["object"] is None else
                                  pointing_hit(grid_to_image(grid_map, size, pre), [card["object"]]))
        progress.update(len(chunk))
    progress.close()
    return pictures


@dataclass
class MistakesBrowser:
    """What ``mistakes.html`` shows (:func:`~vision_attn.report.mistakes.write_mistakes_page`): the
    cards with their maps, the pictures of their images ``{image_id: RGB}``, the method of the maps
    and the page's title."""

    cards: list[dict[str, Any]]
    pictures: dict[Any, np.ndarray]
    method: str
    title: str
    intro: str = DETECTION_INTRO


def detection_mistakes(task, dataset, per_image: list[dict[str, Any]] | None, options,
                       max_false_per_image: int = MAX_FALSE_PER_IMAGE) -> MistakesBrowser | None:
    """The browser of the evaluation's ``per_image`` results (``results_per_image.json``): every
    card of :func:`mistake_cards` with its map (:func:`explain_mistakes`); ``None`` without results.
    The page says how many false positives the per-image cap left out, if any."""
    if per_image is None:
        return None
    cards = mistake_cards(per_image, options.score_threshold, max_false_per_image)
    pictures = explain_mistakes(task, dataset, cards, options) if cards else {}
    false = sum(1 for e in per_image for d in e["detections"]
                if d["score"] >= options.score_threshold and d["outcome"] in TIDE_ERRORS)
    left_out = false - sum(c["kind"] != "miss" for c in cards)
    intro = DETECTION_INTRO + (f" {left_out} of the {false} false positives, beyond the {max_false_per_image} "
                               "best-scoring of their image, are left out." if left_out else "")
    return MistakesBrowser(cards, pictures, decoder_methods(options, model=task)[0],
                           f"vision_attn detection mistakes (score >= {options.score_threshold:g})", intro)
