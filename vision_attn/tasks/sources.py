"""Where a model comes from: a checkpoint this suite trained, or any timm ViT by name.

:func:`load_model` returns a :class:`~vision_attn.tasks.base.VisionTask` either way, so
everything downstream (predictions, explanations, the report, export) runs on it unchanged:

- ``timm:NAME`` (``timm:vit_base_patch16_224.augreg_in21k_ft_in1k``, ``timm:deit_small_distilled_patch16_224``,
  ``timm:vit_medium_patch16_reg4_gap_256``, ...): a :class:`~vision_attn.tasks.ClassificationTask`
  around the timm model *with its own classifier* (``head.kind="timm"``: timm's pooling, ``fc_norm``
  and distilled heads). Weights come from ``weights_file`` (a local ``.safetensors`` / ``.pth``
  timm state dict, read without executing pickles; its classifier's size sets the number of
  classes) or, without one, from timm's hub (``pretrained=True``). Preprocessing is the model's
  timm data config (evaluated exactly as ``timm.data.create_transform``). Class names are
  ImageNet's human-readable descriptions (``timm.data.ImageNetInfo``) for ImageNet-sized heads,
  or ``class_names``.
- ``timm:NAME`` of a model without a classifier (DINOv2, SigLIP and CLIP image towers, EVA-02 MIM,
  any ``num_classes=0`` model, a weights file without the classifier's weights) or with a
  projection instead of classes (Perception Encoder, a CLIP tower's projection: a head of the size
  timm's pretrained config gives, not an ImageNet head, and no ``class_names``): an
  :class:`~vision_attn.tasks.embedding.EmbeddingTask`, whose predictions are embeddings and whose
  explanations explain the embedding's norm or a cosine with a target.
- anything else: a checkpoint written by this suite (:func:`~vision_attn.tasks.base.load_task`),
  with its own weights, class names and stored preprocessing.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from pathlib import Path

import timm
import timm.data
from torch import Tensor

from vision_attn.checkpoint_io import load_state_dict_file
from vision_attn.errors import DataError, EncoderError
from vision_attn.models.classifier import ClassifierConfig
from vision_attn.models.encoder import ViTEncoder, suggest_model_names
from vision_attn.schema import limit
from vision_attn.tasks.base import VisionTask, load_task
from vision_attn.tasks.classification import ClassificationTask
from vision_attn.tasks.embedding import EmbeddingTask

__all__ = ["TIMM_PREFIX", "ClassNames", "imagenet_class_names", "load_model", "load_timm_model",
           "resolve_class_names"]

log = logging.getLogger(__name__)

TIMM_PREFIX = "timm:"
ClassNames = Sequence[str] | str | Path
"""Class names in label order, or a text file with one name per line."""

_STATE_PREFIXES = ("", "module.", "model.", "encoder.model.")  # as ViTEncoder.load_weights unwraps


def load_model(
    source: str | Path,
    weights_file: str | Path | None = None,
    class_names: ClassNames | None = None,
    allow_import: tuple[str, ...] = (),
    map_location: str = "cpu",
) -> VisionTask:
    """A model ready to predict and explain (eval mode), from a timm name or a checkpoint: a
    timm model without a classifier loads as an :class:`~vision_attn.tasks.embedding.EmbeddingTask`.

    Args:
        source: ``timm:NAME`` (a timm ViT-family name, optionally with its pretrained tag) or
            the path of a checkpoint written by this suite.
        weights_file: ``timm:`` only: a local timm state dict (``.safetensors`` / ``.pth``)
            instead of the hub's pretrained weights.
        class_names: ``timm:`` only: the classifier's class names (a list, or a text file with
            one name per line); needed when the head is not an ImageNet head.
        allow_import: checkpoints only: module prefixes whose task classes a checkpoint may
            name (see :func:`~vision_attn.tasks.base.load_task`).
        map_location: device of the model.

    Raises:
        EncoderError: an unknown or non-ViT timm name, pretrained weights unavailable (offline)
            without ``weights_file``, class names that do not fit the classifier.
        CheckpointError: an unreadable weights file or checkpoint.
    """
    text = str(source)
    if text.startswith(TIMM_PREFIX):
        return load_timm_model(text[len(TIMM_PREFIX):], weights_file, class_names, map_location)
    if weights_file is not None or class_names is not None:
        given = "weights_file" if weights_file is not None else "class_names"
        raise EncoderError(
            f"{given} applies to timm models (timm:NAME); the checkpoint {text} stores its own weights and "
            f"class names. Drop {given}, or name a timm model as timm:NAME"
        )
    return load_task(text, map_location=map_location, allow_import=allow_import)


def load_timm_model(
    name: str,
    weights_file: str | Path | None = None,
    class_names: ClassNames | None = None,
    map_location: str = "cpu",
) -> VisionTask:
    """A :class:`~vision_attn.tasks.ClassificationTask` around timm model ``name`` with timm's
    own classifier, or an :class:`~vision_attn.tasks.embedding.EmbeddingTask` for a model without
    one (see :func:`load_model`; ``name`` without the ``timm:`` prefix)."""
    name = name.strip()
    arch, _, tag = name.partition(".")
    if not arch or not timm.is_model(arch):
        raise EncoderError(f"unknown timm model name {name!r}.{suggest_model_names(arch)}")
    try:
        pretrained_cfg = timm.models.get_pretrained_cfg(name)
    except RuntimeError as err:
        tags = ", ".join(timm.list_pretrained(f"{arch}.*")) or "none"
        raise EncoderError(f"timm model {arch!r} has no pretrained tag {tag!r}; its tags: {tags}") from err
    state: dict[str, Tensor] | None = None
    if weights_file is not None:
        state = load_state_dict_file(weights_file)
        num_classes = _classifier_size(state, pretrained_cfg)
    else:
        num_classes = int(getattr(pretrained_cfg, "num_classes", 0) or 0)
    embedding = num_classes < 1 or _is_projection(num_classes, class_names, pretrained_cfg)
    try:
        encoder = ViTEncoder(name, pretrained=state is None, num_classes=num_classes, timm_kwargs=_skip_init(arch))
    except EncoderError as err:
        cause = err.__cause__
        if state is not None or not isinstance(cause, (OSError, RuntimeError)):
            raise
        log.debug("timm:%s: the hub failed: %s", name, cause)
        raise EncoderError(
            f"could not download the weights of timm:{name} ({type(cause).__name__}). Offline? Pass the "
            "weights as a local file: --weights_file FILE (Python: weights_file=FILE), a .safetensors / .pth "
            "timm state dict"
        ) from None
    if state is not None:
        encoder.load_state(state, str(weights_file))
    if embedding and class_names is not None:
        raise EncoderError(f"class names were given, but timm model {name!r} has no classifier (an embedding "
                           "model): drop --class_names (class_names=)")
    if embedding:
        log.info("timm model %s: no classifier, an embedding of %d values; preprocessing %s", name,
                 num_classes or encoder.embed_dim, encoder.data_config)
        return EmbeddingTask(encoder).eval().to(map_location)
    names = resolve_class_names(num_classes, class_names)
    task = ClassificationTask(encoder, num_classes=num_classes, class_names=names, head=ClassifierConfig(kind="timm"))
    log.info("timm model %s: %d classes, preprocessing %s", name, num_classes, encoder.data_config)
    return task.eval().to(map_location)


def _skip_init(arch: str) -> dict[str, str]:
    """``weight_init="skip"`` where timm's ViT takes it: every weight is loaded next (a missing
    one is an error), so timm's random initialisation (seconds for a large model) is skipped."""
    from timm.models.vision_transformer import VisionTransformer

    annotation = inspect.signature(VisionTransformer.__init__).parameters.get("weight_init")
    takes_skip = annotation is not None and "'skip'" in str(annotation.annotation)
    vit_class = timm.models.is_model_in_modules(arch, ["vision_transformer", "deit"])
    return {"weight_init": "skip"} if takes_skip and vit_class else {}


def _is_projection(num_classes: int, class_names: ClassNames | None, pretrained_cfg) -> bool:
    """Whether a head of ``num_classes`` outputs is a projection, not classes: no class names
    given, not an ImageNet head, and the size timm's pretrained config gives the model (a CLIP
    tower's or Perception Encoder's projection; a head fine-tuned to other classes has another)."""
    pretrained = int(getattr(pretrained_cfg, "num_classes", 0) or 0)
    return class_names is None and num_classes == pretrained and imagenet_class_names(num_classes) is None


def _classifier_size(state: dict[str, Tensor], pretrained_cfg) -> int:
    """The number of outputs of the classifier (or projection) in a timm state dict; 0 when it
    holds none (a feature backbone)."""
    classifier = getattr(pretrained_cfg, "classifier", None) or "head"
    head = classifier if isinstance(classifier, str) else classifier[0]
    for prefix in _STATE_PREFIXES:
        weight = state.get(f"{prefix}{head}.weight")
        if weight is not None and weight.dim() == 2:
            return int(weight.shape[0])
    return 0


def imagenet_class_names(num_classes: int) -> list[str] | None:
    """ImageNet's human-readable class descriptions for a head of ``num_classes`` (1000, 11821,
    21841, 21843, ... as :func:`timm.data.infer_imagenet_subset` knows them; timm ships the label
    files, so this works offline), or ``None`` for any other size."""
    subset = timm.data.infer_imagenet_subset({"num_classes": num_classes})
    if subset is None:
        return None
    info = timm.data.ImageNetInfo(subset)
    if info.num_classes() != num_classes:
        return None
    return [info.index_to_description(i) for i in range(num_classes)]


MAX_CLASS_NAME = 1000
"""The longest class name, in characters, a class names file may give."""


def _read_names(class_names: ClassNames) -> tuple[list[str], str]:
    if isinstance(class_names, (str, Path)):
        path = Path(class_names)
        if not path.is_file():
            raise DataError(f"class names file {path} does not exist; give a text file with one class name per line")
        most = limit("num_classes")
        try:
            if path.stat().st_size > most * (MAX_CLASS_NAME + 1):
                raise DataError(f"class names file {path} is larger than {most} names of {MAX_CLASS_NAME} "
                                "characters could be; give one class name per line")
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read class names file {path}: {err}") from err
        long = next((i for i, line in enumerate(lines) if len(line) > MAX_CLASS_NAME), None)
        if long is not None:
            raise DataError(f"class names file {path}: name {long + 1} is longer than {MAX_CLASS_NAME} characters")
        if len(lines) > most:
            raise DataError(f"class names file {path} gives {len(lines)} names, over the limit of {most} "
                            "(VISION_ATTN_MAX_NUM_CLASSES)")
        return lines, f"class names file {path}"
    return [str(n) for n in class_names], "class_names"


def resolve_class_names(num_classes: int, class_names: ClassNames | None = None) -> list[str]:
    """The names of a classifier's ``num_classes`` outputs: ``class_names`` (a list, or a text
    file with one name per line; blank lines skipped) when given, else ImageNet's descriptions
    (:func:`imagenet_class_names`).

    Raises:
        EncoderError: a count that differs from ``num_classes``, or no names given for a head
            that is not an ImageNet head.
        DataError: a class names file that is missing or unreadable.
    """
    if class_names is not None:
        names, where = _read_names(class_names)
        if len(names) != num_classes:
            raise EncoderError(
                f"{where} has {len(names)} class names but the model's classifier has {num_classes} outputs; "
                f"give exactly {num_classes} names, one per line, in the classifier's order"
            )
        return names
    names = imagenet_class_names(num_classes)
    if names is None:
        raise EncoderError(
            f"the model's classifier has {num_classes} outputs, not the size of an ImageNet head (1000, 11221, "
            f"11821, 21841, 21842, 21843), so its class names are unknown; pass them: --class_names FILE (one "
            f"name per line, {num_classes} lines) or class_names=[...]"
        )
    return names
