"""Cross-attention per detected object: where each kept query looked in the image."""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import torch

from vision_attn.explain.overlay import draw_box, image_grid, overlay_saliency, save_png
from vision_attn.explain.rollout import normalize_maps
from vision_attn.outputs import safe_filename

__all__ = ["DECODER_METHODS", "decoder_methods", "explain_detection", "query_attention_maps", "write_detection_overlays"]

log = logging.getLogger(__name__)


def query_attention_maps(cross_attn: list[torch.Tensor], queries: torch.Tensor, grid: tuple[int, int],
                         layers: str = "last") -> torch.Tensor:
    """Maps ``[K, h, w]`` of the decoder cross-attention of ``queries`` (one image).

    Args:
        cross_attn: per decoder layer ``[1, heads, Q, h * w]``.
        queries: ``[K]`` query indices (e.g. ``post_process(...)["queries"]``).
        grid: the patch grid.
        layers: ``last`` (the last layer, heads averaged) or ``mean`` (all layers averaged).
    """
    stack = cross_attn[-1:] if layers == "last" else cross_attn
    fused = torch.stack([a[0].float().mean(0) for a in stack]).mean(0)  # (Q, N)
    return normalize_maps(fused[queries].reshape(-1, *grid))


def _enlarge(rgb: np.ndarray, side: int = 160) -> np.ndarray:
    """Small images enlarged (nearest neighbour) to at least ``side`` pixels, so labels are readable."""
    s = max(rgb.shape[:2])
    if s >= side:
        return rgb
    f = int(np.ceil(side / s))
    return cv2.resize(rgb, (rgb.shape[1] * f, rgb.shape[0] * f), interpolation=cv2.INTER_NEAREST)


DECODER_METHODS = ("attention", "relevance")
"""Maps of the decoder heads (detection, captioning): ``attention`` = the raw cross-attention of
the explained query / word; ``relevance`` = Chefer et al. 2021b through decoder and encoder
(:mod:`vision_attn.explain.decoder_relevance`), over image patches."""


def decoder_methods(options) -> list[str]:
    """The decoder-head methods among ``options.methods`` in their order (``attention`` when none is)."""
    return [m for m in options.methods if m in DECODER_METHODS] or ["attention"]


def explain_detection(task, images: torch.Tensor, pictures: list[np.ndarray], options, truths=None,
                      max_objects: int = 6) -> list:
    """:meth:`~vision_attn.tasks.VisionTask.explain_batch` of a detector: per image the record
    ``{"detections": [...]}`` (objects scoring at least ``options.score_threshold``), the panel
    (the picture with every kept box, then per object, at most ``max_objects``, one tile per
    method of :func:`decoder_methods` with its map, box, label and score) and its report item
    (the first method's maps); ``extras["maps"]`` holds ``{method: [K, h, w]}`` and
    ``extras["detections"]`` the kept ``(query, label, box, score)``."""
    from vision_attn.explain.decoder_relevance import detection_relevance
    from vision_attn.explain.report import Report, png_data_uri, quantise
    from vision_attn.tasks.base import Explained

    sizes = [tuple(p.shape[:2]) for p in pictures]
    with torch.no_grad():
        enc = task.encoder(images)
        out = task.head(enc, need_weights=True)
    dets = task.detect(out, torch.tensor(sizes))
    records = task.predictions_from_outputs((out["pred_logits"], out["pred_boxes"]), sizes, options)
    names = task.class_names or []
    keeps = [(d["scores"] >= options.score_threshold).nonzero().flatten()[:max_objects] for d in dets]
    methods = decoder_methods(options)
    relevance = (detection_relevance(task, images, [d["queries"][k] for d, k in zip(dets, keeps, strict=True)],
                                     [d["labels"][k] for d, k in zip(dets, keeps, strict=True)])
                 if "relevance" in methods else None)
    explained = []
    for j, (picture, det, record, keep) in enumerate(zip(pictures, dets, records, keeps, strict=True)):
        rgb = _enlarge(picture)
        scale = rgb.shape[1] / float(picture.shape[1])
        maps = {m: relevance[j] if m == "relevance" else
                query_attention_maps([a[j : j + 1] for a in out["cross_attn"]], det["queries"][keep].cpu(), enc.grid,
                                     options.query_layers) for m in methods}
        boxed, tiles, titles, labels = rgb, [], [], []
        for i, k in enumerate(keep.tolist()):
            label = f"{names[int(det['labels'][k])]} {float(det['scores'][k]):.2f}"
            box = (det["boxes"][k] * scale).tolist()
            boxed = draw_box(boxed, box, label=label)
            for method in methods:
                tiles.append(draw_box(overlay_saliency(rgb, maps[method][i], alpha=options.alpha), box, label=label))
                titles.append(f"query {int(det['queries'][k])}" + (f" {method}" if len(methods) > 1 else ""))
            labels.append(label)
        panel = image_grid([boxed, *tiles], ["detections", *titles])
        h0, w0 = sizes[j]
        frac = torch.tensor([w0, h0, w0, h0], dtype=torch.float32)
        text = ", ".join(f"query {int(det['queries'][k])}" for k in keep.tolist()) or "no detection above the threshold"
        if truths is not None:
            text = f"{truths[j]}: {text}"
        first = maps[methods[0]]
        item = {"text": text, "image": Report.display_image(rgb), "panels": [png_data_uri(panel)], "kind": "boxes",
                "grid": list(enc.grid), "maps": quantise(first.flatten(1)) if len(keep) else "",
                "boxes": [(det["boxes"][k].float() / frac).tolist() for k in keep.tolist()], "labels": labels}
        kept = [(int(det["queries"][k]), int(det["labels"][k]), det["boxes"][k].tolist(), float(det["scores"][k]))
                for k in keep.tolist()]
        explained.append(Explained(record, panel, item, {"maps": maps, "detections": kept}))
    return explained


def write_detection_overlays(task, dataset, options, out_dir: Path, report=None, max_objects: int = 6) -> int:
    """Overlays (:func:`explain_detection`) of the first ``options.num_overlays`` images.

    Pictures come from ``dataset.read_rgb`` — the same read (orientation included, see
    :mod:`vision_attn.data.detection` on EXIF) as the model input and the boxes."""
    n = min(options.num_overlays, len(dataset))
    device = next(task.parameters()).device
    written = 0
    for start in range(0, n, options.batch_size):
        idx = list(range(start, min(n, start + options.batch_size)))
        images = torch.stack([dataset[i][0] for i in idx]).to(device)
        pictures = [dataset.read_rgb(i) for i in idx]
        for i, e in zip(idx, explain_detection(task, images, pictures, options, max_objects=max_objects), strict=True):
            image_id = dataset.images[i]["id"]
            save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{image_id}.png"), e.panel, root=out_dir)
            if report is not None:
                report.items.append({"name": f"image id {image_id}", **e.report_item})
            written += 1
    log.info("wrote %d detection overlays to %s", written, out_dir / "overlays")
    return written
