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

__all__ = ["query_attention_maps", "write_detection_overlays"]

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


def write_detection_overlays(task, dataset, options, out_dir: Path, max_objects: int = 6, report=None) -> int:
    """For the first ``options.num_overlays`` images: the image with every kept box, then one
    tile per detection with its query's cross-attention, box, label and score.

    Pictures come from ``dataset.read_rgb`` — the same read (orientation included, see
    :mod:`vision_attn.data.detection` on EXIF) as the model input and the boxes."""
    n = min(options.num_overlays, len(dataset))
    device = next(task.parameters()).device
    names = task.class_names or []
    written = 0
    for i in range(n):
        image, target = dataset[i]
        im = dataset.images[i]
        with torch.no_grad():
            enc = task.encoder(image.unsqueeze(0).to(device))
            out = task.head(enc, need_weights=True)
        det = task.detect(out, target["orig_size"].unsqueeze(0))[0]
        keep = (det["scores"] >= options.score_threshold).nonzero().flatten()[:max_objects]
        rgb = dataset.read_rgb(i)  # the dataset's own read: same orientation as its boxes (EXIF)
        side = max(rgb.shape[:2])
        if side < 160:  # enlarge small images so labels are readable
            f = int(np.ceil(160 / side))
            rgb = cv2.resize(rgb, (rgb.shape[1] * f, rgb.shape[0] * f), interpolation=cv2.INTER_NEAREST)
        scale = rgb.shape[1] / float(target["orig_size"][1])
        maps = query_attention_maps(out["cross_attn"], det["queries"][keep].cpu(), enc.grid, options.query_layers)
        boxed = rgb
        tiles, titles = [], []
        for j, k in enumerate(keep.tolist()):
            label = f"{names[det['labels'][k]]} {det['scores'][k]:.2f}"
            box = (det["boxes"][k] * scale).tolist()
            boxed = draw_box(boxed, box, label=label)
            tiles.append(draw_box(overlay_saliency(rgb, maps[j], alpha=options.alpha), box, label=label))
            titles.append(f"query {int(det['queries'][k])}")
        panel = image_grid([boxed, *tiles], ["detections", *titles])
        save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{im['id']}.png"), panel, root=out_dir)
        if report is not None:
            from vision_attn.explain.report import Report, png_data_uri, quantise

            h0, w0 = (float(v) for v in target["orig_size"])
            frac = torch.tensor([w0, h0, w0, h0])
            report.items.append({
                "name": f"image id {im['id']}", "text": ", ".join(titles) or "no detection above the threshold",
                "image": Report.display_image(rgb), "panels": [png_data_uri(panel)], "kind": "boxes",
                "grid": list(enc.grid), "maps": quantise(maps.flatten(1)) if len(keep) else "",
                "boxes": [(det["boxes"][k] / frac).tolist() for k in keep.tolist()],
                "labels": [f"{names[det['labels'][k]]} {det['scores'][k]:.2f}" for k in keep.tolist()]})
        written += 1
    log.info("wrote %d detection overlays to %s", written, out_dir / "overlays")
    return written
