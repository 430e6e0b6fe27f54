"""What the page of a folder run (``vision-attn predict`` / ``explain``) shows first: a table of
the images with what the model said of each (:func:`folder_sections`), and the readable line of
one record (:func:`record_line`), built from the records' shape alone (any task's records)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from vision_attn.blocks import Column, Section, Table

__all__ = ["MAX_SKIPPED_ROWS", "folder_sections", "record_line"]

MAX_SKIPPED_ROWS = 200
"""Skipped files listed on the page at most (``skipped.json`` lists them all)."""

_LISTED = 5  # entries of a list (detections, top-k classes) named on one line


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return f"{float(value):.2f}" if math.isfinite(float(value)) else "—"
    return str(value)


def _labelled(entry: Any) -> str | None:
    """``label score`` of a ``{"label", "score", ...}`` record (a class, a detection); ``None`` for anything else."""
    if not isinstance(entry, dict) or "label" not in entry:
        return None
    score = entry.get("score")
    return f"{entry['label']} {_number(score)}" if score is not None else str(entry["label"])


def _listing(key: str, entries: list[Any]) -> str:
    names = [x for x in (_labelled(e) for e in entries) if x is not None]
    if not entries:
        return f"no {key}"
    if len(names) != len(entries):
        return f"{len(entries)} {key}"
    more = f", and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"{len(entries)} {key}: " + ", ".join(names[:_LISTED]) + more


def record_line(record: dict[str, Any]) -> str:
    """One readable line of a ``predictions.json`` record (its ``file`` left out): the top-k
    classes with their scores (``cat 0.91 · dog 0.05``: class names may hold commas), the
    predicted class and its score, a list of labelled entries (``3 detections: cat 0.91, ...``),
    a text as it is, other values as ``key value``; never cut in the middle of a word."""
    topk = record.get("topk")
    if isinstance(topk, list) and topk and all(_labelled(t) for t in topk):
        return " · ".join(_labelled(t) for t in topk)  # type: ignore[misc]
    parts = []
    if "pred" in record:
        parts.append(_labelled({"label": record["pred"], "score": record.get("score")}) or "")
    for key, value in record.items():
        if key in ("file", "pred", "score", "topk"):
            continue
        if isinstance(value, list):
            parts.append(_listing(key, value))
        elif isinstance(value, str):
            text = " ".join(value.split())
            parts.append(text if len(record) <= 2 else f"{key}: {text}")
        elif isinstance(value, numbers.Number) or value is None:
            parts.append(f"{key} {_number(value) if value is not None else '—'}")
    return "; ".join(p for p in parts if p)


def folder_sections(predictions: Sequence[dict[str, Any]], skipped: Sequence[dict[str, str]],
                    shown: int) -> list[Section]:
    """The first sections of a folder run's page: the images with their :func:`record_line`
    (the first ``shown``, those the page explains; every one is in ``predictions.json``) and the
    skipped files with the reason (at most :data:`MAX_SKIPPED_ROWS`)."""
    rows = [[str(p.get("file", "")), record_line(p)] for p in predictions[:shown]]
    note = (f"The first {len(rows)} of {len(predictions)} images; predictions.json holds every one."
            if len(predictions) > len(rows) else "")
    out = [Section("Predictions", [Table(columns=["file", Column("prediction", hint="what the model said: "
                                                                "the best classes with their scores, the objects "
                                                                "found or the caption")],
                                         rows=rows, id="predictions")], note=note)] if rows else []
    if skipped:
        listed = [[str(s.get("file", "")), str(s.get("reason", ""))] for s in skipped[:MAX_SKIPPED_ROWS]]
        more = (f"The first {len(listed)} of {len(skipped)}; skipped.json lists every one."
                if len(skipped) > len(listed) else "Files that could not be read; the run went on without them.")
        out.append(Section(f"Skipped files ({len(skipped)})",
                           [Table(columns=["file", "reason"], rows=listed, id="skipped")], note=more))
    return out
