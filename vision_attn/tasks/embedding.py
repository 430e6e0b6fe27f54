"""Models without a classifier: a timm ViT whose output is an embedding (DINOv2, CLIP and SigLIP
image towers, EVA-02 MIM, Perception Encoder, any ``num_classes=0`` model).

``timm:NAME`` of such a model loads as an :class:`EmbeddingTask`
(:func:`~vision_attn.tasks.sources.load_model`). Its embedding is timm's own: ``forward_head`` on
the encoder's tokens (the model's pooling, ``fc_norm`` and, for a tower with a projection instead
of classes, the projection). Its ``predictions.json`` record per image: ``embedding_norm``,
``embedding`` (the vector, rounded to :data:`DECIMALS` decimals) and, with a target image or
vector, ``similarity`` (the cosine explained).

**What the explanations explain** (:class:`EmbeddingOptions`, ``--target_image`` /
``--target_embedding`` of ``predict`` and ``explain``):

- the attention methods (``rollout``, ``attention``) read the row of what the pooling reads:
  the class token's, or the mean of the patch tokens' rows for average pooling; register and
  other prefix tokens are left out of the patch map (``tokens`` shows the high-norm tokens);
- the gradient and relevance methods (``relevance``, ``gradcam``, ``lrp``) explain a score of the
  embedding ``e``: by default its norm ``||e||``; with ``target_image`` the cosine between ``e``
  and the embedding of that image (which parts make the image similar to it); with
  ``target_embedding`` the cosine between ``e`` and a vector saved by the user (a CLIP or SigLIP
  text embedding, ...).

A method that cannot apply (attention methods on an attention-pooling head, AttnLRP on a module it
has no rule for) is skipped with a warning naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.data.imageio import read_image
from vision_attn.data.transforms import build_display_transform, build_eval_transform
from vision_attn.errors import ConfigError, EncoderError, VisionAttnError
from vision_attn.explain.evaluate import attention_report_item, explanation_panel
from vision_attn.explain.methods import explain_classifier
from vision_attn.explain.records import Explained
from vision_attn.explain.targets import register_shares
from vision_attn.models.classifier import attention_pool_weights
from vision_attn.models.encoder import EncoderOutput, ViTEncoder
from vision_attn.tasks.base import VisionTask, register_task
from vision_attn.tasks.optim import DEFAULT_OPTIM, Optimization

__all__ = ["DECIMALS", "EmbeddingHead", "EmbeddingOptions", "EmbeddingTask", "read_target_embedding"]

DECIMALS = 5
"""Decimals of the embedding's values in ``predictions.json``."""


@dataclass
class EmbeddingOptions:
    """What an embedding model's explanations explain: its inference options (``--target_image``,
    ``--target_embedding`` of ``predict`` / ``explain``). Neither given: the embedding's norm.

    Attributes:
        target_image: an image file: explain the cosine between each image's embedding and this
            image's (which parts make the image similar to it).
        target_embedding: a ``.npy`` or ``.txt`` file holding one vector of the embedding's size
            (e.g. a CLIP or SigLIP text embedding): explain the cosine between each image's
            embedding and it.
    """

    target_image: str | None = None
    target_embedding: str | None = None

    def __post_init__(self) -> None:
        if self.target_image is not None and self.target_embedding is not None:
            raise ConfigError("give either --target_image or --target_embedding, not both")


def read_target_embedding(path: str | Path, size: int) -> Tensor:
    """The vector of ``size`` values in ``path`` (``.npy``: a NumPy array, read without pickles;
    ``.txt``: numbers separated by white space or commas), as a float tensor.

    Raises:
        ConfigError: a missing or unreadable file, another size, non-finite or all-zero values
            (one line naming the file).
    """
    file = Path(path)
    what = f"--target_embedding {file}"
    if not file.is_file():
        raise ConfigError(f"{what}: no such file; give a .npy or .txt file holding a vector of {size} values")
    try:
        if file.suffix.lower() == ".npy":
            values = np.load(file, allow_pickle=False)
        elif file.suffix.lower() == ".txt":
            values = np.array(file.read_text(encoding="utf-8").replace(",", " ").split(), dtype=np.float64)
        else:
            raise ConfigError(f"{what}: not a .npy or .txt file; give a vector of {size} values in one")
        vector = torch.as_tensor(np.asarray(values, dtype=np.float64).reshape(-1), dtype=torch.float32)
    except VisionAttnError:
        raise
    except (OSError, ValueError, TypeError, UnicodeDecodeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"{what}: cannot read a vector from it ({reason}); give a .npy or .txt file holding "
                          f"{size} numbers") from None
    if vector.numel() != size:
        raise ConfigError(f"{what} holds {vector.numel()} values; the model's embedding has {size}")
    if not bool(torch.isfinite(vector).all()) or float(vector.norm()) == 0.0:
        raise ConfigError(f"{what}: its values must be finite and not all zero")
    return vector


class EmbeddingHead(nn.Module):
    """The timm model's own pooling (and projection, if any) on the encoder's tokens, and the score
    the gradient methods explain.

    Its output is ``[B, 1 + E]``: column :attr:`target_column` (0) the explained score (the
    embedding's norm, or its cosine with :attr:`reference`), then the embedding ``[B, E]``. Like
    :class:`~vision_attn.models.classifier.TimmHead` it holds no parameters: the weights stay in the
    encoder's timm model.

    Attributes:
        pooling: timm's ``global_pool`` (``token``: the class token, ``avg``: the mean of the patch
            tokens, ``map``: attention pooling), which the attention methods follow.
        size: ``E``, the embedding's size.
        reference: ``[E]`` unit vector the cosine is taken with, or ``None`` (the norm).
        target_column: the column of the output that the explanations explain.
    """

    target_column = 0

    def __init__(self, encoder: ViTEncoder) -> None:
        super().__init__()
        model = encoder.model
        if not hasattr(model, "forward_head"):
            raise EncoderError(f"timm model {encoder.name!r} has no forward_head: its embedding is unknown")
        self.pooling: str = str(getattr(model, "global_pool", "token") or "")
        if not self.pooling:
            raise EncoderError(f"timm model {encoder.name!r} is built with global_pool='': it returns tokens, not "
                               "one embedding per image; use its pooled variant")
        self.distilled = False
        self.__dict__["_timm_model"] = model  # the encoder's: not a sub-module, saved once
        self.size = int(getattr(model, "num_classes", 0) or 0) or int(getattr(model, "num_features", 0)
                                                                         or encoder.embed_dim)
        self.reference: Tensor | None = None

    @property
    def global_pool(self) -> str:
        """timm's name of :attr:`pooling`."""
        return self.pooling

    def token_weights(self, out: EncoderOutput) -> Tensor:
        """``[B, T]``: an attention-pooling (``map``) model's weights over the tokens, the row its
        explanations follow (:func:`~vision_attn.models.classifier.attention_pool_weights`)."""
        return attention_pool_weights(self._timm_model, out.tokens)

    def embed(self, out: EncoderOutput) -> Tensor:
        """``[B, E]``: timm's ``forward_head`` (its pooling, ``fc_norm``, projection if any)."""
        return self._timm_model.forward_head(out.tokens)

    def score(self, embedding: Tensor) -> Tensor:
        """``[B]``: the norm of each embedding, or its cosine with :attr:`reference`."""
        if self.reference is None:
            return embedding.norm(dim=-1)
        return F.cosine_similarity(embedding, self.reference.to(embedding), dim=-1)

    def forward(self, out: EncoderOutput) -> Tensor:
        embedding = self.embed(out)
        return torch.cat([self.score(embedding)[:, None], embedding], dim=-1)  # (B, 1 + E)


@register_task
class EmbeddingTask(VisionTask):
    """A ViT without a classifier: an embedding per image, explained by its norm or a cosine
    (module docstring). Built by :func:`~vision_attn.tasks.sources.load_model` for ``timm:NAME``
    of a model without a head; not trained by vision_attn.

    Args:
        encoder: the ViT encoder (timm's model with ``num_classes=0``, or with a projection head).
        optim: kept for the task interface (not trained here).
        compile: ``torch.compile`` the encoder.
    """

    task_name = "embedding"
    built_from = "embedding head"
    inference_options = EmbeddingOptions  # --target_image, --target_embedding
    export_output_names = ("embedding",)
    overlay_description = "input | one overlay per explanation method (the embedding's norm, or a cosine)"

    def __init__(self, encoder: ViTEncoder, optim: Optimization = DEFAULT_OPTIM, compile: bool = False) -> None:
        super().__init__(encoder, optim, compile)
        self.save_hyperparameters(ignore=["encoder", "optim"])
        self.class_names = None
        self.head = EmbeddingHead(encoder)

    def build_from_data(self, datamodule) -> None:
        raise ConfigError("an embedding model (a timm model without a classifier) is not trained by vision_attn")

    def setup(self, stage: str) -> None:  # nothing comes from the data
        return None

    def forward(self, images: Tensor) -> Tensor:
        """The embeddings ``[B, E]`` of normalised images ``[B, 3, H, W]``."""
        return self.head.embed(self.encoder(images))

    def export_forward(self, images: Tensor) -> tuple[Tensor]:
        return (self(images),)

    # ------------------------------------------------------------------ targets
    def set_inference_options(self, options: EmbeddingOptions) -> None:
        """:meth:`VisionTask.set_inference_options`; the target (an image's embedding, a vector from
        a file) is read here, before any image runs.

        Raises:
            ConfigError: an unreadable target image or vector file, a vector of another size.
        """
        super().set_inference_options(options)
        reference = None
        if options.target_embedding is not None:
            reference = read_target_embedding(options.target_embedding, self.head.size)
        elif options.target_image is not None:
            reference = self.image_embedding(options.target_image)
        self.head.reference = None if reference is None else F.normalize(reference.float(), dim=0)

    def image_embedding(self, path: str | Path) -> Tensor:
        """``[E]``: the embedding of the image file ``path``, preprocessed as every image.

        Raises:
            ConfigError: a file that cannot be read as an image (naming it).
        """
        try:
            picture = read_image(path)
        except VisionAttnError as err:
            raise ConfigError(f"--target_image {path}: {' '.join(str(err).split())}") from None
        x = build_eval_transform(self.inference_data_config())(picture)[None]
        device = next(self.parameters()).device
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return self(x.to(device))[0].detach().float().cpu()
        finally:
            self.train(was_training)

    # ------------------------------------------------------------------ predictions and explanations
    def predictions_from_outputs(self, outputs, sizes, options=None) -> list[dict[str, Any]]:
        """``{"embedding_norm", "embedding"}`` per image from ``(embedding [B, E],)`` (the values
        rounded to :data:`DECIMALS` decimals), and ``"similarity"``, the cosine with the target
        image or vector, when one is set."""
        embeddings = outputs[0].detach().float()
        norms = embeddings.norm(dim=-1).tolist()
        reference = self.head.reference
        similarity = None
        if reference is not None:
            similarity = F.cosine_similarity(embeddings, reference.to(embeddings), dim=-1).tolist()
        records = []
        for i, (vector, norm) in enumerate(zip(embeddings.cpu().tolist(), norms, strict=True)):
            record: dict[str, Any] = {"embedding_norm": round(float(norm), DECIMALS)}
            if similarity is not None:
                record["similarity"] = round(float(similarity[i]), DECIMALS)
            record["embedding"] = [round(float(v), DECIMALS) for v in vector]
            records.append(record)
        return records

    def _caption(self, record: dict[str, Any]) -> str:
        options = self.inference
        if options is not None and options.target_image is not None:
            return f"cosine {record['similarity']:.2f} with {Path(options.target_image).name}"
        if options is not None and options.target_embedding is not None:
            return f"cosine {record['similarity']:.2f} with {Path(options.target_embedding).name}"
        return f"embedding norm {record['embedding_norm']:.2f}"

    def explain_batch(self, images, pictures, options, truths=None) -> list[Explained]:
        """The input and one overlay per method (``options.methods``), explaining the score of
        :class:`EmbeddingHead` (the norm, or the cosine with the target)."""
        expl = explain_classifier(self, images, options.methods, head_fusion=options.head_fusion,
                                  discard_ratio=options.discard_ratio)
        embeddings = expl.logits[:, 1:]
        records = self.predictions_from_outputs((embeddings,), [p.shape[:2] for p in pictures], options)
        pre = self.inference_data_config()
        display_tf = build_display_transform(pre)
        registers = register_shares(self.encoder, expl)
        out = []
        for j, (picture, record) in enumerate(zip(pictures, records, strict=True)):
            caption = self._caption(record)
            if truths is not None:
                caption = f"{truths[j]} -> {caption}"
            if registers is not None:  # the attention the patch maps do not show
                caption = f"{caption} | registers {float(registers[j]):.0%}"
            panel = explanation_panel(display_tf(picture), expl.maps, j, caption, options.alpha, picture=picture,
                                      pre=pre, normalize=options.normalize)
            item = None
            if getattr(options, "report", False):  # report.html: every patch's attention row, per layer and head
                item = attention_report_item(expl, j, display_tf(picture), caption, panel)
            out.append(Explained(record, panel, item, {"explanation": expl}))
        return out
