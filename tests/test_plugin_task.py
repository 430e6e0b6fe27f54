"""A fourth task defined outside the package (tests/plugins/multilabel.py) goes through ``fit``,
``validate``, ``predict``, ``export`` and the report with no change to vision_attn — through
``--allow_import tests.plugins`` only; without it, the config and the checkpoint are refused."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from vision_attn.commands import main as vision_attn_main
from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.train import train_main
from vision_attn.errors import CheckpointError, ConfigError
from vision_attn.explain.evaluate import select_images
from vision_attn.export import export_onnx, export_safetensors
from vision_attn.predict import predict_folder
from vision_attn.tasks.base import TASKS, load_task, read_task_meta

PLUGIN = "tests.plugins"
TASK = "tests.plugins.multilabel.MultiLabelTask"
DATA = "tests.plugins.multilabel.ShapeSetsDataModule"
DATA_ARGS = {"num_train": 96, "num_val": 24, "batch_size": 16, "num_workers": 0}
THRESHOLD = 0.35  # a few steps of training learn about the label frequencies (~0.33): labels vary
SHAPE_KINDS = ["circle", "square", "triangle", "star", "cross"]


def _config(folder: Path) -> Path:
    encoder = {"name": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2,
               "num_heads": 2, "mlp_ratio": 2.0, "preprocess": {"crop_pct": 1.0}}
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": 4, "accelerator": "cpu", "devices": 1, "precision": "32-true",
                    "log_every_n_steps": 1, "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"class_path": TASK, "init_args": {
            "encoder": {"class_path": "vision_attn.models.ViTEncoder", "init_args": encoder},
            "threshold": THRESHOLD, "optim": {"lr": 0.003, "warmup_fraction": 0.1}}},
        "data": {"class_path": DATA, "init_args": DATA_ARGS},
    }
    path = folder / "multilabel.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """``vision-attn fit --config multilabel.yaml --allow_import tests.plugins`` (the dispatcher)."""
    folder = tmp_path_factory.mktemp("plugin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISION_ATTN_DEBUG", "1")  # a failure shows its traceback, not a one-line exit
        vision_attn_main(["fit", "--config", str(_config(folder)), "--trainer.default_root_dir",
                          str(folder / "run"), "--allow_import", PLUGIN])
    return folder / "run"


@pytest.fixture(scope="module")
def images(run, tmp_path_factory) -> Path:
    """Six validation images of the run's data, as a plain folder for ``predict``."""
    from tests.plugins.multilabel import ShapeSetsDataModule

    root = ShapeSetsDataModule(**DATA_ARGS).root
    folder = tmp_path_factory.mktemp("images")
    for src in sorted((root / "val").glob("*.png"))[:6]:
        shutil.copy(src, folder / src.name)
    return folder


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / "last.ckpt"


def test_fit_writes_a_checkpoint_that_rebuilds_the_plugin_task(run):
    from tests.plugins.multilabel import MultiLabelTask

    assert TASKS["multilabel"] is MultiLabelTask  # registered by importing its module
    assert _ckpt(run).is_file() and list((run / "checkpoints").glob("best-*.ckpt"))
    assert "val/loss" in (run / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    meta, _ = read_task_meta(_ckpt(run), (PLUGIN,))
    assert meta["task"] == "multilabel" and meta["model"]["class_path"] == TASK
    assert meta["data"] == {"class_path": DATA, "init_args": {**DATA_ARGS, "image_size": 32, "cache_dir": None}}
    task = load_task(_ckpt(run), expected_task="multilabel", allow_import=(PLUGIN,))
    assert type(task) is MultiLabelTask and task.class_names == SHAPE_KINDS and task.threshold == THRESHOLD
    assert task.head.fc.out_features == len(SHAPE_KINDS)


def test_validate_from_the_checkpoint_alone_writes_metrics_predictions_overlays_report(run, tmp_path):
    out = tmp_path / "eval"
    metrics = eval_main(["--ckpt_path", str(_ckpt(run)), "--output_dir", str(out), "--allow_import", PLUGIN,
                         "--explain.num_overlays", "3"])
    written = json.loads((out / "metrics.json").read_text())
    assert set(written) == {"f1_micro", "exact_match"} and written == pytest.approx(metrics)
    predictions = json.loads((out / "predictions.json").read_text())
    assert len(predictions) == DATA_ARGS["num_val"]
    assert all(set(p) == {"file", "truth", "labels", "scores"} for p in predictions)
    assert all(set(p["scores"]) == set(SHAPE_KINDS) and p["truth"] for p in predictions)
    assert all(p["labels"] == [k for k in SHAPE_KINDS if p["scores"][k] >= THRESHOLD] for p in predictions)
    assert 0 < sum(len(p["labels"]) for p in predictions) < len(predictions) * len(SHAPE_KINDS)
    # the metrics are those its predictions give (hand-computed micro F1 and exact match)
    tp = sum(len(set(p["labels"]) & set(p["truth"])) for p in predictions)
    n_pred, n_true = sum(len(p["labels"]) for p in predictions), sum(len(p["truth"]) for p in predictions)
    assert written["f1_micro"] == pytest.approx(2 * tp / (n_pred + n_true))
    exact = sum(p["labels"] == [k for k in SHAPE_KINDS if k in p["truth"]] for p in predictions)
    assert written["exact_match"] == pytest.approx(exact / len(predictions))
    assert len(list((out / "overlays").glob("*.png"))) == 3
    report = (out / "report.html").read_text()
    assert "vision_attn multilabel evaluation" in report and "f1_micro" in report
    chosen = select_images(len(predictions), 3, "sample", 0)  # the default: the seeded sample spread over the split
    assert report.count('class="item"') == 3 and all(predictions[i]["file"] in report for i in chosen)


def test_predict_and_onnx_export_give_the_same_records(run, images, tmp_path):
    ckpt = _ckpt(run)
    result = predict_folder(ckpt, images, tmp_path / "pred", allow_import=(PLUGIN,), progress=False,
                            methods=("rollout", "attention"))
    records = json.loads((tmp_path / "pred" / "predictions.json").read_text())
    assert records == result["predictions"] and len(records) == 6
    assert all(set(r) == {"file", "labels", "scores"} for r in records)
    assert sorted(p.name for p in (tmp_path / "pred" / "overlays").iterdir()) == [r["file"] + ".png" for r in records]
    assert "vision_attn multilabel predictions" in (tmp_path / "pred" / "report.html").read_text()

    # the same records as validate gives for these images (one preprocessing, no crop)
    eval_out = tmp_path / "eval"
    eval_main(["--ckpt_path", str(ckpt), "--output_dir", str(eval_out), "--allow_import", PLUGIN,
               "--explain.num_overlays", "0", "--explain.report", "false"])
    by_name = {Path(p["file"]).name: p for p in json.loads((eval_out / "predictions.json").read_text())}
    for r in records:
        assert r["labels"] == by_name[r["file"]]["labels"]
        assert r["scores"] == pytest.approx(by_name[r["file"]]["scores"], abs=1e-5)

    vision_attn_main(["export", "--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "onnx"), "--format", "onnx",
                      "--allow_import", PLUGIN])
    onnx = predict_folder(tmp_path / "onnx" / "model.onnx", images, tmp_path / "pred_onnx", allow_import=(PLUGIN,),
                          progress=False)["predictions"]
    assert [r["file"] for r in onnx] == [r["file"] for r in records]
    for a, b in zip(onnx, records, strict=True):
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-4)
        assert a["labels"] == b["labels"]
    assert not (tmp_path / "pred_onnx" / "overlays").exists()  # ONNX holds no attention

    from safetensors.torch import load_file

    tensors = load_file(export_safetensors(ckpt, tmp_path / "model.safetensors", part="model",
                                           allow_import=(PLUGIN,)))
    task = load_task(ckpt, allow_import=(PLUGIN,))
    assert set(tensors) == set(task.state_dict())
    assert torch.equal(tensors["head.fc.weight"], task.state_dict()["head.fc.weight"])


def test_without_allow_import_the_plugin_is_refused(run, images, tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "tests.plugins.multilabel")  # as in a fresh process (restored after)
    with pytest.raises(ConfigError, match=rf"refusing to import '(?:{re.escape(DATA)}|{re.escape(TASK)})'"
                                          r".*--allow_import tests"):
        train_main(["--config", str(_config(tmp_path)), "--trainer.default_root_dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()  # nothing was built or written

    ckpt = _ckpt(run)
    refused = rf"{re.escape(TASK)}.*--allow_import tests"
    with pytest.raises(CheckpointError, match=refused):
        load_task(ckpt)
    with pytest.raises(CheckpointError, match=refused):
        eval_main(["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "eval")])
    with pytest.raises(CheckpointError, match=refused):
        predict_folder(ckpt, images, tmp_path / "pred", progress=False)
    with pytest.raises(CheckpointError, match=refused):
        export_onnx(ckpt, tmp_path / "model.onnx")
    assert not any((tmp_path / name).exists() for name in ("eval/metrics.json", "pred/predictions.json", "model.onnx"))
    assert "tests.plugins.multilabel" not in sys.modules  # refused before its code ran
    # an allowed prefix must cover the module: a sibling prefix is not enough
    with pytest.raises(CheckpointError, match=refused):
        load_task(ckpt, allow_import=("tests.plugin",))
