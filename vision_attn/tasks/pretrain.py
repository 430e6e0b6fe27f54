"""Self-supervised pretraining of the encoder on the training images themselves: masked image
modelling (He et al. 2022, "Masked autoencoders are scalable vision learners"; in the form of
Xie et al. 2022, SimMIM, which keeps every token in the encoder and so works with every stem).

::

    vision-attn fit --config configs/pretrain/mae.yaml --data.root ROOT --model.encoder.init_args.img_size 64
    vision-attn fit --config configs/captioning/small.yaml --data.root ROOT \\
        --model.encoder.init_args.weights_file runs/pretrain/checkpoints/last.ckpt

Each training image is cut into blocks of ``masking.block`` x ``masking.block`` patches, and a
share ``masking.ratio`` of the patches (whole blocks) is hidden: their pixels are set to the
mean colour (zero after normalisation) and their patch embeddings replaced by a learned mask
token, so no hidden pixel reaches the encoder (not even through a convolutional stem's
receptive field). A light decoder (``decoder.depth`` transformer blocks, 0: SimMIM's linear head)
predicts every hidden patch's pixels from the encoder's tokens; the loss is the mean squared
error over the hidden patches, each patch's pixels normalised by their own mean and standard
deviation (``masking.norm_pix_loss``, MAE's better target).

The result is an encoder: any task's ``--model.encoder.init_args.weights_file`` reads the
checkpoint (the ``encoder.model.*`` weights; the decoder and mask token are left out), as does
``vision-attn export --ckpt_path CKPT`` (an ``encoder.safetensors`` timm reads). Pretrain with
the same encoder settings (name, sizes, stem) as the task that will use it. The checkpoint
itself predicts nothing: ``predict``, ``explain`` and ``eval.py`` refuse it with that advice
(:attr:`~vision_attn.tasks.VisionTask.no_inference`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.errors import ConfigError, EncoderError
from vision_attn.models.encoder import ViTEncoder
from vision_attn.models.timm_family import patch_embedding
from vision_attn.tasks.base import VisionTask, register_task
from vision_attn.tasks.optim import Optimization

__all__ = ["MaskingConfig", "PixelDecoderConfig", "PretrainTask", "block_mask", "patch_pixels"]

PRETRAIN_OPTIM = Optimization(lr=1.5e-3, weight_decay=0.05, warmup_fraction=0.05, min_lr_ratio=0.01)


@dataclass(frozen=True)
class MaskingConfig:
    """What is hidden from the encoder and how the hidden pixels are scored (``--model.masking.*``).

    Attributes:
        ratio: the share of patches hidden per image (SimMIM: 0.6; MAE: 0.75).
        block: hide square blocks of this many patches per side (SimMIM hides 32 px blocks; 1:
            single patches). The grid need not be a multiple of it: blocks at the border are cut.
        norm_pix_loss: score each patch's pixels after normalising them by their own mean and
            standard deviation (MAE's target); false: the normalised image's pixels as they are.
    """

    ratio: float = 0.6
    block: int = 2
    norm_pix_loss: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.ratio < 1:
            raise ConfigError(f"--model.masking.ratio must lie strictly between 0 and 1, got {self.ratio}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ConfigError(f"--model.masking.block must be a positive integer, got {self.block!r}")


@dataclass(frozen=True)
class PixelDecoderConfig:
    """The decoder that predicts hidden pixels from the encoder's tokens (``--model.decoder.*``);
    it is thrown away after pretraining.

    Attributes:
        depth: transformer blocks before the pixel projection (0: a linear projection, SimMIM's).
        dim: their width.
        num_heads: their attention heads.
    """

    depth: int = 1
    dim: int = 128
    num_heads: int = 4

    def __post_init__(self) -> None:
        for key in ("depth", "dim", "num_heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "depth" else 1):
                raise ConfigError(f"--model.decoder.{key} must be a {'non-negative' if key == 'depth' else 'positive'} "
                                  f"integer, got {value!r}")
        if self.dim % self.num_heads:
            raise ConfigError(f"--model.decoder.dim {self.dim} must be a multiple of num_heads {self.num_heads}")


def block_mask(batch: int, grid: tuple[int, int], ratio: float, block: int,
               generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> Tensor:
    """``[B, h, w]`` booleans, ``True`` for a hidden patch: per image, randomly ordered blocks of
    ``block`` x ``block`` patches (cut at the grid's border) hidden until ``round(ratio * h * w)``
    patches are; the last block is hidden in part, so every image hides exactly that many."""
    h, w = grid
    bh, bw = -(-h // block), -(-w // block)
    want = min(h * w - 1, max(1, round(ratio * h * w)))
    # each patch's block, and a random rank per block: hide patches in the order of their block's rank
    rows = torch.arange(h, device=device) // block
    cols = torch.arange(w, device=device) // block
    block_of = (rows[:, None] * bw + cols[None, :]).reshape(-1)  # [h * w]
    ranks = torch.rand(batch, bh * bw, generator=generator, device="cpu" if generator is not None else device)
    ranks = ranks.to(device)
    patch_rank = ranks[:, block_of] + torch.arange(h * w, device=device) * 1e-9  # ties: row-major order
    order = patch_rank.argsort(dim=1)
    mask = torch.zeros(batch, h * w, dtype=torch.bool, device=device)
    mask.scatter_(1, order[:, :want], True)
    return mask.reshape(batch, h, w)


def patch_pixels(images: Tensor, grid: tuple[int, int]) -> Tensor:
    """``[B, h * w, 3 * ph * pw]``: each patch's pixels (channel first, then row-major within the
    patch, as ``F.unfold`` orders them) of images ``[B, 3, H, W]`` cut into a ``grid`` of patches."""
    h, w = grid
    ph, pw = images.shape[-2] // h, images.shape[-1] // w
    if ph * h != images.shape[-2] or pw * w != images.shape[-1]:
        raise EncoderError(f"images of {images.shape[-2]}x{images.shape[-1]} pixels do not divide into a {h}x{w} "
                           "patch grid; pretrain at a multiple of the patch size")
    return F.unfold(images, kernel_size=(ph, pw), stride=(ph, pw)).transpose(1, 2)


class PixelDecoder(nn.Module):
    """Encoder tokens ``[B, N, D]`` -> every patch's pixels ``[B, N, 3 * p * p]``."""

    def __init__(self, embed_dim: int, pixels: int, config: PixelDecoderConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim)
        if config.depth:
            self.proj_in = nn.Linear(embed_dim, config.dim)
            layer = nn.TransformerEncoderLayer(config.dim, config.num_heads, dim_feedforward=2 * config.dim,
                                               dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, config.depth, enable_nested_tensor=False)
            self.out = nn.Linear(config.dim, pixels)
        else:
            self.proj_in, self.blocks = nn.Identity(), nn.Identity()
            self.out = nn.Linear(embed_dim, pixels)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.blocks(self.proj_in(self.norm(tokens))))


@register_task
class PretrainTask(VisionTask):
    """Masked image modelling of an encoder (see the module docstring).

    Args:
        encoder: the :class:`~vision_attn.models.ViTEncoder` to pretrain.
        masking: what is hidden and how it is scored (:class:`MaskingConfig`).
        decoder: the pixel decoder (:class:`PixelDecoderConfig`).
        optim: learning rates, weight decay and schedule.
        compile: ``torch.compile`` the encoder.
    """

    task_name = "pretrain"
    built_from = "images"
    headline_metrics = ("loss",)
    no_inference = ("a pretraining checkpoint predicts nothing: its encoder is meant for another task. Train one "
                    "from it with --model.encoder.init_args.weights_file CKPT (the same encoder settings), or write "
                    "the encoder's weights with vision-attn export --ckpt_path CKPT")

    def __init__(self, encoder: ViTEncoder, masking: MaskingConfig = MaskingConfig(),
                 decoder: PixelDecoderConfig = PixelDecoderConfig(), optim: Optimization = PRETRAIN_OPTIM,
                 compile: bool = False) -> None:
        super().__init__(encoder, optim, compile)
        self.save_hyperparameters(ignore=["encoder", "optim", "masking", "decoder"])
        self.save_hyperparameters({"masking": asdict(masking), "decoder": asdict(decoder)})
        self.masking = masking
        self.class_names = None
        h, w = encoder.grid_for(*encoder.data_config["input_size"][1:])
        size = encoder.data_config["input_size"]
        pixels = 3 * (size[1] // h) * (size[2] // w)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, encoder.embed_dim))
        nn.init.normal_(self.mask_token, std=0.02)
        self.head = PixelDecoder(encoder.embed_dim, pixels, decoder)

    def build_from_data(self, datamodule: Any) -> None:  # the decoder does not depend on the data
        pass

    def masked_forward(self, images: Tensor, mask: Tensor) -> Tensor:
        """Predicted pixels ``[B, N, 3 * p * p]`` of every patch of ``images`` ``[B, 3, H, W]``
        when the patches where ``mask`` ``[B, h, w]`` is true are hidden."""
        b, (h, w) = images.shape[0], mask.shape[1:]
        hide = mask.reshape(b, h * w, 1)
        ph, pw = images.shape[-2] // h, images.shape[-1] // w
        pixel_mask = mask.repeat_interleave(ph, 1).repeat_interleave(pw, 2)[:, None]
        hidden = images.masked_fill(pixel_mask, 0.0)

        def swap_tokens(_module: nn.Module, _args: Any, out: Tensor) -> Tensor:
            if out.dim() not in (3, 4) or out.shape[0] != b or out.shape[1:-1].numel() != h * w:
                raise EncoderError(f"masked pretraining needs patch tokens [B, N, D] from the patch embedding, "
                                   f"got {tuple(out.shape)}")
            flat = out.reshape(b, h * w, out.shape[-1])
            flat = torch.where(hide, self.mask_token.to(flat.dtype).expand_as(flat), flat)
            return flat.reshape(out.shape)

        embed = patch_embedding(self.encoder.model)
        handle = embed.register_forward_hook(swap_tokens)
        try:
            encoded = self.encoder(hidden)
        finally:
            handle.remove()
        return self.head(encoded.tokens[:, encoded.num_prefix_tokens:])

    def reconstruction_loss(self, images: Tensor, mask: Tensor, predicted: Tensor) -> Tensor:
        """Mean squared error of the hidden patches' pixels (see :class:`MaskingConfig`)."""
        target = patch_pixels(images, tuple(mask.shape[1:]))
        if self.masking.norm_pix_loss:
            mean = target.mean(-1, keepdim=True)
            var = target.var(-1, keepdim=True)
            target = (target - mean) / (var + 1e-6).sqrt()
        per_patch = (predicted.float() - target.float()).pow(2).mean(-1)
        hide = mask.reshape(per_patch.shape).float()
        return (per_patch * hide).sum() / hide.sum().clamp(min=1.0)

    def _step(self, batch: Any, stage: str) -> Tensor:
        images = batch[0]
        grid = self.encoder.grid_for(images.shape[-2], images.shape[-1])
        generator = None
        if stage != "train":  # the same hidden patches at every validation: comparable losses
            generator = torch.Generator().manual_seed(int(batch[1][0]) if len(batch) > 1 else 0)
        mask = block_mask(images.shape[0], grid, self.masking.ratio, self.masking.block, generator, images.device)
        loss = self.reconstruction_loss(images, mask, self.masked_forward(images, mask))
        if stage == "train":
            self.check_finite(loss, {"reconstruction": loss})
        self.log(f"{stage}/loss", loss, prog_bar=True, on_step=stage == "train", on_epoch=True,
                 batch_size=images.shape[0], sync_dist=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._step(batch, "test")
