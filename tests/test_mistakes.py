"""The mistakes the report's gallery shows: which images (each task's ``rank_mistakes``, and
vision_attn.explain.evaluate.worst_images / overlay_images that ask it) and, for detection, which
objects were missed and which detections were false (vision_attn.explain.detection.detection_errors),
on hand-made cases."""

from __future__ import annotations

import pytest
import torch

from vision_attn.data.tokenizer import SPECIAL_TOKENS
from vision_attn.explain.detection import (
    detection_errors,
    rank_detection_errors,
    split_detection_errors,
)
from vision_attn.explain.evaluate import (
    ExplainOptions,
    overlay_images,
    select_images,
    worst_images,
)
from vision_attn.models.captioner import DecoderConfig
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks import CaptioningTask, ClassificationTask, DetectionTask

from .conftest import TINY_VIT

NAMES = ["cat", "dog"]


def _encoder():
    from vision_attn import create_encoder

    return create_encoder("vit_tiny_patch16_224", **TINY_VIT)
# ground truth of one image: A cat, B dog, C cat, D a crowd region of cats
TRUTH = {"boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0], [40.0, 40.0, 50.0, 50.0],
                                [60.0, 60.0, 80.0, 80.0]]),
         "labels": torch.tensor([0, 1, 0, 0]), "iscrowd": torch.tensor([0, 0, 0, 1])}
# detections (deliberately not in score order): (box, score, label)
DETS = [([20.0, 20.0, 30.0, 30.0], 0.7, 0),  # on B, but a cat: wrong class
        ([0.0, 0.0, 10.0, 10.0], 0.9, 0),  # on A: a match
        ([100.0, 100.0, 110.0, 110.0], 0.6, 1),  # nothing there
        ([0.0, 0.0, 10.0, 11.0], 0.8, 0),  # on A again, which the 0.9 took: a duplicate
        ([61.0, 61.0, 79.0, 79.0], 0.5, 0),  # inside the crowd region of its class: ignored
        ([40.0, 40.0, 50.0, 50.0], 0.2, 0)]  # on C, below the threshold: C is missed


def _dets(rows):
    return (torch.tensor([r[0] for r in rows]).reshape(-1, 4), torch.tensor([r[1] for r in rows], dtype=torch.float64),
            torch.tensor([r[2] for r in rows], dtype=torch.int64))


def test_detection_errors_hand_made_case():
    found = detection_errors(*_dets(DETS), TRUTH, NAMES, score_threshold=0.3)
    assert found["missed"] == [{"label": "dog", "box": [20.0, 20.0, 30.0, 30.0]},
                               {"label": "cat", "box": [40.0, 40.0, 50.0, 50.0]}]
    assert [(f["label"], f["score"], f["why"]) for f in found["false"]] == [
        ("cat", pytest.approx(0.8), "duplicate"), ("cat", pytest.approx(0.7), "wrong class: dog"),
        ("dog", pytest.approx(0.6), "background")]
    assert found["false"][2]["box"] == [100.0, 100.0, 110.0, 110.0]
    # with every detection counted, C is matched and nothing else changes
    low = detection_errors(*_dets(DETS), TRUTH, NAMES, score_threshold=0.0)
    assert [m["label"] for m in low["missed"]] == ["dog"]
    assert [f["why"] for f in low["false"]] == ["duplicate", "wrong class: dog", "background"]
    # no detection: every non-crowd object is missed; no ground truth: every detection is false
    none = detection_errors(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64), TRUTH, NAMES)
    assert [m["box"][0] for m in none["missed"]] == [0.0, 20.0, 40.0] and none["false"] == []
    empty = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}
    alone = detection_errors(*_dets(DETS[:2]), empty, NAMES)
    assert alone["missed"] == [] and [f["why"] for f in alone["false"]] == ["background", "background"]


class _Split:
    """A stand-in COCO split: ``images`` and ``scoring_target`` (category ids 5 = cat, 9 = dog)."""

    category_ids = [5, 9]
    class_names = NAMES

    def __init__(self, truths: dict[int, dict]):
        self.images = [{"id": i} for i in truths]
        self.truths = truths

    def __len__(self) -> int:
        return len(self.images)

    def scoring_target(self, image_id: int) -> dict:
        return self.truths[image_id]


def _results(image_id: int, rows) -> list[dict]:
    return [{"image_id": image_id, "category_id": _Split.category_ids[lab], "score": s,
             "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]]} for b, s, lab in rows]


def test_split_detection_errors_ranks_images_by_errors_then_false_score():
    one = {"boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0]]), "labels": torch.tensor([0]), "iscrowd": torch.tensor([0])}
    split = _Split({11: TRUTH, 12: one, 13: one, 14: one, 15: one})
    predictions = (_results(11, DETS)  # 5 errors (2 missed, 3 false)
                   + _results(12, [([0.0, 0.0, 10.0, 10.0], 0.9, 0)])  # right: no error
                   + _results(13, [([50.0, 50.0, 60.0, 60.0], 0.4, 1)])  # missed + false 0.4
                   + _results(14, [([50.0, 50.0, 60.0, 60.0], 0.95, 0)])  # missed + false 0.95
                   + _results(15, [([0.0, 0.0, 10.0, 10.0], 0.1, 0)]))  # below the threshold: missed only
    errors = split_detection_errors(split, predictions, score_threshold=0.3)
    assert sorted(errors) == [0, 2, 3, 4]
    assert errors[0] == detection_errors(*_dets(DETS), TRUTH, NAMES, score_threshold=0.3)
    assert errors[3] == {"missed": [{"label": "cat", "box": [0.0, 0.0, 10.0, 10.0]}],
                         "false": [{"label": "cat", "score": pytest.approx(0.95), "box": [50.0, 50.0, 60.0, 60.0],
                                    "why": "background"}]}
    assert errors[4]["false"] == [] and len(errors[4]["missed"]) == 1
    assert rank_detection_errors(errors) == [0, 3, 2, 4]
    task = DetectionTask(_encoder(), class_names=NAMES, category_ids=_Split.category_ids,
                         head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2))
    assert task.rank_mistakes(split, predictions, 2, ExplainOptions(score_threshold=0.3)) == [0, 3]
    # the threshold is the evaluation's: at 0.0 the detection of 15 matches its object
    assert task.rank_mistakes(split, predictions, 5, ExplainOptions(score_threshold=0.0)) == [0, 3, 2]


class _Folder:
    """A stand-in ImageFolder split of 20 images."""

    samples = [(f"val/{'ab'[k % 2]}/{k}.png", k % 2) for k in range(20)]

    def __len__(self) -> int:
        return len(self.samples)


def test_classification_mistakes_are_the_most_confident_wrong_predictions():
    preds = [{"file": rel, "label": "ab"[lab], "pred": "ab"[lab], "score": 0.9} for rel, lab in _Folder.samples]
    for k, score in ((3, 0.61), (17, 0.99), (8, 0.75), (12, 0.75), (19, 0.52)):
        preds[k] = {**preds[k], "pred": "ab"[1 - _Folder.samples[k][1]], "score": score}
    task = ClassificationTask(_encoder(), class_names=["a", "b"])
    assert task.rank_mistakes(_Folder(), preds, 4) == [17, 8, 12, 3]  # ties: split order
    assert task.rank_mistakes(_Folder(), preds, 0) == []
    assert task.rank_mistakes(_Folder(), None, 4) == []
    options = ExplainOptions(num_overlays=3, mistakes=2)
    sample = select_images(20, 3, "sample", 0)
    assert worst_images(task, _Folder(), options) == []  # no predictions: the sample only
    assert overlay_images(_Folder(), options, worst_images(task, _Folder(), options)) == sample
    options.predictions = preds
    assert worst_images(task, _Folder(), options) == [17, 8]
    assert overlay_images(_Folder(), options, worst_images(task, _Folder(), options)) == sorted(set(sample) | {17, 8})


def test_captioning_mistakes_are_the_lowest_cider():
    split = _Split({7: {}, 3: {}, 5: {}, 9: {}})
    preds = [{"image_id": i, "caption": "x", "cider": c} for i, c in ((7, 0.8), (3, 0.1), (5, 1.2), (9, 0.0))]
    task = CaptioningTask(_encoder(), vocab=[*SPECIAL_TOKENS, "a"],
                          decoder=DecoderConfig(hidden_dim=32, num_layers=1, num_heads=2, max_length=4))
    assert task.rank_mistakes(split, preds, 2) == [3, 1]
    assert task.rank_mistakes(split, [*preds, {"image_id": 99, "cider": -1.0}], 1) == [3]  # unknown id


def test_a_task_without_a_ranking_adds_no_mistakes(tmp_path):
    """VisionTask's defaults: no mistakes ranked, no result section, no gallery; without an
    explain_batch, the default explain_eval draws no overlay."""
    from vision_attn.tasks import VisionTask

    class Plain(VisionTask):
        task_name = ""

    task = Plain(_encoder())
    options = ExplainOptions(num_overlays=2, mistakes=3)
    options.predictions = [{"file": "x", "label": "a", "pred": "b", "score": 1.0}]
    assert worst_images(task, _Folder(), options) == []
    assert task.report_sections({}, {}) == [] and task.mistake_cards([], options.predictions) is None
    assert task.explain_eval(_Folder(), options, tmp_path) == {} and not (tmp_path / "overlays").exists()


def test_mistakes_option_is_checked():
    with pytest.raises(Exception, match="explain.mistakes"):
        ExplainOptions(mistakes=-1)
    assert ExplainOptions().mistakes == 8 and ExplainOptions().predictions is None


def test_eval_explains_the_sample_and_the_most_confident_mistakes(shapes_root, tmp_path):
    """eval.py end to end: the overlays are the seeded sample and the --explain.mistakes most
    confident wrong predictions of predictions.json, and report.html's gallery shows those with
    their overlay (an ``img.copy`` of an explained item), most confident first."""
    import json
    import re

    from vision_attn.commands.evaluate import eval_main
    from vision_attn.commands.train import train_main

    from .conftest import REPO

    enc = "--model.init_args.encoder.init_args."
    common = ["--config", str(REPO / "configs" / "classification" / "shapes.yaml"),
              "--data.init_args.root", str(shapes_root), "--data.init_args.batching.num_workers", "0"]
    run = tmp_path / "run"
    train_main([*common, "--data.init_args.batching.batch_size", "16", f"{enc}embed_dim", "32", f"{enc}depth", "2",
                f"{enc}num_heads", "2", f"{enc}patch_size", "8", "--trainer.max_epochs", "1",
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--trainer.default_root_dir", str(run)])
    out = tmp_path / "eval"
    eval_main([*common, "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--output_dir", str(out),
               "--explain.num_overlays", "2", "--explain.mistakes", "3", "--explain.faithfulness", "false"])
    preds = json.loads((out / "predictions.json").read_text())
    wrong = sorted((i for i, p in enumerate(preds) if p["label"] != p["pred"]), key=lambda i: -preds[i]["score"])
    assert len(wrong) >= 4  # an undertrained model: more mistakes than are explained
    sample = select_images(len(preds), 2, "sample", 0)
    overlays = sorted(int(p.name.split("_")[0]) for p in (out / "overlays").glob("*.png"))
    assert overlays == sorted({*sample, *wrong[:3]})
    page = (out / "report.html").read_text()
    cards = re.findall(r'<div class="mistake" data-score="([^"]+)" data-item="(\d*)">', page)
    assert [float(s) for s, _ in cards] == [preds[i]["score"] for i in wrong[:8]]
    assert [item != "" for _, item in cards[:3]] == [True, True, True]  # the three explained mistakes: overlays
    assert all(f'data-item="{item}" alt="overlay"' in page for _, item in cards[:3])
