"""The page's sections above the images that every page has: the summary line, every metric, the
training curves and the explanation quality; the configuration at the end.

A task's own results are :class:`~vision_attn.blocks.Section` records that the task builds
(:meth:`~vision_attn.tasks.VisionTask.report_sections`) and
:func:`~vision_attn.report.render.render_section` draws. The sections here are markup built from
the metrics, every text from data HTML-escaped.
"""

from __future__ import annotations

import json
from typing import Any

from vision_attn.report.charts import line_svg
from vision_attn.report.markup import esc, finite, fmt

__all__ = ["config_section", "metrics_grid", "quality_section", "summary", "training_section"]

# The explanation-quality columns: metric prefix (``<prefix>_<method>`` in metrics.json), the
# column title and which direction is better.
_QUALITY = [
    ("deletion_auc", "deletion AUC", "lower is better: the prediction falls fast as the top patches go"),
    ("insertion_auc", "insertion AUC", "higher is better: the prediction returns fast as the top patches come"),
    ("pointing", "pointing", "higher is better: share of maps whose peak is inside an object's box"),
    ("energy", "energy", "higher is better: share of the map's mass inside the object's boxes"),
    ("sanity", "sanity", "lower is better: rank correlation with the map of a randomised model"),
]
_QUALITY_EXTRA = ("explain_images", "explain_classes", "explain_words")
# Keys with a quality prefix that are no method's column: captioning's count of the words pointed at,
# and its earlier names of ``pointing_attention`` / ``pointing_random`` (kept in metrics.json for old
# readers).
_QUALITY_NOT_METHODS = ("pointing_words", "pointing_acc", "pointing_acc_random")


def summary(task: str | None, headline: str | None, metrics: dict[str, Any], config: dict[str, Any],
            split_size: int | None, n_items: int) -> str:
    """The one line a reader acts on: task, checkpoint, split and size, the headline metric (the
    first metric when ``headline`` is not among them)."""
    bits = [f'<b>{esc(task or "evaluation")}</b>']
    if config.get("checkpoint") is not None:
        bits.append(f'checkpoint <code>{esc(config["checkpoint"])}</code>')
    split = config.get("split")
    if split is not None or split_size is not None:
        size = f", {split_size} images" if split_size is not None else ""
        bits.append(f'split <code>{esc(split if split is not None else "?")}</code>{size}')
    key = headline if headline in metrics else next(iter(metrics), None)
    if key is not None:
        bits.append(f'{esc(key)} <b class="headline">{fmt(metrics[key])}</b>')
    bits.append(f"{n_items} images explained below")
    return '<p class="summary" id="summary">' + " · ".join(bits) + "</p>"


def metrics_grid(metrics: dict[str, Any]) -> str:
    """Every metric that is not an explanation-quality one, compactly (name: value cells)."""
    keys = [k for k in metrics if not _is_quality_key(k)]
    if not keys:
        return ""
    cells = "".join(f"<div><span>{esc(k)}</span> <b>{fmt(metrics[k])}</b></div>" for k in keys)
    return f'<h2>Metrics</h2><div class="metrics" id="metrics">{cells}</div>'


def _is_quality_key(key: str) -> bool:
    return key in _QUALITY_EXTRA or any(key == p or key.startswith(p + "_") for p, _, _ in _QUALITY)


def quality_section(metrics: dict[str, Any], curves: dict[str, list[float]] | None) -> str:
    """The explanation-quality table (:func:`_quality_table`) and the mean deletion curves, when
    there is either."""
    table = _quality_table(metrics)
    if not table and not curves:
        return ""
    out = table or "<h2>Explanation quality</h2>"
    if curves:
        series = {name: [[k / max(1, len(ys) - 1), y] for k, y in enumerate(ys)] for name, ys in curves.items()}
        out += ('<p class="note">Mean deletion curves: probability of the explained class as the most salient '
                "patches are deleted first, over the explained images (lower = more faithful).</p>"
                + line_svg("deletion", series, "fraction of patches deleted (0 → 1)", "probability",
                           y_range=(0.0, 1.0)))
    return out


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
    head = "".join(f'<th title="{esc(h)}">{esc(t)} {"↓" if h.startswith("lower") else "↑"}</th>'
                   for p, t, h in cols)
    rows = []
    for m in methods:
        name = "random (baseline)" if m == "random" else m
        cells = "".join(f"<td>{fmt(table[m].get(p), 3)}</td>" for p, _, _ in cols)
        rows.append(f'<tr class="{"baseline" if m == "random" else "method"}"><th>{esc(name)}</th>{cells}</tr>')
    n = metrics.get("explain_images")
    note = f" Measured on {int(n)} images." if finite(n) is not None else ""
    pointed, words = finite(metrics.get("pointing_words")), finite(metrics.get("explain_words"))
    if words is not None:
        note += f" Captioning: over {int(words)} generated words"
        note += f" ({int(pointed)} name an object of the image: pointing, energy)." if pointed is not None else "."
    return (f'<h2>Explanation quality</h2><p class="note">Arrows say which direction is better; a method '
            f'should beat the random baseline.{note}</p><table id="quality"><tr><th>method</th>{head}</tr>'
            + "".join(rows) + "</table>")


def training_section(training_curves: dict[str, Any] | None, headline: str | None) -> str:
    """Loss (train and validation), the validation headline metric (else up to 4 validation
    metrics), and the learning rate, per epoch / step (:func:`~vision_attn.report.curves.read_training_curves`)."""
    if not training_curves:
        return ""
    series = training_curves.get("series") or {}
    plots = []
    loss = {k: v for k, v in series.items() if k in ("train/loss", "val/loss") and v}
    if loss:
        plots.append(line_svg("curve-loss", loss, "epoch", "loss"))
    key = f"val/{headline or ''}"
    others = [(k, v) for k, v in series.items() if k.startswith("val/") and "loss" not in k]
    metric = {key: series[key]} if series.get(key) else {k: v for k, v in others[:4] if v}
    if metric:
        plots.append(line_svg("curve-metric", metric, "epoch", "validation metric", legend="bottom-right"))
    lr = {k: v for k, v in (training_curves.get("lr") or {}).items() if v}
    if lr:
        plots.append(line_svg("curve-lr", dict(list(lr.items())[:6]), "optimizer step", "learning rate"))
    if not plots:
        return ""
    files = ", ".join(f"<code>{esc(f)}</code>" for f in training_curves.get("files") or [])
    return (f'<h2>Training</h2><p class="note">From the run\'s {files or "CSV logs"}.</p><div class="row">'
            + "".join(f'<div class="panel-box">{p}</div>' for p in plots) + "</div>")


def config_section(config: dict[str, Any]) -> str:
    """The configuration as JSON, folded in a ``<details>``."""
    return (f'<details id="config"><summary>Configuration</summary><pre>'
            f"{esc(json.dumps(config, indent=2, default=str))}</pre></details>")
