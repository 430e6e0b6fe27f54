"""A fourth task, outside vision_attn: multi-label "which shape kinds are in the image".

Its report comes through the task's hooks alone: a headline metric (:attr:`headline_metric`), a
per-label table built from its own ``per_label.json`` (:meth:`report_sections`), and a mistakes
gallery of the images with the most wrong labels (:meth:`rank_mistakes`, which ``eval.py`` explains,
and :meth:`mistake_cards`); its overlays are drawn by the default ``explain_eval``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import Dataset

from vision_attn.blocks import Column, Mistake, Mistakes, Section, Strong, Table
from vision_attn.data import SceneSetConfig, ensure_shapes_coco, read_image, transforms
from vision_attn.data.loading import SplitDataModule
from vision_attn.explain import explain_classifier
from vision_attn.explain.evaluate import DEFAULT_MISTAKES, explanation_panel
from vision_attn.explain.records import Report, png_data_uri
from vision_attn.models import ViTEncoder
from vision_attn.models.classifier import ClassificationHead
from vision_attn.tasks.base import Explained, VisionTask, gather_objects, register_task
from vision_attn.tasks.optim import DEFAULT_OPTIM, Optimization


class ShapeSets(Dataset):
    """One split of the embedded shape scenes: items ``(image [3, H, W], multi-hot [C], index)``."""

    def __init__(self, root: Path, split: str, transform: Any) -> None:
        ann = json.loads((root / "annotations" / f"instances_{split}.json").read_text())
        cats = sorted(ann["categories"], key=lambda c: c["id"])
        label = {c["id"]: k for k, c in enumerate(cats)}
        row = {im["id"]: k for k, im in enumerate(ann["images"])}
        self.root, self.transform, self.class_names = root, transform, [c["name"] for c in cats]
        self.files = [f"{split}/{im['file_name']}" for im in ann["images"]]
        self.targets = torch.zeros(len(self.files), len(cats))  # [N, C] multi-hot
        for a in ann["annotations"]:
            self.targets[row[a["image_id"]], label[a["category_id"]]] = 1.0

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        return self.transform(read_image(self.root / self.files[i])), self.targets[i], i

    def relative_file(self, i: int) -> str:
        """Image ``i``'s path relative to the root: its name in predictions.json and the report."""
        return self.files[i]


class ShapeSetsDataModule(SplitDataModule):
    """The embedded scenes as multi-label data (plain arguments: checkpoints keep them)."""

    def __init__(self, image_size: int = 32, num_train: int = 96, num_val: int = 24, batch_size: int = 16,
                 num_workers: int = 0, cache_dir: str | None = None) -> None:
        super().__init__()
        self.root = ensure_shapes_coco(SceneSetConfig(image_size=image_size, num_train=num_train, num_val=num_val,
                                                      max_objects=3, min_size=0.3, captions_per_image=1), cache_dir)
        self.train_split, self.val_split, self.datasets = "train", "val", {}
        self.batch_size, self.num_workers = batch_size, num_workers
        self.class_names = ShapeSets(self.root, "val", None).class_names

    def dataset(self, split: str, train: bool = False) -> ShapeSets:
        whole = transforms.whole_image(transforms.model_preprocess(self))  # as the task predicts: no crop
        return ShapeSets(self.root, split, transforms.build_eval_transform(whole))


@dataclass
class LabelOptions:
    """The multi-label task's own inference options (``--labels.threshold`` of ``predict``, ``explain``
    and ``eval.py``).

    Attributes:
        threshold: a shape kind is named when its probability is at least this (``None``: the model's).
    """

    threshold: float | None = None


@register_task
class MultiLabelTask(VisionTask):
    """ViT + mean-pooled linear head, one sigmoid per shape kind (binary cross-entropy)."""

    task_name = "multilabel"
    inference_options, inference_group = LabelOptions, "labels"
    crop_at_inference = False  # a crop could cut a shape off
    export_output_names = ("logits",)
    headline_metrics = ("f1_micro", "exact_match")
    headline_metric = "exact_match"  # the report's summary line: a whole label set right or not
    eval_file_names = ("per_label.json",)
    overlay_description = "input | one overlay per method (explaining the most likely shape kind)"

    def __init__(self, encoder: ViTEncoder, class_names: list[str] | None = None, threshold: float = 0.5,
                 optim: Optimization = DEFAULT_OPTIM, compile: bool = False) -> None:
        super().__init__(encoder, optim, compile)
        self.save_hyperparameters(ignore=["encoder", "optim"])
        self.threshold, self.class_names, self.head, self.eval_records = threshold, None, None, []
        self.per_label: dict[str, dict[str, float]] = {}  # per_label.json of the last eval_results
        if class_names is not None:  # rebuilt from a checkpoint
            self.build_from_data(SimpleNamespace(class_names=class_names))

    def set_inference_options(self, options: LabelOptions) -> None:
        super().set_inference_options(options)
        if options.threshold is not None:
            self.threshold = options.threshold

    def build_from_data(self, datamodule) -> None:
        self.class_names = self.hparams["class_names"] = list(datamodule.class_names)
        self.head = ClassificationHead(self.encoder.embed_dim, len(self.class_names), "mean")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(images))  # [B, C] logits

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        stage = "train" if self.training else ("test" if self.trainer.testing else "val")
        images, targets, index = batch  # [B, 3, H, W], [B, C] multi-hot, [B] dataset indices
        logits = self(images)  # [B, C]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
        self.log(f"{stage}/loss", loss, on_step=stage == "train", on_epoch=True, batch_size=len(targets))
        if stage == "test":
            self.eval_records += [{"index": i, "target": t, "logits": z} for i, t, z in
                                  zip(index.tolist(), targets.cpu(), logits.detach().float().cpu(), strict=True)]
        return loss

    validation_step = test_step = training_step

    def on_test_epoch_start(self) -> None:
        self.eval_records = []

    def eval_results(self, dataset: ShapeSets) -> tuple[dict[str, float], list[dict[str, Any]]]:
        unique = {r["index"]: r for r in gather_objects(self.eval_records)}  # every process's, once each
        records = [unique[i] for i in sorted(unique)]
        logits = torch.stack([r["logits"] for r in records])  # [N, C]
        pred, truth = logits.sigmoid() >= self.threshold, torch.stack([r["target"] for r in records]) > 0
        f1 = 2 * (pred & truth).sum() / (pred.sum() + truth.sum()).clamp(min=1)
        metrics = {"f1_micro": float(f1), "exact_match": float((pred == truth).all(1).float().mean())}
        hits, n_pred, n_true = (pred & truth).sum(0), pred.sum(0), truth.sum(0)  # [C] each
        self.per_label = {name: {"n": int(n_true[c]), "precision": float(hits[c] / n_pred[c].clamp(min=1)),
                                 "recall": float(hits[c] / n_true[c].clamp(min=1))}
                          for c, name in enumerate(self.class_names)}
        predictions = [{"file": dataset.files[r["index"]], "truth": self._names(r["target"] > 0), **rec}
                       for r, rec in zip(records, self.predictions_from_outputs((logits,), []), strict=True)]
        return metrics, predictions

    def _names(self, mask: torch.Tensor) -> list[str]:
        return [n for n, m in zip(self.class_names, mask.tolist(), strict=True) if m]

    def export_forward(self, images: torch.Tensor) -> tuple[torch.Tensor]:
        return (self(images),)

    def predictions_from_outputs(self, outputs, sizes, options=None) -> list[dict[str, Any]]:
        """``{"labels": shape kinds present, "scores": {kind: probability}}`` per image."""
        probs = outputs[0].float().sigmoid()  # [B, C]
        return [{"labels": self._names(p >= self.threshold),
                 "scores": dict(zip(self.class_names, p.tolist(), strict=True))} for p in probs]

    def explain_batch(self, images, pictures, options, truths=None) -> list[Explained]:
        expl = explain_classifier(self, images, options.methods, head_fusion=options.head_fusion,
                                  discard_ratio=options.discard_ratio)
        draw = transforms.build_display_transform(self.inference_data_config())  # what the model sees
        out = []
        for j, record in enumerate(self.predictions_from_outputs((expl.logits,), [], options)):
            display = draw(pictures[j])
            caption = (f"{truths[j]} -> " if truths is not None else "") + ("+".join(record["labels"]) or "none")
            panel = explanation_panel(display, expl.maps, j, caption, options.alpha)
            item = {"text": caption, "image": Report.display_image(display), "panels": [png_data_uri(panel)]}
            out.append(Explained(record, panel, item))
        return out

    def eval_files(self, dataset: ShapeSets) -> dict[str, Any]:
        """``per_label.json``: ``{shape kind: {"n", "precision", "recall"}}`` of the last evaluation."""
        return {"per_label.json": self.per_label}

    def truth_text(self, dataset: ShapeSets, index: int) -> str:
        """The shape kinds of image ``index``, drawn on its overlay by the default ``explain_eval``."""
        return "+".join(self._names(dataset.targets[index] > 0))

    # ------------------------------------------------------------------ report.html
    def report_sections(self, files: dict[str, Any], metrics: dict[str, float]) -> list[Section]:
        """``per_label.json`` as a table, the worst recall first."""
        per_label = files.get("per_label.json") or {}
        rows = [[name, int(r["n"]), r["precision"], r["recall"]]
                for name, r in sorted(per_label.items(), key=lambda kv: (kv[1]["recall"], kv[0]))]
        table = Table(["shape kind", "n", Column("precision", bar=True), Column("recall", bar=True)], rows,
                      title="Per shape kind (worst recall first)", id="per-label")
        return [Section("Labels", [table], note="Precision and recall of each shape kind over the split.")]

    @staticmethod
    def _wrong(record: dict[str, Any]) -> list[str]:
        """The shape kinds a prediction got wrong: missed or added."""
        return sorted(set(record.get("truth") or []) ^ set(record.get("labels") or []))

    def rank_mistakes(self, dataset: ShapeSets, predictions, k: int, options=None) -> list[int]:
        """The images with the most wrong shape kinds, then split order."""
        where = {f: i for i, f in enumerate(dataset.files)}
        wrong = [(-len(self._wrong(r)), where[r["file"]]) for r in predictions
                 if r.get("file") in where and self._wrong(r)]
        return [i for _, i in sorted(wrong)[:k]]

    def mistake_cards(self, items, predictions, limit: int = DEFAULT_MISTAKES) -> Mistakes | None:
        """The split's images with the most wrong shape kinds: truth → predicted, the kinds wrong."""
        if predictions is None:
            return None
        wrong = sorted((r for r in predictions if self._wrong(r)), key=lambda r: -len(self._wrong(r)))
        cards = [Mistake(r["file"], head=[Strong("+".join(r["truth"]) or "none"), " → ",
                                          Strong("+".join(r["labels"]) or "none"), " "],
                         tail=f" — wrong: {', '.join(self._wrong(r))}", score=float(len(self._wrong(r))))
                 for r in wrong[:limit]]
        return Mistakes(cards, intro=f"{len(wrong)} images with a wrong label set; the {len(cards)} with the most "
                                     "wrong shape kinds first.", empty="Every label set is right.")
