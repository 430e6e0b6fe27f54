"""timm models without a classifier, loaded by name as embedding models.

Tiny random-weight models of the headless kinds are registered with timm here (a DINOv2-like one
with registers and layer scale, a CLIP-like image tower with a pre-norm and no head, and a
CLIP-like tower with a projection instead of classes), made and saved by plain timm and loaded
with ``timm:NAME`` and a weights file. Then: the embedding is timm's own; ``predict`` writes the
embeddings and the overlays of every method that applies; a target image changes what the
gradient methods explain; a bad target vector is one line and exit status 2.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import _cfg, _create_vision_transformer
from torch import nn

import vision_attn
from vision_attn.commands.predict import main
from vision_attn.explain.api import explain_images
from vision_attn.explain.methods import applicable_methods
from vision_attn.tasks import EmbeddingOptions, EmbeddingTask

SIZE = 56
TINY = dict(img_size=SIZE, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
METHODS = ["rollout", "attention", "relevance", "gradcam", "lrp", "tokens"]


def _pretrained(num_classes: int = 0) -> dict:
    return _cfg(url="", num_classes=num_classes, input_size=(3, SIZE, SIZE), crop_pct=1.0,
                mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


default_cfgs = generate_default_cfgs({
    "headless_tiny_reg4_dinov2.test": _pretrained(),
    "headless_tiny_clip.test": _pretrained(),
    "headless_tiny_clip_proj.test": _pretrained(16),
    "headless_tiny_siglip.test": _pretrained(),
})


@register_model
def headless_tiny_reg4_dinov2(pretrained: bool = False, **kwargs):
    """DINOv2-like: patch 14, four registers, layer scale, no classifier."""
    args = dict(TINY, patch_size=14, init_values=1e-5, reg_tokens=4, no_embed_class=True, num_classes=0)
    return _create_vision_transformer("headless_tiny_reg4_dinov2", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def headless_tiny_clip(pretrained: bool = False, **kwargs):
    """CLIP-like image tower: pre-norm, class token pooling, no head."""
    args = dict(TINY, patch_size=8, pre_norm=True, norm_layer=partial(nn.LayerNorm, eps=1e-5), num_classes=0)
    return _create_vision_transformer("headless_tiny_clip", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def headless_tiny_clip_proj(pretrained: bool = False, **kwargs):
    """CLIP-like image tower with a 16-wide projection instead of classes."""
    args = dict(TINY, patch_size=8, pre_norm=True, norm_layer=partial(nn.LayerNorm, eps=1e-5), num_classes=16)
    return _create_vision_transformer("headless_tiny_clip_proj", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def headless_tiny_siglip(pretrained: bool = False, **kwargs):
    """SigLIP-like image tower: no class token, attention pooling ('map'), no head."""
    args = dict(TINY, patch_size=8, class_token=False, global_pool="map", num_classes=0)
    return _create_vision_transformer("headless_tiny_siglip", pretrained=pretrained, **dict(args, **kwargs))


NAMES = ["headless_tiny_reg4_dinov2", "headless_tiny_clip"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[nn.Module, Path]]:
    """Each model made by plain timm with every parameter drawn at random, saved with safetensors."""
    root = tmp_path_factory.mktemp("headless")
    out = {}
    for name in [*NAMES, "headless_tiny_clip_proj", "headless_tiny_siglip"]:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.3)
        file = root / f"{name}.safetensors"
        save_file(model.state_dict(), str(file))
        out[name] = (model, file)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("headless_images")
    rng = np.random.default_rng(0)
    for i, size in enumerate([(SIZE, SIZE), (70, 90), (SIZE, SIZE)]):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / f"{i}.png")
    return root


@pytest.mark.parametrize("name", [*NAMES, "headless_tiny_clip_proj", "headless_tiny_siglip"])
def test_the_embedding_is_timms_own(saved, name):
    model, file = saved[name]
    task = vision_attn.load_model(f"timm:{name}", weights_file=file)
    assert isinstance(task, EmbeddingTask) and task.task_name == "embedding"
    x = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        projected = name.endswith("_proj")  # the projection is the embedding; else the pooled features
        expected = model.forward_head(model.forward_features(x), pre_logits=not projected)
        (ours,) = task.export_forward(x)
    assert ours.shape == expected.shape == (3, 16 if projected else 32)
    assert (ours - expected).abs().max() < 1e-5
    records = task.predictions_from_outputs((ours,), [])
    assert set(records[0]) == {"embedding_norm", "embedding"}
    assert records[0]["embedding_norm"] == pytest.approx(float(expected[0].norm()), abs=1e-4)
    assert np.allclose(records[0]["embedding"], expected[0].numpy(), atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_predict_writes_embeddings_and_an_overlay_with_every_method(saved, images, tmp_path, name):
    _, file = saved[name]
    task = vision_attn.load_model(f"timm:{name}", weights_file=file)
    assert all(reason is None for reason in applicable_methods(task, METHODS).values())
    out = tmp_path / "out"
    main(["--model", f"timm:{name}", "--weights_file", str(file), "--images", str(images), "--output_dir", str(out),
          "--methods", *METHODS, "--num_workers", "0", "--device", "cpu", "--batch_size", "2"])
    records = json.loads((out / "predictions.json").read_text())
    assert [r["file"] for r in records] == ["0.png", "1.png", "2.png"]
    for record in records:
        assert set(record) == {"file", "embedding_norm", "embedding"} and len(record["embedding"]) == 32
        assert record["embedding_norm"] == pytest.approx(float(np.linalg.norm(record["embedding"])), abs=1e-3)
    overlays = sorted(p.name for p in (out / "overlays").glob("*.png"))
    assert overlays == ["0.png.png", "1.png.png", "2.png.png"]
    page = (out / "report.html").read_text()  # every patch's attention row, per layer and head
    assert page.count('"kind": "patches"') == 3 and '"heads": 2' in page and '"layers": 2' in page
    # the panel holds the input and one overlay per method: wider than the input alone by the methods
    width = Image.open(out / "overlays" / "0.png.png").size[0]
    single = tmp_path / "one"
    main(["--model", f"timm:{name}", "--weights_file", str(file), "--images", str(images / "0.png"),
          "--output_dir", str(single), "--methods", "rollout", "--num_workers", "0", "--device", "cpu"])
    assert width > 2 * Image.open(single / "overlays" / "0.png.png").size[0]


def test_a_target_image_changes_what_relevance_explains(saved, images, tmp_path):
    name = "headless_tiny_reg4_dinov2"
    task = vision_attn.load_model(f"timm:{name}", weights_file=saved[name][1])
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    by_norm = explain_images(task, x, method="relevance")
    task.set_inference_options(EmbeddingOptions(target_image=str(images / "1.png")))
    by_cosine = explain_images(task, x, method="relevance")
    assert by_norm.shape == by_cosine.shape == (2, SIZE, SIZE)
    assert (by_norm - by_cosine).abs().max() > 1e-3
    # on the command line: the cosine of each image's embedding with the target image's, 1 for itself
    out = tmp_path / "out"
    main(["--model", f"timm:{name}", "--weights_file", str(saved[name][1]), "--images", str(images),
          "--output_dir", str(out), "--target_image", str(images / "1.png"), "--methods", "relevance",
          "--num_workers", "0", "--device", "cpu"])
    records = {r["file"]: r for r in json.loads((out / "predictions.json").read_text())}
    assert records["1.png"]["similarity"] == pytest.approx(1.0, abs=1e-4)
    assert all(-1.0 <= r["similarity"] <= 1.0 for r in records.values())


def test_a_target_embedding_from_a_file(saved, images, tmp_path):
    name = "headless_tiny_clip"
    file = saved[name][1]
    vector = tmp_path / "text.npy"
    np.save(vector, np.linspace(-1.0, 1.0, 32).astype(np.float32))
    out = tmp_path / "out"
    main(["--model", f"timm:{name}", "--weights_file", str(file), "--images", str(images / "0.png"),
          "--output_dir", str(out), "--target_embedding", str(vector), "--no_overlays", "--num_workers", "0",
          "--device", "cpu"])
    (record,) = json.loads((out / "predictions.json").read_text())
    expected = np.dot(record["embedding"], np.linspace(-1, 1, 32)) / (
        np.linalg.norm(record["embedding"]) * np.linalg.norm(np.linspace(-1, 1, 32)))
    assert record["similarity"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("content", ["1 2 3", "not numbers", None])
def test_a_bad_target_embedding_is_one_line_and_status_2(saved, images, tmp_path, capsys, content):
    name = "headless_tiny_clip"
    bad = tmp_path / ("vector.txt" if content is not None else "vector.csv")
    bad.write_text(content or "1,2")
    with pytest.raises(SystemExit) as err:
        main(["--model", f"timm:{name}", "--weights_file", str(saved[name][1]), "--images", str(images),
              "--output_dir", str(tmp_path / "out"), "--target_embedding", str(bad), "--num_workers", "0",
              "--device", "cpu"])
    assert err.value.code == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and str(bad) in message and message.startswith("error: --target_embedding")


def test_class_names_for_a_model_without_a_classifier_are_refused(saved):
    name = "headless_tiny_clip"
    with pytest.raises(vision_attn.errors.EncoderError, match="has no classifier"):
        vision_attn.load_model(f"timm:{name}", weights_file=saved[name][1], class_names=["a", "b"])


def test_an_attention_pooled_tower_is_explained_through_its_pools_attention(saved, images, tmp_path, caplog):
    """SigLIP-like: no class token, attention pooling. The attention methods follow the pool's
    attention over the tokens; AttnLRP has no rule for the pool and is skipped with a warning."""
    from vision_attn.models.classifier import attention_pool_weights

    name = "headless_tiny_siglip"
    model, file = saved[name]
    task = vision_attn.load_model(f"timm:{name}", weights_file=file)
    assert [m for m, r in applicable_methods(task, METHODS).items() if r] == ["lrp"]
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        weights = attention_pool_weights(model, model.forward_features(x))
    from vision_attn.explain.methods import explain_classifier

    raw = explain_classifier(task.eval(), x, ("attention",)).maps["attention"]  # the last block's rows, pool-mixed
    last = [m for m in model.modules() if type(m).__name__ == "Attention"][-1]
    captured = {}
    hook = last.register_forward_hook(lambda mod, args, out: captured.setdefault("x", args[0]))
    with torch.no_grad():
        model.forward_features(x)
    hook.remove()
    b, t, c = captured["x"].shape
    qkv = last.qkv(captured["x"]).reshape(b, t, 3, last.num_heads, c // last.num_heads).permute(2, 0, 3, 1, 4)
    attn = ((qkv[0] * last.scale) @ qkv[1].transpose(-2, -1)).softmax(-1).mean(1)  # (B, T, T)
    expected = torch.einsum("bt,btk->bk", weights, attn).reshape(2, SIZE // 8, SIZE // 8)
    expected = expected / expected.flatten(1).amax(1).view(2, 1, 1)
    torch.testing.assert_close(raw, expected, atol=1e-5, rtol=0)
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        main(["--model", f"timm:{name}", "--weights_file", str(file), "--images", str(images), "--output_dir",
              str(out), "--methods", *METHODS, "--num_workers", "0", "--device", "cpu", "--batch_size", "2"])
    assert sorted(p.name for p in (out / "overlays").glob("*.png")) == ["0.png.png", "1.png.png", "2.png.png"]
    assert any("'lrp' does not apply" in r.getMessage() for r in caplog.records)


def test_the_registers_share_of_the_class_tokens_attention_is_shown_apart(saved, images, tmp_path):
    """Register tokens are left out of the patch maps; the overlay's caption says how much of the
    explained row's last-block attention they take, equal to a recomputation from the captured
    attention. A model without registers has no such note."""
    from vision_attn.explain.capture import capture_attention
    from vision_attn.explain.evaluate import ExplainOptions

    name = "headless_tiny_reg4_dinov2"
    _, file = saved[name]
    task = vision_attn.load_model(f"timm:{name}", weights_file=file).eval()
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))
    options = ExplainOptions(methods=["rollout"], report=True)
    explained = task.explain_batch(x, [np.zeros((SIZE, SIZE, 3), np.uint8)] * 2, options)
    with torch.no_grad(), capture_attention(task.encoder) as attn:
        task.encoder(x)
    last = attn[-1].mean(1)  # (B, T, T): 1 class token, 4 registers, then the patches
    shares = last[:, 0, 1:5].sum(1)
    for e, share in zip(explained, shares, strict=True):
        assert e.report_item["text"].endswith(f"| registers {float(share):.0%}")
    clip = vision_attn.load_model("timm:headless_tiny_clip", weights_file=saved["headless_tiny_clip"][1]).eval()
    (item,) = clip.explain_batch(x[:1], [np.zeros((SIZE, SIZE, 3), np.uint8)], options)
    assert "registers" not in item.report_item["text"]


def test_one_heads_map_of_the_class_token(saved, images, tmp_path, capsys):
    """``head<K>``: head K's attention alone (the per-head maps drawn of a class token), from the
    Python API and ``predict --head_fusion``; a head the model does not have is one clear error."""
    from vision_attn.errors import ConfigError
    from vision_attn.explain.capture import capture_attention
    from vision_attn.explain.methods import explain_classifier

    name = "headless_tiny_clip"
    _, file = saved[name]
    task = vision_attn.load_model(f"timm:{name}", weights_file=file).eval()
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), capture_attention(task.encoder) as attn:
        task.encoder(x)
    for k in range(2):
        got = explain_classifier(task, x, ("attention",), head_fusion=f"head{k}").maps["attention"]
        ref = attn[-1][:, k, 0, 1:].reshape(2, SIZE // 8, SIZE // 8)  # the class token's row, head k
        torch.testing.assert_close(got, ref / ref.flatten(1).amax(1).view(2, 1, 1), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match=r"has 2 heads \(head0 \.\. head1\)"):
        explain_classifier(task, x, ("attention",), head_fusion="head2")
    out = tmp_path / "out"
    main(["--model", f"timm:{name}", "--weights_file", str(file), "--images", str(images / "0.png"),
          "--output_dir", str(out), "--methods", "attention", "rollout", "--head_fusion", "head1",
          "--num_workers", "0", "--device", "cpu"])
    assert (out / "overlays" / "0.png.png").is_file()
    with pytest.raises(SystemExit) as stop:
        main(["--model", f"timm:{name}", "--weights_file", str(file), "--images", str(images / "0.png"),
              "--output_dir", str(tmp_path / "bad"), "--head_fusion", "heads", "--device", "cpu"])
    assert stop.value.code == 2 and "head_fusion must be" in capsys.readouterr().err
