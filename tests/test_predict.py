"""python -m vision_attn.predict: every task from a checkpoint (with overlays), classification and
detection from ONNX (the same predictions as the checkpoint)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from vision_attn.errors import CheckpointError, RunExistsError
from vision_attn.predict import main, predict_folder

from .test_export import _checkpoint, _tasks


@pytest.fixture
def folder(tmp_path):
    images = tmp_path / "imgs"
    (images / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((40, 56, 3)) * 255).astype(np.uint8)).save(images / "a.jpg")
    Image.fromarray((rng.random((30, 30)) * 255).astype(np.uint8), "L").save(images / "sub" / "b.png")
    (images / "broken.png").write_bytes(b"not an image")
    return images


@pytest.mark.parametrize("kind", ["classification", "detection", "captioning"])
def test_predict_from_a_checkpoint_writes_predictions_and_overlays(kind, folder, tmp_path):
    ckpt = _checkpoint(_tasks()[kind], tmp_path / "m.ckpt")
    out = tmp_path / "out"
    res = predict_folder(ckpt, folder, out, batch_size=1, score_threshold=0.0, progress=False)
    assert [p["file"] for p in res["predictions"]] == ["a.jpg", "sub/b.png"]
    assert [s["file"] for s in res["skipped"]] == ["broken.png"]
    keys = {"classification": {"file", "pred", "score", "topk"}, "detection": {"file", "detections"},
            "captioning": {"file", "caption"}}[kind]
    assert all(set(p) == keys for p in res["predictions"])
    if kind == "detection":
        det = res["predictions"][0]["detections"]
        assert det and set(det[0]) == {"label", "category_id", "bbox", "score"}
        x, y, w, h = det[0]["bbox"]
        assert 0 <= x <= 56 and 0 <= y <= 40 and w >= 0 and h >= 0  # pixels of the original image
    assert json.loads((out / "predictions.json").read_text()) == res["predictions"]
    assert sorted(str(p.relative_to(out / "overlays")) for p in (out / "overlays").rglob("*.png")) == ["a.jpg.png",
                                                                                                      "sub/b.png.png"]
    page = (out / "report.html").read_text()
    # per image: its panel and, for the interactive view, the picture (the same items as eval.py's report)
    # (large panels are re-encoded as JPEG to keep the page small)
    assert page.count("data:image/png;base64,") + page.count("data:image/jpeg;base64,") == 4
    view = {"classification": "patches", "detection": "boxes", "captioning": "words"}[kind]
    assert page.count(f'"kind": "{view}"') == 2
    with pytest.raises(SystemExit):  # results already there: refused, nothing overwritten
        main(["--model", str(ckpt), "--images", str(folder), "--output_dir", str(out)])


@pytest.mark.parametrize("kind", ["classification", "detection"])
def test_predict_from_onnx_equals_the_checkpoint(kind, folder, tmp_path):
    pytest.importorskip("onnxruntime")
    from vision_attn.export import export_onnx

    ckpt = _checkpoint(_tasks()[kind], tmp_path / "m.ckpt")
    onnx_path = export_onnx(ckpt, tmp_path / "m.onnx")
    a = predict_folder(ckpt, folder, tmp_path / "a", overlays=False, score_threshold=0.0, progress=False)["predictions"]
    b = predict_folder(onnx_path, folder, tmp_path / "b", score_threshold=0.0, progress=False)["predictions"]
    assert not (tmp_path / "b" / "overlays").exists()  # ONNX holds no attention maps
    if kind == "classification":
        assert [p["pred"] for p in a] == [p["pred"] for p in b]
        assert [p["score"] for p in a] == pytest.approx([p["score"] for p in b], abs=1e-4)
    else:
        for pa, pb in zip(a, b, strict=True):
            assert [d["label"] for d in pa["detections"]] == [d["label"] for d in pb["detections"]]
            assert np.allclose([d["bbox"] for d in pa["detections"]], [d["bbox"] for d in pb["detections"]], atol=1e-2)


def test_captioning_onnx_is_refused_clearly(folder, tmp_path):
    pytest.importorskip("onnxruntime")
    from vision_attn.export import export_onnx

    path = export_onnx(_checkpoint(_tasks()["captioning"], tmp_path / "m.ckpt"), tmp_path / "m.onnx")
    with pytest.raises(CheckpointError, match="captioning model whose predictions need PyTorch"):
        predict_folder(path, folder, tmp_path / "out", progress=False)


@pytest.fixture(scope="module")
def classifier_ckpt(tmp_path_factory):
    return _checkpoint(_tasks()["classification"], tmp_path_factory.mktemp("model") / "m.ckpt")


@pytest.mark.parametrize("present", ["skipped.json", "report.html", "overlays"])
def test_predict_never_overwrites_a_users_files(present, classifier_ckpt, folder, tmp_path):
    """A folder without predictions.json but with a user's skipped.json (or report.html, or
    overlays/) is refused, the file untouched; --overwrite lets the run go ahead."""
    out = tmp_path / "out"
    out.mkdir()
    mine = out / present
    if present == "overlays":
        mine.mkdir()
        mine = mine / "a.jpg.png"
    mine.write_text("the user's own notes")
    with pytest.raises(RunExistsError, match=present):
        predict_folder(classifier_ckpt, folder, out, progress=False)
    assert mine.read_text() == "the user's own notes"
    predict_folder(classifier_ckpt, folder, out, overlays=False, overwrite=True, progress=False)
    assert (out / "predictions.json").is_file()


def test_predict_names_fifos_devices_and_colliding_or_long_names(classifier_ckpt, tmp_path):
    images = tmp_path / "imgs"
    images.mkdir()
    rng = np.random.default_rng(1)
    long_name = "y" * 245 + ".jpeg"  # its overlay name, kept whole, would be 254 bytes + a temporary's
    for name in ("a.jpg", "a.png", long_name):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(images / name)
    os.mkfifo(images / "pipe.png")  # opening it would block the whole run
    (images / "null.jpg").symlink_to("/dev/null")  # a character device
    (images / "gone.png").symlink_to(images / "missing.png")  # a link to nothing
    out = tmp_path / "out"
    res = predict_folder(classifier_ckpt, images, out, methods=("rollout",), progress=False)
    assert [p["file"] for p in res["predictions"]] == ["a.jpg", "a.png", long_name]
    reasons = {s["file"]: s["reason"] for s in json.loads((out / "skipped.json").read_text())}
    assert set(reasons) == {"pipe.png", "null.jpg", "gone.png"}
    assert "FIFO" in reasons["pipe.png"] and "character device" in reasons["null.jpg"]
    overlays = sorted(p.name for p in (out / "overlays").iterdir())
    assert len(overlays) == 3 and {"a.jpg.png", "a.png.png"} <= set(overlays)  # no collision
    assert all(len(n.encode()) <= 200 and n.endswith(".png") for n in overlays)


def test_onnx_runtime_errors_are_one_line_naming_the_file(folder, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(SystemExit) as info:
        main(["--model", str(bad), "--images", str(folder), "--output_dir", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ONNX Runtime cannot load") and str(bad) in err and "\n" not in err


def test_images_may_be_a_file_a_folder_or_a_glob(folder, tmp_path):
    from vision_attn.errors import VisionAttnError
    from vision_attn.predict import resolve_images

    root, files, skipped = resolve_images(folder / "sub" / "b.png")  # one file: named by its name
    assert root == folder / "sub" and files == [folder / "sub" / "b.png"] and skipped == []
    root, files, skipped = resolve_images(folder)  # a folder, recursively; unreadable files come later
    assert [p.relative_to(root).as_posix() for p in files] == ["a.jpg", "broken.png", "sub/b.png"]
    root, files, _ = resolve_images(f"{folder}/**/*.png")  # a glob: rooted before the first wildcard
    assert root == folder and [p.relative_to(root).as_posix() for p in files] == ["broken.png", "sub/b.png"]
    (folder / "dir.png").mkdir()  # a folder that matches the pattern is not an image
    _, files, skipped = resolve_images(f"{folder}/*.png")
    assert [p.name for p in files] == ["broken.png"] and skipped == []
    os.mkfifo(tmp_path / "pipe.png")  # listed, never opened
    _, files, skipped = resolve_images(tmp_path / "pipe.png")
    assert files == [] and skipped[0]["file"] == "pipe.png" and "not a regular file" in skipped[0]["reason"]
    with pytest.raises(VisionAttnError, match="matches no image"):
        resolve_images(f"{folder}/*.gif")
    with pytest.raises(VisionAttnError, match="no such file or folder"):
        resolve_images(tmp_path / "absent.jpg")


@pytest.fixture(scope="module")
def timm_weights(tmp_path_factory):
    """A timm ViT made and saved by plain timm code (random weights, ImageNet-1k head)."""
    import safetensors.torch
    import timm
    import torch

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path_factory.mktemp("timm") / "vit.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(path))
    return path


def test_predict_any_timm_vit_by_name_contract(timm_weights, folder, tmp_path):
    import timm

    photo = folder / "a.jpg"
    out = tmp_path / "out"
    weights = timm_weights
    main(["--model", "timm:vit_tiny_patch16_224", "--weights_file", str(weights), "--images", str(photo),
          "--output_dir", str(out), "--topk", "3", "--methods", "gradcam", "tokens", "--num_workers", "0"])
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == 1 and preds[0]["file"] == "a.jpg"  # a single file: its name
    topk = preds[0]["topk"]
    assert len(topk) == 3 and topk[0] == {"label": preds[0]["pred"], "score": preds[0]["score"]}
    assert [t["score"] for t in topk] == sorted((t["score"] for t in topk), reverse=True)
    info = timm.data.ImageNetInfo()
    names = {info.index_to_description(i) for i in range(1000)}
    assert all(t["label"] in names for t in topk)  # ImageNet descriptions, not indices
    assert (out / "overlays" / "a.jpg.png").is_file() and (out / "report.html").is_file()
    assert json.loads((out / "skipped.json").read_text()) == []
    # --no_overlays: predictions only; a folder gives paths relative to it
    main(["--model", "timm:vit_tiny_patch16_224", "--weights_file", str(weights), "--images", str(folder),
          "--output_dir", str(tmp_path / "o2"), "--no_overlays", "--num_workers", "0"])
    assert not (tmp_path / "o2" / "overlays").exists()
    assert [p["file"] for p in json.loads((tmp_path / "o2" / "predictions.json").read_text())] == ["a.jpg",
                                                                                                   "sub/b.png"]


def test_a_pretrained_name_offline_without_weights_is_one_line_and_status_2(folder, tmp_path, capsys, monkeypatch):
    import timm.models._builder as builder

    def offline(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(builder, "load_pretrained", offline)
    with pytest.raises(SystemExit) as ex:
        main(["--model", "timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k", "--images", str(folder),
              "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "--weights_file" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
