"""What ``report.html`` shows of a captioner's evaluation: its mistakes, the lowest-CIDEr-D captions.

:func:`rank_mistakes` picks the images to explain besides the seeded sample; :func:`mistake_cards`
is the gallery (each caption with its CIDEr-D). The captioner has no result section of its own:
its metrics are the page's metrics grid. :class:`~vision_attn.tasks.CaptioningTask` hands these to
the report through its hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vision_attn.blocks import Mistake, Mistakes, Strong, finite

__all__ = ["mistake_cards", "rank_mistakes"]


def rank_mistakes(dataset: Any, predictions: Sequence[dict[str, Any]] | None, k: int) -> list[int]:
    """The dataset indices of the ``k`` lowest-CIDEr-D captions of ``predictions`` (``{"image_id",
    "caption", "cider"}``), lowest first, joined to ``dataset.images`` by id; records of images the
    split does not have are skipped."""
    if k <= 0 or not predictions:
        return []
    where = {im["id"]: i for i, im in enumerate(getattr(dataset, "images", []))}
    scored = [(float(r["cider"]), where[r["image_id"]]) for r in predictions
              if isinstance(r, dict) and r.get("image_id") in where and r.get("cider") is not None]
    return [i for _, i in sorted(scored)[:k]]


def _record_name(record: dict[str, Any]) -> str:
    """The report item name of a ``predictions.json`` record: ``image id <id>`` (its ``file`` when it has one)."""
    return str(record["file"]) if "file" in record else f"image id {record.get('image_id')}"


def mistake_cards(items: list[dict[str, Any]], predictions: list[dict[str, Any]] | None, limit: int) -> Mistakes:
    """The split's ``limit`` lowest-CIDEr-D captions, lowest first (the explained images' when no
    record carries a CIDEr-D), each card with its score and its caption."""
    records = [(c, k, _record_name(r), r.get("caption")) for k, r in enumerate(predictions or [])
               if isinstance(r, dict) and (c := finite(r.get("cider"))) is not None]
    if records:  # the whole split's captions, joined to the explained items by name
        scored = [(c, name, text) for c, _, name, text in sorted(records)]
        intro = f"The {min(limit, len(scored))} lowest-CIDEr captions of the split's {len(scored)}, lowest first."
    else:
        ciders = sorted((c, i) for i, it in enumerate(items) if (c := finite(it.get("cider"))) is not None)
        scored = [(c, str(items[i].get("name", "")), items[i].get("text", "")) for c, i in ciders]
        intro = "The explained images' lowest-CIDEr captions, lowest first."
    cards = [Mistake(name, head=["CIDEr-D ", Strong(cider), " "], text=str(text if text is not None else ""),
                     score=cider) for cider, name, text in scored[:limit]]
    return Mistakes(cards, intro=intro)
