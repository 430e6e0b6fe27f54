"""AttnLRP through the decoder heads: conservative relevance of one detection or one word.

The rules of :mod:`vision_attn.explain.lrp` (identity rule for norms and activations, AttnLRP's
softmax rule, the uniform rule for ``Q Kᵀ`` and ``A V``, epsilon rule for linear maps) are
installed on the encoder *and* the decoder, so one backward pass of the explained score gives
every input pixel its relevance. The explained score is

- a detection: its query's class **logit** (the softmax head's class before the softmax, the
  focal head's before the sigmoid);
- a word of a caption: its **logit** at its position, the caption teacher-forced (``<bos>`` and
  the words before it as input; what the search scored when it chose the word).

**What the decoder itself holds.** Besides the pixels, relevance reaches what the decoder adds
that the image did not make: the queries' contents entering the first decoder layer (DETR's
object queries; the caption's word embeddings and their positions) and the position embeddings
added to the queries and the memory's keys in every layer. They are taken as inputs of the
relevance (leaves of the backward pass; their values unchanged), and :func:`decoder_lrp_budget`
reports their share as ``queries`` and ``positions`` next to the pixels, biases, the encoder's
embeddings and the softmaxes: the entries sum to the explained logit (conservation; in float64
to rounding).

The map of an item is its pixels' relevance summed over the channels and over cells finer than
the patches (signed): each patch split into :data:`CELLS` x :data:`CELLS` cells (the largest
divisor of the patch side up to it), so that a map keeps where inside a patch the relevance lies
(on a digit's strokes rather than on the whole patch) and the cells of a patch sum to its
relevance. The ``lrp`` method of the detection and captioning explanations draws its positive part,
smoothed over neighbouring cells and scaled to maximum 1 (:func:`positive_maps`); the deletion and
insertion curves change whole patches for every method, so they sum a map's cells per patch first.

Batching as in :mod:`~vision_attn.explain.decoder_relevance`: every (image, item) pair is a row
(the image repeated), one backward pass of the sum of the rows' scores gives each row its own
relevance (rows never mix in evaluation mode); ``max_rows`` bounds a pass. The model is left as
it was (modes restored, every hook removed, no parameter gradient accumulated).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.explain.decoder_relevance import (
    _check_head,
    _encode,
    _explaining,
    _split,
    caption_rows,
    detection_logits,
    detection_rows,
)
from vision_attn.explain.lrp import _patch_size, _patch_sums, lrp_rules, relevance_ledger
from vision_attn.explain.rollout import normalize_maps

__all__ = ["CELLS", "caption_lrp", "cell_grid", "decoder_lrp_budget", "detection_lrp", "gate_by_attention",
           "positive_maps"]

CELLS = 4
"""Cells a side of each patch in the decoder heads' AttnLRP maps (see the module docstring)."""

_SMOOTH = math.exp(-2.0)  # a Gaussian of half a cell, sampled at the neighbouring cells (1 cell = 2 sigma)

OWN_QUERY = False
"""Detection: let a detection's relevance pass only through its own query's tokens in the
decoder's self-attention (the other queries' keys and values held constant), so that its map
holds what its own query read from the image. Measured by ``python -m benchmarks.lrp_cells
--own_query``."""


@contextmanager
def _own_query(head: nn.Module, queries: Tensor | None) -> Iterator[None]:
    """With ``queries [R]`` (each row's explained query), the decoder's self-attention keys and
    values of every other query are held constant (same values, no relevance); ``None``: nothing."""
    if queries is None:
        yield
        return

    def own_only(t: Tensor) -> Tensor:
        keep = torch.zeros(t.shape[:2], dtype=t.dtype, device=t.device)
        keep[torch.arange(len(queries), device=t.device), queries] = 1
        return t.detach() + (t - t.detach()) * keep[..., None]

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args[0], own_only(args[1]), own_only(args[2]), *args[3:]), kwargs

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in head.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _decoder_sources(head: nn.Module) -> Iterator[dict[str, list[Tensor]]]:
    """Make the decoder's own inputs leaves of the backward pass (same values): the first layer's
    queries (``queries``) and every layer's ``query_pos`` / ``memory_pos`` (``positions``)."""
    layers = list(head.layers)
    sources: dict[str, list[Tensor]] = {"queries": [], "positions": []}

    def leaf(t: Tensor, name: str) -> Tensor:
        t = t.detach().requires_grad_(True)
        sources[name].append(t)
        return t

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module is layers[0]:
            args = (leaf(args[0], "queries"), *args[1:])
        for key in ("query_pos", "memory_pos"):
            if kwargs.get(key) is not None:
                kwargs[key] = leaf(kwargs[key], "positions")
        return args, kwargs

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        yield sources
    finally:
        for handle in handles:
            handle.remove()


def _detection_scores(task: nn.Module, x: Tensor, queries: Tensor, classes: Tensor):
    """``(explained logits [R], encoder output)`` of rows ``x`` (inside the rules)."""
    enc = _encode(task.encoder, x)
    logits = task.head(enc)["pred_logits"]  # (R, Q, C [+ 1])
    per_query, classes = detection_logits(logits, queries, classes, bool(getattr(task.head, "focal", False)))
    return per_query.gather(1, classes[:, None]).squeeze(1), enc


def _caption_scores(task: nn.Module, x: Tensor, inputs: Tensor, targets: Tensor, positions: Tensor):
    enc = _encode(task.encoder, x)
    logits, _ = task.head(enc, inputs)  # (R, T, V)
    r = torch.arange(len(positions), device=logits.device)
    return logits[r, positions].float().gather(1, targets[r, positions][:, None]).squeeze(1), enc


def cell_grid(encoder: nn.Module, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((rows, columns), (cell height, cell width))`` of the AttnLRP maps of an ``height`` x
    ``width`` input: the patch grid with each patch split into up to :data:`CELLS` cells a side
    (the largest divisor of the patch side up to it; one cell per patch where the patch size is
    unknown)."""
    h, w = encoder.grid_for(height, width)
    patch = _patch_size(encoder)
    if patch is None:
        return (h, w), (math.ceil(height / h), math.ceil(width / w))
    k = [max(d for d in range(1, CELLS + 1) if side % d == 0) for side in patch]
    return (h * k[0], w * k[1]), (patch[0] // k[0], patch[1] // k[1])


def _pixel_maps(task: nn.Module, x: Tensor, score: Tensor) -> Tensor:
    """``[R, rows, columns]``: the rows' pixel relevance summed per cell of :func:`cell_grid`."""
    (grad,) = torch.autograd.grad(score.sum(), x)
    grid, cell = cell_grid(task.encoder, *x.shape[-2:])
    return _patch_sums((x * grad).detach().sum(dim=1), grid, cell).float().cpu()


def detection_lrp(task: nn.Module, images: Tensor, queries: Sequence[Tensor], labels: Sequence[Tensor] | None = None,
                  max_rows: int = 32) -> list[Tensor]:
    """AttnLRP maps of detections: per image ``[K_b, rows, columns]`` signed relevance per cell of
    :func:`cell_grid` (CPU, float32).

    Args:
        task: a :class:`~vision_attn.tasks.DetectionTask` (``encoder`` and a DETR ``head``).
        images: ``[B, 3, H, W]`` normalised model inputs.
        queries: per image ``[K_b]`` query indices (``post_process(...)["queries"]``).
        labels: per image ``[K_b]`` classes (default: each query's most probable real class).
        max_rows: most (image, detection) rows per pass.
    """
    _check_head(task, "detection_lrp")
    image_idx, query_idx, label_idx, counts = detection_rows(task, images, queries, labels, "detection_lrp")
    grid, _ = cell_grid(task.encoder, *images.shape[-2:])
    maps = []
    with _explaining(task):
        for start in range(0, len(image_idx), max_rows):
            rows = slice(start, start + max_rows)
            device = images.device
            x = images.detach().clone()[torch.tensor(image_idx[rows], device=device)].requires_grad_(True)
            q_rows = torch.tensor(query_idx[rows], device=device)
            with lrp_rules(task), _decoder_sources(task.head), _own_query(task.head, q_rows if OWN_QUERY else None):
                score, _ = _detection_scores(task, x, q_rows, torch.tensor(label_idx[rows], device=device))
            maps.append(_pixel_maps(task, x, score))
    return _split(torch.cat(maps) if maps else torch.zeros(0, *grid), counts, grid)


def caption_lrp(task: nn.Module, images: Tensor, tokens: Sequence[Tensor] | Tensor, max_rows: int = 32) -> list[Tensor]:
    """AttnLRP maps of a caption's words: per image ``[T_b, rows, columns]`` signed relevance per
    cell of :func:`cell_grid` (CPU, float32) of each word's logit, teacher-forced.

    Args:
        task: a :class:`~vision_attn.tasks.CaptioningTask` (``encoder``, ``head``, ``tokenizer``).
        images: ``[B, 3, H, W]`` normalised model inputs.
        tokens: per image ``[T_b]`` word ids without ``<bos>`` (every id is explained).
        max_rows: most (image, word) rows per pass.
    """
    _check_head(task, "caption_lrp")
    full, image_idx, word_idx, counts = caption_rows(task, images, tokens, "caption_lrp")
    grid, _ = cell_grid(task.encoder, *images.shape[-2:])
    maps = []
    with _explaining(task):
        for start in range(0, len(image_idx), max_rows):
            rows = slice(start, start + max_rows)
            b_idx = torch.tensor(image_idx[rows])
            device = images.device
            x = images.detach().clone()[b_idx.to(device)].requires_grad_(True)
            with lrp_rules(task), _decoder_sources(task.head):
                score, _ = _caption_scores(task, x, full[b_idx, :-1].to(device), full[b_idx, 1:].to(device),
                                           torch.tensor(word_idx[rows], device=device))
            maps.append(_pixel_maps(task, x, score))
    return _split(torch.cat(maps) if maps else torch.zeros(0, *grid), counts, grid)


def decoder_lrp_budget(task: nn.Module, images: Tensor, query: int | None = None, label: int | None = None,
                       tokens: Tensor | None = None, position: int | None = None) -> dict[str, float]:
    """Where one item's relevance went (the conservation check), for one image ``[1, 3, H, W]``.

    Detection: ``query`` (and ``label``, default the query's best class); captioning: ``tokens``
    (the caption's word ids without ``<bos>``) and the explained word's ``position``.

    Returns:
        :func:`~vision_attn.explain.lrp.relevance_ledger`'s entries plus ``queries`` and
        ``positions`` (see the module docstring); ``total`` equals ``score`` when the rules
        conserve relevance.
    """
    if images.shape[0] != 1:
        raise ValueError(f"decoder_lrp_budget explains one image, got a batch of {images.shape[0]}")
    _check_head(task, "decoder_lrp_budget")
    if (query is None) == (tokens is None):
        raise ValueError("decoder_lrp_budget: give a detection's query or a caption's tokens (one of them)")
    with _explaining(task):
        x = images.detach().clone().requires_grad_(True)
        with lrp_rules(task, trace=True) as record, _decoder_sources(task.head) as sources:
            if query is not None:
                score, _ = _detection_scores(task, x, torch.tensor([query], device=x.device),
                                             torch.tensor([-1 if label is None else label], device=x.device))
            else:
                full, _, _, _ = caption_rows(task, images, [tokens], "decoder_lrp_budget")
                score, _ = _caption_scores(task, x, full[:, :-1].to(x.device), full[:, 1:].to(x.device),
                                           torch.tensor([int(position or 0)], device=x.device))
        return relevance_ledger(task, x, score.sum(), record, sources)


def smooth_cells(maps: Tensor) -> Tensor:
    """``[K, h, w]`` maps convolved with a Gaussian of half a cell (weights ``e^-2``, ``1``,
    ``e^-2`` along each axis, normalised; zero outside the map)."""
    if maps.numel() == 0:
        return maps
    kernel = maps.new_tensor([_SMOOTH, 1.0, _SMOOTH])
    kernel = kernel / kernel.sum()
    x = F.conv2d(maps[:, None], kernel.view(1, 1, 1, 3), padding=(0, 1))
    return F.conv2d(x, kernel.view(1, 1, 3, 1), padding=(1, 0))[:, 0]


def positive_maps(maps: list[Tensor]) -> list[Tensor]:
    """What ``lrp`` draws of signed relevance maps: smoothed over neighbouring cells
    (:func:`smooth_cells`), the positive part, each scaled to maximum 1."""
    return [normalize_maps(smooth_cells(m).clamp(min=0)) if m.numel() else m for m in maps]


def gate_by_attention(relevance: Tensor, attention: Tensor) -> Tensor:
    """Relevance maps gated by attention maps: ``relevance``'s positive part times ``attention``
    (its negative part clipped), each product scaled to maximum 1.

    Args:
        relevance: ``[K, H, W]`` maps (e.g. AttnLRP's, over cells finer than the patches).
        attention: ``[K, h, w]`` maps of the same items over the patch grid (``h`` dividing
            ``H``, ``w`` dividing ``W``); each patch's value is spread bilinearly between patch
            centres onto the ``H x W`` cells (pixel centres aligned, the edges held), so equal
            sizes leave it unchanged.

    Returns:
        ``[K, H, W]`` in ``[0, 1]``: high only where the item's relevance and its attention
        are both high; zero where either is.
    """
    if relevance.dim() != 3 or attention.dim() != 3 or relevance.shape[0] != attention.shape[0]:
        raise ValueError(f"expected maps [K, H, W] and [K, h, w] of the same K, got {tuple(relevance.shape)} "
                         f"and {tuple(attention.shape)}")
    if relevance.numel() == 0:
        return relevance.float()
    size = tuple(relevance.shape[-2:])
    att = attention.float().clamp(min=0)
    if tuple(att.shape[-2:]) != size:
        att = F.interpolate(att[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    return normalize_maps(relevance.float() * att.to(relevance.device))  # negative relevance: clipped to 0 here
