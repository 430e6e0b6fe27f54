"""The encoder's forward pass over a padded batch (images of different sizes padded to one):
every image's real tokens are those it would get alone (:func:`padded_forward_features`)."""

from __future__ import annotations

from typing import Any

import torch
from timm.layers import resample_abs_pos_embed
from torch import Tensor, nn

from vision_attn.errors import EncoderError

__all__ = ["padded_forward_features"]


def padded_forward_features(encoder: Any, x: Tensor, valid: list[tuple[int, int]], grid: tuple[int, int]
                            ) -> tuple[Tensor, Tensor]:
    """timm's ``forward_features`` for a padded batch, each image as if it were alone:
    ``(tokens [B, P + N, D], patch_mask [B, N])``.

    - patch embedding per image, on its own real patches (any stem: a convolutional stem's
      normalisation and borders then see only the image);
    - position embedding per image resampled to its own grid (timm's
      ``resample_abs_pos_embed``, as the dynamic-size forward does for the whole input);
    - every block runs with a key mask (timm's ``attn_mask``): no token attends to padding.
    Padded tokens are computed too (they attend to the real ones) but nothing reads them.
    """
    m = encoder.model
    if encoder.family != "VisionTransformer":
        raise EncoderError(f"padded batches (images of different sizes) need a timm VisionTransformer; "
                           f"{encoder.name!r} is of the timm class {encoder.family}: give images of one size")
    if not getattr(m, "dynamic_img_size", False):
        raise EncoderError("padded batches (images of different sizes) need an encoder built with "
                           "dynamic_img_size=True")
    if m.training and not isinstance(m.patch_drop, nn.Identity):
        raise EncoderError("padded batches (images of different sizes) cannot be trained with timm's patch "
                           "dropout (patch_drop_rate > 0): set patch_drop_rate to 0 or use a fixed input size")
    b, (gh, gw), ph, pw = x.shape[0], grid, *encoder.patch_size
    cells = None
    for i, (h, w) in enumerate(valid):
        emb = m.patch_embed(x[i : i + 1, :, : h * ph, : w * pw])  # (1, h, w, D): NHWC when dynamic
        if cells is None:
            cells = emb.new_zeros(b, gh, gw, emb.shape[-1])
        cells[i, :h, :w] = emb[0]
    d = cells.shape[-1]
    n_pos_prefix = 0 if m.no_embed_class else m.num_prefix_tokens
    pos = cells.new_zeros(b, gh, gw, d)
    pos_prefix = None
    for size in set(valid) if m.pos_embed is not None else ():
        res = resample_abs_pos_embed(m.pos_embed, new_size=size, old_size=m.patch_embed.grid_size,
                                     num_prefix_tokens=n_pos_prefix)
        pos_prefix = res[:, :n_pos_prefix]
        for i in (i for i, v in enumerate(valid) if v == size):
            pos[i, : size[0], : size[1]] = res[0, n_pos_prefix:].reshape(*size, d)
    tokens = cells.reshape(b, gh * gw, d)
    prefix = []
    if m.cls_token is not None:
        prefix.append(m.cls_token.expand(b, -1, -1))
    if getattr(m, "dist_token", None) is not None:  # DeiT's distillation token follows the class token
        prefix.append(m.dist_token.expand(b, -1, -1))
    if m.reg_token is not None:
        prefix.append(m.reg_token.expand(b, -1, -1))
    pos = pos.reshape(b, gh * gw, d)
    if m.pos_embed is None:
        tokens = torch.cat([*prefix, tokens], dim=1) if prefix else tokens
    elif m.no_embed_class:
        tokens = tokens + pos
        tokens = torch.cat([*prefix, tokens], dim=1) if prefix else tokens
    else:
        tokens = torch.cat([*prefix, tokens], dim=1) if prefix else tokens
        tokens = tokens + (torch.cat([pos_prefix.expand(b, -1, -1), pos], dim=1) if n_pos_prefix else pos)
    tokens = m.norm_pre(m.patch_drop(m.pos_drop(tokens)))
    patch_mask = torch.zeros(b, gh, gw, dtype=torch.bool, device=x.device)
    for i, (h, w) in enumerate(valid):
        patch_mask[i, :h, :w] = True
    encoder._set_local_grid(grid, patch_mask)
    patch_mask = patch_mask.reshape(b, gh * gw)
    keep = torch.cat([patch_mask.new_ones(b, m.num_prefix_tokens), patch_mask], dim=1)[:, None, None, :]
    with encoder._attention_path(x.device, tokens.shape[1]):
        for blk in m.blocks:
            tokens = blk(tokens, attn_mask=keep)
    tokens = m.norm(tokens)
    return tokens, patch_mask
