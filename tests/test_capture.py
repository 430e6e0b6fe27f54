"""capture_attention: complete, faithful, and leaves the model exactly as it found it."""

from __future__ import annotations

import pytest
import timm
import torch

from vision_attn import MultiHeadAttention, capture_attention
from vision_attn.explain.capture import AttentionCaptureError, attention_modules


def _state(model):
    flags = [m.fused_attn for _, m in attention_modules(model)]
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return flags, hooks


def test_records_every_block_with_rows_summing_to_one(tiny_encoder):
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad(), capture_attention(tiny_encoder) as attn:
        out = tiny_encoder(x)
    T = out.tokens.shape[1]
    assert len(attn) == tiny_encoder.depth == 2
    for a in attn:
        assert a.shape == (3, tiny_encoder.num_heads, T, T)
        assert torch.allclose(a.sum(-1), torch.ones(3, tiny_encoder.num_heads, T), atol=1e-5)
        assert (a >= 0).all()


def test_first_block_first_and_matches_manual_computation(tiny_encoder):
    x = torch.randn(2, 3, 32, 32)
    model = tiny_encoder.model
    with torch.no_grad(), capture_attention(tiny_encoder) as attn:
        tiny_encoder(x)
        # Recompute block 0's attention by hand from its input.
        h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        blk = model.blocks[0]
        y = blk.norm1(h)
        B, N, C = y.shape
        qkv = blk.attn.qkv(y).reshape(B, N, 3, blk.attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, _ = qkv.unbind(0)
        manual = ((q * blk.attn.scale) @ k.transpose(-2, -1)).softmax(-1)
    assert torch.allclose(attn[0], manual, atol=1e-5)


def test_outputs_unchanged_and_flags_and_hooks_restored(tiny_encoder):
    x = torch.randn(2, 3, 32, 32)
    before = _state(tiny_encoder)
    assert all(before[0])  # timm uses the fused kernel by default
    with torch.no_grad():
        plain = tiny_encoder(x).tokens
        with capture_attention(tiny_encoder):
            captured = tiny_encoder(x).tokens
        # The explicit path of capture equals the fused path up to float rounding...
        assert torch.allclose(captured, plain, atol=1e-5)
        # ...and equals timm's own non-fused path exactly.
        for _, m in attention_modules(tiny_encoder):
            m.fused_attn = False
        assert torch.equal(tiny_encoder(x).tokens, captured)
        for _, m in attention_modules(tiny_encoder):
            m.fused_attn = True
    assert _state(tiny_encoder) == before


def test_restores_after_an_exception(tiny_encoder):
    before = _state(tiny_encoder)
    with pytest.raises(KeyError):
        with capture_attention(tiny_encoder):
            tiny_encoder(torch.randn(1, 3, 32, 32))
            raise KeyError("boom")
    assert _state(tiny_encoder) == before


def test_raises_when_nothing_was_captured(tiny_encoder):
    with pytest.raises(AttentionCaptureError, match="recorded nothing"):
        with capture_attention(tiny_encoder):
            pass
    assert _state(tiny_encoder)[1] == 0
    with pytest.raises(AttentionCaptureError, match="no attention module"):
        with capture_attention(torch.nn.Linear(3, 3)):
            pass


def test_keep_grad_gives_attention_gradients(tiny_encoder):
    x = torch.randn(2, 3, 32, 32)
    with capture_attention(tiny_encoder, keep_grad=True) as attn:
        out = tiny_encoder(x)
    (out.tokens[:, 0] * torch.randn(out.tokens.shape[-1])).sum().backward()
    assert all(a.grad is not None and a.grad.shape == a.shape for a in attn)
    assert any(a.grad.abs().sum() > 0 for a in attn)


def test_works_on_bare_timm_models_and_our_multihead_attention():
    model = timm.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2).eval()
    with torch.no_grad(), capture_attention(model) as attn:
        model(torch.randn(1, 3, 32, 32))
    assert len(attn) == 2 and attn[0].shape == (1, 2, 18, 18)

    mha = MultiHeadAttention(16, 4).eval()
    x, mem = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    _, ref_w = mha(x, mem, need_weights=True)
    with capture_attention(mha) as attn:
        out, w = mha(x, mem)
    assert w is None and len(attn) == 1
    assert torch.allclose(attn[0], ref_w, atol=1e-6)
    assert mha.fused_attn is True


def test_names_filter(tiny_encoder):
    with torch.no_grad(), capture_attention(tiny_encoder, names=["model.blocks.1"]) as attn:
        tiny_encoder(torch.randn(1, 3, 32, 32))
    assert len(attn) == 1


def test_extract_attention_equals_capture_and_stops_early(tiny_encoder):
    from vision_attn.explain import extract_attention

    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), capture_attention(tiny_encoder) as full:
        tiny_encoder(x)
    calls = []
    handle = tiny_encoder.model.norm.register_forward_hook(lambda *a: calls.append(1))  # after the last block
    try:
        maps = extract_attention(tiny_encoder, x)
    finally:
        handle.remove()
    assert len(maps) == len(full) and all(torch.equal(a, b) for a, b in zip(maps, full, strict=True))
    assert not calls  # the pass stopped after the last attention: the final norm never ran
    assert all(m.fused_attn for m in tiny_encoder.modules() if hasattr(m, "fused_attn"))  # flags restored
