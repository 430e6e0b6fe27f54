"""report.html: self-contained, and interactive in a real browser (headless Debian Chromium via Playwright)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vision_attn import create_encoder
from vision_attn.data.tokenizer import SPECIAL_TOKENS, WordTokenizer
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.explain.report import Report, write_report

from .conftest import TINY_VIT

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium; installed from Debian's packages when missing (skipped, saying why, where impossible)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is part of the dev extra")
    if not Path(CHROMIUM).exists():
        if shutil.which("apt-get") is None:
            pytest.skip("no Chromium at /usr/bin/chromium and no apt-get to install Debian's chromium package")
        res = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
            res = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, text=True, timeout=600)
        if res.returncode != 0 or not Path(CHROMIUM).exists():
            pytest.skip(f"Debian's chromium package could not be installed: {res.stderr.strip()[-300:]}")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def _options(**kw) -> ExplainOptions:
    return ExplainOptions(**{"num_overlays": 2, "faithfulness": False, "batch_size": 2, "score_threshold": 0.0, **kw})


def _classification_report(shapes_root, out: Path) -> Path:
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import explain_eval_split
    from vision_attn.tasks import ClassificationTask

    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["circle", "cross", "square", "star", "triangle"]).eval()
    ds = ImageFolderDataset(shapes_root, "val", task.class_names, build_eval_transform(task.data_config))
    report = Report()
    explain_eval_split(task, ds, _options(methods=["rollout", "attention"]), out, report)
    return write_report(out / "report.html", "classification", {"acc_top1": 0.5}, {"model": "tiny"}, report.items, report.curves)


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

        task = DetectionTask(enc, class_names=["a", "b", "c", "d", "e"], num_queries=4, hidden_dim=32, num_layers=1,
                             num_heads=2).eval()
        ds = CocoDetection(root, "val", build_detection_transform(task.data_config, train=False))
        write_detection_overlays(task, ds, _options(), out, max_objects=3, report=report)
    else:
        from vision_attn.data.captioning import CocoCaptions
        from vision_attn.explain.captioning import write_caption_overlays
        from vision_attn.tasks import CaptioningTask

        task = CaptioningTask(enc, vocab=[*SPECIAL_TOKENS, "a", "red", "circle"], hidden_dim=32, num_layers=1,
                              num_heads=2, max_length=6, beam_size=1).eval()
        with torch.no_grad():  # make sure the untrained decoder says a few words before <eos>
            task.head.out_bias[task.tokenizer.eos_id] = -1e4
        ds = CocoCaptions(root, "val", build_eval_transform(whole_image(task.data_config)),
                          WordTokenizer(task.tokenizer.vocab))
        write_caption_overlays(task, ds, _options(), out, report=report)
    return write_report(out / "report.html", kind, {"map": 0.1}, {"model": "tiny"}, report.items, report.curves)


def _open(browser, path: Path, shots: Path):
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_function("() => [...document.querySelectorAll('canvas')].every(c => c.dataset.shown === 'image')")
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
    assert text.count("data:image/png;base64,") >= 4 and "<svg id=\"deletion\"" in text


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
    _changed(page, lambda: page.click("#cv0", position={"x": (box[0] + box[2]) / 2 * side, "y": (box[1] + box[3]) / 2 * side}), "box")
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

    from vision_attn.explain.report import png_data_uri, quantise

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
    path = write_report(out / "report.html", HOSTILE[0], {HOSTILE[1]: 0.5}, {"data": HOSTILE[2], HOSTILE[3]: 1},
                        items, curves={HOSTILE[0]: [1.0, 0.5, 0.0], "random": [1.0, 0.8, 0.1]})
    return path, items


def test_embedded_json_cannot_close_the_script_and_round_trips(tmp_path):
    import json

    from vision_attn.explain.report import script_json

    path, items = _hostile_report(tmp_path)
    page = path.read_text()
    script = page[page.index("<script>") + len("<script>") : page.rindex("</script>")]
    assert "</script" not in script.lower() and "<!--" not in script and "\u2028" not in script
    data = script[len("const ITEMS=") : script.index(";\nfunction decode")]
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
    page.wait_for_timeout(300)
    assert page.evaluate("() => document.querySelectorAll('svg [onload], img[onerror], script').length") == 1
    assert not dialogs, dialogs
    assert not errors, errors
