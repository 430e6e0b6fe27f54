"""ViT encoder: where the suite builds and runs timm models. The timm-facing parts live beside it:
which timm classes it reads (:mod:`~vision_attn.models.timm_family`), how a timm model is built
(:mod:`~vision_attn.models.timm_build`), how weights files load
(:mod:`~vision_attn.models.encoder_weights`) and the forward pass over padded batches
(:mod:`~vision_attn.models.encoder_padding`); their public names are importable from here too.

``ViTEncoder`` wraps a timm Vision Transformer with global attention over its patch grid and
returns its tokens together with what downstream code needs to interpret them:

- ``tokens``: ``[B, P + N, D]``, identical to timm's ``forward_features`` (final norm applied);
- ``num_prefix_tokens``: ``P``, the class / distillation / register tokens in front;
- ``grid``: ``(h, w)`` patch grid of the *actual* input, so ``N = h * w`` (dynamic image size).

The timm classes it reads (:data:`READABLE_CLASSES`; ``docs/timm_families.md`` lists the models
checked against timm): ``VisionTransformer`` with all its options (``vit_*``, ``deit_*``
distilled, registers, ``token`` / ``avg`` / ``map`` pooling, no class token, layer scale,
QK-norm, FlexiViT), ``VisionTransformerRelPos``, ``Eva`` (EVA-02, RoPE ViTs, Perception
Encoder), ``Beit``, ``Cait`` (its maps read the class-attention blocks) and ``NaFlexVit``. The
model is built with the keyword arguments its class takes (:func:`constructor_arguments`): the
suite's defaults (dropout, ``dynamic_img_size``) go only to classes that take them; Beit, Cait
and ``VisionTransformerRelPos`` then run at the input size they were built for. Windowed,
pooling and channel attention (Swin, PiT, MViT, XCiT) and convolutional networks are refused
with one :class:`~vision_attn.errors.EncoderError` saying why (:func:`refusal`).

Preprocessing (input size, mean, std, interpolation, crop fraction, crop mode) comes from
timm's data config and is kept in ``data_config``; tasks store it in their checkpoints
(:mod:`vision_attn.data.transforms` applies it exactly as timm evaluates).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.attention import explicit_attention, explicit_is_faster
from vision_attn.checkpoint_io import load_state_dict_file
from vision_attn.errors import CheckpointError, EncoderError
from vision_attn.models.encoder_padding import padded_forward_features
from vision_attn.models.encoder_weights import check_stem_and_lsa, load_state
from vision_attn.models.smalldata import (
    ConvStem,
    ShiftedPatchTokenizer,
    apply_local_mlp,
    apply_locality_self_attention,
)
from vision_attn.models.timm_build import (
    CHECKPOINT_TIMM_KWARGS,
    HUB_PROBE_SECONDS,
    TIMM_SOURCE_KWARGS,
    _build_timm_model,
    _plain_data,
    checked_timm_kwargs,
    hub_offline_when_unreachable,
    hub_reachable,
)
from vision_attn.models.timm_family import (
    READABLE_CLASSES,
    UNREADABLE_CLASSES,
    _check_readable,
    constructor_arguments,
    model_family,
    patch_embedding,
    refusal,
    suggest_model_names,
    timm_attention_blocks,
    unreadable_reason,
)
from vision_attn.schema import JSONValue, PreprocessOverrides, check_limits, check_value

__all__ = [
    "CHECKPOINT_TIMM_KWARGS",
    "HUB_PROBE_SECONDS",
    "READABLE_CLASSES",
    "TIMM_SOURCE_KWARGS",
    "UNREADABLE_CLASSES",
    "ConvStem",
    "EncoderOutput",
    "ViTEncoder",
    "checked_timm_kwargs",
    "constructor_arguments",
    "create_encoder",
    "hub_offline_when_unreachable",
    "hub_reachable",
    "model_family",
    "patch_embedding",
    "refusal",
    "suggest_model_names",
    "timm_attention_blocks",
    "unreadable_reason",
]

log = logging.getLogger(__name__)


@dataclass
class EncoderOutput:
    """What :class:`ViTEncoder` returns.

    Attributes:
        tokens: ``[B, P + N, D]`` — prefix tokens first, then patch tokens in row-major order.
        num_prefix_tokens: ``P``.
        grid: ``(h, w)`` with ``h * w = N``.
        patch_mask: ``[B, N]`` ``True`` for the patches of real pixels, ``False`` for padding
            (a batch of images of different sizes padded to one, :meth:`ViTEncoder.forward` with
            ``image_sizes``); ``None`` when every patch is real.
        embedding_tokens: ``[B, P + N, D]`` the tokens entering the first block (patch embedding +
            positions), only when :attr:`ViTEncoder.keep_embedding` is set; else ``None``.
        pixel_tokens: ``[B, N, 3 * p * p]`` each patch's own pixels (the normalised input, channel
            first then row-major within the patch, as ``F.unfold`` orders them), only when
            :attr:`ViTEncoder.keep_pixels` is set; else ``None``.
    """

    tokens: Tensor
    num_prefix_tokens: int
    grid: tuple[int, int]
    patch_mask: Tensor | None = None
    embedding_tokens: Tensor | None = None
    pixel_tokens: Tensor | None = None

    def valid_grids(self) -> list[tuple[int, int]]:
        """Per image, the ``(rows, columns)`` of its real patches (the top-left corner of the
        grid: images are padded at the bottom and on the right); the whole grid without a mask."""
        if self.patch_mask is None:
            return [tuple(self.grid)] * self.tokens.shape[0]
        m = self.patch_mask.reshape(-1, *self.grid)
        rows, cols = m[:, :, 0].sum(1).tolist(), m[:, 0, :].sum(1).tolist()
        return [(int(r), int(c)) for r, c in zip(rows, cols, strict=True)]

    @property
    def patch_tokens(self) -> Tensor:
        """``[B, N, D]``: the tokens of the image patches (the image regions)."""
        return self.tokens[:, self.num_prefix_tokens :]

    @property
    def prefix_tokens(self) -> Tensor:
        """``[B, P, D]``: class / distillation / register tokens."""
        return self.tokens[:, : self.num_prefix_tokens]


PREPROCESS_KEYS = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")


class ViTEncoder(nn.Module):
    """A timm Vision Transformer returning tokens, prefix count and patch grid.

    Args:
        name: timm model name (``vit_tiny_patch16_224``, ``deit_small_distilled_patch16_224``,
            ``vit_small_patch16_224.augreg_in21k``, ``vit_base_patch16_reg4_gap_224``, ...).
            The size arguments below override the architecture for from-scratch models.
        pretrained: load timm's pretrained weights from the hub (needs network access or a
            populated hub cache).
        weights_file: load weights from a local ``.safetensors`` / ``.pth`` / ``.pt`` / ``.bin``
            file instead, or from a vision_attn checkpoint (``.ckpt``: its encoder, e.g. of
            ``configs/pretrain/mae.yaml`` or of another task; read without executing pickled
            code). Position embeddings are resampled to ``img_size`` and a classifier head of
            another size is dropped.
        img_size: training image size (the position-embedding grid); other sizes still work.
        patch_size: patch side in pixels.
        embed_dim: token width ``D``.
        depth: number of transformer blocks.
        num_heads: attention heads per block.
        mlp_ratio: hidden width of the MLP relative to ``embed_dim``.
        num_classes: size of timm's own classifier head (0 = none). The suite's task heads
            live outside the encoder; keep 0 unless you want timm's logits.
        drop_rate: dropout after the position embedding and in the MLPs.
        drop_path_rate: stochastic depth.
        dynamic_img_size: accept any input size (multiple of the patch size), resampling the
            position embeddings on the fly (for the classes that take it; NaFlexVit always does,
            Beit, Cait and ``VisionTransformerRelPos`` take their built ``img_size`` only:
            :attr:`fixed_input_size`).
        timm_kwargs: further keyword arguments for ``timm.create_model``: JSON scalars or lists of
            them (``{"qk_norm": true, "reg_tokens": 4}``). Arguments that make timm read files
            or download (:data:`TIMM_SOURCE_KWARGS`) are refused: use ``weights_file``.
        stem: how pixels become tokens (all four give the same ``p x p`` token grid):
            ``patch`` (timm's linear patch embedding: what pretrained timm weights need),
            ``conv`` (strided convolutions, :class:`~vision_attn.models.smalldata.ConvStem`, Xiao
            et al. 2021), ``cnn`` (a small CNN: convolutions and max pooling, the same class) or
            ``spt`` (shifted patch tokenization,
            :class:`~vision_attn.models.smalldata.ShiftedPatchTokenizer`, Lee et al. 2021), all for
            small models trained from scratch. ``conv``, ``cnn`` and ``spt`` replace
            timm's ``patch_embed.proj``: with ``pretrained=True`` that projection's weights are
            dropped (a warning says so), and a ``weights_file`` must come from an encoder with
            the same stem (a plain timm file is refused with a clear error).
        preprocess: overrides of timm's data config (``input_size``, ``mean``, ``std``,
            ``interpolation``, ``crop_pct``, ``crop_mode``), e.g. ``{"crop_pct": 1.0}`` for small
            images.
        lsa: locality self-attention (Lee et al. 2021) in every block
            (:class:`~vision_attn.models.smalldata.LocalitySelfAttention`: a learned temperature
            per block and no attention of a token to itself), for small models trained from
            scratch. Pretrained and ``weights_file`` weights load into it (a file without the
            temperatures starts them at timm's ``1 / sqrt(d_head)``).
        stem_channels: width of the first conv of ``stem='conv'`` or ``'cnn'`` (doubling per
            stage up to ``embed_dim``); ``None``: ``embed_dim / patch_size`` (at least 8). Ignored,
            with a warning, for the other stems.
        stem_norm: the normalisation inside ``stem='conv'`` or ``'cnn'``: ``layer`` (default) or
            ``instance`` (per channel and image; for pictures whose colours vary more between
            images than the objects differ).
        local_mlp: a depthwise 3x3 convolution over the patch grid inside every block's
            feed-forward (:class:`~vision_attn.models.smalldata.LocalMlp`; LocalViT, CeiT,
            PVTv2), for small models trained from scratch: each block mixes a token with its
            neighbours. Weights must come from an encoder built the same way (a plain timm file
            is refused with a clear error); token merging cannot run on it.
    """

    def __init__(
        self,
        name: str = "vit_tiny_patch16_224",
        pretrained: bool = False,
        weights_file: str | None = None,
        img_size: int | None = None,
        patch_size: int | None = None,
        embed_dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: float | None = None,
        num_classes: int = 0,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        dynamic_img_size: bool = True,
        timm_kwargs: dict[str, JSONValue] | None = None,
        stem: Literal["patch", "conv", "cnn", "spt"] = "patch",
        preprocess: PreprocessOverrides | None = None,
        lsa: bool = False,
        stem_channels: int | None = None,
        local_mlp: bool = False,
        stem_norm: Literal["layer", "instance"] = "layer",
    ) -> None:
        super().__init__()
        # The constructor arguments, minus where the weights came from: enough to rebuild the
        # architecture (weights then come from a checkpoint).
        self.init_args: dict[str, Any] = {
            "name": name, "img_size": img_size, "patch_size": patch_size, "embed_dim": embed_dim,
            "depth": depth, "num_heads": num_heads, "mlp_ratio": mlp_ratio, "num_classes": num_classes,
            "drop_rate": drop_rate, "drop_path_rate": drop_path_rate, "dynamic_img_size": dynamic_img_size,
            "timm_kwargs": dict(timm_kwargs or {}), "stem": stem, "preprocess": dict(preprocess or {}),
            "lsa": bool(lsa), "stem_channels": stem_channels, "stem_norm": stem_norm, "local_mlp": bool(local_mlp),
        }
        if pretrained and weights_file:
            raise EncoderError("Give either pretrained=True (timm hub) or weights_file=PATH, not both.")
        kwargs: dict[str, Any] = checked_timm_kwargs(timm_kwargs)
        if preprocess is not None:
            check_value(preprocess, PreprocessOverrides, "preprocess", "ViTEncoder", EncoderError)
        sizes = {"img_size": img_size, "patch_size": patch_size, "embed_dim": embed_dim, "depth": depth,
                 "num_heads": num_heads, "mlp_ratio": mlp_ratio}
        kwargs.update({k: v for k, v in sizes.items() if v is not None})
        kwargs.update(num_classes=num_classes)
        defaults = {"drop_rate": drop_rate, "drop_path_rate": drop_path_rate, "dynamic_img_size": dynamic_img_size}
        arch = name.split(".")[0] if isinstance(name, str) else ""
        if not timm.is_model(arch):
            raise EncoderError(f"Unknown timm model name {name!r}.{suggest_model_names(arch)}")
        check_limits({**kwargs, **defaults, **dict(preprocess or {})}, f"encoder {name}",
                     error=EncoderError)
        model = _build_timm_model(name, pretrained, kwargs, defaults)
        self.family: str = _check_readable(name, model)
        self._replace_parts(model, name, pretrained, stem, {"channels": stem_channels, "norm": stem_norm}, lsa,
                           local_mlp)
        self.local_mlp = bool(local_mlp)
        self.model = model
        self.name = name
        self.stem = stem
        self.lsa = bool(lsa)
        if weights_file:
            self.load_weights(weights_file)
        embed = patch_embedding(model)
        self.embed_dim: int = model.embed_dim
        self.num_heads: int = model.blocks[0].attn.num_heads
        self.depth: int = len(model.blocks)
        self.num_prefix_tokens: int = model.num_prefix_tokens
        self.patch_size: tuple[int, int] = tuple(embed.patch_size)
        # the input size of a model that takes no other (timm's strict patch embedding), else None
        strict = getattr(embed, "strict_img_size", False) and getattr(embed, "img_size", None) is not None
        self.fixed_input_size: tuple[int, int] | None = tuple(int(s) for s in embed.img_size) if strict else None
        self.data_config: dict[str, Any] = self._resolve_data_config(preprocess or {})
        # Set by a head that reads the first block's input too (the caption decoder's
        # ``embedding_memory``): forward then fills ``EncoderOutput.embedding_tokens``.
        self.keep_embedding: bool = False
        # Set by a head that reads each patch's pixels (the caption decoder's ``pixel_memory``):
        # forward then fills ``EncoderOutput.pixel_tokens``.
        self.keep_pixels: bool = False

    def _replace_parts(self, model: nn.Module, name: str, pretrained: bool, stem: str, stem_options: dict[str, Any],
                       lsa: bool, local_mlp: bool) -> None:
        """The small-data options: another stem, locality self-attention, local feed-forward
        (they change timm's ``VisionTransformer``, and only that class)."""
        if self.family != "VisionTransformer" and (stem != "patch" or lsa or local_mlp):
            raise EncoderError(
                f"stem={stem!r}, lsa={bool(lsa)}, local_mlp={bool(local_mlp)}: the small-data options change timm's "
                f"VisionTransformer, and {name!r} is of the timm class {self.family}; build it with stem='patch', "
                "lsa=False and local_mlp=False"
            )
        stems = {"conv": ConvStem, "cnn": ConvStem, "spt": ShiftedPatchTokenizer}
        if stem_options["channels"] is not None and stem not in ("conv", "cnn"):
            # a config's stem switched on the command line (stem: patch on top of small.yaml) keeps working
            log.warning("stem_channels=%s sets the width of stem='conv' and is ignored with stem=%r",
                        stem_options["channels"], stem)
        if stem in stems:
            if pretrained:
                log.warning("stem=%r replaces the pretrained linear patch embedding of %s by a freshly "
                            "initialised one (stem='patch' keeps it)", stem, name)
            in_chans = model.patch_embed.proj.in_channels
            extra = {**stem_options, "pool": stem == "cnn"} if stem in ("conv", "cnn") else {}
            model.patch_embed.proj = stems[stem](model.patch_embed.patch_size[0], model.embed_dim, in_chans, **extra)
        elif stem != "patch":
            raise EncoderError(f"stem must be 'patch', 'conv', 'cnn' or 'spt', got {stem!r}")
        if lsa:
            apply_locality_self_attention(model)
        if local_mlp:
            apply_local_mlp(model)

    @property
    def class_attention(self) -> bool:
        """Whether the maps read class attention (Cait): the class token's attention over itself
        and the patches, ``[B, heads, 1, T]`` per block, instead of every token's."""
        return self.family == "Cait"

    @property
    def attention_blocks(self) -> list[nn.Module]:
        """The blocks whose attention the maps read, first first (:func:`timm_attention_blocks`)."""
        return timm_attention_blocks(self.model)

    @property
    def last_block(self) -> nn.Module:
        """The last block that reads every token (Grad-CAM reads its ``norm1`` output)."""
        return timm_attention_blocks(self.model)[-1]

    def architecture_config(self) -> dict[str, Any]:
        """``{"class_path", "init_args"}`` that rebuilds this encoder without downloading weights."""
        init_args = {**self.init_args, "pretrained": False, "weights_file": None}
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": init_args}

    @classmethod
    def checked_architecture_args(cls, init_args: Any, what: str = "checkpoint") -> dict[str, Any]:
        """Constructor arguments read from a checkpoint, made safe to build from.

        A checkpoint describes an architecture, never where weights come from: ``pretrained`` is
        forced to ``False`` and ``weights_file`` to ``None`` (so building reads no file and
        downloads nothing; the weights come from the checkpoint), and ``timm_kwargs`` may only
        hold the plain architecture arguments of :data:`CHECKPOINT_TIMM_KWARGS`.

        Raises:
            CheckpointError: naming ``what`` and the key, for an unknown argument, a timm argument
                outside the allow-list (``pretrained_cfg_overlay``, ``checkpoint_path``, layer
                classes, ...) or a value that is not plain data.
        """
        if not isinstance(init_args, dict):
            raise CheckpointError(f"{what}: the encoder's init_args are not a mapping")
        known = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(str(k) for k in init_args if k not in known)
        if unknown:
            raise CheckpointError(
                f"{what}: the encoder's stored arguments have unknown keys {unknown}; "
                "use a checkpoint written by train.py"
            )
        args = dict(init_args)
        for key, safe in (("pretrained", False), ("weights_file", None)):
            if args.get(key) not in (safe, None, False):
                log.warning("%s: ignoring the stored encoder argument %s=%r (weights come from the checkpoint)",
                            what, key, args[key])
            args[key] = safe
        timm_kwargs = args.get("timm_kwargs") or {}
        if not isinstance(timm_kwargs, dict):
            raise CheckpointError(f"{what}: the encoder's timm_kwargs are not a mapping")
        refused = sorted(str(k) for k in timm_kwargs if k not in CHECKPOINT_TIMM_KWARGS)
        if refused:
            raise CheckpointError(
                f"{what}: the encoder's timm_kwargs {refused} are not architecture arguments that a "
                "checkpoint may set (they can make timm read files or download weights); allowed: "
                f"{', '.join(sorted(CHECKPOINT_TIMM_KWARGS))}"
            )
        values = {k: v for k, v in args.items() if k != "timm_kwargs"}
        values.update({f"timm_kwargs.{k}": v for k, v in timm_kwargs.items()})
        for key, value in values.items():
            if not _plain_data(value):
                raise CheckpointError(
                    f"{what}: the encoder's argument {key} is not plain data ({type(value).__name__})"
                )
        args["timm_kwargs"] = dict(timm_kwargs)
        return args

    # ------------------------------------------------------------------ preprocessing
    def _resolve_data_config(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """timm's data config, with the input size of *this* model (not of the pretrained tag)."""
        unknown = set(overrides) - set(PREPROCESS_KEYS)
        if unknown:
            raise EncoderError(f"preprocess has unknown keys {sorted(unknown)}; allowed: {', '.join(PREPROCESS_KEYS)}")
        cfg = dict(timm.data.resolve_model_data_config(self.model))
        embed = patch_embedding(self.model)
        img_size = getattr(embed, "img_size", None) or getattr(embed, "default_img_size", None)
        if img_size is not None:
            cfg["input_size"] = (3, int(img_size[0]), int(img_size[1]))
        cfg.update(overrides)
        return {
            "input_size": tuple(int(s) for s in cfg["input_size"]),
            "interpolation": str(cfg.get("interpolation", "bicubic")),
            "mean": tuple(float(m) for m in cfg["mean"]),
            "std": tuple(float(s) for s in cfg["std"]),
            "crop_pct": float(cfg.get("crop_pct", 1.0)),
            "crop_mode": str(cfg.get("crop_mode") or "center"),
        }

    # ------------------------------------------------------------------ weights
    def load_weights(self, path: str | Path) -> None:
        """Load a local weights file into the timm model (safe: no pickled code runs).

        Accepts a plain timm state dict, a ``{"state_dict": ...}`` / ``{"model": ...}`` wrapper,
        keys prefixed ``module.`` or ``model.``, and resamples position embeddings with timm's own
        checkpoint filter. A classifier head whose shape differs from this model's is dropped
        (with a warning) so the weights can be fine-tuned on another label set.
        """
        self.load_state(load_state_dict_file(path), str(path))

    def classifier_keys(self) -> tuple[str, ...]:
        """Names of timm's classifier modules (``head``; ``head``, ``head_dist`` for distilled DeiT)."""
        classifier = self.model.pretrained_cfg.get("classifier", "head")
        return (classifier,) if isinstance(classifier, str) else tuple(classifier)

    def load_state(self, state: dict[str, Tensor], path: str = "weights") -> None:
        """Load a timm state dict already read (see :meth:`load_weights`; ``path`` names it in
        messages; :func:`~vision_attn.models.encoder_weights.load_state`)."""
        load_state(self, state, path)

    def _check_stem_and_lsa(self, state: dict[str, Tensor], path: str) -> None:
        """Clear errors for weights of another stem, attention or feed-forward kind than this encoder's."""
        check_stem_and_lsa(self, state, path)


    def grid_for(self, height: int, width: int) -> tuple[int, int]:
        """Patch grid ``(h, w)`` for an input of ``height x width`` pixels."""
        return tuple(int(g) for g in patch_embedding(self.model).dynamic_feat_size((height, width)))

    def forward(self, x: Tensor, image_sizes: Tensor | None = None) -> EncoderOutput:
        """Encode images ``[B, 3, H, W]`` (normalised with ``data_config``).

        Args:
            x: the images; a batch of images of different sizes is padded at the bottom and on
                the right (with zeros, i.e. the mean colour after normalisation) to one size.
            image_sizes: ``[B, 2]`` each image's own ``(height, width)`` in pixels before that
                padding. When some image is smaller than the batch, the padded patches are
                masked (:meth:`_forward_padded`): every image's real tokens are those it would
                get alone. ``None`` (or every image the batch's size): timm's own forward.
        """
        if x.dim() != 4 or x.shape[1] != 3:
            raise EncoderError(f"ViTEncoder expects images [B, 3, H, W], got {tuple(x.shape)}")
        if self.fixed_input_size is not None and tuple(x.shape[-2:]) != self.fixed_input_size:
            raise EncoderError(
                f"timm model {self.name!r} ({self.family}) takes images of {self.fixed_input_size[0]}x"
                f"{self.fixed_input_size[1]} pixels only, got {x.shape[-2]}x{x.shape[-1]}; resize the images "
                "(the model's data_config does) or build it with that img_size"
            )
        if not self.keep_embedding:
            out = self._forward(x, image_sizes)
        else:
            if self.class_attention:
                raise EncoderError(f"keep_embedding: the first block of {self.name!r} ({self.family}) reads the "
                                   "patch tokens only (its class token enters later), not [B, P + N, D] tokens")
            kept: list[Tensor] = []
            hook = self.model.blocks[0].register_forward_pre_hook(lambda _m, args: kept.append(args[0]))
            try:
                out = self._forward(x, image_sizes)
            finally:
                hook.remove()
            out.embedding_tokens = kept[0]
        if self.keep_pixels:
            out.pixel_tokens = self.pixel_patches(x, out.grid)
        return out

    def pixel_patches(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """Each patch's pixels ``[B, N, 3 * ph * pw]`` of images ``[B, 3, H, W]`` on the token
        ``grid`` (a partial patch at the bottom or right edge, which the dynamic-size encoder pads
        with zeros, is padded the same way)."""
        ph, pw = self.patch_size
        h, w = grid[0] * ph, grid[1] * pw
        x = F.pad(x, (0, max(w - x.shape[-1], 0), 0, max(h - x.shape[-2], 0)))[..., :h, :w]
        return F.unfold(x, (ph, pw), stride=(ph, pw)).transpose(1, 2)

    def _forward(self, x: Tensor, image_sizes: Tensor | None) -> EncoderOutput:
        grid = self.grid_for(x.shape[-2], x.shape[-1])
        if image_sizes is not None:
            valid = self._valid_grids(image_sizes, grid, x.shape[0])
            if any(v != grid for v in valid):
                return self._forward_padded(x, valid, grid)
        self._set_local_grid(grid, None)
        with self._attention_path(x.device, self.num_prefix_tokens + grid[0] * grid[1]):
            tokens = self.model.forward_features(x)  # (B, P + h*w, D)
        return EncoderOutput(tokens=tokens, num_prefix_tokens=self.num_prefix_tokens, grid=grid)

    def _attention_path(self, device: torch.device, num_tokens: int) -> contextlib.AbstractContextManager:
        """The blocks' self-attention on its explicit path where that is faster (short sequences
        on the CPU, :func:`~vision_attn.attention.explicit_is_faster`), else as it is."""
        if not explicit_is_faster(device, num_tokens, num_tokens):
            return contextlib.nullcontext()
        return explicit_attention(b.attn for b in self.model.blocks
                                  if getattr(getattr(b, "attn", None), "fused_attn", False))

    def _set_local_grid(self, grid: tuple[int, int], valid: Tensor | None) -> None:
        if getattr(self, "local_mlp", False):
            for block in self.model.blocks:
                block.mlp.grid, block.mlp.valid = grid, valid

    def _valid_grids(self, image_sizes: Tensor, grid: tuple[int, int], batch: int) -> list[tuple[int, int]]:
        """Per image, its real patch rows and columns: ``ceil(size / patch)`` (a patch holding any
        real pixel is real), checked against the batch's grid."""
        sizes = torch.as_tensor(image_sizes).reshape(-1, 2).tolist()
        if len(sizes) != batch:
            raise EncoderError(f"image_sizes has {len(sizes)} rows for a batch of {batch} images")
        ph, pw = self.patch_size
        valid = [(-(-int(h) // ph), -(-int(w) // pw)) for h, w in sizes]
        for (h, w), (gh, gw) in zip(sizes, valid, strict=True):
            if not (0 < gh <= grid[0] and 0 < gw <= grid[1]):
                raise EncoderError(f"image size {int(h)}x{int(w)} does not fit the padded batch of "
                                   f"{grid[0] * ph}x{grid[1] * pw} pixels")
        return valid

    def _forward_padded(self, x: Tensor, valid: list[tuple[int, int]], grid: tuple[int, int]) -> EncoderOutput:
        """timm's ``forward_features`` for a padded batch, each image as if it were alone
        (:func:`~vision_attn.models.encoder_padding.padded_forward_features`)."""
        tokens, patch_mask = padded_forward_features(self, x, valid, grid)
        return EncoderOutput(tokens=tokens, num_prefix_tokens=self.num_prefix_tokens, grid=grid,
                             patch_mask=patch_mask)

    def forward_head(self, out: EncoderOutput, pre_logits: bool = False) -> Tensor:
        """timm's own pooling + classifier on the tokens (only useful with ``num_classes > 0``)."""
        return self.model.forward_head(out.tokens, pre_logits=pre_logits)


def create_encoder(
    name: str = "vit_tiny_patch16_224",
    pretrained: bool = False,
    weights_file: str | None = None,
    **timm_kwargs: Any,
) -> ViTEncoder:
    """Build a :class:`ViTEncoder` from a timm name and keyword arguments.

    Args:
        name: the timm model name (``vit_small_patch16_224``, ``deit_tiny_distilled_patch16_224``, ...).
        pretrained: load timm's pretrained weights from the hub (network access or a populated cache).
        weights_file: load the weights from this local file instead (safetensors, a PyTorch state
            dict read without executing pickled code, or a vision_attn checkpoint's encoder).
        **timm_kwargs: arguments that :class:`ViTEncoder` names (``img_size``, ``depth``, ...) are
            passed as such; any other goes to ``timm.create_model``.

    Returns:
        The encoder, in training mode.

    Raises:
        EncoderError: an unknown name, a model the suite cannot explain, weights that do not fit.
    """
    named = set(inspect.signature(ViTEncoder.__init__).parameters) - {"self", "timm_kwargs"}
    direct = {k: v for k, v in timm_kwargs.items() if k in named}
    extra = {k: v for k, v in timm_kwargs.items() if k not in named}
    return ViTEncoder(name=name, pretrained=pretrained, weights_file=weights_file, timm_kwargs=extra, **direct)
