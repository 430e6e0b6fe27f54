"""The page's images: what is known of each explained image, the mistakes gallery and the image grid.

The mistakes gallery (:func:`mistakes_section`) draws the task's :class:`~vision_attn.blocks.Mistakes`
(:meth:`~vision_attn.tasks.VisionTask.mistake_cards`): one card per mistake, worst first, each with
the overlay of its image when the page explains it and a link to its interactive view. The grid
shows every explained image with its overlay panels and an interactive canvas: **patches** — click
a patch to see what it attends to (a layer, a head or the heads fused); **boxes** — click a box to
see its query's cross-attention; **words** — hover a word to see where it looked. Its filters
(correct / wrong, class) and the confusion matrix's cells hide the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vision_attn.blocks import Mistake, Mistakes, Strong, finite
from vision_attn.explain.records import compact_data_uri
from vision_attn.report.markup import esc, fmt
from vision_attn.report.render import cell_text

__all__ = ["grid", "item_meta", "mistakes_section", "record_key"]


def record_key(record: dict[str, Any]) -> str | None:
    """The item name a ``predictions.json`` record belongs to: its ``file``, or ``image id <id>``
    (the name the explanation code gives the items of a COCO split)."""
    if "file" in record:
        return str(record["file"])
    if "image_id" in record:
        return f"image id {record['image_id']}"
    return None


def item_meta(items: list[dict[str, Any]], predictions: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Per item what the grid's badges and filters need: ``truth``, ``pred``, ``score``, ``correct``,
    ``cider``, ``classes`` — from the item itself where it carries them, else from its
    ``predictions.json`` record (joined by name, see :func:`record_key`)."""
    by_name: dict[str, dict[str, Any]] = {}
    for r in predictions or []:
        key = record_key(r) if isinstance(r, dict) else None
        if key is not None and key not in by_name:
            by_name[key] = r
    meta = []
    for it in items:
        r = by_name.get(str(it.get("name")), {})
        truth = it.get("truth", r.get("label"))
        pred = it.get("pred", r.get("pred"))
        m: dict[str, Any] = {"truth": None if truth is None else str(truth),
                             "pred": None if pred is None else str(pred),
                             "score": finite(it.get("score", r.get("score"))),
                             "cider": finite(it.get("cider", r.get("cider")))}
        m["correct"] = None if m["truth"] is None or m["pred"] is None else m["truth"] == m["pred"]
        classes = it.get("classes")
        m["classes"] = ([str(c) for c in classes] if classes is not None
                        else [m["truth"]] if m["truth"] is not None else [m["pred"]] if m["pred"] is not None else [])
        meta.append(m)
    return meta


# ---------------------------------------------------------------------------------------------- mistakes gallery
def mistakes_section(gallery: Mistakes | None, index: Mapping[str, int]) -> str:
    """The mistakes gallery: one card per mistake, worst first, with the overlay panel of the
    explained ones (copied by the script from the grid, so the page holds each image once) and
    a link to its interactive view; ``index`` gives the grid position of each explained image by
    name. Without cards it says ``gallery.empty`` (nothing when that is empty)."""
    if gallery is None:
        return ""
    if not gallery.cards:
        return f'<h2>Mistakes</h2><p class="note" id="mistakes">{esc(gallery.empty)}</p>' if gallery.empty else ""
    cards = "".join(_mistake_card(rank, card, index.get(card.name)) for rank, card in enumerate(gallery.cards, 1))
    return (f'<h2>Mistakes</h2><p class="note">{esc(gallery.intro)}</p><div class="mistakes" id="mistakes">'
            + cards + "</div>")


def _mistake_card(rank: int, card: Mistake, i: int | None) -> str:
    """One card: ``data-score`` / ``data-top`` (its ranking keys), its caption, and the overlay of
    grid item ``i`` with a link to it (``None``: not explained, no overlay)."""
    data = "" if card.score is None else f' data-score="{float(card.score)!r}"'
    if card.top is not None:
        data += f' data-top="{float(card.top)!r}"'
    head = "".join(f"<b>{cell_text(part.value, card.digits)}</b>" if isinstance(part, Strong)
                   else cell_text(part, card.digits) for part in card.head)
    caption = f'#{rank} {head}<span class="name">{esc(card.name)}</span>{esc(card.tail)}'
    if card.text is not None:
        caption += f"<br>{esc(card.text)}"
    if card.lists:
        lists = "".join(f'<div>{esc(x.title)} ({len(x.entries)}):<ul class="{esc(x.key or x.title)}">'
                        + ("".join(f"<li>{esc(e)}</li>" for e in x.entries) or "<li>none</li>") + "</ul></div>"
                        for x in card.lists)
        caption += f'<div class="errs">{lists}</div>'
    if i is None:
        body = '<div class="note">not among the explained images: no overlay</div>'
    else:
        body = (f'<img class="copy" data-item="{i}" alt="overlay">'
                f'<a class="goto" href="#item{i}">interactive view ↓</a>')
    return f'<div class="mistake"{data} data-item="{"" if i is None else i}"><div>{caption}</div>{body}</div>'


# ---------------------------------------------------------------------------------------------- image grid
def grid(items: list[dict[str, Any]], meta: list[dict[str, Any]], canvas: int) -> tuple[str, list[dict[str, Any]]]:
    """The explained images (panels, interactive canvas) with their filters; and the script's items."""
    body, js_items = [_filters(len(items), meta)], []
    for i, (it, m) in enumerate(zip(items, meta, strict=True)):
        badge = ""
        if m["truth"] is not None or m["pred"] is not None:
            cls = "" if m["correct"] is None else ' class="ok"' if m["correct"] else ' class="bad"'
            badge = (f'<p{cls}>{esc(m["truth"] if m["truth"] is not None else "?")} → '
                     f'{esc(m["pred"] if m["pred"] is not None else "?")} {fmt(m["score"], 3)}</p>')
        elif m["cider"] is not None:
            badge = f'<p>CIDEr-D {fmt(m["cider"], 3)}</p>'
        body.append(f'<div class="item" id="item{i}"><h3>{esc(it.get("name", ""))}</h3>{badge}'
                    f'<p class="text">{esc(it.get("text", ""))}</p>')
        panels = "".join(f'<img src="{esc(compact_data_uri(str(p)))}" alt="overlay" loading="lazy" decoding="async">'
                         for p in it.get("panels", []))
        body.append(f'<div class="panels">{panels}</div>')
        if it.get("kind"):
            body.append(_controls(it, i) + f'<canvas id="cv{i}" width="{canvas}" height="{canvas}" '
                        'data-shown="image"></canvas>')
            js_item = {"id": i, **{k: v for k, v in it.items() if k not in ("panels", "name", "text")}}
            js_item["image"] = compact_data_uri(str(it.get("image", "")))
            js_items.append(js_item)
        body.append("</div>")
    body.append("</div>")
    return "".join(body), js_items


def _filters(n_items: int, meta: list[dict[str, Any]]) -> str:
    """The grid's heading and filters (correct / wrong when known, class when any), opening the grid."""
    filters = []
    if any(m["correct"] is not None for m in meta):
        filters.append('show <select id="f-mode"><option value="all">all</option><option value="correct">correct'
                       '</option><option value="wrong">wrong</option></select>')
    classes = sorted({c for m in meta for c in m["classes"]})
    if classes:
        opts = "".join(f'<option value="{k}">{esc(c)}</option>' for k, c in enumerate(classes))
        filters.append(f'class <select id="f-class"><option value="">any</option>{opts}</select>')
    return (f'<h2 id="grid-top">Explained images ({n_items})</h2><div class="filters" id="filters">'
            + " ".join(filters) + ' <button id="f-clear" type="button">show all</button> '
            '<span id="f-status"></span></div><div class="grid" id="grid">')


def _controls(it: dict[str, Any], i: int) -> str:
    """What drives item ``i``'s canvas: layer and head selects (patches), the selected box's label
    (boxes), the caption's words to hover (words)."""
    kind = it.get("kind")
    if kind == "patches":
        ids = it.get("layer_ids") or list(range(it["layers"]))
        layers = "".join(f'<option value="{k}"{" selected" if k == it["layers"] - 1 else ""}>{esc(ids[k])}</option>'
                         for k in range(it["layers"]))
        fused = it.get("heads_fused")
        heads = (f'<option value="fused">fused (mean of {esc(it.get("heads_total", it["heads"]))})</option>'
                 + ("" if fused else "".join(f'<option value="{k}">{k}</option>' for k in range(it["heads"]))))
        kept = (f' <span class="note">Kept here: {esc(it["reduced"])}, to keep the page small '
                "(--report.full_attention keeps every layer and head).</span>") if it.get("reduced") else ""
        return (f'<div class="controls">Click a patch to see what it attends to. Layer <select id="layer{i}">'
                f'{layers}</select> head <select id="head{i}">{heads}</select>{kept}</div>')
    if kind == "boxes":
        missed = " Dashed red: objects no detection found." if it.get("missed_boxes") else ""
        return (f'<div class="controls">Click a box to see its query\'s cross-attention: <b id="sel{i}"></b>'
                f"{missed}</div>")
    if kind == "words":
        words = " ".join(f'<span class="word" data-k="{k}">{esc(w)}</span>' for k, w in enumerate(it["words"]))
        return f'<div class="controls" id="words{i}">Hover a word: {words}</div>'
    return ""
