"""ViTEncoder against timm's own models with the same weights."""

from __future__ import annotations

import logging

import pytest
import timm
import torch
from safetensors.torch import save_file

from vision_attn import create_encoder
from vision_attn.attention import explicit_attention
from vision_attn.checkpoint_io import CheckpointError
from vision_attn.errors import EncoderError
from vision_attn.models.encoder import ViTEncoder

from .conftest import TINY_VIT


def _timm(name: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return timm.create_model(name, dynamic_img_size=True, **kwargs).eval()


@pytest.mark.parametrize(
    "name, prefix",
    [
        ("vit_tiny_patch16_224", 1),
        ("deit_tiny_distilled_patch16_224", 2),
        ("vit_base_patch16_reg4_gap_256", 4),
        ("vit_small_patch14_reg4_dinov2", 5),
    ],
)
def test_tokens_equal_timm_forward_features(name: str, prefix: int):
    kwargs = dict(TINY_VIT)
    ref = _timm(name, num_classes=0, **kwargs)
    enc = create_encoder(name, **kwargs).eval()
    enc.model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = enc(x)
        fused = ref.forward_features(x)
        # short sequences on the CPU run timm's own explicit attention path (faster there)
        with explicit_attention(blk.attn for blk in ref.blocks):
            expected = ref.forward_features(x)
    assert torch.equal(out.tokens, expected)
    torch.testing.assert_close(out.tokens, fused, rtol=1e-5, atol=1e-5)
    assert out.num_prefix_tokens == prefix == enc.num_prefix_tokens
    assert out.grid == (4, 4)
    assert out.tokens.shape == (2, prefix + 16, 32)
    assert out.patch_tokens.shape == (2, 16, 32)


def test_conv_stem_channels_last_same_values_and_gradients():
    # On the CPU the stem runs channels-last (oneDNN's faster layout): the same outputs and
    # gradients as the contiguous layout, and the tokens come out in timm's (B, N, D) order.
    from vision_attn.models.encoder import ConvStem

    torch.manual_seed(0)
    stem = ConvStem(8, 32)
    x = torch.randn(3, 3, 32, 32)
    y = stem(x)
    assert y.shape == (3, 32, 4, 4) and y.is_contiguous(memory_format=torch.channels_last)
    ref = stem.layers(x)  # the contiguous layout, as on other devices
    assert ref.is_contiguous()
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(y, list(stem.parameters()), g)
    ref_grads = torch.autograd.grad(stem.layers(x), list(stem.parameters()), g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                         stem="conv").eval()
    pe = enc.model.patch_embed
    with torch.no_grad():
        tokens = pe(x)  # timm's patch embedding around the stem: flatten + transpose (or NHWC)
        expected = pe.proj.layers(x).permute(0, 2, 3, 1)  # (B, h, w, D) from the contiguous layout
    torch.testing.assert_close(tokens.reshape(expected.shape), expected, atol=1e-5, rtol=1e-5)


def test_encoder_attention_path_restores_flags():
    # Short sequences on the CPU run the blocks' explicit attention path; the flags are restored
    # after the forward, so a capture or a move to the GPU sees the module as it was built.
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
    seen = []
    hook = enc.model.blocks[0].attn.register_forward_pre_hook(lambda m, _a: seen.append(m.fused_attn))
    with torch.no_grad():
        enc(torch.randn(1, 3, 32, 32))
    hook.remove()
    assert seen == [False]
    assert all(blk.attn.fused_attn for blk in enc.model.blocks)


def test_dynamic_image_size_non_square(tiny_encoder):
    with torch.no_grad():
        out = tiny_encoder(torch.randn(1, 3, 48, 24))
    assert out.grid == (6, 3)
    assert out.tokens.shape[1] == 1 + 18


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_local_weights_file_gives_timm_logits(tmp_path, suffix):
    ref = _timm("vit_tiny_patch16_224", num_classes=7, **TINY_VIT)
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    else:
        torch.save({"state_dict": ref.state_dict()}, path)
    torch.manual_seed(123)  # different random init: the file must overwrite it
    enc = create_encoder("vit_tiny_patch16_224", weights_file=str(path), num_classes=7, **TINY_VIT).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(enc.forward_head(enc(x)), ref(x), atol=1e-6)


def test_weights_file_resamples_pos_embed_and_drops_other_head(tmp_path, caplog):
    ref = _timm("vit_tiny_patch16_224", num_classes=10, **TINY_VIT)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    kwargs = {**TINY_VIT, "img_size": 64}
    with caplog.at_level(logging.WARNING):
        enc = create_encoder("vit_tiny_patch16_224", weights_file=str(path), num_classes=3, **kwargs)
    assert enc.model.pos_embed.shape[1] == 1 + 64
    assert "re-initialised" in caplog.text
    assert torch.equal(enc.model.blocks[0].attn.qkv.weight, ref.blocks[0].attn.qkv.weight)


def test_weights_file_of_other_architecture_is_a_clear_error(tmp_path):
    ref = _timm("vit_tiny_patch16_224", num_classes=0, **{**TINY_VIT, "depth": 3})
    path = tmp_path / "deeper.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    with pytest.raises(ValueError, match="does not fit"):
        create_encoder("vit_tiny_patch16_224", weights_file=str(path), **TINY_VIT)


def test_pickled_code_in_weights_file_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "evil": Evil()}, path)
    with pytest.raises(CheckpointError, match="pickled"):
        create_encoder("vit_tiny_patch16_224", weights_file=str(path), **TINY_VIT)
    assert not marker.exists()


def test_unknown_model_name_suggests_close_names():
    with pytest.raises(ValueError, match=r"Unknown timm model name 'vit_tiny_patch16_2244'.*vit_tiny_patch16_224"):
        create_encoder("vit_tiny_patch16_2244")


def test_non_vit_model_is_rejected():
    with pytest.raises(ValueError, match="ViT-family|not a Vision Transformer"):
        create_encoder("resnet18", img_size=32)


def test_pretrained_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    with pytest.raises(EncoderError, match="could not get pretrained weights.*weights_file"):
        create_encoder("vit_tiny_patch16_224", pretrained=True)


def test_missing_weights_file_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="nope.safetensors"):
        create_encoder("vit_tiny_patch16_224", weights_file=str(tmp_path / "nope.safetensors"), **TINY_VIT)


def test_data_config_has_this_models_size_and_overrides():
    enc = create_encoder("vit_tiny_patch16_224", preprocess={"crop_pct": 1.0}, **TINY_VIT)
    cfg = enc.data_config
    assert cfg["input_size"] == (3, 32, 32)
    assert cfg["crop_pct"] == 1.0
    assert len(cfg["mean"]) == 3 and len(cfg["std"]) == 3
    assert cfg["crop_mode"] == "center"  # timm's, so evaluation crops as timm does
    assert create_encoder("vit_tiny_patch16_224", preprocess={"crop_mode": "squash"}, **TINY_VIT).data_config[
        "crop_mode"] == "squash"
    with pytest.raises(ValueError, match="unknown keys"):
        create_encoder("vit_tiny_patch16_224", preprocess={"scale": 2}, **TINY_VIT)


def test_conv_stem_keeps_grid_and_rebuilds_from_config():
    enc = create_encoder("vit_tiny_patch16_224", stem="conv", **{**TINY_VIT, "patch_size": 4})
    out = enc(torch.randn(2, 3, 32, 40))
    assert out.grid == (8, 10) and out.tokens.shape == (2, 81, 32)
    cfg = enc.architecture_config()
    rebuilt = ViTEncoder(**cfg["init_args"])
    rebuilt.load_state_dict(enc.state_dict())
    enc.eval(), rebuilt.eval()
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(rebuilt(x).tokens, enc(x).tokens)
    with pytest.raises(ValueError, match="power-of-two"):
        create_encoder("vit_tiny_patch16_224", stem="conv", **{**TINY_VIT, "patch_size": 6})


def test_conv_stem_channels_set_the_widths_and_rebuild(caplog):
    """``stem_channels`` is the first conv's width, doubling per stride-2 conv up to the
    embedding width; unset keeps the old widths (so old checkpoints load unchanged)."""
    def widths(enc):
        return [m.out_channels for m in enc.model.patch_embed.proj.layers if isinstance(m, torch.nn.Conv2d)]

    base = {**TINY_VIT, "patch_size": 4}  # embed 32: 2 stride-2 convs
    assert widths(create_encoder("vit_tiny_patch16_224", stem="conv", **base)) == [8, 16, 32, 32]
    wide = create_encoder("vit_tiny_patch16_224", stem="conv", stem_channels=16, **base)
    assert widths(wide) == [16, 32, 32, 32]
    assert widths(create_encoder("vit_tiny_patch16_224", stem="conv", stem_channels=64, **base)) == [64, 64, 64, 32]
    assert wide.architecture_config()["init_args"]["stem_channels"] == 16
    rebuilt = ViTEncoder(**ViTEncoder.checked_architecture_args(wide.architecture_config()["init_args"]))
    rebuilt.load_state_dict(wide.state_dict())
    x = torch.randn(1, 3, 32, 32)
    wide.eval(), rebuilt.eval()
    assert torch.equal(rebuilt(x).tokens, wide(x).tokens)
    with caplog.at_level(logging.WARNING, logger="vision_attn"):
        spt = create_encoder("vit_tiny_patch16_224", stem="spt", stem_channels=16, **base)
    assert "stem_channels=16 sets the width of stem='conv' and is ignored with stem='spt'" in caplog.text
    assert type(spt.model.patch_embed.proj).__name__ == "ShiftedPatchTokenizer"
    with pytest.raises(ValueError, match="stem_channels must lie in"):
        create_encoder("vit_tiny_patch16_224", stem="conv", stem_channels=0, **base)


def test_conv_stem_instance_norm_normalises_each_channel_and_rebuilds():
    """``stem_norm='instance'``: every GroupNorm of the stem has one group per channel (so a
    channel's mean and scale over each image are removed), the same parameters as ``layer``,
    other outputs, and a checkpoint's arguments rebuild it; a wrong name is refused."""
    base = {**TINY_VIT, "patch_size": 4}
    layer = create_encoder("vit_tiny_patch16_224", stem="conv", **base)
    inst = create_encoder("vit_tiny_patch16_224", stem="conv", stem_norm="instance", **base)
    norms = [m for m in inst.model.patch_embed.proj.layers if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(m.num_groups == m.num_channels for m in norms)
    assert all(m.num_groups == 1 for m in layer.model.patch_embed.proj.layers if isinstance(m, torch.nn.GroupNorm))
    inst.load_state_dict(layer.state_dict())  # same parameters: a layer-stem file loads
    x = torch.randn(2, 3, 32, 32)
    inst.eval(), layer.eval()
    assert not torch.allclose(inst(x).tokens, layer(x).tokens, atol=1e-4)
    # a channel's statistics after the first norm: zero mean, unit variance per image and channel
    stem = inst.model.patch_embed.proj.layers
    y = stem[1](stem[0](x))
    assert torch.allclose(y.mean((2, 3)), stem[1].bias.expand(2, -1), atol=1e-5)
    args = inst.architecture_config()["init_args"]
    assert args["stem_norm"] == "instance"
    rebuilt = ViTEncoder(**ViTEncoder.checked_architecture_args(args))
    rebuilt.load_state_dict(inst.state_dict())
    rebuilt.eval()
    assert torch.equal(rebuilt(x).tokens, inst(x).tokens)
    with pytest.raises(ValueError, match="stem_norm must be one of layer, instance"):
        create_encoder("vit_tiny_patch16_224", stem="conv", stem_norm="batch", **base)


def test_cnn_stem_pools_to_the_patch_grid_and_rebuilds():
    """``stem='cnn'``: stride-1 3x3 convolutions, each stage max-pooled, a 3x3 conv at the
    token grid and the 1x1 projection; the same token grid as the linear patch embedding (at
    other image sizes too), rebuilt from a checkpoint's arguments; its weights are not
    ``conv``'s (a clear error, not a silent partial load)."""
    base = {**TINY_VIT, "patch_size": 8}  # embed 32: 3 stages
    enc = create_encoder("vit_tiny_patch16_224", stem="cnn", stem_channels=8, stem_norm="instance", **base)
    layers = list(enc.model.patch_embed.proj.layers)
    convs = [m for m in layers if isinstance(m, torch.nn.Conv2d)]
    assert [c.stride[0] for c in convs] == [1, 1, 1, 1, 1]
    assert [c.out_channels for c in convs] == [8, 16, 32, 32, 32]
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in layers) == 3
    enc.eval()
    for size in (32, 48):
        out = enc(torch.randn(1, 3, size, size))
        assert out.grid == (size // 8, size // 8)
    rebuilt = ViTEncoder(**ViTEncoder.checked_architecture_args(enc.architecture_config()["init_args"]))
    rebuilt.load_state_dict(enc.state_dict())
    rebuilt.eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(rebuilt(x).tokens, enc(x).tokens)
    conv = create_encoder("vit_tiny_patch16_224", stem="conv", stem_channels=8, **base)
    with pytest.raises(RuntimeError):
        conv.load_state_dict(enc.state_dict())


def test_checkpoint_arguments_keep_the_architecture_and_drop_weight_sources():
    """What a checkpoint stores rebuilds the same encoder through the checkpoint check; where
    weights come from (hub, file, timm's pretrained config) is never taken from it."""
    from vision_attn.errors import CheckpointError

    enc = create_encoder("vit_tiny_patch16_224", qkv_bias=False, reg_tokens=2, class_token=True,
                         global_pool="avg", **TINY_VIT)
    stored = enc.architecture_config()["init_args"]
    checked = ViTEncoder.checked_architecture_args(stored, "checkpoint x.ckpt")
    assert checked == stored  # a checkpoint of the suite passes unchanged
    rebuilt = ViTEncoder(**checked)
    assert rebuilt.num_prefix_tokens == enc.num_prefix_tokens == 3
    assert ViTEncoder.checked_architecture_args({**stored, "pretrained": True, "weights_file": "w.pth"})[
        "pretrained"] is False
    with pytest.raises(CheckpointError, match=r"checkpoint x.ckpt: the encoder's timm_kwargs \['pretrained_cfg'\]"):
        ViTEncoder.checked_architecture_args({**stored, "timm_kwargs": {"pretrained_cfg": {"file": "/etc/x"}}},
                                             "checkpoint x.ckpt")
    with pytest.raises(CheckpointError, match="timm_kwargs.img_size is not plain data"):
        ViTEncoder.checked_architecture_args({**stored, "timm_kwargs": {"img_size": object()}})


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_embedding_tokens_are_the_first_blocks_input(name):
    """``keep_embedding``: the tokens entering block 0, i.e. timm's own forward from there on
    (blocks, final norm) gives the output tokens; a padded image's real embeddings are the ones
    it gets alone; off by default, and the output is the same either way."""
    enc = create_encoder(name, **TINY_VIT).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = enc(x)
        enc.keep_embedding = True
        out = enc(x)
        rebuilt = enc.model.norm(enc.model.blocks(out.embedding_tokens))
        small = enc(x[:1, :, :24, :16])
        padded = enc(torch.nn.functional.pad(x[:1, :, :24, :16], (0, 16, 0, 8)), image_sizes=torch.tensor([[24, 16]]))
    assert plain.embedding_tokens is None
    assert torch.equal(out.tokens, plain.tokens)
    assert out.embedding_tokens.shape == out.tokens.shape
    torch.testing.assert_close(rebuilt, out.tokens)
    p = enc.num_prefix_tokens
    real = padded.embedding_tokens[0, p:].reshape(4, 4, -1)[:3, :2]  # the 3 x 2 patches of the 24 x 16 image
    torch.testing.assert_close(real, small.embedding_tokens[0, p:].reshape(3, 2, -1), atol=1e-5, rtol=1e-5)
    # and the padded forward gives the image's own tokens (distillation token included)
    torch.testing.assert_close(padded.tokens[0, :p], small.tokens[0, :p], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded.tokens[0, p:].reshape(4, 4, -1)[:3, :2],
                               small.tokens[0, p:].reshape(3, 2, -1), atol=1e-5, rtol=1e-5)
    assert not any(m._forward_pre_hooks for m in enc.model.blocks)  # the capture leaves no hook behind


def test_pixel_tokens_are_each_patchs_own_pixels():
    """``keep_pixels``: pixel token ``n`` is patch ``n``'s pixels (row-major patches, channel
    first within one, as F.unfold orders them), checked against slicing the image by hand; the
    grid follows the encoder's (a 24 x 16 image gives 3 x 2 patches); off by default, and the
    output tokens are the same either way."""
    enc = create_encoder("vit_tiny_patch16_224", **TINY_VIT).eval()
    ph, pw = enc.patch_size
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = enc(x)
        enc.keep_pixels = True
        out = enc(x)
        small = enc(x[:1, :, :24, :16])
    assert plain.pixel_tokens is None and torch.equal(out.tokens, plain.tokens)
    gh, gw = out.grid
    assert out.pixel_tokens.shape == (2, gh * gw, 3 * ph * pw)
    for r, c in [(0, 0), (1, 2), (gh - 1, gw - 1)]:
        patch = x[:, :, r * ph:(r + 1) * ph, c * pw:(c + 1) * pw]
        assert torch.equal(out.pixel_tokens[:, r * gw + c], patch.reshape(2, -1))
    assert small.grid == (24 // ph, 16 // pw)
    padded = out.pixel_tokens[0].reshape(gh, gw, -1)[: small.grid[0], : small.grid[1]]
    assert torch.equal(small.pixel_tokens[0].reshape(*small.grid, -1), padded)


def test_timm_classes_get_the_default_arguments_they_take(caplog):
    # dropout and dynamic image size go to the classes that take them, and only to those
    vit = ViTEncoder("vit_tiny_patch16_224", drop_path_rate=0.1, **TINY_VIT)
    assert vit.model.dynamic_img_size and vit.fixed_input_size is None and vit.family == "VisionTransformer"
    assert type(vit.model.blocks[1].drop_path1).__name__ == "DropPath"
    with caplog.at_level(logging.INFO, logger="vision_attn.models.encoder"):
        cait = ViTEncoder("cait_xxs24_224", drop_path_rate=0.1, **TINY_VIT)
    assert any("takes no dynamic_img_size" in r.getMessage() for r in caplog.records)
    assert cait.family == "Cait" and cait.class_attention and cait.fixed_input_size == (32, 32)
    assert type(cait.model.blocks[0].drop_path).__name__ == "DropPath"
    assert cait.attention_blocks == list(cait.model.blocks_token_only)
    assert cait.last_block is cait.model.blocks_token_only[-1]
    cait.keep_embedding = True  # its first block reads the patch tokens only
    with pytest.raises(EncoderError, match="reads the patch tokens only"):
        cait(torch.randn(1, 3, 32, 32))
    naflex = ViTEncoder("naflexvit_base_patch16_gap", **TINY_VIT).eval()
    with torch.no_grad():
        out = naflex(torch.randn(1, 3, 48, 40))  # any size: NaFlexVit resamples its position embedding
    assert out.grid == (6, 5) and out.tokens.shape == (1, 4 + 30, 32) and naflex.patch_size == (8, 8)
    beit = ViTEncoder("beit_base_patch16_224", **TINY_VIT)
    with pytest.raises(EncoderError, match="padded batches .* timm VisionTransformer; .* is of the timm class Beit"):
        beit(torch.randn(2, 3, 32, 32), image_sizes=torch.tensor([[32, 32], [16, 24]]))


def test_an_encoder_of_another_timm_class_rebuilds_from_its_checkpoint_arguments():
    torch.manual_seed(0)
    enc = ViTEncoder("cait_xxs24_224", timm_kwargs={"depth_token_only": 1}, **TINY_VIT).eval()
    args = ViTEncoder.checked_architecture_args(enc.architecture_config()["init_args"])
    again = ViTEncoder(**args).eval()
    again.load_state_dict(enc.state_dict())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again(x).tokens, enc(x).tokens)
    assert again.family == "Cait" and len(again.attention_blocks) == 1
