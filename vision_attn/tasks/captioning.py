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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.blocks import Mistakes
from vision_attn.data.caption_objects import GENERIC_NOUNS, NUMBER_WORDS, WINDOW, ObjectVocabulary
from vision_attn.data.tokenizer import WordTokenizer, normalize_caption
from vision_attn.distributed import mean_across_processes
from vision_attn.errors import CheckpointError, ConfigError, DataError
from vision_attn.explain.evaluate import DEFAULT_MISTAKES
from vision_attn.losses.scst import baselines, sample_rewards, scst_loss
from vision_attn.metrics.caption import (
    CiderD,
    caption_metrics,
    caption_metrics_per_image,
    image_dependence,
    java_metrics,
)
from vision_attn.metrics.caption_content import content_accuracy
from vision_attn.models.captioner import (
    DEFAULT_DECODER,
    CaptionDecoder,
    DecoderConfig,
    Generation,
    GenerationOptions,
)
from vision_attn.models.detr import cell_centres
from vision_attn.models.encoder import EncoderOutput, ViTEncoder
from vision_attn.tasks import captioning_report
from vision_attn.tasks.base import (
    VisionTask,
    gather_objects,
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
from vision_attn.tasks.optim import Optimization

CAPTIONING_OPTIM = Optimization(lr=5e-4)
CAPTION_TRAINING = CaptionTraining()
CAPTION_SCST = SCSTConfig()

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


# what ``init_from`` compares between the checkpoint and the configured model (else a clear error)
DECODER_ARCHITECTURE = ("hidden_dim", "num_layers", "num_heads", "mlp_ratio", "max_length", "embedding_memory",
                        "pixel_memory")
ENCODER_ARCHITECTURE = ("name", "img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "stem",
                        "lsa", "timm_kwargs")

__all__ = ["CaptioningTask", "CaptionTraining", "SCSTConfig"]

log = logging.getLogger(__name__)


@register_task
class CaptioningTask(VisionTask):
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
            output tokens are dominated by what the grounding loss asks for (README "Captioning":
            it stops the colour collapse of the grounded recipe's bad draws). ``pixel_memory``:
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
            "concept_max_share", "concept_words")},
        "scst": "scst.enabled",
        **{f"scst_{k}": f"scst.{k}" for k in ("samples", "baseline", "max_length", "temperature", "dropout")},
    }
    monitor = ("val/cider", "max")
    crop_at_inference = False  # a centre crop would cut objects off: the whole image, resized
    export_output_names = ("tokens",)  # the encoder's; beam search stays in PyTorch
    onnx_predicts = False
    headline_metrics = ("bleu1", "bleu4", "cider", "kinds_exact", "content_exact", "image_dependence",
                        "pointing_relevance", "pointing_attention", "pointing_random")
    headline_metric = "cider"
    overlay_description = "the caption, then each word's map: relevance and raw cross-attention (one strip each)"

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
        self.encoder.keep_embedding = config.embedding_memory  # the decoder reads what the encoder then returns
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
        from vision_attn.explain.captioning import explain_captioning

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
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets,
                                ignore_index=self.tokenizer.pad_id,
                                label_smoothing=self.training_config.label_smoothing, reduction="sum")
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
        minus log(patches)) against :attr:`concept_table`'s rows of the batch's images."""
        patches = enc.tokens[:, enc.num_prefix_tokens:]
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

    # ------------------------------------------------------------------ self-critical training
    def _scst_statistics(self) -> tuple[CiderD, list[list[str]]]:
        """CIDEr-D's document frequencies from the training references, computed on first use and
        kept (every DDP process reads the whole training split: the same statistics everywhere)."""
        if self.scst_cider is None:
            dm = getattr(self.trainer, "datamodule", None)
            if dm is None or not hasattr(dm, "train_references"):
                raise DataError("--model.scst needs the training references: train with a CaptioningDataModule "
                                "(train.py's data section), not bare dataloaders")
            self.scst_references = dm.train_references()
            self.scst_cider = CiderD(self.scst_references)
            log.info("SCST: CIDEr-D document frequencies from %d training images", len(self.scst_references))
        return self.scst_cider, self.scst_references

    @contextmanager
    def _eval_mode(self, active: bool = True) -> Iterator[None]:
        """Every module in eval mode (no dropout, no stochastic depth) inside the block, when
        ``active``; each module's own mode restored afterwards. Gradients are untouched."""
        modes = {m: m.training for m in self.modules()}
        try:
            if active:
                self.eval()
            yield
        finally:
            for m, mode in modes.items():
                m.training = mode

    def _greedy_captions(self, images: Tensor, max_new: int, enc: EncoderOutput | None = None) -> Tensor:
        """The greedy captions' tokens, decoded as at test time (eval mode, no gradients, no
        decoding constraint); every module's mode is restored afterwards. ``enc``: the images'
        encoder output when it was already computed in eval mode (not encoded again)."""
        with self._eval_mode(), torch.no_grad():
            enc = self.encoder(images) if enc is None else enc
            return self.head.generate(enc, self.tokenizer.bos_id, self.tokenizer.eos_id, max_new, 1).tokens

    def _scst_loss(self, images: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The self-critical loss of a batch, with the samples' rewards and baselines ``(B, S)``."""
        config, tok = self.scst_config, self.tokenizer
        scorer, references = self._scst_statistics()
        refs = [references[i] for i in indices.tolist()]
        s = config.samples
        max_new = config.max_length or self.decoder_config.max_length - 1
        enc = self.encode(images)
        temperature = float(config.temperature)
        samples = self.head.sample(enc, tok.bos_id, tok.eos_id, s, max_new, temperature=temperature)  # tokens only
        rewards = sample_rewards(scorer, self.decode(samples.tokens), refs).to(images.device)  # (B, S)
        greedy = None
        if config.baseline == "greedy":
            # the step already runs in eval mode (scst.dropout false): its encoding is the greedy decode's
            greedy_tokens = self._greedy_captions(images, max_new, None if self.training else enc)
            greedy = sample_rewards(scorer, self.decode(greedy_tokens), refs)[:, 0].to(images.device)  # (B,)
        baseline = baselines(rewards, config.baseline, greedy)  # (B, S)
        logp = self.head.token_logprobs(enc, samples.tokens, tok.bos_id, repeats=s, temperature=temperature)  # (B*S, T)
        loss = scst_loss(logp, samples.lengths, rewards, baseline)
        return loss, rewards, baseline

    def _scst_step(self, batch) -> Tensor:
        """One self-critical step (:mod:`vision_attn.losses.scst`): ``scst.samples`` sampled captions per
        image, rewarded by CIDEr-D against all of the image's training references, minus the
        baseline; ``-(reward - baseline) * log p(sample)`` averaged over the samples. Unless
        ``scst.dropout``, the whole step runs without dropout or stochastic depth, so samples,
        greedy baseline and log-probabilities all come from the same network."""
        images, _, indices = batch[:3]
        with self._eval_mode(not self.scst_config.dropout):
            loss, rewards, baseline = self._scst_loss(images, indices)
        self.check_finite(loss, {"scst": loss})
        n = len(images)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=n, sync_dist=True)
        self.log("train/reward", rewards.mean(), prog_bar=True, on_step=True, on_epoch=True, batch_size=n,
                 sync_dist=True)
        self.log("train/baseline", baseline.mean(), on_step=True, on_epoch=True, batch_size=n, sync_dist=True)
        return loss

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
        records = self._unique_records()
        if self.trainer.sanity_checking or not records:
            return
        metrics = self._score(dataset, records)
        for k, v in metrics.items():
            self.log(f"val/{k}", v, prog_bar=k in ("bleu4", "cider"))  # the same on every process (gathered records)

    def on_test_epoch_start(self) -> None:
        self._stage, self.eval_records = "test", []

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.generation.beam_size)

    def on_test_epoch_end(self) -> None:
        self.eval_records = self._unique_records()

    def _unique_records(self) -> list[dict[str, Any]]:
        unique = {r["index"]: r for r in gather_objects(self.eval_records)}  # DDP pads with repeats
        return [unique[i] for i in sorted(unique)]

    @staticmethod
    def _pairs(dataset, records: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, list[str]]]:
        """``({index: caption}, {index: normalised references})`` of the records."""
        hyps = {r["index"]: r["caption"] for r in records}
        refs = {r["index"]: [normalize_caption(c) for c in dataset.references[r["index"]]] for r in records}
        return hyps, refs

    @classmethod
    def _score(cls, dataset, records: list[dict[str, Any]]) -> dict[str, float]:
        """Validation's metrics: BLEU / CIDEr-D / ROUGE-L, and content accuracy where the split
        has instance annotations (so a run's curves show whether the captions name what is there)."""
        hyps, refs = cls._pairs(dataset, records)
        return {**caption_metrics(hyps, refs), **cls._content(dataset, hyps)}

    def eval_results(self, dataset) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """``(metrics, predictions)``.

        Metrics: BLEU-1..4, CIDEr-D, ROUGE-L, ``image_dependence`` (two images or more),
        ``meteor`` / ``spice`` where the COCO toolkit's Java can run (on the main process;
        else logged), and content accuracy (``content_exact``, ``kinds_exact``,
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
        metrics.update(self._content(dataset, hyps))
        if self._trainer is None or self.trainer.is_global_zero:
            metrics.update(java_metrics(hyps, refs))
        predictions = [{"image_id": dataset.images[r["index"]]["id"], "caption": r["caption"],
                        "cider": per_image[r["index"]]["cider"]} for r in self.eval_records]
        return metrics, predictions

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

    def explain_eval(self, dataset, options, out_dir: Path, report=None) -> dict[str, float]:
        """Per-word strips, and on the seeded sample of ``options.faithfulness_images`` images the
        localisation of object words (``pointing_<method>``, ``energy_<method>``, original image
        pixels), the deletion / insertion AUC of the words' probabilities and the saved maps
        (:func:`~vision_attn.explain.captioning.write_caption_overlays`)."""
        from vision_attn.explain.captioning import write_caption_overlays

        return write_caption_overlays(self, dataset, options, out_dir, report)

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
