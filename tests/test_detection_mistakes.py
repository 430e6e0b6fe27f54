"""The detection mistakes browser: every false positive and missed object of the per-image results
is a card, the "looked at the object?" flag is the pointing test of the card's map, the page is
self-contained and its filters change what Chromium shows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_eval_breakdown import _write_case
from vision_attn.explain import detection_mistakes
from vision_attn.explain.detection_mistakes import mistake_cards
from vision_attn.report.mistakes import mistakes_page


def _evaluated(tmp_path, tiny_encoder, threshold=0.4):
    from vision_attn.data.detection import CocoDetection, build_detection_transform
    from vision_attn.models.detr import DETRConfig
    from vision_attn.tasks import DetectionTask
    from vision_attn.tasks.detection import DetectionOptions

    dets = _write_case(tmp_path)
    ds = CocoDetection(tmp_path, "val")
    task = DetectionTask(tiny_encoder, class_names=ds.class_names, category_ids=ds.category_ids,
                         head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2)).eval()
    ds.transform = build_detection_transform(task.inference_data_config(), train=False)
    task.set_inference_options(DetectionOptions(score_threshold=threshold))
    task.eval_records = [{"image_id": i, "det": d} for i, d in dets.items()]
    task.eval_results(ds)
    return task, ds, task.eval_files(ds)


def test_every_false_positive_and_missed_object_is_a_card(tmp_path, tiny_encoder):
    task, ds, files = _evaluated(tmp_path, tiny_encoder)
    cards = mistake_cards(files["results_per_image.json"], 0.4)
    per_class = files["per_class.csv"]
    assert sum(c["kind"] != "miss" for c in cards) == sum(r["fp"] for r in per_class) > 0
    assert sum(c["kind"] == "miss" for c in cards) == sum(r["fn"] for r in per_class) > 0
    false = [c for c in cards if c["kind"] != "miss"]
    assert [c["score"] for c in false] == sorted((c["score"] for c in false), reverse=True)
    assert all(c["score"] >= 0.4 for c in false)
    for c in cards:  # the object the map should point at: a missed box is its own object
        if c["kind"] == "miss":
            assert c["object"] == c["box"]
        elif c["kind"] in ("bkg", "both"):
            assert c["object"] is None
        else:
            assert c["object"] is not None
    assert any(c["kind"] == "cls" and c["confused"] not in (None, c["category"]) for c in cards)
    # the browser says how many the cap left out
    from vision_attn.explain.detection_mistakes import detection_mistakes

    options = SimpleNamespace(score_threshold=0.0, batch_size=8, methods=["attention"], methods_default=False,
                              query_layers="last", seed=0, decoder_rule=None)
    browser = detection_mistakes(task, ds, files["results_per_image.json"], options, max_false_per_image=1)
    false = sum(1 for e in files["results_per_image.json"] for d in e["detections"]
                if d["outcome"] in ("cls", "loc", "both", "dupe", "bkg"))
    shown = sum(c["kind"] != "miss" for c in browser.cards)
    assert shown < false and f"{false - shown} of the {false} false positives, beyond the 1 " in browser.intro
    # a cap on the false positives of one image keeps its best-scoring ones
    capped = mistake_cards(files["results_per_image.json"], 0.0, max_false_per_image=1)
    per_image: dict = {}
    for c in capped:
        if c["kind"] != "miss":
            per_image.setdefault(c["image_id"], []).append(c["score"])
    assert per_image and all(len(v) == 1 for v in per_image.values())
    for entry in files["results_per_image.json"]:
        wrong = [d["score"] for d in entry["detections"] if d["outcome"] not in ("tp", "ignored", "unscored")]
        if wrong:
            assert per_image[entry["image_id"]] == [max(wrong)]


def test_looked_flag_is_the_pointing_test_of_the_map(tmp_path, tiny_encoder, monkeypatch):
    """With maps that peak at the object's centre the flag is set, with maps that peak in the far
    corner it is not; background detections get no flag."""
    task, ds, files = _evaluated(tmp_path, tiny_encoder)
    cards = mistake_cards(files["results_per_image.json"], 0.4)
    grid = task.encoder.grid_for(*task.data_config["input_size"][1:])
    for where in ("object", "corner"):
        fresh = [dict(c) for c in cards]
        by_image: dict = {}
        for c in fresh:
            by_image.setdefault(c["image_id"], []).append(c)
        ids = list(by_image)
        pending = [by_image[i] for i in ids]

        def fake_maps(model, images, queries, labels, methods, *args, where=where, pending=pending, **kw):
            out = []
            for b, q in enumerate(queries):
                m = torch.zeros(len(q), *grid)
                for k in range(len(q)):
                    if where == "corner":
                        m[k, 0, 0] = 1.0
                    else:  # the cell under the centre of that image's k-th card's object (or box)
                        card = pending[b][k]
                        x0, y0, x1, y1 = card["object"] or card["box"]
                        m[k, min(int((y0 + y1) / 2 / 160 * grid[0]), grid[0] - 1),
                          min(int((x0 + x1) / 2 / 160 * grid[1]), grid[1] - 1)] = 1.0
                out.append(m)
            return {methods[0]: out}

        monkeypatch.setattr(detection_mistakes, "detection_maps", fake_maps)
        options = SimpleNamespace(batch_size=len(ids), methods=["lrp"], methods_default=False, query_layers="last",
                                  seed=0, decoder_rule=None)
        pictures = detection_mistakes.explain_mistakes(task, ds, fresh, options)
        assert set(pictures) == set(ids)
        # a hot cell holds the object's centre; its own centre lies on objects larger than a cell
        cell = 160 / grid[0]
        big = [c for c in fresh if c["object"] is not None and min(c["object"][2] - c["object"][0],
                                                                    c["object"][3] - c["object"][1]) >= cell + 2]
        assert big and all(c["looked"] is (where == "object") for c in big), where
        if where == "corner":
            assert not any(c["looked"] for c in fresh if c["object"] is not None and c["object"][0] > 2)
        assert all(c["looked"] is None for c in fresh if c["object"] is None)
        assert all(c["grid"] == list(grid) and len(c["map"]) > 0 for c in fresh)


def _page_cards(n: int = 300) -> tuple[list[dict], dict]:
    rng = np.random.default_rng(0)
    kinds = ["cls", "loc", "bkg", "miss"]
    cards = []
    for i in range(n):
        kind = kinds[i % 4]
        cards.append({"image_id": i % 40, "kind": kind, "category": ["a", "b<script>", "c"][i % 3],
                      "confused": ["x", "a"][i % 2] if kind == "cls" else None,
                      "score": None if kind == "miss" else float(rng.random()), "size": ["small", "large"][i % 2],
                      "box": [4.0, 4.0, 20.0, 20.0], "object": None if kind == "bkg" else [2.0, 2.0, 18.0, 18.0],
                      "looked": None if kind == "bkg" else bool(i % 3), "grid": [2, 2],
                      "map": "AP8AgA=="})
    pictures = {i: np.full((32, 32, 3), 40 + i, np.uint8) for i in range(40)}
    return cards, pictures


def test_page_is_self_contained_and_escapes_names():
    cards, pictures = _page_cards(12)
    page = mistakes_page("mistakes", cards, pictures, "lrp")
    assert "<script>alert" not in page and "b<script>" not in page and "b&lt;script&gt;" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere
    assert page.count("data:image/jpeg;base64,") == 12  # each image once, however many cards


def test_filters_change_what_chromium_shows(tmp_path, browser):
    cards, pictures = _page_cards(300)
    path = tmp_path / "mistakes.html"
    path.write_text(mistakes_page("mistakes", cards, pictures, "lrp"))
    page = browser.new_page()
    page.goto(path.as_uri())
    visible = "() => [...document.querySelectorAll('.card')].filter(c => !c.classList.contains('hidden')).length"
    assert page.evaluate(visible) == 300
    assert page.inner_text("#shown") == "300 of 300 shown"
    page.select_option("#f-kind", "miss")
    assert page.evaluate(visible) == 75
    page.select_option("#f-class", "b<script>")
    assert page.evaluate(visible) == sum(c["kind"] == "miss" and c["category"] == "b<script>" for c in cards)
    page.select_option("#f-kind", "")
    page.select_option("#f-class", "")
    page.select_option("#f-looked", "none")
    assert page.evaluate(visible) == sum(c["looked"] is None for c in cards)
    page.select_option("#f-looked", "")
    # a class and what it is confused with: one cell of a confusion matrix
    page.select_option("#f-class", "a")
    page.select_option("#f-confused", "x")
    assert page.evaluate(visible) == sum(c["category"] == "a" and c["confused"] == "x" for c in cards) > 0
    page.select_option("#f-class", "")
    page.select_option("#f-confused", "")
    page.select_option("#f-size", "large")
    assert page.evaluate(visible) == 150
    # the address sets the filters: a confusion-matrix cell of report.html links so
    page.close()
    page = browser.new_page()
    page.goto(path.as_uri() + "#class=a&confused=x")
    assert page.evaluate(visible) == sum(c["category"] == "a" and c["confused"] == "x" for c in cards)
    assert page.input_value("#f-class") == "a" and page.input_value("#f-confused") == "x"
    # cards draw themselves when seen: the first ones are drawn, far ones not yet (lazy)
    page.wait_for_function("() => document.querySelector('.card').dataset.drawn === '1'")
    drawn = page.evaluate("() => [...document.querySelectorAll('.card')].filter(c => c.dataset.drawn).length")
    assert 0 < drawn < 300
    assert page.evaluate("() => document.querySelector('.card canvas').width") == 32
    page.close()


@pytest.mark.parametrize("value, written", [("=HYPERLINK(\"x\")", "'=HYPERLINK(\"x\")"), ("-1.5", "-1.5"),
                                            ("@cmd", "'@cmd"), ("plain", "plain")])
def test_csv_cells_cannot_run_as_formulas(tmp_path, value, written):
    import csv

    from vision_attn.outputs import write_csv

    write_csv(tmp_path / "x.csv", [{"class": value, "n": 3, "f1": float("nan")}], root=tmp_path)
    rows = list(csv.reader((tmp_path / "x.csv").open()))
    assert rows == [["class", "n", "f1"], [written, "3", ""]]
