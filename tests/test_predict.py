"""python -m vision_attn.predict: every task from a checkpoint (with overlays), classification and
detection from ONNX (the same predictions as the checkpoint)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from vision_attn.errors import CheckpointError
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
    keys = {"classification": {"file", "pred", "score"}, "detection": {"file", "detections"},
            "captioning": {"file", "caption"}}[kind]
    assert all(set(p) == keys for p in res["predictions"])
    if kind == "detection":
        det = res["predictions"][0]["detections"]
        assert det and set(det[0]) == {"label", "category_id", "bbox", "score"}
        x, y, w, h = det[0]["bbox"]
        assert 0 <= x <= 56 and 0 <= y <= 40 and w >= 0 and h >= 0  # pixels of the original image
    assert json.loads((out / "predictions.json").read_text()) == res["predictions"]
    assert sorted(str(p.relative_to(out / "overlays")) for p in (out / "overlays").rglob("*.png")) == ["a.png", "sub/b.png"]
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 2
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
    with pytest.raises(CheckpointError, match="captioning encoder only"):
        predict_folder(path, folder, tmp_path / "out", progress=False)
