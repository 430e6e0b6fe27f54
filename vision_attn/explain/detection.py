"""Maps per detected object (where each kept query looked in the image) and their measures.

Overlays: :func:`write_detection_overlays`, of the seeded sample and the split's worst images
(:func:`~vision_attn.explain.evaluate.overlay_images`, ranked by the task); each explained image's report item
carries its **missed** and **false** detections (:func:`detection_errors`: the evaluation's
detections scoring at least ``--explain.score_threshold``, matched by :func:`match_detections` at
IoU 0.5; a missed object is a non-crowd ground-truth box no such detection matched, a false
detection one that matched no box — nothing there, a box already taken, or an object of another
class), and the detection task ranks the images by :func:`rank_detection_errors` for the
mistakes gallery.
Measures at evaluation
(:func:`detection_explain_metrics`, called by ``DetectionTask.explain_eval``) over the images
of :func:`~vision_attn.explain.evaluate.select_images` (``--explain.faithfulness_images`` /
``faithfulness_selection`` / ``seed``), for every method of :func:`decoder_methods` and
``random`` (uniform noise on the patch grid), each *item* being one kept detection (score at
least ``--explain.score_threshold``, at most ``max_objects`` per image, best first; the numbers
accumulated by :mod:`vision_attn.explain.measures`):

- **localisation** (``pointing_<method>``, ``energy_<method>``): each detection is matched to
  a ground-truth box (``dataset.scoring_target``, original pixels) by
  :func:`match_detections` — greedy in score order, as COCOeval at IoU 0.5: a detection takes
  the unmatched non-crowd box of its class with the highest IoU, if that IoU is at least 0.5.
  The matched detections are scored with
  :func:`~vision_attn.explain.localisation.localisation` on their map in original image pixels
  (:func:`~vision_attn.explain.localisation.grid_to_image` through
  ``task.inference_data_config()``) against their matched box; unmatched ones are not scored
  (their number is logged). No key when no detection matched.
- **faithfulness** (``--explain.faithfulness``; ``deletion_auc_<method>``,
  ``insertion_auc_<method>``, and ``deletion_auc`` / ``insertion_auc`` of the first method):
  the detection's score — the same query's probability of its label (softmax over classes and
  "no object", or the focal head's sigmoid), as post-processing scored it — as patches are
  deleted / inserted (:func:`~vision_attn.explain.faithfulness.deletion_insertion_curve`, one
  row per detection), averaged over all kept detections.
- **sanity** (``--explain.sanity``; ``sanity_<method>`` and ``OUT/sanity.json``): the mean
  Spearman correlation between each detection's map from the trained model and from the model
  randomised from the output down (:func:`~vision_attn.explain.sanity.model_cascade`: the
  decoder first, then the encoder from the top block), with the trained model's detections
  (query, label); ``sanity_<method>`` is the fully randomised step ``all``.
- **maps** (``--explain.save_maps``): ``OUT/maps/<method>/<NNNNN>_<k>.npy``, float32 ``[H, W]``
  in original image pixels (uncovered pixels 0), ``NNNNN`` the image's index in the split (as
  the overlays name it), ``k`` the detection's rank among the image's kept detections (0 =
  best); ``OUT/maps/index.json``: ``[{"index", "detection" (k), "file" (image path relative to
  the data root), "image_id" (as in predictions.json), "query", "label" (class name),
  "category_id", "score", "box" ([x0, y0, x1, y1] pixels), "truth" (the matched ground-truth
  box [x0, y0, x1, y1], or null)}]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vision_attn.explain.decoder_relevance import detection_relevance
from vision_attn.explain.detection_errors import (  # noqa: F401 (re-exported)
    detection_errors,
    error_keywords,
    match_detections,
    rank_detection_errors,
    split_detection_errors,
)
from vision_attn.explain.evaluate import overlay_images, select_images, worst_images
from vision_attn.explain.faithfulness import (
    MODES,
    curve_ends,
    deletion_insertion_curve,
    end_probabilities,
    on_patch_grid,
)
from vision_attn.explain.images import enlarge
from vision_attn.explain.localisation import grid_to_image
from vision_attn.explain.lrp import lrp_unsupported
from vision_attn.explain.lrp_decoder import detection_lrp, gate_by_attention, positive_maps
from vision_attn.explain.measures import Localisation, MapWriter, Measures, Perturbation, Sanity
from vision_attn.explain.overlay import (
    Normalize,
    attach_colour_bar,
    draw_box,
    image_grid,
    overlay_saliency,
    save_png,
    scale_maps,
)
from vision_attn.explain.progress import Progress
from vision_attn.explain.records import Explained, Report, png_data_uri, quantise
from vision_attn.explain.rollout import normalize_maps
from vision_attn.explain.sanity import StandIn, model_cascade, spearman
from vision_attn.outputs import safe_filename

__all__ = [
    "DECODER_METHODS",
    "DETECTION_DEFAULTS",
    "DETECTION_RULE",
    "StandIn",
    "decoder_methods",
    "detection_explain_metrics",
    "detection_figure",
    "detection_maps",
    "detection_probabilities",
    "explain_detection",
    "detection_errors",
    "error_keywords",
    "match_detections",
    "query_attention_maps",
    "rank_detection_errors",
    "split_detection_errors",
    "write_detection_overlays",
]

log = logging.getLogger(__name__)


def query_attention_maps(cross_attn: list[torch.Tensor], queries: torch.Tensor, grid: tuple[int, int],
                         layers: str = "last") -> torch.Tensor:
    """Maps ``[K, h, w]`` of the decoder cross-attention of ``queries`` (one image).

    Args:
        cross_attn: per decoder layer ``[1, heads, Q, h * w]``.
        queries: ``[K]`` query indices (e.g. ``post_process(...)["queries"]``).
        grid: the patch grid.
        layers: ``last`` (the last layer, heads averaged) or ``mean`` (all layers averaged).
    """
    stack = cross_attn[-1:] if layers == "last" else cross_attn
    fused = torch.stack([a[0].float().mean(0) for a in stack]).mean(0)  # (Q, N)
    return normalize_maps(fused[queries].reshape(-1, *grid))


DECODER_METHODS = ("attention", "relevance", "lrp", "lrp_attention")
"""Maps of the decoder heads (detection, captioning): ``attention`` = the raw cross-attention of
the explained query / word; ``relevance`` = Chefer et al. 2021b through decoder and encoder
(:mod:`vision_attn.explain.decoder_relevance`), over image patches; ``lrp`` = AttnLRP through
decoder and encoder, the positive part of the pixels' relevance over cells finer than the
patches (:mod:`vision_attn.explain.lrp_decoder`); ``lrp_attention`` = ``lrp`` gated by
``attention`` (their product, :func:`~vision_attn.explain.lrp_decoder.gate_by_attention`): the
relevant pixels among those the query / word reads."""


DETECTION_DEFAULTS: tuple[str, ...] = ("lrp_attention", "attention")
"""The detection head's methods, first = the default, when ``--explain.methods`` is not given.
Measured in docs/results/explanations.md (100 images): on stroke scenes the detector was not
tuned on, AttnLRP through the decoder gated by the detection's cross-attention points at the
detected object 0.987 of the time (raw cross-attention 0.987, AttnLRP alone 0.987) with 0.843 of
its mass in the object's box (0.541, 0.653), the best mask IoU (0.613 against 0.499, 0.547) and
deletion; on the demo scenes 0.969 (0.888, 0.964), energy 0.828 (0.441, 0.579). A model whose
attention AttnLRP has no rule for falls back to ``relevance``
(:func:`~vision_attn.explain.lrp.lrp_unsupported`). The captioning head's are
:data:`~vision_attn.explain.captioning.CAPTION_DEFAULTS`."""


DETECTION_RULE = "decoder"
"""The detection head's relevance rule (:data:`~vision_attn.explain.decoder_relevance.RELEVANCE_RULES`)
unless ``--explain.decoder_rule`` says otherwise; the captioning head's is
:data:`~vision_attn.explain.captioning.CAPTION_RULE`. Measured in docs/results/explanations.md: on
the demo scenes and on stroke scenes the model was not tuned on, leaving the encoder's part out
keeps more of the map on the object (energy +0.15 and +0.10, mIoU +0.03 both) at about the same
pointing (-0.005, -0.018)."""


GRADIENT_METHODS = ("relevance", "lrp", "lrp_attention")
"""The decoder methods that need a backward pass per explained item (not the recorded attention)."""


def relevance_rule(options, default: str = DETECTION_RULE) -> str:
    """``options.decoder_rule``, or the head's ``default`` when it is not set."""
    return getattr(options, "decoder_rule", None) or default


def decoder_methods(options, defaults: Sequence[str] = DETECTION_DEFAULTS, model=None) -> list[str]:
    """The decoder-head methods among ``options.methods`` in their order (``attention`` when none
    is); the head's ``defaults`` when the methods were not given (``lrp`` and ``lrp_attention``
    replaced by ``relevance`` when ``model`` has attention AttnLRP has no rule for)."""
    if getattr(options, "methods_default", False):
        methods = list(defaults)
        lrp = [m for m in methods if m in ("lrp", "lrp_attention")]
        if lrp and model is not None and lrp_unsupported(model) is not None:
            log.info("explanations: %s; the default method is relevance instead of %s", lrp_unsupported(model),
                     " and ".join(lrp))
            methods = list(dict.fromkeys("relevance" if m in lrp else m for m in methods))
        return methods
    return [m for m in options.methods if m in DECODER_METHODS] or ["attention"]


def explain_detection(task, images: torch.Tensor, pictures: list[np.ndarray], options, truths=None,
                      max_objects: int = 6) -> list:
    """:meth:`~vision_attn.tasks.VisionTask.explain_batch` of a detector: per image the record
    ``{"detections": [...]}`` (objects scoring at least ``options.score_threshold``), the panel
    (:func:`detection_figure`: the picture with every kept box, then per object, at most
    ``max_objects``, one tile per method of :func:`decoder_methods` with its map, box, label and
    score, on ``options.normalize``'s colour scale, and a colour bar) and its report item
    (the first method's maps); ``extras["maps"]`` holds ``{method: [K, h, w]}`` and
    ``extras["detections"]`` the kept ``(query, label, box, score)``."""
    sizes = [tuple(p.shape[:2]) for p in pictures]
    with torch.no_grad():
        enc = task.encoder(images)
        out = task.head(enc, need_weights=True)
    dets = task.detect(out, torch.tensor(sizes))
    records = task.predictions_from_outputs((out["pred_logits"], out["pred_boxes"]), sizes, options)
    names = task.class_names or []
    keeps = [(d["scores"] >= options.score_threshold).nonzero().flatten()[:max_objects] for d in dets]
    methods = decoder_methods(options, model=task)
    gradient_maps = detection_maps(task, images, [d["queries"][k] for d, k in zip(dets, keeps, strict=True)],
                                   [d["labels"][k] for d, k in zip(dets, keeps, strict=True)],
                                   [m for m in methods if m in GRADIENT_METHODS], options.query_layers,
                                   rule=relevance_rule(options), cross_attn=out["cross_attn"])
    explained = []
    for j, (picture, det, record, keep) in enumerate(zip(pictures, dets, records, keeps, strict=True)):
        rgb = enlarge(picture, 160)
        scale = rgb.shape[1] / float(picture.shape[1])
        maps = {m: gradient_maps[m][j] if m in gradient_maps else
                query_attention_maps([a[j : j + 1] for a in out["cross_attn"]], det["queries"][keep].cpu(), enc.grid,
                                     options.query_layers) for m in methods}
        objects = [(f"query {int(det['queries'][k])}", f"{names[int(det['labels'][k])]} {float(det['scores'][k]):.2f}",
                    (det["boxes"][k] * scale).tolist()) for k in keep.tolist()]
        labels = [label for _, label, _ in objects]
        panel = detection_figure(rgb, objects, maps, options.alpha, getattr(options, "normalize", "shared"))
        h0, w0 = sizes[j]
        frac = torch.tensor([w0, h0, w0, h0], dtype=torch.float32)
        text = ", ".join(f"query {int(det['queries'][k])}" for k in keep.tolist()) or "no detection above the threshold"
        if truths is not None:
            text = f"{truths[j]}: {text}"
        first, item = maps[methods[0]], None
        if options.report:  # report.html's entry (an encoded panel): only when a report is written
            item = {"text": text, "image": Report.display_image(rgb), "panels": [png_data_uri(panel)], "kind": "boxes",
                    "grid": list(first.shape[-2:]), "maps": quantise(first.flatten(1)) if len(keep) else "",
                    "boxes": [(det["boxes"][k].float() / frac).tolist() for k in keep.tolist()], "labels": labels}
        kept = [(int(det["queries"][k]), int(det["labels"][k]), det["boxes"][k].tolist(), float(det["scores"][k]))
                for k in keep.tolist()]
        explained.append(Explained(record, panel, item, {"maps": maps, "detections": kept}))
    return explained


def detection_figure(rgb: np.ndarray, objects: Sequence[tuple[str, str, Sequence[float]]],
                     maps: Mapping[str, torch.Tensor | np.ndarray], alpha: float = 0.5,
                     normalize: Normalize = "shared") -> np.ndarray:
    """One image's detections and their maps: the picture with every box, then per object one
    tile per method (its map, box and label), and a colour bar (uint8 RGB).

    Args:
        rgb: the picture, uint8 RGB ``[H, W, 3]``.
        objects: per object ``(title, label, box)``: e.g. ``("query 7", "cat 0.91", [x0, y0, x1,
            y1])``, the box in ``rgb``'s pixels.
        maps: per method ``[K, h, w]``, one map per object over the patch grid (any scale).
        alpha: heat-map opacity.
        normalize: ``shared`` (one colour scale for every tile of the figure: a weak map stays
            weak) or ``per_map`` (each map to its own maximum;
            :func:`~vision_attn.explain.overlay.scale_maps`).
    """
    methods = list(maps)
    flat = [maps[m][i] for i in range(len(objects)) for m in methods]
    scaled, peaks = scale_maps(flat, normalize)
    boxed, tiles, titles = rgb, [], []
    for i, (title, label, box) in enumerate(objects):
        boxed = draw_box(boxed, box, label=label)
        for k, method in enumerate(methods):
            tiles.append(draw_box(overlay_saliency(rgb, scaled[i * len(methods) + k], alpha=alpha), box, label=label))
            titles.append(title + (f" {method}" if len(methods) > 1 else ""))
    panel = _detection_panel(boxed, tiles, titles, len(methods))
    top = peaks[0] if normalize == "shared" and peaks and peaks[0] > 0 else None
    return attach_colour_bar(panel, top)


def _detection_panel(boxed: np.ndarray, tiles: list[np.ndarray], titles: list[str], n_methods: int,
                     per_row: int = 4) -> np.ndarray:
    """The picture with every kept box, then the objects' tiles (``n_methods`` per object), at
    most ``per_row`` tiles of whole objects in a row: one row while they fit, else rows under
    the first (a blank cell under the picture), so an image with many objects stays readable
    at a page's width rather than one long strip."""
    width = max(1, per_row // max(1, n_methods)) * max(1, n_methods)  # tiles per row: whole objects
    if len(tiles) <= width:
        return image_grid([boxed, *tiles], ["detections", *titles])
    blank = np.full_like(boxed, 255)
    cells, names = [], []
    for start in range(0, len(tiles), width):
        cells += [boxed if start == 0 else blank, *tiles[start : start + width]]
        names += ["detections" if start == 0 else "", *titles[start : start + width]]
    return image_grid(cells, names, cols=1 + width)


def write_detection_overlays(task, dataset, options, out_dir: Path, report=None, max_objects: int = 6) -> int:
    """Overlays (:func:`explain_detection`) of ``options.num_overlays`` images chosen by
    ``options.overlay_selection`` (:func:`~vision_attn.explain.evaluate.select_images`) and of the
    ``options.mistakes`` images with the most missed and false detections in the evaluation's
    predictions (``options.predictions``; :func:`~vision_attn.explain.evaluate.worst_images`, the
    task's ranking).

    Each report item carries ``missed`` and ``false`` (:func:`detection_errors`) of the
    evaluation's detections (``options.predictions``), else of the detections drawn, and
    ``missed_boxes`` (the missed objects' boxes as xyxy fractions, drawn dashed red in the
    interactive view). Pictures
    come from ``dataset.read_rgb`` — the same read (orientation included, see
    :mod:`vision_attn.data.detection` on EXIF) as the model input and the boxes."""
    keywords = error_keywords(task, dataset, options)
    chosen = overlay_images(dataset, options, worst_images(task, dataset, options))
    predictions = getattr(options, "predictions", None)  # the evaluation's (eval.py), else none
    errors = split_detection_errors(dataset, predictions, **keywords) if predictions else {}
    names = keywords["class_names"] or []
    scored = hasattr(dataset, "scoring_target")
    device = next(task.parameters()).device
    written = 0
    progress = Progress("detection overlays", len(chosen), "image")
    for start in range(0, len(chosen), options.batch_size):
        idx = chosen[start : start + options.batch_size]
        images = torch.stack([dataset[i][0] for i in idx]).to(device)
        pictures = [dataset.read_rgb(i) for i in idx]
        explained = explain_detection(task, images, pictures, options, max_objects=max_objects)
        for i, picture, e in zip(idx, pictures, explained, strict=True):
            image_id = dataset.images[i]["id"]
            save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{image_id}.png"), e.panel, root=out_dir)
            if report is not None and e.report_item is not None:
                item = {"name": f"image id {image_id}", **e.report_item}
                found = errors.get(i)
                if found is None and scored and not predictions:  # no evaluation: the detections drawn
                    kept = e.extras["detections"]
                    found = detection_errors(
                        torch.tensor([d[2] for d in kept], dtype=torch.float32).reshape(-1, 4),
                        torch.tensor([d[3] for d in kept], dtype=torch.float32),
                        torch.tensor([d[1] for d in kept], dtype=torch.int64), dataset.scoring_target(image_id),
                        names, options.score_threshold)
                if found is not None:
                    h, w = picture.shape[:2]  # the interactive view draws the missed objects (xyxy fractions)
                    item.update(found, missed_boxes=[[m["box"][0] / w, m["box"][1] / h, m["box"][2] / w,
                                                      m["box"][3] / h] for m in found["missed"]])
                elif predictions and scored:  # evaluated, nothing wrong
                    item.update({"missed": [], "false": []})
                report.items.append(item)
            written += 1
        progress.update(len(idx))
    progress.close()
    log.info("wrote %d detection overlays to %s", written, out_dir / "overlays")
    return written


# ---------------------------------------------------------------------------- measures at evaluation
def detection_probabilities(model) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """``(proba, width)``: ``proba(images)`` is ``[n, Q * width]``, every query's class
    probabilities flattened (softmax over the ``C`` classes and "no object", ``width = C + 1``;
    a focal head's sigmoid, ``width = C``), so detection ``(query q, label c)`` is column
    ``q * width + c`` and its value the score post-processing gave it."""
    focal = bool(getattr(model.head, "focal", False))
    width = int(model.head.num_classes) + (0 if focal else 1)

    def proba(images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model.head(model.encoder(images))["pred_logits"].float()  # (n, Q, width)
        return (logits.sigmoid() if focal else logits.softmax(-1)).flatten(1)  # (n, Q * width)

    return proba, width


def detection_maps(model, images: torch.Tensor, queries: list[torch.Tensor], labels: list[torch.Tensor],
                   methods: list[str], query_layers: str = "last", seed: int = 0,
                   rule: str = DETECTION_RULE, cross_attn: list[torch.Tensor] | None = None
                   ) -> dict[str, list[torch.Tensor]]:
    """``{method: per image [K_b, h, w]}`` maps (CPU, float32) of the given detections.

    Args:
        model: anything with a detection ``encoder`` and DETR ``head`` (a task, or a stand-in
            with randomised weights).
        images: ``[B, 3, H, W]`` model inputs.
        queries: per image ``[K_b]`` query indices.
        labels: per image ``[K_b]`` classes.
        methods: among :data:`DECODER_METHODS` and ``random``.
        query_layers: of ``attention`` and ``lrp_attention`` (see :func:`query_attention_maps`).
        seed: of ``random`` (the same seed gives the same noise whatever the model).
        rule: of ``relevance`` (:data:`~vision_attn.explain.decoder_relevance.RELEVANCE_RULES`).
        cross_attn: the head's ``cross_attn`` output for ``images`` when the caller has it (no
            second forward pass for ``attention`` / ``lrp_attention``).
    """
    grid = model.encoder.grid_for(*images.shape[-2:])
    out: dict[str, list[torch.Tensor]] = {}
    if {"attention", "lrp_attention"} & set(methods):
        attn = cross_attn
        if attn is None:
            with torch.no_grad():
                attn = model.head(model.encoder(images), need_weights=True)["cross_attn"]
        out["attention"] = [query_attention_maps([a[j : j + 1] for a in attn], q.cpu(), grid, query_layers).cpu()
                            if len(q) else torch.zeros(0, *grid) for j, q in enumerate(queries)]
    if "relevance" in methods:
        out["relevance"] = [m.cpu() for m in detection_relevance(model, images, queries, labels, rule=rule)]
    if {"lrp", "lrp_attention"} & set(methods):
        out["lrp"] = positive_maps(detection_lrp(model, images, queries, labels))
    if "lrp_attention" in methods:
        out["lrp_attention"] = [gate_by_attention(r, a) for r, a in zip(out["lrp"], out["attention"], strict=True)]
    if "random" in methods:
        gen = torch.Generator().manual_seed(seed)
        out["random"] = [torch.rand(len(q), *grid, generator=gen) for q in queries]
    return {m: out[m] for m in methods}


@dataclass
class _Detected:
    """One batch's kept detections: per image at most ``max_objects`` scoring at least the
    threshold, best first (``capped``: those left out beyond them)."""

    idx: list[int]
    images: torch.Tensor
    sizes: list[tuple[int, int]]
    dets: list[dict[str, torch.Tensor]]
    keeps: list[torch.Tensor]
    capped: int

    def __post_init__(self) -> None:
        self.queries = [d["queries"][k] for d, k in zip(self.dets, self.keeps, strict=True)]
        self.labels = [d["labels"][k] for d, k in zip(self.dets, self.keeps, strict=True)]
        self.count = sum(len(q) for q in self.queries)


def _detect(task, dataset, idx: list[int], score_threshold: float, max_objects: int) -> _Detected:
    """Detect on the images ``idx`` of ``dataset`` and keep the best ones per image."""
    device = next(task.parameters()).device
    items = [dataset[i] for i in idx]
    images = torch.stack([it[0] for it in items]).to(device)
    sizes = [(int(it[1]["orig_size"][0]), int(it[1]["orig_size"][1])) for it in items]
    with torch.no_grad():
        dets = task.detect(task(images), torch.tensor(sizes))
    keeps = [(d["scores"] >= score_threshold).nonzero().flatten() for d in dets]
    capped = sum(max(0, len(k) - max_objects) for k in keeps)
    return _Detected(idx, images, sizes, dets, [k[:max_objects] for k in keeps], capped)


def _localise_detections(task, dataset, batch: _Detected, maps: dict[str, list[torch.Tensor]],
                         measures: Measures) -> None:
    """Match each kept detection to a ground-truth box and update the localisation (matched
    detections only; against the matched object's mask too when the data has masks) and the
    saved maps with its maps in original image pixels."""
    pre = task.inference_data_config()
    names = task.class_names or []
    for j, i in enumerate(batch.idx):
        image_id = dataset.images[i]["id"]
        truth = dataset.scoring_target(image_id)
        det, keep, labels = batch.dets[j], batch.keeps[j], batch.labels[j]
        match = match_detections(det["boxes"][keep], labels, truth["boxes"], truth["labels"], truth["iscrowd"])
        masks = dataset.scoring_masks(image_id) if hasattr(dataset, "scoring_masks") else []
        for k, g in enumerate(match):
            own = truth["boxes"][g].tolist() if g >= 0 else None
            if own is None and measures.maps is None:
                continue
            image_maps = {m: grid_to_image(maps[m][j][k], batch.sizes[j], pre) for m in maps}  # (H, W) each
            if measures.maps is not None:
                c = int(labels[k])
                measures.maps.update(image_maps, {
                    "index": i, "detection": k, "file": dataset.relative_file(i), "image_id": image_id,
                    "query": int(batch.queries[j][k]), "label": names[c] if c < len(names) else str(c),
                    "category_id": int(task.category_ids[c]) if task.category_ids else c,
                    "score": float(det["scores"][keep[k]]), "box": [float(v) for v in det["boxes"][keep[k]].tolist()],
                    "truth": own}, f"{i:05d}_{k}")
            mask = masks[g] if own is not None and g < len(masks) and masks[g] is not None else None
            pixels = [mask.decode(batch.sizes[j])] if mask is not None else []
            measures.localisation.update(image_maps, [own] if own is not None else [], pixels)


def _detection_curves(task, batch: _Detected, maps: dict[str, list[torch.Tensor]],
                      steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """``{method: {mode: [R, steps + 1]}}``: each kept detection's score (its query's
    probability of its label) as its map's patches are deleted or inserted."""
    proba, width = detection_probabilities(task)
    images, device = batch.images, batch.images.device
    rows = torch.tensor([j for j, q in enumerate(batch.queries) for _ in range(len(q))], dtype=torch.long,
                        device=device)
    target = torch.cat([q.cpu() * width + c.cpu() for q, c in zip(batch.queries, batch.labels, strict=True)])
    target = target.to(device)
    shared = end_probabilities(proba, images)  # every curve's first and last point, once per image
    grid = task.encoder.grid_for(*images.shape[-2:])
    out = {}
    for m, per_image in maps.items():
        sal = on_patch_grid(torch.cat(per_image), grid).to(device)  # (R, h, w): one row per detection
        out[m] = {mode: deletion_insertion_curve(proba, images[rows], sal, target, mode, steps,
                                                 ends=curve_ends(shared, rows, target, mode)) for mode in MODES}
    return out


def _detection_sanity(task, batch: _Detected, maps: dict[str, list[torch.Tensor]], options,
                      seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """``{method: {step: [R]}}``: the Spearman correlation of each kept detection's maps with
    its maps from the model randomised from the output down (decoder, then encoder)."""
    methods = list(maps)
    trained = {m: torch.cat(v).flatten(1) for m, v in maps.items()}  # (R, h * w)
    out: dict[str, dict[str, torch.Tensor]] = {m: {} for m in methods}
    for step, encoder, head in model_cascade(task.encoder, task.head, seed=options.seed,
                                               cascade=options.sanity_cascade):
        randomised = detection_maps(StandIn(encoder, head), batch.images, batch.queries, batch.labels, methods,
                                    options.query_layers, seed, relevance_rule(options))
        for m in methods:
            out[m][step] = spearman(trained[m], torch.cat(randomised[m]).flatten(1))
    return out


def detection_explain_metrics(task, dataset, options, out_dir: Path, max_objects: int = 20) -> dict[str, float]:
    """Localisation, faithfulness and sanity numbers of the detection maps, and the saved maps
    (see the module docstring).

    Args:
        task: a :class:`~vision_attn.tasks.DetectionTask` in eval mode.
        dataset: a :class:`~vision_attn.data.detection.CocoDetection` with the evaluation
            transform (items ``(image, target)`` with ``target["orig_size"]``).
        options: an :class:`~vision_attn.explain.evaluate.ExplainOptions`.
        out_dir: the evaluation output folder.
        max_objects: most detections measured per image (the best ones).
    """
    picked = select_images(len(dataset), options.faithfulness_images, options.faithfulness_selection, options.seed)
    if not picked:
        return {}
    methods = list(dict.fromkeys([*decoder_methods(options, model=task), "random"]))
    # the items (detections) are known only once detected: one report over the images, with their total
    progress = Progress("explanation measures: detections", len(picked), "image")
    measures = Measures(localisation=Localisation(progress=False),
                        perturbation=Perturbation(first=methods[0], progress=False), sanity=Sanity(progress=False),
                        maps=MapWriter(out_dir, "detections") if options.save_maps else None)
    measured = capped = 0
    for start in range(0, len(picked), options.batch_size):
        batch = _detect(task, dataset, picked[start : start + options.batch_size], options.score_threshold,
                        max_objects)
        measured, capped = measured + batch.count, capped + batch.capped
        seed = options.seed + start
        maps = detection_maps(task, batch.images, batch.queries, batch.labels, methods, options.query_layers, seed,
                              relevance_rule(options))
        _localise_detections(task, dataset, batch, maps, measures)
        if options.faithfulness and batch.count:
            measures.perturbation.update(_detection_curves(task, batch, maps, options.steps))
        if options.sanity and batch.count:
            measures.sanity.update(_detection_sanity(task, batch, maps, options, seed))
        progress.update(len(batch.idx))
    progress.close()
    if capped:
        log.info("explanation measures: %d detections above the threshold beyond the best %d per image were left out",
                 capped, max_objects)
    log.info("explanation measures: %d detections on %d images, %d matched to a ground-truth box",
             measured, len(picked), measures.localisation.count)
    metrics: dict[str, float] = {}
    if measures.maps is not None:
        metrics.update(measures.maps.compute())
    if measured == 0:
        log.warning("explanation measures: no detection scored at least %s on the %d images measured; no "
                    "localisation, faithfulness or sanity numbers", options.score_threshold, len(picked))
        return metrics
    if not measures.localisation.count:
        log.warning("localisation: none of the %d detections matches a ground-truth box of its class (IoU >= 0.5); "
                    "no pointing / energy numbers", measured)
    metrics.update(measures.localisation.compute())
    metrics.update(measures.perturbation.compute())
    measures.sanity.write(out_dir)
    metrics.update(measures.sanity.compute())
    return dict(sorted(metrics.items()))
