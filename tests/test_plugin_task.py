"""A fourth task defined outside the package (tests/plugins/multilabel.py) goes through ``fit``,
``validate``, ``predict``, ``export`` and the report with no change to vision_attn — through
``--allow_import tests.plugins`` only; without it, the config and the checkpoint are refused. Its
page has the headline, result section and mistakes gallery its hooks give."""

from __future__ import annotations

import html
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
from vision_attn.explain.evaluate import ExplainOptions, select_images
from vision_attn.export import export_onnx, export_safetensors
from vision_attn.predict import FolderRun, ModelSource, predict_folder
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
    # per_label.json, the task's own file: what its predictions give
    per_label = json.loads((out / "per_label.json").read_text())
    assert list(per_label) == SHAPE_KINDS
    for kind, row in per_label.items():
        hits = sum(kind in p["labels"] and kind in p["truth"] for p in predictions)
        assert row["n"] == sum(kind in p["truth"] for p in predictions)
        assert row["recall"] == pytest.approx(hits / max(1, row["n"]))
        assert row["precision"] == pytest.approx(hits / max(1, sum(kind in p["labels"] for p in predictions)))
    # the overlays (the default explain_eval): the seeded sample and the images with the most wrong labels
    wrong = {i: len(set(p["labels"]) ^ set(p["truth"])) for i, p in enumerate(predictions)}
    worst = sorted((i for i in wrong if wrong[i]), key=lambda i: (-wrong[i], i))[:8]  # --explain.mistakes 8
    assert worst  # a few steps of training: some label sets are wrong
    chosen = select_images(len(predictions), 3, "sample", 0)  # the default: the seeded sample spread over the split
    explained = sorted({*chosen, *worst})
    assert sorted(int(p.name[:5]) for p in (out / "overlays").glob("*.png")) == explained
    report = (out / "report.html").read_text()
    assert "vision_attn multilabel evaluation" in report and "f1_micro" in report
    assert report.count('class="item"') == len(explained) and all(predictions[i]["file"] in report for i in chosen)
    _check_page(report, written, per_label, [predictions[i] for i in worst], explained, predictions)


def _check_page(report: str, metrics: dict, per_label: dict, worst: list[dict], explained: list[int],
                predictions: list[dict]) -> None:
    """The plugin's headline in the summary line, its per-label table and its mistakes gallery."""
    summary = re.search(r'<p class="summary" id="summary">(.*?)</p>', report).group(1)
    assert f'exact_match <b class="headline">{metrics["exact_match"]:.4f}</b>' in summary  # not the first metric
    table = re.search(r'<table id="per-label">(.*?)</table>', report).group(1)
    rows = [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", r)]
            for r in re.findall(r"<tr>(.*?)</tr>", table)]
    order = sorted(per_label, key=lambda k: (per_label[k]["recall"], k))
    assert rows == [["shape kind", "n", "precision", "recall"]] + [
        [k, str(per_label[k]["n"]), f"{per_label[k]['precision']:.3f}", f"{per_label[k]['recall']:.3f}"] for k in order]
    cards = re.findall(r'<div class="mistake" data-score="([^"]+)" data-item="(\d*)"><div>#(\d+) (.*?)</div>', report)
    assert [int(rank) for _, _, rank, _ in cards] == list(range(1, len(worst) + 1))
    names = [html.unescape(re.search(r'<span class="name">(.*?)</span>', c).group(1)) for *_, c in cards]
    assert names == [p["file"] for p in worst]
    assert [float(s) for s, *_ in cards] == [len(set(p["labels"]) ^ set(p["truth"])) for p in worst]
    files = [predictions[i]["file"] for i in explained]  # the grid's order: each card shows its image's overlay
    assert [int(item) for _, item, *_ in cards] == [files.index(p["file"]) for p in worst]


def test_predict_and_onnx_export_give_the_same_records(run, images, tmp_path):
    ckpt = _ckpt(run)
    result = predict_folder(ModelSource(ckpt, allow_import=(PLUGIN,)), images, tmp_path / "pred",
                            FolderRun(progress=False), ExplainOptions(methods=["rollout", "attention"]))
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
    onnx = predict_folder(ModelSource(tmp_path / "onnx" / "model.onnx", allow_import=(PLUGIN,)), images,
                          tmp_path / "pred_onnx", FolderRun(progress=False))["predictions"]
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
        predict_folder(ckpt, images, tmp_path / "pred", FolderRun(progress=False))
    with pytest.raises(CheckpointError, match=refused):
        export_onnx(ckpt, tmp_path / "model.onnx")
    assert not any((tmp_path / name).exists() for name in ("eval/metrics.json", "pred/predictions.json", "model.onnx"))
    assert "tests.plugins.multilabel" not in sys.modules  # refused before its code ran
    # an allowed prefix must cover the module: a sibling prefix is not enough
    with pytest.raises(CheckpointError, match=refused):
        load_task(ckpt, allow_import=("tests.plugin",))
