"""What an export leaves on disk: exactly the documented file, also when it fails."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from vision_attn import create_encoder
from vision_attn.tasks import ClassificationTask

from .conftest import TINY_VIT

pytest.importorskip("onnx", reason="onnx is part of the export extra: pip install -e '.[export]'")


def _checkpoint(path):
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b"])
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(task)
    trainer.save_checkpoint(path)
    return path


def test_onnx_export_writes_exactly_one_file_and_nothing_when_interrupted(tmp_path, monkeypatch):
    import onnx

    from vision_attn.export import export_onnx

    ckpt = _checkpoint(tmp_path / "m.ckpt")
    out = tmp_path / "out"
    out.mkdir()
    export_onnx(ckpt, out / "model.onnx")
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]  # no hidden side file, no temporary
    onnx.checker.check_model(str(out / "model.onnx"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(ckpt, out / "again.onnx")
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]
