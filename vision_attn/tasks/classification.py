"""Image classification system: ViT encoder + pooling head, label-smoothed cross-entropy.

Mixup and CutMix (``--model.mix.mixup ALPHA``, ``--model.mix.cutmix ALPHA``: DeiT's small-data
regularisers) are timm's :class:`timm.data.Mixup` applied to the training batch in
``training_step`` only, one ``lam`` per batch (timm's ``batch`` mode: image ``i`` is mixed with
image ``B - 1 - i``), with the label smoothing passed to it and timm's
:class:`~timm.loss.SoftTargetCrossEntropy` as the loss. Validation and test are unchanged (hard
labels, plain cross-entropy). With both alphas at 0 nothing is mixed and the training loss is
the label-smoothed cross-entropy as before.

Details:

- timm's ``Mixup`` needs an even batch. Training drops the last partial batch, but a batch can
  still be odd (an odd ``batch_size``, or a dataset smaller than one batch): then the first
  ``B - 1`` images are mixed and the last one is kept as it is, with its label-smoothed one-hot
  target (every image still counts; the same loss that an unmixed image gets).
- ``train/acc_*`` with mixing compares the predictions with each mixed target's dominant class
  (its argmax: the image whose weight is larger), so it reads lower than without mixing and is
  not comparable with ``val/acc_*``.
- timm draws ``lam`` from NumPy's global generator, which ``seed_everything`` seeds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.data.mixup import mixup_target
from timm.loss import SoftTargetCrossEntropy
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from vision_attn.blocks import Mistakes, Section
from vision_attn.distributed import unique_records
from vision_attn.errors import ConfigError, EncoderError
from vision_attn.explain.evaluate import DEFAULT_MISTAKES, explain_classification, explain_eval_split
from vision_attn.explain.methods import TOKENS, Token, resolve_target_class
from vision_attn.explain.task_mistakes import classification_mistakes
from vision_attn.metrics.breakdown import classification_breakdown, precision_recall_f1
from vision_attn.models.classifier import ClassificationHead, ClassifierConfig, HeadKind, TimmHead
from vision_attn.models.encoder import ViTEncoder
from vision_attn.tasks import classification_report
from vision_attn.tasks.base import VisionTask, register_task
from vision_attn.tasks.optim import Optimization

CLASSIFICATION_OPTIM = Optimization()
SOFT_TARGET_CROSS_ENTROPY = SoftTargetCrossEntropy()  # the loss of mixed targets (no state: shared)

__all__ = ["ClassificationOptions", "ClassificationTask", "ClassifierConfig", "HeadKind", "MixConfig",
           "classification_metrics"]


@dataclass(frozen=True)
class MixConfig:
    """Mixup and CutMix of the training batches (timm's :class:`timm.data.Mixup`; see the module
    docstring). Both alphas 0: nothing is mixed.

    Attributes:
        mixup: mixup's Beta(alpha, alpha) parameter (``0``: off; DeiT uses 0.8).
        cutmix: CutMix's Beta(alpha, alpha) parameter (``0``: off; DeiT uses 1.0).
        prob: probability that a training batch is mixed at all (mixup or CutMix).
        switch_prob: with both on, probability that a mixed batch uses CutMix rather than mixup.
    """

    mixup: float = 0.0
    cutmix: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5

    def __post_init__(self) -> None:
        for key in ("mixup", "cutmix"):
            value = getattr(self, key)
            if not value >= 0:
                raise ValueError(f"--model.mix.{key} is a Beta distribution's alpha: >= 0 (0 = off), got {value}")
        for key in ("prob", "switch_prob"):
            value = getattr(self, key)
            if not 0 <= value <= 1:
                raise ValueError(f"--model.mix.{key} is a probability: between 0 and 1, got {value}")


@dataclass
class ClassificationOptions:
    """What a classifier's predictions and explanations show: its inference options
    (``--topk``, ``--target_class``, ``--token`` of ``predict`` / ``explain``;
    ``--explain.topk`` etc. of ``eval.py``).

    Attributes:
        topk: the K best classes listed per image (``"topk"`` of the folder commands' records).
        target_class: explain this class (a class name, or an index) instead of the prediction;
            the faithfulness numbers then follow its probability.
        token: the token row explained: ``auto`` (what the head reads), or for a distilled DeiT
            ``cls`` (class token), ``dist`` (distillation token), ``mean`` (their average).
    """

    topk: int = 5
    target_class: str | None = None
    token: Token = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ConfigError(f"topk must be an integer >= 1, got {self.topk!r}")
        if self.token not in TOKENS:
            raise ConfigError(f"token {self.token!r} invalid; choose one of {', '.join(TOKENS)}")
        if self.target_class is not None:
            self.target_class = str(self.target_class)


LINEAR_HEAD = ClassifierConfig()
NO_MIX = MixConfig()


def _metric_collection(num_classes: int) -> MetricCollection:
    metrics = {
        "acc_top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
        "acc_macro": MulticlassAccuracy(num_classes, top_k=1, average="macro"),
    }
    if num_classes >= 5:
        metrics["acc_top5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro")
    return MetricCollection(metrics)


def classification_metrics(logits: Tensor, labels: Tensor) -> dict[str, float]:
    """``acc_top1`` (micro), ``acc_macro`` and ``acc_top5`` (when ``C >= 5``) of a whole split."""
    metrics = _metric_collection(logits.shape[1])
    metrics.update(logits, labels)
    return {k: float(v) for k, v in metrics.compute().items()}


@register_task
class ClassificationTask(VisionTask):
    """ViT image classifier.

    Class names and their number normally come from the data: leave them unset and the
    task reads them from the datamodule (``class_names``) when training starts.

    Args:
        encoder: the ViT encoder.
        num_classes: number of classes (default: from the datamodule; with ``head.kind='timm'``,
            the timm model's classifier size).
        class_names: class names in label order (default: from the datamodule).
        head: the head's kind, pooling and dropout
            (:class:`~vision_attn.models.classifier.ClassifierConfig`; ``--model.head.pooling``
            etc.).
        label_smoothing: label smoothing of the training loss (with mixing: of the mixed targets).
        mix: mixup and CutMix of the training batches (:class:`MixConfig`; off by default).
        optim: learning rates, weight decay and schedule (default ``CLASSIFICATION_OPTIM``;
            ``--model.optim.lr`` etc.).
        compile: ``torch.compile`` the encoder when training or evaluation starts (a run-time
            choice: not stored in checkpoints).
    """

    task_name = "classification"
    inference_options = ClassificationOptions  # --topk, --target_class, --token (eval.py: --explain.topk ...)
    monitor = ("val/acc_top1", "max")
    export_output_names = ("logits",)
    headline_metrics = ("acc_top1", "acc_macro", "deletion_auc", "deletion_auc_random", "insertion_auc",
                        "insertion_auc_random")
    overlay_description = "input | one overlay per explanation method (rollout, relevance, raw attention)"
    eval_file_names = ("per_class.json", "confusion_matrix.json", "per_class.csv", "results_per_image.json",
                       "results_per_image.csv")
    headline_metric = "acc_top1"
    legacy_arguments = {"head": "head.kind", "pooling": "head.pooling", "head_dropout": "head.dropout",
                        "mixup": "mix.mixup", "cutmix": "mix.cutmix", "mix_prob": "mix.prob",
                        "mix_switch_prob": "mix.switch_prob"}

    def __init__(
        self,
        encoder: ViTEncoder,
        num_classes: int | None = None,
        class_names: list[str] | None = None,
        head: ClassifierConfig = LINEAR_HEAD,
        label_smoothing: float = 0.1,
        mix: MixConfig = NO_MIX,
        optim: Optimization = CLASSIFICATION_OPTIM,
        compile: bool = False,
    ) -> None:
        super().__init__(encoder, optim, compile)
        # the groups are dataclasses: kept as plain mappings in hparams (what checkpoints store)
        self.save_hyperparameters(ignore=["encoder", "optim", "head", "mix"])
        self.save_hyperparameters({"head": asdict(head), "mix": asdict(mix)})
        self.head_config, self.mix_config = head, mix
        self.head_kind: HeadKind = head.kind
        self.pooling = head.pooling
        self.head_dropout = head.dropout
        self.label_smoothing = label_smoothing
        self.mixup, self.cutmix, self.mix_prob, self.mix_switch_prob = mix.mixup, mix.cutmix, mix.prob, mix.switch_prob
        self.mixer: Mixup | None = None  # built with the head (it needs the number of classes)
        self.class_names: list[str] | None = None
        self.head: ClassificationHead | TimmHead | None = None
        if head.kind == "timm" and num_classes is None and class_names is None:
            num_classes = int(getattr(encoder.model, "num_classes", 0) or 0)
        if class_names is not None or num_classes is not None:
            self._build_head(num_classes, class_names)
        self.eval_records: list[dict[str, Any]] = []

    def _build_head(self, num_classes: int | None, class_names: list[str] | None) -> None:
        if class_names is not None and num_classes is not None and len(class_names) != num_classes:
            raise ValueError(f"num_classes={num_classes} but {len(class_names)} class_names were given")
        if class_names is None:
            class_names = [str(i) for i in range(int(num_classes))]
        n = len(class_names)
        if self.head_kind == "timm":
            head = TimmHead(self.encoder)
            if head.num_classes != n:
                raise EncoderError(
                    f"head.kind='timm': the timm model's classifier has {head.num_classes} classes but "
                    f"{n} class names were given; give {head.num_classes} names"
                )
            self.head = head
        else:
            pooling = self.pooling
            if pooling == "auto":  # the class token when there is one (register-only models have none)
                pooling = "cls" if getattr(self.encoder.model, "cls_token", None) is not None else "mean"
            self.head = ClassificationHead(self.encoder.embed_dim, n, pooling, self.head_dropout)
        self.class_names = list(class_names)
        self.mixer = None
        if self.mixup > 0 or self.cutmix > 0:
            self.mixer = Mixup(mixup_alpha=self.mixup, cutmix_alpha=self.cutmix, prob=self.mix_prob,
                               switch_prob=self.mix_switch_prob, mode="batch", correct_lam=True,
                               label_smoothing=self.label_smoothing, num_classes=n)
        self.hparams["num_classes"] = n
        self.hparams["class_names"] = self.class_names
        # ("train" cannot be a ModuleDict key: it would shadow nn.Module.train)
        self.metrics = torch.nn.ModuleDict(
            {f"{stage}_metrics": _metric_collection(n).clone(prefix=f"{stage}/") for stage in ("train", "val", "test")}
        )

    def build_from_data(self, datamodule) -> None:
        self._build_head(len(datamodule.class_names), datamodule.class_names)

    def forward(self, images: Tensor) -> Tensor:
        """Logits ``[B, C]`` for normalised images ``[B, 3, H, W]``."""
        if self.head is None:
            raise RuntimeError("the classification head is not built yet: pass num_classes or class_names")
        return self.head(self.encoder(images))

    def mix(self, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Mixup / CutMix of a training batch (see the module docstring): ``(mixed images
        [B, 3, H, W], soft targets [B, C])``, label smoothing included. ``images`` may be changed
        in place (timm's ``Mixup`` mixes in place). An odd batch mixes its first ``B - 1`` images; the last
        keeps its image and its label-smoothed one-hot target."""
        if self.mixer is None:
            raise RuntimeError("mixing is off (mixup = cutmix = 0) or the head is not built yet")
        even = len(images) - len(images) % 2
        if even == len(images):
            return self.mixer(images, labels)
        if even == 0:  # a batch of one: nothing to mix with
            return images, mixup_target(labels, self.mixer.num_classes, 1.0, self.label_smoothing)
        mixed, targets = self.mixer(images[:even], labels[:even])
        last = mixup_target(labels[even:], self.mixer.num_classes, 1.0, self.label_smoothing)
        return torch.cat([mixed, images[even:]]), torch.cat([targets, last])

    def _shared_step(self, batch: tuple[Tensor, Tensor, Tensor], stage: str) -> Tensor:
        images, labels, index = batch
        if stage == "train" and self.mixer is not None:
            images, targets = self.mix(images, labels)
            logits = self(images)
            loss = SOFT_TARGET_CROSS_ENTROPY(logits, targets)
            labels = targets.argmax(-1)  # the dominant class of each mixed target (train/acc_*)
        else:
            logits = self(images)
            smoothing = self.label_smoothing if stage == "train" else 0.0
            loss = F.cross_entropy(logits, labels, label_smoothing=smoothing)
        if stage == "train":
            self.check_finite(loss, {"cross_entropy": loss})
        metrics = self.metrics[f"{stage}_metrics"]
        metrics.update(logits.detach(), labels)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, prog_bar=True, on_step=on_step, on_epoch=True, batch_size=len(labels),
                 sync_dist=True)
        self.log_dict(metrics, prog_bar=stage != "train", on_step=False, on_epoch=True)
        if stage == "test":
            probs = logits.detach().float().softmax(-1).cpu()
            for i, lab, p in zip(index.tolist(), labels.tolist(), probs, strict=True):
                self.eval_records.append({"index": i, "label": lab, "probs": p})
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "test")

    def on_test_epoch_start(self) -> None:
        self.eval_records = []

    def on_test_epoch_end(self) -> None:
        # One record per image: gather from every process and drop the duplicates that a
        # distributed sampler pads with, so results do not depend on the process count.
        self.eval_records = unique_records(self.eval_records, "index", sort=True)

    def _evaluated(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(probs [N, C], labels [N], scores [N], preds [N])`` of the last test run: the top-1
        class of each image and its probability, computed once for every file ``eval.py`` writes."""
        if not self.eval_records:
            raise RuntimeError("no evaluation records: run trainer.test(...) first")
        probs = torch.stack([r["probs"] for r in self.eval_records])  # (N, C)
        labels = torch.tensor([r["label"] for r in self.eval_records])
        scores, preds = probs.max(dim=1)
        return probs, labels, scores, preds

    def eval_results(self, dataset) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """``(metrics, predictions)`` from the last test run, in the contract's formats.

        Args:
            dataset: the evaluated :class:`~vision_attn.data.ImageFolderDataset`.
        """
        samples = dataset.samples
        probs, labels, scores, preds = self._evaluated()
        metrics = classification_metrics(probs, labels)
        names = self.class_names or []
        predictions = [
            {"file": samples[r["index"]][0], "label": names[r["label"]], "pred": names[p], "score": s}
            for r, p, s in zip(self.eval_records, preds.tolist(), scores.tolist(), strict=True)
        ]
        return metrics, predictions

    def eval_files(self, dataset) -> dict[str, Any]:
        """``per_class.json`` (``{class: {"acc", "n", "precision", "recall"}}``) and
        ``confusion_matrix.json`` (``{"labels", "counts"}``, rows = truth) of the last test run,
        from the same top-1 predictions as ``predictions.json``
        (:func:`~vision_attn.metrics.breakdown.classification_breakdown`); ``per_class.csv``: per
        class ``n``, ``tp``, ``fp``, ``fn``, precision, recall and F1 of the top-1 predictions;
        ``results_per_image.json`` / ``.csv``: per image its ``file``, ``truth``, ``pred``, ``score``
        (the top-1 probability), ``truth_score``, ``truth_rank`` (1: the truth is the top-1 class)
        and ``correct``."""
        probs, labels, scores, preds = self._evaluated()
        names = self.class_names or []
        per_class, confusion = classification_breakdown(labels, preds, names)
        truth_scores = probs.gather(1, labels[:, None]).squeeze(1)
        ranks = 1 + (probs > truth_scores[:, None]).sum(1)  # 1: the truth is the top-1 class
        samples = dataset.samples
        images = [{"file": samples[r["index"]][0], "truth": names[t], "pred": names[p], "score": s,
                   "truth_score": ts, "truth_rank": k, "correct": t == p}
                  for r, t, p, s, ts, k in zip(self.eval_records, labels.tolist(), preds.tolist(), scores.tolist(),
                                               truth_scores.tolist(), ranks.tolist(), strict=True)]
        counts = confusion["counts"]
        rows = []
        for c, name in enumerate(names):
            tp = counts[c][c]
            fn, fp = sum(counts[c]) - tp, sum(row[c] for row in counts) - tp
            precision, recall, f1 = precision_recall_f1(tp, fp, fn)
            rows.append({"class": name, "n": per_class[name]["n"], "tp": tp, "fp": fp, "fn": fn,
                         "precision": precision, "recall": recall, "f1": f1})
        return {"per_class.json": per_class, "confusion_matrix.json": confusion, "per_class.csv": rows,
                "results_per_image.json": images, "results_per_image.csv": images}

    # ------------------------------------------------------------------ inference, export, explanation
    def set_inference_options(self, options: ClassificationOptions) -> None:
        """:meth:`VisionTask.set_inference_options`; a ``target_class`` that names no class of the
        model is refused here, before any image runs."""
        if getattr(options, "target_class", None) is not None and self.class_names:
            resolve_target_class(options.target_class, self.class_names, len(self.class_names))
        super().set_inference_options(options)

    def export_forward(self, images: Tensor) -> tuple[Tensor]:
        return (self(images),)

    def predictions_from_outputs(self, outputs, sizes, options=None) -> list[dict[str, Any]]:
        """``{"pred", "score", "topk"}`` per image from ``(logits,)``: the top-1 class and its
        softmax probability, and ``topk``: ``[{"label", "score"}]`` of the ``k`` most probable
        classes, top-1 first (``k``: ``options.topk``, else :attr:`inference`'s, at most ``C``)."""
        names = self.class_names or []
        probs = outputs[0].float().softmax(-1)  # (B, C)
        k = max(1, min(int(getattr(options, "topk", None) or self.inference.topk), probs.shape[-1]))
        scores, classes = probs.topk(k, dim=-1)  # (B, k), sorted: top-1 first
        records = []
        for top_scores, top_classes in zip(scores.tolist(), classes.tolist(), strict=True):
            topk = [{"label": names[c], "score": float(p)} for c, p in zip(top_classes, top_scores, strict=True)]
            records.append({"pred": topk[0]["label"], "score": topk[0]["score"], "topk": topk})
        return records

    def explain_batch(self, images, pictures, options, truths=None):
        """The input (as the model sees it) and one overlay per method (``options.methods``)."""
        return explain_classification(self, images, pictures, options, truths)

    def explain_eval(self, dataset, options, out_dir, report=None) -> dict[str, float]:
        """Overlays of ``options.num_overlays`` images and faithfulness metrics (``eval.py``), and
        the mistakes browser of every misclassified image (:attr:`eval_mistakes`, ``mistakes.html``:
        :func:`~vision_attn.explain.task_mistakes.classification_mistakes`)."""
        metrics = explain_eval_split(self, dataset, options, out_dir, report)
        self.eval_mistakes = classification_mistakes(self, dataset, self.eval_records, options) \
            if self.eval_records else None
        return metrics

    # ------------------------------------------------------------------ report.html
    def rank_mistakes(self, dataset, predictions, k, options=None) -> list[int]:
        """The most confident wrong predictions (:func:`~vision_attn.tasks.classification_report.rank_mistakes`)."""
        return classification_report.rank_mistakes(dataset, predictions, k)

    def report_sections(self, files, metrics) -> list[Section]:
        """The per-class table and the confusion matrix (:mod:`~vision_attn.tasks.classification_report`)."""
        return classification_report.result_sections(files, metrics)

    def mistake_cards(self, items, predictions, limit=DEFAULT_MISTAKES) -> Mistakes:
        """The most confident wrong predictions (:func:`~vision_attn.tasks.classification_report.mistake_cards`)."""
        return classification_report.mistake_cards(items, predictions, limit)
