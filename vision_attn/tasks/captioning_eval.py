"""Validation and test of the captioning task: beam-searched captions per image, gathered from
every process, scored by BLEU / CIDEr-D / ROUGE-L, image dependence, METEOR / SPICE where Java
runs, and content accuracy where the split has instance annotations."""

from __future__ import annotations

import logging
from typing import Any

from vision_attn.data.tokenizer import normalize_caption
from vision_attn.distributed import unique_records
from vision_attn.errors import ConfigError
from vision_attn.metrics.breakdown import precision_recall_f1
from vision_attn.metrics.caption import (
    caption_metrics,
    caption_metrics_per_image,
    image_dependence,
    java_metrics,
)
from vision_attn.metrics.caption_content import content_accuracy
from vision_attn.metrics.reference_content import ContentVocabulary, reference_checks, reference_content

__all__ = ["CaptionEvaluation", "caption_result_files"]

log = logging.getLogger("vision_attn.tasks.captioning")  # the task's logger: its messages read as before


class CaptionEvaluation:
    """The validation and test steps of :class:`~vision_attn.tasks.captioning.CaptioningTask` and
    the metrics of its records (a mixin: it reads the task's decoder, tokenizer and generation
    options)."""

    def _eval_step(self, batch, beam_size: int) -> None:
        images, tokens, indices = batch[:3]
        loss = self._loss(images, tokens)
        self.log(f"{self._stage}/loss", loss, prog_bar=True, on_epoch=True, batch_size=len(images), sync_dist=True)
        gen = self.generate(images, beam_size=beam_size)
        for i, text in zip(indices.tolist(), self.decode(gen.tokens), strict=True):
            self.eval_records.append({"index": i, "caption": text})

    def on_validation_epoch_start(self) -> None:
        self._stage, self.eval_records = "val", []

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.training_config.val_beam_size)

    def on_validation_epoch_end(self) -> None:
        dataset = self.trainer.val_dataloaders.dataset
        records = unique_records(self.eval_records, "index", sort=True)  # DDP pads with repeats
        if self.trainer.sanity_checking or not records:
            return
        metrics = self._score(dataset, records)
        for k, v in metrics.items():
            self.log(f"val/{k}", v, prog_bar=k in ("bleu4", "cider"))  # the same on every process (gathered records)

    def on_test_epoch_start(self) -> None:
        self._stage, self.eval_records = "test", []
        self._content_vocabulary()  # a bad --explain.content_words file is refused before the images run

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.generation.beam_size)

    def on_test_epoch_end(self) -> None:
        self.eval_records = unique_records(self.eval_records, "index", sort=True)  # DDP pads with repeats

    @staticmethod
    def _pairs(dataset, records: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, list[str]]]:
        """``({index: caption}, {index: normalised references})`` of the records."""
        hyps = {r["index"]: r["caption"] for r in records}
        refs = {r["index"]: [normalize_caption(c) for c in dataset.references[r["index"]]] for r in records}
        return hyps, refs

    @classmethod
    def _score(cls, dataset, records: list[dict[str, Any]]) -> dict[str, float]:
        """Validation's metrics: BLEU / CIDEr-D / ROUGE-L, the content words checked against the
        references, and content accuracy where the split has instance annotations (so a run's
        curves show whether the captions name what is there)."""
        hyps, refs = cls._pairs(dataset, records)
        return {**caption_metrics(hyps, refs), **reference_content(hyps, refs), **cls._content(dataset, hyps)}

    def _content_vocabulary(self) -> ContentVocabulary | None:
        """The object words of ``--explain.content_words`` (``None``: found in the references)."""
        path = getattr(self.evaluation_options, "content_words", None)
        if not path:
            return None
        try:
            return ContentVocabulary.from_file(path)
        except ValueError as err:
            raise ConfigError(f"--explain.content_words: {err}") from None

    def eval_results(self, dataset) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """``(metrics, predictions)``.

        Metrics: BLEU-1..4, CIDEr-D, ROUGE-L, ``image_dependence`` (two images or more),
        ``meteor`` / ``spice`` where the COCO toolkit's Java can run (on the main process;
        else logged), the content words against the references (``objects_exact``,
        ``relations_exact``, ``hallucination_rate``, ``hallucinated_captions``,
        ``content_vocabulary``: :func:`~vision_attn.metrics.reference_content.reference_content`)
        and content accuracy (``content_exact``, ``kinds_exact``,
        ``content_precision``, ``content_recall``, ``count_acc``, ``content_images``) when
        the split has instance annotations. Predictions: ``[{"image_id", "caption",
        "cider"}]`` with the image's CIDEr-D.
        """
        if not self.eval_records:
            raise RuntimeError("no evaluation records: run trainer.test(...) first")
        hyps, refs = self._pairs(dataset, self.eval_records)
        metrics, per_image = caption_metrics_per_image(hyps, refs)
        if len(hyps) >= 2:
            metrics["image_dependence"] = image_dependence(hyps, refs, true_cider=metrics["cider"])
        else:
            log.info("image_dependence not computed: it needs at least two images, the split has %d", len(hyps))
        vocab = self._content_vocabulary()
        metrics.update(reference_content(hyps, refs, vocab))
        self.eval_caption_files = caption_result_files(dataset, self.eval_records, hyps, refs, per_image,
                                                       vocab or ContentVocabulary.from_references(refs))
        metrics.update(self._content(dataset, hyps))
        if self._trainer is None or self.trainer.is_global_zero:
            metrics.update(java_metrics(hyps, refs))
        predictions = [{"image_id": dataset.images[r["index"]]["id"], "caption": r["caption"],
                        "cider": per_image[r["index"]]["cider"]} for r in self.eval_records]
        return metrics, predictions

    eval_file_names = ("per_class.csv", "results_per_image.json", "results_per_image.csv")

    def eval_files(self, dataset) -> dict[str, Any]:
        """The object-by-object files of the last :meth:`eval_results`
        (:func:`caption_result_files`)."""
        if getattr(self, "eval_caption_files", None) is None:
            raise RuntimeError("no per-image results: call eval_results(...) after trainer.test(...) first")
        return self.eval_caption_files

    @staticmethod
    def _content(dataset, hyps: dict[int, str]) -> dict[str, float]:
        """Content accuracy of the captions (``{}``, logged, without instance annotations)."""
        annotated = dataset.annotated_objects() if hasattr(dataset, "annotated_objects") else None
        if annotated is None:
            where = getattr(dataset, "instances_file", "the dataset")
            log.info("content accuracy not computed: no instance annotations (%s)", where)
            return {}
        scores = content_accuracy({dataset.images[i]["id"]: text for i, text in hyps.items()}, annotated)
        if not scores:
            log.info("content accuracy not computed: no evaluated image is in %s", dataset.instances_file)
        return scores


def caption_result_files(dataset, records: list[dict[str, Any]], hyps: dict[int, str], refs: dict[int, list[str]],
                         per_image: dict[int, dict[str, float]], vocab: ContentVocabulary) -> dict[str, Any]:
    """``results_per_image.json`` / ``.csv`` and ``per_class.csv`` of a captioning evaluation.

    Per image: ``image_id``, ``file_name``, ``caption``, ``references`` (normalised; the CSV joins
    them with `` | ``), ``cider`` (CIDEr-D), and the content checks against the references
    (:func:`~vision_attn.metrics.reference_content.reference_checks`: ``objects_exact``,
    ``relations_exact``, ``hallucinated`` object words; empty without references or object
    words). Per object word (``per_class.csv``): ``said`` (captions naming it), ``referenced``
    (images whose references name it), ``tp`` (both), ``fp``, ``fn``, precision, recall and F1.
    """
    images: list[dict[str, Any]] = []
    words: dict[str, list[int]] = {}  # object word -> [tp, fp, fn] over the images
    for r in records:
        i = r["index"]
        check = reference_checks(hyps[i], refs[i], vocab) if refs[i] and vocab.objects else None
        im = dataset.images[i]
        images.append({"image_id": im["id"], "file_name": im.get("file_name"), "caption": r["caption"],
                       "references": refs[i], "cider": per_image[i]["cider"],
                       "objects_exact": None if check is None else check["objects_exact"],
                       "relations_exact": None if check is None else check["relations_exact"],
                       "hallucinated": [] if check is None else check["hallucinated"]})
        if check is not None:
            named, referenced = set(check["named"]), set(check["referenced"])
            for word in named | referenced:
                counts = words.setdefault(word, [0, 0, 0])
                counts[0 if word in named and word in referenced else (1 if word in named else 2)] += 1
    rows = []
    for word in sorted(words):
        tp, fp, fn = words[word]
        precision, recall, f1 = precision_recall_f1(tp, fp, fn)
        rows.append({"class": word, "said": tp + fp, "referenced": tp + fn, "tp": tp, "fp": fp, "fn": fn,
                     "precision": precision, "recall": recall, "f1": f1})
    flat = [{**e, "references": " | ".join(e["references"]), "hallucinated": " ".join(e["hallucinated"])}
            for e in images]
    return {"per_class.csv": rows, "results_per_image.json": images, "results_per_image.csv": flat}
