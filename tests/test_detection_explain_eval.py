"""Detection explanations measured at evaluation: matching, localisation, faithfulness, maps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks import DetectionTask

from .conftest import REPO


def _tiny_task(tiny_encoder, focal=False, num_classes=2):
    return DetectionTask(tiny_encoder, num_classes=num_classes, category_ids=[3, 7][:num_classes],
                         head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2, focal=focal)).eval()


# --- matching --------------------------------------------------------------------------------------------


def test_match_detections_greedy_by_score_same_class_once_and_never_crowd():
    from vision_attn.explain.detection import match_detections

    truth = torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0], [40.0, 40.0, 50.0, 50.0],
                          [0.0, 20.0, 10.0, 30.0]])
    truth_labels = torch.tensor([0, 1, 0, 0])
    crowd = torch.tensor([0, 0, 0, 1])
    dets = torch.tensor([
        [0.0, 0.0, 10.0, 9.0],     # box 0 (IoU 0.9)
        [0.0, 0.0, 10.0, 10.0],    # box 0 again, exact: already taken by the better-scored detection
        [20.0, 20.0, 30.0, 30.0],  # box 1's place, but class 0: no match
        [40.0, 40.0, 50.0, 44.0],  # box 2 with IoU 0.4 < 0.5
        [0.0, 20.0, 10.0, 30.0],   # exactly on the crowd region: never matched
        [40.0, 40.0, 50.0, 46.0],  # box 2 with IoU 0.6
    ])
    labels = torch.tensor([0, 0, 0, 0, 0, 0])
    assert match_detections(dets, labels, truth, truth_labels, crowd) == [0, -1, -1, -1, -1, 2]
    # without crowd flags the region is an ordinary box
    assert match_detections(dets, labels, truth, truth_labels)[4] == 3
    assert match_detections(dets[:0], labels[:0], truth, truth_labels) == []
    assert match_detections(dets, labels, truth[:0], truth_labels[:0]) == [-1] * 6


# --- the explained score ---------------------------------------------------------------------------------


@pytest.mark.parametrize("focal", [False, True])
def test_probability_column_is_the_detection_score_and_starts_the_deletion_curve(tiny_encoder, focal):
    from vision_attn.explain.detection import detection_probabilities
    from vision_attn.explain.faithfulness import deletion_insertion_curve

    task = _tiny_task(tiny_encoder, focal=focal)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dets = task.detect(task(images), torch.tensor([[32, 32], [32, 32]]))
    proba, width = detection_probabilities(task)
    assert width == 2 + (0 if focal else 1)
    rows = torch.tensor([0, 0, 1])
    picks = [(0, 0), (0, 1), (1, 0)]  # (image, rank of the detection)
    target = torch.tensor([int(dets[b]["queries"][k]) * width + int(dets[b]["labels"][k]) for b, k in picks])
    scores = torch.tensor([float(dets[b]["scores"][k]) for b, k in picks])
    assert torch.allclose(proba(images)[rows].gather(1, target[:, None]).squeeze(1), scores, atol=1e-6)
    sal = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(1))
    curve = deletion_insertion_curve(proba, images[rows], sal, target, "deletion", steps=4)
    assert torch.allclose(curve[:, 0], scores, atol=1e-6)  # nothing deleted yet: the detection's score


# --- localisation, faithfulness and saved maps on a hand-made split ---------------------------------------


def _split(root, n_images=10, seed=0, masks=False):
    """64 x 64 images with one or two 20 x 20 objects whose centres lie in the inner patch cells
    of a 4 x 4 grid (16 px each) and a hand-made detection list per image: every object with its
    class, plus a wrong-class detection on the first object (unmatched)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (root / "val").mkdir(parents=True)
    (root / "annotations").mkdir()
    images, anns, dets = [], [], []
    for i in range(1, n_images + 1):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / "val" / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": 64, "height": 64})
        boxes, labels = [], []
        for _ in range(int(rng.integers(1, 3))):
            cx, cy = rng.uniform(17, 47, 2)
            box = [float(cx - 10), float(cy - 10), float(cx + 10), float(cy + 10)]
            label = int(rng.integers(2))
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": [3, 7][label],
                         "bbox": [box[0], box[1], 20.0, 20.0], "area": 400.0, "iscrowd": 0})
            if masks:  # the square's pixels as a polygon
                x0, y0, x1, y1 = box
                anns[-1]["segmentation"] = [[x0, y0, x1, y0, x1, y1, x0, y1]]
            boxes.append(box)
            labels.append(label)
        boxes.append(boxes[0])
        labels.append(1 - labels[0])
        k = len(boxes)
        dets.append({"boxes": torch.tensor(boxes), "labels": torch.tensor(labels),
                     "scores": torch.linspace(0.9, 0.5, k), "queries": torch.arange(k)})
    cats = [{"id": 3, "name": "a"}, {"id": 7, "name": "b"}]
    (root / "annotations" / "instances_val.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return dets


def _attend_to_the_objects(monkeypatch, task, dets: list[dict]) -> None:
    """``task`` detects ``dets`` (one image after the other) and its raw attention map of each
    detection is 1 at the patch of the detection's centre (16 px patches), 0 elsewhere."""
    queue, current = list(dets), list(dets)
    monkeypatch.setattr(task, "detect", lambda outputs, sizes: [queue.pop(0) for _ in range(len(sizes))])

    def on_the_object(cross_attn, queries, grid, layers="last"):
        boxes = current[0]["boxes"][queries]
        maps = torch.zeros(len(queries), *grid)
        for k, (x0, y0, x1, y1) in enumerate(boxes.tolist()):
            maps[k, int((y0 + y1) / 2 // 16), int((x0 + x1) / 2 // 16)] = 1.0
        current.pop(0)
        return maps

    monkeypatch.setattr("vision_attn.explain.detection.query_attention_maps", on_the_object)


def test_map_on_the_object_points_at_it_and_random_gets_the_area_share(tmp_path, tiny_encoder, monkeypatch):
    import vision_attn.explain.detection as det_explain
    from vision_attn.data.detection import CocoDetection, build_detection_transform

    dets = _split(tmp_path)
    task = _tiny_task(tiny_encoder)
    ds = CocoDetection(tmp_path, "val", build_detection_transform(task.data_config, train=False))
    _attend_to_the_objects(monkeypatch, task, dets)
    options = ExplainOptions(methods=["attention", "relevance"], faithfulness_images=len(dets), steps=4,
                             save_maps=True, batch_size=4, score_threshold=0.3)
    metrics = det_explain.detection_explain_metrics(task, ds, options, tmp_path / "out")
    assert metrics["pointing_attention"] == 1.0
    assert metrics["energy_attention"] > 0.3
    area_share = 400 / 64**2
    assert metrics["energy_random"] == pytest.approx(area_share, abs=0.04)
    assert metrics["pointing_random"] < 0.5
    keys = {f"{k}_{m}" for k in ("pointing", "energy", "deletion_auc", "insertion_auc")
            for m in ("attention", "relevance", "random")} | {"deletion_auc", "insertion_auc"}
    assert set(metrics) == keys
    assert all(0.0 <= v <= 1.0 for v in metrics.values())
    assert metrics["deletion_auc"] == metrics["deletion_auc_attention"]
    # saved maps: one per detection and method, original pixels; the wrong-class detection has no truth
    index = json.loads((tmp_path / "out" / "maps" / "index.json").read_text())
    assert len(index) == sum(len(d["queries"]) for d in dets)
    assert [e["truth"] is None for e in index] == [k == len(d["queries"]) - 1 for d in dets
                                                     for k in range(len(d["queries"]))]
    first = index[0]
    assert first["file"] == "val/1.png" and first["image_id"] == 1 and first["detection"] == 0
    assert first["box"] == pytest.approx(first["truth"]) and first["label"] in ("0", "1")  # the task's class names
    for m in ("attention", "relevance", "random"):
        arr = np.load(tmp_path / "out" / "maps" / m / f"{first['index']:05d}_{first['detection']}.npy")
        assert arr.dtype == np.float32 and arr.shape == (64, 64)


def test_masks_of_the_matched_objects_score_the_maps(tmp_path, tiny_encoder, monkeypatch):
    """With masks in the instances file, each matched detection's maps are scored against its
    object's mask too: a map on the object beats the random baseline on mIoU and mAP."""
    import vision_attn.explain.detection as det_explain
    from vision_attn.data.detection import CocoDetection, build_detection_transform

    dets = _split(tmp_path, masks=True)
    task = _tiny_task(tiny_encoder)
    ds = CocoDetection(tmp_path, "val", build_detection_transform(task.data_config, train=False))
    first = ds.scoring_masks(1)[0].decode()
    box = ds.scoring_target(1)["boxes"][0].tolist()
    assert first.shape == (64, 64) and abs(int(first.sum()) - 400) <= 40  # the 20 x 20 square
    ys, xs = np.nonzero(first)
    assert abs(xs.min() - box[0]) <= 1 and abs(ys.max() + 1 - box[3]) <= 1
    _attend_to_the_objects(monkeypatch, task, dets)
    options = ExplainOptions(methods=["attention"], faithfulness_images=len(dets), faithfulness=False,
                             batch_size=4, score_threshold=0.3)
    metrics = det_explain.detection_explain_metrics(task, ds, options, tmp_path / "out")
    assert {"pixel_acc_attention", "miou_attention", "map_mask_attention", "miou_random"} <= set(metrics)
    assert metrics["miou_attention"] > metrics["miou_random"] + 0.15
    assert metrics["map_mask_attention"] > metrics["map_mask_random"] + 0.15


def test_no_detection_gives_no_numbers(tmp_path, tiny_encoder, monkeypatch, caplog):
    from vision_attn.data.detection import CocoDetection, build_detection_transform
    from vision_attn.explain.detection import detection_explain_metrics

    _split(tmp_path, n_images=2)
    task = _tiny_task(tiny_encoder)
    ds = CocoDetection(tmp_path, "val", build_detection_transform(task.data_config, train=False))
    options = ExplainOptions(methods=["attention"], faithfulness_images=2, steps=2, score_threshold=1.01)
    assert detection_explain_metrics(task, ds, options, tmp_path / "out") == {}
    assert "no detection scored at least" in caplog.text


PINNED = {
    "deletion_auc": 0.30269152522087095, "deletion_auc_attention": 0.30269152522087095,
    "deletion_auc_random": 0.3049205422401428, "deletion_auc_relevance": 0.2921755015850067,
    "energy_attention": 0.11923006154281124, "energy_random": 0.10390814061968809,
    "energy_relevance": 0.11711883423281515, "insertion_auc": 0.30858898162841797,
    "insertion_auc_attention": 0.30858898162841797, "insertion_auc_random": 0.30538699626922605,
    "insertion_auc_relevance": 0.31708587408065797, "pointing_attention": 0.5714285714285714,
    "pointing_random": 0.2857142857142857, "pointing_relevance": 0.42857142857142855,
    "sanity_attention": 0.08147058823529411, "sanity_random": 1.0, "sanity_relevance": -0.06441176470588236,
}
PINNED_OUTPUTS = {
    "sanity": {"attention/head": 0.13366120721177194, "attention/block1": 0.137613934049077,
               "attention/block0": 0.12606091277570472, "attention/all": 0.08147058823529411,
               "relevance/head": -0.012941176470588244, "relevance/block1": 0.05323529411764707,
               "relevance/block0": -0.05882352941176472, "relevance/all": -0.06441176470588236, "random/head": 1.0,
               "random/block1": 1.0, "random/block0": 1.0, "random/all": 1.0},
    "maps": {"attention": 25796.136580586433, "random": 20721.128681261092, "relevance": 17735.60358034633},
}


def test_explanation_numbers_are_pinned(tmp_path, tiny_encoder, monkeypatch):
    """The measures of the model's own maps (attention, relevance, random) of hand-made
    detections, at most two per image, in three batches: every number, the sanity curves and
    the saved maps keep their values."""
    from vision_attn.data.detection import CocoDetection, build_detection_transform
    from vision_attn.explain.detection import detection_explain_metrics

    from .test_measures import assert_pinned, explanation_outputs

    dets = _split(tmp_path / "data", n_images=5)
    task = _tiny_task(tiny_encoder)
    ds = CocoDetection(tmp_path / "data", "val", build_detection_transform(task.data_config, train=False))
    queue = list(dets)
    monkeypatch.setattr(task, "detect", lambda outputs, sizes: [queue.pop(0) for _ in range(len(sizes))])
    options = ExplainOptions(methods=["attention", "relevance"], faithfulness_images=5, steps=3, save_maps=True,
                             sanity=True, batch_size=2, score_threshold=0.3, decoder_rule="full")
    metrics = detection_explain_metrics(task, ds, options, tmp_path / "out", max_objects=2)
    assert_pinned(metrics, PINNED)  # the paper's rule (the pins were taken with it)
    outputs = explanation_outputs(tmp_path / "out")
    kept = [(i, k) for i, d in enumerate(dets) for k in range(min(2, len(d["queries"])))]
    assert [(e["index"], e["detection"]) for e in outputs["index"]] == kept
    assert_pinned(outputs["sanity"], PINNED_OUTPUTS["sanity"])
    assert outputs["maps"] == pytest.approx(PINNED_OUTPUTS["maps"], rel=1e-5)
    # the head's default rule (DETECTION_RULE, the decoder's part alone) draws other relevance maps
    queue[:] = list(dets)
    options.decoder_rule, options.save_maps, options.sanity = None, False, False
    default = detection_explain_metrics(task, ds, options, tmp_path / "default", max_objects=2)
    assert default["energy_attention"] == pytest.approx(metrics["energy_attention"])
    assert default["energy_relevance"] != pytest.approx(metrics["energy_relevance"])


# --- eval.py on a trained checkpoint ----------------------------------------------------------------------


def test_eval_writes_detection_explanation_metrics_and_maps(tmp_path):
    from vision_attn.commands.evaluate import eval_main
    from vision_attn.commands.train import train_main

    cfg = str(REPO / "configs" / "detection" / "shapes.yaml")
    enc = "--model.init_args.encoder.init_args."
    common = ["--config", cfg, "--data.init_args.synthetic.num_train", "8", "--data.init_args.synthetic.num_val", "3",
              "--data.init_args.synthetic.image_size", "32", "--data.init_args.batching.num_workers", "0",
              "--data.init_args.cache_dir", str(tmp_path / "data")]
    out = tmp_path / "det"
    train_main([*common, f"{enc}img_size", "32", f"{enc}embed_dim", "32", f"{enc}depth", "1", f"{enc}num_heads", "2",
                "--model.init_args.head.hidden_dim", "32", "--model.init_args.head.num_layers", "1",
                "--model.init_args.head.num_heads", "2", "--model.init_args.head.num_queries", "4",
                "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
                "--trainer.default_root_dir", str(out)])
    metrics = eval_main([*common, "--ckpt_path", str(out / "checkpoints" / "last.ckpt"),
                         "--output_dir", str(out / "eval"), "--explain.num_overlays", "1",
                         "--explain.score_threshold", "0.0", "--explain.faithfulness_images", "2",
                         "--explain.steps", "3", "--explain.save_maps", "true", "--explain.sanity", "true",
                         "--explain.report", "false"])
    saved = json.loads((out / "eval" / "metrics.json").read_text())
    assert saved == metrics
    methods = ("lrp_attention", "attention", "random")  # the defaults
    expected = {f"{k}_{m}" for k in ("deletion_auc", "insertion_auc", "sanity") for m in methods}
    assert expected <= set(saved)
    assert saved["sanity_random"] == pytest.approx(1.0)  # the baseline ignores the model
    explained = {k: v for k, v in saved.items() if k.split("_")[0] in ("pointing", "energy", "deletion",
                                                                        "insertion", "sanity")}
    assert all(0.0 <= v <= 1.0 + 1e-6 for k, v in explained.items() if not k.startswith("sanity"))
    index = json.loads((out / "eval" / "maps" / "index.json").read_text())
    assert index and (any(e["truth"] for e in index) == ("pointing_attention" in saved))
    preds = json.loads((out / "eval" / "predictions.json").read_text())
    assert {e["image_id"] for e in index} <= {p["image_id"] for p in preds}
    for e in index:
        for m in methods:
            arr = np.load(out / "eval" / "maps" / m / f"{e['index']:05d}_{e['detection']}.npy")
            assert arr.shape == (32, 32) and arr.dtype == np.float32
    assert json.loads((out / "eval" / "sanity.json").read_text())["steps"][-1] == "all"
    # the object-by-object files and every mistake in the browser
    assert {"tide_ap50", "tide_cls", "tide_miss", "tide_fp", "tide_fn"} <= set(saved)
    per_image = json.loads((out / "eval" / "results_per_image.json").read_text())
    assert [e["image_id"] for e in per_image] == sorted(e["image_id"] for e in per_image) and len(per_image) == 3
    assert (out / "eval" / "results_per_image.csv").read_text().startswith("image_id,file_name,kind,")
    page = (out / "eval" / "mistakes.html").read_text()
    from vision_attn.explain.detection_mistakes import mistake_cards
    assert f">{len(mistake_cards(per_image, 0.0))} mistakes (" in page


def test_detection_panel_wraps_many_objects_into_rows_of_whole_objects():
    """Few objects: one row (picture, then each object's tiles); more than fit: rows of whole
    objects under the picture, a blank cell under it, tiles in order."""
    from vision_attn.explain.detection import _detection_panel

    picture = np.zeros((64, 64, 3), np.uint8)
    tiles = [np.full((64, 64, 3), 10 * (k + 1), np.uint8) for k in range(12)]  # 6 objects x 2 methods
    cell, pad, title = 128, 2, 18

    def centre(panel, row, col):
        return panel[pad + row * (cell + title + pad) + title + cell // 2, pad + col * (cell + pad) + cell // 2]

    two = _detection_panel(picture, tiles[:4], ["t"] * 4, 2)  # 2 objects: one row of 5
    assert two.shape[:2] == (pad + cell + title + pad, pad + 5 * (cell + pad))
    six = _detection_panel(picture, tiles, ["t"] * 12, 2)  # 6 objects: 3 rows of picture/blank + 2 objects
    assert six.shape[:2] == (pad + 3 * (cell + title + pad), pad + 5 * (cell + pad))
    assert centre(six, 0, 0).tolist() == [0, 0, 0]  # the picture
    assert centre(six, 1, 0).tolist() == centre(six, 2, 0).tolist() == [255, 255, 255]  # blank under it
    assert [int(centre(six, r, c)[0]) for r in range(3) for c in range(1, 5)] == [10 * (k + 1) for k in range(12)]
    one_method = _detection_panel(picture, tiles[:6], ["t"] * 6, 1)  # 4 objects a row with one method
    assert one_method.shape[1] == pad + 5 * (cell + pad) and one_method.shape[0] == pad + 2 * (cell + title + pad)
