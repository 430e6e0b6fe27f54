"""MultiHeadAttention and scaled_dot_product_attention against torch's references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vision_attn.attention import (
    EXPLICIT_MAX_SCORES,
    EXPLICIT_MIN_QUERIES,
    KVCache,
    MultiHeadAttention,
    causal_mask,
    explicit_attention,
    explicit_is_faster,
    scaled_dot_product_attention,
)

ATOL = 1e-5


def _qkv(b=2, h=3, tq=5, tk=7, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, tq, d, generator=g), torch.randn(b, h, tk, d, generator=g),
            torch.randn(b, h, tk, d, generator=g))


def test_hand_computed_case():
    # One query, two keys: scores [0, 2] / sqrt(2); softmax; weighted sum of the values.
    q = torch.tensor([[[[1.0, 1.0]]]])
    k = torch.tensor([[[[1.0, -1.0], [1.0, 1.0]]]])
    v = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])
    out, w = scaled_dot_product_attention(q, k, v, need_weights=True)
    s = torch.tensor([0.0, 2.0]) / 2**0.5
    expected_w = s.exp() / s.exp().sum()
    assert torch.allclose(w[0, 0, 0], expected_w, atol=1e-6)
    assert torch.allclose(out[0, 0, 0], expected_w @ v[0, 0], atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "int"])
def test_sdpa_matches_torch(need_weights: bool, mask_kind: str):
    q, k, v = _qkv(tq=6, tk=6)
    mask = None
    is_causal = False
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., 0] = True  # keep at least one key per row
    elif mask_kind == "float":
        mask = torch.randn(2, 3, 6, 6)
    elif mask_kind == "int":
        mask = (torch.rand(6, 6, generator=torch.Generator().manual_seed(2)) > 0.3).long()
        mask[:, 0] = 1
    elif mask_kind == "causal":
        is_causal = True
    ref_mask = mask.bool() if mask_kind == "int" else mask
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, is_causal=is_causal)
    out, w = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, need_weights=need_weights)
    assert torch.allclose(out, ref, atol=ATOL)
    if need_weights:
        assert w.shape == (2, 3, 6, 6)
        assert torch.allclose(w.sum(-1), torch.ones(2, 3, 6), atol=1e-6)
        assert torch.allclose(w @ v, ref, atol=ATOL)
    else:
        assert w is None


@pytest.mark.parametrize("tq,tk", [(8, 8), (16, 64), (1, 64), (4, 4), (130, 130)])
@pytest.mark.parametrize("masked", [False, True])
def test_cpu_path_choice_same_values_and_gradients(monkeypatch, tq: int, tk: int, masked: bool):
    # Short sequences on the CPU skip the fused kernel (faster there); long ones, and one or a
    # few queries at a time (incremental decoding), use it. Either way the output and the
    # gradients are torch's fused result.
    explicit = EXPLICIT_MIN_QUERIES <= tq and tq * tk <= EXPLICIT_MAX_SCORES
    assert explicit == (tq in (8, 16))
    assert explicit_is_faster(torch.device("cpu"), tq, tk) == explicit
    assert not explicit_is_faster(torch.device("cuda"), 4, 4) and not explicit_is_faster(torch.device("meta"), 4, 4)
    q, k, v = (t.requires_grad_(True) for t in _qkv(tq=tq, tk=tk, d=8))
    mask = torch.rand(2, 1, tq, tk, generator=torch.Generator().manual_seed(3)) > 0.4 if masked else None
    if masked:
        mask[..., 0] = True
    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    out, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(calls) == (0 if explicit else 1)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    monkeypatch.undo()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_explicit_attention_restores_flags_even_after_an_error():
    a, b = MultiHeadAttention(8, 2), MultiHeadAttention(8, 2)
    b.fused_attn = False
    with pytest.raises(RuntimeError, match="boom"), explicit_attention([a, b]):
        assert not a.fused_attn and not b.fused_attn
        raise RuntimeError("boom")
    assert a.fused_attn and not b.fused_attn


def test_key_mask_excludes_padding():
    q, k, v = _qkv(tk=7)
    key_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out, w = scaled_dot_product_attention(q, k, v, key_mask=key_mask, need_weights=True)
    assert torch.all(w[1, :, :, 4:] == 0)
    ref = F.scaled_dot_product_attention(q[1:], k[1:, :, :4], v[1:, :, :4])
    assert torch.allclose(out[1:], ref, atol=ATOL)


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_row_gives_zeros_not_nan(need_weights: bool):
    q, k, v = _qkv(tq=3, tk=4)
    q.requires_grad_(True)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False  # query 1 may attend nowhere
    out, w = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=need_weights)
    assert not torch.isnan(out).any()
    assert torch.all(out[:, :, 1] == 0)
    if need_weights:
        assert torch.all(w[:, :, 1] == 0)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    # Float mask with an all -inf row behaves the same.
    fmask = torch.zeros(3, 4).masked_fill(~mask, float("-inf"))
    out_f, _ = scaled_dot_product_attention(q.detach(), k, v, attn_mask=fmask, need_weights=need_weights)
    assert torch.allclose(out_f, out.detach(), atol=ATOL)


def _copy_from_torch(mha: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    e = mha.embed_dim
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            wq, wk, wv = ref.in_proj_weight.split(e)
        else:
            wq, wk, wv = ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight
        bq, bk, bv = ref.in_proj_bias.split(e)
        mha.q_proj.weight.copy_(wq), mha.k_proj.weight.copy_(wk), mha.v_proj.weight.copy_(wv)
        mha.q_proj.bias.copy_(bq), mha.k_proj.bias.copy_(bk), mha.v_proj.bias.copy_(bv)
        mha.out_proj.weight.copy_(ref.out_proj.weight)
        mha.out_proj.bias.copy_(ref.out_proj.bias)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "both"])
def test_matches_nn_multihead_attention(cross: bool, masks: str):
    torch.manual_seed(0)
    e, h, b, tq = 16, 4, 3, 5
    tk = 9 if cross else tq
    kdim = 12 if cross else None
    ref = nn.MultiheadAttention(e, h, batch_first=True, kdim=kdim, vdim=kdim).eval()
    mha = MultiHeadAttention(e, h, kdim=kdim).eval()
    _copy_from_torch(mha, ref)
    x = torch.randn(b, tq, e)
    mem = torch.randn(b, tk, kdim) if cross else x
    key_mask = None
    causal = None
    if masks in ("padding", "both"):
        key_mask = torch.ones(b, tk, dtype=torch.bool)
        key_mask[1, -2:] = False
        key_mask[2, 1] = False
    if masks in ("causal", "both"):
        causal = causal_mask(tq, tk)
    # torch's masks mark positions to *exclude*; ours mark positions to keep.
    ref_out, ref_w = ref(
        x, mem, mem,
        key_padding_mask=None if key_mask is None else ~key_mask,
        attn_mask=None if causal is None else ~causal,
        need_weights=True, average_attn_weights=False,
    )
    for need_weights in (False, True):
        out, w = mha(x, None if not cross else mem, attn_mask=causal, key_mask=key_mask, need_weights=need_weights)
        assert torch.allclose(out, ref_out, atol=ATOL)
        if need_weights:
            assert torch.allclose(w, ref_w, atol=ATOL)
    out_avg, w_avg = mha(x, None if not cross else mem, attn_mask=causal, key_mask=key_mask,
                         need_weights=True, average_attn_weights=True)
    assert torch.allclose(w_avg, ref_w.mean(1), atol=ATOL)


def test_is_causal_flag_equals_explicit_mask():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, 6, 16)
    a, _ = mha(x, is_causal=True)
    b, _ = mha(x, attn_mask=causal_mask(6, 6))
    assert torch.allclose(a, b, atol=ATOL)


def test_kv_cache_incremental_equals_full_causal_pass():
    torch.manual_seed(0)
    self_attn = MultiHeadAttention(16, 4).eval()
    cross_attn = MultiHeadAttention(16, 4, kdim=8).eval()
    x = torch.randn(2, 7, 16)
    memory = torch.randn(2, 5, 8)

    def layer(inp, self_cache=None, cross_cache=None):
        h, _ = self_attn(inp, is_causal=True, cache=self_cache)
        h2, w = cross_attn(inp + h, memory, cache=cross_cache, need_weights=True)
        return inp + h + h2, w

    full, full_w = layer(x)
    self_cache, cross_cache = KVCache(), KVCache(static=True)
    steps, ws = [], []
    for t in range(7):
        y, w = layer(x[:, t : t + 1], self_cache, cross_cache)
        steps.append(y)
        ws.append(w)
    assert self_cache.length == 7 and cross_cache.length == 5
    assert torch.allclose(torch.cat(steps, 1), full, atol=ATOL)
    assert torch.allclose(torch.cat(ws, 2), full_w, atol=ATOL)
    # Several new tokens at once on top of a cache: same answer.
    cache = KVCache()
    a, _ = self_attn(x[:, :3], is_causal=True, cache=cache)
    b, _ = self_attn(x[:, 3:], is_causal=True, cache=cache)
    ref, _ = self_attn(x, is_causal=True)
    assert torch.allclose(torch.cat([a, b], 1), ref, atol=ATOL)


def test_kv_cache_reorder_selects_rows():
    cache = KVCache()
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 1, 4)
    cache.append(k, k.clone())
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.k[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]


def test_dropout_only_in_training_and_weights_before_dropout():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(2, 5, 16)
    mha.eval()
    a, _ = mha(x)
    b, _ = mha(x)
    assert torch.equal(a, b)
    mha.train()
    _, w = mha(x, need_weights=True)
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 5), atol=1e-6)


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="key_mask"):
        scaled_dot_product_attention(q, k, v, key_mask=torch.ones(2, 3, dtype=torch.bool))
