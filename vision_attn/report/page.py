"""A self-contained ``report.html``: what an evaluation found, and what the model looked at.

Everything is inside the one file — images as ``data:`` URIs, plots as inline SVG, attention
maps as quantised arrays, the script inline — so it opens from disk with no network. Top to
bottom:

1. a summary line: task, checkpoint, split and its size, the headline metric;
2. the task's results: **classification** — the per-class table (worst class first) and the
   confusion matrix (click a cell: the grid shows exactly the explained images of that cell);
   **detection** — per-class AP bars, the COCO size breakdown (``map_small`` ...,
   ``mar_1`` ...) and the precision-recall curves at IoU 0.5; then every other metric, compactly;
3. training curves (loss, the task metric, the learning rate) when the checkpoint sits in a run
   folder with ``csv/*/metrics.csv`` (:func:`read_training_curves`);
4. the explanation-quality table (method x deletion / insertion / pointing / energy / sanity,
   whichever ``metrics`` has, the random baseline last) and the mean deletion curves;
5. the mistakes gallery: the most confident wrong predictions (classification), images with
   missed or false detections (detection, when the items carry them: the most errors first,
   then the highest-scoring false detection, each error listed), the lowest-CIDEr captions
   (captioning), each with its overlays and a link to its interactive view — ``eval.py``
   explains the split's worst mistakes besides its seeded sample
   (:func:`~vision_attn.explain.evaluate.overlay_images`), so they have overlays wherever they
   lie in the split;
6. the grid of explained images, filterable (correct / wrong, class), each with its overlay
   panels and an interactive canvas: **classification** — click a patch to see what it attends
   to (a layer, a head or the heads fused); **detection** — click a box to see its query's
   cross-attention; **captioning** — hover a word to see where it looked;
7. the configuration, folded in a ``<details>``.

The page keeps a ``data-shown`` attribute on each canvas naming the map on display, so tests
(and users' scripts) can check that a click changed it. Every text that comes from data (class
names, file names, captions, configuration values, CSV column names) is HTML-escaped where it
enters markup, and the data the script reads is embedded with :func:`script_json`.

Size: large PNG panels are re-encoded as JPEG (:func:`compact_data_uri`) and the canvas image
is stored at its own resolution (at most ``side``), so a 16-image report stays at a few MB.
"""

from __future__ import annotations

import csv
import html
import json
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vision_attn.explain.records import compact_data_uri
from vision_attn.outputs import json_ready, write_text

__all__ = ["read_training_curves", "script_json",
           "write_report"]

log = logging.getLogger(__name__)

# Characters that could end a <script> element or start markup inside one, and the two line
# separators older JavaScript parsers reject in strings: written as JSON's \u escapes, which
# parse back to the same text.
_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}

# The headline metric of each task (the summary line, the training-curve metric).
HEADLINE = {"classification": "acc_top1", "detection": "map", "captioning": "cider"}

# The explanation-quality columns: metric prefix (``<prefix>_<method>`` in metrics.json), the
# column title and which direction is better.
_QUALITY = [("deletion_auc", "deletion AUC", "lower is better: the prediction falls fast as the top patches go"),
            ("insertion_auc", "insertion AUC", "higher is better: the prediction returns fast as the top patches come"),
            ("pointing", "pointing", "higher is better: share of maps whose peak is inside an object's box"),
            ("energy", "energy", "higher is better: share of the map's mass inside the object's boxes"),
            ("sanity", "sanity", "lower is better: rank correlation with the map of a randomised model")]
_QUALITY_EXTRA = ("explain_images", "explain_classes", "explain_words")
# Keys with a quality prefix that are no method's column: captioning's count of the words pointed at, and
# its earlier names of ``pointing_attention`` / ``pointing_random`` (kept in metrics.json for old readers).
_QUALITY_NOT_METHODS = ("pointing_words", "pointing_acc", "pointing_acc_random")
_SIZE_KEYS = ("map_small", "map_medium", "map_large", "mar_1", "mar_10", "mar_100")
_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def script_json(obj: Any) -> str:
    """``obj`` as JSON that is safe inside an HTML ``<script>`` element.

    ``<``, ``>``, ``&``, U+2028 and U+2029 are written as ``\\uXXXX`` escapes (JSON allows them
    only inside strings, where the escape means the same character), so no value (a category
    named ``</script><script>alert(1)</script>``, a caption word) can close the element or
    start markup; ``json.loads`` of the result gives ``obj`` back (non-finite numbers, which
    JSON cannot hold, become ``null``).
    """
    text = json.dumps(json_ready(obj)[0], allow_nan=False)
    for char, escaped in _SCRIPT_ESCAPES.items():
        text = text.replace(char, escaped)
    return text


# ---------------------------------------------------------------------------------------------- training curves
def _number(text: Any) -> float | None:
    """A finite float from a CSV cell, or ``None`` (empty, garbled, NaN, inf)."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _version_key(path: Path) -> tuple[int, str]:
    """``csv/version_10`` after ``csv/version_9``; other folder names after, by name."""
    m = re.fullmatch(r"version_(\d+)", path.parent.name)
    return (int(m.group(1)), "") if m else (1 << 30, path.parent.name)


def read_training_curves(ckpt_path: str | Path, max_bytes: int = 64 << 20) -> dict[str, Any] | None:
    """The training curves of the run a checkpoint belongs to, or ``None``.

    A checkpoint at ``<run>/checkpoints/<name>.ckpt`` belongs to ``<run>``; Lightning's
    ``CSVLogger`` writes ``<run>/csv/version_<k>/metrics.csv`` there (one version per start, a
    resumed run adds one). All versions are read in order, a later value for the same epoch
    replacing an earlier one. Nothing outside ``<run>`` is read: a ``csv`` folder or file that
    resolves (through links) outside the run folder is skipped, as are files over
    ``max_bytes``; unreadable, garbled or half-written files give what could be parsed.

    Returns:
        ``{"epochs": [int], "series": {"train/loss": [[epoch, value]], "val/loss": ...,
        "val/<metric>": ...}, "lr": {"<optimizer>/<group>": [[step, value]]}, "files":
        ["csv/version_0/metrics.csv", ...]}``: per epoch the epoch-level value of each
        ``train/*`` and ``val/*`` column (``train/loss_epoch`` is named ``train/loss``; per-step
        columns are left out), and the learning rate of each parameter group per logged step
        (groups with the same schedule as an earlier one are left out). ``None`` when the
        checkpoint is not in a ``checkpoints`` folder or no file gave a value.
    """
    ckpt = Path(ckpt_path)
    if ckpt.parent.name != "checkpoints":
        return None
    run = ckpt.parent.parent
    try:
        run_real = run.resolve(strict=True)
        found = sorted((run / "csv").glob("*/metrics.csv"), key=_version_key)
    except OSError:
        return None
    per_epoch: dict[str, dict[int, float]] = {}
    lr: dict[str, dict[float, float]] = {}
    used: list[str] = []
    for f in found:
        try:
            real = f.resolve(strict=True)
            if not real.is_relative_to(run_real) or not real.is_file():
                log.warning("training curves: skipped %s, which resolves outside the run folder %s", f, run)
                continue
            if real.stat().st_size > max_bytes:
                log.warning("training curves: skipped %s (%d bytes, more than %d)", f, real.stat().st_size, max_bytes)
                continue
            _read_metrics_csv(real, per_epoch, lr)
            used.append(real.relative_to(run_real).as_posix())
        except OSError as e:
            log.warning("training curves: could not read %s: %s", f, e)
    series = {name: [[e, v] for e, v in sorted(values.items())] for name, values in sorted(per_epoch.items()) if values}
    groups: dict[str, list[list[float]]] = {}
    for name, values in lr.items():
        points = [[s, v] for s, v in sorted(values.items())]
        if points and all(points != other for other in groups.values()):
            groups[name] = points
    if not series and not groups:
        return None
    epochs = sorted({int(e) for points in series.values() for e, _ in points})
    return {"epochs": epochs, "series": series, "lr": groups, "files": used}


def _read_metrics_csv(path: Path, per_epoch: dict[str, dict[int, float]], lr: dict[str, dict[float, float]]) -> None:
    """Add one ``metrics.csv``'s epoch-level values and learning rates (rows it cannot parse are skipped)."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            for row in csv.DictReader(fh):
                epoch, step = _number(row.get("epoch")), _number(row.get("step"))
                for col, cell in row.items():
                    if not isinstance(col, str) or not isinstance(cell, str):
                        continue  # a row with more cells than the header (restkey None), or fewer
                    value = _number(cell)
                    if value is None:
                        continue
                    if col.startswith("lr-") and step is not None:
                        lr.setdefault(col[3:], {})[step] = value
                    elif epoch is not None and col.startswith(("train/", "val/")) and not col.endswith("_step"):
                        name = col[: -len("_epoch")] if col.endswith("_epoch") else col
                        per_epoch.setdefault(name, {})[int(epoch)] = value
    except (csv.Error, UnicodeError) as e:
        log.warning("training curves: %s is garbled (%s); kept the rows before it", path, e)


# ---------------------------------------------------------------------------------------------- inline SVG plots
def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, digits: int = 4) -> str:
    """A metric for display: ``—`` for missing / NaN / COCO's -1 (no ground truth in range)."""
    if value is None or isinstance(value, bool):
        return "—"
    try:
        v = float(value)
    except (TypeError, ValueError):
        return _esc(value)
    if not math.isfinite(v) or v == -1.0:
        return "—"
    return f"{v:.{digits}f}" if abs(v) < 1e4 else f"{v:.4g}"


def _tick(v: float) -> str:
    """An axis end label: 3 significant digits, short exponents for learning rates (``4.48e-4``)."""
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
        mantissa, exponent = f"{v:.2e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{v:.3g}" if v != 0 else "0"


def _line_svg(svg_id: str, series: dict[str, Sequence[Sequence[float]]], xlabel: str, ylabel: str = "",
              width: int = 380, height: int = 210, y_range: tuple[float, float] | None = None,
              legend: str = "top-right") -> str:
    """Inline SVG line plot of ``{name: [[x, y], ...]}``: axes with their ranges, a legend
    (``top-right``, ``bottom-right`` or ``bottom-left`` inside the plot: where the curves leave
    room), a dot per point when a series has few points (one point still shows)."""
    left, right, top, bottom = 54, 8, 8, 34
    pw, ph = width - left - right, height - top - bottom
    series = {name: [(float(x), float(y)) for x, y in points if math.isfinite(float(x)) and math.isfinite(float(y))]
              for name, points in series.items()}
    pts = [p for s in series.values() for p in s]
    if not pts:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = y_range if y_range else (min(ys), max(ys))
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 0.5), y1 + (abs(y1) * 0.1 or 0.5)

    def sx(x: float) -> float:
        return left + pw * (x - x0) / (x1 - x0)

    def sy(y: float) -> float:
        return top + ph * (1 - (y - y0) / (y1 - y0))

    parts = [f'<svg id="{_esc(svg_id)}" class="plot" width="{width}" height="{height}" role="img" '
             f'viewBox="0 0 {width} {height}">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>']
    for v, anchor in ((y0, "end"), (y1, "end")):
        parts.append(f'<text x="{left - 4}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="{anchor}">{_tick(v)}</text>')
    for v, anchor in ((x0, "start"), (x1, "end")):
        parts.append(f'<text x="{sx(v):.1f}" y="{top + ph + 12}" font-size="10" text-anchor="{anchor}">{_tick(v)}</text>')
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{height - 6}" font-size="11" text-anchor="middle">{_esc(xlabel)}</text>')
    if ylabel:
        parts.append(f'<text x="10" y="{top + ph / 2:.1f}" font-size="11" text-anchor="middle" '
                     f'transform="rotate(-90 10 {top + ph / 2:.1f})">{_esc(ylabel)}</text>')
    for i, (name, points) in enumerate(series.items()):
        c = _COLOURS[i % len(_COLOURS)]
        coords = [(sx(float(x)), sy(min(max(float(y), y0), y1))) for x, y in points]
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        if len(coords) <= 30:
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{c}"/>' for x, y in coords]
        if legend.startswith("bottom"):
            y = top + ph - 6 - 13 * (len(series) - 1 - i)
            x, anchor = (left + 6, "start") if legend == "bottom-left" else (left + pw - 4, "end")
            parts.append(f'<text x="{x}" y="{y}" fill="{c}" font-size="11" text-anchor="{anchor}">{_esc(name)}</text>')
        else:
            parts.append(f'<text x="{left + pw - 4}" y="{top + 14 + 13 * i}" fill="{c}" font-size="11" '
                         f'text-anchor="end">{_esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bars_svg(svg_id: str, rows: list[tuple[str, float | None, float | None, str]], width: int = 520,
              value_label: str = "AP", back_label: str = "AP@0.5") -> str:
    """Horizontal bars in [0, 1]: per row ``(name, value, background value, note)``; the
    background bar (lighter) is drawn behind; ``None`` / -1 show as "no ground truth"."""
    label_w, bar_h, gap, top = 150, 16, 4, 22
    pw = width - label_w - 130
    height = top + len(rows) * (bar_h + gap) + 8
    parts = [f'<svg id="{_esc(svg_id)}" class="plot" width="{width}" height="{height}" role="img" '
             f'viewBox="0 0 {width} {height}">']
    if back_label:  # the legend: only needed when there are two bars per row
        parts.append(f'<rect x="{label_w}" y="4" width="12" height="10" fill="#9ecae1"/><text x="{label_w + 16}" '
                     f'y="13" font-size="11">{_esc(back_label)}</text><rect x="{label_w + 90}" y="4" width="12" '
                     f'height="10" fill="#1f77b4"/><text x="{label_w + 106}" y="13" font-size="11">'
                     f'{_esc(value_label)}</text>')
    for i, (name, value, back, note) in enumerate(rows):
        y = top + i * (bar_h + gap)
        parts.append(f'<g><title>{_esc(name)}</title><text x="{label_w - 6}" y="{y + bar_h - 4}" font-size="11" '
                     f'text-anchor="end">{_esc(name[:24])}</text></g>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{pw}" height="{bar_h}" fill="#f3f3f3"/>')
        known = [v for v in (back, value) if v is not None and v >= 0]
        if back is not None and back >= 0:
            parts.append(f'<rect class="bar" x="{label_w}" y="{y}" width="{pw * min(back, 1.0):.1f}" height="{bar_h}" '
                         'fill="#9ecae1"/>')
        if value is not None and value >= 0:
            parts.append(f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{pw * min(value, 1.0):.1f}" '
                         f'height="{bar_h - 6}" fill="#1f77b4"/>')
        text = f"{_fmt(value, 3)} {note}" if known else f"no ground truth {note}"
        parts.append(f'<text x="{label_w + pw + 4}" y="{y + bar_h - 4}" font-size="10">{_esc(text.strip())}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _curve_svg(curves: dict[str, list[float]]) -> str:
    """Inline SVG of the mean deletion curves (x: fraction of patches deleted, y: probability)."""
    series = {name: [[k / max(1, len(ys) - 1), y] for k, y in enumerate(ys)] for name, ys in curves.items()}
    return _line_svg("deletion", series, "fraction of patches deleted (0 → 1)", "probability", y_range=(0.0, 1.0))


# ---------------------------------------------------------------------------------------------- page sections
def _float_or_none(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _record_key(record: dict[str, Any]) -> str | None:
    """The item name a ``predictions.json`` record belongs to: its ``file`` (classification), or
    ``image id <id>`` (detection, captioning: the names their explanation code gives items)."""
    if "file" in record:
        return str(record["file"])
    if "image_id" in record:
        return f"image id {record['image_id']}"
    return None


def _item_meta(items: list[dict[str, Any]], predictions: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Per item what the filters and galleries need: ``truth``, ``pred``, ``score``, ``correct``,
    ``cider``, ``missed``, ``false``, ``classes`` — from the item itself where it carries them,
    else from its ``predictions.json`` record (joined by name, see :func:`_record_key`)."""
    by_name: dict[str, dict[str, Any]] = {}
    for r in predictions or []:
        key = _record_key(r) if isinstance(r, dict) else None
        if key is not None and key not in by_name:
            by_name[key] = r
    meta = []
    for it in items:
        r = by_name.get(str(it.get("name")), {})
        truth = it.get("truth", r.get("label"))
        pred = it.get("pred", r.get("pred"))
        m: dict[str, Any] = {"truth": None if truth is None else str(truth), "pred": None if pred is None else str(pred),
                             "score": _float_or_none(it.get("score", r.get("score"))),
                             "cider": _float_or_none(it.get("cider", r.get("cider")))}
        m["correct"] = None if m["truth"] is None or m["pred"] is None else m["truth"] == m["pred"]
        m["missed"] = [_error_text(x) for x in it.get("missed") or []]
        m["false"] = [_error_text(x) for x in it.get("false") or []]
        m["false_score"] = max((s for x in it.get("false") or [] if isinstance(x, dict)
                                and (s := _float_or_none(x.get("score"))) is not None), default=None)
        classes = it.get("classes")
        m["classes"] = ([str(c) for c in classes] if classes is not None
                        else [m["truth"]] if m["truth"] is not None else [m["pred"]] if m["pred"] is not None else [])
        meta.append(m)
    return meta


def _error_text(error: Any) -> str:
    """A missed object or false detection for display: ``label``, ``label 0.87``, ``label 0.87
    (wrong class: cat)``; a plain string as it is (see
    :func:`~vision_attn.explain.detection.detection_errors` for the records)."""
    if not isinstance(error, dict):
        return str(error)
    text = str(error.get("label", "?"))
    score = _float_or_none(error.get("score"))
    if score is not None:
        text += f" {score:.2f}"
    if error.get("why"):
        text += f" ({error['why']})"
    return text


def _guess_task(items: list[dict[str, Any]], per_class: Any, confusion: Any) -> str | None:
    if confusion or (per_class and any(isinstance(v, dict) and "acc" in v for v in per_class.values())):
        return "classification"
    kinds = {it.get("kind") for it in items}
    return "detection" if "boxes" in kinds else "captioning" if "words" in kinds else (
        "classification" if "patches" in kinds else None)


def _summary(task: str | None, metrics: dict[str, Any], config: dict[str, Any], split_size: int | None,
             n_items: int) -> str:
    """The one line a reader acts on: task, checkpoint, split and size, headline metric."""
    bits = [f'<b>{_esc(task or "evaluation")}</b>']
    if config.get("checkpoint") is not None:
        bits.append(f'checkpoint <code>{_esc(config["checkpoint"])}</code>')
    split = config.get("split")
    if split is not None or split_size is not None:
        size = f", {split_size} images" if split_size is not None else ""
        bits.append(f'split <code>{_esc(split if split is not None else "?")}</code>{size}')
    key = HEADLINE.get(task or "")
    if key is None or key not in metrics:
        key = next(iter(metrics), None)
    if key is not None:
        bits.append(f'{_esc(key)} <b class="headline">{_fmt(metrics[key])}</b>')
    bits.append(f"{n_items} images explained below")
    return '<p class="summary" id="summary">' + " · ".join(bits) + "</p>"


def _metrics_grid(metrics: dict[str, Any]) -> str:
    """Every metric that is not an explanation-quality one, compactly (name: value cells)."""
    keys = [k for k in metrics if not _is_quality_key(k)]
    if not keys:
        return ""
    cells = "".join(f'<div><span>{_esc(k)}</span> <b>{_fmt(metrics[k])}</b></div>' for k in keys)
    return f'<h2>Metrics</h2><div class="metrics" id="metrics">{cells}</div>'


def _is_quality_key(key: str) -> bool:
    return key in _QUALITY_EXTRA or any(key == p or key.startswith(p + "_") for p, _, _ in _QUALITY)


def _quality_table(metrics: dict[str, Any]) -> str:
    """Method x (deletion, insertion, pointing, energy, sanity) from ``<prefix>_<method>`` keys;
    the random baseline last; columns only where some method has a value."""
    table: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        if key in _QUALITY_NOT_METHODS:
            continue
        for prefix, _, _ in _QUALITY:
            if key.startswith(prefix + "_"):
                table.setdefault(key[len(prefix) + 1:], {})[prefix] = value
    if not table:
        return ""
    cols = [(p, t, h) for p, t, h in _QUALITY if any(p in row for row in table.values())]
    methods = sorted(table, key=lambda m: (m == "random", m))
    head = "".join(f'<th title="{_esc(h)}">{_esc(t)} {"↓" if h.startswith("lower") else "↑"}</th>' for p, t, h in cols)
    rows = []
    for m in methods:
        name = "random (baseline)" if m == "random" else m
        cells = "".join(f"<td>{_fmt(table[m].get(p), 3)}</td>" for p, _, _ in cols)
        rows.append(f'<tr class="{"baseline" if m == "random" else "method"}"><th>{_esc(name)}</th>{cells}</tr>')
    n = metrics.get("explain_images")
    note = f" Measured on {int(n)} images." if _float_or_none(n) is not None else ""
    pointed, words = _float_or_none(metrics.get("pointing_words")), _float_or_none(metrics.get("explain_words"))
    if words is not None:
        note += f" Captioning: over {int(words)} generated words"
        note += f" ({int(pointed)} name an object of the image: pointing, energy)." if pointed is not None else "."
    return (f'<h2>Explanation quality</h2><p class="note">Arrows say which direction is better; a method '
            f'should beat the random baseline.{note}</p><table id="quality"><tr><th>method</th>{head}</tr>'
            + "".join(rows) + "</table>")


def _classification_section(per_class: dict[str, Any] | None, confusion: dict[str, Any] | None) -> str:
    """Per-class table (worst accuracy first, with the class each is most confused with) and the
    clickable confusion matrix (SVG; row-normalised colour, counts in the cells)."""
    parts = []
    labels: list[str] = [str(x) for x in (confusion or {}).get("labels") or []]
    counts = [[int(c) for c in row] for row in (confusion or {}).get("counts") or []]
    if per_class:
        def order(item: tuple[str, Any]) -> tuple[int, float]:
            acc = _float_or_none(item[1].get("acc")) if isinstance(item[1], dict) else None
            return (acc is None, acc if acc is not None else 0.0)

        rows = []
        for name, row in sorted(per_class.items(), key=order):
            row = row if isinstance(row, dict) else {}
            confused = ""
            if name in labels and len(counts) == len(labels):
                t = labels.index(name)
                off = [(c, labels[p]) for p, c in enumerate(counts[t]) if p != t and c > 0]
                if off:
                    c, other = max(off, key=lambda x: x[0])
                    confused = f"{_esc(other)} ({c})"
            acc = _float_or_none(row.get("acc"))
            bar = f'<span class="bar" style="width:{60 * acc:.0f}px"></span>' if acc is not None else ""
            rows.append(f"<tr><th>{_esc(name)}</th><td>{_esc(row.get('n', '—'))}</td><td>{bar}{_fmt(acc, 3)}</td>"
                        f"<td>{_fmt(row.get('precision'), 3)}</td><td>{_fmt(row.get('recall'), 3)}</td>"
                        f"<td>{confused}</td></tr>")
        parts.append('<div class="panel-box"><h4>Per class (worst first)</h4><table id="per-class">'
                     "<tr><th>class</th><th>n</th><th>acc</th><th>precision</th><th>recall</th>"
                     "<th>most confused with</th></tr>" + "".join(rows) + "</table></div>")
    if labels and len(counts) == len(labels) and all(len(r) == len(labels) for r in counts):
        parts.append('<div class="panel-box"><h4>Confusion matrix (rows: truth, columns: predicted; '
                     'click a cell)</h4>' + _confusion_svg(labels, counts) + "</div>")
    return '<div class="row">' + "".join(parts) + "</div>" if parts else ""


def _confusion_svg(labels: list[str], counts: list[list[int]]) -> str:
    n = len(labels)
    cell = max(6, min(34, 480 // max(n, 1)))
    show_text = cell >= 12
    margin = min(130, 7 * max((len(x) for x in labels), default=1) + 10) if show_text else 10
    size = margin + n * cell + 4
    parts = [f'<svg id="confusion" class="plot" width="{size}" height="{size}" role="img" viewBox="0 0 {size} {size}">']
    for t in range(n):
        total = sum(counts[t]) or 1
        for p in range(n):
            share, c = counts[t][p] / total, counts[t][p]
            colour = f"rgba(31,119,180,{share:.3f})" if t == p else f"rgba(214,39,40,{share:.3f})"
            parts.append(f'<rect class="cell" data-t="{t}" data-p="{p}" x="{margin + p * cell}" y="{margin + t * cell}" '
                         f'width="{cell - 1}" height="{cell - 1}" fill="{colour}" stroke="#ddd">'
                         f'<title>{_esc(labels[t])} → {_esc(labels[p])}: {c}</title></rect>')
            if show_text and c:
                parts.append(f'<text x="{margin + p * cell + cell / 2:.1f}" y="{margin + t * cell + cell / 2 + 4:.1f}" '
                             f'font-size="10" text-anchor="middle" pointer-events="none">{c}</text>')
        if show_text:
            y = margin + t * cell + cell / 2 + 4
            parts.append(f'<text x="{margin - 4}" y="{y:.1f}" font-size="10" text-anchor="end">{_esc(labels[t][:18])}</text>')
            x = margin + t * cell + cell / 2 + 4
            parts.append(f'<text x="{x:.1f}" y="{margin - 4}" font-size="10" transform="rotate(-90 {x:.1f} {margin - 4})">'
                         f'{_esc(labels[t][:18])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _detection_section(per_class: dict[str, Any] | None, metrics: dict[str, Any],
                       pr_curves: dict[str, Sequence[Sequence[float]]] | None = None) -> str:
    """Per-category AP bars (AP@[.5:.95] over AP@0.5, worst first), the COCO size breakdown and,
    when given, precision-recall curves (``{category: [[recall, precision], ...]}``)."""
    parts = []
    if per_class:
        rows = []
        for name, row in per_class.items():
            row = row if isinstance(row, dict) else {}
            rows.append((str(name), _float_or_none(row.get("ap")), _float_or_none(row.get("ap_50")),
                         f"({row.get('n_gt', '?')} objects)"))
        rows.sort(key=lambda r: (r[1] is None or r[1] < 0, r[1] if r[1] is not None else 0.0))
        parts.append('<div class="panel-box"><h4>AP per category (worst first)</h4>'
                     + _bars_svg("ap-per-class", rows) + "</div>")
    sizes = [(k, _float_or_none(metrics.get(k))) for k in _SIZE_KEYS if k in metrics]
    if sizes:
        rows = [(k, v, None, "") for k, v in sizes]  # -1 (COCO: no object of that size) reads "no ground truth"
        parts.append('<div class="panel-box"><h4 title="COCO: small &lt; 32², large &gt; 96² pixels of area; mar_k: recall '
                     'with at most k detections per image">By object size; recall at 1 / 10 / 100 detections</h4>'
                     + _bars_svg("size-breakdown", rows, value_label="value", back_label="") + "</div>")
    curves = _pr_points(pr_curves)
    if curves:
        shown = dict(list(curves.items())[:8])
        more = f" (the first 8 of {len(curves)} categories)" if len(curves) > 8 else ""
        parts.append('<div class="panel-box"><h4 title="COCOeval&#x27;s interpolated precision at each recall '
                     'threshold; IoU 0.5, all areas, 100 detections per image">Precision-recall at IoU 0.5'
                     f'{_esc(more)}</h4>' + _line_svg("pr-curves", shown, "recall", "precision", width=420, height=250,
                                                      y_range=(0.0, 1.0), legend="bottom-left")
                     + "</div>")
    return '<div class="row">' + "".join(parts) + "</div>" if parts else ""


def _pr_points(pr_curves: dict[str, Any] | None) -> dict[str, list[list[float]]]:
    """``{category: [[recall, precision], ...]}`` from either form write_report accepts: point lists,
    or ``pr_curves.json``'s ``{"recall": [...], "precision": [...]}``. Points with precision
    ``-1`` (pycocotools: no ground truth) are left out, and so are categories left without any."""
    out: dict[str, list[list[float]]] = {}
    for name, curve in (pr_curves or {}).items():
        if isinstance(curve, dict):
            pairs = list(zip(curve.get("recall") or [], curve.get("precision") or [], strict=False))
        else:
            pairs = [tuple(p)[:2] for p in curve or [] if isinstance(p, list | tuple) and len(p) >= 2]
        points = [[r, p] for r, p in ((_float_or_none(a), _float_or_none(b)) for a, b in pairs)
                  if r is not None and p is not None and p >= 0]
        if points:
            out[str(name)] = points
    return out


def _training_section(training_curves: dict[str, Any] | None, task: str | None) -> str:
    """Loss (train and validation), the task metric, and the learning rate, per epoch / step."""
    if not training_curves:
        return ""
    series = training_curves.get("series") or {}
    plots = []
    loss = {k: v for k, v in series.items() if k in ("train/loss", "val/loss") and v}
    if loss:
        plots.append(_line_svg("curve-loss", loss, "epoch", "loss"))
    key = "val/" + HEADLINE.get(task or "", "")
    metric = {key: series[key]} if series.get(key) else {
        k: v for k, v in list((k, v) for k, v in series.items() if k.startswith("val/") and "loss" not in k)[:4] if v}
    if metric:
        plots.append(_line_svg("curve-metric", metric, "epoch", "validation metric", legend="bottom-right"))
    lr = {k: v for k, v in (training_curves.get("lr") or {}).items() if v}
    if lr:
        plots.append(_line_svg("curve-lr", dict(list(lr.items())[:6]), "optimizer step", "learning rate"))
    if not plots:
        return ""
    files = ", ".join(f"<code>{_esc(f)}</code>" for f in training_curves.get("files") or [])
    return (f'<h2>Training</h2><p class="note">From the run\'s {files or "CSV logs"}.</p><div class="row">'
            + "".join(f'<div class="panel-box">{p}</div>' for p in plots) + "</div>")


def _mistakes_section(task: str | None, items: list[dict[str, Any]], meta: list[dict[str, Any]],
                      predictions: list[dict[str, Any]] | None, limit: int) -> str:
    """The mistakes gallery: one card per mistake, worst first, with the overlay panel of the
    explained ones (copied by the script from the grid, so the page holds each image once) and
    a link to its interactive view."""
    index = {str(it.get("name")): i for i, it in enumerate(items)}
    cards: list[tuple[dict[str, Any], int | None, str]] = []  # (data, item index, caption html)
    if task == "classification":
        wrong = [r for r in predictions or [] if isinstance(r, dict) and "label" in r and "pred" in r
                 and str(r["label"]) != str(r["pred"])]
        source = "the split"
        if predictions is None:
            wrong = [{"file": it.get("name"), "label": m["truth"], "pred": m["pred"], "score": m["score"]}
                     for it, m in zip(items, meta, strict=True) if m["correct"] is False]
            source = "the explained images"
        if not wrong:
            return ('<h2>Mistakes</h2><p class="note" id="mistakes">No wrong prediction in '
                    f'{source}.</p>' if predictions is not None or any(m["correct"] is not None for m in meta) else "")
        wrong.sort(key=lambda r: -(_float_or_none(r.get("score")) or 0.0))
        for rank, r in enumerate(wrong[:limit], 1):
            score = _float_or_none(r.get("score"))
            caption = (f'#{rank} <b>{_esc(r["label"])}</b> → <b>{_esc(r["pred"])}</b> {_fmt(score, 3)} '
                       f'<span class="name">{_esc(r.get("file", ""))}</span>')
            cards.append(({"score": score}, index.get(str(r.get("file"))), caption))
        intro = (f"{len(wrong)} wrong predictions in {source}; the {len(cards)} most confident, most confident "
                 "first (truth → predicted, probability).")
    elif task == "captioning":
        records = [(c, k, _record_key(r), r.get("caption")) for k, r in enumerate(predictions or [])
                   if isinstance(r, dict) and (c := _float_or_none(r.get("cider"))) is not None]
        if records:  # the whole split's captions, joined to the explained items by name
            scored = [(c, index.get(str(key)), str(key), text) for c, _, key, text in sorted(records)]
            intro = f"The {min(limit, len(scored))} lowest-CIDEr captions of the split's {len(scored)}, lowest first."
        else:
            scored = [(c, i, str(items[i].get("name", "")), items[i].get("text", ""))
                      for c, i in sorted((m["cider"], i) for i, m in enumerate(meta) if m["cider"] is not None)]
            intro = "The explained images' lowest-CIDEr captions, lowest first."
        for rank, (cider, i, name, text) in enumerate(scored[:limit], 1):
            caption = (f'#{rank} CIDEr-D <b>{_fmt(cider, 3)}</b> <span class="name">{_esc(name)}</span><br>'
                       f'{_esc(text if text is not None else "")}')
            cards.append(({"score": cider}, i, caption))
        if not cards:
            return ""
    elif task == "detection":
        bad = sorted(((len(m["missed"]) + len(m["false"]), m["false_score"] or 0.0, i)
                      for i, m in enumerate(meta) if m["missed"] or m["false"]), key=lambda x: (-x[0], -x[1], x[2]))
        if not bad:  # an evaluation (it has predictions) says why the gallery is empty; a predict page says nothing
            return ('<h2>Mistakes</h2><p class="note" id="mistakes">Missed and false detections are listed here when '
                    "the explained images carry their matching to the ground truth; these do not.</p>"
                    if predictions is not None else "")
        for rank, (count, top, i) in enumerate(bad[:limit], 1):
            m = meta[i]
            missed = "".join(f"<li>{_esc(x)}</li>" for x in m["missed"]) or "<li>none</li>"
            false = "".join(f"<li>{_esc(x)}</li>" for x in m["false"]) or "<li>none</li>"
            caption = (f'#{rank} <span class="name">{_esc(items[i].get("name", ""))}</span> — {count} '
                       f'error{"s" if count != 1 else ""}'
                       f'<div class="errs"><div>missed ({len(m["missed"])}):<ul class="missed">{missed}</ul></div>'
                       f'<div>false ({len(m["false"])}):<ul class="false">{false}</ul></div></div>')
            cards.append(({"score": float(count), "top": top}, i, caption))
        intro = ("Explained images with missed objects (ground truth that no detection above the threshold matched "
                 "at IoU 0.5) or false detections (above the threshold, matching no object of their class), the "
                 "most errors first, then the highest-scoring false detection.")
    else:
        return ""
    html_cards = []
    for data, i, caption in cards:
        score = "" if data["score"] is None else f' data-score="{data["score"]!r}"'
        if data.get("top") is not None:
            score += f' data-top="{data["top"]!r}"'
        if i is None:
            body = '<div class="note">not among the explained images: no overlay</div>'
        else:
            body = (f'<img class="copy" data-item="{i}" alt="overlay"><a class="goto" href="#item{i}">interactive view ↓</a>')
        html_cards.append(f'<div class="mistake"{score} data-item="{"" if i is None else i}"><div>{caption}</div>{body}</div>')
    return (f'<h2>Mistakes</h2><p class="note">{_esc(intro)}</p><div class="mistakes" id="mistakes">'
            + "".join(html_cards) + "</div>")


def _grid(items: list[dict[str, Any]], meta: list[dict[str, Any]], canvas: int) -> tuple[str, list[dict[str, Any]]]:
    """The explained images (panels, interactive canvas) with their filters; and the script's items."""
    body, js_items = [], []
    has_correct = any(m["correct"] is not None for m in meta)
    classes = sorted({c for m in meta for c in m["classes"]})
    filters = []
    if has_correct:
        filters.append('show <select id="f-mode"><option value="all">all</option><option value="correct">correct'
                       '</option><option value="wrong">wrong</option></select>')
    if classes:
        opts = "".join(f'<option value="{k}">{_esc(c)}</option>' for k, c in enumerate(classes))
        filters.append(f'class <select id="f-class"><option value="">any</option>{opts}</select>')
    body.append(f'<h2 id="grid-top">Explained images ({len(items)})</h2><div class="filters" id="filters">'
                + " ".join(filters) + ' <button id="f-clear" type="button">show all</button> '
                '<span id="f-status"></span></div><div class="grid" id="grid">')
    for i, (it, m) in enumerate(zip(items, meta, strict=True)):
        badge = ""
        if m["truth"] is not None or m["pred"] is not None:
            cls = "" if m["correct"] is None else ' class="ok"' if m["correct"] else ' class="bad"'
            badge = (f'<p{cls}>{_esc(m["truth"] if m["truth"] is not None else "?")} → '
                     f'{_esc(m["pred"] if m["pred"] is not None else "?")} {_fmt(m["score"], 3)}</p>')
        elif m["cider"] is not None:
            badge = f'<p>CIDEr-D {_fmt(m["cider"], 3)}</p>'
        body.append(f'<div class="item" id="item{i}"><h3>{_esc(it.get("name", ""))}</h3>{badge}'
                    f'<p class="text">{_esc(it.get("text", ""))}</p>')
        panels = "".join(f'<img src="{_esc(compact_data_uri(str(p)))}" alt="overlay">' for p in it.get("panels", []))
        body.append(f'<div class="panels">{panels}</div>')
        kind = it.get("kind")
        if kind:
            controls = ""
            if kind == "patches":
                layers = "".join(f'<option value="{k}"{" selected" if k == it["layers"] - 1 else ""}>{k}</option>'
                                 for k in range(it["layers"]))
                heads = '<option value="fused">fused (mean)</option>' + "".join(
                    f'<option value="{k}">{k}</option>' for k in range(it["heads"]))
                controls = (f'<div class="controls">Click a patch to see what it attends to. Layer <select id="layer{i}">'
                            f'{layers}</select> head <select id="head{i}">{heads}</select></div>')
            elif kind == "boxes":
                missed = " Dashed red: objects no detection found." if it.get("missed_boxes") else ""
                controls = (f'<div class="controls">Click a box to see its query\'s cross-attention: <b id="sel{i}"></b>'
                            f'{missed}</div>')
            elif kind == "words":
                words = " ".join(f'<span class="word" data-k="{k}">{_esc(w)}</span>' for k, w in enumerate(it["words"]))
                controls = f'<div class="controls" id="words{i}">Hover a word: {words}</div>'
            body.append(controls + f'<canvas id="cv{i}" width="{canvas}" height="{canvas}" data-shown="image"></canvas>')
            js_item = {"id": i, **{k: v for k, v in it.items() if k not in ("panels", "name", "text")}}
            js_item["image"] = compact_data_uri(str(it.get("image", "")))
            js_items.append(js_item)
        body.append("</div>")
    body.append("</div>")
    return "".join(body), js_items


_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}
h2{margin:22px 0 6px;border-bottom:1px solid #ddd;padding-bottom:3px}h4{margin:4px 0}
.summary{font-size:15px;background:#f4f8fc;padding:8px 12px;border-left:4px solid #1f77b4}
.headline{font-size:18px}.note{color:#555;font-size:13px;margin:4px 0}code{font-size:12px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}
tr.baseline{color:#777;font-style:italic}.bar{display:inline-block;height:9px;background:#1f77b4;margin-right:4px}
.metrics{display:flex;flex-wrap:wrap;gap:4px 18px;font-size:13px}.metrics span{color:#555}
.row{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}.panel-box{min-width:0}
#confusion .cell{cursor:pointer}#confusion .cell.on{stroke:#000;stroke-width:2}
.mistakes{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}.mistake{border:1px solid #e0b4b4;background:#fff8f8;padding:6px;
font-size:13px;max-width:480px}.mistake img{max-width:100%;max-height:220px;display:block;margin:4px 0}
.name{color:#666;font-size:12px;word-break:break-all}.errs{display:flex;gap:16px}.errs ul{margin:2px 0;padding-left:18px}.filters{font-size:13px;margin:6px 0 10px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:14px}
.item{border:1px solid #ddd;padding:8px;min-width:0}.item h3{font-size:14px;margin:0 0 4px;word-break:break-all}
.item p{margin:2px 0;font-size:13px}.ok{color:#17803d}.bad{color:#c0392b;font-weight:600}[hidden]{display:none!important}
.panels img{max-width:100%;max-height:220px;margin:2px 0;border:1px solid #eee}
canvas{border:1px solid #999;cursor:crosshair;image-rendering:pixelated;max-width:100%}.word{padding:1px 3px;cursor:pointer}
.word:hover,.word.on{background:#fd0}.controls{margin:4px 0;font-size:13px}pre{font-size:12px;background:#f6f6f6;padding:8px;
overflow:auto}details{margin-top:20px}summary{cursor:pointer;font-weight:600}
"""

_SCRIPT = r"""
function decode(b64){const s=atob(b64);const a=new Uint8Array(s.length);for(let i=0;i<s.length;i++)a[i]=s.charCodeAt(i);return a;}
function jet(v){const f=x=>Math.min(1,Math.max(0,1.5-Math.abs(4*v-x)))*255;return `rgb(${f(3)|0},${f(2)|0},${f(1)|0})`;}
function View(item){
  const cv=document.getElementById('cv'+item.id),ctx=cv.getContext('2d'),img=new Image(),S=cv.width;
  const [gh,gw]=item.grid,N=gh*gw,data=item.maps?decode(item.maps):null,cw=S/gw,ch=S/gh;
  ctx.imageSmoothingEnabled=false;
  let mark=null;
  function paint(arr,off,label,extra){
    ctx.globalAlpha=1;ctx.drawImage(img,0,0,S,S);
    if(arr){let m=0;for(let i=0;i<N;i++)m=Math.max(m,arr[off+i]);ctx.globalAlpha=0.55;
      for(let i=0;i<N;i++){ctx.fillStyle=jet(m?arr[off+i]/m:0);ctx.fillRect((i%gw)*cw,Math.floor(i/gw)*ch,cw+0.5,ch+0.5);}}
    ctx.globalAlpha=1;if(extra)extra();cv.dataset.shown=label;}
  function drawBoxes(){ctx.lineWidth=2;item.boxes.forEach((b,k)=>{ctx.strokeStyle=k===mark?'#ff0':'#0f0';
    ctx.strokeRect(b[0]*S,b[1]*S,(b[2]-b[0])*S,(b[3]-b[1])*S);});
    ctx.setLineDash([5,3]);ctx.strokeStyle='#f33';(item.missed_boxes||[]).forEach(b=>
      ctx.strokeRect(b[0]*S,b[1]*S,(b[2]-b[0])*S,(b[3]-b[1])*S));ctx.setLineDash([]);}
  img.onload=()=>paint(null,0,'image',item.kind==='boxes'?drawBoxes:null);img.src=item.image;
  if(item.kind==='patches'){
    const H=item.heads,ls=document.getElementById('layer'+item.id),hs=document.getElementById('head'+item.id);
    const row=(l,h,p)=>((l*H+h)*N+p)*N;
    function show(p){const l=+ls.value,h=hs.value;mark=p;
      const outline=()=>{ctx.strokeStyle='#fff';ctx.lineWidth=2;ctx.strokeRect((p%gw)*cw,Math.floor(p/gw)*ch,cw,ch);};
      if(h==='fused'){const t=new Float32Array(N);for(let k=0;k<H;k++)for(let i=0;i<N;i++)t[i]+=data[row(l,k,p)+i]/H;
        paint(t,0,`layer${l}-fused-patch${p}`,outline);}
      else paint(data,row(l,+h,p),`layer${l}-head${h}-patch${p}`,outline);}
    cv.addEventListener('click',e=>{const r=cv.getBoundingClientRect();const x=Math.floor((e.clientX-r.left)/r.width*gw),
      y=Math.floor((e.clientY-r.top)/r.height*gh);show(Math.min(N-1,Math.max(0,y*gw+x)));});
    ls.onchange=hs.onchange=()=>{if(mark!==null)show(mark);};
  } else if(item.kind==='boxes'){
    cv.addEventListener('click',e=>{const r=cv.getBoundingClientRect();const fx=(e.clientX-r.left)/r.width,fy=(e.clientY-r.top)/r.height;
      let best=-1,area=1e9;item.boxes.forEach((b,k)=>{const a=(b[2]-b[0])*(b[3]-b[1]);
        if(fx>=b[0]&&fx<=b[2]&&fy>=b[1]&&fy<=b[3]&&a<area){best=k;area=a;}});
      if(best<0)return;mark=best;paint(data,best*N,`box${best}`,drawBoxes);
      document.getElementById('sel'+item.id).textContent=item.labels[best];});
  } else if(item.kind==='words'){
    const spans=document.querySelectorAll('#words'+item.id+' .word');
    spans.forEach(el=>{const k=+el.dataset.k;const on=()=>{spans.forEach(w=>w.classList.remove('on'));el.classList.add('on');
      paint(data,k*N,`word${k}`);};el.addEventListener('mouseenter',on);el.addEventListener('click',on);});
  }
}
const F={cell:null,n:0};
const byId=id=>document.getElementById(id);
function applyFilters(){
  const ms=byId('f-mode'),cs=byId('f-class'),st=byId('f-status');
  const mode=ms?ms.value:'all',cls=cs&&cs.value!==''?PAGE.classes[+cs.value]:null;let shown=0;
  PAGE.meta.forEach((m,i)=>{let ok=true;
    if(F.cell)ok=m.truth===F.cell[0]&&m.pred===F.cell[1];
    else{if(mode==='correct')ok=m.correct===true;else if(mode==='wrong')ok=m.correct===false;
      if(ok&&cls!==null)ok=m.classes.includes(cls);}
    const el=byId('item'+i);if(el){el.hidden=!ok;if(ok)shown++;}});
  document.querySelectorAll('#confusion .cell').forEach(r=>r.classList.toggle('on',!!F.cell&&
    PAGE.labels[+r.dataset.t]===F.cell[0]&&PAGE.labels[+r.dataset.p]===F.cell[1]));
  if(st)st.textContent=F.cell?`truth \u201c${F.cell[0]}\u201d, predicted \u201c${F.cell[1]}\u201d: ${F.n} images in the split, `+
    `${shown} of them explained below`:`showing ${shown} of ${PAGE.meta.length} explained images`;
  return shown;}
function resetFilters(){F.cell=null;const ms=byId('f-mode'),cs=byId('f-class');if(ms)ms.value='all';if(cs)cs.value='';applyFilters();}
for(const id of ['f-mode','f-class']){const el=byId(id);if(el)el.addEventListener('change',()=>{F.cell=null;applyFilters();});}
if(byId('f-clear'))byId('f-clear').addEventListener('click',resetFilters);
document.querySelectorAll('#confusion .cell').forEach(r=>r.addEventListener('click',()=>{
  const t=+r.dataset.t,p=+r.dataset.p;const ms=byId('f-mode'),cs=byId('f-class');if(ms)ms.value='all';if(cs)cs.value='';
  F.cell=[PAGE.labels[t],PAGE.labels[p]];F.n=PAGE.counts[t][p];applyFilters();byId('grid-top').scrollIntoView();}));
document.querySelectorAll('a.goto').forEach(a=>a.addEventListener('click',resetFilters));
document.querySelectorAll('img.copy').forEach(im=>{const s=document.querySelector('#item'+im.dataset.item+' .panels img');
  if(s)im.src=s.src;else im.remove();});
applyFilters();
window.addEventListener('load',()=>{for(const item of ITEMS)View(item);});
"""


def write_report(path: Path, title: str, metrics: dict[str, float], config: dict[str, Any], items: list[dict[str, Any]],
                 curves: dict[str, list[float]] | None = None, canvas: int = 256,
                 root: str | Path | None = None, *, task: str | None = None,
                 per_class: dict[str, dict[str, Any]] | None = None, confusion: dict[str, Any] | None = None,
                 predictions: list[dict[str, Any]] | None = None, training_curves: dict[str, Any] | None = None,
                 pr_curves: dict[str, Any] | None = None, split_size: int | None = None,
                 mistakes: int = 8) -> Path:
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

    Every text is HTML-escaped where it enters markup, and the data the script reads is
    embedded with :func:`script_json`, so no name, label or word can run script in the page.
    """
    task = task or _guess_task(items, per_class, confusion)
    labels = [str(x) for x in (confusion or {}).get("labels") or []]
    counts = [[int(c) for c in row] for row in (confusion or {}).get("counts") or []]
    if split_size is None:
        if counts:
            split_size = sum(map(sum, counts))
        elif predictions is not None and task in ("classification", "captioning"):
            split_size = len(predictions)
    meta = _item_meta(items, predictions)
    body = [f"<h1>{_esc(title)}</h1>", _summary(task, metrics, config, split_size, len(items))]
    if task == "classification":
        body.append(_classification_section(per_class, confusion))
    elif task == "detection":
        body.append(_detection_section(per_class, metrics, pr_curves))
    body.append(_metrics_grid(metrics))
    body.append(_training_section(training_curves, task))
    quality = _quality_table(metrics)
    if quality or curves:
        body.append(quality or "<h2>Explanation quality</h2>")
    if curves:
        body.append('<p class="note">Mean deletion curves: probability of the explained class as the most salient '
                    "patches are deleted first, over the explained images (lower = more faithful).</p>"
                    + _curve_svg(curves))
    body.append(_mistakes_section(task, items, meta, predictions, mistakes))
    grid, js_items = _grid(items, meta, canvas)
    body.append(grid)
    body.append(f'<details id="config"><summary>Configuration</summary><pre>'
                f'{_esc(json.dumps(config, indent=2, default=str))}</pre></details>')
    page_data = {"meta": meta, "classes": sorted({c for m in meta for c in m["classes"]}), "labels": labels,
                 "counts": counts}
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{_esc(title)}</title><style>{_STYLE}</style>"
            f"</head><body>{''.join(body)}<script>const ITEMS={script_json(js_items)};"
            f"const PAGE={script_json(page_data)};{_SCRIPT}</script></body></html>")
    return write_text(path, page, root=root)
