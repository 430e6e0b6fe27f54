"""Explanations at evaluation time: overlays, faithfulness, localisation and sanity numbers.

Which images: :func:`select_images`. The overlays (and ``report.html``'s explained images) are
that seeded sample **and** the evaluation's ``--explain.mistakes`` worst mistakes as the task
ranks them (:func:`worst_images`, :meth:`~vision_attn.tasks.VisionTask.rank_mistakes`: e.g. the
most confident wrong predictions, the images with the most missed and false detections, the
lowest-CIDEr captions), so the report's mistakes gallery shows each of them with its overlays
wherever it lies in the split (:func:`overlay_images`; the mean deletion curves of the report
stay those of the sample). :func:`write_overlays` draws them for any task through its
:meth:`~vision_attn.tasks.VisionTask.explain_batch` (the default
:meth:`~vision_attn.tasks.VisionTask.explain_eval`). By default the faithfulness numbers
come from a seeded random sample spread over the whole split (one image drawn from each of
``N`` equal consecutive strata), so a class-sorted split (ImageFolder) is covered class by
class rather than through its first classes only; ``metrics.json`` reports how many images
(``explain_images``) and classes (``explain_classes``) that sample covered. The localisation
and sanity numbers and the saved maps use the same images.

**Localisation** (when boxes are known: ``--explain.annotations FILE``, or the embedded shapes
data's own boxes): ``pointing_<method>`` and ``energy_<method>`` for every method asked for and
``random`` (:mod:`vision_attn.explain.localisation`), over the explained images that have a
box of their labelled class. Class-specific methods explain the *labelled* class here (not the
prediction, nor ``--explain.target_class``): the boxes are those of that class.

**Sanity** (``--explain.sanity true``): ``sanity_<method>``, the mean Spearman correlation
between the maps of the trained model and of its fully randomised copy
(:mod:`vision_attn.explain.sanity`; labelled class), and ``OUT/sanity.json`` with the curve
over the cascade (the head first, then the encoder's top block down).

**Maps** (``--explain.save_maps true``): the localisation maps (labelled class, original image
pixels) as ``OUT/maps/<method>/<NNNNN>.npy`` (float32 ``[H, W]``, ``NNNNN`` the image's index
in the split, as the overlays name it) and ``OUT/maps/index.json``
(``[{"index", "file", "label"}]``, ``file`` as in ``predictions.json``).

The numbers are accumulated, averaged and named by the measures of
:mod:`vision_attn.explain.measures`, as for the other heads; this module produces the maps and
what they are measured against.

Used by ``eval.py`` (options under ``--explain.*``) and by the folder command
``python -m vision_attn.overlay``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from vision_attn.data.imageio import DEFAULT_MAX_PIXELS, read_image
from vision_attn.data.synthetic import manifest_annotations
from vision_attn.data.transforms import build_display_transform
from vision_attn.errors import ConfigError, DataError
from vision_attn.explain.faithfulness import (
    MODES,
    curve_ends,
    deletion_insertion_curve,
    end_probabilities,
)
from vision_attn.explain.images import dataset_picture
from vision_attn.explain.localisation import grid_to_image, load_image_objects
from vision_attn.explain.measures import ItemScores, Localisation, MapWriter, Measures, Perturbation, Sanity
from vision_attn.explain.methods import (
    TOKENS,
    Token,
    check_methods,
    explain_classifier,
    faithful_methods,
)
from vision_attn.explain.overlay import NORMALIZE, Normalize, explanation_figure, save_png
from vision_attn.explain.progress import Progress
from vision_attn.explain.records import Explained, Report, png_data_uri, quantise
from vision_attn.explain.road import classifier_scores
from vision_attn.explain.rollout import check_head_fusion
from vision_attn.explain.sanity import sanity_check
from vision_attn.explain.targets import register_shares
from vision_attn.outputs import safe_filename

__all__ = ["DEFAULT_MISTAKES", "ExplainOptions", "Selection", "attention_report_item", "explain_eval_split",
           "explanation_panel",
           "overlay_images", "select_images", "worst_images", "write_overlays"]

log = logging.getLogger(__name__)

Selection = Literal["sample", "spread", "first"]


def select_images(n_total: int, n: int, selection: Selection = "sample", seed: int = 0) -> list[int]:
    """Sorted indices of the ``min(n, n_total)`` images of a split of ``n_total`` to explain.

    Args:
        n_total: images in the split.
        n: images wanted.
        selection: ``sample`` — a seeded random sample spread over the split: the indices are
            cut into ``n`` consecutive strata of (almost) equal size and one index is drawn
            from each, so every run of ``2 * ceil(n_total / n) - 1`` consecutive images (a
            class of a class-sorted split) has at least one image in it; ``spread`` — evenly
            spaced indices (first and last included); ``first`` — the first ``n``.
        seed: of ``sample``.
    """
    n = min(n, n_total)
    if n <= 0:
        return []
    if selection == "first":
        return list(range(n))
    if selection == "spread":
        return sorted({round(k * (n_total - 1) / max(1, n - 1)) for k in range(n)})
    if selection != "sample":
        raise ValueError(f"image selection must be 'sample', 'spread' or 'first', got {selection!r}")
    gen = torch.Generator().manual_seed(seed)
    bounds = [k * n_total // n for k in range(n + 1)]  # strata [bounds[k], bounds[k + 1])
    offsets = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    return [lo + min(hi - lo - 1, int(u * (hi - lo))) for lo, hi, u in zip(bounds[:-1], bounds[1:], offsets,
                                                                             strict=True)]


DEFAULT_MISTAKES = 8
"""``--explain.mistakes``' default: the worst mistakes of the split explained besides the seeded
sample (the report's mistakes gallery shows as many cards): few enough that the page stays small
and the explanation time short, enough to see a pattern."""


DEFAULT_METHODS: tuple[str, ...] = ("relevance", "rollout", "attention")
"""The classifier's methods when ``--explain.methods`` is not given, ``relevance`` first: on the
trained demo classifier it points like raw attention (0.99), puts the most mass on the object
(energy 0.79) and deletes faster than rollout and attention (docs/results/explanations.md)."""


@dataclass
class ExplainOptions:
    """What ``eval.py`` explains (``--explain.*``) and the folder commands draw.

    ``score_threshold``, ``target_class``, ``token`` and ``topk`` (:attr:`task_fields`) are what the
    explanation functions read of a task's own inference options: the commands take them from the
    task's option group (:attr:`~vision_attn.tasks.VisionTask.inference_options`, e.g.
    ``--explain.topk`` of a classifier) and the task fills them in
    (:meth:`~vision_attn.tasks.VisionTask.explain_options`); they are not ``--explain`` options of
    every task.

    Args:
        methods: explanation methods drawn side by side, names of the registry
            :data:`vision_attn.explain.methods.METHODS`: ``rollout``, ``relevance``
            (gradient-weighted, class specific), ``attention`` (raw last layer), ``gradcam``
            (Grad-CAM on the last block's patch tokens), ``tokens`` (diagnostic: patch-token
            norms, no faithfulness numbers), ``random`` (the baseline), and any method
            registered with :func:`~vision_attn.explain.methods.register_method`. The first
            method with faithfulness numbers is reported as ``deletion_auc`` /
            ``insertion_auc`` (default ``relevance``, chosen from the measured table); the
            ``random`` baseline is always measured too.
        num_overlays: overlays written for N images of the split (0 = none).
        mistakes: overlays written also for the split's ``K`` worst mistakes, wherever they lie
            (0 = the sample only; :func:`worst_images`; default :data:`DEFAULT_MISTAKES`):
            the most confident wrong predictions (classification), the images with the most
            missed and false detections (detection), the lowest-CIDEr captions (captioning).
            They need the evaluation's predictions (:attr:`predictions`, set by ``eval.py``).
        overlay_selection: which images, for every task: ``sample`` (default; the seeded
            random sample spread over the split that the faithfulness numbers use, so every
            class shows up in a class-sorted folder), ``spread`` (evenly spaced) or ``first``
            (the first N; see :func:`select_images`).
        faithfulness: compute deletion / insertion AUC for each method and a random baseline,
            and (classification) SaCo's faithfulness coefficient ``saco_<method>``
            (:func:`~vision_attn.explain.road.saco`).
        road: classification: also ROAD (remove and debias: the removed patches imputed from
            their neighbours, most and least relevant first; ``road_<method>``,
            ``road_morf_<method>``, ``road_lerf_<method>``; :mod:`vision_attn.explain.road`).
            A sparse solve per perturbed image: cheap at small image sizes, slow at 224 px.
        faithfulness_images: at most this many images for the faithfulness numbers (and the
            pointing game of captioning).
        faithfulness_selection: which images: ``sample`` (default; a seeded random sample
            spread over the split), ``spread`` or ``first`` (see :func:`select_images`).
        seed: of the ``sample`` selections.
        steps: points of the deletion / insertion curves.
        head_fusion: how rollout and raw attention fuse the heads (``mean``, ``max``, ``min``), or
            ``head<K>``: head ``K`` alone (``head0``, ``head1``, ...).
        discard_ratio: rollout's discard ratio.
        alpha: heat-map opacity of the overlays.
        normalize: overlays: one colour scale for every panel of a figure (shared) or each map
            scaled to its own maximum (per_map).
        batch_size: images per explanation batch.
        score_threshold: detection: objects drawn need at least this score.
        query_layers: detection: cross-attention of the ``last`` decoder layer, or the
            ``mean`` over all layers (heads are averaged in both).
        decoder_rule: detection and captioning: how ``relevance`` is carried through the model
            (:data:`~vision_attn.explain.decoder_relevance.RELEVANCE_RULES`: ``full``, ``decoder``,
            ``decoder_last``); unset: each head's measured default.
        report: also write ``report.html`` (self-contained, interactive) with the overlays.
        target_class: classification: explain this class (a class name, or an index) instead
            of the prediction; the faithfulness numbers then follow its probability.
        token: classification: the token row explained: ``auto`` (what the head reads), or
            for a distilled DeiT ``cls`` (class token), ``dist`` (distillation token), ``mean``
            (their average).
        topk: classification: the ``topk`` best classes listed per image in predictions.
        annotations: a COCO instances file with the boxes of the evaluated images, for the
            localisation numbers (``pointing_<method>``, ``energy_<method>``): its
            ``file_name``s are the image paths relative to the data root, as in
            ``predictions.json`` (``val/cat/1.png``); the category names are the class names.
            Unset: the embedded shapes data's own boxes (``ROOT/annotations/instances_<split>
            .json``, named in its ``manifest.json``) when evaluating on it, else no
            localisation numbers.
        save_maps: write the maps of the localisation numbers in original image pixels to
            ``OUT/maps/<method>/<NNNNN>.npy`` with ``OUT/maps/index.json``.
        sanity: the model-randomisation sanity check (Adebayo et al. 2018): ``sanity_<method>``
            and ``OUT/sanity.json``.
        sanity_cascade: measure every step of the sanity check's cascade (``OUT/sanity.json``'s curves);
            ``false``: the fully randomised model only (``sanity_<method>``; one map pass, not one per block).
        content_words: captioning: a text file of the object words whose presence in the
            captions is checked against the references (one word per line); unset: the words
            that vary between the images' references
            (:mod:`vision_attn.metrics.reference_content`).
    """

    # None: each head's own default, chosen from the measured table (docs/results/explanations.md;
    # python -m benchmarks.explanations): DEFAULT_METHODS for the classifier, the
    # decoder heads' DETECTION_DEFAULTS / CAPTION_DEFAULTS (vision_attn.explain.detection / .captioning).
    methods: list[str] | None = None
    num_overlays: int = 16
    mistakes: int = DEFAULT_MISTAKES
    overlay_selection: Selection = "sample"
    faithfulness: bool = True
    road: bool = False
    faithfulness_images: int = 256
    faithfulness_selection: Selection = "sample"
    seed: int = 0
    steps: int = 16
    head_fusion: str = "mean"
    discard_ratio: float = 0.0
    alpha: float = 0.5
    normalize: Literal["shared", "per_map"] = "shared"
    batch_size: int = 32
    score_threshold: float = 0.3
    query_layers: Literal["last", "mean"] = "last"
    decoder_rule: Literal["full", "decoder", "decoder_last"] | None = None
    report: bool = True
    target_class: str | None = None
    token: Token = "auto"
    topk: int = 5
    annotations: str | None = None
    save_maps: bool = False
    sanity: bool = False
    sanity_cascade: bool = True
    content_words: str | None = None

    # Not an option: ``eval.py`` sets it to the evaluation's ``predictions.json`` records before
    # the explanations run, so that :func:`overlay_images` can add the worst mistakes.
    predictions: ClassVar[list[dict[str, Any]] | None] = None

    # The fields a task's inference options set (see the class docstring): no --explain option of their own.
    task_fields: ClassVar[tuple[str, ...]] = ("score_threshold", "target_class", "token", "topk")

    def __post_init__(self) -> None:
        self.methods_default = self.methods is None  # whether the heads may put their own default first
        if self.methods is None:
            self.methods = list(DEFAULT_METHODS)
        check_methods(self.methods, "explain.methods")
        if self.token not in TOKENS:
            raise ConfigError(f"explain.token {self.token!r} invalid; choose one of {', '.join(TOKENS)}")
        check_head_fusion(self.head_fusion)
        if self.normalize not in NORMALIZE:
            raise ConfigError(f"normalize {self.normalize!r} invalid; choose one of {', '.join(NORMALIZE)}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ConfigError(f"explain.topk must be an integer >= 1, got {self.topk!r}")
        if isinstance(self.mistakes, bool) or not isinstance(self.mistakes, int) or self.mistakes < 0:
            raise ConfigError(f"explain.mistakes must be an integer >= 0 (0: the seeded sample only), "
                              f"got {self.mistakes!r}")
        if self.target_class is not None:
            self.target_class = str(self.target_class)


def worst_images(task, dataset, options) -> list[int]:
    """The dataset indices of the split's ``options.mistakes`` worst mistakes in the evaluation's
    predictions (``options.predictions``), worst first, as the task ranks them
    (:meth:`~vision_attn.tasks.VisionTask.rank_mistakes`); none without predictions. Options
    without these fields (the folder commands, tests) ask for none."""
    predictions, k = getattr(options, "predictions", None), getattr(options, "mistakes", 0)
    if k <= 0 or not predictions:
        return []
    return list(task.rank_mistakes(dataset, predictions, k, options))[:k]


def overlay_images(dataset, options: ExplainOptions, worst: Sequence[int] = ()) -> list[int]:
    """Sorted dataset indices to draw overlays for: the seeded sample (:func:`select_images` with
    ``options.num_overlays``, ``overlay_selection``, ``seed``) and the ``worst`` mistakes (dataset
    indices, e.g. :func:`worst_images`)."""
    chosen = set(select_images(len(dataset), options.num_overlays, options.overlay_selection, options.seed))
    extra = [i for i in worst if i not in chosen]
    if worst:
        log.info("overlays: %d worst mistakes added to the %d sampled images (%d were in the sample)",
                 len(extra), len(chosen), len(worst) - len(extra))
    return sorted(chosen | set(worst))


def write_overlays(task, dataset, options: ExplainOptions, out_dir: Path, report: Report | None = None) -> int:
    """The overlays of a split, drawn by the task's :meth:`~vision_attn.tasks.VisionTask.explain_batch`:
    of the seeded sample and the worst mistakes (:func:`overlay_images`, :func:`worst_images`), in
    batches of ``options.batch_size``, into ``out_dir/overlays/<NNNNN>_<name>.png`` (``NNNNN`` the
    image's index in the split); their report items, named as the images, go into ``report``.
    Returns the number of overlays written.

    What it reads of ``dataset``: ``dataset[i][0]``, the model input ``[3, H, W]``;
    ``dataset.relative_file(i)``, the image's name (its path relative to ``dataset.root``); the
    picture drawn on from ``dataset.read_rgb(i)`` when the dataset has it, else from the file. The
    ground truth drawn on each panel is the task's
    :meth:`~vision_attn.tasks.VisionTask.truth_text` (none when it gives ``None``).
    """
    chosen = overlay_images(dataset, options, worst_images(task, dataset, options))
    device = next(task.parameters()).device
    written = 0
    progress = Progress("explanation overlays", len(chosen), "image")
    for start in range(0, len(chosen), options.batch_size):
        idx = chosen[start : start + options.batch_size]
        names = [str(dataset.relative_file(i)) for i in idx]
        images = torch.stack([dataset[i][0] for i in idx]).to(device)
        pictures = [dataset_picture(dataset, i) for i in idx]
        truths = [task.truth_text(dataset, i) for i in idx]
        explained = task.explain_batch(images, pictures, options, truths if None not in truths else None)
        for i, name, e in zip(idx, names, explained, strict=True):
            save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{Path(name).stem}.png"), e.panel, root=out_dir)
            written += 1
            if report is not None and e.report_item is not None:
                report.items.append({"name": name, **e.report_item})
        progress.update(len(idx))
    progress.close()
    if written:
        log.info("wrote %d overlays to %s", written, out_dir / "overlays")
    return written


def explanation_panel(
    display: np.ndarray, maps: dict[str, torch.Tensor], index: int, caption: str, alpha: float = 0.5,
    *, picture: np.ndarray | None = None, pre: dict[str, Any] | None = None, normalize: Normalize = "shared",
) -> np.ndarray:
    """One image: the input (with ``caption`` above) and one overlay per method, side by side, and
    a colour bar (:func:`~vision_attn.explain.overlay.explanation_figure`).

    Drawn on the original ``picture`` (uint8 RGB, before preprocessing) when given, at its own
    aspect ratio, each map covering the part the model saw (``pre``: the task's
    ``inference_data_config()``, the model's crop outlined); without it on ``display`` (the
    input as the model sees it). ``normalize``: one colour scale for all panels (``shared``) or
    each map to its own maximum (``per_map``).
    """
    one = {method: m[index] for method, m in maps.items()}
    if picture is None:
        return explanation_figure(display, one, None, caption, alpha, normalize)
    return explanation_figure(picture, one, pre, caption, alpha, normalize)


def attention_report_item(expl, j: int, display: np.ndarray, caption: str, panel: np.ndarray) -> dict:
    """Image ``j`` of an explained batch for report.html: every patch's attention row, per layer and head."""

    item = {"text": caption, "image": Report.display_image(display), "panels": [png_data_uri(panel)]}
    if not expl.attentions:  # only methods that need no attention (gradcam, tokens): no patch view
        return item
    if len({a.shape[-1] for a in expl.attentions}) > 1:  # a token-merged model: its blocks see fewer tokens
        return item
    p = expl.num_prefix_tokens
    rows = torch.stack([a[j, :, p:, p:] for a in expl.attentions])  # (L, H, N, N): patch -> patch
    return {**item, "kind": "patches", "grid": list(expl.grid), "layers": rows.shape[0], "heads": rows.shape[1],
            "maps": quantise(rows)}


def explain_classification(task, images: torch.Tensor, pictures: list[np.ndarray], options: ExplainOptions,
                           truths: list[str] | None = None) -> list:
    """:meth:`~vision_attn.tasks.VisionTask.explain_batch` of a classifier: per image the
    record ``{"pred", "score"}``, the panel (the original picture, the model's crop outlined,
    captioned ``pred score`` or ``truth -> pred score``, one overlay per method on
    ``options.normalize``'s colour scale, and a colour bar: :func:`explanation_panel`) and its
    report item; ``extras["explanation"]`` is the batch's :class:`~vision_attn.explain.methods.Explanation`."""

    expl = explain_classifier(task, images, options.methods, head_fusion=options.head_fusion,
                              discard_ratio=options.discard_ratio, target_class=options.target_class,
                              token=options.token)
    records = task.predictions_from_outputs((expl.logits,), [p.shape[:2] for p in pictures], options)
    names = task.class_names or []
    pre = task.inference_data_config()
    display_tf = build_display_transform(pre)  # the pixels the model saw (report.html's patch view)
    registers = register_shares(task.encoder, expl)
    out = []
    for j, (picture, record) in enumerate(zip(pictures, records, strict=True)):
        display = display_tf(picture)
        caption = f"{record['pred']} {record['score']:.2f}"
        explained = int(expl.target[j])
        if options.target_class is not None and explained < len(names) and names[explained] != record["pred"]:
            caption = f"{caption} | explains {names[explained]}"
        if truths is not None:
            caption = f"{truths[j]} -> {caption}"
        if registers is not None:  # the attention the patch maps do not show
            caption = f"{caption} | registers {float(registers[j]):.0%}"
        panel = explanation_panel(display, expl.maps, j, caption, options.alpha, picture=picture, pre=pre,
                                  normalize=options.normalize)
        item = attention_report_item(expl, j, display, caption, panel) if options.report else None  # report.html only
        out.append(Explained(record, panel, item, {"explanation": expl}))
    return out


@torch.no_grad()
def _probabilities(task, x: torch.Tensor) -> torch.Tensor:
    return task(x).float().softmax(-1)


def _class_curves(task, images: torch.Tensor, maps: dict[str, torch.Tensor], target: torch.Tensor, steps: int,
                  modes: Sequence[str] = MODES) -> dict[str, dict[str, torch.Tensor]]:
    """``{method: {mode: [B, steps + 1]}}``: the probability of each image's ``target`` class as
    the patches of each map (``[B, h, w]``) are deleted or inserted (the curves' first and last
    points, the same for every map, are computed once)."""

    def proba(x: torch.Tensor) -> torch.Tensor:
        return _probabilities(task, x)

    target = target.to(images.device)
    rows = torch.arange(images.shape[0], device=images.device)
    shared = end_probabilities(proba, images)
    return {method: {mode: deletion_insertion_curve(proba, images, sal.to(images.device), target, mode, steps,
                                                    ends=curve_ends(shared, rows, target, mode))
                     for mode in modes}
            for method, sal in maps.items()}


def _sample_curves(task, images: torch.Tensor, expl, steps: int,
                   keep: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """The deletion curves of the batch's images where ``keep`` (``[B]`` bool) is true, for each
    method with faithfulness numbers and a ``random`` baseline (the report's mean curves)."""
    maps = {m: expl.maps[m] for m in faithful_methods(expl.maps)}
    if "random" not in maps:
        maps["random"] = torch.rand(images.shape[0], *expl.grid, generator=torch.Generator().manual_seed(0))
    rows = keep.cpu().nonzero().flatten()
    kept = {m: sal[rows.to(sal.device)] for m, sal in maps.items()}
    target = expl.target[rows.to(expl.target.device)]
    return _class_curves(task, images[rows.to(images.device)], kept, target, steps, ("deletion",))


def _batches(dataset, indices: list[int], batch_size: int) -> DataLoader:
    return DataLoader(Subset(dataset, indices), batch_size=batch_size, shuffle=False, num_workers=0)


def explain_eval_split(task, dataset, options: ExplainOptions, out_dir: Path, report=None) -> dict[str, float]:
    """Write ``out_dir/overlays/*.png`` and return the faithfulness metrics of ``dataset``.

    Args:
        task: a classification task in eval mode.
        dataset: an :class:`~vision_attn.data.ImageFolderDataset` with the evaluation transform.
        options: see :class:`ExplainOptions`.
        out_dir: the evaluation output folder.
        report: a :class:`~vision_attn.explain.records.Report` to fill (interactive attention
            rows of every patch, the panels, the images' mean deletion curves), or ``None``.
    """
    device = next(task.parameters()).device
    names = task.class_names or []
    metrics: dict[str, float] = {}
    chosen = overlay_images(dataset, options, worst_images(task, dataset, options))
    if chosen:
        written = 0
        sample = set(select_images(len(dataset), options.num_overlays, options.overlay_selection, options.seed))
        sample_curves = Perturbation(progress=False)  # the report's mean deletion curves: the seeded sample's
        progress = Progress("explanation overlays", len(chosen), "image")
        for images, labels, idx in _batches(dataset, chosen, options.batch_size):
            rels = [dataset.samples[i][0] for i in idx.tolist()]  # dataset indices (ImageFolderDataset returns them)
            pictures = [read_image(dataset.root / rel) for rel in rels]
            truths = [names[int(lab)] for lab in labels]
            explained = task.explain_batch(images.to(device), pictures, options, truths)
            for i, rel, truth, e in zip(idx.tolist(), rels, truths, explained, strict=True):
                save_png(out_dir / "overlays" / safe_filename(f"{i:05d}_{truth}_{Path(rel).stem}.png"), e.panel,
                         root=out_dir)
                written += 1
                if report is not None and e.report_item is not None:
                    report.items.append({"name": str(rel), **e.report_item})
            in_sample = torch.tensor([i in sample for i in idx.tolist()])
            if report is not None and explained and bool(in_sample.any()):
                # the mean deletion curves describe the seeded sample, not the added mistakes
                sample_curves.update(_sample_curves(task, images.to(device), explained[0].extras["explanation"],
                                                    options.steps, in_sample))
            progress.update(len(idx))
        progress.close()
        if report is not None and sample_curves.count:
            report.curves = sample_curves.curves("deletion")
        log.info("wrote %d overlays to %s", written, out_dir / "overlays")
    picked = select_images(len(dataset), options.faithfulness_images, options.faithfulness_selection, options.seed)
    if not picked:
        return dict(sorted(metrics.items()))
    ran = False
    if options.faithfulness:
        metrics.update(_faithfulness_metrics(task, dataset, picked, options))
        ran = True
    box_file = _annotation_file(dataset, options)
    if box_file is not None or options.save_maps or options.sanity:
        metrics.update(_localisation_and_sanity(task, dataset, picked, options, out_dir, box_file))
        ran = True
    if ran:
        metrics["explain_images"] = float(len(picked))
        metrics["explain_classes"] = float(len({dataset.samples[i][1] for i in picked}))
        log.info("explanations measured on %d images covering %d classes", len(picked),
                 int(metrics["explain_classes"]))
    return dict(sorted(metrics.items()))


def _faithfulness_metrics(task, dataset, picked: list[int], options: ExplainOptions) -> dict[str, float]:
    """Mean deletion / insertion AUC, SaCo and (``options.road``) ROAD of every method and
    ``random`` over the ``picked`` images."""
    device = next(task.parameters()).device
    gen = torch.Generator().manual_seed(0)
    asked = faithful_methods(options.methods)
    methods = list(dict.fromkeys([*asked, "random"]))
    # the first method asked for that has faithfulness numbers is *the* method
    measure = Perturbation(first=asked[0] if asked else None, total=len(picked))
    scores = ItemScores(total=len(picked))
    for images, _, _ in _batches(dataset, picked, options.batch_size):
        images = images.to(device)
        expl = explain_classifier(task, images, methods, head_fusion=options.head_fusion,
                                  discard_ratio=options.discard_ratio, generator=gen,
                                  target_class=options.target_class, token=options.token)
        maps = {m: expl.maps[m] for m in faithful_methods(expl.maps)}
        measure.update(_class_curves(task, images, maps, expl.target, options.steps))
        scores.update(classifier_scores(lambda x: _probabilities(task, x), images, maps, expl.target, options.road,
                                        options.seed))
    return {**measure.compute(), **scores.compute()}


def _annotation_file(dataset, options: ExplainOptions) -> Path | None:
    """``options.annotations``, else the boxes the embedded shapes data names in its
    ``manifest.json`` for this split (:func:`~vision_attn.data.synthetic.manifest_annotations`),
    else ``None``."""
    if options.annotations:
        return Path(options.annotations).expanduser()
    path = manifest_annotations(dataset.root, getattr(dataset, "split", ""))
    if path is not None:
        log.info("localisation: boxes of the embedded data from %s", path)
    return path


def _localisation_and_sanity(task, dataset, picked: list[int], options: ExplainOptions, out_dir: Path,
                             box_file: Path | None) -> dict[str, float]:
    """Pointing / energy (with ``box_file``; with its objects' masks also pixel accuracy, mIoU and
    mAP: :mod:`vision_attn.explain.segmentation`), saved maps (``options.save_maps``) and sanity
    correlations (``options.sanity``) of every method and ``random``, over the ``picked``
    images, each map explaining the image's labelled class."""
    device = next(task.parameters()).device
    methods = list(dict.fromkeys([*options.methods, "random"]))
    boxes = load_image_objects(box_file) if box_file is not None else None
    gen = torch.Generator().manual_seed(options.seed)
    # one report when both run: the sanity check's (the longer work; the two advance together)
    measures = Measures(localisation=Localisation(total=len(picked), progress=False if options.sanity else None),
                        sanity=Sanity(total=len(picked)),
                        maps=MapWriter(out_dir, "images") if options.save_maps else None)
    kwargs = {"head_fusion": options.head_fusion, "discard_ratio": options.discard_ratio, "token": options.token}
    for images, labels, idx in _batches(dataset, picked, options.batch_size):
        images, labels = images.to(device), labels.to(device)
        if boxes is not None or measures.maps is not None:
            expl = explain_classifier(task, images, methods, target=labels, generator=gen, **kwargs)
            _localise_images(task, dataset, idx.tolist(), labels, expl.maps, boxes, measures)
        if options.sanity:
            measures.sanity.update(sanity_check(task, images, methods, labels, seed=options.seed,
                                                cascade=options.sanity_cascade, **kwargs))
    metrics: dict[str, float] = {}
    if measures.maps is not None:
        measures.maps.compute()
    if boxes is not None:
        scored = measures.localisation.count
        if scored == 0:
            raise DataError(
                f"annotation file {box_file}: none of the {len(picked)} explained images has a box of its labelled "
                f"class; its file_names must be the image paths relative to the data root, as in predictions.json "
                f"(e.g. {Path(dataset.samples[picked[0]][0]).as_posix()!r}), and its category names the class names"
            )
        if scored < len(picked):
            log.warning("localisation: %d of the %d explained images have no box of their labelled class in %s; "
                        "measured on the other %d", len(picked) - scored, len(picked), box_file, scored)
        metrics.update(measures.localisation.compute())
    if options.sanity:
        measures.sanity.write(out_dir)
        metrics.update(measures.sanity.compute())
    return metrics


def _localise_images(task, dataset, idx: list[int], labels: torch.Tensor, grid_maps: dict[str, torch.Tensor],
                     boxes: dict | None, measures: Measures) -> None:
    """Update the localisation (against the boxes of each image's labelled class) and the saved
    maps with the batch's maps (``{method: [B, h, w]}``) in original image pixels."""
    names = task.class_names or []
    pre = task.inference_data_config()
    for j, i in enumerate(idx):
        rel = Path(dataset.samples[i][0]).as_posix()
        size = read_image(Path(dataset.root) / rel, getattr(dataset, "max_pixels", DEFAULT_MAX_PIXELS)).shape[:2]
        maps = {m: grid_to_image(grid[j], size, pre) for m, grid in grid_maps.items()}  # (H, W) each
        label = names[int(labels[j])] if int(labels[j]) < len(names) else str(int(labels[j]))
        if measures.maps is not None:
            measures.maps.update(maps, {"index": i, "file": rel, "label": label}, f"{i:05d}")
        objects = [(box, mask) for name, box, mask in (boxes or {}).get(rel, []) if name == label]
        masks = [mask.decode(size) for _, mask in objects if mask is not None]
        measures.localisation.update(maps, [box for box, _ in objects], masks)
