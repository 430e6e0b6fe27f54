"""report.html is bounded by design: under 10 MB whatever the model and the number of images.

The end-to-end run with a random-weight timm ViT-B/16 explains 3 images here, not 50: on a
2-core CPU 50 images take about 2 minutes. Measured once (50 generated images, ViT-B/16,
``--methods attention``): 5.39 MB (2.56 MB of attention rows, the last layer with the heads
averaged, 51 KB per image; 2.76 MB of pictures); the same page with every layer and head would
hold 50 x 7.4 MB = 369 MB of attention rows. The bound itself is tested on 50 items of
ViT-B/16's shape (12 layers x 12 heads x 196 x 196 rows, incompressible pictures) written
straight to the page (:func:`test_fifty_vit_b_items_stay_under_the_bound`), and the end-to-end
run checks that each of its images costs less than a fiftieth of the bound.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vision_attn.explain.records import png_data_uri, quantise
from vision_attn.report import write_report
from vision_attn.report.budget import MAX_PAGE_BYTES, fit_attention, fit_items
from vision_attn.report.folder import record_line
from vision_attn.report.markup import fmt

from .conftest import save_timm_weights

VIT_B = {"layers": 12, "heads": 12, "grid": [14, 14]}


def _patches_item(name: str, layers: int, heads: int, grid: list[int], maps: str, picture: str) -> dict:
    return {"name": name, "text": "tabby cat 0.91", "image": picture, "panels": [picture], "kind": "patches",
            "grid": grid, "layers": layers, "heads": heads, "maps": maps}


def _noise_uri(h: int, w: int, seed: int) -> str:
    return png_data_uri((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


def test_fifty_vit_b_items_stay_under_the_bound(tmp_path):
    n = 196
    rows = np.random.default_rng(0).random((12, 12, n, n)).astype(np.float32)
    maps = quantise(rows)
    assert len(maps) > 7_000_000  # one image's every layer and head: 7.4 MB of text
    picture, panel = _noise_uri(224, 224, 1), _noise_uri(240, 920, 2)  # noise: the worst case for JPEG
    items = [{**_patches_item(f"img{k:02d}.png", 12, 12, [14, 14], maps, picture), "panels": [panel]}
             for k in range(50)]
    path = write_report(tmp_path / "report.html", "vit-b", {"images": 50}, {}, items)
    size = path.stat().st_size
    assert size < MAX_PAGE_BYTES, size
    page = path.read_text()
    kept = json.loads(page[page.index("const ITEMS=") + len("const ITEMS="): page.index(";const PAGE=")])
    assert len(kept) == 50 and {it["reduced"] for it in kept} == {"the last layer, heads averaged"}
    assert kept[0]["layers"] == 1 and kept[0]["heads"] == 1 and kept[0]["layer_ids"] == [11]
    assert len(base64.b64decode(kept[0]["maps"])) == n * n
    assert page.count('loading="lazy"') == 50  # every panel


def test_attention_is_kept_whole_when_it_fits_and_reduced_in_order_when_not():
    rng = np.random.default_rng(0)
    rows = rng.random((2, 3, 16, 16))
    item = _patches_item("a", 2, 3, [4, 4], quantise(rows), "")
    assert fit_attention(item, 10_000) is item  # a small model keeps every layer and head
    full = 2 * 3 * 256 * 4 // 3
    forms = [fit_attention(item, b)["reduced"] for b in (full - 1, 1_000, 600, 300)]
    assert forms == ["the last layer's heads", "every layer, heads averaged", "the last layer, heads averaged",
                     "the last layer, heads averaged, 2 x 2 patches pooled"]
    fused = fit_attention(item, 300)
    assert fused["grid"] == [2, 2] and len(base64.b64decode(fused["maps"])) == 16 and fused["heads_fused"]
    # the head mean of the last layer, as stored (each row to its maximum)
    last = fit_attention(item, 600)
    mean = np.frombuffer(base64.b64decode(item["maps"]), np.uint8).reshape(2, 3, 16, 16)[-1].astype(float).mean(0)
    got = np.frombuffer(base64.b64decode(last["maps"]), np.uint8).reshape(16, 16)
    assert np.abs(got - np.round(mean / mean.max(-1, keepdims=True) * 255)).max() <= 1
    # full attention: every row kept, however large
    assert fit_items([item], full_attention=True)[0]["maps"] == item["maps"]


def test_counts_are_integers_and_records_read_as_lines():
    assert fmt(8) == "8" and fmt(np.int64(3)) == "3" and fmt(0.5) == "0.5000"
    line = record_line({"file": "a.jpg", "pred": "tabby, tabby cat", "score": 0.912,
                        "topk": [{"label": "tabby, tabby cat", "score": 0.912}, {"label": "tiger cat", "score": 0.05}]})
    assert line == "tabby, tabby cat 0.91 · tiger cat 0.05"
    dets = [{"label": "cat", "category_id": 1, "bbox": [0, 0, 1, 1], "score": 0.9}] * 7
    assert record_line({"file": "b.jpg", "detections": dets}) == \
        "7 detections: cat 0.90, cat 0.90, cat 0.90, cat 0.90, cat 0.90, and 2 more"
    caption = "a red circle next to a blue square on a white background " * 8
    assert record_line({"file": "c.jpg", "caption": caption}) == " ".join(caption.split())  # never cut


@pytest.fixture(scope="module")
def vit_b_weights(tmp_path_factory):
    """A timm ViT-B/16 made and saved by plain timm code (random weights, ImageNet-1k head)."""
    return save_timm_weights("vit_base_patch16_224", tmp_path_factory.mktemp("vitb"))


def _images(folder, n: int):
    folder.mkdir(parents=True)
    for k in range(n):
        h, w = (48, 64) if k % 2 else (80, 40)
        yy, xx = np.mgrid[0:h, 0:w]
        a = np.stack([(xx * 4 + k * 9) % 256, (yy * 3 + k * 5) % 256, ((xx + yy) * 2) % 256], -1).astype(np.uint8)
        Image.fromarray(a).save(folder / f"img{k:02d}.png")
    (folder / "broken.jpg").write_bytes(b"not an image")
    return folder


def test_predict_page_of_a_vit_b_opens_on_a_table_and_stays_small(vit_b_weights, tmp_path):
    from vision_attn.commands.predict import main

    images, out = _images(tmp_path / "imgs", 3), tmp_path / "out"
    main(["--model", "timm:vit_base_patch16_224", "--weights_file", str(vit_b_weights), "--images", str(images),
          "--output_dir", str(out), "--methods", "attention", "--num_workers", "0", "--topk", "3"])
    page = (out / "report.html").read_text()
    size = (out / "report.html").stat().st_size
    # each image's cost, with the page's fixed parts counted in it, times the 50 images the page holds
    assert 50 * size / 3 < MAX_PAGE_BYTES, size
    # the table first: each file with its top-k line, then the skipped file with its reason
    first = page.index('id="predictions"')
    assert first < page.index('id="grid"') and first < page.index('id="metrics"')
    rows = re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", page[first: page.index("</table>", first)])
    preds = json.loads((out / "predictions.json").read_text())
    assert [r[0] for r in rows] == ["img00.png", "img01.png", "img02.png"]
    assert [r[1] for r in rows] == [record_line(p).replace("&", "&amp;").replace("'", "&#x27;") for p in preds]
    assert all(r[1].count(" · ") == 2 for r in rows)  # the three best classes
    skipped = page[page.index('id="skipped"'):]
    reason = json.loads((out / "skipped.json").read_text())[0]["reason"]
    assert "broken.jpg" in skipped[: skipped.index("</table>")] and reason
    assert re.sub("&[^;]+;", "", reason)[:20] in re.sub("&[^;]+;", "", skipped[: skipped.index("</table>")])
    # counts as integers; cards with a readable line, not JSON; lazy pictures; the attention kept small
    assert "images <b class=\"headline\">3</b>" in page and "3.0000" not in page
    assert '{"pred"' not in page and '<p class="text">{' not in page
    assert page.count('loading="lazy"') == 3
    items = json.loads(page[page.index("const ITEMS=") + len("const ITEMS="): page.index(";const PAGE=")])
    assert {it["reduced"] for it in items} == {"the last layer, heads averaged"}


def _clicked_in_chromium(path) -> dict:
    """Open ``path`` in headless Chromium on a thread of its own (another test module may hold
    Playwright's sync API on this one), click the canvas; what the page shows."""
    import threading

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is part of the dev extra")
    from .conftest import CHROMIUM

    if not Path(CHROMIUM).exists():
        pytest.skip("no Chromium at /usr/bin/chromium")
    result: dict = {}

    def run() -> None:
        try:
            with sync_api.sync_playwright() as pw:
                b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
                page = b.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(path.resolve().as_uri())
                page.wait_for_function("() => document.querySelector('#cv0').dataset.shown === 'image'")
                result["heads"] = page.eval_on_selector_all("#head0 option", "os => os.map(o => o.value)")
                result["layers"] = page.eval_on_selector_all("#layer0 option", "os => os.map(o => o.textContent)")
                page.click("#cv0", position={"x": 30, "y": 30})
                page.wait_for_function("() => document.querySelector('#cv0').dataset.shown !== 'image'")
                result["shown"] = page.eval_on_selector("#cv0", "c => c.dataset.shown")
                result["errors"] = errors
                b.close()
        except Exception as err:  # noqa: BLE001 - handed to the test
            result["error"] = err

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    if "error" in result:
        raise result["error"]
    return result


def test_a_reduced_view_still_answers_clicks_in_the_browser(tmp_path):
    rows = np.random.default_rng(0).random((3, 2, 64, 64))
    picture = png_data_uri(np.full((32, 32, 3), 90, np.uint8))
    item = fit_attention(_patches_item("a.png", 3, 2, [8, 8], quantise(rows), picture), 2_000)
    assert item["reduced"] == "the last layer, heads averaged, 2 x 2 patches pooled"
    seen = _clicked_in_chromium(write_report(tmp_path / "report.html", "reduced", {}, {}, [item]))
    assert seen == {"heads": ["fused"], "layers": ["2"], "shown": "layer0-fused-patch0", "errors": []}
