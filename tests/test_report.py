"""report.html: self-contained, and interactive in a real browser (headless Debian Chromium via Playwright)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
import torch

from vision_attn import create_encoder
from vision_attn.data.tokenizer import SPECIAL_TOKENS, WordTokenizer
from vision_attn.explain.evaluate import DEFAULT_MISTAKES, ExplainOptions
from vision_attn.explain.records import Report
from vision_attn.models.captioner import DecoderConfig, GenerationOptions
from vision_attn.models.detr import DETRConfig
from vision_attn.report import write_report
from vision_attn.tasks import captioning_report, classification_report, detection_report

from .conftest import TINY_VIT


def _options(**kw) -> ExplainOptions:
    return ExplainOptions(**{"num_overlays": 2, "faithfulness": False, "batch_size": 2, "score_threshold": 0.0, **kw})


def _classification_report(shapes_root, out: Path) -> Path:
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import explain_eval_split
    from vision_attn.tasks import ClassificationTask

    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT),
                              class_names=["circle", "cross", "square", "star", "triangle"]).eval()
    ds = ImageFolderDataset(shapes_root, "val", task.class_names, build_eval_transform(task.data_config))
    report = Report()
    explain_eval_split(task, ds, _options(methods=["rollout", "attention"]), out, report)
    return write_report(out / "report.html", "classification", {"acc_top1": 0.5}, {"model": "tiny"}, report.items,
                        report.curves, task=task.task_name, headline=task.headline_metric,
                        mistakes=task.mistake_cards(report.items, None))


def _coco_report(kind: str, out: Path, data: Path) -> Path:
    from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco
    from vision_attn.data.transforms import build_eval_transform, whole_image

    root = ensure_shapes_coco(SceneSetConfig(image_size=32, num_train=4, num_val=3), data)
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", **TINY_VIT)
    report = Report()
    if kind == "detection":
        from vision_attn.data.detection import CocoDetection, build_detection_transform
        from vision_attn.explain.detection import write_detection_overlays
        from vision_attn.tasks import DetectionTask

        head = DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2)
        task = DetectionTask(enc, class_names=["a", "b", "c", "d", "e"], head=head).eval()
        ds = CocoDetection(root, "val", build_detection_transform(task.data_config, train=False))
        write_detection_overlays(task, ds, _options(), out, max_objects=3, report=report)
    else:
        from vision_attn.data.captioning import CocoCaptions
        from vision_attn.explain.captioning import write_caption_overlays
        from vision_attn.tasks import CaptioningTask

        task = CaptioningTask(enc, vocab=[*SPECIAL_TOKENS, "a", "red", "circle"],
                              decoder=DecoderConfig(hidden_dim=32, num_layers=1, num_heads=2, max_length=6),
                              generate=GenerationOptions(beam_size=1)).eval()
        with torch.no_grad():  # make sure the untrained decoder says a few words before <eos>
            task.head.out_bias[task.tokenizer.eos_id] = -1e4
        ds = CocoCaptions(root, "val", build_eval_transform(whole_image(task.data_config)),
                          WordTokenizer(task.tokenizer.vocab))
        write_caption_overlays(task, ds, _options(), out, report=report)
    return write_report(out / "report.html", kind, {"map": 0.1}, {"model": "tiny"}, report.items, report.curves,
                        task=task.task_name, headline=task.headline_metric,
                        mistakes=task.mistake_cards(report.items, None))


def _open(browser, path: Path, shots: Path):
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_function("() => [...document.querySelectorAll('canvas')].every(c => c.dataset.shown === 'image')")
    # the pictures are lazy-loaded (a reader's scrolling loads them); load every one now
    page.evaluate("() => document.querySelectorAll('img[loading=lazy]').forEach(i => { i.loading = 'eager'; })")
    page.wait_for_function("() => [...document.images].every(i => i.complete)")
    widths = page.eval_on_selector_all("img", "els => els.map(e => e.naturalWidth)")
    assert widths and all(w > 0 for w in widths), widths
    return page, errors


def _changed(page, action, expect: str) -> None:
    before = page.eval_on_selector("#cv0", "c => c.toDataURL()")
    action()
    page.wait_for_function(f"() => document.querySelector('#cv0').dataset.shown.startsWith('{expect}')")
    assert page.eval_on_selector("#cv0", "c => c.toDataURL()") != before  # the displayed map changed


def test_report_is_self_contained(shapes_root, tmp_path):
    path = _classification_report(shapes_root, tmp_path / "cls")
    text = path.read_text()
    assert "http://" not in text and "https://" not in text  # no CDN, no network
    assert text.count("data:image/") >= 4 and "<svg id=\"deletion\"" in text


def test_classification_report_click_a_patch(browser, shapes_root, tmp_path):
    page, errors = _open(browser, _classification_report(shapes_root, tmp_path / "cls"), tmp_path)
    _changed(page, lambda: page.click("#cv0", position={"x": 30, "y": 30}), "layer")
    shown = page.eval_on_selector("#cv0", "c => c.dataset.shown")
    page.select_option("#head0", "0")
    page.wait_for_function(f"() => document.querySelector('#cv0').dataset.shown !== '{shown}'")
    page.screenshot(path=str(tmp_path / "classification.png"), full_page=True)
    assert not errors, errors


def test_detection_report_click_a_box(browser, tmp_path):
    path = _coco_report("detection", tmp_path / "det", tmp_path / "data")
    page, errors = _open(browser, path, tmp_path)
    box = page.evaluate("() => ITEMS[0].boxes[0]")
    side = page.eval_on_selector("#cv0", "c => c.getBoundingClientRect().width")
    # the smallest box containing the point wins: click the centre of the smallest box
    boxes = page.evaluate("() => ITEMS[0].boxes")
    k = min(range(len(boxes)), key=lambda i: (boxes[i][2] - boxes[i][0]) * (boxes[i][3] - boxes[i][1]))
    box = boxes[k]
    centre = {"x": (box[0] + box[2]) / 2 * side, "y": (box[1] + box[3]) / 2 * side}
    _changed(page, lambda: page.click("#cv0", position=centre), "box")
    assert page.text_content("#sel0")
    page.screenshot(path=str(tmp_path / "detection.png"), full_page=True)
    assert not errors, errors


def test_captioning_report_hover_a_word(browser, tmp_path):
    path = _coco_report("captioning", tmp_path / "cap", tmp_path / "data")
    page, errors = _open(browser, path, tmp_path)
    _changed(page, lambda: page.hover("#words0 .word >> nth=0"), "word0")
    page.screenshot(path=str(tmp_path / "captioning.png"), full_page=True)
    assert not errors, errors


HOSTILE = ["</script><script>alert('script')</script>", "<img src=x onerror=alert('img')>",
           "\"'><svg onload=alert('svg')>", "</SCRIPT ><!--", "a\u2028b\u2029c & &amp; <b>"]


def _hostile_report(out: Path) -> tuple[Path, list[dict]]:
    """A page whose every text comes from hostile names: file names, class names, metric and
    method names, detection category names, caption vocabulary words."""
    import numpy as np

    from vision_attn.explain.records import png_data_uri, quantise

    rgb = np.full((16, 16, 3), 120, np.uint8)
    image, panel = Report.display_image(rgb), png_data_uri(rgb)
    base = {"image": image, "panels": [panel], "grid": [2, 2]}
    items = [
        {**base, "name": HOSTILE[0] + ".png", "text": HOSTILE[1], "kind": "patches", "layers": 1, "heads": 1,
         "maps": quantise(np.random.default_rng(0).random((1, 1, 4, 4)))},
        {**base, "name": "image id " + HOSTILE[2], "text": HOSTILE[3], "kind": "boxes",
         "maps": quantise(np.eye(2, 4)), "boxes": [[0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0]],
         "labels": [f"{HOSTILE[0]} 0.90", f"{HOSTILE[4]} 0.50"]},
        {**base, "name": HOSTILE[4], "text": " ".join(HOSTILE), "kind": "words", "words": HOSTILE,
         "maps": quantise(np.random.default_rng(1).random((len(HOSTILE), 4)))},
    ]
    labels = HOSTILE[:3]
    predictions = [{"file": items[0]["name"], "label": labels[1], "pred": labels[2], "score": 0.9},
                   {"file": items[1]["name"], "label": labels[2], "pred": labels[2], "score": 0.5}]
    training = {"epochs": [0, 1],
                "series": {"train/loss": [[0, 1.0], [1, 0.5]], f"val/{HOSTILE[0]}": [[0, 0.1], [1, 0.2]]},
                "lr": {HOSTILE[1]: [[0, 0.1], [5, 0.2]]}, "files": [HOSTILE[3]]}
    files = {"per_class.json": {name: {"acc": 0.5, "n": 2, "precision": 0.5, "recall": 0.5} for name in labels},
             "confusion_matrix.json": {"labels": labels, "counts": [[1, 0, 0], [0, 0, 1], [0, 0, 1]]}}
    metrics = {HOSTILE[1]: 0.5, f"pointing_{HOSTILE[2]}": 0.4}
    path = write_report(out / "report.html", HOSTILE[0], metrics,
                        {"data": HOSTILE[2], HOSTILE[3]: 1, "checkpoint": HOSTILE[4], "split": HOSTILE[1]},
                        items, curves={HOSTILE[0]: [1.0, 0.5, 0.0], "random": [1.0, 0.8, 0.1]}, task="classification",
                        sections=classification_report.result_sections(files, metrics), headline="acc_top1",
                        mistakes=classification_report.mistake_cards(items, predictions, DEFAULT_MISTAKES),
                        predictions=predictions, training_curves=training)
    return path, items


def test_embedded_json_cannot_close_the_script_and_round_trips(tmp_path):
    import json

    from vision_attn.report import script_json

    path, items = _hostile_report(tmp_path)
    page = path.read_text()
    script = page[page.index("<script>") + len("<script>") : page.rindex("</script>")]
    assert "</script" not in script.lower() and "<!--" not in script and "\u2028" not in script
    data = script[len("const ITEMS=") : script.index(";const PAGE=")]
    assert not set(data) & set("<>&\u2028\u2029")
    assert [it["labels" if "labels" in it else "words" if "words" in it else "maps"] for it in json.loads(data)] == [
        items[0]["maps"], items[1]["labels"], items[2]["words"]]
    assert json.loads(script_json({"k": HOSTILE})) == {"k": HOSTILE}
    assert "<img src=x" not in page and "<svg onload" not in page  # markup texts are escaped too


def test_hostile_names_run_no_script_in_the_browser(browser, tmp_path):
    path, items = _hostile_report(tmp_path)
    page = browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_function("() => [...document.querySelectorAll('canvas')].every(c => c.dataset.shown === 'image')")
    page.wait_for_timeout(300)  # let any injected script, onerror or onload handler run
    assert not dialogs, dialogs
    assert page.title() == HOSTILE[0]
    assert page.eval_on_selector_all("h3", "els => els.map(e => e.textContent)") == [it["name"] for it in items]
    assert page.eval_on_selector_all("#words2 .word", "els => els.map(e => e.textContent)") == HOSTILE
    assert page.evaluate("() => ITEMS[1].labels") == items[1]["labels"]
    side = page.eval_on_selector("#cv1", "c => c.getBoundingClientRect().width")
    page.click("#cv1", position={"x": side / 4, "y": side / 4})  # the box labelled with HOSTILE[0]
    page.wait_for_function("() => document.querySelector('#cv1').dataset.shown === 'box0'")
    assert page.text_content("#sel1") == items[1]["labels"][0]  # shown as text, not markup
    page.hover("#words2 .word >> nth=0")
    page.click("#confusion .cell[data-t='1'][data-p='2']")  # the hostile names reach the status line as text
    assert HOSTILE[1] in page.text_content("#f-status") and HOSTILE[2] in page.text_content("#f-status")
    assert page.eval_on_selector_all(".item", "els => els.filter(e => !e.hidden).map(e => e.id)") == ["item0"]
    for sel in ("#per-class", "#confusion", "#quality", "#mistakes", "#curve-metric", "#curve-lr", "#summary"):
        assert any(h in page.text_content(sel) for h in HOSTILE), sel  # shown as text, not markup
    page.wait_for_timeout(300)
    assert page.evaluate("() => document.querySelectorAll('svg [onload], img[onerror], script').length") == 1
    assert not dialogs, dialogs
    assert not errors, errors


# ---------------------------------------------------------------------------------------------- the page's sections
CLASSES = ["cat", "dog", "fox"]
# split of 10 images: (file, truth, pred, score); the first 7 are explained (have report items)
SPLIT = [("a.png", "cat", "cat", 0.91), ("b.png", "cat", "dog", 0.97), ("c.png", "dog", "dog", 0.80),
         ("d.png", "dog", "cat", 0.55), ("e.png", "fox", "dog", 0.62), ("f.png", "cat", "dog", 0.71),
         ("g.png", "fox", "fox", 0.66), ("h.png", "fox", "cat", 0.99), ("i.png", "dog", "dog", 0.50),
         ("j.png", "cat", "fox", 0.40)]
EXPLAINED = 7

METRICS_CSV = """epoch,lr-AdamW/pg1,lr-AdamW/pg2,step,train/loss_epoch,train/loss_step,val/acc_top1,val/loss
,0.001,0.001,9,,,,
0,,,9,,2.5,,
0,,,9,,,0.40,1.9
0,,,9,2.2,,,
,0.0005,0.0005,19,,,,
1,,,19,,1.5,,
1,,,19,,,0.60,1.4
1,,,19,1.6,,,
garbled,row,with,too,many,cells,x,y,z,w
2,,,29,nan,,oops,1.1
"""


def _item(name: str, seed: int) -> dict:
    import numpy as np

    from vision_attn.explain.records import png_data_uri, quantise

    rng = np.random.default_rng(seed)
    rgb = (rng.random((8, 8, 3)) * 255).astype(np.uint8)
    return {"name": name, "text": f"explained {name}", "image": Report.display_image(rgb),
            "panels": [png_data_uri(rgb)],
            "kind": "patches", "grid": [2, 2], "layers": 1, "heads": 1, "maps": quantise(rng.random((1, 1, 4, 4)))}


def _write_run(run: Path, text: str = METRICS_CSV) -> Path:
    """A run folder as train.py leaves it: checkpoints/last.ckpt and csv/version_0/metrics.csv."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "csv" / "version_0" / "metrics.csv").write_text(text)
    return run / "checkpoints" / "last.ckpt"


def _classification_page(out: Path) -> Path:
    from vision_attn.report import read_training_curves

    predictions = [{"file": f, "label": t, "pred": p, "score": s} for f, t, p, s in SPLIT]
    counts = [[sum(1 for _, t, p, _ in SPLIT if (t, p) == (a, b)) for b in CLASSES] for a in CLASSES]
    per_class = {c: {"acc": counts[k][k] / sum(counts[k]), "n": sum(counts[k]), "precision": 0.5, "recall": 0.5}
                 for k, c in enumerate(CLASSES)}
    items = [_item(f, k) for k, (f, *_rest) in enumerate(SPLIT[:EXPLAINED])]
    metrics = {"acc_top1": 0.4, "deletion_auc_rollout": 0.2, "deletion_auc_random": 0.4, "insertion_auc_rollout": 0.7,
               "insertion_auc_random": 0.5, "sanity_rollout": 0.1, "explain_images": 7.0}
    files = {"per_class.json": per_class, "confusion_matrix.json": {"labels": CLASSES, "counts": counts}}
    return write_report(out / "report.html", "classification", metrics, {"checkpoint": "run/checkpoints/last.ckpt",
                        "split": "val"}, items, {"rollout": [1.0, 0.4, 0.1], "random": [1.0, 0.8, 0.5]},
                        task="classification", sections=classification_report.result_sections(files, metrics),
                        headline="acc_top1", mistakes=classification_report.mistake_cards(items, predictions, 8),
                        predictions=predictions, training_curves=read_training_curves(_write_run(out / "run")))


def _visit(browser, path: Path, on_dialog=None):
    """Open the page, recording console errors and every request that is not the file itself or a data: URI."""
    page = browser.new_page()
    if on_dialog is not None:
        page.on("dialog", on_dialog)
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url) if r.url != path.resolve().as_uri()
            and not r.url.startswith("data:") else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_function("() => [...document.querySelectorAll('canvas')].every(c => c.dataset.shown === 'image')")
    # the pictures are lazy-loaded (a reader's scrolling loads them); load every one now
    page.evaluate("() => document.querySelectorAll('img[loading=lazy]').forEach(i => { i.loading = 'eager'; })")
    page.wait_for_function("() => [...document.images].every(i => i.complete && i.naturalWidth > 0)")
    return page, errors, requests


def _plots(page) -> dict[str, list[float]]:
    """Every SVG plot: its rendered size and how many drawn marks (lines, bars, cells, dots) it has."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('svg')].map(s => {
        const r = s.getBoundingClientRect();
        return [s.id, [r.width, r.height, s.querySelectorAll('polyline, circle, rect.bar, rect.cell').length]];}))""")


def _visible(page) -> list[str]:
    return page.eval_on_selector_all(".item",
                                     "els => els.filter(e => !e.hidden).map(e => e.querySelector('h3').textContent)")


def test_classification_page_sections_confusion_click_and_mistakes(browser, tmp_path):
    page, errors, requests = _visit(browser, _classification_page(tmp_path))
    plots = _plots(page)
    assert set(plots) == {"confusion", "curve-loss", "curve-metric", "curve-lr", "deletion"}, plots
    assert all(w > 50 and h > 50 and marks > 0 for w, h, marks in plots.values()), plots
    assert plots["confusion"][2] == len(CLASSES) ** 2
    summary = page.text_content("#summary")
    assert "classification" in summary and "run/checkpoints/last.ckpt" in summary and "10 images" in summary
    assert "0.4000" in summary  # acc_top1, the headline
    # per-class table: worst accuracy first (cat 1/4, fox 1/3, dog 2/3), with the class each is most confused with
    rows = page.eval_on_selector_all("#per-class tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")[1:]
    assert [(r[0], r[1], r[-1]) for r in rows] == [  # ties: label order
        ("cat", "4", "dog (2)"), ("fox", "3", "cat (1)"), ("dog", "3", "cat (1)")]
    # quality table: the random baseline is the last row, columns only where known
    assert page.eval_on_selector_all("#quality tr", "rs => rs.map(r => r.cells[0].textContent)") == [
        "method", "rollout", "random (baseline)"]
    assert len(page.eval_on_selector_all("#quality tr:first-child th", "e => e")) == 4  # method, del, ins, sanity
    # the mistakes gallery: every wrong prediction of the split, most confident first
    wrong = sorted((r for r in SPLIT if r[1] != r[2]), key=lambda r: -r[3])
    assert page.eval_on_selector_all("#mistakes .mistake", "els => els.map(e => +e.dataset.score)") == [
        r[3] for r in wrong]
    assert page.eval_on_selector_all("#mistakes .mistake .name", "els => els.map(e => e.textContent)") == [
        r[0] for r in wrong]
    explained = {f for f, *_ in SPLIT[:EXPLAINED]}
    overlays = page.eval_on_selector_all("#mistakes .mistake", "els => els.map(e => !!e.querySelector('img.copy'))")
    assert overlays == [r[0] in explained for r in wrong]
    # clicking a confusion cell shows exactly the explained images of that cell, for every cell
    for t, truth in enumerate(CLASSES):
        for p, pred in enumerate(CLASSES):
            page.click(f"#confusion .cell[data-t='{t}'][data-p='{p}']")
            expect = [f for f, a, b, _ in SPLIT[:EXPLAINED] if (a, b) == (truth, pred)]
            assert _visible(page) == expect, (truth, pred)
            n = sum(1 for _, a, b, _ in SPLIT if (a, b) == (truth, pred))
            assert f"{n} images in the split, {len(expect)} of them explained" in page.text_content("#f-status")
            # a wrong cell links to all of its images in mistakes.html
            link = page.eval_on_selector("#f-cell-link", "a => a.hidden ? null : a.getAttribute('href')")
            def uri(x: str) -> str:
                return quote(x, safe="!'()*")  # as encodeURIComponent

            assert link == (None if truth == pred else f"mistakes.html#class={uri(truth)}&confused={uri(pred)}")
    page.click("#f-clear")
    assert _visible(page) == [f for f, *_ in SPLIT[:EXPLAINED]]
    page.select_option("#f-mode", "wrong")
    assert _visible(page) == [f for f, a, b, _ in SPLIT[:EXPLAINED] if a != b]
    page.select_option("#f-class", label="cat")
    assert _visible(page) == [f for f, a, b, _ in SPLIT[:EXPLAINED] if a != b and a == "cat"]
    page.click("#mistakes a.goto >> nth=0")  # the link to an interactive view clears the filters first
    assert len(_visible(page)) == EXPLAINED
    assert not errors, errors
    assert not requests, requests
    page.screenshot(path=str(tmp_path / "classification_page.png"), full_page=True)


def _detection_and_captioning_pages(out: Path) -> tuple[Path, Path, list[float]]:
    det_items = [{**_item(f"image id {k}", k), "kind": None} for k in range(3)]
    det_items[1]["missed"], det_items[2]["false"] = ["cat"], ["dog", "fox"]
    per_class = {"cat": {"ap": 0.5, "ap_50": 0.8, "n_gt": 4}, "dog": {"ap": 0.2, "ap_50": 0.3, "n_gt": 2},
                 "fox": {"ap": -1.0, "ap_50": -1.0, "n_gt": 0}}
    metrics = {"map": 0.35, "map_small": -1.0, "map_medium": 0.3, "map_large": 0.4, "mar_1": 0.2, "mar_10": 0.4,
               "mar_100": 0.45, "pointing_attention": 0.8, "pointing_random": 0.1}
    pr = {"cat": [[0.0, 1.0], [0.5, 0.8], [1.0, 0.2]], "dog": [[0.0, 1.0], [0.5, 0.4], [1.0, 0.0]]}
    det = write_report(out / "det" / "report.html", "detection", metrics, {}, det_items, task="detection",
                       sections=detection_report.result_sections({"per_class.json": per_class, "pr_curves.json": pr},
                                                                 metrics),
                       headline="map", mistakes=detection_report.mistake_cards(det_items, [], 8), predictions=[])
    ciders = [1.5, 0.2, 0.9, 0.0]
    cap_items = [_item(f"image id {k}", k) for k in range(4)]
    predictions = [{"image_id": k, "caption": f"caption {k}", "cider": c} for k, c in enumerate(ciders)]
    cap = write_report(out / "cap" / "report.html", "captioning", {"cider": 0.65}, {}, cap_items,
                       task="captioning", headline="cider", split_size=len(predictions),
                       mistakes=captioning_report.mistake_cards(cap_items, predictions, 8), predictions=predictions)
    return det, cap, ciders


def test_detection_and_captioning_pages(browser, tmp_path):
    det, cap, ciders = _detection_and_captioning_pages(tmp_path)
    page, errors, requests = _visit(browser, det)
    plots = _plots(page)
    assert set(plots) == {"ap-per-class", "size-breakdown", "pr-curves"}
    assert all(w > 50 and h > 50 for w, h, _ in plots.values()), plots
    assert plots["ap-per-class"][2] == 4 and plots["size-breakdown"][2] == 5  # fox and map_small have no bar
    labels = page.eval_on_selector_all("#ap-per-class text", "els => els.map(e => e.textContent)")
    assert labels.index("dog") < labels.index("cat") < labels.index("fox")  # worst first, no ground truth last
    assert "no ground truth (0 objects)" in labels
    assert page.eval_on_selector_all("#mistakes .mistake", "els => els.map(e => +e.dataset.score)") == [2.0, 1.0]
    assert page.eval_on_selector_all("#quality tr", "rs => rs.map(r => r.cells[0].textContent)") == [
        "method", "attention", "random (baseline)"]
    assert not errors and not requests, (errors, requests)
    page, errors, requests = _visit(browser, cap)
    # the lowest-CIDEr captions first
    assert page.eval_on_selector_all("#mistakes .mistake", "els => els.map(e => +e.dataset.score)") == sorted(ciders)
    assert page.eval_on_selector_all("#mistakes .mistake .name", "els => els.map(e => e.textContent)") == [
        f"image id {k}" for k in sorted(range(4), key=lambda k: ciders[k])]
    assert not errors and not requests, (errors, requests)


def test_read_training_curves(tmp_path):
    from vision_attn.report import read_training_curves

    ckpt = _write_run(tmp_path / "run")
    # a resumed run adds version_1: its epoch 2 replaces nothing, its epoch 1 replaces version_0's
    (tmp_path / "run" / "csv" / "version_1").mkdir()
    (tmp_path / "run" / "csv" / "version_1" / "metrics.csv").write_text(
        "epoch,step,train/loss_epoch,val/acc_top1,lr-AdamW/pg1,lr-AdamW/pg2\n1,19,1.55,,,\n2,29,1.2,0.7,,\n"
        ",29,,,0.0001,0.0001\n")
    got = read_training_curves(ckpt)
    assert got == {
        "epochs": [0, 1, 2],
        "series": {"train/loss": [[0, 2.2], [1, 1.55], [2, 1.2]], "val/acc_top1": [[0, 0.4], [1, 0.6], [2, 0.7]],
                   "val/loss": [[0, 1.9], [1, 1.4], [2, 1.1]]},
        "lr": {"AdamW/pg1": [[9.0, 0.001], [19.0, 0.0005], [29.0, 0.0001]]},  # pg2 repeats pg1's schedule
        "files": ["csv/version_0/metrics.csv", "csv/version_1/metrics.csv"],
    }


def test_read_training_curves_stays_in_the_run_and_tolerates_garbage(tmp_path):
    from vision_attn.report import read_training_curves

    assert read_training_curves(tmp_path / "elsewhere" / "last.ckpt") is None  # not in a checkpoints folder
    bare = tmp_path / "bare" / "checkpoints"
    bare.mkdir(parents=True)
    assert read_training_curves(bare / "last.ckpt") is None  # no csv folder
    outside = tmp_path / "outside"
    _write_run(outside)
    run = tmp_path / "linked"
    (run / "checkpoints").mkdir(parents=True)
    (run / "csv").symlink_to(outside / "csv")  # a csv folder that leads out of the run
    assert read_training_curves(run / "checkpoints" / "last.ckpt") is None
    run2 = tmp_path / "filelink"
    (run2 / "checkpoints").mkdir(parents=True)
    (run2 / "csv" / "version_0").mkdir(parents=True)
    (run2 / "csv" / "version_0" / "metrics.csv").symlink_to(outside / "csv" / "version_0" / "metrics.csv")
    assert read_training_curves(run2 / "checkpoints" / "last.ckpt") is None
    junk = tmp_path / "junk"
    ckpt = _write_run(junk, "epoch,val/loss\n0,1.0\n")
    (junk / "csv" / "version_1").mkdir()
    (junk / "csv" / "version_1" / "metrics.csv").write_bytes(b"\xff\xfe\x00garbage\x00\n\x00,\x00\n" * 50)
    (junk / "csv" / "version_2").mkdir()
    (junk / "csv" / "version_2" / "metrics.csv").write_text('epoch,val/loss\n1,"unterminated\n' + "x" * 200_000)
    assert read_training_curves(ckpt)["series"] == {"val/loss": [[0, 1.0]]}


def test_large_panels_are_compacted(tmp_path):
    import base64

    import cv2
    import numpy as np

    from vision_attn.explain.records import compact_data_uri, png_data_uri

    yy, xx = np.mgrid[0:600, 0:1000]
    rng = np.random.default_rng(0)
    smooth = np.stack([(xx / 4) % 256, (yy / 3) % 256, (xx + yy) % 256], -1) + rng.normal(0, 6, (600, 1000, 3))
    big = png_data_uri(np.clip(smooth, 0, 255).astype(np.uint8))
    small = png_data_uri(np.zeros((8, 8, 3), np.uint8))
    assert compact_data_uri(small) == small  # small images stay lossless
    jpeg = compact_data_uri(big)
    assert jpeg.startswith("data:image/jpeg;base64,") and len(jpeg) < len(big) / 3
    decoded = cv2.imdecode(np.frombuffer(base64.b64decode(jpeg.split(",", 1)[1]), np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape == (600, 1000, 3)
    assert np.abs(decoded[..., ::-1].astype(float) - np.clip(smooth, 0, 255).round()).mean() < 8
    # a 16-image report with such panels stays well under 5 MB
    items = [{**_item(f"{k}.png", k), "panels": [big]} for k in range(16)]
    size = write_report(tmp_path / "report.html", "size", {}, {}, items).stat().st_size
    assert size < 16 * len(big) / 3 and size < 5_000_000, size


# ------------------------------------------------------------------------------------------ mistakes outside the sample
def _gallery(page) -> list[dict]:
    """Each mistake card: its score, name, whether it shows an overlay (loaded, the grid's own panel) and its link."""
    return page.eval_on_selector_all("#mistakes .mistake", """els => els.map(e => {
        const im = e.querySelector('img.copy'), item = e.dataset.item;
        const grid = item === '' ? null : document.querySelector('#item' + item + ' .panels img');
        return {score: +e.dataset.score, top: e.dataset.top === undefined ? null : +e.dataset.top,
                name: e.querySelector('.name').textContent, item: item,
                overlay: !!im && im.complete && im.naturalWidth > 0 && !!grid && im.src === grid.src,
                link: e.querySelector('a.goto') ? e.querySelector('a.goto').getAttribute('href') : null,
                text: e.textContent};})""")


def test_classification_mistakes_outside_the_sample_get_overlays(browser, shapes_root, tmp_path):
    """eval's explanations cover the seeded sample and the --explain.mistakes most confident wrong
    predictions: those outside the sample get an overlay file and a report item, and the gallery
    shows them, most confident first, each with its overlay and its interactive view."""
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import explain_eval_split, select_images
    from vision_attn.tasks import ClassificationTask

    torch.manual_seed(0)
    names = ["circle", "cross", "square", "star", "triangle"]
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=names).eval()
    ds = ImageFolderDataset(shapes_root, "val", names, build_eval_transform(task.data_config))
    options = _options(methods=["rollout"], num_overlays=2, mistakes=3)
    sample = select_images(len(ds), 2, "sample", 0)
    outside = [i for i in range(len(ds)) if i not in sample]
    wrong = {outside[3]: 0.61, outside[9]: 0.97, outside[15]: 0.83, outside[20]: 0.55}  # the last is 4th: no overlay
    predictions = []
    for i, (rel, label) in enumerate(ds.samples):
        pred = names[(label + 1) % len(names)] if i in wrong else names[label]
        predictions.append({"file": rel, "label": names[label], "pred": pred, "score": wrong.get(i, 0.9)})
    options.predictions = predictions
    out = tmp_path / "eval"
    report = Report()
    explain_eval_split(task, ds, options, out, report)
    order = sorted(wrong, key=lambda i: -wrong[i])
    explained = sorted({*sample, *order[:3]})
    assert [it["name"] for it in report.items] == [ds.samples[i][0] for i in explained]
    written = sorted(p.name[:5] for p in (out / "overlays").glob("*.png"))
    assert written == [f"{i:05d}" for i in explained]
    assert set(report.curves) == {"rollout", "random"}  # the deletion curves: the sample only (2 images)
    path = write_report(out / "report.html", "classification", {"acc_top1": 0.84}, {}, report.items, report.curves,
                        task=task.task_name, headline=task.headline_metric,
                        mistakes=task.mistake_cards(report.items, predictions), predictions=predictions)
    page, errors, requests = _visit(browser, path)
    cards = _gallery(page)
    assert [c["score"] for c in cards] == [wrong[i] for i in order]
    assert [c["name"] for c in cards] == [ds.samples[i][0] for i in order]
    assert [c["overlay"] for c in cards] == [True, True, True, False]
    for card in cards[:3]:  # the link goes to that image's interactive view
        item = page.eval_on_selector(card["link"], "e => e.querySelector('h3').textContent")
        assert item == card["name"]
        assert page.eval_on_selector(card["link"] + " canvas", "c => c.dataset.shown") == "image"
    assert not errors and not requests, (errors, requests)


def test_detection_mistakes_list_missed_and_false_and_pr_curves_render(browser, tmp_path):
    """The images with the most missed and false detections in the evaluation's predictions are
    explained even outside the sample; the gallery lists their errors, most errors first, then the
    highest-scoring false detection; pr_curves.json's form renders as one curve per category with
    ground truth (the -1 points left out)."""
    from vision_attn.data.detection import CocoDetection, build_detection_transform
    from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco
    from vision_attn.explain.detection import write_detection_overlays
    from vision_attn.explain.evaluate import select_images
    from vision_attn.tasks import DetectionTask

    root = ensure_shapes_coco(SceneSetConfig(image_size=32, num_train=4, num_val=8), tmp_path / "data")
    torch.manual_seed(0)
    probe = CocoDetection(root, "val")
    task = DetectionTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=probe.class_names,
                         category_ids=probe.category_ids, head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1,
                                                                          num_heads=2)).eval()
    ds = CocoDetection(root, "val", build_detection_transform(task.data_config, train=False))
    sample = select_images(len(ds), 1, "sample", 0)
    outside = [i for i in range(len(ds)) if i not in sample]
    a, b, c = outside[0], outside[2], outside[4]
    predictions = []
    for i, im in enumerate(ds.images):  # every object found exactly at 0.9, but a's first object is missed
        truth = ds.scoring_target(im["id"])
        objects = zip(truth["boxes"].tolist(), truth["labels"].tolist(), strict=True)
        for k, ((x0, y0, x1, y1), lab) in enumerate(objects):
            if (i, k) != (a, 0):
                predictions.append({"image_id": im["id"], "category_id": ds.category_ids[lab],
                                    "bbox": [x0, y0, x1 - x0, y1 - y0], "score": 0.9})
    other = ds.category_ids[-1]

    def false(i: int, score: float, x: float = 0.0) -> dict:
        return {"image_id": ds.images[i]["id"], "category_id": other, "bbox": [x, x, 2.0, 2.0], "score": score}

    # a: 1 missed + 1 false (0.3) = 2 errors; c: 1 false at 0.95; b: 1 false at 0.7; c's 0.2 is below the threshold
    predictions += [false(a, 0.3), false(b, 0.7), false(c, 0.95), false(c, 0.2, 4.0)]
    options = _options(num_overlays=1, mistakes=2, score_threshold=0.3)
    options.predictions = predictions
    report = Report()
    write_detection_overlays(task, ds, options, tmp_path / "eval", max_objects=2, report=report)
    names = [it["name"] for it in report.items]
    assert names == [f"image id {ds.images[i]['id']}" for i in sorted({*sample, a, c})]  # b: third, not explained
    by_name = dict(zip(names, report.items, strict=True))
    item_a, item_c = by_name[f"image id {ds.images[a]['id']}"], by_name[f"image id {ds.images[c]['id']}"]
    assert len(item_a["missed"]) == 1 and [f["score"] for f in item_a["false"]] == [pytest.approx(0.3)]
    h, w = ds.read_rgb(a).shape[:2]  # the missed object, drawn in the interactive view: xyxy fractions
    x0, y0, x1, y1 = ds.scoring_target(ds.images[a]["id"])["boxes"][0].tolist()
    assert item_a["missed_boxes"] == [pytest.approx([x0 / w, y0 / h, x1 / w, y1 / h])]
    assert item_a["missed"][0]["box"] == pytest.approx([x0, y0, x1, y1])
    assert item_c["missed"] == [] and [f["score"] for f in item_c["false"]] == [pytest.approx(0.95)]
    assert all(by_name[f"image id {ds.images[i]['id']}"] == {**by_name[f"image id {ds.images[i]['id']}"],
                                                               "missed": [], "false": []} for i in sample)
    pr = {ds.class_names[0]: {"recall": [0.0, 0.5, 1.0], "precision": [1.0, 0.5, 0.0]},
          ds.class_names[1]: {"recall": [0.0, 0.5, 1.0], "precision": [0.8, 0.4, -1.0]},
          ds.class_names[-1]: {"recall": [0.0, 0.5, 1.0], "precision": [-1.0, -1.0, -1.0]}}
    path = write_report(tmp_path / "eval" / "report.html", "detection", {"map": 0.5}, {}, report.items,
                        task=task.task_name, sections=task.report_sections({"pr_curves.json": pr}, {"map": 0.5}),
                        headline=task.headline_metric, mistakes=task.mistake_cards(report.items, predictions),
                        predictions=predictions)
    page, errors, requests = _visit(browser, path)
    cards = _gallery(page)
    assert [(card["name"], card["score"], card["top"]) for card in cards] == [
        (f"image id {ds.images[a]['id']}", 2.0, 0.3), (f"image id {ds.images[c]['id']}", 1.0, 0.95)]
    assert all(card["overlay"] for card in cards)
    lists = page.eval_on_selector_all("#mistakes .mistake", """els => els.map(e => ['missed', 'false'].map(
        k => [...e.querySelectorAll('ul.' + k + ' li')].map(li => li.textContent)))""")
    assert lists == [[[item_a["missed"][0]["label"]], [f"{ds.class_names[-1]} 0.30 (background)"]],
                     [["none"], [f"{ds.class_names[-1]} 0.95 (background)"]]]
    link = cards[0]["link"]  # a's interactive view says what the dashed box is; c's has none
    assert "Dashed red" in page.text_content(link) and "Dashed red" not in page.text_content(cards[1]["link"])
    # the PR curves: one polyline per category with ground truth, the -1 point dropped
    lines = page.eval_on_selector_all("#pr-curves polyline",
                                      "els => els.map(e => e.getAttribute('points').split(' ').length)")
    assert lines == [3, 2]
    assert _plots(page)["pr-curves"][0] > 50
    assert not errors and not requests, (errors, requests)
    page.screenshot(path=str(tmp_path / "detection_mistakes.png"), full_page=True)


def test_captioning_lowest_cider_outside_the_sample_is_explained(tmp_path):
    from vision_attn.data.captioning import CocoCaptions
    from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco
    from vision_attn.data.transforms import build_eval_transform, whole_image
    from vision_attn.explain.captioning import write_caption_overlays
    from vision_attn.explain.evaluate import select_images
    from vision_attn.tasks import CaptioningTask

    root = ensure_shapes_coco(SceneSetConfig(image_size=32, num_train=4, num_val=6), tmp_path / "data")
    torch.manual_seed(0)
    task = CaptioningTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT),
                          vocab=[*SPECIAL_TOKENS, "a", "red", "circle"],
                          decoder=DecoderConfig(hidden_dim=32, num_layers=1, num_heads=2, max_length=4),
                          generate=GenerationOptions(beam_size=1)).eval()
    ds = CocoCaptions(root, "val", build_eval_transform(whole_image(task.data_config)),
                      WordTokenizer(task.tokenizer.vocab))
    sample = select_images(len(ds), 1, "sample", 0)
    worst = [i for i in range(len(ds)) if i not in sample][-1]
    predictions = [{"image_id": im["id"], "caption": "a", "cider": 0.05 if i == worst else 1.0 + i}
                   for i, im in enumerate(ds.images)]
    options = _options(num_overlays=1, mistakes=1)
    options.predictions = predictions
    report = Report()
    write_caption_overlays(task, ds, options, tmp_path / "eval", report=report)
    assert [it["name"] for it in report.items] == [f"image id {ds.images[i]['id']}" for i in sorted({*sample, worst})]
    assert sorted(p.name[:5] for p in (tmp_path / "eval" / "overlays").glob("*.png")) == [
        f"{i:05d}" for i in sorted({*sample, worst})]


def test_quality_table_leaves_out_counts_and_old_names(tmp_path):
    """Captioning's metrics.json has ``pointing_words`` (a count) and ``pointing_acc`` /
    ``pointing_acc_random`` (old names of pointing_attention / pointing_random): no method rows."""
    import re

    metrics = {"cider": 3.7, "pointing_relevance": 0.69, "pointing_attention": 0.53, "pointing_random": 0.08,
               "pointing_acc": 0.53, "pointing_acc_random": 0.08, "pointing_words": 172.0, "explain_words": 172.0,
               "deletion_auc_relevance": 0.27, "deletion_auc_random": 0.49, "explain_images": 40.0}
    page = write_report(tmp_path / "report.html", "captioning", metrics, {}, [], task="captioning").read_text()
    table = page[page.index('<table id="quality">'):]
    table = table[: table.index("</table>")]
    assert re.findall(r'<tr class="[a-z]+"><th>([^<]+)</th>', table) == ["attention", "relevance", "random (baseline)"]
    assert "over 172 generated words (172 name an object of the image" in page


def test_embedded_json_holds_no_nan():
    import json

    from vision_attn.report import script_json

    text = script_json({"a": float("nan"), "b": [1.0, float("inf")], "c": "</script>"})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in embedded JSON")) == {
        "a": None, "b": [1.0, None], "c": "</script>"}


# ---------------------------------------------------------------------------------------------- assets and sections
def test_style_and_script_are_package_files_inlined_in_the_page(tmp_path):
    """The page's CSS and JavaScript are package data found through importlib.resources (so an
    installed package has them), declared in pyproject.toml, and inlined: the page stays one file."""
    import fnmatch
    import sys
    from importlib import resources

    from .conftest import REPO

    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

    assets = resources.files("vision_attn.report") / "assets"
    css, js = (assets / "report.css").read_text(encoding="utf-8"), (assets / "report.js").read_text(encoding="utf-8")
    assert "#confusion .cell" in css and "function View(item)" in js
    page = write_report(tmp_path / "report.html", "assets", {"acc_top1": 0.5}, {}, [_item("a.png", 0)]).read_text()
    assert f"<style>{css}</style>" in page and page.endswith(f"{js}</script></body></html>")
    assert "<link" not in page and "<script src" not in page
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = globs["vision_attn.report"]
    for f in (REPO / "vision_attn" / "report" / "assets").iterdir():
        assert any(fnmatch.fnmatch(f"assets/{f.name}", g) for g in shipped), f"{f.name} is not package data"


def test_public_names_import_from_the_package_and_the_page_module():
    import vision_attn.report as report
    import vision_attn.report.page as page

    for name in ("write_report", "read_training_curves", "script_json"):
        assert getattr(report, name) is getattr(page, name)


def _sections_page(out: Path) -> tuple[Path, list[dict]]:
    """A page whose result section is given as data, every text in it hostile."""
    from vision_attn.report import (
        Bar,
        BarChart,
        Card,
        Cards,
        Column,
        ConfusionMatrix,
        Curves,
        Section,
        Table,
    )

    items = [{**_item(f"{k}.png", k), "truth": HOSTILE[k % 2], "pred": HOSTILE[1]} for k in range(3)]
    labels = HOSTILE[:2]
    section = Section(HOSTILE[0], note=HOSTILE[1], blocks=[
        Table([HOSTILE[2], Column(HOSTILE[3], hint=HOSTILE[4], bar=True), "n"],
              [[HOSTILE[0], 0.5, 3], [HOSTILE[4], None, 0]], title=HOSTILE[2], id="plugin-table"),
        BarChart([Bar(HOSTILE[1], 0.7, 0.9, HOSTILE[2]), Bar(HOSTILE[3], None)], title="bars", id="plugin-bars",
                 back_label=HOSTILE[4]),
        Curves({HOSTILE[0]: [[0, 0.1], [1, 0.5]], HOSTILE[1]: [[0, 0.3], [1, 0.2]]}, HOSTILE[2], HOSTILE[3],
               title="curves", hint=HOSTILE[4], id="plugin-curves"),
        ConfusionMatrix(labels, [[1, 1], [0, 1]], title="matrix"),
        Cards([Card(HOSTILE[0], [HOSTILE[1], HOSTILE[2]], item="1.png"), Card(HOSTILE[3], item="not explained")],
              title="cards", id="plugin-cards"),
    ])
    path = write_report(out / "report.html", "plugin", {"f1": 0.25}, {}, items, task="multilabel",
                        sections=[section], headline="f1")
    return path, items


def test_sections_given_as_data_render_escaped_and_interactive(browser, tmp_path):
    path, items = _sections_page(tmp_path)
    text = path.read_text()
    assert "<img src=x" not in text and "<svg onload" not in text
    dialogs: list[str] = []
    page, errors, requests = _visit(browser, path, on_dialog=lambda d: (dialogs.append(d.message), d.dismiss()))
    assert page.text_content("h2") == HOSTILE[0] and "f1 0.2500" in page.text_content("#summary")
    rows = page.eval_on_selector_all("#plugin-table tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert rows == [[HOSTILE[2], HOSTILE[3], "n"], [HOSTILE[0], "0.500", "3"], [HOSTILE[4], "—", "0"]]
    assert page.eval_on_selector("#plugin-table th:nth-child(2)", "e => e.title") == HOSTILE[4]
    assert page.eval_on_selector_all("#plugin-table span.bar", "els => els.length") == 1
    plots = _plots(page)
    assert {"plugin-bars", "plugin-curves", "confusion"} <= set(plots)
    assert plots["plugin-bars"][2] == 2 and plots["confusion"][2] == 4  # 0.7 over 0.9: two bars; None: none
    assert page.eval_on_selector_all("#plugin-curves polyline", "els => els.length") == 2
    cards = page.eval_on_selector_all("#plugin-cards .card", """els => els.map(e => {const im = e.querySelector('img');
        return [e.querySelector('b').textContent, !!im && im.complete && im.naturalWidth > 0,
                e.querySelector('a.goto') ? e.querySelector('a.goto').getAttribute('href') : null];})""")
    assert cards == [[HOSTILE[0], True, "#item1"], [HOSTILE[3], False, None]]
    page.click("#confusion .cell[data-t='0'][data-p='1']")  # the given matrix drives the grid's cell filter
    assert _visible(page) == ["0.png", "2.png"]
    assert HOSTILE[0] in page.text_content("#f-status") and HOSTILE[1] in page.text_content("#f-status")
    page.wait_for_timeout(300)
    assert page.evaluate("() => document.querySelectorAll('svg [onload], img[onerror], script').length") == 1
    assert not dialogs and not errors and not requests, (dialogs, errors, requests)


def test_builtin_results_are_section_records():
    """Each built-in task builds its result sections from its own evaluation files (its
    ``report_sections`` hook); captioning has none (the default)."""
    from vision_attn.report import BarChart, ConfusionMatrix, Curves, Section, Table
    from vision_attn.tasks import CaptioningTask, ClassificationTask, DetectionTask, VisionTask

    per_class = {c: {"acc": 0.5, "n": 2, "precision": 0.5, "recall": 0.5} for c in CLASSES}
    confusion = {"labels": CLASSES, "counts": [[1, 1, 0], [0, 2, 0], [1, 0, 1]]}
    classifier = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=CLASSES)
    (cls,) = classifier.report_sections({"per_class.json": per_class, "confusion_matrix.json": confusion}, {})
    assert isinstance(cls, Section) and [type(b) for b in cls.blocks] == [Table, ConfusionMatrix]
    assert cls.blocks[0].id == "per-class" and cls.blocks[1].id == "confusion"
    detection = {"cat": {"ap": 0.5, "ap_50": 0.8, "n_gt": 4}}
    detector = DetectionTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["cat"],
                             head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1, num_heads=2))
    files = {"per_class.json": detection, "pr_curves.json": {"cat": [[0.0, 1.0], [1.0, 0.5]]}}
    (det,) = detector.report_sections(files, {"map_small": 0.1})
    assert [(type(b), b.id) for b in det.blocks] == [(BarChart, "ap-per-class"), (BarChart, "size-breakdown"),
                                                       (Curves, "pr-curves")]
    assert CaptioningTask.report_sections is VisionTask.report_sections
    assert VisionTask.report_sections(classifier, {}, {"cider": 1.0}) == []
    assert (classifier.headline_metric, detector.headline_metric, CaptioningTask.headline_metric) == (
        "acc_top1", "map", "cider")


def test_section_renderer_refuses_what_it_cannot_draw():
    from dataclasses import dataclass

    from vision_attn.report import (
        Block,
        ConfusionMatrix,
        Section,
        Table,
        render_section,
    )

    @dataclass(frozen=True)
    class Gauge(Block):
        value: float = 0.0

    with pytest.raises(TypeError, match="Gauge"):
        render_section(Section("s", [Gauge(value=1.0)]))
    with pytest.raises(ValueError, match="row 1 has 1 cells for 2 columns"):
        render_section(Section("s", [Table(["a", "b"], [["x", 1], ["y"]], id="t")]))
    assert render_section(Section("empty", [ConfusionMatrix(["a", "b"], [[1, 2]])])) == ""  # not square: nothing
