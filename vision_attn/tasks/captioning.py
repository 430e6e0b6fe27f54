"""Captioning system: ViT encoder + caption decoder, teacher forcing, beam search, caption metrics.

``eval.py`` reports BLEU-1..4, CIDEr-D, ROUGE-L, image dependence, METEOR / SPICE where Java can
run them (:mod:`vision_attn.metrics.caption`) and, when the split has instance annotations,
content accuracy (:mod:`vision_attn.metrics.caption_content`); ``predictions.json`` items carry their
image's CIDEr-D (``"cider"``: their mean is the corpus ``cider``).

Training is teacher-forced cross-entropy, or (``scst.enabled``, usually started from a
cross-entropy checkpoint with ``training.init_from``) self-critical sequence training, Rennie et
al. 2017 (:mod:`vision_attn.losses.scst`; ``configs/captioning/scst.yaml``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.blocks import Mistakes
from vision_attn.data.tokenizer import WordTokenizer
from vision_attn.distributed import mean_across_processes
from vision_attn.errors import CheckpointError, ConfigError, DataError
from vision_attn.explain.captioning import explain_captioning, write_caption_overlays
from vision_attn.explain.evaluate import DEFAULT_MISTAKES
from vision_attn.explain.task_mistakes import caption_mistakes
from vision_attn.metrics.caption import CiderD
from vision_attn.models.captioner import (
    DEFAULT_DECODER,
    CaptionDecoder,
    DecoderConfig,
    Generation,
    GenerationOptions,
)
from vision_attn.models.encoder import EncoderOutput, ViTEncoder
from vision_attn.tasks import captioning_report
from vision_attn.tasks.base import (
    VisionTask,
    read_task_meta,
    register_task,
    restore_from_checkpoint,
)
from vision_attn.tasks.captioning_config import (
    CAPTION_GENERATION,
    CaptionTraining,
    SCSTConfig,
    check_generation,
)
from vision_attn.tasks.captioning_eval import CaptionEvaluation
from vision_attn.tasks.captioning_losses import (  # noqa: F401 (re-exported: tests and configs name them here)
    GROUNDING_BACKGROUND_WEIGHT,
    WORD_ATTENTION_SKIP,
    _owner_labels,
    class_regions,
    concept_targets,
    concept_vocabulary,
    grounding_weights,
    idf_token_weights,
    patch_objects,
    patch_targets,
    repeat_images,
    word_attention_loss,
    word_attention_targets,
    word_kinds,
)
from vision_attn.tasks.captioning_scst import CaptionSelfCritical
from vision_attn.tasks.optim import Optimization

CAPTIONING_OPTIM = Optimization(lr=5e-4)
CAPTION_TRAINING = CaptionTraining()
CAPTION_SCST = SCSTConfig()

# what ``init_from`` compares between the checkpoint and the configured model (else a clear error)
DECODER_ARCHITECTURE = ("hidden_dim", "num_layers", "num_heads", "mlp_ratio", "max_length", "embedding_memory",
                        "pixel_memory")
ENCODER_ARCHITECTURE = ("name", "img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "stem",
                        "lsa", "timm_kwargs")

__all__ = ["CaptioningTask", "CaptionTraining", "SCSTConfig"]

log = logging.getLogger(__name__)


@register_task
class CaptioningTask(CaptionSelfCritical, CaptionEvaluation, VisionTask):
    """Image captioning on a ViT encoder.

    The vocabulary comes from the data (the tokenizer trained on the training captions) when
    training starts, and is saved in checkpoints; ``eval.py`` uses the checkpoint's.

    Args:
        encoder: the ViT encoder.
        vocab: the tokenizer's ``tokenizers`` JSON (a word list in older checkpoints; default:
            from the data).
        decoder: the caption decoder's width, depth, heads, dropout, longest caption in tokens
            (``<bos>``, ``<eos>`` included) and extra memory paths
            (:class:`~vision_attn.models.captioner.DecoderConfig`; ``--model.decoder.hidden_dim``
            etc.). ``embedding_memory``: the decoder also reads the stem's patch embeddings, so
            low-level evidence (an object's colour) reaches the words even where the encoder's
            output tokens are dominated by what the grounding loss asks for (it stops the colour
            collapse of the grounded recipe's bad draws, docs/results/captioning.md). ``pixel_memory``:
            each patch's own pixels too — with a fast-learning encoder (``optim.encoder_lr``) the
            stem's embeddings lost the colours on some seeds. Both off by default; a checkpoint
            remembers them.
        generate: how evaluation and prediction decode
            (:class:`~vision_attn.models.captioner.GenerationOptions`; default
            :data:`~vision_attn.tasks.captioning_config.CAPTION_GENERATION`: beam 3, length
            penalty 1, ``min_length`` 0, repetition penalty 1, ``max_length`` ``None`` = the
            decoder's ``max_length - 1``); ``eval.py --generate.*`` overrides them for one run.
        training: the cross-entropy training: label smoothing, word dropout, the auxiliary
            grounding, word-attention and concept losses, a frozen encoder, validation's beam and
            the checkpoint whose weights it starts from (:class:`CaptionTraining`;
            ``--model.training.grounding_weight`` etc.).
        scst: self-critical sequence training instead of cross-entropy (:class:`SCSTConfig`;
            ``--model.scst.enabled true``).
        optim: learning rates, weight decay and schedule (default ``CAPTIONING_OPTIM``;
            ``--model.optim.lr`` etc.).
        compile: ``torch.compile`` the encoder when training or evaluation starts (a run-time
            choice: not stored in checkpoints).
    """

    task_name = "captioning"
    inference_options = GenerationOptions  # --generate.beam_size etc.
    inference_group = "generate"
    built_from = "tokenizer vocabulary"
    source_args = ("training.init_from",)  # a checkpoint to start from: never read because a checkpoint names it
    legacy_arguments = {
        **{k: f"decoder.{k}" for k in ("hidden_dim", "num_layers", "num_heads", "mlp_ratio", "dropout", "max_length",
                                       "embedding_memory", "pixel_memory")},
        **{k: f"generate.{k}" for k in ("beam_size", "length_penalty", "min_length", "repetition_penalty")},
        **{k: f"training.{k}" for k in (
            "label_smoothing", "word_dropout", "freeze_encoder", "val_beam_size", "init_from", "grounding_weight",
            "grounding_balance", "grounding_classes", "word_attention_weight", "concept_weight",
            "concept_max_share", "concept_words", "concept_tokens", "idf_weight")},
        "scst": "scst.enabled",
        **{f"scst_{k}": f"scst.{k}" for k in ("samples", "baseline", "max_length", "temperature", "dropout")},
    }
    monitor = ("val/cider", "max")
    crop_at_inference = False  # a centre crop would cut objects off: the whole image, resized
    export_output_names = ("tokens",)  # the encoder's; beam search stays in PyTorch
    onnx_predicts = False
    headline_metrics = ("bleu1", "bleu4", "cider", "kinds_exact", "content_exact", "image_dependence",
                        "pointing_lrp_attention", "pointing_attention", "pointing_random")
    headline_metric = "cider"
    overlay_description = ("the caption, then each word's map: AttnLRP gated by the word's cross-attention, and raw "
                            "cross-attention (one strip each)")

    def __init__(
        self,
        encoder: ViTEncoder,
        vocab: list[str] | str | None = None,
        decoder: DecoderConfig = DEFAULT_DECODER,
        generate: GenerationOptions = CAPTION_GENERATION,
        training: CaptionTraining = CAPTION_TRAINING,
        scst: SCSTConfig = CAPTION_SCST,
        optim: Optimization = CAPTIONING_OPTIM,
        compile: bool = False,
    ) -> None:
        super().__init__(encoder, optim, compile)
        # the groups are dataclasses: kept as plain mappings in hparams (what checkpoints store);
        # init_from says where this run started, not what the model is
        self.save_hyperparameters(ignore=["encoder", "optim", "decoder", "generate", "training", "scst"])
        self.decoder_config, self.scst_config = decoder, scst
        self.training_config = training
        self.save_hyperparameters({"decoder": dataclasses.asdict(decoder), "generate": dataclasses.asdict(generate),
                                   "training": self._training_hparams(), "scst": dataclasses.asdict(scst)})
        self.head: CaptionDecoder | None = None
        self.grounding_head: torch.nn.Linear | None = None
        self.word_kinds: Tensor | None = None  # [V]: the category each word names (word_attention_weight)
        self.concept_head: torch.nn.Linear | None = None
        self.concept_table: Tensor | None = None  # [training images, concepts]: the targets, by dataset index
        self.token_weights: Tensor | None = None  # [vocabulary]: idf_weight's target-word weights (training only)
        self.class_names = None
        self.tokenizer: WordTokenizer | None = None
        chosen = {f.name: getattr(generate, f.name) for f in dataclasses.fields(generate)}
        defaults = {**dataclasses.asdict(CAPTION_GENERATION), "max_length": decoder.max_length - 1}
        self.generation = GenerationOptions(**{k: defaults[k] if v is None else v for k, v in chosen.items()})
        check_generation(self.generation, "--model.generate")
        if self.generation.max_length > decoder.max_length - 1:
            raise ConfigError(f"--model.generate.max_length must be at most decoder.max_length - 1 = "
                              f"{decoder.max_length - 1} (or null), got {self.generation.max_length!r}")
        self.eval_records: list[dict[str, Any]] = []
        if scst.max_length is not None and not 1 <= scst.max_length <= decoder.max_length - 1:
            raise ConfigError(f"--model.scst.max_length must be between 1 and decoder.max_length - 1 = "
                              f"{decoder.max_length - 1} (or null), got {scst.max_length!r}")
        self.scst_cider: CiderD | None = None  # CIDEr-D statistics of the training references (SCST, built once)
        self.scst_references: list[list[str]] | None = None
        self.init_from = training.init_from
        if training.freeze_encoder:
            self.encoder.requires_grad_(False)
        if self.init_from is not None:
            self._start_from(self.init_from, vocab)
        elif vocab is not None:
            self._build(vocab)

    def _training_hparams(self) -> dict[str, Any]:
        """:attr:`training_config` as ``hparams`` keep it: without ``init_from``."""
        stored = dataclasses.asdict(self.training_config)
        stored.pop("init_from")
        return stored

    def _store_training(self, **learned: Any) -> None:
        """Set fields of :attr:`training_config` learned from the data (``grounding_classes``,
        ``concept_words``) and keep the group in ``hparams``."""
        self.training_config = dataclasses.replace(self.training_config, **learned)
        self.hparams["training"] = self._training_hparams()

    def _start_from(self, path: str, vocab: list[str] | str | None) -> None:
        """Load the weights (only) of the captioning checkpoint ``path`` (see ``init_from``)."""
        what = f"--model.training.init_from {path}"
        meta, ckpt = read_task_meta(path)
        if meta.get("task") != self.task_name:
            raise CheckpointError(f"{what} holds a {meta.get('task')!r} model, not a captioning one; start from a "
                                  "checkpoint of a captioning run of train.py")
        stored = meta["model"]["init_args"]
        if stored.get("vocab") is None:
            raise CheckpointError(f"{what} does not store the model's tokenizer vocabulary; use a checkpoint "
                                  "written by train.py")
        theirs = WordTokenizer.restore(stored["vocab"])
        if vocab is not None and WordTokenizer.restore(vocab).vocab != theirs.vocab:
            raise CheckpointError(f"{what}: its vocabulary ({len(theirs)} tokens) is not the one given in "
                                  "--model.vocab; leave --model.vocab out (the checkpoint's is used)")
        theirs_decoder, ours_decoder = stored.get("decoder") or {}, self.hparams["decoder"]
        for key in DECODER_ARCHITECTURE:
            if key in theirs_decoder and theirs_decoder[key] != ours_decoder[key]:
                raise CheckpointError(f"{what} was trained with model.decoder.{key}={theirs_decoder[key]!r}, this "
                                      f"model has {ours_decoder[key]!r}; configure the checkpoint's (its run's "
                                      "config.yaml)")
        ours = self.encoder.architecture_config()["init_args"]
        enc = stored["encoder"]["init_args"]
        for key in ENCODER_ARCHITECTURE:
            if key in enc and key in ours and enc[key] != ours[key]:
                raise CheckpointError(f"{what} was trained with model.encoder.{key}={enc[key]!r}, this model has "
                                      f"{ours[key]!r}; configure the checkpoint's (its run's config.yaml)")
        learned = stored.get("training") or {}
        self._store_training(grounding_classes=learned.get("grounding_classes"),
                             concept_words=learned.get("concept_words"))
        self._build(stored["vocab"])
        restore_from_checkpoint(self, meta, ckpt, what)
        self.train()
        log.info("captioning weights, vocabulary and preprocessing from %s (optimiser and schedule start afresh)",
                 path)

    def _build(self, vocab: list[str] | str) -> None:
        config = self.decoder_config
        self.tokenizer = WordTokenizer.restore(vocab)
        self.head = CaptionDecoder(len(self.tokenizer), self.encoder.embed_dim, config, self.tokenizer.pad_id,
                                   pixel_dim=self._pixel_dim() if config.pixel_memory else None)
        # the decoder (embedding_memory) or the concept head (concept_tokens) reads what the encoder then returns
        self.encoder.keep_embedding = config.embedding_memory or self.training_config.concept_tokens == "embedding"
        self.encoder.keep_pixels = config.pixel_memory
        classes = self.training_config.grounding_classes
        self.grounding_head = self._grounding_head(classes) if classes else None
        self._word_kinds_for(classes)
        if self.grounding_head is not None and not self._grounding_active:
            # kept for the checkpoint, but no gradient reaches it (DDP requires every trained parameter used)
            self.grounding_head.requires_grad_(False)
        words = self.training_config.concept_words
        self.concept_head = self._concept_head(words) if words else None
        if self.concept_head is not None and not self._concept_active:
            self.concept_head.requires_grad_(False)  # as the grounding head
        self.hparams.update(vocab=self.tokenizer.to_json())

    def _word_kinds_for(self, classes: list[str] | None) -> None:
        """:attr:`word_kinds` (:func:`word_kinds` of the vocabulary) for the word-attention loss."""
        self.word_kinds = word_kinds(self.tokenizer.vocab, classes) if classes and self._word_attention_active else None

    def _pixel_dim(self) -> int:
        """Values per patch of the encoder's pixel tokens (``pixel_memory``)."""
        ph, pw = self.encoder.patch_size
        return 3 * ph * pw

    def _grounding_head(self, classes: list[str]) -> torch.nn.Linear:
        """Per patch token: the logits of background and of each of ``classes``."""
        return torch.nn.Linear(self.encoder.embed_dim, len(classes) + 1)

    @property
    def _word_attention_active(self) -> bool:
        """Whether training adds the word-attention loss (a weight > 0, cross-entropy training)."""
        return self.training_config.word_attention_weight > 0 and not self.scst_config.enabled

    @property
    def _grounding_active(self) -> bool:
        """Whether training adds the grounding loss (a weight > 0, cross-entropy training)."""
        return self.training_config.grounding_weight > 0 and not self.scst_config.enabled

    def _concept_head(self, words: list[str]) -> torch.nn.Linear:
        """Per patch token: a score for each of the concept ``words``."""
        return torch.nn.Linear(self.encoder.embed_dim, len(words))

    @property
    def _concept_active(self) -> bool:
        """Whether training adds the concept loss (a weight > 0, cross-entropy training)."""
        return self.training_config.concept_weight > 0 and not self.scst_config.enabled

    def build_from_data(self, datamodule) -> None:
        if self._grounding_active:
            self._store_training(grounding_classes=self._attach_boxes(datamodule))
        if self._concept_active:
            self._store_training(concept_words=self._concepts(datamodule, None))
        self._build(datamodule.tokenizer.to_json())

    def _concepts(self, datamodule, words: list[str] | None) -> list[str] | None:
        """The concept words (``words``, or chosen from the training references) and, as
        :attr:`concept_table`, their targets per training image; ``None`` without a training
        split of COCO captions (logged)."""
        if not hasattr(datamodule, "train_references"):
            log.warning("--model.training.concept_weight %g: the data has no training split of COCO captions; "
                        "no concept loss", self.training_config.concept_weight)
            return None
        references = datamodule.train_references()
        if words is None:
            share = self.training_config.concept_max_share
            words = concept_vocabulary(references, share)
            log.info("concept loss: %d words used by at most %.0f%% of the %d training images' references",
                     len(words), 100 * share, len(references))
        self.concept_table = concept_targets(references, words)
        return words

    def _attach_boxes(self, datamodule) -> list[str] | None:
        """Attach the training split's boxes to its items (``grounding_weight``), labelled by
        the model's categories where it has them; the category names, or ``None`` when the
        split has no instances file (logged)."""
        dataset = getattr(datamodule, "datasets", {}).get("train")
        if dataset is None or not hasattr(dataset, "attach_boxes"):
            log.warning("--model.training.grounding_weight %g: the data has no training split of COCO captions; "
                        "training on the captions alone", self.training_config.grounding_weight)
            return None
        found = dataset.attach_boxes(self.training_config.grounding_classes)
        if found is None:
            log.warning("--model.training.grounding_weight %g: %s does not exist, so the encoder learns from the "
                        "captions alone", self.training_config.grounding_weight, dataset.instances_file)
        return found

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if stage == "fit" and self.scst_config.enabled and self.init_from is None and not self.trainer.ckpt_path:
            log.warning("self-critical training from scratch: it is a second phase; start it from a cross-entropy "
                        "checkpoint with --model.training.init_from CKPT (configs/captioning/scst.yaml)")
        if self.head is None:
            if dm is None or not hasattr(dm, "tokenizer"):
                raise DataError("CaptioningTask needs a captioning datamodule (it trains the tokenizer)")
            self.build_from_data(dm)
        else:
            if self.init_from is not None and stage == "fit" and hasattr(dm, "tokenizer") \
                    and dm.tokenizer.vocab != self.tokenizer.vocab:
                raise CheckpointError(
                    f"--model.training.init_from {self.init_from}: its vocabulary ({len(self.tokenizer)} tokens) "
                    f"is not the one the training captions give ({len(dm.tokenizer)} tokens); start from a model "
                    "trained on these captions with the same data.captions.min_word_freq and "
                    "data.captions.max_vocab")
            self.configure_datamodule(dm)
            if stage == "fit" and self._grounding_active:
                classes = self._attach_boxes(dm)
                if self.grounding_head is None and classes:  # started from a model trained without boxes
                    self._store_training(grounding_classes=classes)
                    self.grounding_head = self._grounding_head(classes).to(self.device)
                    self._word_kinds_for(classes)
            if stage == "fit" and self._concept_active:
                words = self._concepts(dm, self.training_config.concept_words)
                if self.concept_head is None and words:  # started from a model trained without concepts
                    self._store_training(concept_words=words)
                    self.concept_head = self._concept_head(words).to(self.device)
        if stage == "fit" and self.training_config.idf_weight > 0 and hasattr(dm, "train_references"):
            tok = self.tokenizer
            self.token_weights = idf_token_weights(dm.train_references(), tok.vocab, {tok.eos_id, tok.unk_id},
                                                   self.training_config.idf_weight)

    def configure_datamodule(self, datamodule) -> None:
        """Make the data use this model's preprocessing and tokenizer (token ids must mean what they meant in
        training), and captions no longer than the decoder's ``max_length``."""
        super().configure_datamodule(datamodule)
        if datamodule is not None and hasattr(datamodule, "tokenizer"):
            datamodule.tokenizer = self.tokenizer
            if getattr(datamodule, "max_length", None) is not None:
                datamodule.max_length = min(datamodule.max_length, self.decoder_config.max_length)

    def set_inference_options(self, options: GenerationOptions) -> None:
        """Override decoding options (``--generate.*`` of ``eval.py``, ``predict`` and ``explain``;
        ``None`` fields keep the model's)."""
        chosen = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        check_generation(GenerationOptions(**chosen), "--generate")
        super().set_inference_options(options)
        for key, value in chosen.items():
            if value is not None:
                setattr(self.generation, key, value)

    def set_generation(self, options: GenerationOptions) -> None:
        """:meth:`set_inference_options` (its name in earlier versions)."""
        self.set_inference_options(options)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.training_config.freeze_encoder:
            self.encoder.eval()  # frozen: no dropout / drop-path either
        return self

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.training_config.freeze_encoder:
            self.encoder.eval()  # Lightning restores per-module modes after validation

    # ------------------------------------------------------------------ model
    def encode(self, images: Tensor) -> EncoderOutput:
        if self.training_config.freeze_encoder:
            with torch.no_grad():
                return self.encoder(images)
        return self.encoder(images)

    def forward(self, images: Tensor, tokens: Tensor) -> Tensor:
        """Teacher-forced logits ``[B, T, V]`` for ``tokens [B, T]`` (logits ``t`` predict ``t + 1``)."""
        return self.head(self.encode(images), tokens)[0]

    def generate(self, images: Tensor, beam_size: int | None = None, return_attention: bool = False,
                 use_cache: bool = True) -> Generation:
        """Captions of normalised images (token ids; :meth:`decode` turns them into text)."""
        return self.generate_encoded(self.encode(images), beam_size, return_attention, use_cache)

    def generate_encoded(self, enc: EncoderOutput, beam_size: int | None = None, return_attention: bool = False,
                         use_cache: bool = True) -> Generation:
        """:meth:`generate` from the encoder's output."""
        g = self.generation
        return self.head.generate(enc, self.tokenizer.bos_id, self.tokenizer.eos_id, g.max_length,
                                  beam_size or g.beam_size, g.length_penalty, use_cache, return_attention,
                                  min_length=g.min_length or 0, repetition_penalty=g.repetition_penalty or 1.0)

    # ------------------------------------------------------------------ inference, export, explanation
    def export_forward(self, images: Tensor) -> tuple[Tensor]:
        return (self.encoder(images).tokens,)

    def predictions_from_outputs(self, outputs, sizes, options=None) -> list[dict[str, Any]]:
        """``{"caption"}`` per image, decoded (beam search) from the encoder's ``(tokens,)``."""
        tokens = outputs[0]
        _, h, w = self.data_config["input_size"]
        enc = EncoderOutput(tokens, self.encoder.num_prefix_tokens, self.encoder.grid_for(int(h), int(w)))
        with torch.no_grad():
            gen = self.generate_encoded(enc)
        return [{"caption": " ".join(self.tokenizer.decode_words(row.tolist()))} for row in gen.tokens]

    def explain_batch(self, images, pictures, options, truths=None):
        return explain_captioning(self, images, pictures, options, truths)

    def decode(self, tokens: Tensor) -> list[str]:
        return [self.tokenizer.decode(row.tolist()) for row in tokens]

    # ------------------------------------------------------------------ steps
    def _loss(self, images: Tensor, tokens: Tensor, across_processes: bool = False) -> Tensor:
        """Mean cross-entropy per target token. With ``across_processes`` (training under DDP) the
        token count is averaged over processes, so DDP's gradient averaging yields the gradient
        of the mean over the global batch's tokens."""
        return self._caption_loss(self.encode(images), tokens, across_processes)

    def _caption_loss(self, enc: EncoderOutput, tokens: Tensor, across_processes: bool = False,
                      attention: list[Tensor] | None = None) -> Tensor:
        """:meth:`_loss` from the encoder's output; a given ``attention`` list receives the last
        layer's cross-attention ``[B, T-1, N]`` (mean over the heads) of the teacher-forced steps."""
        inputs = tokens[:, :-1]
        if self.training and self.training_config.word_dropout > 0:
            inputs = self._drop_words(inputs)
        logits, weights = self.head(enc, inputs, need_weights=attention is not None)  # (B, T-1, V)
        if attention is not None:
            attention.append(weights[-1].float().mean(dim=1))
        targets = tokens[:, 1:].reshape(-1)
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets,
                                    ignore_index=self.tokenizer.pad_id,
                                    label_smoothing=self.training_config.label_smoothing, reduction="none")
        if self.training and self.token_weights is not None:
            per_token = per_token * self.token_weights.to(per_token.device)[targets]
        total = per_token.sum()
        count = (targets != self.tokenizer.pad_id).sum().float()
        if across_processes:
            count = mean_across_processes(count)
        return total / count.clamp(min=1.0)

    def _drop_words(self, inputs: Tensor) -> Tensor:
        """Word dropout (Bowman et al. 2016) on the teacher-forced inputs: each word (not ``<bos>``,
        not padding) is replaced by ``<unk>`` with probability ``word_dropout``, so the next word
        cannot be guessed from the caption so far as easily and has to be read from the image.
        The targets are unchanged."""
        tok = self.tokenizer
        droppable = (inputs != tok.pad_id) & (inputs != tok.bos_id)
        drop = droppable & (torch.rand(inputs.shape, device=inputs.device) < self.training_config.word_dropout)
        return inputs.masked_fill(drop, tok.unk_id)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        if self.scst_config.enabled:
            return self._scst_step(batch)
        images, tokens, indices, *boxes = batch
        enc = self.encode(images)
        supervise = bool(boxes) and self.word_kinds is not None  # set only while the loss is active
        attention: list[Tensor] | None = [] if supervise else None
        per_image = tokens.shape[0] // len(images)  # captions_per_image: K captions per image, image by image
        terms = {"caption": self._caption_loss(repeat_images(enc, per_image), tokens, True, attention)}
        weights = {"caption": 1.0}
        if self.grounding_head is not None and boxes and self._grounding_active:
            terms["grounding"] = self._grounding_loss(enc, boxes[0])
            weights["grounding"] = self.training_config.grounding_weight
        if attention:
            k = len(self.training_config.grounding_classes)
            regions = torch.stack([class_regions(b.to(tokens.device), c.to(tokens.device), enc.grid, k)
                                   for b, c in boxes[0]])
            regions = regions.repeat_interleave(per_image, dim=0)
            word = word_attention_loss(attention[0], word_attention_targets(tokens[:, 1:], self.word_kinds), regions)
            if word is not None:
                terms["word_attention"] = word
                weights["word_attention"] = self.training_config.word_attention_weight
        if self.concept_head is not None and self.concept_table is not None and self._concept_active:
            terms["concept"] = self._concept_loss(enc, indices)
            weights["concept"] = self.training_config.concept_weight
        loss = sum(weights[k] * v for k, v in terms.items())
        self.check_finite(loss, {("cross_entropy" if k == "caption" else k): v for k, v in terms.items()})
        if len(terms) > 1:
            for name, value in terms.items():
                self.log(f"train/{name}_loss", value, on_step=True, on_epoch=True, batch_size=len(images),
                         sync_dist=True)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(images), sync_dist=True)
        return loss

    def _concept_loss(self, enc: EncoderOutput, indices: Tensor) -> Tensor:
        """Binary cross-entropy of the concept head's image scores (log-sum-exp over the patches
        of ``concept_tokens``, minus log(patches)) against :attr:`concept_table`'s rows of the
        batch's images."""
        tokens = enc.embedding_tokens if self.training_config.concept_tokens == "embedding" else enc.tokens
        patches = tokens[:, enc.num_prefix_tokens:]
        logits = self.concept_head(patches).float()  # (B, N, K)
        scores = torch.logsumexp(logits, dim=1) - math.log(logits.shape[1])  # (B, K)
        targets = self.concept_table[indices.cpu()].to(scores.device)
        return F.binary_cross_entropy_with_logits(scores, targets)

    def _grounding_loss(self, enc: EncoderOutput, boxes: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Cross-entropy of the grounding head's per-patch categories against
        :func:`patch_targets` of each image's ``(boxes, labels)``; background weighted
        :data:`GROUNDING_BACKGROUND_WEIGHT`; with ``grounding_balance`` each object's patches
        share one object's weight (:func:`grounding_weights`)."""
        patches = enc.tokens[:, enc.num_prefix_tokens:]
        logits = self.grounding_head(patches).float()  # (B, N, K + 1)
        owners = torch.stack([patch_objects(b.to(logits.device), enc.grid) for b, _ in boxes])
        targets = torch.stack([_owner_labels(o, c.to(logits.device)) for o, (_, c) in zip(owners, boxes, strict=True)])
        flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        if not self.training_config.grounding_balance:
            weight = torch.ones(logits.shape[-1], device=logits.device)
            weight[0] = GROUNDING_BACKGROUND_WEIGHT
            return F.cross_entropy(flat_logits, flat_targets, weight=weight)
        weights = grounding_weights(owners, GROUNDING_BACKGROUND_WEIGHT).reshape(-1)
        per_patch = F.cross_entropy(flat_logits, flat_targets, reduction="none")
        return (weights * per_patch).sum() / weights.sum()

    # ------------------------------------------------------------------ explanation
    def explain_eval(self, dataset, options, out_dir: Path, report=None) -> dict[str, float]:
        """Per-word strips, and on the seeded sample of ``options.faithfulness_images`` images the
        localisation of object words (``pointing_<method>``, ``energy_<method>``, original image
        pixels), the deletion / insertion AUC of the words' probabilities and the saved maps
        (:func:`~vision_attn.explain.captioning.write_caption_overlays`); and the mistakes browser
        of the object words no reference has (:attr:`eval_mistakes`, ``mistakes.html``:
        :func:`~vision_attn.explain.task_mistakes.caption_mistakes`)."""
        metrics = write_caption_overlays(self, dataset, options, out_dir, report)
        files = getattr(self, "eval_caption_files", None)
        self.eval_mistakes = (caption_mistakes(self, dataset, files["results_per_image.json"], options)
                              if files else None)
        return metrics

    # ------------------------------------------------------------------ report.html
    def rank_mistakes(self, dataset, predictions, k, options=None) -> list[int]:
        """The lowest-CIDEr-D captions (:func:`~vision_attn.tasks.captioning_report.rank_mistakes`)."""
        return captioning_report.rank_mistakes(dataset, predictions, k)

    def mistake_cards(self, items, predictions, limit=DEFAULT_MISTAKES) -> Mistakes:
        """The lowest-CIDEr-D captions (:func:`~vision_attn.tasks.captioning_report.mistake_cards`)."""
        return captioning_report.mistake_cards(items, predictions, limit)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self) -> dict[str, Any]:
        if self.tokenizer is None:
            raise CheckpointError("the captioning model has no tokenizer yet; it is built when training starts")
        return super().checkpoint_meta()
