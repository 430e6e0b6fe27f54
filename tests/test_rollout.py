"""Rollout, gradient relevance and raw attention against hand-computed cases and invariants."""

from __future__ import annotations

import pytest
import torch

from vision_attn import capture_attention
from vision_attn.explain.rollout import (
    RolloutStream,
    attention_rollout,
    fuse_heads,
    gradient_relevance,
    last_layer_attention,
    normalize_maps,
)
from vision_attn.models.classifier import ClassifierConfig


def _uniform(b, h, t):
    return torch.full((b, h, t, t), 1.0 / t)


def test_identity_attention_gives_a_uniform_map():
    t = 1 + 6
    eye = torch.eye(t).expand(2, 3, t, t)
    maps = attention_rollout([eye, eye], grid=(2, 3))
    assert maps.shape == (2, 2, 3)
    assert torch.all(maps == maps.flatten()[0])  # constant (the class token keeps to itself: zeros)
    uniform = attention_rollout([_uniform(2, 3, t)] * 3, grid=(2, 3))
    assert torch.allclose(uniform, torch.ones(2, 2, 3))


def test_one_hot_chain_points_at_the_expected_patch():
    # 1 + 4 tokens. Block 1: the class token attends only to patch token 3 (grid cell (1, 0));
    # every other token attends to itself. Block 2: all tokens attend to themselves.
    t = 5
    a1 = torch.eye(t).clone()
    a1[0] = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
    a2 = torch.eye(t)
    maps = attention_rollout([a1.view(1, 1, t, t), a2.view(1, 1, t, t)], grid=(2, 2))
    # By hand: (A1 + I)/2 row 0 = [0.5, 0, 0, 0.5, 0]; A2 + I normalised = I. Patch 3-1=2 -> (1, 0).
    expected = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]])
    assert torch.allclose(maps, expected)


def test_rollout_matches_a_direct_computation_and_batch_equals_per_image():
    torch.manual_seed(0)
    t, heads = 1 + 6, 2
    attn = [torch.softmax(torch.randn(3, heads, t, t), -1) for _ in range(3)]
    maps = attention_rollout(attn, grid=(2, 3), head_fusion="max", start_layer=1)
    # direct: product of normalised (max-fused + I) for blocks 1 and 2
    r = torch.eye(t).expand(3, t, t)
    for a in attn[1:]:
        f = a.amax(1) + torch.eye(t)
        r = (f / f.sum(-1, keepdim=True)) @ r
    row = r[:, 0, 1:].reshape(3, 2, 3)
    assert torch.allclose(maps, row / row.flatten(1).amax(1).view(3, 1, 1), atol=1e-6)
    for i in range(3):
        single = attention_rollout([a[i : i + 1] for a in attn], grid=(2, 3), head_fusion="max", start_layer=1)
        assert torch.allclose(single[0], maps[i], atol=1e-6)
    assert maps.amax(dim=(1, 2)).allclose(torch.ones(3))


def test_class_attention_rows_read_as_blocks_that_leave_the_other_tokens_unchanged():
    # Cait's class-attention blocks: only the class token attends ([B, heads, 1, T]); the patch
    # tokens pass through. The class token after the blocks is, by hand, with a_l the head-mean
    # row: c_l = (c_{l-1} + a_l0 c_{l-1} + sum_j a_lj e_j) / 2 over the input tokens (rows of the
    # rollout matrix summing to 1: (A + I) / 2).
    torch.manual_seed(4)
    t, heads = 1 + 6, 3
    attn = [torch.softmax(torch.randn(2, heads, 1, t), -1) for _ in range(2)]
    c = torch.zeros(2, t)
    c[:, 0] = 1.0
    for a in attn:
        row = a.mean(1)[:, 0]  # (B, T)
        c = 0.5 * (c + row[:, :1] * c + torch.cat([torch.zeros(2, 1), row[:, 1:]], dim=1))
    expected = c[:, 1:].reshape(2, 2, 3)
    expected = expected / expected.flatten(1).amax(1).view(2, 1, 1)
    torch.testing.assert_close(attention_rollout(attn, grid=(2, 3)), expected, atol=1e-6, rtol=0)
    stream = RolloutStream()
    for a in attn:
        stream.update(a)
    torch.testing.assert_close(stream.maps((2, 3)), expected, atol=1e-6, rtol=0)
    # relevance: R = I + relu(grad * A) rows for the class token only; the raw attention is its row
    grads = [torch.randn_like(a) for a in attn]
    rel = torch.eye(t).repeat(2, 1, 1)
    for a, g in zip(attn, grads, strict=True):
        cam = torch.zeros(2, t, t)
        cam[:, :1] = (g * a).clamp(min=0).mean(1)
        rel = rel + cam @ rel
    row = rel[:, 0, 1:].reshape(2, 2, 3)
    torch.testing.assert_close(gradient_relevance(attn, grads, grid=(2, 3)),
                               row / row.flatten(1).amax(1).view(2, 1, 1), atol=1e-6, rtol=0)
    last = attn[-1].mean(1)[:, 0, 1:].reshape(2, 2, 3)
    torch.testing.assert_close(last_layer_attention(attn, grid=(2, 3)),
                               last / last.flatten(1).amax(1).view(2, 1, 1), atol=1e-6, rtol=0)


def test_non_square_grid_and_register_tokens():
    torch.manual_seed(1)
    prefix, h, w = 5, 2, 4  # cls + 4 registers
    t = prefix + h * w
    attn = [torch.softmax(torch.randn(2, 2, t, t), -1) for _ in range(2)]
    maps = attention_rollout(attn, grid=(h, w), num_prefix_tokens=prefix)
    assert maps.shape == (2, h, w)
    # Explaining register token 2 instead of the class token is a different row.
    other = attention_rollout(attn, grid=(h, w), num_prefix_tokens=prefix, token_index=2)
    assert not torch.allclose(maps, other)
    with pytest.raises(ValueError, match="do not fill the grid"):
        attention_rollout(attn, grid=(3, 3), num_prefix_tokens=prefix)
    with pytest.raises(ValueError, match="not a prefix token"):
        attention_rollout(attn, grid=(h, w), num_prefix_tokens=prefix, token_index=5)


def test_discard_ratio_never_discards_prefix_columns():
    t = 1 + 4
    a = torch.full((1, 1, t, t), 0.01)
    a[..., 0] = 0.001  # attention to the class token is the smallest of all...
    a[0, 0, 0, 2] = 0.9
    kept = attention_rollout([a], grid=(2, 2), discard_ratio=0.9)
    plain = attention_rollout([a], grid=(2, 2))
    assert kept.shape == plain.shape
    # ...but is never discarded; with 90 % of the patch entries gone, only patch 1 survives.
    assert kept[0].flatten().tolist() == [0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="discard_ratio"):
        attention_rollout([a], grid=(2, 2), discard_ratio=1.0)


def test_fusion_and_normalisation_edge_cases():
    a = torch.tensor([[[[0.2, 0.8]], [[0.6, 0.4]]]])  # [1, 2 heads, 1, 2]
    assert torch.allclose(fuse_heads(a, "mean"), torch.tensor([[[0.4, 0.6]]]))
    assert torch.allclose(fuse_heads(a, "max"), torch.tensor([[[0.6, 0.8]]]))
    assert torch.allclose(fuse_heads(a, "min"), torch.tensor([[[0.2, 0.4]]]))
    with pytest.raises(ValueError, match="head_fusion"):
        fuse_heads(a, "median")
    z = normalize_maps(torch.zeros(2, 3, 3))
    assert torch.equal(z, torch.zeros(2, 3, 3))
    c = normalize_maps(torch.full((1, 2, 2), 0.3))
    assert torch.equal(c, torch.ones(1, 2, 2))


def test_gradient_relevance_hand_case_and_real_model(tiny_encoder):
    # One block, one head: relevance = I + relu(grad * A) -> row 0.
    t = 1 + 4
    a = torch.full((1, 1, t, t), 0.2)
    g = torch.zeros(1, 1, t, t)
    g[0, 0, 0, 4] = 5.0  # only the class token's attention to patch 3 helps the score
    g[0, 0, 0, 2] = -5.0  # negative evidence is clipped
    rel = gradient_relevance([a], [g], grid=(2, 2))
    assert rel[0].flatten().tolist() == [0.0, 0.0, 0.0, 1.0]
    # On a real ViT: needs gradients, batch == per image.
    x = torch.randn(3, 3, 32, 32)
    torch.manual_seed(0)
    w = torch.randn(tiny_encoder.embed_dim)
    with capture_attention(tiny_encoder, keep_grad=True) as attn:
        out = tiny_encoder(x)
    with pytest.raises(ValueError, match="no gradients"):
        gradient_relevance(attn, None, out.grid)
    (out.tokens[:, 0] @ w).sum().backward()
    maps = gradient_relevance(attn, None, out.grid)
    assert maps.shape == (3, 4, 4) and torch.all((maps >= 0) & (maps <= 1))
    with capture_attention(tiny_encoder, keep_grad=True) as attn1:
        out1 = tiny_encoder(x[1:2])
    (out1.tokens[:, 0] @ w).sum().backward()
    assert torch.allclose(gradient_relevance(attn1, None, out1.grid)[0], maps[1], atol=1e-5)


def test_last_layer_attention_is_the_cls_row(tiny_encoder):
    with torch.no_grad(), capture_attention(tiny_encoder) as attn:
        out = tiny_encoder(torch.randn(2, 3, 32, 32))
    m = last_layer_attention(attn, out.grid)
    row = attn[-1].mean(1)[:, 0, 1:].reshape(2, 4, 4)
    assert torch.allclose(m, row / row.amax(dim=(1, 2), keepdim=True), atol=1e-6)


def test_gradient_relevance_equals_the_recursive_definition():
    torch.manual_seed(2)
    t = 1 + 6
    attn = [torch.softmax(torch.randn(2, 3, t, t), -1) for _ in range(3)]
    grads = [torch.randn(2, 3, t, t) for _ in range(3)]
    rel = torch.eye(t).repeat(2, 1, 1)
    for a, g in zip(attn, grads, strict=True):
        rel = rel + (g * a).clamp(min=0).mean(1) @ rel
    row = rel[:, 0, 1:].reshape(2, 2, 3)
    expected = row / row.amax(dim=(1, 2), keepdim=True)
    assert torch.allclose(gradient_relevance(attn, grads, grid=(2, 3)), expected, atol=1e-6)


def test_patches_row_is_the_mean_of_the_patch_rows():
    torch.manual_seed(3)
    p, t = 2, 2 + 6
    attn = [torch.softmax(torch.randn(2, 3, t, t), -1) for _ in range(2)]
    grads = [torch.randn(2, 3, t, t) for _ in range(2)]
    eye = torch.eye(t)
    roll, rel = eye.repeat(2, 1, 1), eye.repeat(2, 1, 1)
    for a, g in zip(attn, grads, strict=True):
        f = a.mean(1) + eye
        roll = (f / f.sum(-1, keepdim=True)) @ roll
        rel = rel + (g * a).clamp(min=0).mean(1) @ rel

    def expected(full):  # mean over the patch rows, patch columns, scaled to max 1
        row = full[:, p:, p:].mean(1).reshape(2, 2, 3)
        return row / row.amax(dim=(1, 2), keepdim=True)

    kw = {"grid": (2, 3), "num_prefix_tokens": p, "token_index": "patches"}
    assert torch.allclose(attention_rollout(attn, **kw), expected(roll), atol=1e-6)
    assert torch.allclose(gradient_relevance(attn, grads, **kw), expected(rel), atol=1e-6)
    assert torch.allclose(last_layer_attention(attn, **kw), expected(attn[-1].mean(1)), atol=1e-6)
    assert not torch.allclose(attention_rollout(attn, (2, 3), p), expected(roll))  # the class token's row differs


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_explanations_follow_the_heads_pooling(pooling):
    """A mean-pooling head never reads the class token: its maps are the mean of the patch rows."""
    from vision_attn import create_encoder
    from vision_attn.explain.methods import explain_classifier
    from vision_attn.tasks import ClassificationTask

    from .conftest import TINY_VIT

    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"],
                              head=ClassifierConfig(pooling=pooling)).eval()
    x = torch.randn(2, 3, 32, 32)
    expl = explain_classifier(task, x, ("rollout", "relevance", "attention"))
    assert expl.num_prefix_tokens == 1 and expl.token_index == (0 if pooling == "cls" else "patches")
    # by hand from the same model: capture, backpropagate the explained logit, full matrices
    with capture_attention(task.encoder, keep_grad=True) as attn:
        logits = task.head(task.encoder(x))
    logits.gather(1, expl.target.view(-1, 1)).sum().backward()
    t = attn[0].shape[-1]
    eye = torch.eye(t)
    roll, rel = eye.repeat(2, 1, 1), eye.repeat(2, 1, 1)
    for a in attn:
        f = a.detach().mean(1) + eye
        roll = (f / f.sum(-1, keepdim=True)) @ roll
        rel = rel + (a.grad * a.detach()).clamp(min=0).mean(1) @ rel
    last = attn[-1].detach().mean(1)
    for name, full in (("rollout", roll), ("relevance", rel), ("attention", last)):
        rows = full[:, 1:, 1:] if pooling == "mean" else full[:, :1, 1:]  # (B, rows, patches)
        per_row = rows.reshape(2, -1, 4, 4)
        by_hand = per_row.mean(1)  # average of the per-row maps
        by_hand = by_hand / by_hand.amax(dim=(1, 2), keepdim=True)
        assert torch.allclose(expl.maps[name], by_hand, atol=1e-5), name
    with pytest.raises(ValueError, match="cannot explain a head with pooling 'map'"):
        from vision_attn.explain.methods import explained_token

        explained_token(type("Head", (), {"pooling": "map"})(), 1)
