"""Classification task: head, metrics against hand counts, schedule, self-describing checkpoints."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from vision_attn import create_encoder, load_task
from vision_attn.checkpoint_io import CheckpointError
from vision_attn.data.classification import ImageFolderDataModule
from vision_attn.data.loading import Batching
from vision_attn.models import ClassificationHead, EncoderOutput
from vision_attn.tasks import ClassificationTask
from vision_attn.tasks.base import warmup_cosine
from vision_attn.tasks.classification import classification_metrics
from vision_attn.tasks.optim import Optimization

from .conftest import TINY_VIT


def test_head_pooling():
    tokens = torch.randn(2, 1 + 4, 8)
    out = EncoderOutput(tokens, 1, (2, 2))
    head = ClassificationHead(8, 3, pooling="cls")
    assert torch.equal(head.pool(out), tokens[:, 0])
    head = ClassificationHead(8, 3, pooling="mean")
    assert torch.allclose(head.pool(out), tokens[:, 1:].mean(1))
    auto = ClassificationHead(8, 3, pooling="auto")
    assert torch.allclose(auto.pool(EncoderOutput(tokens[:, 1:], 0, (2, 2))), tokens[:, 1:].mean(1))
    with pytest.raises(ValueError, match="class token"):
        ClassificationHead(8, 3, pooling="cls").pool(EncoderOutput(tokens[:, 1:], 0, (2, 2)))


def test_metrics_match_hand_counts():
    # 6 samples, 5 classes. Top-1 right for samples 0, 1, 3 -> micro 0.5.
    labels = torch.tensor([0, 1, 2, 2, 3, 4])
    logits = torch.full((6, 5), -10.0)
    preds = [0, 1, 0, 2, 4, 3]
    for i, p in enumerate(preds):
        logits[i, p] = 10.0
    logits[2, 2] = 5.0  # second choice right for sample 2
    m = classification_metrics(logits, labels)
    assert m["acc_top1"] == pytest.approx(3 / 6)
    # per class recall: c0 1/1, c1 1/1, c2 1/2, c3 0/1, c4 0/1 -> mean 0.5
    assert m["acc_macro"] == pytest.approx((1 + 1 + 0.5 + 0 + 0) / 5)
    assert m["acc_top5"] == pytest.approx(1.0)
    assert "acc_top5" not in classification_metrics(logits[:, :3], labels.clamp(max=2))


def test_warmup_cosine_shape():
    total, warm = 100, 10
    f = [warmup_cosine(s, total, warm, 0.01) for s in range(total + 1)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[100] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))


def _task(**kw):
    torch.manual_seed(0)
    return ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), **kw)


def test_schedule_follows_trainer_length_and_checkpoint_roundtrip(shapes_root, tmp_path):
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    task = _task(optim=Optimization(lr=1e-3, warmup_fraction=0.2, min_lr_ratio=0.05))
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(task, datamodule=dm)
    assert task.class_names == dm.class_names
    steps = trainer.global_step
    assert steps == 2 * (60 // 16)
    sched = trainer.lr_scheduler_configs[0].scheduler
    # After the last step the schedule has reached its end: lr = min_lr_ratio * peak.
    assert sched.get_last_lr()[0] == pytest.approx(1e-3 * warmup_cosine(steps, steps, int(0.2 * steps), 0.05))
    assert sched.get_last_lr()[0] == pytest.approx(5e-5)

    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = load_task(path, expected_task="classification")
    assert isinstance(loaded, ClassificationTask)
    assert loaded.class_names == dm.class_names and loaded.data_config == task.data_config
    # The stored preprocessing wins over what the encoder would compute today.
    import vision_attn.tasks.base as base

    meta, ckpt = base.read_task_meta(path)
    meta["data_config"]["mean"] = [0.25, 0.25, 0.25]
    other = base.restore_from_checkpoint(base.build_task_from_meta(meta), meta, ckpt, "test")
    assert other.data_config["mean"] == (0.25, 0.25, 0.25)
    x = torch.randn(2, 3, 32, 32)
    task.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), task(x))
    with pytest.raises(CheckpointError, match="not a 'detection'"):
        load_task(path, expected_task="detection")


def test_class_mismatch_between_model_and_data_is_reported(shapes_root):
    task = _task(class_names=["a", "b"])
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(num_workers=0))
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(ValueError, match="built for classes"):
        trainer.fit(task, datamodule=dm)


def test_foreign_checkpoint_is_refused(tmp_path):
    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}}, path)
    with pytest.raises(CheckpointError, match="not written by a vision_attn task"):
        load_task(path)


def test_compile_switch_compiles_the_encoder_in_place(tmp_path, monkeypatch):
    """``--model.compile true``: same parameter names, same outputs, not stored in the checkpoint.
    Dynamo's graph runs on its eager backend here (the switch is under test, not the code
    generator; ``python -m benchmarks.cpu_paths`` runs the default one)."""
    import lightning as L

    from vision_attn import create_encoder, load_task
    from vision_attn.tasks import ClassificationTask

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, **{"backend": "eager", **kw}))
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    task = ClassificationTask(enc, num_classes=3, compile=True).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        eager = task(x)
    names = list(task.state_dict())
    task.configure_model()
    assert task.encoder._compiled_call_impl is not None
    assert list(task.state_dict()) == names
    with torch.no_grad():
        torch.testing.assert_close(task(x), eager, atol=1e-5, rtol=1e-4)
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(task)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    assert "compile" not in ckpt["vision_attn"]["model"]["init_args"]
    assert load_task(tmp_path / "c.ckpt").encoder._compiled_call_impl is None


# --- eval.py's per_class.json and confusion_matrix.json ------------------------------------------------------

_FAST_EVAL = ["--explain.num_overlays", "0", "--explain.faithfulness", "false", "--explain.report", "false"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, shapes_root):
    """A tiny shapes classifier (2 epochs) evaluated by eval.py (without explanations): ``(out, ckpt)``."""
    from vision_attn.commands.evaluate import eval_main
    from vision_attn.commands.train import train_main

    from .conftest import REPO

    run = tmp_path_factory.mktemp("cls_eval")
    enc = "--model.init_args.encoder.init_args."
    train_main(["--config", str(REPO / "configs" / "classification" / "shapes.yaml"),
                "--data.init_args.root", str(shapes_root), "--data.init_args.batching.num_workers", "0",
                "--data.init_args.batching.batch_size", "16", f"{enc}embed_dim", "32", f"{enc}depth", "2",
                f"{enc}num_heads", "2", f"{enc}patch_size", "8", "--trainer.max_epochs", "2",
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--trainer.default_root_dir", str(run / "train")])
    ckpt = str(run / "train" / "checkpoints" / "last.ckpt")
    eval_main([*_FAST_EVAL, "--ckpt_path", ckpt, "--output_dir", str(run / "eval")])
    return run / "eval", ckpt


def test_mistakes_browser_has_every_misclassified_image(evaluated):
    """mistakes.html: one card per wrong prediction of predictions.json, filed under its true class
    and saying what it was taken for, each with a map over the patch grid."""
    import json

    out, _ = evaluated
    preds = json.loads((out / "predictions.json").read_text())
    page = (out / "mistakes.html").read_text()
    start = page.index("const CARDS=") + len("const CARDS=")
    cards = json.JSONDecoder().raw_decode(page[start:])[0]
    wrong = [p for p in preds if p["label"] != p["pred"]]
    assert sorted((c["image"], c["category"], c["note"]) for c in cards) == sorted(
        (p["file"], p["label"], f"taken for {p['pred']}") for p in wrong)
    assert all(c["kind"] == "misclassified" and c["map"] and c["grid"] for c in cards)
    assert sorted(c["confused"] for c in cards) == sorted(p["pred"] for p in wrong)  # the cell's other half
    assert page.count("data:image/jpeg;base64,") == len({c["image"] for c in cards})


def test_per_image_and_per_class_csv_reconcile_with_metrics_json(evaluated):
    """results_per_image.csv: one row per image of predictions.json; its accuracy is acc_top1; the
    truth ranks 1 exactly when correct; per_class.csv's counts are those of the rows."""
    import csv
    import json

    out, _ = evaluated
    metrics = json.loads((out / "metrics.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    rows = list(csv.DictReader((out / "results_per_image.csv").open()))
    assert [r["file"] for r in rows] == [p["file"] for p in preds]
    assert rows == [{k: str(v) for k, v in r.items()} for r in json.loads((out / "results_per_image.json").read_text())]
    correct = [r["correct"] == "True" for r in rows]
    assert sum(correct) / len(rows) == pytest.approx(metrics["acc_top1"])
    assert all((r["truth_rank"] == "1") == c for r, c in zip(rows, correct, strict=True))
    assert all(float(r["truth_score"]) <= float(r["score"]) + 1e-7 for r in rows)
    per_class = list(csv.DictReader((out / "per_class.csv").open()))
    for row in per_class:
        name = row["class"]
        tp = sum(r["truth"] == name and r["pred"] == name for r in rows)
        fp = sum(r["truth"] != name and r["pred"] == name for r in rows)
        fn = sum(r["truth"] == name and r["pred"] != name for r in rows)
        assert (int(row["tp"]), int(row["fp"]), int(row["fn"])) == (tp, fp, fn), name
        if tp + fp and tp + fn and tp:
            p, r = tp / (tp + fp), tp / (tp + fn)
            assert float(row["f1"]) == pytest.approx(2 * p * r / (p + r))


def test_eval_writes_the_confusion_matrix_and_per_class_results_of_predictions_json(evaluated):
    import json

    out, _ = evaluated
    preds = json.loads((out / "predictions.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    confusion = json.loads((out / "confusion_matrix.json").read_text())
    per_class = json.loads((out / "per_class.json").read_text())
    names = confusion["labels"]
    assert names == sorted({p["label"] for p in preds})  # ImageFolder's class order, spelled as predictions.json
    assert {p["pred"] for p in preds} <= set(names) and list(per_class) == names
    counts = confusion["counts"]
    assert sum(map(sum, counts)) == len(preds) == 25
    for i, truth in enumerate(names):  # rows = truth, columns = prediction, cell by cell
        for j, pred in enumerate(names):
            assert counts[i][j] == sum(p["label"] == truth and p["pred"] == pred for p in preds), (truth, pred)
    assert sum(counts[i][i] for i in range(len(names))) / len(preds) == pytest.approx(metrics["acc_top1"], abs=1e-6)
    for name, entry in per_class.items():
        mine = [p for p in preds if p["label"] == name]
        called = [p for p in preds if p["pred"] == name]
        right = sum(p["pred"] == name for p in mine)
        assert entry["n"] == len(mine)
        assert entry["acc"] == entry["recall"] == pytest.approx(right / len(mine))
        assert entry["precision"] == (pytest.approx(right / len(called)) if called else None)
    assert sum(e["acc"] for e in per_class.values()) / len(names) == pytest.approx(metrics["acc_macro"], abs=1e-6)


def test_eval_task_files_are_refused_and_replaced_like_metrics_json(evaluated, tmp_path, monkeypatch):
    """An output folder holding only per_class.json is refused without --overwrite (the file
    untouched); with it, a task that no longer writes confusion_matrix.json removes the old one."""
    import shutil

    from vision_attn.commands.evaluate import eval_main
    from vision_attn.errors import RunExistsError

    src, ckpt = evaluated
    out = tmp_path / "eval"
    shutil.copytree(src, out)
    (out / "metrics.json").unlink()
    (out / "predictions.json").unlink()
    for name in ("confusion_matrix.json", "per_class.csv", "results_per_image.json", "results_per_image.csv"):
        (out / name).unlink()
    (out / "per_class.json").write_text("{}")
    with pytest.raises(RunExistsError, match=r"already holds evaluation results \(per_class.json\)"):
        eval_main([*_FAST_EVAL, "--ckpt_path", ckpt, "--output_dir", str(out)])
    assert (out / "per_class.json").read_text() == "{}"
    (out / "confusion_matrix.json").write_text("{}")
    real = ClassificationTask.eval_files
    monkeypatch.setattr(ClassificationTask, "eval_files",
                        lambda self, ds: {"per_class.json": real(self, ds)["per_class.json"]})
    eval_main([*_FAST_EVAL, "--ckpt_path", ckpt, "--output_dir", str(out), "--overwrite"])
    assert (out / "per_class.json").read_bytes() == (src / "per_class.json").read_bytes()
    assert not (out / "confusion_matrix.json").exists()
    # a task's eval_files may only give the files it declares (those are checked before evaluating)
    monkeypatch.setattr(ClassificationTask, "eval_files", lambda self, ds: {"extra.json": {}})
    with pytest.raises(Exception, match="declare every file it writes"):
        eval_main([*_FAST_EVAL, "--ckpt_path", ckpt, "--output_dir", str(tmp_path / "other")])
    assert not (tmp_path / "other" / "metrics.json").exists()
