"""The page's images: what is known of each explained image, the mistakes gallery and the image grid.

The mistakes gallery shows the most confident wrong predictions (classification), the images with
missed or false detections (detection, when the items carry them: the most errors first, then the
highest-scoring false detection, each error listed) or the lowest-CIDEr captions (captioning), each
with its overlay and a link to its interactive view. The grid shows every explained image with its
overlay panels and an interactive canvas: **patches** — click a patch to see what it attends to (a
layer, a head or the heads fused); **boxes** — click a box to see its query's cross-attention;
**words** — hover a word to see where it looked. Its filters (correct / wrong, class) and the
confusion matrix's cells hide the others.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from vision_attn.explain.records import compact_data_uri
from vision_attn.report.markup import esc, finite, fmt

__all__ = ["grid", "item_meta", "mistakes_section", "record_key"]


def record_key(record: dict[str, Any]) -> str | None:
    """The item name a ``predictions.json`` record belongs to: its ``file`` (classification), or
    ``image id <id>`` (detection, captioning: the names their explanation code gives items)."""
    if "file" in record:
        return str(record["file"])
    if "image_id" in record:
        return f"image id {record['image_id']}"
    return None


def item_meta(items: list[dict[str, Any]], predictions: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Per item what the filters and galleries need: ``truth``, ``pred``, ``score``, ``correct``,
    ``cider``, ``missed``, ``false``, ``false_score``, ``classes`` — from the item itself where it
    carries them, else from its ``predictions.json`` record (joined by name, see :func:`record_key`)."""
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
        m["missed"] = [_error_text(x) for x in it.get("missed") or []]
        m["false"] = [_error_text(x) for x in it.get("false") or []]
        m["false_score"] = max((s for x in it.get("false") or [] if isinstance(x, dict)
                                and (s := finite(x.get("score"))) is not None), default=None)
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
    score = finite(error.get("score"))
    if score is not None:
        text += f" {score:.2f}"
    if error.get("why"):
        text += f" ({error['why']})"
    return text


# ---------------------------------------------------------------------------------------------- mistakes gallery
class _Card(NamedTuple):
    score: float | None  # data-score: what the gallery is ranked by
    top: float | None  # data-top: the second key (detection: the highest-scoring false detection)
    item: int | None  # the explained item it shows, or None (no overlay)
    caption: str  # markup, every text from data escaped


class _Gallery(NamedTuple):
    intro: str  # plain text above the cards
    cards: list[_Card]
    empty: str  # plain text said when there are no cards ("": the gallery is left out)


def mistakes_section(task: str | None, items: list[dict[str, Any]], meta: list[dict[str, Any]],
                     predictions: list[dict[str, Any]] | None, limit: int) -> str:
    """The mistakes gallery: one card per mistake, worst first, with the overlay panel of the
    explained ones (copied by the script from the grid, so the page holds each image once) and
    a link to its interactive view."""
    rank = {"classification": _classification_mistakes, "captioning": _caption_mistakes,
            "detection": _detection_mistakes}.get(task or "")
    if rank is None:
        return ""
    index = {str(it.get("name")): i for i, it in enumerate(items)}
    gallery = rank(items, meta, predictions, limit, index)
    if not gallery.cards:
        return f'<h2>Mistakes</h2><p class="note" id="mistakes">{esc(gallery.empty)}</p>' if gallery.empty else ""
    html_cards = []
    for card in gallery.cards:
        data = "" if card.score is None else f' data-score="{card.score!r}"'
        if card.top is not None:
            data += f' data-top="{card.top!r}"'
        i = card.item
        if i is None:
            body = '<div class="note">not among the explained images: no overlay</div>'
        else:
            body = (f'<img class="copy" data-item="{i}" alt="overlay">'
                    f'<a class="goto" href="#item{i}">interactive view ↓</a>')
        html_cards.append(f'<div class="mistake"{data} data-item="{"" if i is None else i}"><div>{card.caption}</div>'
                          f"{body}</div>")
    return (f'<h2>Mistakes</h2><p class="note">{esc(gallery.intro)}</p><div class="mistakes" id="mistakes">'
            + "".join(html_cards) + "</div>")


def _classification_mistakes(items: list[dict[str, Any]], meta: list[dict[str, Any]],
                             predictions: list[dict[str, Any]] | None, limit: int, index: dict[str, int]) -> _Gallery:
    """The split's most confident wrong predictions (the explained images' without ``predictions``)."""
    wrong = [r for r in predictions or [] if isinstance(r, dict) and "label" in r and "pred" in r
             and str(r["label"]) != str(r["pred"])]
    source = "the split"
    if predictions is None:
        wrong = [{"file": it.get("name"), "label": m["truth"], "pred": m["pred"], "score": m["score"]}
                 for it, m in zip(items, meta, strict=True) if m["correct"] is False]
        source = "the explained images"
    if not wrong:
        known = predictions is not None or any(m["correct"] is not None for m in meta)
        return _Gallery("", [], f"No wrong prediction in {source}." if known else "")
    wrong.sort(key=lambda r: -(finite(r.get("score")) or 0.0))
    cards = []
    for rank, r in enumerate(wrong[:limit], 1):
        score = finite(r.get("score"))
        caption = (f'#{rank} <b>{esc(r["label"])}</b> → <b>{esc(r["pred"])}</b> {fmt(score, 3)} '
                   f'<span class="name">{esc(r.get("file", ""))}</span>')
        cards.append(_Card(score, None, index.get(str(r.get("file"))), caption))
    intro = (f"{len(wrong)} wrong predictions in {source}; the {len(cards)} most confident, most confident "
             "first (truth → predicted, probability).")
    return _Gallery(intro, cards, "")


def _caption_mistakes(items: list[dict[str, Any]], meta: list[dict[str, Any]],
                      predictions: list[dict[str, Any]] | None, limit: int, index: dict[str, int]) -> _Gallery:
    """The split's lowest-CIDEr captions (the explained images' when no record carries a CIDEr-D)."""
    records = [(c, k, record_key(r), r.get("caption")) for k, r in enumerate(predictions or [])
               if isinstance(r, dict) and (c := finite(r.get("cider"))) is not None]
    if records:  # the whole split's captions, joined to the explained items by name
        scored = [(c, index.get(str(key)), str(key), text) for c, _, key, text in sorted(records)]
        intro = f"The {min(limit, len(scored))} lowest-CIDEr captions of the split's {len(scored)}, lowest first."
    else:
        scored = [(c, i, str(items[i].get("name", "")), items[i].get("text", ""))
                  for c, i in sorted((m["cider"], i) for i, m in enumerate(meta) if m["cider"] is not None)]
        intro = "The explained images' lowest-CIDEr captions, lowest first."
    cards = []
    for rank, (cider, i, name, text) in enumerate(scored[:limit], 1):
        caption = (f'#{rank} CIDEr-D <b>{fmt(cider, 3)}</b> <span class="name">{esc(name)}</span><br>'
                   f'{esc(text if text is not None else "")}')
        cards.append(_Card(cider, None, i, caption))
    return _Gallery(intro, cards, "")


def _detection_mistakes(items: list[dict[str, Any]], meta: list[dict[str, Any]],
                        predictions: list[dict[str, Any]] | None, limit: int, index: dict[str, int]) -> _Gallery:
    """The explained images with missed objects or false detections, the most errors first, then
    the highest-scoring false detection; each card lists its errors."""
    bad = sorted(((len(m["missed"]) + len(m["false"]), m["false_score"] or 0.0, i)
                  for i, m in enumerate(meta) if m["missed"] or m["false"]), key=lambda x: (-x[0], -x[1], x[2]))
    # an evaluation (it has predictions) says why the gallery is empty; a predict page says nothing
    empty = ("Missed and false detections are listed here when the explained images carry their matching to "
             "the ground truth; these do not." if predictions is not None else "")
    cards = []
    for rank, (count, top, i) in enumerate(bad[:limit], 1):
        m = meta[i]
        missed = "".join(f"<li>{esc(x)}</li>" for x in m["missed"]) or "<li>none</li>"
        false = "".join(f"<li>{esc(x)}</li>" for x in m["false"]) or "<li>none</li>"
        caption = (f'#{rank} <span class="name">{esc(items[i].get("name", ""))}</span> — {count} '
                   f'error{"s" if count != 1 else ""}'
                   f'<div class="errs"><div>missed ({len(m["missed"])}):<ul class="missed">{missed}</ul></div>'
                   f'<div>false ({len(m["false"])}):<ul class="false">{false}</ul></div></div>')
        cards.append(_Card(float(count), top, i, caption))
    intro = ("Explained images with missed objects (ground truth that no detection above the threshold matched "
             "at IoU 0.5) or false detections (above the threshold, matching no object of their class), the "
             "most errors first, then the highest-scoring false detection.")
    return _Gallery(intro, cards, empty)


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
        panels = "".join(f'<img src="{esc(compact_data_uri(str(p)))}" alt="overlay">' for p in it.get("panels", []))
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
        layers = "".join(f'<option value="{k}"{" selected" if k == it["layers"] - 1 else ""}>{k}</option>'
                         for k in range(it["layers"]))
        heads = '<option value="fused">fused (mean)</option>' + "".join(
            f'<option value="{k}">{k}</option>' for k in range(it["heads"]))
        return (f'<div class="controls">Click a patch to see what it attends to. Layer <select id="layer{i}">'
                f'{layers}</select> head <select id="head{i}">{heads}</select></div>')
    if kind == "boxes":
        missed = " Dashed red: objects no detection found." if it.get("missed_boxes") else ""
        return (f'<div class="controls">Click a box to see its query\'s cross-attention: <b id="sel{i}"></b>'
                f"{missed}</div>")
    if kind == "words":
        words = " ".join(f'<span class="word" data-k="{k}">{esc(w)}</span>' for k, w in enumerate(it["words"]))
        return f'<div class="controls" id="words{i}">Hover a word: {words}</div>'
    return ""
