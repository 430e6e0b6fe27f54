"""DETR-style detection system: ViT encoder + DETR head + Hungarian set loss + COCO mAP."""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from vision_attn.blocks import Mistakes, Section
from vision_attn.boxes import box_xyxy_to_xywh
from vision_attn.data.dense import DenseSchedule
from vision_attn.data.detection import build_detection_transform
from vision_attn.distributed import unique_records
from vision_attn.errors import ConfigError
from vision_attn.explain.detection import (
    detection_explain_metrics,
    error_keywords,
    explain_detection,
    write_detection_overlays,
)
from vision_attn.explain.detection_mistakes import detection_mistakes
from vision_attn.explain.evaluate import DEFAULT_MISTAKES
from vision_attn.losses.matcher import HungarianMatcher
from vision_attn.losses.set_criterion import SetCriterion
from vision_attn.metrics.breakdown import coco_map_metric, detection_breakdown
from vision_attn.models.detr import DETRConfig, DETRHead, post_process
from vision_attn.models.encoder import ViTEncoder
from vision_attn.tasks import detection_report
from vision_attn.tasks.base import VisionTask, gather_objects, register_task
from vision_attn.tasks.convergence import ConvergenceAlarm
from vision_attn.tasks.detection_results import detection_results
from vision_attn.tasks.optim import Optimization

DETECTION_OPTIM = Optimization(lr=1e-4, weight_decay=1e-4, warmup_fraction=0.0, min_lr_ratio=0.1)

__all__ = ["DETECTION_HEAD", "DetectionOptions", "DetectionTask", "SetLossConfig", "mean_average_precision"]

log = logging.getLogger(__name__)


def mean_average_precision(preds: list[dict[str, Tensor]], targets: list[dict[str, Tensor]]) -> dict[str, float]:
    """COCO ``map``, ``map_50``, ``map_75`` (and ``mar_100``) of xyxy-pixel detections.

    ``targets`` may carry ``iscrowd`` (crowd regions: detections matched to them are ignored,
    as in pycocotools) and ``area`` (for the size ranges), as
    :meth:`~vision_attn.data.detection.CocoDetection.scoring_target` gives them.
    """
    metric = coco_map_metric()
    metric.update(preds, targets)
    res = metric.compute()
    return {k: float(res[k]) for k in ("map", "map_50", "map_75", "mar_100")}


@dataclass(frozen=True)
class SetLossConfig:
    """The set loss of a detector: the Hungarian matcher's costs and the loss terms' weights
    (:class:`~vision_attn.losses.matcher.HungarianMatcher`,
    :class:`~vision_attn.losses.set_criterion.SetCriterion`). DETR's by default.

    Attributes:
        cost_class: matcher class cost.
        cost_bbox: matcher L1 cost.
        cost_giou: matcher GIoU cost.
        weight_ce: loss weight of classification.
        weight_bbox: loss weight of L1.
        weight_giou: loss weight of GIoU.
        eos_coef: weight of the no-object class (softmax only).
        o2m_repeat: H-DETR's ``K``, the ground truth repeated ``K`` times for the one-to-many
            queries (the head's ``o2m_mode="hybrid"`` only).
        mal_gamma: classify the matching queries with DEIM's matchability-aware loss (Huang et al.
            2025: a matched class's target is its box's IoU with the object to the power
            ``mal_gamma``; 1.5 in the paper) instead of the focal loss; a focal head only.
            ``null``: the focal loss.
        weight_fgl: weight of the edge distributions' localisation term (a head with ``fdr``;
            D-FINE's fine-grained localisation loss, Peng et al. 2025: 0.15).
        weight_ddf: weight of the earlier layers' self-distillation from the last (``fdr``;
            D-FINE's GO-LSD: 1.5).
    """

    cost_class: float = 1.0
    cost_bbox: float = 5.0
    cost_giou: float = 2.0
    weight_ce: float = 1.0
    weight_bbox: float = 5.0
    weight_giou: float = 2.0
    eos_coef: float = 0.1
    o2m_repeat: int = 6
    mal_gamma: float | None = None
    weight_fgl: float = 0.15
    weight_ddf: float = 1.5


@dataclass
class DetectionOptions:
    """Which detections the folder commands and the overlays keep: a detector's inference options
    (``--score_threshold`` of ``predict`` / ``explain``; ``--explain.score_threshold`` of ``eval.py``).

    Attributes:
        score_threshold: objects scoring less are left out of the records of ``predict`` and of
            the overlays (``eval.py``'s ``predictions.json`` keeps every detection, for COCO scoring).
    """

    score_threshold: float = 0.3

    def __post_init__(self) -> None:
        if isinstance(self.score_threshold, bool) or not isinstance(self.score_threshold, (int, float)):
            raise ConfigError(f"score_threshold must be a number, got {self.score_threshold!r}")


DETECTION_HEAD = DETRConfig()
"""The task's default head: 20 queries, width 128, 3 layers, 4 heads, no dropout (smaller than DETR's,
:data:`~vision_attn.models.detr.DEFAULT_DETR`)."""
DETR_LOSS = SetLossConfig()


@register_task
class DetectionTask(VisionTask):
    """DETR-style detector on a ViT encoder.

    Class names, their number and the annotation file's category ids come from the data
    (``DetectionDataModule``) when training starts, and are saved in checkpoints.

    Args:
        encoder: the ViT encoder.
        num_classes: ``C`` (default: from the data).
        class_names: names in label order (default: from the data).
        category_ids: the annotation file's category id of each label (default: from the data).
        head: the DETR head: its architecture, the published remedies (``box_refine``,
            ``focal``), the training aids and the detections kept
            (:class:`~vision_attn.models.detr.DETRConfig`; default :data:`DETECTION_HEAD`;
            ``--model.head.num_queries`` etc.).
        loss: the matcher's costs and the loss weights (:class:`SetLossConfig`;
            ``--model.loss.cost_class`` etc.).
        optim: learning rates, weight decay and schedule (default ``DETECTION_OPTIM``;
            ``--model.optim.lr`` etc.).
        compile: ``torch.compile`` the encoder when training or evaluation starts (a run-time
            choice: not stored in checkpoints).
    """

    task_name = "detection"
    inference_options = DetectionOptions  # --score_threshold (eval.py: --explain.score_threshold)
    monitor = ("val/map", "max")
    crop_at_inference = False  # a centre crop would cut objects off: the whole image, resized
    export_output_names = ("pred_logits", "pred_boxes")
    headline_metrics = ("map", "map_50", "map_75")
    eval_file_names = ("per_class.json", "pr_curves.json", "per_class.csv", "results_per_image.json",
                       "results_per_image.csv")
    headline_metric = "map"
    overlay_description = ("boxes | per detected object: its AttnLRP map gated by its query's cross-attention, and "
                           "that raw cross-attention")
    legacy_arguments = {
        **{k: f"head.{k}" for k in (
            "num_queries", "hidden_dim", "num_layers", "num_heads", "mlp_ratio", "dropout", "focal", "box_refine",
            "dn_groups", "label_noise_ratio", "box_noise_scale", "dn_negatives", "query_selection",
            "look_forward_twice", "o2m_groups", "o2m_mode", "pyramid", "dense_encoder", "top_k")},
        **{k: f"loss.{k}" for k in (
            "cost_class", "cost_bbox", "cost_giou", "weight_ce", "weight_bbox", "weight_giou", "eos_coef",
            "o2m_repeat")},
    }

    def __init__(
        self,
        encoder: ViTEncoder,
        num_classes: int | None = None,
        class_names: list[str] | None = None,
        category_ids: list[int] | None = None,
        head: DETRConfig = DETECTION_HEAD,
        loss: SetLossConfig = DETR_LOSS,
        optim: Optimization = DETECTION_OPTIM,
        compile: bool = False,
    ) -> None:
        super().__init__(encoder, optim, compile)
        # the groups are dataclasses: kept as plain mappings in hparams (what checkpoints store)
        self.save_hyperparameters(ignore=["encoder", "optim", "head", "loss"])
        self.save_hyperparameters({"head": dataclasses.asdict(head), "loss": dataclasses.asdict(loss)})
        self.head_config, self.loss_config = head, loss
        if loss.mal_gamma is not None and (not head.focal or not loss.mal_gamma > 0):
            raise ConfigError(f"model.loss.mal_gamma {loss.mal_gamma}: the matchability-aware loss needs a focal head "
                              "(model.head.focal true) and a gamma above 0 (the paper's: 1.5)")
        self.head: DETRHead | None = None
        self.class_names: list[str] | None = None
        self.category_ids: list[int] | None = None
        self.eval_records: list[dict[str, Any]] = []
        self.eval_per_class: dict[str, dict[str, Any]] | None = None  # per_class.json of the last eval_results
        self.eval_pr_curves: dict[str, dict[str, list[float]]] | None = None  # pr_curves.json of the last eval_results
        self.eval_object_files: dict[str, Any] = {}  # per_class.csv, results_per_image.json / .csv
        self.eval_mistakes = None  # the mistakes browser of the last explain_eval (eval.py: mistakes.html)
        if num_classes is not None or class_names is not None:
            self._build(num_classes, class_names, category_ids)

    def _build(self, num_classes: int | None, class_names: list[str] | None, category_ids: list[int] | None) -> None:
        head, loss = self.head_config, self.loss_config
        if class_names is None:
            class_names = [str(i) for i in range(int(num_classes))]
        n = len(class_names)
        self.class_names = list(class_names)
        self.category_ids = list(category_ids) if category_ids is not None else list(range(1, n + 1))
        self.head = DETRHead(self.encoder.embed_dim, n, head)
        matcher = HungarianMatcher(loss.cost_class, loss.cost_bbox, loss.cost_giou, focal=head.focal)
        repeat = loss.o2m_repeat if head.o2m_mode == "hybrid" else 1
        self.criterion = SetCriterion(n, matcher, loss.weight_ce, loss.weight_bbox, loss.weight_giou, loss.eos_coef,
                                      head.focal, dn=head.dn_groups > 0, enc=head.query_selection,
                                      o2m=head.o2m_groups > 0, o2m_repeat=repeat, dense=head.dense_encoder,
                                      mal_gamma=loss.mal_gamma, fdr_offsets=self.head.fdr_offsets if head.fdr else None,
                                      weight_fgl=loss.weight_fgl, weight_ddf=loss.weight_ddf)
        self.val_pairs: list[tuple[dict, dict]] = []  # (prediction, target) per validation image
        self.hparams.update(num_classes=n, class_names=self.class_names, category_ids=self.category_ids)

    def build_from_data(self, datamodule) -> None:
        names = datamodule.class_names
        self._build(len(names), names, getattr(datamodule, "category_ids", None))

    def forward(self, images: Tensor, need_weights: bool = False, targets: list[dict[str, Tensor]] | None = None,
                image_sizes: Tensor | None = None) -> dict:
        """The head's outputs (``pred_logits``, ``pred_boxes``, ...) for normalised images.

        ``targets`` (training only) feed the head's denoising queries when ``dn_groups > 0``.
        ``image_sizes`` (``[B, 2]`` each image's ``(height, width)`` before the batch was padded,
        :func:`~vision_attn.data.detection.detection_collate`): the padding is masked in the
        encoder and in the decoder's cross-attention, and boxes are fractions of each image's own
        size. The batch is first padded (zeros) to a multiple of the patch size if needed.
        """
        if image_sizes is None:
            return self.head(self.encoder(images), need_weights=need_weights, targets=targets)
        ph, pw = self.encoder.patch_size
        pad_h, pad_w = -images.shape[-2] % ph, -images.shape[-1] % pw
        if pad_h or pad_w:
            images = torch.nn.functional.pad(images, (0, pad_w, 0, pad_h))
        return self.head(self.encoder(images, image_sizes=image_sizes), need_weights=need_weights, targets=targets)

    def detect(self, outputs: dict, orig_sizes: Tensor) -> list[dict[str, Tensor]]:
        """Post-processed detections in original pixels (labels are contiguous 0..C-1)."""
        return post_process(outputs, orig_sizes, self.head_config.top_k, self.head_config.focal)

    def _shared_step(self, batch, stage: str) -> Tensor:
        images, targets = batch
        # a padded batch (aspect-preserving resize): each image's own size, for the masks
        sized = bool(targets) and "size" in targets[0]
        sizes = torch.stack([t["size"] for t in targets]).to(images.device) if sized else None
        outputs = self(images, targets=targets if stage == "train" else None, image_sizes=sizes)
        terms = self.criterion(outputs, targets, across_processes=stage == "train")
        loss = self.criterion.total(terms, len(outputs["aux_outputs"]))
        if stage == "train":
            self.check_finite(loss, terms)
        bs = len(targets)
        self.log(f"{stage}/loss", loss, prog_bar=True, on_step=stage == "train", on_epoch=True, batch_size=bs,
                 sync_dist=True)
        for k in ("loss_ce", "loss_bbox", "loss_giou", "cardinality_error"):
            self.log(f"{stage}/{k}", terms[k], on_step=False, on_epoch=True, batch_size=bs, sync_dist=True)
        for k in ("loss_dn_ce", "loss_dn_bbox", "loss_dn_giou", "loss_enc_ce", "loss_enc_bbox", "loss_enc_giou",
                  "loss_o2m_ce", "loss_o2m_bbox", "loss_o2m_giou", "loss_dense_ce", "loss_dense_bbox",
                  "loss_dense_giou", "loss_fgl"):
            if k in terms:  # the training aids' terms, when switched on (dn and o2m: training only)
                self.log(f"{stage}/{k}", terms[k], on_step=False, on_epoch=True, batch_size=bs, sync_dist=True)
        if stage != "train":
            orig = torch.stack([t["orig_size"] for t in targets])
            dets = self.detect(outputs, orig)
            preds = [{"boxes": d["boxes"], "scores": d["scores"], "labels": d["labels"]} for d in dets]
            if stage == "val":  # scored against the original annotations, as eval_results does
                for p, t in zip(preds, targets, strict=True):
                    scored = {k: v.cpu() for k, v in t["scored"].items()}
                    self.val_pairs.append(({k: v.cpu() for k, v in p.items()}, scored))
            else:
                for t, d in zip(targets, dets, strict=True):
                    self.eval_records.append({"image_id": t["image_id"], "det": {k: v.cpu() for k, v in d.items()}})
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "val")

    def on_validation_epoch_start(self) -> None:
        self.val_pairs = []

    def on_validation_epoch_end(self) -> None:
        # Gathered as objects, not through torchmetrics' sync: that issues one collective per
        # image and so needs the same image count on every process, which an unpadded
        # evaluation sampler does not give (see vision_attn.data.loading).
        pairs = gather_objects(self.val_pairs)
        self.val_pairs = []
        if not pairs:
            return
        res = mean_average_precision([p for p, _ in pairs], [t for _, t in pairs])
        for k in ("map", "map_50", "map_75"):
            self.log(f"val/{k}", res[k], prog_bar=k != "map_75")  # the same on every process

    def test_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "test")

    def on_test_epoch_start(self) -> None:
        self.eval_records = []
        self.eval_per_class = None
        self.eval_pr_curves = None
        self.eval_object_files = {}

    def on_test_epoch_end(self) -> None:
        self.eval_records = unique_records(self.eval_records, "image_id", sort=True)

    def eval_results(self, dataset) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """``(metrics, predictions)``: COCO mAP, its size ranges and recalls
        (:data:`~vision_attn.metrics.breakdown.COCO_SUMMARY_KEYS`) and the COCO results list (ids as
        in the file). Keeps the per-category AP for :meth:`eval_files`.

        The ground truth is ``dataset.scoring_target`` (original pixels, crowd regions flagged),
        the same as validation scores, so ``metrics`` equal pycocotools' COCOeval of the
        results list on the annotation file.
        """
        if not self.eval_records:
            raise RuntimeError("no evaluation records: run trainer.test(...) first")
        by_id = {r["image_id"]: r["det"] for r in self.eval_records}
        known = {im["id"] for im in dataset.images}
        unknown = [i for i in by_id if i not in known]
        if unknown:
            log.warning("ignored predictions for %d image ids that the split does not have, e.g. %s", len(unknown),
                        unknown[0])
        if not any(len(d["scores"]) for i, d in by_id.items() if i in known):
            log.warning("the model made no detection on %d images: every metric is 0", len(known))
        preds, targets, results = [], [], []
        for im in dataset.images:
            det = by_id.get(im["id"])
            if det is None:
                continue
            preds.append({"boxes": det["boxes"], "scores": det["scores"], "labels": det["labels"]})
            targets.append(dataset.scoring_target(im["id"]))  # crowd regions included, as pycocotools
            for box, score, label in zip(box_xyxy_to_xywh(det["boxes"]).tolist(), det["scores"].tolist(),
                                         det["labels"].tolist(), strict=True):
                # unrounded, so that pycocotools scoring this file reproduces ``metrics`` exactly
                results.append({"image_id": im["id"], "category_id": self.category_ids[label],
                                "bbox": box, "score": score})
        breakdown = detection_breakdown(preds, targets, self.class_names or [])
        self.eval_per_class = breakdown.per_class
        self.eval_pr_curves = breakdown.pr_curves
        tide, self.eval_object_files = detection_results(dataset, results, self.category_ids, self.class_names or [],
                                                         self.inference.score_threshold, breakdown.per_class)
        return {**breakdown.metrics, **tide}, results

    def eval_files(self, dataset) -> dict[str, Any]:
        """``per_class.json``: ``{category name: {"ap", "ap_50", "n_gt"}}`` of the last
        :meth:`eval_results` (pycocotools' per-category AP; -1 without ground truth),
        ``pr_curves.json``: ``{category name: {"recall", "precision"}}`` at IoU 0.5
        (:func:`~vision_attn.metrics.breakdown.pr_curves_from_precision`; -1 without ground truth),
        and the object-by-object files of :mod:`~vision_attn.tasks.detection_results`
        (``per_class.csv``, ``results_per_image.json`` / ``.csv``)."""
        if self.eval_per_class is None or self.eval_pr_curves is None:
            raise RuntimeError("no per-category results: call eval_results(...) after trainer.test(...) first")
        return {"per_class.json": self.eval_per_class, "pr_curves.json": self.eval_pr_curves,
                **self.eval_object_files}

    def configure_callbacks(self) -> list[L.Callback]:
        """The base's callbacks and the convergence alarm
        (:class:`~vision_attn.tasks.convergence.ConvergenceAlarm`: a warning naming the likely cause
        when validation map_50 is below 0.05 a quarter into the run, or the loss is not finite) and
        the schedule of the denser training images (:class:`~vision_attn.data.dense.DenseSchedule`:
        plain images for the last epochs)."""
        return [*super().configure_callbacks(), ConvergenceAlarm(), DenseSchedule()]

    # ------------------------------------------------------------------ inference, export, explanation
    def export_forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        out = self(images)
        return out["pred_logits"], out["pred_boxes"]

    def predictions_from_outputs(self, outputs, sizes, options=None) -> list[dict[str, Any]]:
        """``{"detections": [{"label", "category_id", "bbox": [x, y, w, h] pixels, "score"}]}`` per
        image from ``(pred_logits, pred_boxes)``: objects scoring at least
        ``options.score_threshold`` (without options: :attr:`inference`'s)."""
        threshold = (self.inference if options is None else options).score_threshold
        logits, boxes = outputs
        dets = self.detect({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([tuple(s) for s in sizes]))
        names, cat_ids = self.class_names or [], self.category_ids or []
        records = []
        for det in dets:
            keep = (det["scores"] >= threshold).nonzero().flatten().tolist()
            records.append({"detections": [
                {"label": names[int(det["labels"][k])], "category_id": int(cat_ids[int(det["labels"][k])]),
                 "bbox": box_xyxy_to_xywh(det["boxes"][k]).tolist(), "score": float(det["scores"][k])}
                for k in keep]})
        return records

    def explain_batch(self, images, pictures, options, truths=None):
        return explain_detection(self, images, pictures, options, truths)

    def explain_eval(self, dataset, options, out_dir: Path, report=None) -> dict[str, float]:
        """Overlays of ``options.num_overlays`` images (``options.overlay_selection``), then the localisation,
        faithfulness and sanity numbers of every decoder method and ``random`` (and the saved
        maps): :func:`~vision_attn.explain.detection.detection_explain_metrics`; and the mistakes
        browser of the evaluation's results (:attr:`eval_mistakes`, which ``eval.py`` writes as
        ``mistakes.html``: :func:`~vision_attn.explain.detection_mistakes.detection_mistakes`).

        Explanations are drawn on the model input of single-image inference (the whole image
        resized to the input size, :meth:`inference_data_config`, as ``predict.py`` sees it): a
        dataset read with the aspect-preserving resize (``--data.resize aspect``) is read that
        way for them, so the maps map back to the pixels by that one geometry."""
        if getattr(dataset, "with_size", False):
            log.info("explanations: images resized to the input size %s (as at inference), not by the "
                     "aspect-preserving evaluation resize", self.inference_data_config()["input_size"][1:])
            dataset = copy.copy(dataset)
            dataset.transform = build_detection_transform(self.inference_data_config(), train=False)
            dataset.with_size = False
        write_detection_overlays(self, dataset, options, out_dir, report=report)
        metrics = detection_explain_metrics(self, dataset, options, out_dir)
        self.eval_mistakes = detection_mistakes(self, dataset, self.eval_object_files.get("results_per_image.json"),
                                                options)
        return metrics

    # ------------------------------------------------------------------ report.html
    def rank_mistakes(self, dataset, predictions, k, options=None) -> list[int]:
        """The images with the most missed and false detections scoring at least
        ``options.score_threshold`` (:func:`~vision_attn.tasks.detection_report.rank_mistakes`)."""
        return detection_report.rank_mistakes(dataset, predictions, k, **error_keywords(self, dataset, options))

    def report_sections(self, files, metrics) -> list[Section]:
        """Per-category AP, the size breakdown and the PR curves (:mod:`~vision_attn.tasks.detection_report`)."""
        return detection_report.result_sections(files, metrics)

    def mistake_cards(self, items, predictions, limit=DEFAULT_MISTAKES) -> Mistakes:
        """The explained images' missed and false detections
        (:func:`~vision_attn.tasks.detection_report.mistake_cards`)."""
        return detection_report.mistake_cards(items, predictions, limit)
