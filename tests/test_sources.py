"""Model sources: timm ViTs by name predict exactly as timm does; checkpoints; clear errors.

The reference is timm itself: models created and saved by plain timm code (never through the
suite), run by timm on timm's own evaluation transform of the same decoded image.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import timm.data
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from vision_attn.data.imageio import read_image
from vision_attn.data.transforms import build_eval_transform
from vision_attn.errors import DataError, EncoderError
from vision_attn.tasks.base import load_task
from vision_attn.tasks.sources import load_model, resolve_class_names

IMAGENET = timm.data.ImageNetInfo("imagenet-1k")


def _save_timm_model(path: Path, name: str, **kwargs) -> tuple[torch.nn.Module, Path]:
    """A timm model made and saved by plain timm code: seeded init, classifier weights spread
    out (so that top-5 is well separated), ``save_file(model.state_dict())``."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    for key, param in model.named_parameters():
        if key.startswith("head") and key.endswith("weight"):
            torch.nn.init.normal_(param, std=0.5)
    file = path / f"{name}.safetensors"
    save_file(model.state_dict(), str(file))
    return model, file


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("timm_weights")


@pytest.fixture(scope="module")
def vit_tiny(weights_dir) -> tuple[torch.nn.Module, Path]:
    """vit_tiny_patch16_224 made and saved by timm, shared by the tests of this module."""
    return _save_timm_model(weights_dir, "vit_tiny_patch16_224")


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, np.ndarray]:
    """Decoded RGB images (the suite's decoder): two photographs, grey, RGBA, odd-sized."""
    from sklearn.datasets import load_sample_images

    root = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(0)
    files = {Path(f).stem: Path(f) for f in load_sample_images().filenames}  # china, flower (427 x 640)
    grey = (np.add.outer(np.arange(131), np.arange(97)) % 256).astype(np.uint8)
    Image.fromarray(grey, "L").save(root / "grey.png")
    rgba = rng.integers(0, 256, (150, 211, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(root / "rgba.png")
    Image.fromarray(rng.integers(0, 256, (33, 517, 3), dtype=np.uint8)).save(root / "odd.png")
    files.update(grey=root / "grey.png", rgba=root / "rgba.png", odd=root / "odd.png")
    return {name: read_image(f) for name, f in files.items()}


def _assert_matches_timm(task, model, images: list[np.ndarray], data_config: dict | None = None) -> None:
    """The task's preprocessing, top-5 and probabilities equal timm's on the same decoded images."""
    cfg = data_config or timm.data.resolve_data_config({}, model=model)
    reference = timm.data.create_transform(**cfg)
    x_ref = torch.stack([reference(Image.fromarray(img)) for img in images])
    ours = build_eval_transform(task.data_config)
    x = torch.stack([ours(img) for img in images])
    assert x.shape == x_ref.shape
    assert (x - x_ref).abs().max() < 1e-6
    with torch.no_grad():
        probs_ref = model(x_ref).softmax(-1)
        (logits,) = task.export_forward(x)
    probs = logits.softmax(-1)
    assert (probs - probs_ref).abs().max() < 1e-4
    records = task.predictions_from_outputs((logits,), [img.shape[:2] for img in images], SimpleNamespace(topk=5))
    top_ref = probs_ref.topk(5, dim=-1)
    for record, scores, classes in zip(records, top_ref.values, top_ref.indices, strict=True):
        assert [t["label"] for t in record["topk"]] == [task.class_names[int(c)] for c in classes]
        assert np.allclose([t["score"] for t in record["topk"]], scores.numpy(), atol=1e-4)
        assert record["pred"] == record["topk"][0]["label"] and record["score"] == record["topk"][0]["score"]


def test_timm_vit_by_name_predicts_as_timm(vit_tiny, pictures):
    model, file = vit_tiny
    task = load_model("timm:vit_tiny_patch16_224", weights_file=file)
    assert task.data_config["crop_pct"] == 0.9 and task.data_config["crop_mode"] == "center"
    assert task.class_names[0] == IMAGENET.index_to_description(0) == "tench, Tinca tinca"
    assert len(task.class_names) == 1000 and task.head.pooling == "token" and not task.head.distilled
    _assert_matches_timm(task, model, [pictures[k] for k in ("china", "flower", "grey", "rgba", "odd")])


def test_distilled_deit_and_register_model_predict_as_timm(weights_dir, pictures):
    for name, pooling, prefix in (("deit_tiny_distilled_patch16_224", "token", 2),
                                  ("vit_dwee_patch16_reg1_gap_256", "avg", 1)):
        model, file = _save_timm_model(weights_dir, name)
        task = load_model(f"timm:{name}", weights_file=file)
        assert task.head.pooling == pooling and task.encoder.num_prefix_tokens == prefix
        assert task.head.distilled == name.startswith("deit")
        _assert_matches_timm(task, model, [pictures["flower"], pictures["grey"]])


def test_non_square_input_with_dynamic_image_size(weights_dir, pictures):
    model, file = _save_timm_model(weights_dir, "vit_tiny_patch16_224", dynamic_img_size=True)
    task = load_model("timm:vit_tiny_patch16_224", weights_file=file)
    wide = {**task.data_config, "input_size": (3, 160, 224)}
    task.encoder.data_config = wide
    cfg = {**timm.data.resolve_data_config({}, model=model), "input_size": (3, 160, 224)}
    _assert_matches_timm(task, model, [pictures["china"], pictures["odd"]], cfg)


def test_topk_records_are_sorted_and_capped():
    from vision_attn import create_encoder
    from vision_attn.tasks.classification import ClassificationTask

    from .conftest import TINY_VIT

    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"])
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    (record,) = task.predictions_from_outputs((logits,), [(4, 4)], SimpleNamespace(topk=10))
    assert [t["label"] for t in record["topk"]] == ["b", "c", "a"]  # at most C, top-1 first
    assert record["pred"] == "b" and record["score"] == pytest.approx(float(logits.softmax(-1)[0, 1]))
    (default,) = task.predictions_from_outputs((logits,), [(4, 4)])
    assert len(default["topk"]) == 3
    (one,) = task.predictions_from_outputs((logits,), [(4, 4)], SimpleNamespace(topk=1))
    assert one["topk"] == [{"label": "b", "score": one["score"]}]


def test_timm_task_checkpoint_rebuilds_with_load_task(vit_tiny, tmp_path, pictures):
    _, file = vit_tiny
    task = load_model("timm:vit_tiny_patch16_224", weights_file=file)
    ckpt = tmp_path / "timm.ckpt"
    torch.save({"state_dict": task.state_dict(), "vision_attn": task.checkpoint_meta()}, ckpt)
    again = load_task(ckpt)
    assert isinstance(load_model(str(ckpt)).head, type(again.head))
    assert again.hparams["head"]["kind"] == "timm" and type(again.head).__name__ == "TimmHead"
    assert again.data_config == task.data_config and again.class_names == task.class_names
    x = build_eval_transform(task.data_config)(pictures["odd"])[None]
    with torch.no_grad():
        assert torch.equal(again(x), task(x))
    assert not any(k.startswith("head.") for k in task.state_dict())  # the weights live in the encoder once


def test_class_names_from_a_file_for_another_head(tmp_path):
    _, file = _save_timm_model(tmp_path, "vit_tiny_patch16_224", num_classes=3)
    names = tmp_path / "names.txt"
    names.write_text("cat\ndog\n\nbird\n")
    task = load_model("timm:vit_tiny_patch16_224", weights_file=file, class_names=names)
    assert task.class_names == ["cat", "dog", "bird"] and task.head.num_classes == 3
    with pytest.raises(EncoderError, match=r"3 outputs.*--class_names FILE"):
        load_model("timm:vit_tiny_patch16_224", weights_file=file)
    with pytest.raises(EncoderError, match=r"names.txt has 2 class names .* 3 outputs; give exactly 3"):
        names.write_text("cat\ndog\n")
        load_model("timm:vit_tiny_patch16_224", weights_file=file, class_names=names)
    with pytest.raises(DataError, match="missing.txt does not exist"):
        load_model("timm:vit_tiny_patch16_224", weights_file=file, class_names=tmp_path / "missing.txt")


def test_a_class_names_file_is_bounded_before_it_sizes_any_output(tmp_path, monkeypatch):
    """Names go into every prediction and the report: a file of a few megabytes of one name, more
    names than the class limit, or a file larger than any allowed list is refused, naming it."""
    names = tmp_path / "names.txt"
    names.write_text("cat\n" + "x" * 2_000_000 + "\ndog\n")
    with pytest.raises(DataError, match=r"names.txt: name 2 is longer than 1000 characters"):
        resolve_class_names(3, names)
    monkeypatch.setenv("VISION_ATTN_MAX_NUM_CLASSES", "2")
    names.write_text("cat\ndog\nbird\n")
    with pytest.raises(DataError, match=r"names.txt gives 3 names, over the limit of 2"):
        resolve_class_names(3, names)
    names.write_text("cat\n" * 1000)
    with pytest.raises(DataError, match=r"names.txt is larger than 2 names of 1000 characters could be"):
        resolve_class_names(3, names)
    monkeypatch.delenv("VISION_ATTN_MAX_NUM_CLASSES")
    names.write_text("cat\n\ndog\n  bird  \n")
    assert resolve_class_names(3, names) == ["cat", "dog", "bird"]


def test_imagenet_heads_are_named_offline():
    assert resolve_class_names(1000)[1] == IMAGENET.index_to_description(1)
    in21k = resolve_class_names(21843)
    assert len(in21k) == 21843 and in21k[1] == timm.data.ImageNetInfo("imagenet-21k-goog").index_to_description(1)
    with pytest.raises(EncoderError, match="1000 outputs"):
        resolve_class_names(1000, ["a", "b"])
    with pytest.raises(EncoderError, match="7 outputs, not the size of an ImageNet head"):
        resolve_class_names(7)


def test_bad_sources_are_clear_errors(vit_tiny, tmp_path):
    with pytest.raises(EncoderError,
                       match=r"unknown timm model name 'vit_tiny_patch16_2244'.*Did you mean: vit_tiny_patch16_224"):
        load_model("timm:vit_tiny_patch16_2244")
    with pytest.raises(EncoderError, match=r"'resnet18' is not a Vision Transformer"):
        load_model("timm:resnet18")
    with pytest.raises(EncoderError, match=r"no pretrained tag 'nope'.*augreg_in21k_ft_in1k"):
        load_model("timm:vit_tiny_patch16_224.nope")
    with pytest.raises(EncoderError, match="weights_file applies to timm models"):
        load_model(str(tmp_path / "run.ckpt"), weights_file=tmp_path / "w.safetensors")
    state = {k: v for k, v in load_file(str(vit_tiny[1])).items() if not k.startswith("head.")}
    save_file(state, str(tmp_path / "backbone.safetensors"))
    backbone = load_model("timm:vit_tiny_patch16_224", weights_file=tmp_path / "backbone.safetensors")
    assert backbone.task_name == "embedding"  # no classifier: an embedding model (tests/test_headless.py)


def test_offline_without_weights_file_says_to_pass_it(monkeypatch):
    import timm.models._builder as builder

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load this file.")

    for fn in ("download_cached_file", "load_state_dict_from_url", "load_state_dict_from_hf"):
        monkeypatch.setattr(builder, fn, offline)
    with pytest.raises(EncoderError) as err:
        load_model("timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    message = str(err.value)
    assert "\n" not in message and "--weights_file FILE" in message and "timm:vit_tiny_patch16_224" in message
