"""A self-contained ``report.html``: what an evaluation found, and what the model looked at.

Everything is inside the one file — images as ``data:`` URIs, plots as inline SVG, attention
maps as quantised arrays, the style sheet and the script (package files,
``vision_attn/report/assets/``) inline — so it opens from disk with no network. Top to bottom:

1. a summary line: task, checkpoint, split and its size, the headline metric;
2. the task's results, as :class:`~vision_attn.blocks.Section` records the task built
   (:meth:`~vision_attn.tasks.VisionTask.report_sections`: e.g. a per-class table and a confusion
   matrix — click a cell: the grid shows exactly the explained images of that cell — or bar charts
   and precision-recall curves); then every other metric, compactly;
3. training curves (loss, the task's headline metric, the learning rate) when the checkpoint sits
   in a run folder with ``csv/*/metrics.csv`` (:func:`~vision_attn.report.curves.read_training_curves`);
4. the explanation-quality table (method x deletion / insertion / pointing / energy / sanity,
   whichever ``metrics`` has, the random baseline last) and the mean deletion curves;
5. the mistakes gallery, the task's :class:`~vision_attn.blocks.Mistakes`
   (:meth:`~vision_attn.tasks.VisionTask.mistake_cards`, drawn by
   :func:`~vision_attn.report.gallery.mistakes_section`) — ``eval.py`` explains the split's worst
   mistakes (:meth:`~vision_attn.tasks.VisionTask.rank_mistakes`) besides its seeded sample, so
   they have overlays wherever they lie in the split;
6. the grid of explained images, filterable, each with its overlay panels and an interactive
   canvas (:func:`~vision_attn.report.gallery.grid`);
7. the configuration, folded in a ``<details>``.

The page keeps a ``data-shown`` attribute on each canvas naming the map on display, so tests
(and users' scripts) can check that a click changed it. Every text that comes from data (class
names, file names, captions, configuration values, CSV column names) is HTML-escaped where it
enters markup, and the data the script reads is embedded with :func:`script_json`.

Size: a page stays under :data:`~vision_attn.report.budget.MAX_PAGE_BYTES` (10 MB) whatever the
model and the number of images (:mod:`vision_attn.report.budget`): each explained image gets a
share of the budget for its pictures (re-encoded as JPEG, smaller when needed) and for the
patches view's attention rows (every layer and head when they fit; else the layers or heads
averaged, the last layer, a pooled patch grid; ``full_attention`` keeps them all). Pictures
are lazy-loaded (``loading="lazy"``): the browser decodes those in view first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from vision_attn.blocks import ConfusionMatrix, Mistakes, Section
from vision_attn.outputs import write_text
from vision_attn.report.budget import fit_items
from vision_attn.report.curves import read_training_curves
from vision_attn.report.gallery import grid, item_meta, mistakes_section
from vision_attn.report.markup import esc, script_json
from vision_attn.report.render import render_section
from vision_attn.report.sections import (
    config_section,
    metrics_grid,
    quality_section,
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
                 predictions: list[dict[str, Any]] | None = None, training_curves: dict[str, Any] | None = None,
                 split_size: int | None = None, sections: Sequence[Section] = (), headline: str | None = None,
                 mistakes: Mistakes | None = None, full_attention: bool = False) -> Path:
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
            fractions), ``labels`` and optionally ``missed_boxes``; ``words`` add ``words``.
            Optional: ``truth``, ``pred``, ``score`` (else taken from ``predictions``), ``cider``,
            ``classes`` (what the class filter matches).
        curves: mean deletion curves per method.
        canvas: side of the interactive canvas in pixels.
        root: the output folder the page must stay in (default: its own folder).
        task: the task's name, shown first in the summary line (default: ``evaluation``).
        predictions: ``predictions.json``: joined to the items by name (``file``, or
            ``image id <image_id>``) for truth / prediction / score / CIDEr-D.
        training_curves: :func:`read_training_curves` of the checkpoint.
        split_size: images in the split (default: the total of the confusion matrix with the id
            ``confusion``, when a section has one).
        sections: the task's result sections, shown after the summary
            (:meth:`~vision_attn.tasks.VisionTask.report_sections`). The grid's cell filter works on
            their :class:`~vision_attn.blocks.ConfusionMatrix` with the id ``confusion``.
        headline: the metric of the summary line and of the training plot
            (:attr:`~vision_attn.tasks.VisionTask.headline_metric`; the first metric when missing).
        mistakes: the mistakes gallery (:meth:`~vision_attn.tasks.VisionTask.mistake_cards`;
            ``None``: none).
        full_attention: keep every layer and head of the patches views' attention rows (the
            page then grows with the model and the number of images; default: each image's
            rows fitted to its share of the page, :func:`~vision_attn.report.budget.fit_items`).

    Every text is HTML-escaped where it enters markup, and the data the script reads is
    embedded with :func:`script_json`, so no name, label or word can run script in the page.
    """
    matrix = _filter_matrix(sections)
    if split_size is None and matrix.counts:
        split_size = sum(int(c) for row in matrix.counts for c in row)
    items = fit_items(items, full_attention)
    meta = item_meta(items, predictions)
    index = {str(it.get("name")): i for i, it in enumerate(items)}
    images, js_items = grid(items, meta, canvas)
    body = [f"<h1>{esc(title)}</h1>", summary(task, headline, metrics, config, split_size, len(items)),
            *(render_section(s, index) for s in sections), metrics_grid(metrics),
            training_section(training_curves, headline), quality_section(metrics, curves),
            mistakes_section(mistakes, index), images, config_section(config)]
    page_data = {"meta": meta, "classes": sorted({c for m in meta for c in m["classes"]}),
                 "labels": [str(x) for x in matrix.labels], "counts": [[int(c) for c in r] for r in matrix.counts]}
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{asset('report.css')}</style></head><body>{''.join(body)}"
            f"<script>const ITEMS={script_json(js_items)};const PAGE={script_json(page_data)};"
            f"{asset('report.js')}</script></body></html>")
    return write_text(path, page, root=root)


def _filter_matrix(sections: Sequence[Section]) -> ConfusionMatrix:
    """The confusion matrix the grid's cell filter reads (id ``confusion``), or an empty one."""
    for section in sections:
        for block in section.blocks:
            if isinstance(block, ConfusionMatrix) and block.id == "confusion":
                return block
    return ConfusionMatrix([], [])
