"""Per-class and per-size breakdowns (vision_attn.metrics.breakdown) against hand counts, torchmetrics
and pycocotools' COCOeval on the same predictions."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision, MulticlassRecall

from vision_attn.metrics.breakdown import (
    COCO_SUMMARY_KEYS,
    classification_breakdown,
    confusion_counts,
    detection_breakdown,
)
from vision_attn.models.detr import DETRConfig

# ---------------------------------------------------------------------------------------------- classification


def test_confusion_and_per_class_equal_hand_counts():
    # truth:  a a a b b c c c c ; d has no image; c is never predicted right; b is never predicted
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    preds = [0, 0, 2, 0, 3, 0, 3, 3, 0]
    per_class, confusion = classification_breakdown(labels, preds, ["a", "b", "c", "d"])
    assert confusion == {"labels": ["a", "b", "c", "d"],
                         "counts": [[2, 0, 1, 0],
                                    [1, 0, 0, 1],
                                    [2, 0, 0, 2],
                                    [0, 0, 0, 0]]}
    assert per_class["a"] == {"acc": 2 / 3, "n": 3, "precision": 2 / 5, "recall": 2 / 3}
    assert per_class["b"] == {"acc": 0.0, "n": 2, "precision": None, "recall": 0.0}  # never predicted
    assert per_class["c"] == {"acc": 0.0, "n": 4, "precision": 0.0, "recall": 0.0}
    assert per_class["d"] == {"acc": None, "n": 0, "precision": 0.0, "recall": None}  # no image of d
    assert list(per_class) == confusion["labels"]


def test_per_class_equals_torchmetrics_and_diagonal_gives_accuracy():
    torch.manual_seed(0)
    n, c = 200, 6
    labels = torch.randint(0, c, (n,))
    logits = torch.randn(n, c) + 2.0 * torch.nn.functional.one_hot(labels, c)  # better than chance
    preds = logits.argmax(1)
    per_class, confusion = classification_breakdown(labels, preds, [f"k{i}" for i in range(c)])
    counts = torch.tensor(confusion["counts"])
    assert int(counts.sum()) == n
    top1 = MulticlassAccuracy(c, average="micro")(logits, labels)
    assert float(counts.trace()) / n == pytest.approx(float(top1), abs=1e-6)
    for name, metric in (("acc", MulticlassAccuracy), ("precision", MulticlassPrecision), ("recall", MulticlassRecall)):
        reference = metric(c, average=None)(logits, labels).tolist()
        assert [per_class[f"k{i}"][name] for i in range(c)] == pytest.approx(reference, abs=1e-6), name
    assert [per_class[f"k{i}"]["n"] for i in range(c)] == torch.bincount(labels, minlength=c).tolist()
    assert 0.2 < float(top1) < 0.95  # a case where mistakes fill the off-diagonal cells


def test_confusion_counts_refuses_out_of_range_and_ragged_inputs():
    with pytest.raises(ValueError, match="outside 0..2"):
        confusion_counts([0, 3], [0, 1], 3)
    with pytest.raises(ValueError, match="2 labels but 1 predictions"):
        confusion_counts([0, 1], [0], 3)
    with pytest.raises(ValueError, match="not unique"):
        classification_breakdown([0], [0], ["a", "a"])


# ---------------------------------------------------------------------------------------------- detection
CATEGORIES = [{"id": 3, "name": "a"}, {"id": 7, "name": "b"}, {"id": 11, "name": "c"}, {"id": 20, "name": "d"}]
SIDES = {"small": (12, 26), "medium": (36, 80), "large": (100, 140)}  # box sides: areas < 32^2, < 96^2, above


def _write_case(root: Path, sizes: tuple[str, ...] = ("small", "medium", "large"), n_images: int = 6, seed: int = 0):
    """A 160 x 160 split in COCO layout with sparse category ids: objects of ``sizes`` of
    categories a and b, crowd regions of a; detections: jittered true boxes of a (some with the
    wrong class, some at IoU 0.52), none of b, false positives of c (which has no ground truth), nothing of d.
    Returns ``{image_id: {"boxes" xyxy, "scores", "labels"}}`` (labels 0..3 in category order)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (root / "val").mkdir(parents=True)
    (root / "annotations").mkdir()
    images, anns, dets = [], [], {}
    for i in range(1, n_images + 1):
        Image.fromarray(rng.integers(0, 255, (160, 160, 3), dtype=np.uint8)).save(root / "val" / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": 160, "height": 160})
        boxes, scores, labels = [], [], []

        def add(box, label, crowd=0, _i=i):
            anns.append({"id": len(anns) + 1, "image_id": _i, "category_id": CATEGORIES[label]["id"], "bbox": box,
                         "area": box[2] * box[3], "iscrowd": crowd})

        for size in sizes:
            lo, hi = SIDES[size]
            w, h = (float(v) for v in rng.uniform(lo, hi, 2))
            x, y = (float(v) for v in rng.uniform(0, 160 - max(w, h), 2))
            add([x, y, w, h], 0)
            j = rng.normal(0, 0.06 * w, 4)
            if i % 3 == 0:  # shifted by 0.316 w: IoU 0.52, a match at IoU 0.5 but not at 0.55
                j = [0.316 * w, 0.0, 0.316 * w, 0.0]
            boxes.append([x + j[0], y + j[1], x + w + j[2], y + h + j[3]])
            labels.append(0 if rng.random() > 0.25 else 2)
            scores.append(float(rng.uniform(0.2, 1.0)))
            add([float(v) for v in (*rng.uniform(0, 100, 2), rng.uniform(lo, hi), rng.uniform(lo, hi))], 1)  # missed
        if i % 2:
            add([100.0, 100.0, 50.0, 50.0], 0, crowd=1)  # a crowd region, with a detection inside
            boxes.append([110.0, 110.0, 140.0, 145.0])
            labels.append(0)
            scores.append(0.9)
        for _ in range(2):  # false positives, of a and of c
            x, y = rng.uniform(0, 120, 2)
            boxes.append([x, y, x + rng.uniform(8, 40), y + rng.uniform(8, 40)])
            labels.append(int(rng.choice([0, 2])))
            scores.append(float(rng.uniform(0.0, 0.8)))
        dets[i] = {"boxes": torch.tensor(boxes, dtype=torch.float32), "scores": torch.tensor(scores),
                   "labels": torch.tensor(labels)}
    (root / "annotations" / "instances_val.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": CATEGORIES}))
    return dets


def _results(dets) -> list[dict]:
    """The COCO results list of ``dets`` (what predictions.json holds)."""
    out = []
    for image_id, d in dets.items():
        for (x0, y0, x1, y1), s, lab in zip(d["boxes"].tolist(), d["scores"].tolist(), d["labels"].tolist(),
                                            strict=True):
            out.append({"image_id": image_id, "category_id": CATEGORIES[lab]["id"], "bbox": [x0, y0, x1 - x0, y1 - y0],
                        "score": s})
    return out


def _coco_eval(ann_file: Path, results: list[dict], cat_ids: list[int] | None = None) -> np.ndarray:
    """pycocotools' COCOeval summary (12 numbers), of all categories or of ``cat_ids`` only."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann_file))
        ev = COCOeval(gt, gt.loadRes(results), "bbox")
        if cat_ids is not None:
            ev.params.catIds = cat_ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats


def _scored(root: Path, dets):
    from vision_attn.data.detection import CocoDetection

    ds = CocoDetection(root, "val")
    ids = sorted(dets)
    return ds, [dets[i] for i in ids], [ds.scoring_target(i) for i in ids]


def test_size_ranges_and_recalls_equal_pycocotools(tmp_path):
    dets = _write_case(tmp_path)
    ds, preds, targets = _scored(tmp_path, dets)
    ours = detection_breakdown(preds, targets, ds.class_names).metrics
    stats = _coco_eval(ds.ann_file, _results(dets))
    assert list(ours) == list(COCO_SUMMARY_KEYS)
    for key, ref in zip(COCO_SUMMARY_KEYS, stats[:9], strict=True):  # COCOeval's order
        assert ours[key] == pytest.approx(ref, abs=1e-6), key
    # a non-trivial case: every range scored, and the numbers differ between them
    assert all(0.02 < ours[k] < 0.98 for k in ("map", "map_small", "map_medium", "map_large"))
    assert len({round(ours[k], 4) for k in ("map_small", "map_medium", "map_large")}) == 3
    assert ours["mar_1"] < ours["mar_10"]


def test_a_size_range_without_ground_truth_is_minus_one_as_in_pycocotools(tmp_path):
    dets = _write_case(tmp_path, sizes=("small", "medium"))
    ds, preds, targets = _scored(tmp_path, dets)
    ours = detection_breakdown(preds, targets, ds.class_names).metrics
    stats = _coco_eval(ds.ann_file, _results(dets))
    assert ours["map_large"] == stats[5] == -1.0
    for key, ref in zip(COCO_SUMMARY_KEYS, stats[:9], strict=True):
        assert ours[key] == pytest.approx(ref, abs=1e-6), key


def test_per_category_ap_equals_pycocotools_per_category(tmp_path):
    """Each category evaluated alone by COCOeval (``params.catIds = [id]``): AP, AP50; -1 for c
    (detections, no ground truth) and d (nothing), 0 for b (ground truth, never detected)."""
    dets = _write_case(tmp_path)
    ds, preds, targets = _scored(tmp_path, dets)
    per_class = detection_breakdown(preds, targets, ds.class_names).per_class
    assert list(per_class) == ["a", "b", "c", "d"]
    results = _results(dets)
    anns = json.loads(ds.ann_file.read_text())["annotations"]
    for cat in CATEGORIES:
        stats = _coco_eval(ds.ann_file, results, [cat["id"]])
        entry = per_class[cat["name"]]
        assert entry["ap"] == pytest.approx(stats[0], abs=1e-6), cat
        assert entry["ap_50"] == pytest.approx(stats[1], abs=1e-6), cat
        assert entry["n_gt"] == sum(a["category_id"] == cat["id"] and not a["iscrowd"] for a in anns)
    assert 0.05 < per_class["a"]["ap"] < per_class["a"]["ap_50"] < 1.0
    assert per_class["b"]["ap"] == 0.0 and per_class["b"]["n_gt"] == 18
    assert per_class["c"]["ap"] == per_class["d"]["ap"] == -1.0 and per_class["d"]["n_gt"] == 0


def test_detection_task_writes_the_breakdown(tmp_path, tiny_encoder):
    """DetectionTask.eval_results adds the size ranges and recalls to metrics.json, and its
    eval_files gives per_class.json, both equal to pycocotools on the written results."""
    from vision_attn.tasks import DetectionTask

    dets = _write_case(tmp_path)
    ds, _, _ = _scored(tmp_path, dets)
    task = DetectionTask(tiny_encoder, class_names=ds.class_names, category_ids=ds.category_ids,
                         head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2))
    task.eval_records = [{"image_id": i, "det": d} for i, d in dets.items()]
    metrics, results = task.eval_results(ds)
    stats = _coco_eval(ds.ann_file, results)
    for key, ref in zip(COCO_SUMMARY_KEYS, stats[:9], strict=True):
        assert metrics[key] == pytest.approx(ref, abs=1e-6), key
    assert task.eval_file_names == ("per_class.json", "pr_curves.json", "per_class.csv", "results_per_image.json",
                                    "results_per_image.csv")
    files = task.eval_files(ds)
    assert set(files) == set(task.eval_file_names)
    precision, cat_ids, _ = _coco_precision(ds.ann_file, results)
    for cat in CATEGORIES:
        assert files["per_class.json"][cat["name"]]["ap"] == pytest.approx(
            _coco_eval(ds.ann_file, results, [cat["id"]])[0], abs=1e-6)
        assert np.allclose(files["pr_curves.json"][cat["name"]]["precision"],
                           precision[0, :, cat_ids.index(cat["id"]), 0, -1], atol=1e-6, rtol=0)


def test_repeated_category_names_are_told_apart():
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    preds = [{"boxes": boxes, "scores": torch.tensor([0.9]), "labels": torch.tensor([1])}]
    targets = [{"boxes": boxes, "labels": torch.tensor([1])}]
    per_class = detection_breakdown(preds, targets, ["car", "car", "bus"]).per_class
    assert per_class == {"car [0]": {"ap": -1.0, "ap_50": -1.0, "n_gt": 0},
                         "car [1]": {"ap": 1.0, "ap_50": 1.0, "n_gt": 1},
                         "bus": {"ap": -1.0, "ap_50": -1.0, "n_gt": 0}}


def _coco_precision(ann_file: Path, results: list[dict]) -> tuple[np.ndarray, list[int], np.ndarray]:
    """pycocotools' accumulated precision array ``[T, R, K, A, M]``, its category ids and recall thresholds."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann_file))
        ev = COCOeval(gt, gt.loadRes(results), "bbox")
        ev.evaluate()
        ev.accumulate()
    return ev.eval["precision"], list(ev.params.catIds), ev.params.recThrs


def test_pr_curves_equal_pycocotools_precision_array(tmp_path):
    """pr_curves.json: per category, pycocotools' precision[IoU 0.5, :, k, all areas, 100 dets]
    over its recall thresholds; -1 throughout for c (detections, no ground truth) and d (nothing)."""
    dets = _write_case(tmp_path)
    ds, preds, targets = _scored(tmp_path, dets)
    curves = detection_breakdown(preds, targets, ds.class_names).pr_curves
    precision, cat_ids, rec_thrs = _coco_precision(ds.ann_file, _results(dets))
    assert list(curves) == ["a", "b", "c", "d"]
    for cat in CATEGORIES:
        k = cat_ids.index(cat["id"])
        ref = precision[0, :, k, 0, -1]
        ours = curves[cat["name"]]
        assert np.allclose(ours["recall"], rec_thrs, atol=1e-12, rtol=0)
        assert np.allclose(ours["precision"], ref, atol=1e-6, rtol=0), cat
    a = np.asarray(curves["a"]["precision"])
    assert a[0] > 0.3 and a[-1] == 0.0 and len(set(a.round(4))) > 3  # a real curve, cut where recall ends
    assert np.all(np.diff(a) <= 1e-12)  # COCOeval's interpolation: never increasing
    assert curves["b"]["precision"] == [0.0] * 101  # ground truth, never detected
    assert curves["c"]["precision"] == curves["d"]["precision"] == [-1.0] * 101
    json.dumps(curves)  # plain floats: what pr_curves.json holds


def test_pr_curves_from_precision_refuses_a_mismatched_array():
    from vision_attn.metrics.breakdown import pr_curves_from_precision

    with pytest.raises(ValueError, match="does not match"):
        pr_curves_from_precision(torch.zeros(10, 101, 2, 4, 3), [0], ["a", "b"])
    assert pr_curves_from_precision(None, [], ["a"])["a"]["precision"] == [-1.0] * 101
