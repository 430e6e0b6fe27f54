"""Explanations at evaluation time: overlays and faithfulness numbers of a chosen set of images.

Which images: :func:`select_images`. By default the faithfulness numbers come from a seeded
random sample spread over the whole split (one image drawn from each of ``N`` equal
consecutive strata), so a class-sorted split (ImageFolder) is covered class by class rather
than through its first classes only; ``metrics.json`` reports how many images
(``explain_images``) and classes (``explain_classes``) that sample covered.

Used by ``eval.py`` (options under ``--explain.*``) and by the folder command
``python -m vision_attn.overlay``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from vision_attn.data.imageio import read_image
from vision_attn.data.transforms import build_display_transform
from vision_attn.errors import ConfigError
from vision_attn.explain.methods import (
    TOKENS,
    Token,
    check_methods,
    explain_classifier,
    faithful_methods,
    faithfulness,
)
from vision_attn.explain.overlay import image_grid, overlay_saliency, put_text, save_png
from vision_attn.outputs import safe_filename

__all__ = ["ExplainOptions", "Selection", "explain_eval_split", "explanation_panel", "select_images"]

log = logging.getLogger(__name__)

Selection = Literal["sample", "spread", "first"]


def select_images(n_total: int, n: int, selection: Selection = "sample", seed: int = 0) -> list[int]:
    """Sorted indices of the ``min(n, n_total)`` images of a split of ``n_total`` to explain.

    Args:
        n_total: images in the split.
        n: images wanted.
        selection: ``sample`` — a seeded random sample spread over the split: the indices are
            cut into ``n`` consecutive strata of (almost) equal size and one index is drawn
            from each, so every run of ``2 * ceil(n_total / n) - 1`` consecutive images (a
            class of a class-sorted split) has at least one image in it; ``spread`` — evenly
            spaced indices (first and last included); ``first`` — the first ``n``.
        seed: of ``sample``.
    """
    n = min(n, n_total)
    if n <= 0:
        return []
    if selection == "first":
        return list(range(n))
    if selection == "spread":
        return sorted({round(k * (n_total - 1) / max(1, n - 1)) for k in range(n)})
    if selection != "sample":
        raise ValueError(f"image selection must be 'sample', 'spread' or 'first', got {selection!r}")
    gen = torch.Generator().manual_seed(seed)
    bounds = [k * n_total // n for k in range(n + 1)]  # strata [bounds[k], bounds[k + 1])
    offsets = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    return [lo + min(hi - lo - 1, int(u * (hi - lo))) for lo, hi, u in zip(bounds[:-1], bounds[1:], offsets,
                                                                             strict=True)]


@dataclass
class ExplainOptions:
    """What ``eval.py`` explains.

    Args:
        methods: explanation methods drawn side by side, names of the registry
            :data:`vision_attn.explain.methods.METHODS`: ``rollout``, ``relevance``
            (gradient-weighted, class specific), ``attention`` (raw last layer), ``gradcam``
            (Grad-CAM on the last block's patch tokens), ``tokens`` (diagnostic: patch-token
            norms, no faithfulness numbers), ``random`` (the baseline), and any method
            registered with :func:`~vision_attn.explain.methods.register_method`. The first
            method with faithfulness numbers is reported as ``deletion_auc`` /
            ``insertion_auc``; the ``random`` baseline is always measured too.
        num_overlays: overlays written for N images of the split (0 = none).
        overlay_selection: ``first`` (the first N images), ``spread`` (N images evenly
            spread over the split, so every class shows up in a class-sorted folder) or
            ``sample`` (a seeded random sample spread over the split; see
            :func:`select_images`).
        faithfulness: compute deletion / insertion AUC for each method and a random baseline.
        faithfulness_images: at most this many images for the faithfulness numbers (and the
            pointing game of captioning).
        faithfulness_selection: which images: ``sample`` (default; a seeded random sample
            spread over the split), ``spread`` or ``first`` (see :func:`select_images`).
        seed: of the ``sample`` selections.
        steps: points of the deletion / insertion curves.
        head_fusion: how rollout and raw attention fuse the heads (mean, max, min).
        discard_ratio: rollout's discard ratio.
        alpha: heat-map opacity of the overlays.
        batch_size: images per explanation batch.
        score_threshold: detection: objects drawn need at least this score.
        query_layers: detection: cross-attention of the ``last`` decoder layer, or the
            ``mean`` over all layers (heads are averaged in both).
        report: also write ``report.html`` (self-contained, interactive) with the overlays.
        target_class: classification: explain this class (a class name, or an index) instead
            of the prediction; the faithfulness numbers then follow its probability.
        token: classification: the token row explained: ``auto`` (what the head reads), or
            for a distilled DeiT ``cls`` (class token), ``dist`` (distillation token), ``mean``
            (their average).
        topk: classification: the ``topk`` best classes listed per image in predictions.
    """

    methods: list[str] = field(default_factory=lambda: ["rollout", "relevance", "attention"])
    num_overlays: int = 16
    overlay_selection: Selection = "first"
    faithfulness: bool = True
    faithfulness_images: int = 256
    faithfulness_selection: Selection = "sample"
    seed: int = 0
    steps: int = 16
    head_fusion: str = "mean"
    discard_ratio: float = 0.0
    alpha: float = 0.5
    batch_size: int = 32
    score_threshold: float = 0.3
    query_layers: Literal["last", "mean"] = "last"
    report: bool = True
    target_class: str | None = None
    token: Token = "auto"
    topk: int = 5

    def __post_init__(self) -> None:
        check_methods(self.methods, "explain.methods")
        if self.token not in TOKENS:
            raise ConfigError(f"explain.token {self.token!r} invalid; choose one of {', '.join(TOKENS)}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ConfigError(f"explain.topk must be an integer >= 1, got {self.topk!r}")
        if self.target_class is not None:
            self.target_class = str(self.target_class)


def explanation_panel(
    display: np.ndarray, maps: dict[str, torch.Tensor], index: int, caption: str, alpha: float = 0.5
) -> np.ndarray:
    """One image: the input (with ``caption``) and one overlay per method, side by side.

    Small inputs are enlarged (nearest neighbour) to at least 160 px first, so the caption
    fits and the heat map is drawn at a resolution one can look at.
    """
    side = max(display.shape[:2])
    if side < 160:
        f = int(np.ceil(160 / side))
        display = cv2.resize(display, (display.shape[1] * f, display.shape[0] * f), interpolation=cv2.INTER_NEAREST)
    tiles = [put_text(display, caption)]
    titles = ["input"]
    for method, m in maps.items():
        tiles.append(overlay_saliency(display, m[index], alpha=alpha))
        titles.append(method)
    return image_grid(tiles, titles)


def _report_item(expl, j: int, display: np.ndarray, caption: str, panel: np.ndarray) -> dict:
    """Image ``j`` of an explained batch for report.html: every patch's attention row, per layer and head."""
    from vision_attn.explain.report import Report, png_data_uri, quantise

    item = {"text": caption, "image": Report.display_image(display), "panels": [png_data_uri(panel)]}
    if not expl.attentions:  # only methods that need no attention (gradcam, tokens): no patch view
        return item
    p = expl.num_prefix_tokens
    rows = torch.stack([a[j, :, p:, p:] for a in expl.attentions])  # (L, H, N, N): patch -> patch
    return {**item, "kind": "patches", "grid": list(expl.grid), "layers": rows.shape[0], "heads": rows.shape[1],
            "maps": quantise(rows)}


def explain_classification(task, images: torch.Tensor, pictures: list[np.ndarray], options: ExplainOptions,
                           truths: list[str] | None = None) -> list:
    """:meth:`~vision_attn.tasks.VisionTask.explain_batch` of a classifier: per image the
    record ``{"pred", "score"}``, the panel (the input as the model sees it, captioned
    ``pred score`` or ``truth -> pred score``, and one overlay per method) and its report
    item; ``extras["explanation"]`` is the batch's :class:`~vision_attn.explain.methods.Explanation`."""
    from vision_attn.tasks.base import Explained

    expl = explain_classifier(task, images, options.methods, head_fusion=options.head_fusion,
                              discard_ratio=options.discard_ratio, target_class=options.target_class,
                              token=options.token)
    records = task.predictions_from_outputs((expl.logits,), [p.shape[:2] for p in pictures], options)
    names = task.class_names or []
    display_tf = build_display_transform(task.inference_data_config())  # the pixels the model saw
    out = []
    for j, (picture, record) in enumerate(zip(pictures, records, strict=True)):
        display = display_tf(picture)
        caption = f"{record['pred']} {record['score']:.2f}"
        explained = int(expl.target[j])
        if options.target_class is not None and explained < len(names) and names[explained] != record["pred"]:
            caption = f"{caption} | explains {names[explained]}"
        if truths is not None:
            caption = f"{truths[j]} -> {caption}"
        panel = explanation_panel(display, expl.maps, j, caption, options.alpha)
        out.append(Explained(record, panel, _report_item(expl, j, display, caption, panel), {"explanation": expl}))
    return out


def _add_deletion_curves(task, images: torch.Tensor, expl, steps: int, report, total: int) -> None:
    """Accumulate the mean deletion curve of each method (and a random baseline) over ``total`` images."""
    from vision_attn.explain.faithfulness import deletion_insertion_curve

    def proba(x):
        with torch.no_grad():
            return task(x).float().softmax(-1)

    maps = {m: expl.maps[m] for m in faithful_methods(expl.maps)}
    if "random" not in maps:
        maps["random"] = torch.rand(images.shape[0], *expl.grid, generator=torch.Generator().manual_seed(0))
    report.curves = report.curves or {}
    for method, sal in maps.items():
        curve = deletion_insertion_curve(proba, images, sal.to(images.device), expl.target, "deletion", steps).sum(0) / total
        prev = report.curves.get(method, [0.0] * len(curve))
        report.curves[method] = [a + float(b) for a, b in zip(prev, curve, strict=True)]


def _batches(dataset, indices: list[int], batch_size: int) -> DataLoader:
    return DataLoader(Subset(dataset, indices), batch_size=batch_size, shuffle=False, num_workers=0)


def explain_eval_split(task, dataset, options: ExplainOptions, out_dir: Path, report=None) -> dict[str, float]:
    """Write ``out_dir/overlays/*.png`` and return the faithfulness metrics of ``dataset``.

    Args:
        task: a classification task in eval mode.
        dataset: an :class:`~vision_attn.data.ImageFolderDataset` with the evaluation transform.
        options: see :class:`ExplainOptions`.
        out_dir: the evaluation output folder.
        report: a :class:`~vision_attn.explain.report.Report` to fill (interactive attention
            rows of every patch, the panels, the images' mean deletion curves), or ``None``.
    """
    device = next(task.parameters()).device
    names = task.class_names or []
    metrics: dict[str, float] = {}
    n_over = min(options.num_overlays, len(dataset))
    if n_over > 0:
        written = 0
        chosen = select_images(len(dataset), n_over, options.overlay_selection, options.seed)
        for images, labels, idx in _batches(dataset, chosen, options.batch_size):
            rels = [dataset.samples[i][0] for i in idx.tolist()]  # dataset indices (ImageFolderDataset returns them)
            pictures = [read_image(dataset.root / rel) for rel in rels]
            truths = [names[int(lab)] for lab in labels]
            explained = task.explain_batch(images.to(device), pictures, options, truths)
            for i, rel, truth, e in zip(idx.tolist(), rels, truths, explained, strict=True):
                save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{truth}_{Path(rel).stem}.png"), e.panel,
                         root=out_dir)
                written += 1
                if report is not None:
                    report.items.append({"name": str(rel), **e.report_item})
            if report is not None and explained:
                _add_deletion_curves(task, images.to(device), explained[0].extras["explanation"], options.steps,
                                     report, len(chosen))
        log.info("wrote %d overlays to %s", written, out_dir / "overlays")
    picked = select_images(len(dataset), options.faithfulness_images, options.faithfulness_selection, options.seed)
    if options.faithfulness and picked:
        n = len(picked)
        gen = torch.Generator().manual_seed(0)
        sums: dict[str, float] = {}
        methods = list(dict.fromkeys([*faithful_methods(options.methods), "random"]))
        for images, _, _ in _batches(dataset, picked, options.batch_size):
            images = images.to(device)
            expl = explain_classifier(task, images, methods, head_fusion=options.head_fusion,
                                      discard_ratio=options.discard_ratio, generator=gen,
                                      target_class=options.target_class, token=options.token)
            for method, aucs in faithfulness(task, images, expl, options.steps).items():
                for key, values in aucs.items():
                    sums[f"{key}_{method}"] = sums.get(f"{key}_{method}", 0.0) + float(values.sum())
        metrics = {k: v / n for k, v in sums.items()}
        asked = faithful_methods(options.methods)
        if asked:  # the first method asked for that has faithfulness numbers is *the* method
            metrics["deletion_auc"] = metrics[f"deletion_auc_{asked[0]}"]
            metrics["insertion_auc"] = metrics[f"insertion_auc_{asked[0]}"]
        metrics["explain_images"] = float(n)
        metrics["explain_classes"] = float(len({dataset.samples[i][1] for i in picked}))
        log.info("faithfulness of %d images covering %d classes", n, int(metrics["explain_classes"]))
    return dict(sorted(metrics.items()))
