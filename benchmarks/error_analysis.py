"""What a detector's error analysis costs in ``eval.py``, and how fast its mistakes browser opens.

    python -m benchmarks.error_analysis CKPT [--score_threshold 0.3 0.05] [--json docs/results/error_analysis.json]

For each threshold, one ``eval.py`` run of the checkpoint on its own data (every default on) with
the error analysis timed inside it: TIDE's error split and the per-image and per-class files
(:func:`~vision_attn.tasks.detection_results.detection_results`), the maps of the mistakes browser
(:func:`~vision_attn.explain.detection_mistakes.detection_mistakes`) and its page. The share is
their seconds over the rest of the run's. Then ``mistakes.html`` is opened in headless Chromium
five times: the median seconds until the filters have counted the cards and the first card is
drawn (Debian's ``/usr/bin/chromium`` through Playwright; the column is empty without them).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import command_line
from benchmarks.results_json import write_results

CHROMIUM = "/usr/bin/chromium"


def timed_eval(ckpt: str, out: Path, threshold: float) -> dict[str, float]:
    """``eval_main`` on ``ckpt`` with the error analysis's parts timed; the row's numbers."""
    import vision_attn.commands.evaluate as evaluate
    import vision_attn.tasks.detection as detection

    spent = {"files": 0.0, "maps": 0.0, "page": 0.0}
    originals = (detection.detection_results, detection.detection_mistakes, evaluate.write_mistakes_page)

    def timing(name, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        return run

    detection.detection_results = timing("files", originals[0])
    detection.detection_mistakes = timing("maps", originals[1])
    evaluate.write_mistakes_page = timing("page", originals[2])
    try:
        t0 = time.perf_counter()
        metrics = evaluate.eval_main(["--ckpt_path", ckpt, "--output_dir", str(out), "--explain.score_threshold",
                                      str(threshold), "--trainer.enable_progress_bar", "false"])
        total = time.perf_counter() - t0
    finally:
        detection.detection_results, detection.detection_mistakes, evaluate.write_mistakes_page = originals
    page = (out / "mistakes.html").read_text(encoding="utf-8")
    start = page.index("const CARDS=") + len("const CARDS=")
    cards = json.JSONDecoder().raw_decode(page[start:])[0]
    extra = sum(spent.values())
    return {"total": total, **spent, "share": extra / (total - extra), "cards": len(cards),
            "map_50": metrics.get("map_50"), "tide_miss": metrics.get("tide_miss")}


def open_seconds(page: Path, repeats: int = 5) -> float | None:
    """Median seconds until the browser page has counted its cards and drawn the first one."""
    if not Path(CHROMIUM).exists():
        return None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    times = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        for _ in range(repeats):
            tab = browser.new_page()
            t = time.perf_counter()
            tab.goto(page.as_uri())
            tab.wait_for_function("() => document.getElementById('shown').textContent.length > 0 && "
                                  "(!document.querySelector('.card') || document.querySelector('.card').dataset.drawn)")
            times.append(time.perf_counter() - t)
            tab.close()
        browser.close()
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> list[list]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="a detection checkpoint (evaluated on the data saved in it)")
    p.add_argument("--score_threshold", type=float, nargs="+", default=[0.3, 0.05])
    p.add_argument("--json", default=None, help="write the table here as a results file")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="error-analysis-") as tmp:
        for threshold in a.score_threshold:
            out = Path(tmp) / f"eval-{threshold:g}"
            r = timed_eval(a.ckpt, out, threshold)
            seconds = open_seconds(out / "mistakes.html")
            rows.append([threshold, r["cards"], round(r["total"], 1), round(r["files"], 2), round(r["maps"], 2),
                         round(r["page"], 2), round(r["share"], 4), None if seconds is None else round(seconds, 3)])
            print(f"threshold {threshold:g}: {r['cards']} cards; eval {r['total']:.1f} s, files {r['files']:.2f} s, "
                  f"maps {r['maps']:.2f} s, page {r['page']:.2f} s ({100 * r['share']:.1f} % of the rest); "
                  f"browser opens in {seconds if seconds is None else round(seconds, 3)} s")
    if a.json:
        write_results(a.json, page="detection", title="What the error analysis adds to eval.py",
                      command=command_line("benchmarks.error_analysis", argv),
                      columns=["score threshold", "mistake cards", {"name": "eval.py s", "format": ".1f"},
                               {"name": "TIDE and files s", "format": ".2f"},
                               {"name": "browser maps s", "format": ".2f"}, {"name": "browser page s", "format": ".2f"},
                               {"name": "share of the rest", "format": ".3f"},
                               {"name": "browser opens s (median of 5)", "format": ".3f"}],
                      rows=rows,
                      description="One `eval.py` run of the detector per threshold, everything on by default; the "
                                  "error analysis (TIDE's split, results_per_image.json / .csv, per_class.csv, the "
                                  "mistakes browser's maps and page) timed inside it. The share is its seconds over "
                                  "the rest of the run's. The browser: headless Chromium, until the filters have "
                                  "counted the cards and the first card is drawn.",
                      notes=[f"checkpoint: `{a.ckpt}`"])
    return rows


if __name__ == "__main__":
    main()
