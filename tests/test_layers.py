"""Shared decoder layers against torch's nn.TransformerDecoderLayer; cached == full decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vision_attn.attention import causal_mask
from vision_attn.models.layers import MLP, DecoderLayer, LayerCache, sine_position_embedding_2d


def _copy_mha(ours, ref):
    e = ours.embed_dim
    wq, wk, wv = ref.in_proj_weight.split(e)
    bq, bk, bv = ref.in_proj_bias.split(e)
    with torch.no_grad():
        for lin, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())


def test_decoder_layer_equals_torch_pre_norm_decoder_layer():
    torch.manual_seed(0)
    dim, heads = 16, 4
    ref = nn.TransformerDecoderLayer(dim, heads, dim_feedforward=64, dropout=0.0, activation="gelu",
                                     batch_first=True, norm_first=True).eval()
    ours = DecoderLayer(dim, heads, mlp_ratio=4.0).eval()
    _copy_mha(ours.self_attn, ref.self_attn)
    _copy_mha(ours.cross_attn, ref.multihead_attn)
    with torch.no_grad():
        ours.norm1.load_state_dict(ref.norm1.state_dict())
        ours.norm2.load_state_dict(ref.norm2.state_dict())
        ours.norm3.load_state_dict(ref.norm3.state_dict())
        ours.mlp[0].load_state_dict(ref.linear1.state_dict())
        ours.mlp[3].load_state_dict(ref.linear2.state_dict())
    x, mem = torch.randn(2, 5, dim), torch.randn(2, 9, dim)
    mem_mask = torch.ones(2, 9, dtype=torch.bool)
    mem_mask[1, -3:] = False
    expected = ref(x, mem, tgt_mask=~causal_mask(5, 5), memory_key_padding_mask=~mem_mask)
    out, w = ours(x, mem, causal=True, memory_key_mask=mem_mask, need_weights=True)
    assert torch.allclose(out, expected, atol=1e-5)
    assert w.shape == (2, heads, 5, 9) and torch.all(w[1, :, :, -3:] == 0)


def test_cached_incremental_decoding_equals_full_pass():
    torch.manual_seed(1)
    layers = nn.ModuleList(DecoderLayer(16, 2, memory_dim=8) for _ in range(2)).eval()
    x, mem = torch.randn(3, 6, 16), torch.randn(3, 4, 8)

    def run(inp, caches=None):
        ws = []
        for i, layer in enumerate(layers):
            inp, w = layer(inp, mem, causal=True, need_weights=True, cache=None if caches is None else caches[i])
            ws.append(w)
        return inp, ws

    full, full_w = run(x)
    caches = [LayerCache() for _ in layers]
    steps = [run(x[:, t : t + 1], caches) for t in range(6)]
    assert torch.allclose(torch.cat([s[0] for s in steps], 1), full, atol=1e-5)
    assert torch.allclose(torch.cat([s[1][-1] for s in steps], 2), full_w[-1], atol=1e-5)
    caches[0].reorder(torch.tensor([2, 0, 1]))
    assert caches[0].self_attn.k.shape[0] == 3


def test_sine_embedding_and_mlp():
    pe = sine_position_embedding_2d((3, 5), 32)
    assert pe.shape == (15, 32) and torch.all(pe.abs() <= 1)
    assert len({tuple(r.round(decimals=5).tolist()) for r in pe}) == 15  # every cell distinct
    assert torch.allclose(pe.view(3, 5, 32)[0, :, :16], pe.view(3, 5, 32)[0, :1, :16].expand(5, 16))  # row half
    with pytest.raises(ValueError, match="divisible by 4"):
        sine_position_embedding_2d((2, 2), 30)
    mlp = MLP(8, 16, 4, 3)
    assert mlp(torch.randn(2, 8)).shape == (2, 4) and len(mlp.layers) == 3
