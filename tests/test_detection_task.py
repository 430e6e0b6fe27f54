"""Detection task: mAP equals pycocotools' COCOeval; predictions.json in COCO results format."""

from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest
import torch

from vision_attn import create_encoder, load_task
from vision_attn.data.detection import DetectionDataModule
from vision_attn.data.layout import SplitLayout
from vision_attn.data.loading import Batching
from vision_attn.data.synthetic import SceneSetConfig
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks import DetectionTask
from vision_attn.tasks.base import build_task_from_meta
from vision_attn.tasks.detection import SetLossConfig, mean_average_precision

from .conftest import write_exif_rotated_jpeg


def _coco_eval(ann_file, results):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = COCO(str(ann_file))
    dt = gt.loadRes(results)
    ev = COCOeval(gt, dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats  # [map, map_50, map_75, ...]


def _random_case(tmp_path):
    """Jittered true boxes (20 % with a wrong class) plus false positives, as tensors and COCO results."""
    from vision_attn.data.detection import CocoDetection
    from vision_attn.data.synthetic import ensure_shapes_coco

    root = ensure_shapes_coco(SceneSetConfig(num_train=2, num_val=12, image_size=64), tmp_path)
    ds = CocoDetection(root, "val")
    rng = np.random.default_rng(0)
    preds, targets, results = [], [], []
    for im in ds.images:
        gt = ds.annotations[im["id"]]
        boxes, scores, labels = [], [], []
        for box, label in gt:  # jittered true boxes, some with the wrong class, plus false positives
            jitter = rng.normal(0, 2.5, 4)
            boxes.append([max(0.0, v + d) for v, d in zip(box, jitter, strict=True)])
            labels.append(label if rng.random() > 0.2 else (label + 1) % 5)
            scores.append(float(rng.uniform(0.3, 1.0)))
        for _ in range(2):
            x, y = rng.uniform(0, 40, 2)
            boxes.append([x, y, x + rng.uniform(5, 20), y + rng.uniform(5, 20)])
            labels.append(int(rng.integers(0, 5)))
            scores.append(float(rng.uniform(0, 0.6)))
        b = torch.tensor(boxes, dtype=torch.float32)
        preds.append({"boxes": b, "scores": torch.tensor(scores), "labels": torch.tensor(labels)})
        targets.append({"boxes": torch.tensor([g[0] for g in gt]), "labels": torch.tensor([g[1] for g in gt])})
        for bb, s, lab in zip(b.tolist(), scores, labels, strict=True):
            results.append({"image_id": im["id"], "category_id": ds.category_ids[lab],
                            "bbox": [bb[0], bb[1], bb[2] - bb[0], bb[3] - bb[1]], "score": s})
    return ds, preds, targets, results


def test_map_equals_pycocotools_on_the_same_predictions(tmp_path):
    ds, preds, targets, results = _random_case(tmp_path)
    ours = mean_average_precision(preds, targets)
    stats = _coco_eval(ds.ann_file, results)
    assert 0.1 < ours["map"] < 0.95  # a non-trivial case
    # Equal, not close: with torchmetrics' float32 default thresholds this case differs (0.2104 vs 0.2112).
    assert ours["map"] == pytest.approx(stats[0], abs=1e-6)
    assert ours["map_50"] == pytest.approx(stats[1], abs=1e-6)
    assert ours["map_75"] == pytest.approx(stats[2], abs=1e-6)


def test_train_test_predictions_json_accepted_by_pycocotools(tmp_path):
    dm = DetectionDataModule(synthetic=SceneSetConfig(num_train=16, num_val=6, image_size=32), cache_dir=str(tmp_path),
                             batching=Batching(batch_size=8, num_workers=0))
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    task = DetectionTask(enc, head=DETRConfig(num_queries=5, hidden_dim=32, num_layers=2, num_heads=2, box_refine=True,
                                              focal=True))
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(task, datamodule=dm)
    assert task.category_ids == [1, 2, 3, 4, 5]
    trainer.test(task, dataloaders=dm.eval_dataloader("val"), verbose=False)
    ds = dm.datasets["val"]
    metrics, results = task.eval_results(ds)
    assert set(metrics) >= {"map", "map_50", "map_75"}
    assert {r["image_id"] for r in results} <= {im["id"] for im in ds.images}
    assert all(set(r) == {"image_id", "category_id", "bbox", "score"} for r in results)
    path = tmp_path / "predictions.json"
    path.write_text(json.dumps(results))
    stats = _coco_eval(ds.ann_file, json.loads(path.read_text()))
    assert metrics["map"] == pytest.approx(max(stats[0], 0.0), abs=1e-6)
    # self-describing checkpoint
    ckpt = tmp_path / "d.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = load_task(ckpt, expected_task="detection")
    x = torch.randn(1, 3, 32, 32)
    task.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(x)["pred_boxes"], task(x)["pred_boxes"])


# --- crowd regions, validation == evaluation, overlays of EXIF-rotated images ----------------------


def _crowd_and_tiny_split(root, n_images=4, seed=0):
    """A 64 x 64 split with ordinary boxes, crowd regions and objects of 1.5 px (0.75 px after
    resizing to a 32 px input: dropped by SanitizeBoundingBoxes(min_size=1)); plus crafted
    detections in pixels (jittered true boxes, some on crowd regions, false positives)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (root / "val").mkdir(parents=True)
    (root / "annotations").mkdir()
    images, anns, dets = [], [], {}
    for i in range(1, n_images + 1):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / "val" / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": 64, "height": 64})
        boxes, scores, labels = [], [], []

        def add(box, label, crowd, _i=i):
            anns.append({"id": len(anns) + 1, "image_id": _i, "category_id": [3, 7][label], "bbox": box,
                         "area": box[2] * box[3], "iscrowd": crowd})

        for _ in range(2):  # ordinary objects, detected with jitter (some with the wrong class)
            x, y = rng.uniform(0, 40, 2)
            box = [float(x), float(y), float(rng.uniform(8, 20)), float(rng.uniform(8, 20))]
            label = int(rng.integers(2))
            add(box, label, 0)
            j = rng.normal(0, 1.5, 4)
            boxes.append([box[0] + j[0], box[1] + j[1], box[0] + box[2] + j[2], box[1] + box[3] + j[3]])
            labels.append(label if rng.random() > 0.2 else 1 - label)
            scores.append(float(rng.uniform(0.3, 1.0)))
        x, y = rng.uniform(2, 60, 2)  # a tiny object, detected well
        add([float(x), float(y), 1.5, 1.5], i % 2, 0)
        boxes.append([x - 0.1, y, x + 1.5, y + 1.6])
        labels.append(i % 2)
        scores.append(float(rng.uniform(0.5, 1.0)))
        crowd = [30.0, 30.0, 30.0, 30.0]  # a crowd region, with two detections inside it
        add(crowd, 0, 1)
        for k in range(2):
            boxes.append([32.0 + 8 * k, 34.0, 44.0 + 8 * k, 50.0])
            labels.append(0)
            scores.append(float(rng.uniform(0.6, 0.95)))
        for _ in range(2):  # false positives
            x, y = rng.uniform(0, 40, 2)
            boxes.append([x, y, x + rng.uniform(5, 20), y + rng.uniform(5, 20)])
            labels.append(int(rng.integers(2)))
            scores.append(float(rng.uniform(0.0, 0.7)))
        order = np.argsort(scores)[::-1].copy()
        dets[i] = {"boxes": torch.tensor(boxes, dtype=torch.float32)[order].clamp(0, 64),
                   "scores": torch.tensor(scores, dtype=torch.float32)[order],
                   "labels": torch.tensor(labels)[order], "queries": torch.arange(len(scores))}
    cats = [{"id": 3, "name": "a"}, {"id": 7, "name": "b"}]
    (root / "annotations" / "instances_val.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return dets


def _tiny_task(tiny_encoder, num_classes=2, category_ids=(3, 7)):
    return DetectionTask(tiny_encoder, num_classes=num_classes, category_ids=list(category_ids),
                         head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2))


def test_crowd_regions_are_scored_as_pycocotools_scores_them(tmp_path, tiny_encoder):
    """Detections on crowd regions are ignored (not false positives): metrics.json's map,
    map_50, map_75 equal COCOeval of the written predictions.json."""
    from vision_attn.data.detection import CocoDetection

    dets = _crowd_and_tiny_split(tmp_path)
    ds = CocoDetection(tmp_path, "val")
    assert all(len(ds.annotations[i]) == 3 for i in dets)  # crowd regions are no training targets
    task = _tiny_task(tiny_encoder)
    task.eval_records = [{"image_id": i, "det": d} for i, d in dets.items()]
    metrics, results = task.eval_results(ds)
    (tmp_path / "predictions.json").write_text(json.dumps(results))
    stats = _coco_eval(ds.ann_file, json.loads((tmp_path / "predictions.json").read_text()))
    assert 0.1 < metrics["map"] < 0.95
    for k, s in zip(("map", "map_50", "map_75"), stats[:3], strict=True):
        assert metrics[k] == pytest.approx(s, abs=1e-6), k
    assert all(int(ds.scoring_target(i)["iscrowd"].sum()) == 1 for i in dets)  # but scored as crowd
    # The case is sensitive: counting the crowd detections as false positives changes map.
    without = [{k: v[t["iscrowd"] == 0] for k, v in t.items()} for t in map(ds.scoring_target, dets)]
    preds = [{k: d[k] for k in ("boxes", "scores", "labels")} for d in dets.values()]
    assert abs(mean_average_precision(preds, without)["map"] - stats[0]) > 1e-3


def test_validation_and_evaluation_score_the_same_ground_truth(tmp_path, tiny_encoder):
    """Objects of 0.75 input pixels and crowd regions: val/map == eval map == pycocotools."""
    dets = _crowd_and_tiny_split(tmp_path)
    dm = DetectionDataModule(root=str(tmp_path), layout=SplitLayout(train_split="val", val_split="val"),
                             batching=Batching(batch_size=3, num_workers=0))
    task = _tiny_task(tiny_encoder)
    dm.preprocess = task.data_config
    assert task.data_config["input_size"][1:] == (32, 32)
    queue = []

    def crafted(outputs, orig_sizes):  # the same detections, in loader order, for both runs
        return [queue.pop(0) for _ in range(len(orig_sizes))]

    task.detect = crafted
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    queue[:] = [dets[i] for i in sorted(dets)]
    val_map = trainer.validate(task, dataloaders=dm.eval_dataloader("val"), verbose=False)[0]["val/map"]
    queue[:] = [dets[i] for i in sorted(dets)]
    loader = dm.eval_dataloader("val")
    trainer.test(task, dataloaders=loader, verbose=False)
    metrics, results = task.eval_results(loader.dataset)
    stats = _coco_eval(loader.dataset.ann_file, results)
    assert 0.1 < metrics["map"] < 0.95
    assert val_map == pytest.approx(metrics["map"], abs=1e-6)
    assert metrics["map"] == pytest.approx(stats[0], abs=1e-6)


def test_detection_overlay_of_an_exif_rotated_image_draws_the_box_on_the_object(tmp_path, tiny_encoder,
                                                                                   monkeypatch):
    """A JPEG stored 40 x 20 with EXIF 'rotate 90' whose annotation file declares the stored
    size: the detected box (on the white square in stored pixels) is drawn on the square."""
    from types import SimpleNamespace

    import vision_attn.explain.detection as explain_detection
    from vision_attn.data.detection import CocoDetection, build_detection_transform

    write_exif_rotated_jpeg(tmp_path)  # val/a.jpg: 40x20 stored, white square at x 28..36, y 2..10
    ann = {"images": [{"id": 1, "file_name": "a.jpg", "width": 40, "height": 20}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [28, 2, 8, 8], "area": 64,
                            "iscrowd": 0}],
           "categories": [{"id": 1, "name": "square"}]}
    (tmp_path / "annotations" / "instances_val.json").write_text(json.dumps(ann))
    task = _tiny_task(tiny_encoder, num_classes=1, category_ids=(1,)).eval()
    ds = CocoDetection(tmp_path, "val", build_detection_transform(task.data_config, train=False))
    task.detect = lambda outputs, sizes: [{"boxes": torch.tensor([[28.0, 2.0, 36.0, 10.0]]),
                                           "scores": torch.tensor([0.9]), "labels": torch.tensor([0]),
                                           "queries": torch.tensor([0])}]
    drawn = []
    real_draw_box = explain_detection.draw_box

    def recording_draw_box(image, box, *args, **kwargs):
        drawn.append((image.copy(), list(box)))
        return real_draw_box(image, box, *args, **kwargs)

    monkeypatch.setattr(explain_detection, "draw_box", recording_draw_box)
    options = SimpleNamespace(num_overlays=1, overlay_selection="sample", seed=0, score_threshold=0.3, report=False,
                              query_layers="last", alpha=0.5, batch_size=8, methods=["attention"])
    assert explain_detection.write_detection_overlays(task, ds, options, tmp_path / "out") == 1
    image, box = drawn[0]  # the "detections" picture, before drawing
    assert image.shape[1] > image.shape[0]  # the stored orientation (wider than high), as the boxes
    x0, y0, x1, y1 = (round(v) for v in box)
    inner = image[y0 + 2 : y1 - 2, x0 + 2 : x1 - 2]
    assert inner.size and inner.mean() > 200  # the box lies on the white square


# --- training aids through the task --------------------------------------------------------------------


def test_training_aids_through_the_task_fit_log_and_reload(tmp_path):
    """``DetectionTask`` passes the targets to the head only in training; the aids' terms are
    logged; a checkpoint reloads with the switches; inference equals the same weights without
    the training-only aids."""
    dm = DetectionDataModule(synthetic=SceneSetConfig(num_train=8, num_val=4, image_size=32), cache_dir=str(tmp_path),
                             batching=Batching(batch_size=4, num_workers=0))
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
    aids = dict(dn_groups=2, dn_negatives=True, label_noise_ratio=0.2, box_noise_scale=0.4, query_selection=True,
                look_forward_twice=True, o2m_groups=2, o2m_mode="hybrid")
    task = DetectionTask(enc, head=DETRConfig(num_queries=5, hidden_dim=32, num_layers=2, num_heads=2,
                                              box_refine=True, focal=True, **aids), loss=SetLossConfig(o2m_repeat=3))
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)
    trainer.fit(task, datamodule=dm)
    assert task.criterion.parts == ("dn_", "enc_", "o2m_") and task.criterion.o2m_repeat == 3
    logged = set(trainer.callback_metrics)
    assert {"train/loss_dn_ce", "train/loss_dn_giou", "train/loss_enc_bbox", "train/loss_o2m_ce"} <= logged
    assert "val/loss_enc_ce" in logged and "val/loss_dn_ce" not in logged and "val/loss_o2m_ce" not in logged
    ckpt = tmp_path / "aids.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = load_task(ckpt, expected_task="detection")
    assert loaded.head.dn_groups == 2 and loaded.head.o2m_mode == "hybrid" and loaded.head.query_selection
    x = torch.randn(2, 3, 32, 32)
    task.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x)["pred_boxes"], task(x)["pred_boxes"])
    # defaults: no aid, the criterion's weight table is DETR's
    plain = DetectionTask(enc, class_names=["a"], head=DETRConfig(num_queries=5, hidden_dim=32, num_layers=2,
                                                                  num_heads=2))
    assert plain.criterion.parts == () and not hasattr(plain.head, "label_embed")


def test_checkpoints_from_before_the_training_aids_build_without_them(tmp_path):
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    task = DetectionTask(enc, class_names=["a", "b"], head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1,
                                                                      num_heads=2))
    meta = task.checkpoint_meta()
    stored = meta["model"]["init_args"]
    for k in ("dn_groups", "label_noise_ratio", "box_noise_scale", "dn_negatives", "query_selection",
              "look_forward_twice", "o2m_groups", "o2m_mode"):
        del stored["head"][k]  # as saved before the aids existed
    del stored["loss"]["o2m_repeat"]
    task = build_task_from_meta(meta)
    assert task.head.dn_groups == 0 and task.head.o2m_groups == 0 and task.criterion.parts == ()
