"""What the captioning task's auxiliary losses read: which patches belong to which object and
category, which words name or describe a category, which caption words are concepts.

- grounding (``training.grounding_weight``): :func:`patch_targets` per patch, weighted by
  :func:`grounding_weights` with ``grounding_balance``;
- word attention (``training.word_attention_weight``): :func:`word_kinds`,
  :func:`word_attention_targets`, :func:`class_regions` and :func:`word_attention_loss`;
- concepts (``training.concept_weight``): :func:`concept_vocabulary` and :func:`concept_targets`;
- content words weighted in the cross-entropy (``training.idf_weight``): :func:`idf_token_weights`;
- :func:`repeat_images`: the encoder output repeated for several captions per image.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from vision_attn.data.caption_objects import GENERIC_NOUNS, NUMBER_WORDS, WINDOW, ObjectVocabulary
from vision_attn.data.tokenizer import normalize_caption
from vision_attn.models.detr import cell_centres
from vision_attn.models.encoder import EncoderOutput

__all__ = ["GROUNDING_BACKGROUND_WEIGHT", "WORD_ATTENTION_SKIP", "class_regions", "concept_targets",
           "concept_vocabulary", "grounding_weights", "idf_token_weights", "patch_objects", "patch_targets",
           "repeat_images", "word_attention_loss", "word_attention_targets", "word_kinds"]

GROUNDING_BACKGROUND_WEIGHT = 0.2
"""Class weight of "background" (no box holds the patch's centre) in the grounding loss: most
patches of a scene are background, and the objects' patches are what the encoder must learn."""


def patch_objects(boxes: Tensor, grid: tuple[int, int]) -> Tensor:
    """Per patch of a ``grid = (rows, cols)`` token grid, the index of the smallest of ``boxes``
    (``[N, 4]`` normalised ``x0, y0, x1, y1``) that holds the patch's centre (edges included),
    else -1: ``[rows * cols]`` int64, row-major like the tokens."""
    if len(boxes) == 0:
        return torch.full((grid[0] * grid[1],), -1, dtype=torch.int64, device=boxes.device)
    cx, cy = cell_centres(grid, device=boxes.device).unbind(-1)
    cx, cy = cx[:, None], cy[:, None]  # (patches, 1)
    b = boxes.to(torch.float32)
    inside = (cx >= b[:, 0]) & (cx <= b[:, 2]) & (cy >= b[:, 1]) & (cy <= b[:, 3])  # (patches, boxes)
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    chosen = torch.where(inside, area, torch.full_like(area, float("inf"))).argmin(1)
    return torch.where(inside.any(1), chosen, torch.full_like(chosen, -1))


def patch_targets(boxes: Tensor, labels: Tensor, grid: tuple[int, int]) -> Tensor:
    """Per patch of a ``grid = (rows, cols)`` token grid, ``1 + label`` of the smallest of
    ``boxes`` (``[N, 4]`` normalised ``x0, y0, x1, y1``) that holds the patch's centre
    (edges included), else 0 (background): ``[rows * cols]`` int64, row-major like the tokens."""
    return _owner_labels(patch_objects(boxes, grid), labels)


def _owner_labels(owner: Tensor, labels: Tensor) -> Tensor:
    """``1 + labels[owner]`` where a patch has an owner (:func:`patch_objects`), else 0."""
    if len(labels) == 0:
        return owner + 1
    return torch.where(owner >= 0, labels.to(torch.int64)[owner.clamp(min=0)] + 1, torch.zeros_like(owner))


def grounding_weights(owners: Tensor, background: float) -> Tensor:
    """Per-patch weights of the balanced grounding loss, from :func:`patch_objects`' ``[B, N]``
    owners: background patches ``background``; an object's patches ``m / n`` where ``n`` is its
    own patch count and ``m`` the mean over the batch's objects — every object weighs the same
    whatever its size, and the objects together weigh what they weigh unbalanced."""
    weights = torch.full(owners.shape, float(background), device=owners.device)
    owned = owners >= 0
    if not owned.any():
        return weights
    # one id per (image, object): patch counts per object by bincount
    per_image = int(owners.max()) + 1
    ids = (owners + per_image * torch.arange(owners.shape[0], device=owners.device)[:, None])[owned]
    counts = torch.bincount(ids)
    mean = owned.sum() / (counts > 0).sum()
    weights[owned] = mean / counts[ids].to(weights.dtype)
    return weights


WORD_ATTENTION_SKIP: frozenset[str] = frozenset(
    {"a", "an", "the", "and", "or", "of", "to", "in", "on", "at", "by", "with", "is", "are", "there", "its", "their",
     "this", "that", "some", "next", "left", "right", "above", "below", "top", "bottom", "middle", "center"}
    | set(NUMBER_WORDS) | set(GENERIC_NOUNS))
"""Words whose prediction the word-attention loss leaves alone even right before a kind word
(function words, places, counts): they do not describe the object itself."""


def word_kinds(vocab: list[str], classes: list[str]) -> Tensor:
    """Per token id of ``vocab``: the index in ``classes`` of the category the word names on its
    own (a one-word category name, plural or synonym, as content accuracy reads them,
    :class:`~vision_attn.data.caption_objects.ObjectVocabulary`), -2 for a word that describes an
    object without naming it (not in :data:`WORD_ATTENTION_SKIP`), -1 otherwise (special tokens,
    function words): ``[V]`` int64."""
    names = ObjectVocabulary([normalize_caption(c) for c in classes])
    index = {normalize_caption(c): i for i, c in enumerate(classes)}
    out = torch.full((len(vocab),), -1, dtype=torch.int64)
    for v, word in enumerate(vocab):
        if (word.startswith("<") and word.endswith(">")) or not word.strip():
            continue
        found = names.match([word], 0)
        if found is not None and found[1] == 1:
            out[v] = index[found[0]]
        elif word.isalpha() and word not in WORD_ATTENTION_SKIP:
            out[v] = -2
    return out


def word_attention_targets(targets: Tensor, kinds: Tensor, window: int = WINDOW) -> Tensor:
    """Which category each predicted word's attention should fall on: ``[B, T]`` class index or -1.

    A target word naming a category (``kinds[word] >= 0``, :func:`word_kinds`) gets its own
    category; the up to ``window - 1`` target words just before it that describe without naming
    (``kinds == -2``: "small", "red") get the same one — the step that says "red" is where the
    caption decides which object comes next. Everything else is -1 (not supervised)."""
    k = kinds.to(targets.device)[targets]  # (B, T)
    named = torch.where(k >= 0, k, torch.full_like(k, -1))
    out = named.clone()
    for back in range(1, window):
        ahead = torch.full_like(k, -1)
        ahead[:, :-back] = named[:, back:]
        # a describing word takes the category of a kind word ``back`` steps later, if only describing words lie between
        between = torch.ones_like(k, dtype=torch.bool)
        for j in range(1, back):
            shifted = torch.zeros_like(between)
            shifted[:, :-j] = k[:, j:] == -2
            between &= shifted
        out = torch.where((k == -2) & (out < 0) & between & (ahead >= 0), ahead, out)
    return out


def class_regions(boxes: Tensor, labels: Tensor, grid: tuple[int, int], num_classes: int) -> Tensor:
    """Per category, the patches of a ``grid`` that belong to one of its boxes: ``[K, rows * cols]``
    bool. A patch belongs to a box that holds its centre (:func:`patch_objects`' rule, the
    smallest box winning), and a box holding no patch centre to the patch under its own centre."""
    n = grid[0] * grid[1]
    out = torch.zeros(num_classes, n, dtype=torch.bool, device=boxes.device)
    if len(boxes) == 0:
        return out
    owner = patch_objects(boxes, grid)
    labels = labels.to(torch.int64)
    for j in range(len(boxes)):
        mine = owner == j
        if not mine.any():
            cx = float((boxes[j, 0] + boxes[j, 2]) / 2)
            cy = float((boxes[j, 1] + boxes[j, 3]) / 2)
            col = min(grid[1] - 1, max(0, int(cx * grid[1])))
            row = min(grid[0] - 1, max(0, int(cy * grid[0])))
            mine = torch.zeros_like(mine)
            mine[row * grid[1] + col] = True
        out[labels[j]] |= mine
    return out


def word_attention_loss(attention: Tensor, classes: Tensor, regions: Tensor) -> Tensor | None:
    """Mean of ``-log`` (the attention mass inside the named category's patches) over the
    supervised steps: ``attention [B, T, N]`` (rows sum to 1), ``classes [B, T]`` from
    :func:`word_attention_targets`, ``regions [B, K, N]`` from :func:`class_regions`. Steps
    whose category has no box in the image are skipped; ``None`` when no step is left."""
    b, t = classes.shape
    picked = classes.clamp(min=0)
    mask = torch.gather(regions, 1, picked[:, :, None].expand(b, t, regions.shape[-1]))  # (B, T, N)
    valid = (classes >= 0) & mask.any(-1)
    if not valid.any():
        return None
    mass = (attention.float() * mask).sum(-1)
    return -torch.log(mass[valid].clamp(min=1e-6)).mean()


def repeat_images(enc: EncoderOutput, times: int) -> EncoderOutput:
    """``enc`` with every image's tokens repeated ``times`` times in a row (image 0 ``times``
    times, then image 1, ...), for ``times`` captions per image; ``enc`` itself when 1."""
    if times == 1:
        return enc
    rep = {f.name: getattr(enc, f.name).repeat_interleave(times, dim=0) for f in dataclasses.fields(enc)
           if isinstance(getattr(enc, f.name), Tensor) and getattr(enc, f.name).shape[:1] == enc.tokens.shape[:1]}
    return dataclasses.replace(enc, **rep)


def concept_vocabulary(references: list[list[str]], max_share: float) -> list[str]:
    """The caption words that say what an image shows rather than how a sentence goes: every
    word (of normalised ``references``, per image a list of captions) that occurs in the
    references of at least one image and of at most ``max_share`` of the images ("a", "and",
    "the" occur in nearly all); sorted."""
    counts: dict[str, int] = {}
    for refs in references:
        for word in {w for r in refs for w in r.split()}:
            counts[word] = counts.get(word, 0) + 1
    limit = max_share * len(references)
    return sorted(w for w, n in counts.items() if n <= limit)


def concept_targets(references: list[list[str]], words: list[str]) -> Tensor:
    """Per image and word: the share of the image's references that contain the word
    (``[images, len(words)]`` float32, in [0, 1]): "zero" said by all five captions of an image
    is 1, "above" said by one of five is 0.2."""
    column = {w: k for k, w in enumerate(words)}
    out = torch.zeros(len(references), len(words))
    for i, refs in enumerate(references):
        for r in refs:
            for k in {column[w] for w in r.split() if w in column}:
                out[i, k] += 1.0 / len(refs)
    return out


def idf_token_weights(references: list[list[str]], vocab: list[str], special: set[int], strength: float) -> Tensor:
    """Per token id of ``vocab``, the weight of that target word in the caption cross-entropy:
    ``(1 - strength) + strength * idf(w) / mean_idf``, where ``idf(w) = log(images / images whose
    references use w)`` over the training ``references`` (per image a list of normalised
    captions) and ``mean_idf`` is the mean idf over every word of every reference, so the
    average target keeps weight 1. Words every image's references use ("the", "a") fall to
    ``1 - strength``; the words that tell images apart (the objects) rise. The ``special`` ids
    (``<eos>`` and the like: every caption has to end) and words the references never use keep
    weight 1. ``[len(vocab)]`` float32."""
    index = {w: i for i, w in enumerate(vocab)}
    images = max(len(references), 1)
    df = torch.zeros(len(vocab))
    counts = torch.zeros(len(vocab))
    for refs in references:
        for r in refs:
            for w in r.split():
                if w in index:
                    counts[index[w]] += 1
        for w in {w for r in refs for w in r.split() if w in index}:
            df[index[w]] += 1
    idf = torch.where(df > 0, torch.log(images / df.clamp(min=1)), torch.zeros_like(df))
    mean_idf = float((idf * counts).sum() / counts.sum().clamp(min=1))
    weights = torch.ones(len(vocab))
    if mean_idf > 0:
        used = df > 0
        weights[used] = (1.0 - strength) + strength * idf[used] / mean_idf
    for i in special:
        weights[i] = 1.0
    return weights
