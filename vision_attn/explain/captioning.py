"""Per-word cross-attention of generated captions ("Show, Attend and Tell" strips), and how
well the per-word maps localise and explain.

For every generated word, the ``attention`` map is the decoder's cross-attention over the patch
grid at the step that *produced* the word (heads averaged; the last layer, or the mean over
layers); ``relevance`` is Chefer et al. 2021b through decoder and encoder
(:func:`~vision_attn.explain.decoder_relevance.caption_relevance`).

Measured by ``eval.py`` (:func:`write_caption_overlays`) on a seeded sample of the split (the
faithfulness images, :func:`~vision_attn.explain.evaluate.select_images`), for every method of
:func:`~vision_attn.explain.detection.decoder_methods` and a ``random`` baseline (seeded
uniform maps over the patch grid: its localisation numbers are the mean over
:data:`RANDOM_DRAWS` maps per word, its faithfulness and saved map the first of them; the numbers
accumulated by :mod:`vision_attn.explain.measures`):

- **Localisation** (when the split has boxes, ``ROOT/annotations/instances_<split>.json`` as
  the embedded shapes data and COCO do): the explained words are the generated words that name
  an object of the image — its category or, where annotations carry one, its ``colour``
  ("red"). Category names are read as content accuracy reads them (:func:`named_words`, with
  :class:`~vision_attn.data.caption_objects.ObjectVocabulary`): plurals ("circles"), synonyms ("man"
  for a person) and names of several words ("traffic light", scored at its last word). Each
  word's map is mapped to the original image's pixels
  (:func:`~vision_attn.explain.localisation.grid_to_image` through the evaluation
  preprocessing) and scored against the boxes of the objects the word names
  (:func:`~vision_attn.explain.localisation.localisation`): ``pointing_<method>`` is the share
  of words whose map maximum (first index on ties) lies within 1 px of such a box,
  ``energy_<method>`` the mean share of the map's mass inside them. ``pointing_words`` counts
  the words. ``pointing_acc`` / ``pointing_acc_random`` are the previous version's names of
  ``pointing_attention`` / ``pointing_random`` (kept for one version).
- **Faithfulness** (``--explain.faithfulness``): ``deletion_auc_<method>`` /
  ``insertion_auc_<method>`` over the same words (when the split has no boxes, every generated
  word that can name something in the image: :func:`grounded_positions` leaves out the
  :data:`UNGROUNDED_WORDS` such as "a", "of", "there", and the frame "a picture of"): the
  patches are removed (deletion; replaced by the normalisation mean) or put back into a blurred
  image (insertion) in the order of the word's map, and the curve follows the word's
  *probability* ``exp(log p(word | <bos>, earlier words, image))``, teacher-forced on the
  generated caption. Probabilities lie in ``[0, 1]``, so the AUCs do too (log-probabilities
  would not: unbounded below). Lower deletion / higher insertion is better.
  ``deletion_auc`` / ``insertion_auc`` are the first method's; ``explain_words`` counts the
  words.
- **Sanity** (``--explain.sanity true``; ``sanity_<method>`` and ``OUT/sanity.json``): the
  mean Spearman correlation, over the same words, between each word's map from the trained
  model and from the model randomised from the output down
  (:func:`~vision_attn.explain.sanity.model_cascade`: the decoder first, then the encoder from
  the top block). The randomised
  models explain the trained model's caption, teacher-forced (:func:`teacher_forced_word_maps`:
  ``attention`` is the cross-attention of the position that predicts the word, as during
  generation; ``relevance`` the word's log-probability). ``sanity_<method>`` is the fully
  randomised step ``all``; ``random`` scores 1 by construction (the same seeded draws).
- **Maps** (``--explain.save_maps true``): every explained word's map of every method, float32
  ``[H, W]`` in original image pixels, as ``OUT/maps/<method>/<NNNNN>.npy`` (``NNNNN`` a running
  number over the explained words) and ``OUT/maps/index.json``: ``[{"index": NNNNN, "file":
  <the image_id, as in predictions.json>, "image_index": <the image's index in the split, as
  the overlays name it>, "word", "position": <the word's index in the caption>}]``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.data.caption_objects import ObjectVocabulary
from vision_attn.data.imageio import read_image
from vision_attn.data.tokenizer import normalize_caption
from vision_attn.errors import DataError
from vision_attn.explain.caption_boxes import BoxMasks, NamedBoxes, _split_boxes
from vision_attn.explain.decoder_relevance import caption_relevance
from vision_attn.explain.detection import DECODER_METHODS, GRADIENT_METHODS, decoder_methods, relevance_rule
from vision_attn.explain.evaluate import overlay_images, select_images, worst_images
from vision_attn.explain.faithfulness import MODES, blur, on_patch_grid, order_ends, perturbation_curves
from vision_attn.explain.images import enlarge
from vision_attn.explain.localisation import grid_to_image, localisation
from vision_attn.explain.lrp_decoder import caption_lrp, gate_by_attention, positive_maps
from vision_attn.explain.measures import Localisation, MapWriter, Measures, Perturbation, Sanity
from vision_attn.explain.overlay import Normalize, attach_colour_bar, image_grid, overlay_saliency, save_png, scale_maps
from vision_attn.explain.progress import Progress
from vision_attn.explain.records import Explained, Report, png_data_uri, quantise
from vision_attn.explain.rollout import normalize_maps
from vision_attn.explain.sanity import StandIn, model_cascade, spearman
from vision_attn.outputs import safe_filename

__all__ = ["CAPTION_DEFAULTS", "CAPTION_RULE", "FRAME_WORDS", "RANDOM_DRAWS", "UNGROUNDED_WORDS", "boxes_vocabulary",
           "caption_figure", "caption_strip", "explain_captioning", "grounded_positions", "named_words",
           "pointing_game", "random_word_maps", "teacher_forced_word_maps", "word_attention_maps",
           "word_end_probabilities", "word_probability_curves", "write_caption_overlays"]

log = logging.getLogger(__name__)

CAPTION_DEFAULTS: tuple[str, ...] = ("lrp_attention", "attention")
"""The captioning head's methods, first = the default, when ``--explain.methods`` is not given
(:func:`~vision_attn.explain.detection.decoder_methods`; ``relevance`` where AttnLRP has no rule).
Measured in docs/results/explanations.md (100 images): on stroke scenes the captioner was not
tuned on, AttnLRP gated by the word's cross-attention points at the named digit 0.951 of the time
(AttnLRP alone 0.981, raw cross-attention 0.718) and keeps far more of its mass on it (0.711
against 0.534 and 0.263), with the best mask IoU (0.561) and deletion; on the demo scenes
pointing 0.989 (0.994, 0.745), energy 0.849 (0.709, 0.324)."""
CAPTION_RULE = "decoder"
"""The captioning head's relevance rule (:data:`~vision_attn.explain.decoder_relevance.RELEVANCE_RULES`)
unless ``--explain.decoder_rule`` says otherwise: on stroke-digit scenes the model was not tuned on,
the cross-attention carried through the decoder alone points at the named digit more often and
keeps more of its mass on it than the full rule (docs/results/explanations.md)."""

RANDOM_DRAWS = 16
"""Seeded random maps per explained word whose mean pointing / energy is ``random``'s (a
steadier estimate of the chance level than one draw); the first is also its faithfulness map."""

Box = Sequence[float]


def word_attention_maps(attention: torch.Tensor, num_words: int, grid: tuple[int, int],
                        layers: str = "last") -> torch.Tensor:
    """Maps ``[num_words, h, w]`` in ``[0, 1]`` from one image's ``Generation.attention`` ``[T, L, N]``."""
    att = attention[:num_words].float()
    fused = att[:, -1] if layers == "last" else att.mean(1)  # (T, N)
    return normalize_maps(fused.reshape(-1, *grid))


def teacher_forced_word_maps(model, images: Tensor, tokens: Sequence[Tensor], methods: Sequence[str],
                             layers: str = "last", rule: str = "full") -> dict[str, list[Tensor]]:
    """Per decoder method, one ``[T_b, h, w]`` map per image for the given captions, teacher-forced.

    ``model``: a captioner (``encoder``, ``head``, ``tokenizer``; the task or a stand-in with
    another encoder). ``tokens``: per image the word ids without ``<bos>`` (``[T_b]``).
    ``attention``: heads averaged, at the position whose output predicts word ``t`` (the query
    of generation's step ``t``, so equal to :func:`word_attention_maps` of the generation;
    causal decoder), the last layer or the mean over layers (``layers``). ``relevance``:
    :func:`~vision_attn.explain.decoder_relevance.caption_relevance` with ``rule``. ``lrp``:
    :func:`~vision_attn.explain.lrp_decoder.caption_lrp`'s positive part. ``lrp_attention``:
    ``lrp`` gated by ``attention`` (:func:`~vision_attn.explain.lrp_decoder.gate_by_attention`).
    """
    out: dict[str, list[Tensor]] = {}
    grid = model.encoder.grid_for(*images.shape[-2:])
    seqs = [torch.as_tensor(t).long().flatten().cpu() for t in tokens]
    if {"attention", "lrp_attention"} & set(methods):
        longest = max((len(q) for q in seqs), default=0)
        full = torch.full((len(seqs), longest + 1), model.head.pad_id, dtype=torch.long)
        full[:, 0] = model.tokenizer.bos_id
        for b, q in enumerate(seqs):
            full[b, 1 : len(q) + 1] = q
        with torch.no_grad():
            _, weights = model.head(model.encoder(images), full[:, :-1].to(images.device), need_weights=True)
        att = torch.stack(weights, dim=1).mean(dim=2).transpose(1, 2).cpu()  # (B, T, L, N)
        out["attention"] = [word_attention_maps(att[b], len(q), grid, layers) for b, q in enumerate(seqs)]
    if "relevance" in methods:
        out["relevance"] = caption_relevance(model, images, seqs, rule=rule)
    if {"lrp", "lrp_attention"} & set(methods):
        out["lrp"] = positive_maps(caption_lrp(model, images, seqs))
    if "lrp_attention" in methods:
        out["lrp_attention"] = [gate_by_attention(r, a) for r, a in zip(out["lrp"], out["attention"], strict=True)]
    unknown = [m for m in methods if m not in out]
    if unknown:
        raise ValueError(f"teacher_forced_word_maps: no captioning method {unknown}; known: "
                         f"{', '.join(DECODER_METHODS)}")
    return {m: out[m] for m in methods}


def caption_strip(rgb: np.ndarray, words: list[str], maps: torch.Tensor | Sequence[np.ndarray], alpha: float = 0.5,
                  cols: int = 8, title: str | None = None) -> np.ndarray:
    """The image, then one overlay per word (``maps``: ``[T, h, w]`` in ``[0, 1]``) titled with
    the word; the caption (after ``title``, e.g. the method, when given) written above."""
    rgb = enlarge(rgb, 128)  # small images enlarged so the heat maps can be seen
    tiles = [rgb] + [overlay_saliency(rgb, m, alpha=alpha) for m in maps]
    grid = image_grid(tiles, ["image", *words], cols=min(cols, len(tiles)))
    band = np.full((22, grid.shape[1], 3), 255, np.uint8)
    caption = " ".join(words) or "(empty caption)"
    text = f"{title}: {caption}" if title else caption
    cv2.putText(band, text, (4, 16), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1, cv2.LINE_AA)
    return np.concatenate([band, grid], axis=0)


def caption_figure(picture: np.ndarray, words: list[str], maps: Mapping[str, Tensor], alpha: float = 0.5,
                   normalize: Normalize = "shared") -> np.ndarray:
    """The per-word strips (:func:`caption_strip`) of every method (``maps``: ``[T, h, w]`` each,
    any scale), stacked, on one colour scale for the figure (``shared``; ``per_map``: each map
    to its own maximum; :func:`~vision_attn.explain.overlay.scale_maps`), with a colour bar."""
    methods = list(maps)
    scaled, peaks = scale_maps([w for m in methods for w in maps[m]], normalize)
    at = np.cumsum([0] + [len(maps[m]) for m in methods])
    strips = [caption_strip(picture, words, scaled[at[k] : at[k + 1]], alpha, title=m if len(methods) > 1 else None)
              for k, m in enumerate(methods)]
    return attach_colour_bar(np.concatenate(strips, axis=0), peaks[0] if normalize == "shared" and peaks
                             and peaks[0] > 0 else None)


UNGROUNDED_WORDS = frozenset({
    # articles, determiners, pronouns
    "a", "an", "the", "this", "that", "these", "those", "it", "its", "they", "them", "their", "he", "his", "him",
    "she", "her", "we", "our", "you", "your", "i", "my", "some", "any", "each", "every", "other", "another",
    # auxiliaries and copulas, conjunctions, non-spatial prepositions
    "is", "are", "was", "were", "be", "been", "being", "am", "has", "have", "had", "do", "does",
    "and", "or", "but", "nor", "so", "than", "then", "while", "which", "who", "whom", "whose", "what",
    "of", "with", "to", "for", "as", "there", "here", "very", "shows", "showing", "contains", "containing",
})
"""Words a caption uses that name nothing in the image. Without boxes, :func:`grounded_positions`
leaves them out of the explained words: their probability hardly depends on the pixels, so
their deletion / insertion curves say little about a map and cost as much as the rest (spatial
words such as "above", "left", "on", "at", "by" and every number, colour and object word stay)."""

FRAME_WORDS = frozenset({"picture", "image", "photo", "photograph", "photography", "view", "close", "closeup"})
"""The frame of a caption ("a picture of ...", "a close up of ..."): ungrounded when "of" follows
(or "up of", for "close up of"); "a picture hanging on the wall" keeps its picture."""


def grounded_positions(words: list[str]) -> list[int]:
    """Positions of the ``words`` that can name something in the image: not in
    :data:`UNGROUNDED_WORDS`, and not a :data:`FRAME_WORDS` frame (all positions if none is)."""
    low = [w.lower() for w in words]

    def frame(t: int) -> bool:
        rest = low[t + 1 : t + 3]
        return low[t] in FRAME_WORDS and (rest[:1] == ["of"] or rest == ["up", "of"])

    framed = {t + k for t in range(len(low)) if frame(t) for k in ((0, 1) if low[t + 1] == "up" else (0,))}
    kept = [t for t, w in enumerate(low) if w not in UNGROUNDED_WORDS and t not in framed]
    return kept or list(range(len(words)))


def boxes_vocabulary(boxes: Iterable[NamedBoxes]) -> ObjectVocabulary:
    """An :class:`~vision_attn.data.caption_objects.ObjectVocabulary` whose categories are every name
    of the ``boxes`` (of one image or of a split), with the default synonyms."""
    return ObjectVocabulary(sorted({name for image in boxes for names, _ in image for name in names if name}))


def _split_vocabulary(dataset, boxes: dict[int, NamedBoxes]) -> ObjectVocabulary:
    """The vocabulary content accuracy reads the split's captions with (every category of the
    instances file, its colours), or, for a dataset without ``annotated_objects`` (or an instances
    file content accuracy cannot read, which it reports), the boxes'."""
    try:
        annotated = dataset.annotated_objects() if callable(getattr(dataset, "annotated_objects", None)) else None
    except DataError:
        annotated = None
    return annotated.vocabulary() if annotated is not None else boxes_vocabulary(boxes.values())


def named_words(words: list[str], boxes: NamedBoxes, vocab: ObjectVocabulary | None = None
                ) -> list[tuple[int, list[list[float]]]]:
    """``[(position, boxes it names)]`` of the ``words`` that name one of the image's ``boxes``
    (``[(names, xyxy)]``), in caption order.

    Words are matched as content accuracy matches them
    (:meth:`~vision_attn.data.caption_objects.ObjectVocabulary.match`): from each word the longest
    category name, its last word possibly plural, or a synonym ("men" names a ``person``); the
    words of a matched name are consumed ("teddy bear" is no ``bear``) and a name of several
    words is scored at its last word. Any other word names the boxes that carry it as a name
    (a colour, "red").

    Args:
        words: the caption's words.
        boxes: the image's ``[(names of the box, [x0, y0, x1, y1])]``.
        vocab: the vocabulary (evaluation uses the split's, the one content accuracy reads its
            captions with); default: the names of ``boxes`` (:func:`boxes_vocabulary`).
    """
    vocab = vocab if vocab is not None else boxes_vocabulary([boxes])
    low = [normalize_caption(w) for w in words]
    out = []
    i = 0
    while i < len(low):
        found = vocab.match(low, i)
        name, span = found if found is not None else (low[i], 1)
        own = [box for names, box in boxes if name in names] if name else []
        if own:
            out.append((i + span - 1, own))
        i += span
    return out


def pointing_game(words: list[str], maps: np.ndarray | Tensor, boxes: NamedBoxes, tolerance: float = 1.0,
                  vocab: ObjectVocabulary | None = None) -> tuple[int, int, float]:
    """``(hits, object words, summed energy share)`` of one caption.

    Args:
        words: the caption's words.
        maps: ``[len(words), H, W]`` one map per word in original image pixels.
        boxes: the image's ``[(words naming the box, [x0, y0, x1, y1] pixels)]``.
        tolerance: of the hit, in pixels (:func:`~vision_attn.explain.localisation.pointing_hit`).
        vocab: how words name boxes (:func:`named_words`).
    """
    hits, energy = 0, 0.0
    named = named_words(words, boxes, vocab)
    for t, own in named:
        hit, share = localisation(np.asarray(maps[t]), own, tolerance)
        hits += int(hit)
        energy += share
    return hits, len(named), energy


def random_word_maps(n: int, grid: tuple[int, int], generator: torch.Generator) -> Tensor:
    """The ``random`` baseline: ``[n, h, w]`` uniform values over the patch grid."""
    return torch.rand(n, *grid, generator=generator)


@torch.no_grad()
def word_probability_curves(
    task,
    images: Tensor,
    tokens: Sequence[Tensor],
    items: Sequence[tuple[int, int]],
    saliency: Tensor,
    mode: Literal["deletion", "insertion"] = "deletion",
    steps: int = 16,
    chunk: int = 128,
    ends: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The probability of explained words as patches are deleted (or inserted) in map order.

    The captioning counterpart of
    :func:`~vision_attn.explain.faithfulness.deletion_insertion_curve`: the same patch ranking
    (most salient first, ties by position), baselines (deletion: ``0`` = the normalisation mean;
    insertion: the blurred image) and curve points; the score is the word's probability given
    ``<bos>`` and the caption's earlier words (teacher-forced), so it lies in ``[0, 1]``.

    Args:
        task: a :class:`~vision_attn.tasks.CaptioningTask` in eval mode.
        images: ``[B, 3, H, W]`` normalised model inputs.
        tokens: per image the caption's ids without ``<bos>`` (``[T_b]``).
        items: ``R`` explained words as ``(image b, position t)``: the word ``tokens[b][t]``.
        saliency: ``[R, h, w]`` the words' maps over the patch grid.
        mode: ``deletion`` or ``insertion``.
        steps: curve points after the start (``steps + 1`` in all).
        chunk: (word, curve point) rows per model call.
        ends: ``[R]`` probabilities at the first and last point when the caller has them
            (:func:`word_end_probabilities`, :func:`~vision_attn.explain.faithfulness.order_ends`);
            only the points in between are computed.

    Returns:
        ``[R, steps + 1]`` probabilities at ``0, 1/steps, ..., 1`` of the patches changed.
    """
    r_total = len(items)
    _, _, H, W = images.shape
    h, w = saliency.shape[-2:]
    if H % h or W % w:
        raise ValueError(f"image size {H}x{W} is not a multiple of the saliency grid {h}x{w}")
    if saliency.shape[0] != r_total:
        raise ValueError(f"{r_total} words but {saliency.shape[0]} maps")
    device = images.device
    if r_total == 0:
        return torch.zeros(0, steps + 1, device=device)
    b_idx, t_idx, full, target = _word_rows(task, tokens, items, device)
    base = torch.zeros_like(images) if mode == "deletion" else blur(images)
    return perturbation_curves(lambda x, rows: _word_probability(task, x, full[rows], t_idx[rows], target[rows]),
                               images, base, saliency, b_idx, mode, steps, chunk, ends)


def _word_rows(task, tokens: Sequence[Tensor], items: Sequence[tuple[int, int]], device: torch.device
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(image index, position, <bos> + caption, word id)`` of each explained word ``(b, t)``;
    the captions are cut after the last explained position (the decoder is causal)."""
    b_idx = torch.tensor([b for b, _ in items], device=device)
    t_idx = torch.tensor([t for _, t in items], device=device)
    seqs = [torch.as_tensor(tokens[b]).long().flatten().cpu() for b, _ in items]
    longest = max(int(t) for _, t in items) + 1  # the inputs up to the explained word suffice (causal)
    full = torch.full((len(items), longest + 1), task.tokenizer.pad_id, dtype=torch.long)
    full[:, 0] = task.tokenizer.bos_id
    for r, s in enumerate(seqs):
        full[r, 1 : min(len(s), longest) + 1] = s[:longest]
    full = full.to(device)  # (R, 1 + longest): <bos> w_0 .. ; inputs [:, :-1], word t = full[:, t + 1]
    return b_idx, t_idx, full, full[torch.arange(len(items), device=device), t_idx + 1]


def _word_probability(task, images: Tensor, full: Tensor, t_idx: Tensor, target: Tensor) -> Tensor:
    """Teacher-forced probability of word ``target`` at position ``t_idx`` of each row."""
    logits = task(images, full[:, :-1])  # (n, longest, V)
    logp = F.log_softmax(logits[torch.arange(len(t_idx), device=images.device), t_idx].float(), dim=-1)
    return logp.gather(1, target[:, None]).squeeze(1).exp()


@torch.no_grad()
def word_end_probabilities(task, images: Tensor, tokens: Sequence[Tensor], items: Sequence[tuple[int, int]],
                           chunk: int = 128) -> dict[str, Tensor]:
    """The explained words' ``[R]`` probabilities on the images (``image``) and on their
    ``zero`` and ``blur`` baselines: the first and last points of every map's deletion and
    insertion curves (:func:`~vision_attn.explain.faithfulness.order_ends`), computed once."""
    device = images.device
    if not items:
        return dict.fromkeys(("image", "zero", "blur"), torch.zeros(0, device=device))
    b_idx, t_idx, full, target = _word_rows(task, tokens, items, device)
    out = {}
    for name, x in (("image", images), ("zero", torch.zeros_like(images)), ("blur", blur(images))):
        out[name] = torch.cat([_word_probability(task, x[b_idx[s : s + chunk]], full[s : s + chunk],
                                                 t_idx[s : s + chunk], target[s : s + chunk])
                               for s in range(0, len(items), chunk)])
    return out


def explain_captioning(task, images: torch.Tensor, pictures: list[np.ndarray], options, truths=None) -> list:
    """:meth:`~vision_attn.tasks.VisionTask.explain_batch` of a captioner: per image the record
    ``{"caption"}``, the per-word strips of the methods of
    :func:`~vision_attn.explain.detection.decoder_methods` on ``options.normalize``'s colour scale
    (:func:`caption_figure`) and its report item (the
    first method's maps); ``extras`` holds the ``words``, their ids ``tokens`` (``[T]``, no
    ``<bos>``) and ``maps`` ``{method: [T, h, w]}`` over the patch grid."""
    with torch.no_grad():
        gen = task.generate(images, return_attention=True)
    grid = task.encoder.grid_for(*images.shape[-2:])
    captions = [task.tokenizer.decode_words(gen.tokens[j].tolist()) for j in range(len(pictures))]
    methods = decoder_methods(options, CAPTION_DEFAULTS, task)
    word_ids = [gen.tokens[j][: len(w)] for j, w in enumerate(captions)]
    gradient_maps = teacher_forced_word_maps(task, images, word_ids, [m for m in methods if m in GRADIENT_METHODS],
                                             options.query_layers, relevance_rule(options, CAPTION_RULE))
    explained = []
    for j, (picture, words) in enumerate(zip(pictures, captions, strict=True)):
        maps = {m: gradient_maps[m][j] if m in gradient_maps else
                word_attention_maps(gen.attention[j].cpu(), len(words), grid, options.query_layers) for m in methods}
        strip = caption_figure(picture, words, maps, options.alpha, getattr(options, "normalize", "shared"))
        text = " ".join(words) if truths is None else f"{' '.join(words)} (reference: {truths[j]})"
        first = maps[methods[0]]
        item = None if not options.report else {  # report.html's entry: only when a report is written
            "text": text, "image": Report.display_image(picture), "panels": [png_data_uri(strip)], "kind": "words",
            "grid": list(first.shape[-2:]), "words": words, "maps": quantise(first.flatten(1)) if words else ""}
        extras = {"words": words, "tokens": word_ids[j].cpu(), "maps": maps}
        explained.append(Explained({"caption": " ".join(words)}, strip, item, extras))
    return explained


def _caption_items(task, images: Tensor, explained: list, rows: list[tuple[int, int, int, np.ndarray]],
                   boxes: dict[int, NamedBoxes] | None, methods: list[str], generator: torch.Generator,
                   measures: Measures, vocab: ObjectVocabulary | None = None,
                   masks: BoxMasks | None = None
                   ) -> tuple[list[tuple[int, int]], dict[str, list[Tensor]]]:
    """The explained words of the batch's measured images, their localisation and saved maps.

    ``rows``: ``(batch position j, split index i, image id, original picture)`` per image to
    measure; ``vocab``: how words name boxes (:func:`named_words`); ``masks``: the objects' masks
    by image (:func:`_split_boxes`), which score a word's maps against the masks of the objects it
    names. Returns the words as
    ``(batch position, word position)`` and per method their maps over the patch grid (one
    ``[K, h, w]`` per image, in the order of the words)."""
    pre = task.inference_data_config()
    grid = task.encoder.grid_for(*images.shape[-2:])
    items, grids = [], {m: [] for m in methods}
    for j, i, image_id, picture in rows:
        words = explained[j].extras["words"]
        if boxes is not None:
            named = named_words(words, boxes.get(image_id, []), vocab)
        else:
            named = [(t, []) for t in grounded_positions(words)]
        if not named:
            continue
        positions = [t for t, _ in named]
        maps = {m: explained[j].extras["maps"][m][positions].float() for m in methods if m != "random"}
        draws = random_word_maps(RANDOM_DRAWS * len(positions), grid, generator).view(RANDOM_DRAWS, -1, *grid)
        maps["random"] = draws[0]  # (K, h, w): the draw of the faithfulness curves and saved maps
        size = picture.shape[:2]
        image_maps = {m: grid_to_image(g, size, pre) for m, g in maps.items()}  # (K, H, W) each
        more = (grid_to_image(draws[1:].flatten(0, 1), size, pre).reshape(RANDOM_DRAWS - 1, len(positions), *size)
                if boxes is not None else None)
        decoded = [(box, mask.decode(size)) for box, mask in (masks or {}).get(image_id, [])]
        for k, (t, own) in enumerate(named):
            if more is not None:  # random: the mean over its draws
                measures.localisation.update({m: np.concatenate([image_maps[m][k][None], more[:, k]])
                                              if m == "random" else image_maps[m][k] for m in methods}, own,
                                             [pixels for box, pixels in decoded if box in own])
            if measures.maps is not None:
                n = measures.maps.count
                measures.maps.update({m: image_maps[m][k] for m in methods},
                                     {"index": n, "file": image_id, "image_index": i, "word": words[t], "position": t})
        items += [(j, t) for t in positions]
        for m in methods:
            grids[m].append(maps[m])
    return items, grids


def _word_curves(task, images: Tensor, explained: list, items: list[tuple[int, int]],
                 grids: dict[str, list[Tensor]], steps: int) -> dict[str, dict[str, Tensor]]:
    """``{method: {mode: [R, steps + 1]}}``: the probability of each of the ``items``' words as
    its map's patches are deleted or inserted (:func:`word_probability_curves`)."""
    tokens = [e.extras["tokens"] for e in explained]
    shared = word_end_probabilities(task, images, tokens, items)  # every map's first and last points, once
    grid = task.encoder.grid_for(*images.shape[-2:])
    out = {}
    for m, per_image in grids.items():
        sal = on_patch_grid(torch.cat(per_image), grid).to(images.device)  # (R, h, w)
        out[m] = {mode: word_probability_curves(task, images, tokens, items, sal, mode, steps,
                                                ends=order_ends(shared, mode)) for mode in MODES}
    return out


def _sanity(task, images: Tensor, explained: list, items: list[tuple[int, int]], grids: dict[str, list[Tensor]],
            options) -> dict[str, dict[str, Tensor]]:
    """``{method: {step: [R]}}``: the Spearman correlations of the ``items`` ``(batch position,
    word position)`` between the trained maps (``grids``, in the order of ``items``) and the
    maps of the models randomised from the output down (see the module docstring)."""
    rows = sorted({j for j, _ in items})  # the measured images of the batch
    where = {j: r for r, j in enumerate(rows)}
    tokens = [explained[j].extras["tokens"] for j in rows]
    trained = {m: torch.cat(g).flatten(1) for m, g in grids.items()}  # (R, h * w)
    asked = [m for m in grids if m != "random"]
    out: dict[str, dict[str, Tensor]] = {m: {} for m in grids}
    for step, encoder, head in model_cascade(task.encoder, task.head, seed=options.seed,
                                               cascade=options.sanity_cascade):
        stand_in = StandIn(encoder, head, tokenizer=task.tokenizer)
        maps = teacher_forced_word_maps(stand_in, images[rows], tokens, asked, options.query_layers,
                                        relevance_rule(options, CAPTION_RULE))
        for m in grids:
            if m == "random":  # the model is not asked: the same draws, correlation 1
                randomised = trained[m]
            else:
                randomised = torch.stack([maps[m][where[j]][t] for j, t in items]).flatten(1)
            out[m][step] = spearman(trained[m], randomised)
    return out


def _caption_metrics(measures: Measures, methods: list[str], out_dir: Path) -> dict[str, float]:
    """The numbers of the explained words (see the module docstring), and ``OUT/sanity.json``."""
    measures.sanity.write(out_dir)
    out = measures.sanity.compute()
    located = measures.localisation.compute()
    if located:
        out.update(located)
        alias = "attention" if "attention" in methods else methods[0]
        # the previous version's names, kept one more version: raw attention's and random's
        out.update(pointing_acc=out[f"pointing_{alias}"], pointing_acc_random=out["pointing_random"],
                   pointing_words=float(measures.localisation.count))
    faithful = measures.perturbation.compute()
    if faithful:
        out.update(faithful)
        out["explain_words"] = float(measures.perturbation.count)
    return out


def write_caption_overlays(task, dataset, options, out_dir: Path, report=None) -> dict[str, float]:
    """Write a per-word strip (:func:`explain_captioning`) for ``options.num_overlays`` images and the
    ``options.mistakes`` lowest-CIDEr captions of the evaluation (``options.predictions``;
    :func:`~vision_attn.explain.evaluate.worst_images`) into ``out_dir/overlays`` and return the
    localisation (when the split has boxes) and faithfulness (``options.faithfulness``) metrics
    of up to ``options.faithfulness_images`` images, saving their maps with
    ``options.save_maps`` (see the module docstring)."""
    chosen = set(overlay_images(dataset, options, worst_images(task, dataset, options)))
    masks: BoxMasks = {}
    boxes = _split_boxes(dataset, masks)
    vocab = _split_vocabulary(dataset, boxes) if boxes is not None else None
    measured = boxes is not None or options.faithfulness or options.save_maps or options.sanity
    picked = (set(select_images(len(dataset), options.faithfulness_images, options.faithfulness_selection,
                                options.seed)) if measured else set())
    todo = sorted(chosen | picked)
    device = next(task.parameters()).device
    methods = list(dict.fromkeys([*decoder_methods(options, CAPTION_DEFAULTS, task), "random"]))
    # the items (words) are known only once generated: one report over the images, with their total
    measures = Measures(Localisation(progress=False), Perturbation(first=methods[0], progress=False),
                        Sanity(progress=False), MapWriter(out_dir, "words") if options.save_maps and picked else None)
    progress = Progress("caption overlays and explanation measures", len(todo), "image")
    generator = torch.Generator().manual_seed(options.seed)
    max_pixels = getattr(dataset, "max_pixels", None)
    written = 0
    for start in range(0, len(todo), options.batch_size):
        idx = todo[start : start + options.batch_size]
        images = torch.stack([dataset[i][0] for i in idx]).to(device)
        pictures = [read_image(dataset.image_path(i), **({"max_pixels": max_pixels} if max_pixels else {}))
                    for i in idx]
        explained = task.explain_batch(images, pictures, options)
        rows = []
        for j, (i, e) in enumerate(zip(idx, explained, strict=True)):
            image_id = dataset.images[i]["id"]
            if i in chosen:
                # The id comes from the annotation file: one safe, short name under out_dir, always.
                save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{image_id}.png"), e.panel, root=out_dir)
                written += 1
                if report is not None and e.report_item is not None:
                    report.items.append({"name": f"image id {image_id}", **e.report_item})
            if i in picked:
                rows.append((j, i, image_id, pictures[j]))
        items, grids = _caption_items(task, images, explained, rows, boxes, methods, generator, measures, vocab, masks)
        if options.sanity and items:
            measures.sanity.update(_sanity(task, images, explained, items, grids, options))
        if options.faithfulness and items:
            measures.perturbation.update(_word_curves(task, images, explained, items, grids, options.steps))
        progress.update(len(idx))
    progress.close()
    if written:
        log.info("wrote %d per-word attention strips to %s", written, out_dir / "overlays")
    if measures.maps is not None:
        measures.maps.compute()
    if boxes is not None and picked and not measures.localisation.count:
        log.warning("localisation: no generated word of the %d explained images names an object of its image; "
                    "no pointing / energy numbers", len(picked))
    metrics = _caption_metrics(measures, methods, out_dir)
    if metrics or (options.save_maps and picked):
        metrics["explain_images"] = float(len(picked))
    return metrics
