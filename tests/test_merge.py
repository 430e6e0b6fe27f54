"""Token merging (ToMe): r=0 is the unmerged model bit for bit, the matching and the size-weighted
merge equal a per-image reference, proportional attention makes merged duplicates exact, and the
explanations of a merged model come back on the patch grid."""

from __future__ import annotations

import json

import pytest
import timm
import torch

from vision_attn import capture_attention, create_encoder
from vision_attn.errors import EncoderError
from vision_attn.explain.capture import streaming_relevance, streaming_rollout
from vision_attn.explain.rollout import (
    attention_rollout,
    gradient_relevance,
    last_layer_attention,
    rollout_scores,
)
from vision_attn.models.merging import (
    MergeState,
    TokenExpand,
    TokenMerge,
    grid_attention,
    merge_log,
    merge_state,
    merge_tokens,
    token_merging,
    unmerge_tokens,
)

from .conftest import TINY_VIT

ENCODERS = {
    "vit": ("vit_tiny_patch16_224", {}),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", {}),
    "registers": ("vit_tiny_patch16_224", {"reg_tokens": 4}),
    "no_prefix": ("vit_tiny_patch16_224", {"class_token": False, "global_pool": "avg"}),
    "lsa": ("vit_tiny_patch16_224", {"lsa": True}),
}
# 64 px, patch 8: an 8x8 grid of 64 patch tokens, enough to merge a few per block
SIZES = {**TINY_VIT, "img_size": 64, "depth": 4}


def _encoder(key: str):
    name, extra = ENCODERS[key]
    torch.manual_seed(0)
    return create_encoder(name, **SIZES, **extra).eval()


def _hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("key", list(ENCODERS))
def test_r0_is_the_unmerged_model_and_unmerge_restores_it(key):
    enc = _encoder(key)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = enc(x).tokens
        merge_tokens(enc, 0)
        assert torch.equal(enc(x).tokens, ref)
        with capture_attention(enc) as attn_r0:
            enc(x)
        merge_tokens(enc, 6)  # merged: another, shorter computation, same output shape (the grid is kept)
        merged = enc(x).tokens
        assert merged.shape == ref.shape and not torch.allclose(merged, ref, atol=1e-3)
        unmerge_tokens(enc)
        assert all(type(b) is timm.models.vision_transformer.Block for b in enc.model.blocks)
        assert _hooks(enc) == 0 and merge_state(enc) is None
        assert torch.equal(enc(x).tokens, ref)
        with capture_attention(enc) as attn:
            enc(x)
    assert all(torch.equal(a, b) for a, b in zip(attn, attn_r0, strict=True))


def test_a_deep_copy_of_a_merged_model_merges_on_its_own():
    import copy

    enc = merge_tokens(_encoder("vit"), 4)
    twin = copy.deepcopy(enc)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(twin(x).tokens, enc(x).tokens)
    assert merge_state(twin) is not merge_state(enc) and merge_state(twin).size.shape[1] == 1 + 64 - 4 * 4
    unmerge_tokens(twin)
    assert _hooks(twin) == 0 and _hooks(enc) == 4  # each model's hooks are its own
    with torch.no_grad():
        assert not torch.equal(twin(x).tokens, enc(x).tokens)


def test_context_manager_restores_also_after_an_error(tiny_encoder):
    with pytest.raises(KeyError):
        with token_merging(tiny_encoder, 2) as model:
            assert merge_state(model).r == 2
            raise KeyError("boom")
    assert merge_state(tiny_encoder) is None and _hooks(tiny_encoder) == 0
    merge_tokens(tiny_encoder, 1)
    with token_merging(tiny_encoder, 3):
        assert merge_state(tiny_encoder).r == 3
    assert merge_state(tiny_encoder).r == 1  # back to the earlier r, still merged
    with pytest.raises(EncoderError, match="merge_r must be an integer >= 0"):
        merge_tokens(tiny_encoder, -1)
    with pytest.raises(EncoderError, match="needs a timm Vision Transformer"):
        merge_tokens(torch.nn.Linear(2, 2), 1)
    swin = timm.create_model("vit_relpos_small_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=32,
                             num_heads=2)
    with pytest.raises(EncoderError, match="block 0 is"):
        merge_tokens(swin, 1)


def _reference_merge(x, keys, size, r, p):
    """ToMe's bipartite soft matching and size-weighted merge for ONE image, with Python loops."""
    metric = keys.mean(0)[p:]  # (N, d): mean over heads, patch tokens only
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a_idx, b_idx = list(range(0, len(metric), 2)), list(range(1, len(metric), 2))
    best = {}
    for i in a_idx:
        sims = [float(metric[i] @ metric[j]) for j in b_idx]
        best[i] = (max(sims), b_idx[sims.index(max(sims))])
    merged = sorted(a_idx, key=lambda i: -best[i][0])[:r]
    kept = [i for i in a_idx if i not in merged]
    groups = [[i] for i in range(p)] + [[p + i] for i in kept] + [[p + j] + [p + i for i in merged if best[i][1] == j]
                                                                 for j in b_idx]
    tokens = torch.stack([sum(x[g] * size[g] for g in grp) / sum(size[g] for g in grp) for grp in groups])
    sizes = torch.stack([sum(size[g] for g in grp) for grp in groups])
    return tokens, sizes, groups


@pytest.mark.parametrize("p", [0, 1, 5])
def test_matching_and_weighted_merge_equal_a_per_image_reference(p):
    torch.manual_seed(p)
    b, n, d, heads = 3, 11, 6, 2  # an odd number of patch tokens: set A has one more
    t = p + n
    x, keys = torch.randn(b, t, d), torch.randn(b, heads, t, 4)
    size = torch.randint(1, 4, (b, t, 1)).float()
    state = MergeState(r=3, num_prefix_tokens=p, depth=2)
    state.start(x)
    state.size, state.keys = size, keys
    state.assignment = torch.arange(t).expand(b, -1)
    out = state.merge(x, 0)
    assert out.shape == (b, t - 3, d)
    for i in range(b):
        tokens, sizes, groups = _reference_merge(x[i], keys[i], size[i], 3, p)
        assert torch.allclose(out[i], tokens, atol=1e-6)
        assert torch.equal(state.size[i], sizes)
        # the source matrix: token k holds exactly the original tokens of its group
        src = state.source()[i]
        assert [sorted(torch.nonzero(row).flatten().tolist()) for row in src] == [sorted(g) for g in groups]
    step = state.steps[0][0]
    assert torch.allclose(step.left(x), out, atol=1e-6)  # the logged map is the merge itself...
    dense = step.matrix()  # ...a row-stochastic [B, T - r, T] matrix
    assert torch.allclose(dense @ x, out, atol=1e-6) and torch.allclose(dense.sum(-1), torch.ones(b, t - 3))
    v = torch.rand(b, t - 3)
    assert torch.allclose(step.right(v), (v.unsqueeze(1) @ dense)[:, 0], atol=1e-6)
    assert torch.allclose(step.right(v).sum(-1), v.sum(-1), atol=1e-5)  # scores keep their sum
    expand = TokenExpand(state.assignment, t - 3)
    assert torch.equal(expand.left(out), expand.matrix() @ out)
    assert torch.equal(expand.right(torch.ones(b, t)), state.source().sum(-1))  # a token collects its patches


def _duplicated_tokens(vit, b=2):
    """``[B, P + N, D]`` block inputs whose patch tokens 0, 1, 2 are identical."""
    torch.manual_seed(3)
    x = torch.randn(b, vit.num_prefix_tokens + 16, vit.embed_dim)
    p = vit.num_prefix_tokens
    x[:, p + 1] = x[:, p]
    x[:, p + 2] = x[:, p]
    return x


def test_proportional_attention_makes_merged_duplicates_exact():
    """Identical tokens stay identical in a ViT; merging them into one token of size 3 and adding
    log(size) to the logits computes exactly what the three separate tokens compute. Block 0
    merges two of them (A-B pair), block 1 the third one: both blocks' attention runs merged."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                            mlp_ratio=2.0).eval()
    x = _duplicated_tokens(vit)
    with torch.no_grad():
        with capture_attention(vit) as attn:
            ref = vit.blocks(x)
        merge_tokens(vit, 1)
        with capture_attention(vit) as attn_m:
            out = vit.blocks(x)
    state = merge_state(vit)
    p = vit.num_prefix_tokens
    assert [a.shape[-1] for a in attn_m] == [p + 16, p + 15]
    assert sorted(state.size[0].flatten().tolist())[-1] == 3.0  # the three duplicates are one token
    assert (state.assignment[:, p: p + 3] == state.assignment[:, p: p + 1]).all()
    assert torch.allclose(out, ref, atol=1e-5)
    # Without the log-size bias the result differs: the bias is what makes it exact.
    state.attention_bias = lambda attn_mask, like: None
    with torch.no_grad():
        assert not torch.allclose(vit.blocks(x), ref, atol=1e-3)
    del state.attention_bias
    # The explanations of the merged model are those of the unmerged one, on all original tokens.
    merges = merge_log(vit)
    for token_index in (0, "patches"):
        assert torch.allclose(attention_rollout(attn_m, (4, 4), p, token_index=token_index, merges=merges),
                              attention_rollout(attn, (4, 4), p, token_index=token_index), atol=1e-5)
        assert torch.allclose(last_layer_attention(attn_m, (4, 4), p, token_index=token_index, merges=merges),
                              last_layer_attention(attn, (4, 4), p, token_index=token_index), atol=1e-5)
    # and every block's attention, mapped back to the original tokens, is the unmerged one
    on_grid = grid_attention(attn_m, merges)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(on_grid, attn, strict=True))


@pytest.mark.parametrize("key", ["vit", "deit_distilled", "registers", "no_prefix"])
def test_merged_explanations_have_the_grid_shape_and_rollouts_sums(key):
    enc = _encoder(key)
    merge_tokens(enc, 6)
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad(), capture_attention(enc) as attn:
        out = enc(x)
    p, (h, w) = out.num_prefix_tokens, out.grid
    assert out.tokens.shape[1] == p + h * w  # tokens back on the grid
    assert [a.shape[-1] for a in attn] == [p + h * w - 6 * i for i in range(4)]
    merges = merge_log(enc)
    assert isinstance(merges[-1][-1], TokenExpand) and all(isinstance(s[0], TokenMerge) for s in merges)
    token_index = 0 if p else "patches"
    for fn in (attention_rollout, last_layer_attention):
        maps = fn(attn, out.grid, p, token_index=token_index, merges=merges)
        assert maps.shape == (2, h, w) and maps.amax(dim=(1, 2)).allclose(torch.ones(2))
    # the raw rollout row over the original tokens sums to what an unmerged rollout sums to: 1
    unmerged = _encoder(key)
    with torch.no_grad(), capture_attention(unmerged) as attn_u:
        unmerged(x)
    row = rollout_scores(attn, p, token_index=token_index, merges=merges)
    assert row.shape == (2, p + h * w)
    assert torch.allclose(row.sum(-1), rollout_scores(attn_u, p, token_index=token_index).sum(-1), atol=1e-5)
    # and the patches' part equals the merged tokens' part at the last block (shares split by size)
    before_expand = rollout_scores(attn, p, token_index=token_index, merges=[*merges[:-1], merges[-1][:-1]])
    assert torch.allclose(row[:, p:].sum(-1), before_expand[:, p:].sum(-1), atol=1e-5)
    with pytest.raises(ValueError, match="different numbers of tokens"):
        attention_rollout(attn, out.grid, p)
    on_grid = grid_attention(attn, merges)  # every block back on the original tokens, rows summing to 1
    assert all(a.shape == (2, enc.num_heads, p + h * w, p + h * w) for a in on_grid)
    assert all(torch.allclose(a.sum(-1), torch.ones(2, enc.num_heads, p + h * w), atol=1e-5) for a in on_grid)
    # streaming follows the merges as they happen: equal to the stored rollout
    with torch.no_grad(), streaming_rollout(enc) as stream:
        enc(x)
    assert torch.allclose(stream.maps(out.grid, p, token_index),
                          attention_rollout(attn, out.grid, p, token_index=token_index, merges=merges), atol=1e-6)


def test_merged_relevance_stored_and_streaming_agree():
    enc = _encoder("registers")
    merge_tokens(enc, 5)
    x = torch.randn(2, 3, 64, 64)
    w = torch.randn(enc.embed_dim)
    with capture_attention(enc, keep_grad=True) as attn:
        out = enc(x)
    (out.tokens[:, 0] @ w).sum().backward()
    stored = gradient_relevance(attn, None, out.grid, out.num_prefix_tokens, merges=merge_log(enc))
    with streaming_relevance(enc) as rel:
        out = enc(x)
    streamed = rel.maps((out.tokens[:, 0] @ w).sum(), out.grid, out.num_prefix_tokens)
    assert streamed.shape == (2, 8, 8) and torch.allclose(streamed, stored, atol=1e-6)


def test_merging_cuts_tokens_as_scheduled_and_caps_at_half():
    enc = _encoder("vit")
    merge_tokens(enc, 100)  # more than half the patches: at most half merge per block
    with torch.no_grad(), capture_attention(enc) as attn:
        enc(torch.randn(1, 3, 64, 64))
    assert [a.shape[-1] for a in attn] == [1 + 64, 1 + 32, 1 + 16, 1 + 8]


def test_predict_folder_merge_r(tmp_path):
    import numpy as np
    from PIL import Image

    from vision_attn.commands.predict import main
    from vision_attn.predict import FolderRun, ModelSource, predict_folder

    from .test_export import _checkpoint, _tasks

    images = tmp_path / "imgs"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray((rng.random((40, 56, 3)) * 255).astype(np.uint8)).save(images / f"{i}.png")
    ckpt = _checkpoint(_tasks()["classification"], tmp_path / "m.ckpt")
    run = FolderRun(batch_size=2, progress=False, num_workers=0)
    plain = predict_folder(ckpt, images, tmp_path / "plain", run)
    same = predict_folder(ModelSource(ckpt, merge_r=0), images, tmp_path / "r0", run)
    assert same == plain
    main(["--model", str(ckpt), "--images", str(images), "--output_dir", str(tmp_path / "r2"), "--merge_r", "2",
          "--no_overlays", "--num_workers", "0"])
    merged = json.loads((tmp_path / "r2" / "predictions.json").read_text())
    assert [p["file"] for p in merged] == [p["file"] for p in plain["predictions"]]
    assert [p["score"] for p in merged] != [p["score"] for p in plain["predictions"]]  # it did merge
    with pytest.raises(SystemExit):
        main(["--model", str(ckpt), "--images", str(images), "--output_dir", str(tmp_path / "bad"), "--merge_r",
              "-1", "--no_overlays"])


def test_merging_benchmark_runs_tiny():
    from benchmarks.merging import run

    res = run("vit_tiny_patch16_224", batch=2, repeats=1, r_values=(0, 4), img_size=64, patch_size=8, embed_dim=32,
              depth=3, num_heads=2)
    r0, r4 = res["rows"]
    assert r0["top1_agreement"] == 1.0 and r0["rollout_spearman_median"] == pytest.approx(1.0)
    assert r4["tokens_last_block"] == 1 + 64 - 3 * 4 and 0 < r4["speedup"] and -1 <= r4["rollout_spearman_min"] <= 1


def test_explain_classifier_on_a_merged_model():
    """The classifier's maps (rollout, relevance, raw attention) of a merged model, through the
    method registry: on the patch grid, equal to the stored rollout through the merges."""
    from vision_attn.explain.methods import MethodInputs, explain_classifier
    from vision_attn.tasks import ClassificationTask

    if "merges" not in MethodInputs.__dataclass_fields__:
        pytest.skip("explain_classifier passes no merges (MethodInputs has no merges field)")
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **SIZES), class_names=["a", "b", "c"]).eval()
    merge_tokens(task, 4)
    x = torch.randn(2, 3, 64, 64)
    expl = explain_classifier(task, x, ("rollout", "relevance", "attention"))
    assert all(m.shape == (2, 8, 8) for m in expl.maps.values())
    with torch.no_grad(), capture_attention(task.encoder) as attn:
        out = task.encoder(x)
    assert torch.allclose(expl.maps["rollout"], attention_rollout(attn, out.grid, 1, merges=merge_log(task)), atol=1e-6)
