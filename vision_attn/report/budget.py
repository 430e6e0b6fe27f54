"""How ``report.html`` stays bounded: a byte budget per page, shared by its explained images.

A page holds, per explained image, its pictures (the overlay panels and the interactive view's
image, as ``data:`` URIs) and, for the **patches** view, the attention row of every patch
(``layers x heads x N x N`` bytes: 7.4 MB of text per image for a ViT-B/16 at 224 px). Both are
fitted to a share of the page's budget here, so that the page stays under
:data:`MAX_PAGE_BYTES` whatever the model and the number of images:

- the attention rows (:func:`fit_attention`): the richest of *every layer and head*, *every
  layer, heads averaged*, *the last layer's heads*, *the last layer, heads averaged* that fits
  the image's share of :data:`ATTENTION_BYTES`; when even the last layer's mean does not fit,
  its patch grid is pooled (2 x 2 patches, 3 x 3, ...) until it does;
- the pictures (:func:`fit_picture`): re-encoded as JPEG, at a lower quality and then a smaller
  size, until they fit the image's share of :data:`PICTURE_BYTES`.

``full_attention`` (``--report.full_attention``) keeps every layer and head of every image: the
page then grows with the model and the number of images (about 7.4 MB per image on ViT-B/16).
"""

from __future__ import annotations

import base64
import logging
import math
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

__all__ = ["ATTENTION_BYTES", "ATTENTION_ITEM_BYTES", "MAX_PAGE_BYTES", "PICTURE_BYTES", "PICTURE_ITEM_BYTES",
           "ReportOptions", "fit_attention", "fit_items", "fit_picture"]


@dataclass
class ReportOptions:
    """What ``report.html`` keeps (``--report.*`` of ``eval.py``).

    Attributes:
        full_attention: keep every layer and head of the per-patch attention view (the page then
            grows with the model and the number of images); default: what fits a page of at
            most 10 MB.
    """

    full_attention: bool = False

log = logging.getLogger(__name__)

MAX_PAGE_BYTES = 10_000_000
"""What a page holds at most by default (its pictures, attention rows, sections and script)."""

ATTENTION_BYTES = 4_000_000
"""The page's share for the patches views' attention rows (base64 text), split among its images."""

ATTENTION_ITEM_BYTES = 256_000
"""At most this much attention per image, however few images the page shows (a quick page)."""

PICTURE_BYTES = 5_000_000
"""The page's share for the pictures (panels and the interactive views' images), split among its images."""

PICTURE_ITEM_BYTES = 600_000
"""At most this much picture data per image."""

_DATA_PREFIX = "data:image/"


def _b64_len(n: int) -> int:
    return 4 * math.ceil(n / 3)


def _requantise(rows: np.ndarray) -> np.ndarray:
    """uint8 rows scaled to their own maximum (255), as :func:`~vision_attn.explain.records.quantise` stores them."""
    peak = rows.max(axis=-1, keepdims=True)
    scaled = np.where(peak > 0, rows / np.where(peak > 0, peak, 1.0), 0.0)
    return (scaled * 255).round().astype(np.uint8)


def _pool(rows: np.ndarray, grid: tuple[int, int], f: int) -> tuple[np.ndarray, tuple[int, int]]:
    """``rows [..., N, N]`` (query patch x key patch) on the grid ``(gh, gw)`` pooled by ``f`` x
    ``f`` patches on both axes: the mean over the queries of a cell, the sum over its keys."""
    gh, gw = grid
    ph, pw = math.ceil(gh / f), math.ceil(gw / f)
    cell = (np.arange(gh)[:, None] // f * pw + np.arange(gw)[None, :] // f).reshape(-1)  # (N,) pooled index
    onehot = np.zeros((gh * gw, ph * pw), np.float64)
    onehot[np.arange(gh * gw), cell] = 1.0
    keys = rows @ onehot  # (..., N, M): mass per pooled key cell
    queries = np.swapaxes(np.swapaxes(keys, -1, -2) @ (onehot / onehot.sum(0, keepdims=True)), -1, -2)  # (..., M, M)
    return queries, (ph, pw)


def _candidates(rows: np.ndarray) -> list[tuple[str, np.ndarray, list[int], bool]]:
    """The reduced forms of ``rows [L, H, N, N]``, richest first: ``(what, rows, layer ids, heads averaged)``."""
    layers, heads = rows.shape[:2]
    last = rows[-1:]
    out = [("every layer and head", rows, list(range(layers)), False)]
    if heads > 1:
        out.append(("every layer, heads averaged", rows.mean(1, keepdims=True), list(range(layers)), True))
    if layers > 1:
        out.append(("the last layer's heads", last, [layers - 1], False))
    if layers > 1 and heads > 1:
        out.append(("the last layer, heads averaged", last.mean(1, keepdims=True), [layers - 1], True))
    out.sort(key=lambda c: -c[1].size)  # the richest form that fits wins
    return out


def fit_attention(item: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """The patches item ``item`` with its attention rows (``maps``) fitted to ``max_bytes`` of text
    (see the module docstring); other items, and items that fit, come back unchanged.

    A reduced item says what it holds: ``layer_ids`` (the model's layers kept, e.g. ``[11]``),
    ``heads_fused`` (the heads averaged: one map per layer), ``pooled`` (patches pooled per side,
    ``grid`` then being the pooled grid) and ``reduced`` (a sentence for the page).
    """
    if item.get("kind") != "patches" or not item.get("maps"):
        return item
    layers, heads = int(item["layers"]), int(item["heads"])
    gh, gw = (int(v) for v in item["grid"])
    n = gh * gw
    if _b64_len(layers * heads * n * n) <= max_bytes:
        return item
    raw = np.frombuffer(base64.b64decode(item["maps"]), np.uint8)
    if raw.size != layers * heads * n * n:
        return item  # not the shape it claims: left as it is (the page's script reads what is there)
    rows = raw.reshape(layers, heads, n, n).astype(np.float32)
    for what, kept, layer_ids, fused in _candidates(rows):
        if _b64_len(kept.size) <= max_bytes:
            return _reduced(item, kept, layer_ids, fused, (gh, gw), 1, what)
    kept = rows[-1:].mean(1, keepdims=True)  # the last layer's mean, pooled until it fits
    f = 2
    while True:
        pooled, grid = _pool(kept.astype(np.float64), (gh, gw), f)
        if _b64_len(pooled.size) <= max_bytes or grid == (1, 1):
            return _reduced(item, pooled, [layers - 1], heads > 1, grid, f,
                            f"the last layer, heads averaged, {f} x {f} patches pooled")
        f += 1


def _reduced(item: dict[str, Any], rows: np.ndarray, layer_ids: list[int], fused: bool, grid: tuple[int, int],
             pooled: int, what: str) -> dict[str, Any]:
    data = base64.b64encode(_requantise(rows.astype(np.float64)).tobytes()).decode("ascii")
    return {**item, "maps": data, "layers": int(rows.shape[0]), "heads": int(rows.shape[1]), "grid": list(grid),
            "layer_ids": layer_ids, "heads_fused": fused, "heads_total": int(item["heads"]), "pooled": pooled,
            "reduced": what}


def fit_picture(uri: str, max_bytes: int) -> str:
    """A picture's ``data:`` URI in at most ``max_bytes`` of text: as it is when it fits, else as
    a JPEG at quality 85, 70, 55, then halving its size, until it fits (a URI that is no picture
    is returned as it is)."""
    if len(uri) <= max_bytes or not uri.startswith(_DATA_PREFIX) or ";base64," not in uri:
        return uri
    try:
        raw = base64.b64decode(uri.split(",", 1)[1], validate=True)
    except ValueError:
        return uri
    img = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
    if img is None:
        return uri
    prefix = "data:image/jpeg;base64,"
    while True:
        for quality in (85, 70, 55):
            ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
            if ok and len(prefix) + _b64_len(len(buf)) <= max_bytes:
                return prefix + base64.b64encode(buf.tobytes()).decode("ascii")
        h, w = img.shape[:2]
        if max(h, w) <= 16:
            return prefix + base64.b64encode(buf.tobytes()).decode("ascii")
        img = cv2.resize(img, (max(1, w // 2), max(1, h // 2)), interpolation=cv2.INTER_AREA)


def fit_items(items: list[dict[str, Any]], full_attention: bool = False) -> list[dict[str, Any]]:
    """``items`` (the page's explained images) with their pictures and attention rows fitted to
    their share of the page (see the module docstring); ``full_attention`` keeps every attention
    row (the pictures are fitted all the same)."""
    n = max(1, len(items))
    attention = min(ATTENTION_ITEM_BYTES, ATTENTION_BYTES // n)
    pictures = min(PICTURE_ITEM_BYTES, PICTURE_BYTES // n)
    out, reduced = [], []
    for it in items:
        fitted = it if full_attention else fit_attention(it, attention)
        if fitted is not it and fitted.get("reduced"):
            reduced.append(fitted["reduced"])
        uris = [str(p) for p in fitted.get("panels", [])] + ([str(fitted["image"])] if fitted.get("image") else [])
        share = pictures // max(1, len(uris))
        fitted = {**fitted, "panels": [fit_picture(p, share) for p in uris[: len(fitted.get("panels", []))]]}
        if it.get("image"):
            fitted["image"] = fit_picture(str(it["image"]), share)
        out.append(fitted)
    if reduced:
        log.info("report: the attention of %d explained images kept as %s, to keep the page under %d MB "
                 "(--report.full_attention keeps every layer and head)", len(reduced), reduced[0],
                 MAX_PAGE_BYTES // 1_000_000)
    return out
