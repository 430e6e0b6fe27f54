"""The convergence alarm: each deliberately broken setting produces its own message, a sound one
none; the callback warns once, a quarter into the run or at the first non-finite loss."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from vision_attn.tasks.convergence import ConvergenceAlarm, detection_checks


def _split(root, boxes, labels=None, size=(64, 64), with_boxes=True):
    """A COCO split of two images with ``boxes`` ([x, y, w, h] as written) in the first one."""
    from PIL import Image

    from vision_attn.data.detection import CocoDetection

    (root / "train").mkdir(parents=True)
    (root / "annotations").mkdir()
    images = []
    for i in (1, 2):
        Image.new("RGB", size).save(root / "train" / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": size[1], "height": size[0]})
    anns = [{"id": k + 1, "image_id": 1, "category_id": (labels or [1] * len(boxes))[k], "bbox": b,
             "area": b[2] * b[3], "iscrowd": 0} for k, b in enumerate(boxes)] if with_boxes else []
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    (root / "annotations" / "instances_train.json").write_text(json.dumps({"images": images, "annotations": anns,
                                                                           "categories": cats}))
    return CocoDetection(root, "train")


def _task(lr=5e-4, warmup=0.05, classes=("a", "b")):
    return SimpleNamespace(optim=SimpleNamespace(lr=lr, warmup_fraction=warmup), class_names=list(classes))


def _problems(task, dataset, names=("a", "b")):
    dm = SimpleNamespace(datasets={"train": dataset}, class_names=None if names is None else list(names))
    return {name: problem for name, problem in detection_checks(task, dm) if problem}


GOOD = [[4.0, 4.0, 20.0, 20.0], [30.0, 30.0, 10.0, 12.0]]


def test_a_sound_setting_has_no_problem(tmp_path):
    assert _problems(_task(), _split(tmp_path, GOOD)) == {}


@pytest.mark.parametrize("cause, task, boxes, names, message", [
    ("learning rate", _task(lr=0.05), GOOD, ("a", "b"), "model.optim.lr 0.05 is above"),
    ("learning rate", _task(lr=1e-7), GOOD, ("a", "b"), "is below"),
    ("warm-up", _task(warmup=0.5), GOOD, ("a", "b"), "warmup_fraction 0.5"),
    ("classes", _task(classes=("a", "b", "c")), GOOD, ("a", "b"), "the model has 3 classes, the data 2"),
    ("boxes", _task(), [[10.0, 10.0, 60.0, 60.0], [30.0, 30.0, 62.0, 63.0]], ("a", "b"), "2 of 2 training boxes"),
])
def test_each_cause_produces_its_message(tmp_path, cause, task, boxes, names, message):
    problems = _problems(task, _split(tmp_path, boxes), names)
    assert list(problems) == [cause] and message in problems[cause]


def test_labels_beyond_the_model_and_no_box_left(tmp_path):
    problems = _problems(_task(classes=("a",)), _split(tmp_path / "x", GOOD, labels=[1, 2]), names=None)
    assert "training labels go up to 1, the model has 1 classes" in problems["classes"]
    # every annotation outside its image: dropped while reading, no training box left
    empty = _split(tmp_path / "y", [[100.0, 100.0, 5.0, 5.0]])
    assert "none of the 2 training images has a box left" in _problems(_task(), empty)["images"]


def _trainer(epoch, max_epochs, value, dataset):
    return SimpleNamespace(current_epoch=epoch, max_epochs=max_epochs, sanity_checking=False, global_step=7,
                           callback_metrics={"val/map_50": torch.tensor(value)},
                           datamodule=SimpleNamespace(datasets={"train": dataset}, class_names=["a", "b"]))


def test_the_callback_warns_once_a_quarter_into_the_run(tmp_path, caplog):
    dataset = _split(tmp_path, GOOD)
    alarm = ConvergenceAlarm()
    task = _task(lr=0.05)
    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.convergence"):
        alarm.on_validation_end(_trainer(8, 40, 0.0, dataset), task)  # 9 of 40 epochs: too early
        assert not caplog.records
        alarm.on_validation_end(_trainer(9, 40, 0.3, dataset), task)  # learning
        assert not caplog.records
        alarm.on_validation_end(_trainer(9, 40, 0.01, dataset), task)
        alarm.on_validation_end(_trainer(10, 40, 0.01, dataset), task)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "val/map_50 is 0.010 after 10 of 40 epochs" in text and "learning rate: model.optim.lr 0.05" in text
    assert "learning rate PROBLEM, warm-up ok, classes ok, boxes ok, images ok" in text


def test_a_non_finite_loss_warns_at_once(tmp_path, caplog):
    alarm = ConvergenceAlarm()
    trainer = _trainer(0, 40, 0.0, _split(tmp_path, GOOD))
    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.convergence"):
        alarm.on_train_batch_end(trainer, _task(), {"loss": torch.tensor(1.5)}, None, 0)
        assert not caplog.records
        alarm.on_train_batch_end(trainer, _task(), {"loss": torch.tensor(float("nan"))}, None, 1)
        alarm.on_train_batch_end(trainer, _task(), {"loss": torch.tensor(float("nan"))}, None, 2)
    assert len(caplog.records) == 1 and "the training loss is nan at step 7" in caplog.records[0].getMessage()
    assert "none of the checks found one" in caplog.records[0].getMessage()


def test_the_detector_runs_the_alarm():
    from vision_attn import create_encoder
    from vision_attn.models.detr import DETRConfig
    from vision_attn.tasks import DetectionTask

    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    task = DetectionTask(enc, num_classes=2, head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2))
    assert any(isinstance(c, ConvergenceAlarm) for c in task.configure_callbacks())
