"""Per-word cross-attention of generated captions ("Show, Attend and Tell" strips) and a pointing check.

For every generated word, the map is the decoder's cross-attention over the patch grid at the
step that *produced* the word (heads averaged; the last layer, or the mean over layers).

Pointing game: when the split also has boxes (``ROOT/annotations/instances_<split>.json``, as
the embedded shapes data and COCO do), every generated word that names a box — its category
("circle", "dog") or, where annotations carry one, its ``colour`` ("red"; the embedded data
does) — is a hit if its map's peak patch lies inside a box it names. ``pointing_acc`` is the
hit rate; ``pointing_acc_random`` the rate a uniformly random patch would reach on the same
words (the share of patch centres inside such boxes).
"""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import torch

from vision_attn.data.detection import load_coco_annotations
from vision_attn.data.imageio import read_image
from vision_attn.data.tokenizer import normalize_caption
from vision_attn.explain.overlay import image_grid, overlay_saliency, save_png
from vision_attn.explain.rollout import normalize_maps
from vision_attn.outputs import safe_filename

__all__ = ["caption_strip", "explain_captioning", "pointing_game", "word_attention_maps", "write_caption_overlays"]

log = logging.getLogger(__name__)


def word_attention_maps(attention: torch.Tensor, num_words: int, grid: tuple[int, int], layers: str = "last") -> torch.Tensor:
    """Maps ``[num_words, h, w]`` in ``[0, 1]`` from one image's ``Generation.attention`` ``[T, L, N]``."""
    att = attention[:num_words].float()
    fused = att[:, -1] if layers == "last" else att.mean(1)  # (T, N)
    return normalize_maps(fused.reshape(-1, *grid))


def caption_strip(rgb: np.ndarray, words: list[str], maps: torch.Tensor, alpha: float = 0.5, cols: int = 8,
                  title: str | None = None) -> np.ndarray:
    """The image, then one overlay per word titled with the word; the caption (after ``title``,
    e.g. the method, when given) written above."""
    side = max(rgb.shape[:2])
    if side < 128:  # enlarge small images so the heat maps can be seen
        f = int(np.ceil(128 / side))
        rgb = cv2.resize(rgb, (rgb.shape[1] * f, rgb.shape[0] * f), interpolation=cv2.INTER_NEAREST)
    tiles = [rgb] + [overlay_saliency(rgb, m, alpha=alpha) for m in maps]
    grid = image_grid(tiles, ["image", *words], cols=min(cols, len(tiles)))
    band = np.full((22, grid.shape[1], 3), 255, np.uint8)
    caption = " ".join(words) or "(empty caption)"
    cv2.putText(band, f"{title}: {caption}" if title else caption, (4, 16), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1, cv2.LINE_AA)
    return np.concatenate([band, grid], axis=0)


def _is_box(value) -> bool:
    return (isinstance(value, list) and len(value) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))


def _split_boxes(dataset) -> dict[int, list[tuple[set[str], list[float]]]] | None:
    """``{image id: [(words naming the box, xyxy fractions)]}`` from the split's instances file, if any."""
    path = dataset.root / "annotations" / f"instances_{dataset.split}.json"
    if not path.is_file():
        return None
    data = load_coco_annotations(path)
    names = {c.get("id"): normalize_caption(str(c.get("name", ""))) for c in data.get("categories") or []
             if isinstance(c, dict)}
    sizes = {im.get("id"): (im.get("width"), im.get("height")) for im in data.get("images") or []
             if isinstance(im, dict)}
    out: dict[int, list[tuple[str, list[float]]]] = {}
    for a in data.get("annotations") or []:
        # the pointing game only reads well-formed boxes (the data reader counts the others)
        if not isinstance(a, dict) or not _is_box(a.get("bbox")):
            continue
        w, h = sizes.get(a.get("image_id"), (None, None)) if isinstance(a.get("image_id"), int) else (None, None)
        if not w or not h or a.get("category_id") not in names:
            continue
        x, y, bw, bh = a["bbox"]
        words = {names[a["category_id"]]} | ({normalize_caption(a["colour"])} if isinstance(a.get("colour"), str) else set())
        out.setdefault(a["image_id"], []).append((words, [x / w, y / h, (x + bw) / w, (y + bh) / h]))
    return out


def pointing_game(words: list[str], maps: torch.Tensor, boxes: list[tuple[set[str], list[float]]]) -> tuple[int, int, float]:
    """``(hits, category words, expected random hits)`` for one caption (see the module docstring)."""
    gh, gw = maps.shape[-2:]
    cy = (torch.arange(gh, dtype=torch.float32) + 0.5) / gh
    cx = (torch.arange(gw, dtype=torch.float32) + 0.5) / gw
    named = set().union(*(names for names, _ in boxes)) if boxes else set()
    hits = total = 0
    chance = 0.0
    for word, m in zip(words, maps, strict=True):
        if word not in named:
            continue
        inside = torch.zeros(gh, gw, dtype=torch.bool)
        for names, (x0, y0, x1, y1) in boxes:
            if word in names:
                inside |= ((cy[:, None] >= y0) & (cy[:, None] <= y1)) & ((cx[None, :] >= x0) & (cx[None, :] <= x1))
        peak = int(m.flatten().argmax())
        hits += int(inside.flatten()[peak])
        total += 1
        chance += float(inside.float().mean())
    return hits, total, chance


def explain_captioning(task, images: torch.Tensor, pictures: list[np.ndarray], options, truths=None) -> list:
    """:meth:`~vision_attn.tasks.VisionTask.explain_batch` of a captioner: per image the record
    ``{"caption"}``, the per-word strip (:func:`caption_strip`) of each method of
    :func:`~vision_attn.explain.detection.decoder_methods` (stacked) and its report item (the
    first method's maps); ``extras`` holds the ``words`` and ``maps`` ``{method: [T, h, w]}``."""
    from vision_attn.explain.decoder_relevance import caption_relevance
    from vision_attn.explain.detection import decoder_methods
    from vision_attn.explain.report import Report, png_data_uri, quantise
    from vision_attn.tasks.base import Explained

    with torch.no_grad():
        gen = task.generate(images, return_attention=True)
    grid = task.encoder.grid_for(*images.shape[-2:])
    captions = [task.tokenizer.decode_words(gen.tokens[j].tolist()) for j in range(len(pictures))]
    methods = decoder_methods(options)
    relevance = (caption_relevance(task, images, [gen.tokens[j][: len(w)] for j, w in enumerate(captions)])
                 if "relevance" in methods else None)
    explained = []
    for j, (picture, words) in enumerate(zip(pictures, captions, strict=True)):
        maps = {m: relevance[j] if m == "relevance" else
                word_attention_maps(gen.attention[j].cpu(), len(words), grid, options.query_layers) for m in methods}
        strips = [caption_strip(picture, words, maps[m], options.alpha, title=m if len(methods) > 1 else None)
                  for m in methods]
        strip = np.concatenate(strips, axis=0)
        text = " ".join(words) if truths is None else f"{' '.join(words)} (reference: {truths[j]})"
        first = maps[methods[0]]
        item = {"text": text, "image": Report.display_image(picture), "panels": [png_data_uri(strip)], "kind": "words",
                "grid": list(grid), "words": words, "maps": quantise(first.flatten(1)) if words else ""}
        explained.append(Explained({"caption": " ".join(words)}, strip, item, {"words": words, "maps": maps}))
    return explained


def write_caption_overlays(task, dataset, options, out_dir: Path, report=None) -> dict[str, float]:
    """Write a per-word strip (:func:`explain_captioning`) for ``options.num_overlays`` images into
    ``out_dir/overlays`` and, when the split has boxes and ``options.faithfulness`` is on,
    return the pointing metrics of up to ``options.faithfulness_images`` images."""
    from vision_attn.explain.evaluate import select_images

    chosen = set(select_images(len(dataset), options.num_overlays, options.overlay_selection, options.seed))
    boxes = _split_boxes(dataset) if options.faithfulness else None
    pointed = (set(select_images(len(dataset), options.faithfulness_images, options.faithfulness_selection,
                                 options.seed)) if boxes is not None else set())
    todo = sorted(chosen | pointed)
    device = next(task.parameters()).device
    hits: dict[str, int] = {}
    total = 0
    chance = 0.0
    written = 0
    for start in range(0, len(todo), options.batch_size):
        idx = todo[start : start + options.batch_size]
        images = torch.stack([dataset[i][0] for i in idx]).to(device)
        pictures = [read_image(dataset.image_path(i)) for i in idx]
        for i, e in zip(idx, task.explain_batch(images, pictures, options), strict=True):
            image_id = dataset.images[i]["id"]
            if i in chosen:
                # The id comes from the annotation file: one safe, short name under out_dir, always.
                save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{image_id}.png"), e.panel, root=out_dir)
                written += 1
                if report is not None:
                    report.items.append({"name": f"image id {image_id}", **e.report_item})
            if boxes is not None and i in pointed:
                for method, maps in e.extras["maps"].items():
                    h, t, c = pointing_game(e.extras["words"], maps, boxes.get(image_id, []))
                    hits[method] = hits.get(method, 0) + h
                total, chance = total + t, chance + c
    if written:
        log.info("wrote %d per-word attention strips to %s", written, out_dir / "overlays")
    if not total:
        return {}
    metrics = {f"pointing_{m}": h / total for m, h in hits.items()}
    # the names of the previous version, kept one more version: raw attention's hit rate
    alias = "attention" if "attention" in hits else next(iter(hits))
    return {**metrics, "pointing_random": chance / total, "pointing_acc": hits[alias] / total,
            "pointing_acc_random": chance / total, "pointing_words": float(total),
            "explain_images": float(len(pointed))}
