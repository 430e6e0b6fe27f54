"""The captioning task's argument groups besides the decoder's architecture
(:class:`~vision_attn.models.captioner.DecoderConfig`) and the decoding options
(:class:`~vision_attn.models.captioner.GenerationOptions`): how it trains with cross-entropy
(:class:`CaptionTraining`) and with self-critical sequence training (:class:`SCSTConfig`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from vision_attn.errors import ConfigError
from vision_attn.models.captioner import GenerationOptions

__all__ = ["CAPTION_GENERATION", "CaptionTraining", "SCSTConfig", "check_generation"]

CAPTION_GENERATION = GenerationOptions(beam_size=3, length_penalty=1.0, max_length=None, min_length=0,
                                       repetition_penalty=1.0)
"""The task's decoding: beam 3, length penalty 1, no length constraint below what the decoder
holds (``max_length`` ``None``: the decoder's ``max_length - 1``), no repetition penalty."""


def check_generation(options: GenerationOptions, prefix: str) -> None:
    """Refuse decoding options that cannot work, naming the option and the allowed values."""
    rules = {"beam_size": (lambda v: v >= 1, "at least 1"), "max_length": (lambda v: v >= 1, "at least 1"),
             "min_length": (lambda v: v >= 0, "at least 0"),
             "repetition_penalty": (lambda v: v > 0 and math.isfinite(v), "a positive number (1 = off)"),
             "length_penalty": (math.isfinite, "a finite number")}
    for key, (ok, allowed) in rules.items():
        value = getattr(options, key)
        if value is not None and not ok(value):
            raise ConfigError(f"{prefix}.{key} must be {allowed}, got {value!r}")


def _weight(value: float, key: str) -> None:
    if not (value >= 0.0 and math.isfinite(value)):
        raise ConfigError(f"--model.training.{key} must be a number >= 0 (0 = off), got {value}")


@dataclass(frozen=True)
class CaptionTraining:
    """How the captioner trains with teacher-forced cross-entropy: the loss and its auxiliary
    terms, the encoder frozen or not, validation's decoding and the weights it starts from.

    Attributes:
        label_smoothing: of the teacher-forced cross-entropy.
        word_dropout: share of the teacher-forced input words replaced by ``<unk>`` (word
            dropout), which makes the decoder read more from the image; 0 = off.
        freeze_encoder: keep the encoder's weights fixed (and in eval mode).
        val_beam_size: beam width of the captions scored during training's validation.
        init_from: a captioning checkpoint of ``train.py`` whose weights (and vocabulary, and
            preprocessing) this model starts from — the weights only: the optimiser, the schedule
            and the epoch start afresh (``--ckpt_path`` resumes a run instead). Read with the
            suite's safe checkpoint reader; a checkpoint of another task, or whose vocabulary or
            architecture differs from this model's, is an error. Not stored in checkpoints.
        grounding_weight: weight of an auxiliary loss that supervises the encoder's patch tokens
            with the training split's instance boxes when it has them (``instances_<split>.json``
            next to the captions: the embedded scenes and COCO do): a linear head on every patch
            token predicts the category of the smallest box holding the patch's centre, or
            background (cross-entropy, background weighted
            :data:`~vision_attn.tasks.captioning_losses.GROUNDING_BACKGROUND_WEIGHT`). Captions alone
            teach a from-scratch encoder the objects' kinds slowly (docs/results/captioning.md); 0 = off.
            Without an instances file the captions alone are used (logged). Generation and the
            explanations do not use the head.
        grounding_balance: weigh every object alike in the grounding loss, whatever its size (its
            patches share one object's weight,
            :func:`~vision_attn.tasks.captioning_losses.grounding_weights`), instead of every patch
            alike — a small object's kind gets as much of the loss as a large one's.
        grounding_classes: the category names the grounding head predicts (set from the data
            when training starts and saved in checkpoints; leave unset).
        word_attention_weight: weight of an auxiliary loss on the decoder's cross-attention
            (needs ``grounding_weight > 0``, whose boxes it reads): when the next word names a
            category, or describes the object a category word names right after it ("red" in
            "a red circle", :func:`~vision_attn.tasks.captioning_losses.word_attention_targets`), the
            last decoder layer's attention of that step (mean over the heads) should fall on the
            patches of that category's boxes; the loss is ``-log`` of the mass there (attention
            correctness, Liu et al. 2017). 0 = off.
        concept_weight: weight of an auxiliary loss that needs no boxes: the words that say what
            an image shows (:func:`~vision_attn.tasks.captioning_losses.concept_vocabulary`: caption
            words in at most ``concept_max_share`` of the training images' references) are
            predicted from the patch tokens, multiple-instance style (log-sum-exp over the
            patches, binary cross-entropy against the share of the image's references that use
            the word; Fang et al. 2015's visual concepts). 0 = off.
        concept_max_share: the most images (share of the training set) whose references may use
            a word for it to count as a concept.
        concept_words: the words the concept head predicts (set from the training captions when
            training starts and saved in checkpoints; leave unset).
        concept_tokens: which patch tokens the concept head reads: ``output`` (the encoder's
            last block) or ``embedding`` (the tokens entering its first block: the stem's, so
            the loss teaches the stem directly what the objects are; with a convolutional stem
            that is learned in far fewer steps than through the blocks, and the decoder sees it
            through the residual stream, or directly with ``decoder.embedding_memory``).
        idf_weight: how much the caption cross-entropy weights each target word by its inverse
            document frequency over the training images' references
            (:func:`~vision_attn.tasks.captioning_losses.idf_token_weights`): 0 = every word alike,
            1 = in proportion to its idf, so the words that tell images apart (the objects) count
            more than the template words every caption shares. In [0, 1].
    """

    label_smoothing: float = 0.1
    word_dropout: float = 0.0
    freeze_encoder: bool = False
    val_beam_size: int = 1
    init_from: str | None = None
    grounding_weight: float = 0.0
    grounding_balance: bool = False
    grounding_classes: list[str] | None = None
    word_attention_weight: float = 0.0
    concept_weight: float = 0.0
    concept_max_share: float = 0.5
    concept_words: list[str] | None = None
    concept_tokens: Literal["output", "embedding"] = "output"
    idf_weight: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.word_dropout < 1.0:
            raise ValueError(f"--model.training.word_dropout must be in [0, 1), got {self.word_dropout}")
        for key in ("grounding_weight", "word_attention_weight", "concept_weight"):
            _weight(getattr(self, key), key)
        if self.word_attention_weight > 0 and not self.grounding_weight > 0:
            raise ConfigError("--model.training.word_attention_weight needs the instance boxes that grounding "
                              "reads: set --model.training.grounding_weight > 0 too (e.g. 0.3), or "
                              "word_attention_weight 0")
        if self.concept_tokens not in ("output", "embedding"):
            raise ConfigError("--model.training.concept_tokens must be output or embedding, "
                              f"got {self.concept_tokens!r}")
        if not 0.0 <= self.idf_weight <= 1.0:
            raise ConfigError(f"--model.training.idf_weight must be in [0, 1] (0 = off), got {self.idf_weight}")
        if not 0.0 < self.concept_max_share <= 1.0:
            raise ConfigError(f"--model.training.concept_max_share must be in (0, 1], got {self.concept_max_share}")


@dataclass(frozen=True)
class SCSTConfig:
    """Self-critical sequence training (Rennie et al. 2017, :mod:`vision_attn.losses.scst`).

    Attributes:
        enabled: train with SCST instead of cross-entropy: CIDEr-D rewards of sampled captions
            against the image's references, minus a baseline. A second phase: start it from a
            cross-entropy model with ``training.init_from``. Needs a
            :class:`~vision_attn.data.CaptioningDataModule` (the training references).
        samples: captions sampled per image and step.
        baseline: ``greedy`` (the greedy caption's reward, as the paper) or ``mean`` (the mean
            reward of the image's other samples; needs ``samples >= 2``).
        max_length: most tokens of a sampled (and of the greedy baseline) caption, ``<eos>``
            included (default: what the decoder holds, ``max_length - 1``).
        temperature: samples are drawn from the softmax of the logits divided by this (1: the
            model's own distribution, as the paper; below 1 the samples stay closer to the greedy
            caption, e.g. for a model trained with label smoothing, whose tails are fat); the
            policy gradient uses the same tempered distribution.
        dropout: keep dropout and stochastic depth on during the self-critical step (as in
            training). Off by default: sampled with dropout, a model's captions scored well below
            its own greedy caption (CIDEr-D 0.65 vs 0.94 for samples without dropout, on a batch
            of the embedded scenes), so nearly every advantage was negative.
    """

    enabled: bool = False
    samples: int = 5
    baseline: Literal["greedy", "mean"] = "greedy"
    max_length: int | None = None
    temperature: float = 1.0
    dropout: bool = False

    def __post_init__(self) -> None:
        if self.baseline not in ("greedy", "mean"):
            raise ConfigError(f"--model.scst.baseline must be greedy or mean, got {self.baseline!r}")
        least = 2 if self.baseline == "mean" else 1
        if not isinstance(self.samples, int) or self.samples < least:
            raise ConfigError(f"--model.scst.samples must be at least {least} with the {self.baseline} baseline, "
                              f"got {self.samples!r}")
        if not isinstance(self.temperature, int | float) or not self.temperature > 0:
            raise ConfigError(f"--model.scst.temperature must be a number > 0 (1: the model's own softmax), "
                              f"got {self.temperature!r}")
