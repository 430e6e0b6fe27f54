"""Detection task: mAP equals pycocotools' COCOeval; predictions.json in COCO results format."""

from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest
import torch

from vision_attn import create_encoder, load_task
from vision_attn.data.detection import DetectionDataModule
from vision_attn.data.synthetic import SceneSetConfig
from vision_attn.tasks import DetectionTask
from vision_attn.tasks.detection import mean_average_precision


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
    dm = DetectionDataModule(synthetic=SceneSetConfig(num_train=16, num_val=6, image_size=32), batch_size=8,
                             num_workers=0, cache_dir=str(tmp_path))
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    task = DetectionTask(enc, num_queries=5, hidden_dim=32, num_layers=2, num_heads=2, box_refine=True, focal=True)
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
