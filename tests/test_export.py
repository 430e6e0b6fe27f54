"""ONNX export: ONNX Runtime gives PyTorch's outputs (atol 1e-4) for every task, at another batch size
(the detector with the local feed-forward encoder of configs/detection/shapes.yaml)."""

from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest
import torch

from vision_attn import create_encoder, load_task
from vision_attn.data.tokenizer import SPECIAL_TOKENS
from vision_attn.models.captioner import DecoderConfig
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks import CaptioningTask, ClassificationTask, DetectionTask

from .conftest import TINY_VIT

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is part of the dev extra: pip install -e '.[dev]'")


def _checkpoint(task, path):
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(task)
    trainer.save_checkpoint(path)
    return path


def _tasks():
    torch.manual_seed(0)
    enc = lambda **kw: create_encoder("vit_tiny_patch16_224", stem="conv", **TINY_VIT, **kw)  # noqa: E731
    return {
        "classification": ClassificationTask(enc(), class_names=["a", "b", "c"]),
        # the shapes detector's encoder: its local feed-forward exports too
        "detection": DetectionTask(enc(local_mlp=True), class_names=["a", "b"], head=DETRConfig(num_queries=5,
                                                                                                hidden_dim=32,
                                                                                                num_layers=2,
                                                                                                num_heads=2,
                                                                                                box_refine=True,
                                                                                                focal=True)),
        "captioning": CaptioningTask(enc(), vocab=[*SPECIAL_TOKENS, "a", "red", "circle"],
                                     decoder=DecoderConfig(hidden_dim=32, num_layers=1, num_heads=2)),
    }


@pytest.mark.parametrize("kind", ["classification", "detection", "captioning"])
def test_onnx_runtime_matches_pytorch(kind, tmp_path):
    import onnx

    from vision_attn.export import export_onnx

    task = _tasks()[kind]
    ckpt = _checkpoint(task, tmp_path / "m.ckpt")
    path = export_onnx(ckpt, tmp_path / "m.onnx")
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta["task"] == kind and json.loads(meta["data_config"])["input_size"] == [3, 32, 32]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, 32, 32)  # another batch size than the export example
    outputs = session.run(None, {"images": x.numpy()})
    model = load_task(ckpt).eval()
    with torch.no_grad():
        if kind == "classification":
            expected = [model(x)]
        elif kind == "detection":
            out = model(x)
            expected = [out["pred_logits"], out["pred_boxes"]]
        else:
            expected = [model.encoder(x).tokens]
    assert [o.name for o in session.get_outputs()] == {"classification": ["logits"],
                                                       "detection": ["pred_logits", "pred_boxes"],
                                                       "captioning": ["tokens"]}[kind]
    for got, ref in zip(outputs, expected, strict=True):
        np.testing.assert_allclose(got, ref.numpy(), atol=1e-4, rtol=0)
    with pytest.raises(Exception, match="refusing to overwrite"):
        export_onnx(ckpt, path)
