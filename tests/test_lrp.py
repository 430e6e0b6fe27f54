"""AttnLRP relevance (vision_attn.explain.lrp): conservation of the explained logit, equality with
gradient x input when the rules are off, the attention rules against a slow reference written
from the paper's equations, the ``lrp`` method through explain_classifier, and an encoder left
untouched (also when the forward pass raises)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention
from torch import nn

from vision_attn import create_encoder
from vision_attn.attention import explicit_attention
from vision_attn.errors import ConfigError
from vision_attn.explain.lrp import lrp_relevance, lrp_rules, relevance_budget
from vision_attn.explain.methods import explain_classifier
from vision_attn.explain.rollout import normalize_maps
from vision_attn.models.classifier import ClassifierConfig
from vision_attn.tasks import ClassificationTask

from .conftest import TINY_VIT

# (timm name, head): the suite's linear head on a class token; timm's own heads of a distilled
# DeiT (mean of two classifiers) and of a register model with mean pooling and fc_norm.
MODELS = [
    ("vit_tiny_patch16_224", "linear"),
    ("deit_tiny_distilled_patch16_224", "timm"),
    ("vit_little_patch16_reg4_gap_256", "timm"),
]


def _task(name: str = "vit_tiny_patch16_224", head: str = "linear", sinks: bool = True,
          **encoder_kw) -> ClassificationTask:
    """A float64 tiny classifier. ``sinks``: non-zero biases and embeddings (every place that
    keeps relevance is used); otherwise all of them zero. ``encoder_kw``: more encoder arguments."""
    torch.manual_seed(0)
    kw = {"num_classes": 3} if head == "timm" else {}
    task = ClassificationTask(create_encoder(name, **TINY_VIT, **kw, **encoder_kw), num_classes=3,
                              head=ClassifierConfig(kind=head))
    with torch.no_grad():
        for pname, p in task.named_parameters():
            leaf = pname.rsplit(".", 1)[-1]
            if leaf in ("bias", "pos_embed", "cls_token", "dist_token", "reg_token"):
                p.normal_(std=0.1) if sinks else p.zero_()
            elif leaf == "weight" and p.dim() == 2:
                p.normal_(std=0.3)  # larger than timm's init: the attention is far from uniform
    return task.eval().double()


def _images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize(("name", "head"), MODELS)
def test_relevance_is_conserved(name, head):
    """Pixels + biases + embeddings + softmax = the explained logits (exact to rounding)."""
    task, images = _task(name, head), _images()
    budget = relevance_budget(task, images)
    logits = task.head(task.encoder(images)).detach()
    assert budget["score"] == pytest.approx(float(logits.max(dim=1).values.sum()), rel=1e-12)
    assert budget["total"] == pytest.approx(budget["score"], rel=1e-10)
    assert abs(budget["pixels"]) > 1e-3 * abs(budget["score"])  # the pixels do receive relevance
    assert budget["softmax"] != 0.0


@pytest.mark.parametrize(("name", "head"), MODELS)
def test_relevance_is_conserved_with_qk_norm(name, head):
    """timm's ``qk_norm=True`` (LayerNorms on every head's q and k, with non-zero biases): the q / k
    norms' biases keep their share of the halved relevance of ``Q Kᵀ``, so the ledger still closes."""
    task, images = _task(name, head, qk_norm=True), _images()
    attn = task.encoder.model.blocks[0].attn
    assert isinstance(attn.q_norm, nn.LayerNorm) and float(attn.k_norm.bias.detach().abs().sum()) > 0
    budget = relevance_budget(task, images)
    logits = task.head(task.encoder(images)).detach()
    assert budget["score"] == pytest.approx(float(logits.max(dim=1).values.sum()), rel=1e-12)
    assert budget["total"] == pytest.approx(budget["score"], rel=1e-10)
    assert abs(budget["pixels"]) > 1e-3 * abs(budget["score"])


def test_relevance_is_conserved_with_a_local_feed_forward():
    """The encoder of configs/detection/small.yaml: a convolutional stem and a local feed-forward
    in every block (its depthwise convolution carries relevance as a linear layer does)."""
    task, images = _task(stem="conv", local_mlp=True), _images()
    assert task.encoder.local_mlp
    budget = relevance_budget(task, images)
    logits = task.head(task.encoder(images)).detach()
    assert budget["score"] == pytest.approx(float(logits.max(dim=1).values.sum()), rel=1e-12)
    assert budget["total"] == pytest.approx(budget["score"], rel=1e-10)
    assert abs(budget["pixels"]) > 1e-3 * abs(budget["score"])


def test_without_biases_the_pixels_and_softmax_hold_the_logit():
    """Biases and embeddings zeroed: what the pixels get is the logit minus the softmax's share."""
    task, images = _task(sinks=False), _images(1)
    budget = relevance_budget(task, images)
    assert budget["biases"] == 0.0 and budget["embeddings"] == 0.0
    assert budget["pixels"] + budget["softmax"] == pytest.approx(budget["score"], rel=1e-10)
    result = lrp_relevance(task, images)
    assert float(result.maps.sum()) == pytest.approx(budget["pixels"], rel=1e-10)  # maps: patch sums


@pytest.mark.parametrize("size", [(33, 41), (37, 45), (32, 40)])
def test_patch_sums_use_the_padded_patch_grid(size):
    """timm's ``dynamic_img_pad``: an image of sides that are not multiples of the patch size is
    padded at the bottom / right to whole 8 x 8 patches; each map cell sums the pixel relevance of
    its own 8 x 8 cell (the last row / column: the part of it inside the image)."""
    task = _task(dynamic_img_pad=True)
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    result = lrp_relevance(task, images)
    pixels = result.pixels.sum(dim=1)  # (B, H, W)
    rows, cols = -(-size[0] // 8), -(-size[1] // 8)
    assert result.maps.shape == (2, rows, cols)
    expected = torch.zeros(2, rows, cols, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            expected[:, r, c] = pixels[:, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8].sum(dim=(1, 2))
    torch.testing.assert_close(result.maps, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(("name", "head"), MODELS)
def test_rules_off_is_gradient_times_input(name, head):
    task, images = _task(name, head), _images()
    target = torch.tensor([0, 2])
    x = images.clone().requires_grad_(True)
    score = task.head(task.encoder(x)).gather(1, target.view(-1, 1)).sum()  # untouched model, fused attention
    (grad,) = torch.autograd.grad(score, x)
    plain = lrp_relevance(task, images, target, rules=False)
    torch.testing.assert_close(plain.pixels, x.detach() * grad, rtol=0, atol=1e-10)
    rules = lrp_relevance(task, images, target)
    assert (rules.pixels - plain.pixels).abs().max() > 1e-3 * plain.pixels.abs().max()  # the rules act


def _lrp_attention_reference(attn: nn.Module, x: torch.Tensor, r_out: torch.Tensor, qkv_bias=None,
                             score_bias=None) -> torch.Tensor:
    """Relevance of ``x [T, D]`` for relevance ``r_out [T, D]`` at a timm attention module's
    output, message by message from the AttnLRP equations (epsilon -> 0 rule for the linear
    layers and for the sum of the scores and a position bias, the uniform rule for Q Kᵀ and A V,
    the softmax rule x (R - s sum R)). ``qkv_bias``: the bias of the fused projection (Beit's and
    Eva's ``q_bias | 0 | v_bias``); ``score_bias``: ``[heads, T, T]`` added to the scores."""

    def linear(inp, weight, r, bias=None):  # R_i = sum_j inp_i w_ji r_j / z_j (z_j with the bias)
        z = inp @ weight.T + (0 if bias is None else bias)
        return inp * ((r / z) @ weight)

    heads = attn.num_heads
    hd = attn.qkv.weight.shape[0] // (3 * heads)
    qkv = x @ attn.qkv.weight.T + (0 if qkv_bias is None else qkv_bias)
    o_heads, r_qkv = [], torch.zeros_like(qkv)
    for h in range(heads):
        q, k, v = (qkv[:, (i * heads + h) * hd:(i * heads + h + 1) * hd] for i in range(3))  # (T, d) each
        s = (q * attn.scale) @ k.T + (0 if score_bias is None else score_bias[h])
        a = s.softmax(dim=-1)
        o_heads.append((a, v, q, k, s))
    o = torch.cat([a @ v for a, v, *_ in o_heads], dim=1)
    r_o = linear(o, attn.proj.weight, r_out, attn.proj.bias)
    for h, (a, v, q, k, s) in enumerate(o_heads):
        r = r_o[:, h * hd:(h + 1) * hd]
        terms = a[:, :, None] * v[None, :, :]  # (Tq, Tk, d): A_ij v_jd, summing to o_id over j
        share = 0.5 * terms * (r / (a @ v))[:, None, :]
        r_a, r_v = share.sum(dim=2), share.sum(dim=0)
        r_s = s * (r_a - a * r_a.sum(dim=1, keepdim=True))
        terms = (q * attn.scale)[:, None, :] * k[None, :, :]  # (Tq, Tk, d): summing to s_ij over d
        share = 0.5 * terms * (r_s / s)[:, :, None]
        for i, r_part in enumerate((share.sum(dim=1), share.sum(dim=0), r_v)):  # R_q, R_k, R_v
            r_qkv[:, (i * heads + h) * hd:(i * heads + h + 1) * hd] = r_part
    return linear(x, attn.qkv.weight, r_qkv, qkv_bias)


def test_attention_rules_match_the_papers_equations():
    torch.manual_seed(0)
    attn = Attention(8, num_heads=2, qkv_bias=False, proj_bias=False).double().eval()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    c = torch.randn(1, 5, 8, dtype=torch.float64)  # explain sum(c * out): R_out = out * c
    xg = x.clone().requires_grad_(True)
    with lrp_rules(attn):
        out = attn(xg)
    (grad,) = torch.autograd.grad((out * c).sum(), xg)
    reference = _lrp_attention_reference(attn, x[0], (out * c).detach()[0])
    torch.testing.assert_close((x * grad)[0], reference, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["beit", "eva"])
def test_other_attention_classes_follow_the_papers_equations(kind):
    # Beit: a fused qkv applied with F.linear and q / v biases, a relative position bias on the
    # scores: no factor leaves a module. Eva: the same projection, Q and K through q_norm / k_norm.
    from timm.models.beit import Attention as BeitAttention
    from timm.models.eva import EvaAttention

    torch.manual_seed(0)
    if kind == "beit":
        attn = BeitAttention(8, num_heads=2, qkv_bias=True, window_size=(2, 2)).double().eval()  # T = 1 + 4
    else:
        attn = EvaAttention(8, num_heads=2, qkv_bias=True, scale_norm=False).double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.5)
    qkv_bias = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias]).detach()
    score_bias = attn._get_rel_pos_bias()[0].detach() if kind == "beit" else None  # (heads, T, T)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    c = torch.randn(1, 5, 8, dtype=torch.float64)
    xg = x.clone().requires_grad_(True)
    with lrp_rules(attn):
        out = attn(xg)
    (grad,) = torch.autograd.grad((out * c).sum(), xg)
    assert "_get_rel_pos_bias" not in attn.__dict__  # the override is gone after the block
    with explicit_attention([attn]):
        torch.testing.assert_close(out, attn(x), rtol=0, atol=0)  # the forward values are the module's
    reference = _lrp_attention_reference(attn, x[0], (out * c).detach()[0], qkv_bias, score_bias)
    torch.testing.assert_close((x * grad)[0], reference, rtol=1e-9, atol=1e-12)


def test_norm_and_activation_rules_by_hand():
    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64)
    x[0, 0] = 0.0  # the identity rule at 0
    g = torch.randn(3, 6, dtype=torch.float64)
    for module in (nn.GELU(), nn.LayerNorm(6).double()):
        if isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight)
            nn.init.normal_(module.bias)
        xg = x.clone().requires_grad_(True)
        with lrp_rules(module):
            y = module(xg)
        torch.testing.assert_close(y, module(x), rtol=0, atol=0)  # same forward values
        (grad,) = torch.autograd.grad((y * g).sum(), xg)
        if isinstance(module, nn.GELU):  # identity rule: R_in = R_out elementwise
            torch.testing.assert_close(x * grad, F.gelu(x) * g, rtol=1e-12, atol=1e-15)
        else:  # std constant: linear in x, relevance conserved except the bias's share
            kept = (x * grad).sum(dim=1)
            torch.testing.assert_close(kept, ((y - module.bias) * g).sum(dim=1).detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("name", "head"), MODELS)
def test_lrp_method_through_explain_classifier(name, head):
    task, images = _task(name, head), _images(3)
    with torch.inference_mode():  # as in Lightning's predict loop
        batched = explain_classifier(task, images, ["lrp", "rollout"])
    maps = batched.maps["lrp"]
    assert maps.shape == (3, 4, 4) and maps.dtype == torch.float32
    assert float(maps.min()) >= 0.0 and float(maps.max()) == pytest.approx(1.0)
    direct = lrp_relevance(task, images, batched.target)
    torch.testing.assert_close(maps, normalize_maps(direct.maps.float()))
    for i in range(3):
        single = explain_classifier(task, images[i : i + 1], ["lrp"], target=batched.target[i : i + 1])
        torch.testing.assert_close(single.maps["lrp"][0], maps[i], rtol=1e-6, atol=1e-6)


def test_lrp_runs_once_per_batch_when_lrp_attention_reuses_it(monkeypatch):
    from vision_attn.explain import methods

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return lrp_relevance(*args, **kwargs)

    monkeypatch.setattr(methods, "lrp_relevance", counted)
    task, images = _task(), _images(2)
    both = explain_classifier(task, images, ["lrp", "lrp_attention", "attention"])
    assert len(calls) == 1
    alone = explain_classifier(task, images, ["lrp_attention", "attention"], target=both.target)
    assert len(calls) == 2  # a new batch: computed again
    torch.testing.assert_close(both.maps["lrp_attention"], alone.maps["lrp_attention"])
    torch.testing.assert_close(both.maps["lrp"], normalize_maps(lrp_relevance(task, images, both.target).maps.float()))


def _state(task):
    hooks = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in task.named_modules()}
    flags = {name: m.fused_attn for name, m in task.named_modules() if hasattr(m, "fused_attn")}
    return hooks, flags, {k: v.clone() for k, v in task.state_dict().items()}


def test_encoder_unchanged_after_lrp_even_when_the_forward_raises():
    task, images = _task(), _images()
    before = task.head(task.encoder(images)).detach()
    hooks, flags, weights = _state(task)
    lrp_relevance(task, images)

    def boom(*_):
        raise RuntimeError("boom")

    handle = task.encoder.model.blocks[1].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        lrp_relevance(task, images)
    handle.remove()
    hooks_after, flags_after, weights_after = _state(task)
    assert hooks_after == hooks and flags_after == flags and any(flags.values())
    assert all(torch.equal(weights[k], weights_after[k]) for k in weights)
    assert torch.equal(task.head(task.encoder(images)), before)


def test_unsupported_attention_is_refused():
    torch.manual_seed(0)
    encoder = create_encoder("vit_tiny_patch16_224", **TINY_VIT, num_classes=3, global_pool="map")
    task = ClassificationTask(encoder, num_classes=3, head=ClassifierConfig(kind="timm")).eval()
    with pytest.raises(ConfigError, match="AttentionPoolLatent"):
        lrp_relevance(task, torch.randn(1, 3, 32, 32))
