"""A self-contained ``report.html``: what an evaluation found, and what the model looked at.

Everything is inside the one file — images as ``data:`` URIs, plots as inline SVG, attention
maps as quantised arrays, the style sheet and the script (package files,
``vision_attn/report/assets/``) inline — so it opens from disk with no network. Top to bottom:

1. a summary line: task, checkpoint, split and its size, the headline metric;
2. the task's results, as :class:`~vision_attn.blocks.Section` records (given, or the
   built-in tasks' own, :func:`~vision_attn.report.sections.result_sections`): for classification
   the per-class table and the confusion matrix (click a cell: the grid shows exactly the explained
   images of that cell); for detection per-class AP bars, the COCO size breakdown and the
   precision-recall curves at IoU 0.5; then every other metric, compactly;
3. training curves (loss, the task metric, the learning rate) when the checkpoint sits in a run
   folder with ``csv/*/metrics.csv`` (:func:`~vision_attn.report.curves.read_training_curves`);
4. the explanation-quality table (method x deletion / insertion / pointing / energy / sanity,
   whichever ``metrics`` has, the random baseline last) and the mean deletion curves;
5. the mistakes gallery (:func:`~vision_attn.report.gallery.mistakes_section`) — ``eval.py``
   explains the split's worst mistakes besides its seeded sample
   (:func:`~vision_attn.explain.evaluate.overlay_images`), so they have overlays wherever they
   lie in the split;
6. the grid of explained images, filterable, each with its overlay panels and an interactive
   canvas (:func:`~vision_attn.report.gallery.grid`);
7. the configuration, folded in a ``<details>``.

The page keeps a ``data-shown`` attribute on each canvas naming the map on display, so tests
(and users' scripts) can check that a click changed it. Every text that comes from data (class
names, file names, captions, configuration values, CSV column names) is HTML-escaped where it
enters markup, and the data the script reads is embedded with :func:`script_json`.

Size: large PNG panels are re-encoded as JPEG (:func:`~vision_attn.explain.records.compact_data_uri`)
and the canvas image is stored at its own resolution (at most ``side``), so a 16-image report stays
at a few MB.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from vision_attn.outputs import write_text
from vision_attn.blocks import ConfusionMatrix, Section
from vision_attn.report.curves import read_training_curves
from vision_attn.report.gallery import grid, item_meta, mistakes_section
from vision_attn.report.markup import esc, script_json
from vision_attn.report.render import render_section
from vision_attn.report.sections import (
    HEADLINE,
    config_section,
    metrics_grid,
    quality_section,
    result_sections,
    summary,
    training_section,
)

__all__ = ["read_training_curves", "script_json", "write_report"]

# What each inlined asset must not hold: the closing tag that would end its element early, and
# (script) the comment opener that changes how an HTML parser reads a script element.
_ASSET_FORBIDDEN = {"report.css": ("</style",), "report.js": ("</script", "<!--")}


@functools.cache
def asset(name: str) -> str:
    """The text of ``vision_attn/report/assets/<name>`` (``report.css``, ``report.js``), read with
    :mod:`importlib.resources` so it is found in an installed package (it ships as package data)."""
    text = (resources.files("vision_attn.report") / "assets" / name).read_text(encoding="utf-8")
    for bad in _ASSET_FORBIDDEN.get(name, ()):
        if bad in text.lower():
            raise ValueError(f"report asset {name} holds {bad!r}, which an HTML parser would read as markup "
                             "inside its element in the page")
    return text


def write_report(path: Path, title: str, metrics: dict[str, float], config: dict[str, Any], items: list[dict[str, Any]],
                 curves: dict[str, list[float]] | None = None, canvas: int = 256,
                 root: str | Path | None = None, *, task: str | None = None,
                 per_class: dict[str, dict[str, Any]] | None = None, confusion: dict[str, Any] | None = None,
                 predictions: list[dict[str, Any]] | None = None, training_curves: dict[str, Any] | None = None,
                 pr_curves: dict[str, Any] | None = None, split_size: int | None = None,
                 mistakes: int = 8, sections: Sequence[Section] | None = None, headline: str | None = None) -> Path:
    """Write ``report.html`` (sections: see the module docstring).

    Args:
        path: the file (written through a fresh temporary file and a rename, see
            :mod:`vision_attn.outputs`).
        title: page title.
        metrics: the run's metrics (``metrics.json``).
        config: a summary folded at the end as JSON (model, data, checkpoint); its
            ``checkpoint`` and ``split`` also go in the summary line.
        items: per explained image ``{"name", "text", "image" (data URI), "panels" [data URIs],
            "kind" ("patches" | "boxes" | "words" | None), "grid" [h, w], "maps" (quantised),
            ...}``: ``patches`` add ``layers``, ``heads``; ``boxes`` add ``boxes`` (xyxy
            fractions) and ``labels``; ``words`` add ``words``. Optional: ``truth``, ``pred``,
            ``score`` (else taken from ``predictions``), ``cider``, ``missed`` / ``false``
            (detection: the ground-truth objects no detection matched / the detections that
            matched nothing, as :func:`~vision_attn.explain.detection.detection_errors` records
            ``{"label", "score", "why", "box"}`` or as plain labels), ``classes`` (what the class
            filter matches).
        curves: mean deletion curves per method (classification).
        canvas: side of the interactive canvas in pixels.
        root: the output folder the page must stay in (default: its own folder).
        task: ``classification`` | ``detection`` | ``captioning`` (default: guessed from the
            other arguments and the items' kinds).
        per_class: ``per_class.json`` (classification ``{class: {acc, n, precision, recall}}``,
            detection ``{category: {ap, ap_50, n_gt}}``).
        confusion: ``confusion_matrix.json`` (``{"labels", "counts"}``, rows = truth).
        predictions: ``predictions.json``: joined to the items by name (``file``, or
            ``image id <image_id>``) for truth / prediction / score / CIDEr-D; the
            classification and captioning mistakes galleries rank the whole split's records.
        training_curves: :func:`read_training_curves` of the checkpoint.
        pr_curves: detection: ``pr_curves.json`` (``{category: {"recall": [...], "precision":
            [...]}}``, :func:`~vision_attn.metrics.breakdown.pr_curves_from_precision`: pycocotools'
            ``eval["precision"][0, :, k, 0, -1]`` over its 101 recall points — IoU 0.5, all
            areas, 100 detections), or ``{category: [[recall, precision], ...]}``; ``-1``
            points are left out; at most 8 categories are drawn.
        split_size: images in the split (default: the confusion matrix's total, or the number
            of classification / captioning predictions).
        mistakes: cards in the mistakes gallery (``eval.py`` explains as many worst mistakes,
            ``--explain.mistakes``, default 8).
        sections: the task's result sections, shown after the summary (default: the built-in
            task's, from ``per_class``, ``confusion``, ``metrics`` and ``pr_curves``). The
            confusion-matrix filter works on their :class:`~vision_attn.blocks.ConfusionMatrix`
            with the id ``confusion``.
        headline: the metric of the summary line and of the training plot (default: the task's,
            :data:`~vision_attn.report.sections.HEADLINE`; the first metric when missing).

    Every text is HTML-escaped where it enters markup, and the data the script reads is
    embedded with :func:`script_json`, so no name, label or word can run script in the page.
    """
    task = task or _guess_task(items, per_class, confusion)
    headline = headline or HEADLINE.get(task or "")
    if sections is None:
        sections = result_sections(task, per_class, confusion, metrics, pr_curves)
    if split_size is None:
        split_size = _split_size(task, confusion, predictions)
    meta = item_meta(items, predictions)
    index = {str(it.get("name")): i for i, it in enumerate(items)}
    images, js_items = grid(items, meta, canvas)
    body = [f"<h1>{esc(title)}</h1>", summary(task, headline, metrics, config, split_size, len(items)),
            *(render_section(s, index) for s in sections), metrics_grid(metrics),
            training_section(training_curves, headline), quality_section(metrics, curves),
            mistakes_section(task, items, meta, predictions, mistakes), images, config_section(config)]
    matrix = _filter_matrix(sections)
    page_data = {"meta": meta, "classes": sorted({c for m in meta for c in m["classes"]}),
                 "labels": [str(x) for x in matrix.labels], "counts": [[int(c) for c in r] for r in matrix.counts]}
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{asset('report.css')}</style></head><body>{''.join(body)}"
            f"<script>const ITEMS={script_json(js_items)};const PAGE={script_json(page_data)};"
            f"{asset('report.js')}</script></body></html>")
    return write_text(path, page, root=root)


def _split_size(task: str | None, confusion: dict[str, Any] | None,
                predictions: list[dict[str, Any]] | None) -> int | None:
    """Images in the split: the confusion matrix's total, or the number of classification /
    captioning predictions (detection has one record per detection); ``None`` when unknown."""
    counts = (confusion or {}).get("counts") or []
    if counts:
        return sum(int(c) for row in counts for c in row)
    if predictions is not None and task in ("classification", "captioning"):
        return len(predictions)
    return None


def _filter_matrix(sections: Sequence[Section]) -> ConfusionMatrix:
    """The confusion matrix the grid's cell filter reads (id ``confusion``), or an empty one."""
    for section in sections:
        for block in section.blocks:
            if isinstance(block, ConfusionMatrix) and block.id == "confusion":
                return block
    return ConfusionMatrix([], [])


def _guess_task(items: list[dict[str, Any]], per_class: Any, confusion: Any) -> str | None:
    """The task a page is for, from its files: a confusion matrix or per-class accuracy is
    classification; else the items' kinds (boxes: detection, words: captioning, patches:
    classification)."""
    if confusion or (per_class and any(isinstance(v, dict) and "acc" in v for v in per_class.values())):
        return "classification"
    kinds = {it.get("kind") for it in items}
    return "detection" if "boxes" in kinds else "captioning" if "words" in kinds else (
        "classification" if "patches" in kinds else None)
