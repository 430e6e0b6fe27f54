"""ViTDet's simple feature pyramid in the DETR head: switched off, the head is the head without
the pyramid bit for bit, the levels are what ViTDet builds, the cross-attention maps go back to the
patch grid without losing mass, and both explanation methods work with the pyramid on."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vision_attn import capture_attention, create_encoder
from vision_attn.explain.capture import attention_modules
from vision_attn.explain.decoder_relevance import detection_relevance
from vision_attn.explain.detection import detection_maps
from vision_attn.models.detr import PYRAMID_SCALES, DETRConfig, DETRHead, SimpleFeaturePyramid
from vision_attn.models.encoder import EncoderOutput
from vision_attn.tasks.detection import DetectionTask

from .conftest import REPO
from .test_decoder_relevance import _bar, _fuse

BEFORE_PYRAMID = "7a388ec"  # a commit whose vision_attn/models/detr.py has no pyramid


def _enc(b=2, grid=(5, 6), dim=24, prefix=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return EncoderOutput(torch.randn(b, prefix + grid[0] * grid[1], dim, generator=g), prefix, grid)


def _old_detr_module(tmp_path):
    """``vision_attn/models/detr.py`` as it was before the pyramid (skipped without the history)."""
    try:
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{BEFORE_PYRAMID}:vision_attn/models/detr.py"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"git history with commit {BEFORE_PYRAMID} not available")
    path = tmp_path / "detr_before_pyramid.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("detr_before_pyramid", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop("detr_before_pyramid", None)
    spec.loader.exec_module(module)
    return module


SWITCHES = [{}, {"box_refine": True, "focal": True},
            {"box_refine": True, "query_selection": True, "dn_groups": 2, "dn_negatives": True, "o2m_groups": 2,
             "look_forward_twice": True}]


@pytest.mark.parametrize("kw", SWITCHES)
@pytest.mark.parametrize("train", [False, True])
def test_pyramid_off_is_the_head_before_it_bit_for_bit(tmp_path, kw, train):
    old = _old_detr_module(tmp_path)
    targets = [{"labels": torch.tensor([0, 2]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2], [0.3, 0.3, 0.1, 0.2]])},
               {"labels": torch.tensor([1]), "boxes": torch.tensor([[0.4, 0.5, 0.2, 0.3]])}]
    outs, states = [], []
    sizes = dict(num_queries=5, hidden_dim=32, num_layers=2, num_heads=4)
    for build in (lambda: old.DETRHead(24, 3, **sizes, **kw), lambda: DETRHead(24, 3, DETRConfig(**sizes, dropout=0.1,
                                                                                                  **kw))):
        torch.manual_seed(0)
        head = build().train(train)
        states.append(head.state_dict())
        torch.manual_seed(5)  # the denoising noise
        outs.append(head(_enc(), need_weights=True, targets=targets))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    a, b = outs
    assert a.keys() == b.keys()
    for k in ("pred_logits", "pred_boxes"):
        assert torch.equal(a[k], b[k])
    assert all(torch.equal(x, y) for x, y in zip(a["cross_attn"], b["cross_attn"], strict=True))
    assert all(torch.equal(x["pred_boxes"], y["pred_boxes"]) for x, y in zip(a["aux_outputs"], b["aux_outputs"],
                                                                              strict=True))


def test_level_grids_and_memory_size():
    assert SimpleFeaturePyramid.level_grids((5, 6)) == [(10, 12), (5, 6), (3, 3), (2, 2)]
    assert SimpleFeaturePyramid.level_grids((8, 8)) == [(16, 16), (8, 8), (4, 4), (2, 2)]
    assert SimpleFeaturePyramid.level_grids((1, 3)) == [(2, 6), (1, 3), (1, 2), (1, 1)]
    assert PYRAMID_SCALES == (2.0, 1.0, 0.5, 0.25)
    head = DETRHead(24, 3, config=DETRConfig(num_queries=5, hidden_dim=32, num_layers=1, num_heads=4, pyramid=True,
                                             dropout=0.1)).eval()
    memory, pos, mask, _ = head._memory(_enc())
    assert memory.shape == (2, 120 + 30 + 9 + 4, 32) and pos.shape == (1, 163, 32) and mask is None
    assert not hasattr(head, "input_proj")  # each level has its own projection


def test_levels_are_vitdet_s_up_identity_and_max_pools():
    torch.manual_seed(0)
    pyr = SimpleFeaturePyramid(4, 8).eval()
    h, w = 3, 5
    x = torch.randn(1, h * w, 4)
    levels = pyr(x, (h, w))
    cells = x[0].reshape(h, w, 4)
    # identity level: the tokens projected
    torch.testing.assert_close(levels[1][0][0], pyr.proj[1](x[0]))
    # 2x: fine cell (2i + a, 2j + c) = W[:, :, a, c]^T x(i, j) + bias (transposed conv, stride = kernel)
    wt, bias = pyr.up.weight, pyr.up.bias  # (in, out, 2, 2)
    fine = torch.zeros(2 * h, 2 * w, 4)
    for i in range(h):
        for j in range(w):
            for a in range(2):
                for c in range(2):
                    fine[2 * i + a, 2 * j + c] = cells[i, j] @ wt[:, :, a, c] + bias
    torch.testing.assert_close(levels[0][0][0], pyr.proj[0](fine.reshape(-1, 4)))
    # 1/2 and 1/4: the elementwise max over each window, partial windows at the bottom and right kept
    for lvl, k in ((2, 2), (3, 4)):
        rows, cols = -(-h // k), -(-w // k)
        pooled = torch.stack([cells[r * k : (r + 1) * k, c * k : (c + 1) * k].reshape(-1, 4).amax(0)
                              for r in range(rows) for c in range(cols)])
        torch.testing.assert_close(levels[lvl][0][0], pyr.proj[lvl](pooled))


def _to_patches_matrix(grid):
    """``S [M, N]`` built cell by cell: a fine token gives all to its patch, a pooled token spreads
    evenly over the patches of its window."""
    h, w = grid
    rows = []
    for scale, (lh, lw) in zip(PYRAMID_SCALES, SimpleFeaturePyramid.level_grids(grid), strict=True):
        for r in range(lh):
            for c in range(lw):
                row = torch.zeros(h, w, dtype=torch.float64)
                if scale >= 1:
                    f = int(scale)
                    row[r // f, c // f] = 1.0
                else:
                    k = int(1 / scale)
                    window = row[r * k : (r + 1) * k, c * k : (c + 1) * k]
                    window += 1.0 / window.numel()
                rows.append(row.flatten())
    return torch.stack(rows)


@pytest.mark.parametrize("grid", [(3, 3), (4, 8), (5, 6), (1, 2)])
def test_to_patches_is_the_resampling_matrix_and_keeps_the_mass(grid):
    s = _to_patches_matrix(grid)
    values = torch.rand(2, 3, s.shape[0], dtype=torch.float64)
    out = SimpleFeaturePyramid.to_patches(values, grid)
    torch.testing.assert_close(out, values @ s)
    torch.testing.assert_close(out.sum(-1), values.sum(-1))
    # by hand, grid 3 x 3: the single 1/4 token spreads 1/9 per patch; the 1/2 token (1, 1) is patch (2, 2) alone
    if grid == (3, 3):
        one = torch.zeros(36 + 9 + 4 + 1, dtype=torch.float64)
        one[-1] = 1.0
        assert torch.allclose(SimpleFeaturePyramid.to_patches(one, grid), torch.full((9,), 1 / 9, dtype=torch.float64))
        one = torch.zeros_like(one)
        one[36 + 9 + 3] = 1.0
        assert SimpleFeaturePyramid.to_patches(one, grid).tolist() == [0.0] * 8 + [1.0]
    with pytest.raises(ValueError, match="tokens"):
        SimpleFeaturePyramid.to_patches(values[..., :-1], grid)


@pytest.mark.parametrize("kw", [{}, {"box_refine": True, "query_selection": True, "focal": True}])
def test_pyramid_head_cross_attention_is_over_the_patch_grid(kw):
    torch.manual_seed(0)
    head = DETRHead(24, 3, DETRConfig(num_queries=5, hidden_dim=32, num_layers=2, num_heads=4, pyramid=True,
                                      dropout=0.1, **kw)).eval()
    enc = _enc()
    out = head(enc, need_weights=True)
    assert out["pred_boxes"].shape == (2, 5, 4)
    assert len(out["cross_attn"]) == 2 and out["cross_attn"][0].shape == (2, 4, 5, 30)
    torch.testing.assert_close(out["cross_attn"][1].sum(-1), torch.ones(2, 4, 5))
    with capture_attention(head, names=["layers.1.cross_attn"]) as raw:  # over the levels' tokens
        head(enc)
    assert raw[0].shape == (2, 4, 5, 163)
    torch.testing.assert_close(out["cross_attn"][1], SimpleFeaturePyramid.to_patches(raw[0], enc.grid))
    if kw:
        assert out["enc_outputs"]["pred_boxes"].shape == (2, 5, 4)  # selected among all levels' tokens


def test_pyramid_head_trains_every_level():
    torch.manual_seed(0)
    head = DETRHead(24, 3, config=DETRConfig(num_queries=5, hidden_dim=32, num_layers=2, num_heads=4, pyramid=True,
                                             box_refine=True, dropout=0.1)).train()
    out = head(_enc())
    (out["pred_boxes"].sum() + out["pred_logits"].sum()).backward()
    pyr = head.feature_pyramid
    assert pyr.up.weight.grad.abs().sum() > 0 and pyr.level_embed.grad.abs().sum() > 0
    assert all(p[0].weight.grad.abs().sum() > 0 for p in pyr.proj)
    assert "feature_pyramid.level_embed" in head.no_weight_decay()


# ---------------------------------------------------------------------------- explanations
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


TINY_HEAD = DETRConfig(num_queries=4, hidden_dim=32, num_layers=2, num_heads=2, pyramid=True)


def _task(**head) -> DetectionTask:
    """A tiny pyramid detector; ``head``: fields of its :class:`DETRConfig` besides the tiny sizes."""
    torch.manual_seed(0)
    return DetectionTask(create_encoder("vit_tiny_patch16_224", **TINY), num_classes=2,
                         head=replace(TINY_HEAD, **head)).eval()


def _reference_pyramid_map(task, image, query, label):
    """The paper's equations one image at a time (as tests/test_decoder_relevance.py), with the
    cross-attention over the pyramid's tokens carried to the patches by the matrix built above."""
    with torch.enable_grad(), capture_attention(task, keep_grad=True) as attn:
        enc = task.encoder(image[None])
        logits = task.head(enc)["pred_logits"][0, query]
    grads = torch.autograd.grad(logits[label], list(attn))
    attn, grads = list(attn), list(grads)
    depth, layers, prefix = len(attention_modules(task.encoder)), len(task.head.layers), enc.num_prefix_tokens
    s = _to_patches_matrix(enc.grid)
    t = attn[0].shape[-1]
    r_ii = torch.eye(t, dtype=torch.float64)
    for k in range(depth):
        r_ii = r_ii + _fuse(attn[k][0], grads[k][0]) @ r_ii
    q = attn[depth][0].shape[-1]
    r_qq, r_qi = torch.eye(q, dtype=torch.float64), torch.zeros(q, t, dtype=torch.float64)
    for layer in range(layers):
        sa, ca = depth + 2 * layer, depth + 2 * layer + 1
        a_qq = _fuse(attn[sa][0], grads[sa][0])
        r_qq, r_qi = r_qq + a_qq @ r_qq, r_qi + a_qq @ r_qi
        a_qi = _fuse(attn[ca][0], grads[ca][0]) @ s  # [Q, M] -> [Q, N]
        r_qi = r_qi + _bar(r_qq).T @ a_qi @ _bar(r_ii)[prefix:]
    row = r_qi[query, prefix:].float().reshape(enc.grid)
    return row / row.max() if row.max() > 0 else row


@pytest.mark.parametrize("kw", [{}, {"focal": True, "box_refine": True}])
def test_relevance_through_the_pyramid_matches_the_equations(kw):
    task = _task(**kw)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    queries, labels = [torch.tensor([2, 0]), torch.tensor([1])], [torch.tensor([1, 0]), torch.tensor([0])]
    maps = detection_relevance(task, images, queries, labels, max_rows=2)
    assert [m.shape for m in maps] == [(2, 4, 4), (1, 4, 4)]
    for b, (qs, ls) in enumerate(zip(queries, labels, strict=True)):
        for k, (q, c) in enumerate(zip(qs.tolist(), ls.tolist(), strict=True)):
            torch.testing.assert_close(maps[b][k], _reference_pyramid_map(task, images[b], q, c), atol=1e-5, rtol=0)


def test_attention_and_relevance_maps_of_a_pyramid_task():
    task = _task(box_refine=True)
    images = torch.randn(1, 3, 32, 40, generator=torch.Generator().manual_seed(4))
    queries, labels = [torch.tensor([0, 3])], [torch.tensor([1, 0])]
    maps = detection_maps(task, images, queries, labels, ["attention", "relevance"])
    for method in ("attention", "relevance"):
        assert maps[method][0].shape == (2, 4, 5)
        assert torch.isfinite(maps[method][0]).all() and torch.allclose(maps[method][0].amax((1, 2)), torch.ones(2))
    # the attention method is the mean over heads of the last layer's patch-grid weights, as without the pyramid
    with torch.no_grad():
        attn = task(images, need_weights=True)["cross_attn"][-1][0].mean(0)[[0, 3]].reshape(2, 4, 5)
    expected = attn / attn.amax((1, 2), keepdim=True)
    torch.testing.assert_close(maps["attention"][0], expected, atol=1e-5, rtol=0)
    assert not torch.allclose(maps["relevance"][0], maps["attention"][0], atol=1e-2)


def test_pyramid_switch_through_the_task_and_its_checkpoint_hparams():
    task = _task()
    assert task.hparams["head"]["pyramid"] is True and task.head.pyramid
    plain = DetectionTask(create_encoder("vit_tiny_patch16_224", **TINY), num_classes=2,
                          head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2))
    assert not plain.head.pyramid and not hasattr(plain.head, "feature_pyramid")
    out = task(torch.randn(2, 3, 32, 32))
    assert out["pred_logits"].shape == (2, 4, 3)
    assert F.softmax(out["pred_logits"], -1).isfinite().all()


def test_pyramid_task_checkpoint_and_onnx_export_match_pytorch(tmp_path):
    """The switch is stored in the checkpoint, and the exported graph (transposed convolution, max
    pooling with partial windows) gives PyTorch's outputs at another batch size."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is part of the dev extra")
    from vision_attn import load_task
    from vision_attn.export import export_onnx

    from .test_export import _checkpoint

    task = _task(box_refine=True, focal=True)
    ckpt = _checkpoint(task, tmp_path / "m.ckpt")
    model = load_task(ckpt).eval()
    assert model.head.pyramid and model.hparams["head"]["pyramid"]
    path = export_onnx(ckpt, tmp_path / "m.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    logits, boxes = session.run(None, {"images": x.numpy()})
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(out["pred_logits"], task(x)["pred_logits"])  # the weights came back
    np.testing.assert_allclose(logits, out["pred_logits"].numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(boxes, out["pred_boxes"].numpy(), atol=1e-4, rtol=0)
