"""Streaming rollout / relevance equal the stored-capture ones, on the suite's encoders and heads,
while keeping one running product instead of every block's attention."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from vision_attn import capture_attention, create_encoder
from vision_attn.explain.capture import (
    AttentionCaptureError,
    observe_attention,
    streaming_relevance,
    streaming_rollout,
)
from vision_attn.explain.methods import explain_classifier
from vision_attn.explain.rollout import (
    RolloutStream,
    attention_rollout,
    gradient_relevance,
    rollout_scores,
)
from vision_attn.models.classifier import ClassifierConfig
from vision_attn.tasks import ClassificationTask

from .conftest import TINY_VIT

# (timm name, extra arguments): a class token, a distilled DeiT (class + distillation tokens),
# register tokens, no prefix token at all, and the suite's locality self-attention.
ENCODERS = {
    "vit": ("vit_tiny_patch16_224", {}),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", {}),
    "registers": ("vit_tiny_patch16_224", {"reg_tokens": 4}),
    "no_prefix": ("vit_tiny_patch16_224", {"class_token": False, "global_pool": "avg"}),
    "lsa": ("vit_tiny_patch16_224", {"lsa": True}),
}


def _encoder(key: str, depth: int = 3):
    name, extra = ENCODERS[key]
    torch.manual_seed(0)
    return create_encoder(name, **{**TINY_VIT, "depth": depth}, **extra).eval()


@pytest.mark.parametrize("key", list(ENCODERS))
@pytest.mark.parametrize("options", [{}, {"head_fusion": "max", "discard_ratio": 0.5, "start_layer": 1}])
def test_streaming_rollout_equals_stored_rollout(key, options):
    enc = _encoder(key)
    x = torch.randn(3, 3, 32, 48)  # a non-square grid
    with torch.no_grad(), capture_attention(enc) as attn:
        out = enc(x)
    p = out.num_prefix_tokens
    with torch.no_grad(), streaming_rollout(enc, **options) as stream:
        out2 = enc(x)
    assert torch.equal(out.tokens, out2.tokens)  # the stream changes nothing in the forward
    rows = [r for r in (0, 1, (0, 1)) if p > 0 and max(r if isinstance(r, tuple) else (r,)) < p]
    weights = torch.softmax(torch.randn(3, out.tokens.shape[1]), -1)
    for token_index in [*rows, "patches", weights]:
        stored = attention_rollout(attn, out.grid, p, token_index=token_index, **options)
        streamed = stream.maps(out.grid, p, token_index)
        assert streamed.shape == (3, *out.grid)
        assert torch.allclose(streamed, stored, atol=1e-6, rtol=0), (key, token_index)
    # the raw row: sums to 1 like the stored rollout's
    raw = stream.scores(0 if p else "patches", p)
    assert torch.allclose(raw, rollout_scores(attn, p, token_index=0 if p else "patches", **options), atol=1e-6)
    assert torch.allclose(raw.sum(-1), torch.ones(3), atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean", "seq"])
def test_streaming_follows_the_heads_row_like_explain_classifier(pooling):
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"],
                              head=ClassifierConfig(pooling=pooling)).eval()
    x = torch.randn(2, 3, 32, 32)
    expl = explain_classifier(task, x, ("rollout", "relevance"))
    with torch.no_grad(), streaming_rollout(task.encoder) as stream:
        out = task.encoder(x)
    maps = stream.maps(out.grid, out.num_prefix_tokens, expl.token_index)
    assert torch.allclose(maps, expl.maps["rollout"], atol=1e-6, rtol=0)
    with torch.enable_grad(), streaming_relevance(task.encoder) as rel:
        out = task.encoder(x)
        logits = task.head(out)
    score = logits.gather(1, expl.target.view(-1, 1)).sum()
    rel_maps = rel.maps(score, out.grid, out.num_prefix_tokens, expl.token_index)
    assert torch.allclose(rel_maps, expl.maps["relevance"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("start_layer", [0, 2])
def test_streaming_relevance_equals_stored_relevance(start_layer):
    enc = _encoder("registers", depth=4)
    x = torch.randn(2, 3, 32, 32)
    w = torch.randn(enc.embed_dim)
    with capture_attention(enc, keep_grad=True) as attn:
        out = enc(x)
    (out.tokens[:, 0] @ w).sum().backward()
    stored = gradient_relevance(attn, None, out.grid, out.num_prefix_tokens, start_layer=start_layer)
    with streaming_relevance(enc, start_layer=start_layer) as rel:
        out = enc(x)
    streamed = rel.maps((out.tokens[:, 0] @ w).sum(), out.grid, out.num_prefix_tokens)
    assert torch.allclose(streamed, stored, atol=1e-6, rtol=0)
    assert not torch.allclose(streamed, torch.ones_like(streamed))  # a real, non-constant map


def test_hand_case_identity_and_one_hot_blocks():
    # As in test_rollout: block 1 sends the class token to patch 3 ((1, 0) of a 2x2 grid).
    t = 5
    a1 = torch.eye(t).clone()
    a1[0] = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
    stream = RolloutStream()
    stream.update(a1.view(1, 1, t, t))
    stream.update(torch.eye(t).view(1, 1, t, t))
    assert torch.equal(stream.maps((2, 2), 1), torch.tensor([[[0.0, 0.0], [1.0, 0.0]]]))
    # the running product is the full [B, T, T] matrix: (A2 + I)/2 (A1 + I)/2 with A2 = I
    expected = (a1 + torch.eye(t)) / 2
    assert torch.allclose(stream.product[0].float(), expected)


def test_the_stream_keeps_no_attention_map():
    enc = _encoder("vit", depth=4)
    refs: list[weakref.ref] = []
    with torch.no_grad(), observe_attention(enc, lambda a: refs.append(weakref.ref(a))):
        enc(torch.randn(2, 3, 32, 32))
    gc.collect()
    assert len(refs) == 4 and all(r() is None for r in refs)  # observe_attention keeps none of them
    refs.clear()
    with torch.no_grad(), observe_attention(enc, lambda a: refs.append(weakref.ref(a))), \
            streaming_rollout(enc) as stream:
        out = enc(torch.randn(2, 3, 32, 32))
    gc.collect()
    assert all(r() is None for r in refs)  # neither does the stream...
    t = out.tokens.shape[1]
    assert stream.product.shape == (2, t, t)  # ...only one [B, T, T] product
    with torch.no_grad(), capture_attention(enc) as attn:  # the stored capture keeps L [B, H, T, T]
        enc(torch.randn(2, 3, 32, 32))
    assert sum(a.numel() for a in attn) == 4 * enc.num_heads * stream.product.numel()


def test_errors_are_clear(tiny_encoder):
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(AttentionCaptureError, match="one forward pass"):
        with torch.no_grad(), streaming_rollout(tiny_encoder):
            tiny_encoder(x)
            tiny_encoder(x)
    with pytest.raises(AttentionCaptureError, match="recorded nothing"):
        with streaming_rollout(tiny_encoder):
            pass
    assert all(m.fused_attn for m in tiny_encoder.modules() if hasattr(m, "fused_attn"))  # flags restored
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in tiny_encoder.modules()) == 0
    with torch.no_grad(), streaming_rollout(tiny_encoder, start_layer=5) as stream:
        out = tiny_encoder(x)
    with pytest.raises(ValueError, match="start_layer 5"):
        stream.maps(out.grid)
    with torch.no_grad(), streaming_relevance(tiny_encoder) as rel:
        out = tiny_encoder(x)
    with pytest.raises(ValueError, match="not in the autograd graph"):
        rel.maps(out.tokens.sum(), out.grid)


def test_stored_rollout_of_a_merged_model_needs_its_merges():
    attn = [torch.softmax(torch.randn(1, 2, t, t), -1) for t in (9, 7)]
    with pytest.raises(ValueError, match="merge_log"):
        attention_rollout(attn, (2, 4))


def test_streaming_benchmark_measures_less_memory_at_the_demo_size():
    from benchmarks.streaming import run_config

    r = run_config("demo", batch=2, repeats=1)
    assert r["max_abs_diff"]["streaming"] <= 1e-6 and r["max_abs_diff"]["streaming_f64"] <= 1e-6
    # the stored capture keeps L * H * T^2 floats; the streaming rollout adds far less than that
    assert r["extra_bytes"]["stored"] > r["stored_attention_bytes"] / 4
    assert r["extra_bytes"]["streaming"] < r["stored_attention_bytes"] / r["depth"]
    assert r["peak_bytes"]["streaming"] < r["peak_bytes"]["stored"]
