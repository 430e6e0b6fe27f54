"""TIDE's error split equals the tidecv package's (1.0.1) on the same boxes; a hand-computed case;
the detection evaluation's per-image files reconcile with its per-class counts and metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_eval_breakdown import CATEGORIES, _results, _write_case
from vision_attn.metrics.tide import TIDE_ERRORS, tide_errors

tidecv = pytest.importorskip("tidecv", reason="tidecv is the test-only reference (make test installs it)")


def _scenes(seed: int, n_images: int = 30, ties: bool = False, crowd: bool = True):
    """Random boxes of 4 classes; detections: jittered copies (some of another class, some far
    off, some duplicated), background boxes; ``ties``: half the scores are 0.5."""
    rng = np.random.default_rng(seed)
    anns, dets = [], []
    for image in range(n_images):
        for _ in range(rng.integers(0, 5)):
            x, y = rng.uniform(0, 80, 2)
            w, h = rng.uniform(5, 30, 2)
            c = int(rng.integers(1, 5))
            anns.append({"image_id": image, "category_id": c, "bbox": [x, y, w, h],
                         "iscrowd": int(crowd and rng.random() < 0.08)})
            for _ in range(rng.integers(0, 3)):
                j = rng.normal(0, rng.choice([1, 4, 10]), 4)
                dets.append({"image_id": image, "category_id": c if rng.random() < 0.8 else int(rng.integers(1, 5)),
                             "bbox": [x + j[0], y + j[1], max(1.0, w + j[2]), max(1.0, h + j[3])],
                             "score": 0.5 if ties and rng.random() < 0.5 else float(rng.random())})
        for _ in range(rng.integers(0, 3)):
            x, y = rng.uniform(0, 80, 2)
            w, h = rng.uniform(5, 30, 2)
            dets.append({"image_id": image, "category_id": int(rng.integers(1, 5)), "bbox": [x, y, w, h],
                         "score": float(rng.random())})
    return list(range(n_images)), anns, dets


def _reference(images, anns, dets):
    """tidecv's numbers (as fractions) and error counts."""
    from tidecv import TIDE, Data

    gt, pred = Data("gt"), Data("pred")
    for image in images:
        gt.add_image(image, str(image))
    for a in anns:
        if a.get("iscrowd"):
            gt.add_ignore_region(a["image_id"], a["category_id"], a["bbox"], None)
        else:
            gt.add_ground_truth(a["image_id"], a["category_id"], a["bbox"], None)
    for d in dets:
        pred.add_detection(d["image_id"], d["category_id"], d["score"], d["bbox"], None)
    tide = TIDE()
    tide.evaluate(gt, pred, mode=TIDE.BOX, name="run")
    main = {k.lower(): v / 100 for k, v in tide.get_main_errors()["run"].items()}
    special = tide.get_special_errors()["run"]
    run = tide.runs["run"]
    counts = {e.short_name.lower(): len(run.error_dict[e]) for e in TIDE._error_types}
    return run.ap / 100, {**main, "fp": special["FalsePos"] / 100, "fn": special["FalseNeg"] / 100}, counts


@pytest.mark.parametrize("seed", range(6))
def test_equals_tidecv_on_random_scenes(seed):
    images, anns, dets = _scenes(seed, ties=seed % 3 == 1, crowd=seed % 2 == 0)
    ap, dap, counts = _reference(images, anns, dets)
    ours = tide_errors(images, anns, dets)
    assert 0.02 < ap < 0.9 and sum(counts.values()) > 50  # a case with every kind of error
    assert ours.ap50 == pytest.approx(ap, abs=1e-9)
    for kind in (*TIDE_ERRORS, "fp", "fn"):
        assert ours.dap[kind] == pytest.approx(dap[kind], abs=1e-9), kind
    assert ours.counts == counts


def test_hand_computed_case():
    """One class, two boxes. d1 (0.9) takes g1; d2 (0.8) is background; d3 (0.7) overlaps g2 by
    IoU 1/3 (a localisation error); d4 (0.6) duplicates g1; a second image has only a crowd region,
    and a detection on it is ignored (not in AP, still a background error). AP = 51/101 (precision
    1 up to recall 0.5). Fixing d3: TP, FP, TP -> precision 1 up to 0.5 and 2/3 after:
    (51 + 50 * 2/3) / 101. Fixing the false positives' scores changes nothing (already below the
    true one); dropping g2: recall 1 at once."""
    anns = [{"image_id": 1, "category_id": 5, "bbox": [0, 0, 10, 10]},
            {"image_id": 1, "category_id": 5, "bbox": [40, 0, 10, 10]},
            {"image_id": 2, "category_id": 5, "bbox": [0, 0, 50, 50], "iscrowd": 1}]
    dets = [{"image_id": 1, "category_id": 5, "bbox": [0, 0, 10, 10], "score": 0.9},
            {"image_id": 1, "category_id": 5, "bbox": [80, 80, 10, 10], "score": 0.8},
            {"image_id": 1, "category_id": 5, "bbox": [45, 0, 10, 10], "score": 0.7},
            {"image_id": 1, "category_id": 5, "bbox": [1, 0, 10, 10], "score": 0.6},
            {"image_id": 2, "category_id": 5, "bbox": [5, 5, 10, 10], "score": 0.95}]
    r = tide_errors([1, 2], anns, dets)
    base = 51 / 101
    assert r.ap50 == pytest.approx(base)
    assert r.dap["loc"] == pytest.approx((51 + 50 * 2 / 3) / 101 - base)
    assert r.dap["bkg"] == pytest.approx(0.0) and r.dap["dupe"] == pytest.approx(0.0)
    assert r.dap["fp"] == pytest.approx(0.0) and r.dap["fn"] == pytest.approx(1.0 - base)
    # the detection on the crowd region is left out of AP but, as in TIDE, still counted as an error
    assert r.counts == {"cls": 0, "loc": 1, "both": 0, "dupe": 1, "bkg": 2, "miss": 0}
    assert _reference([1, 2], anns, dets) == (pytest.approx(r.ap50), pytest.approx(r.dap), r.counts)
    assert [d["outcome"] for d in r.detections] == ["tp", "bkg", "loc", "dupe", "ignored"]
    assert r.detections[2]["iou"] == pytest.approx(5 / 15) and r.detections[2]["gt"] == 1
    assert [t["outcome"] for t in r.truths] == ["tp", "fn", "crowd"]
    assert r.truths[1]["error"] == "loc" and r.truths[0]["det"] == 0  # g2 is recoverable, not missed
    assert r.metrics()["tide_loc"] == r.dap["loc"] and r.metrics()["tide_count_dupe"] == 1.0


def test_evaluation_files_reconcile_with_the_counts_and_tidecv(tmp_path, tiny_encoder):
    """DetectionTask.eval_results on a split with crowd regions, wrong classes and misses: the
    tide_* metrics equal tidecv's on the written results; per_class.csv's counts are those of
    results_per_image.csv at the threshold; its n_gt is per_class.json's; P / R / F1 follow."""
    from vision_attn.data.detection import CocoDetection
    from vision_attn.models.detr import DETRConfig
    from vision_attn.tasks import DetectionTask
    from vision_attn.tasks.detection import DetectionOptions
    from vision_attn.tasks.detection_results import class_counts

    dets = _write_case(tmp_path)
    ds = CocoDetection(tmp_path, "val")
    task = DetectionTask(tiny_encoder, class_names=ds.class_names, category_ids=ds.category_ids,
                         head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2))
    task.set_inference_options(DetectionOptions(score_threshold=0.4))
    task.eval_records = [{"image_id": i, "det": d} for i, d in dets.items()]
    metrics, results = task.eval_results(ds)
    assert len(results) == len(_results(dets))
    truth = json.loads((tmp_path / "annotations" / "instances_val.json").read_text())
    ap, dap, counts = _reference([im["id"] for im in truth["images"]], truth["annotations"], results)
    assert metrics["tide_ap50"] == pytest.approx(ap, abs=1e-9)
    for kind in (*TIDE_ERRORS, "fp", "fn"):
        assert metrics[f"tide_{kind}"] == pytest.approx(dap[kind], abs=1e-9)
        if kind in counts:
            assert metrics[f"tide_count_{kind}"] == counts[kind]
    files = task.eval_files(ds)
    per_image, rows, per_class = files["results_per_image.json"], files["results_per_image.csv"], files["per_class.csv"]
    assert [e["image_id"] for e in per_image] == [im["id"] for im in ds.images]
    assert len(rows) == sum(len(e["truths"]) + len(e["detections"]) for e in per_image) == len(results) + len(
        truth["annotations"])
    found = class_counts(per_image, 0.4)
    by_rows: dict[str, list[int]] = {}
    for row in rows:  # the counts again, from the CSV rows alone
        entry = by_rows.setdefault(row["category"], [0, 0, 0])
        if row["kind"] == "detection" and row["score"] >= 0.4 and row["outcome"] not in ("ignored", "unscored"):
            entry[0 if row["outcome"] == "tp" else 1] += 1
        if row["kind"] == "truth" and row["outcome"] in ("tp", "fn"):
            entry[2] += 0 if row["outcome"] == "tp" and row["score"] >= 0.4 else 1
    assert {k: tuple(v) for k, v in by_rows.items()} == found
    assert [r["class"] for r in per_class] == [c["name"] for c in CATEGORIES]
    for r in per_class:
        tp, fp, fn = found.get(r["class"], (0, 0, 0))
        assert (r["tp"], r["fp"], r["fn"]) == (tp, fp, fn)
        assert r["n_gt"] == files["per_class.json"][r["class"]]["n_gt"]
        if tp + fp:
            assert r["precision"] == pytest.approx(tp / (tp + fp))
        if tp + fn:
            assert r["recall"] == pytest.approx(tp / (tp + fn))
        if r["precision"] and r["recall"]:
            assert r["f1"] == pytest.approx(2 * r["precision"] * r["recall"] / (r["precision"] + r["recall"]))
    assert any(r["fp"] for r in per_class) and any(r["fn"] for r in per_class) and any(r["tp"] for r in per_class)
    outcomes = {d["outcome"] for e in per_image for d in e["detections"]}
    assert {"tp", "ignored", "bkg"} <= outcomes  # crowd regions: a detection inside one is ignored


def test_eval_summary_names_the_worst_classes_and_the_error_split():
    from vision_attn.commands.evaluate import eval_summary

    metrics = {"map": 0.5, "map_50": 0.75, "tide_ap50": 0.7, "tide_fp": 0.1, "tide_fn": 0.2,
               **{f"tide_{k}": 0.01 * (i + 1) for i, k in enumerate(TIDE_ERRORS)}}
    aps = (("a", 0.9), ("b", 0.2), ("c", -1.0), ("d", 0.4), ("e", 0.3))
    rows = [{"class": c, "ap": ap, "f1": 0.5} for c, ap in aps]
    lines = eval_summary(("map", "map_50", "missing"), metrics, {"per_class.csv": rows})
    assert lines == ["results: map 0.5000, map_50 0.7500",
                     "worst classes by AP: b 0.200, e 0.300, d 0.400",  # c has no ground truth (-1)
                     "TIDE dAP at IoU 0.5: cls 0.010, loc 0.020, both 0.030, dupe 0.040, bkg 0.050, miss 0.060; "
                     "false positives 0.100, false negatives 0.200"]
    f1 = eval_summary(("acc_top1",), {"acc_top1": 0.9}, {"per_class.csv": [{"class": "x", "f1": 0.3},
                                                                           {"class": "y", "f1": None}]})
    assert f1 == ["results: acc_top1 0.9000", "worst classes by F1: x 0.300"]
