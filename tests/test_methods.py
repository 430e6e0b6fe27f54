"""The registry of explanation methods, Grad-CAM, token norms, target class / token choice,
register and distillation tokens, and the ``explain_images`` API — against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vision_attn import capture_attention, create_encoder
from vision_attn.errors import ConfigError
from vision_attn.explain.methods import METHODS, explain_classifier, faithfulness, register_method
from vision_attn.explain.rollout import _discard_lowest, normalize_maps
from vision_attn.models.classifier import ClassifierConfig
from vision_attn.tasks import ClassificationTask

from .conftest import TINY_VIT

NAMES = ["cat", "dog", "fox"]


def _task(name: str = "vit_tiny_patch16_224", pooling: str = "auto", **kw) -> ClassificationTask:
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder(name, **{**TINY_VIT, **kw}), class_names=NAMES,
                              head=ClassifierConfig(pooling=pooling))
    nn.init.normal_(task.head.fc.weight, std=1.0)  # class-specific gradients that differ clearly
    return task.eval()


class _DistilledHead(nn.Module):
    """What a timm DeiT head does (the TimmHead of timm models): timm's own ``forward_head``,
    which averages the class-token and distillation-token classifiers."""

    global_pool = "token"
    distilled = True

    def __init__(self, encoder) -> None:
        super().__init__()
        self.encoder = [encoder]  # not a sub-module (no second registration)

    def forward(self, out):
        return self.encoder[0].forward_head(out)


class _Classifier(nn.Module):
    def __init__(self, encoder, head) -> None:
        super().__init__()
        self.encoder, self.head, self.class_names = encoder, head, NAMES

    def forward(self, x):
        return self.head(self.encoder(x))


def _distilled_task() -> _Classifier:
    torch.manual_seed(0)
    encoder = create_encoder("deit_tiny_distilled_patch16_224", **TINY_VIT, num_classes=3)
    return _Classifier(encoder, _DistilledHead(encoder)).eval()


def _block_output(task, x):
    """The last block's output, by a hook written here, and the logits."""
    seen = []
    handle = task.encoder.model.blocks[-1].register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        logits = task.head(task.encoder(x))
    finally:
        handle.remove()
    return seen[0], logits


# ---------------------------------------------------------------------------- Grad-CAM and tokens
@pytest.mark.parametrize("name,kw", [("vit_tiny_patch16_224", {}),
                                     ("vit_little_patch16_reg4_gap_256", {"class_token": True})])
def test_gradcam_equals_a_hand_written_gradcam(name, kw):
    task = _task(name, **kw)
    p = task.encoder.num_prefix_tokens
    assert p == (1 if not kw else 5)  # class token (+ 4 registers)
    x = torch.randn(2, 3, 32, 32)
    expl = explain_classifier(task, x, ("gradcam",), target_class="dog")
    # by hand, pytorch-grad-cam's ViT recipe: target layer blocks[-1].norm1, backpropagate the
    # target logit, weight each channel by its gradient averaged over the patch tokens
    seen = []
    handle = task.encoder.model.blocks[-1].norm1.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        logits = task(x)
    finally:
        handle.remove()
    acts = seen[0]
    acts.retain_grad()
    logits[:, 1].sum().backward()
    a, g = acts[:, p:].detach(), acts.grad[:, p:]  # (B, 16, D): patch tokens only
    cam = torch.relu((a * g.mean(dim=1, keepdim=True)).sum(-1)).reshape(2, 4, 4)
    cam = cam / cam.amax(dim=(1, 2), keepdim=True)
    assert cam.amax() > 0 and (cam == 0).any()  # a real map: some cells clipped by the ReLU
    assert expl.maps["gradcam"].shape == (2, 4, 4)
    assert torch.allclose(expl.maps["gradcam"], cam, atol=1e-5)


def test_tokens_are_the_norms_of_the_last_blocks_patch_tokens():
    task = _task("vit_little_patch16_reg4_gap_256")
    x = torch.randn(3, 3, 32, 32)
    expl = explain_classifier(task, x, ("tokens", "rollout"))
    with torch.no_grad():
        acts, _ = _block_output(task, x)
    norms = acts[:, 4:].norm(dim=-1).reshape(3, 4, 4)  # the 4 register tokens are not patches
    assert torch.allclose(expl.maps["tokens"], norms / norms.amax(dim=(1, 2), keepdim=True), atol=1e-6)
    # a diagnostic: no deletion / insertion numbers for it
    assert set(faithfulness(task, x, expl, steps=2)) == {"rollout"}


# ---------------------------------------------------------------------------- the registry
def test_a_method_registered_elsewhere_is_accepted_everywhere():
    from vision_attn.explain.evaluate import ExplainOptions

    with pytest.raises(ConfigError, match="choose one or more of rollout, relevance, attention, gradcam"):
        ExplainOptions(methods=["edges"])

    @register_method("edges", needs=("block_output",))
    def edges(inputs):
        return inputs.block_output[:, inputs.num_prefix_tokens :, 0].exp().view(-1, *inputs.grid)

    try:
        assert ExplainOptions(methods=["edges", "rollout"]).methods == ["edges", "rollout"]
        task = _task()
        x = torch.randn(2, 3, 32, 32)
        expl = explain_classifier(task, x, ("edges", "random"))
        assert list(expl.maps) == ["edges", "random"]
        with torch.no_grad():
            acts, _ = _block_output(task, x)
        assert torch.allclose(expl.maps["edges"], normalize_maps(acts[:, 1:, 0].exp().view(2, 4, 4)))
        assert set(faithfulness(task, x, expl, steps=2)) == {"edges", "random"}
    finally:
        METHODS.pop("edges")
    with pytest.raises(ConfigError, match=r"unknown \['edges'\]"):
        explain_classifier(_task(), torch.randn(1, 3, 32, 32), ("edges",))


# ---------------------------------------------------------------------------- target class
def test_target_class_by_name_or_index_changes_the_class_specific_maps():
    task = _task()
    x = torch.randn(2, 3, 32, 32)
    pred = explain_classifier(task, x, ("relevance", "gradcam", "rollout"))
    other = int((pred.target[0] + 1) % 3)
    by_name = explain_classifier(task, x, ("relevance", "gradcam", "rollout"), target_class=NAMES[other])
    by_index = explain_classifier(task, x, ("relevance", "gradcam", "rollout"), target_class=other)
    by_digits = explain_classifier(task, x, ("relevance",), target_class=str(other))  # the CLI's form
    per_image = explain_classifier(task, x, ("relevance",), target=torch.tensor([other, other]))
    assert by_name.target.tolist() == [other, other]
    for m in ("relevance", "gradcam"):
        assert torch.equal(by_name.maps[m], by_index.maps[m])
        assert not torch.allclose(by_name.maps[m][0], pred.maps[m][0], atol=1e-3), m
    assert torch.equal(by_digits.maps["relevance"], by_name.maps["relevance"])
    assert torch.equal(per_image.maps["relevance"], by_name.maps["relevance"])
    assert torch.equal(by_name.maps["rollout"], pred.maps["rollout"])  # rollout is not class specific
    with pytest.raises(ConfigError, match="'dgo' is not a class name.*Did you mean: 'dog'"):
        explain_classifier(task, x, ("relevance",), target_class="dgo")
    with pytest.raises(ConfigError, match="not a class index 0..2"):
        explain_classifier(task, x, ("relevance",), target_class=3)


# ---------------------------------------------------------------------------- distillation token
def _rows(task, x, methods):
    """Unnormalised rollout / relevance / last-layer attention matrices ``[B, T, T]`` by hand."""
    with capture_attention(task.encoder, keep_grad=True) as attn:
        logits = task.head(task.encoder(x))
    logits.gather(1, logits.argmax(1, keepdim=True)).sum().backward()
    t = attn[0].shape[-1]
    eye = torch.eye(t)
    roll, rel = eye.repeat(x.shape[0], 1, 1), eye.repeat(x.shape[0], 1, 1)
    for a in attn:
        f = a.detach().mean(1) + eye
        roll = (f / f.sum(-1, keepdim=True)) @ roll
        rel = rel + (a.grad * a.detach()).clamp(min=0).mean(1) @ rel
    return {"rollout": roll, "relevance": rel, "attention": attn[-1].detach().mean(1)}


def test_distilled_deit_cls_dist_mean_rows():
    task = _distilled_task()
    assert task.encoder.num_prefix_tokens == 2
    x = torch.randn(2, 3, 32, 32)
    methods = ("rollout", "relevance", "attention")
    maps = {tok: explain_classifier(task, x, methods, token=tok) for tok in ("auto", "cls", "dist", "mean")}
    assert maps["auto"].token_index == (0, 1) and maps["dist"].token_index == 1
    full = _rows(task, x, methods)
    for m in methods:
        mean_rows = (full[m][:, 0, 2:] + full[m][:, 1, 2:]) / 2  # average of the two rows, then scaled
        assert torch.allclose(maps["mean"].maps[m], normalize_maps(mean_rows.reshape(2, 4, 4)), atol=1e-5), m
        assert torch.allclose(maps["dist"].maps[m], normalize_maps(full[m][:, 1, 2:].reshape(2, 4, 4)), atol=1e-5)
        assert torch.equal(maps["auto"].maps[m], maps["mean"].maps[m])  # what the head reads
        assert not torch.allclose(maps["dist"].maps[m], maps["cls"].maps[m], atol=1e-3), m
        assert not torch.allclose(maps["mean"].maps[m], maps["cls"].maps[m], atol=1e-4), m
    with pytest.raises(ConfigError, match="token='dist' needs a distilled model"):
        explain_classifier(_task(), x, ("rollout",), token="dist")
    with pytest.raises(ConfigError, match="no class token"):
        explain_classifier(_task("vit_little_patch16_reg4_gap_256"), x, ("rollout",), token="cls")


# ---------------------------------------------------------------------------- register tokens
def test_rollout_discard_never_touches_register_and_class_token_columns():
    task = _task("vit_little_patch16_reg4_gap_256", class_token=True)
    p = task.encoder.num_prefix_tokens
    assert p == 5
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), capture_attention(task.encoder) as attn:
        out = task.encoder(x)
    fused = attn[0].mean(1)  # (B, T, T), T = 5 + 16
    kept = _discard_lowest(fused, 0.9, p)
    assert torch.equal(kept[:, :, :p], fused[:, :, :p])  # attention to class and register tokens kept
    assert (kept[:, :, p:] == 0).float().mean() > 0.85  # ... while 90% of the rest is gone
    expl = explain_classifier(task, x, ("rollout", "attention"), discard_ratio=0.9)
    assert expl.num_prefix_tokens == 5 and out.grid == (4, 4)
    assert all(m.shape == (2, 4, 4) and torch.isfinite(m).all() for m in expl.maps.values())  # patches only


# ---------------------------------------------------------------------------- explain_images
def test_explain_images_upsamples_the_maps_of_explain_classifier():
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.api import explain_images

    task = _task()
    x = torch.randn(3, 3, 32, 32)
    for method in ("relevance", "gradcam", "rollout"):
        maps = explain_images(task, x, method=method, batch_size=2)
        assert maps.shape == (3, 32, 32) and maps.dtype == torch.float32
        assert maps.min() >= 0 and torch.allclose(maps.amax(dim=(1, 2)), torch.ones(3))
        grid = explain_classifier(task, x, (method,)).maps[method]
        up = F.interpolate(grid[:, None], size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
        assert torch.allclose(maps, normalize_maps(up), atol=1e-5), method
    assert torch.equal(explain_images(task, x, target="fox"), explain_images(task, x, target=[2, 2, 2]))
    others = [(int(t) + 1) % 3 for t in explain_classifier(task, x).target]  # never the prediction
    assert not torch.allclose(explain_images(task, x, target=others), explain_images(task, x), atol=1e-3)
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (40, 30, 3), dtype=np.uint8) for _ in range(2)]
    tf = build_eval_transform(task.inference_data_config())
    from_arrays = explain_images(task, pictures, method="attention")
    assert torch.allclose(from_arrays, explain_images(task, torch.stack([tf(p) for p in pictures]), method="attention"))
    task.train()
    explain_images(task, x[:1])
    assert task.training  # the mode is restored
    with pytest.raises(ConfigError, match="explains classifiers"):
        explain_images(nn.Linear(2, 2), x)


# ---------------------------------------------------------------------------- options
def test_explain_options_target_class_and_token_reach_the_panels():
    from vision_attn.explain.evaluate import ExplainOptions

    with pytest.raises(ConfigError, match="explain.token 'distil' invalid"):
        ExplainOptions(token="distil")
    with pytest.raises(ConfigError, match="topk"):
        ExplainOptions(topk=0)
    assert ExplainOptions().topk == 5 and ExplainOptions(methods=["random", "tokens"]).methods == ["random", "tokens"]
    task = _task()
    x = torch.randn(2, 3, 32, 32)
    pictures = [np.zeros((32, 32, 3), np.uint8)] * 2
    options = ExplainOptions(methods=["relevance", "tokens"], target_class="fox", num_overlays=2, faithfulness=False)
    explained = task.explain_batch(x, pictures, options)
    expl = explained[0].extras["explanation"]
    assert expl.target.tolist() == [2, 2]
    assert torch.equal(expl.maps["relevance"], explain_classifier(task, x, ("relevance",), target_class=2).maps[
        "relevance"])


def test_a_class_name_given_twice_asks_for_the_index():
    from vision_attn.errors import ConfigError
    from vision_attn.explain.methods import resolve_target_class

    names = ["heron", "crane", "truck", "crane"]  # as ImageNet-1k: 134 (bird) and 517 (machine)
    with pytest.raises(ConfigError, match=r"several classes.*\[1, 3\].*index"):
        resolve_target_class("crane", names, 4)
    assert resolve_target_class("3", names, 4) == 3 and resolve_target_class("truck", names, 4) == 2


def test_auto_pooling_of_a_register_model_without_class_token_is_the_mean():
    from vision_attn import create_encoder
    from vision_attn.explain.methods import explained_token
    from vision_attn.tasks import ClassificationTask

    enc = create_encoder("vit_little_patch16_reg4_gap_256", img_size=32, patch_size=8, embed_dim=32, depth=1,
                         num_heads=2)
    assert enc.num_prefix_tokens == 4 and getattr(enc.model, "cls_token", None) is None
    task = ClassificationTask(enc, num_classes=3)
    assert task.head.pooling == "mean" and explained_token(task.head, enc.num_prefix_tokens) == "patches"


def test_grid_maps_reach_pixels_through_the_padded_patch_grid():
    from types import SimpleNamespace

    from vision_attn.explain.api import grid_to_pixels

    model = SimpleNamespace(encoder=SimpleNamespace(patch_size=(8, 8)))
    grid = torch.tensor([[1.0, 0.0], [0.0, 0.0]])[None, None]  # a 12 x 12 image padded to 16 x 16: two 8-px cells
    pixels = grid_to_pixels(grid, (12, 12), model)[0, 0]
    assert pixels.shape == (12, 12)
    # cell centres lie at 4 and 12 (8 px apart); pixel row 8 (centre 8.5) is 4.5 / 8 of the way from the
    # first to the second: 1 - 0.5625. A grid stretched over the unpadded 12 px puts the centres at 3
    # and 9 (6 px apart): 1 - 5.5 / 6 there
    assert pixels[8, 2].item() == pytest.approx(0.4375)
    assert pixels[2, 2].item() == pytest.approx(1.0)
    stretched = grid_to_pixels(grid, (12, 12), SimpleNamespace())[0, 0]  # without a patch size: stretched
    assert stretched[8, 2].item() == pytest.approx(1 / 12, abs=1e-6)


def test_an_attention_pooling_head_is_explained_through_its_pools_attention():
    # timm's attention pooling ('map'): the row the methods follow is the pool's attention over the
    # tokens (per image), so every method runs but AttnLRP, which has no rule for the pool.
    from vision_attn.explain.api import explain_images
    from vision_attn.explain.methods import applicable_methods
    from vision_attn.models.classifier import attention_pool_weights

    torch.manual_seed(0)
    encoder = create_encoder("vit_tiny_patch16_224", **TINY_VIT, num_classes=3, global_pool="map")
    task = ClassificationTask(encoder, num_classes=3, head=ClassifierConfig(kind="timm")).eval()
    images = torch.randn(2, 3, 32, 32)
    reasons = applicable_methods(task)
    assert [m for m, r in reasons.items() if r is not None] == ["lrp", "lrp_attention"]
    expl = explain_classifier(task, images, ("rollout", "attention", "relevance", "gradcam"))
    with torch.no_grad():
        weights = attention_pool_weights(encoder.model, encoder(images).tokens)
    torch.testing.assert_close(expl.token_index, weights)  # the pool's attention is the explained row
    assert all(m.shape == (2, 4, 4) and torch.isfinite(m).all() for m in expl.maps.values())
    with pytest.raises(ConfigError, match=r"method 'lrp' does not apply to this model.*AttentionPoolLatent"):
        explain_images(task, images, method="lrp")
    assert explain_images(task, images, method="relevance").shape == (2, 32, 32)
