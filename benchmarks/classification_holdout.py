"""The classification ``small.yaml`` recipe on digit sets it was not tuned on
(``python -m benchmarks.classification_holdout``; not part of ``make test``).

    python -m benchmarks.classification_holdout DATA [--epochs 30] [--name RUN]
        [--results docs/results/classification_holdout.json] [-- OVERRIDES ...]

``DATA`` is one of:

- ``strokes``: single hand-drawn stroke digits (:func:`vision_attn.data.strokes.render_stroke_scene`,
  one digit per image, coloured gradient backgrounds, stray pen lines, any ink colour), 32 px,
  2000 / 500 images;
- ``sklearn``: scikit-learn's bundled handwritten digits (8 x 8 grey, 1797 images, resized to
  32 px), 1300 / 497 images;
- ``glyphs``: the embedded font digits the recipe was tuned on (``vision-attn data glyphs``),
  1000 / 500 images.

Each run is ``train.py`` exactly as a user runs it, in a subprocess::

    python train.py --config configs/classification/small.yaml --data.root ROOT --trainer.max_epochs 30

(plus the overrides after ``--``), timed from start to exit, and scored by the last validation's
``val/acc_top1`` (the run's ``csv/version_*/metrics.csv``). ``--results`` keeps one row per
``--name`` in the results file, so several runs make one table.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np

from benchmarks.common import command_line, finite, machine, refuse_earlier_run, write_result
from benchmarks.holdout import REPO, timed
from benchmarks.results_json import write_results
from vision_attn.data.strokes import mask_to_rle, render_stroke_scene

log = logging.getLogger("benchmarks.classification_holdout")

CONFIG = "configs/classification/small.yaml"


def _write_folder(root: Path, write: Callable[[Path], dict]) -> Path:
    """``root`` written once by ``write(tmp)`` (which returns the manifest), in one rename."""
    if (root / "manifest.json").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp-", dir=root.parent))
    try:
        (tmp / "manifest.json").write_text(json.dumps(write(tmp)))
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _save(path: Path, img: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), img):
        raise OSError(f"OpenCV could not write {path}")


def stroke_digits(work: Path, train_images: int = 2000, val_images: int = 500, size: int = 32, seed: int = 7) -> Path:
    """An ImageFolder root of single stroke digits (``train/<digit>/``, ``val/<digit>/``), written
    once, with each split's digit masks in ``annotations/instances_<split>.json`` (COCO RLE;
    ``file_name`` relative to the root: what ``eval.py --explain.annotations`` reads)."""

    def write(tmp: Path) -> dict:
        (tmp / "annotations").mkdir()
        categories = [{"id": d + 1, "name": str(d)} for d in range(10)]
        for offset, (split, count) in enumerate((("train", train_images), ("val", val_images))):
            rng = np.random.default_rng([seed, offset])
            images, annotations = [], []
            for i in range(count):
                digit, placed = i % 10, []
                while not placed:  # a digit cut off at the border is drawn again
                    img, placed, _ = render_stroke_scene(rng, size, [digit], 0.5, 0.75)
                name = f"{split}/{digit}/{i:05d}.png"
                _save(tmp / name, cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
                mask = placed[0][1]
                ys, xs = np.nonzero(mask)
                images.append({"id": i + 1, "file_name": name, "height": size, "width": size})
                annotations.append({"id": i + 1, "image_id": i + 1, "category_id": digit + 1, "iscrowd": 0,
                                    "bbox": [float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1),
                                             float(ys.max() - ys.min() + 1)],
                                    "area": float(mask.sum()), "segmentation": mask_to_rle(mask)})
            (tmp / "annotations" / f"instances_{split}.json").write_text(
                json.dumps({"images": images, "annotations": annotations, "categories": categories}))
        return {"train": train_images, "val": val_images, "size": size, "seed": seed}

    return _write_folder(work / "data" / f"stroke-digits-v2-s{size}-n{train_images}-{val_images}-seed{seed}", write)


def sklearn_digits(work: Path, train_images: int = 1300, size: int = 32, seed: int = 0) -> Path:
    """scikit-learn's bundled 8 x 8 digits resized to ``size`` px, shuffled by ``seed``: the first
    ``train_images`` for training, the rest for validation (ImageFolder, written once)."""
    from sklearn.datasets import load_digits

    def write(tmp: Path) -> dict:
        digits = load_digits()
        order = np.random.default_rng(seed).permutation(len(digits.images))
        for k, i in enumerate(order):
            img = cv2.resize((digits.images[i] / 16.0 * 255).astype(np.uint8), (size, size),
                             interpolation=cv2.INTER_LINEAR)
            _save(tmp / ("train" if k < train_images else "val") / str(digits.target[i]) / f"{i:05d}.png", img)
        return {"train": train_images, "val": len(order) - train_images, "size": size, "seed": seed}

    return _write_folder(work / "data" / f"sklearn-digits-s{size}-n{train_images}-seed{seed}", write)


def glyph_digits(work: Path) -> Path:
    """The embedded glyph digits the recipe was tuned on (``vision-attn data glyphs --num_train 1000
    --num_val 500``)."""
    from vision_attn.data.synthetic import ShapesConfig, ensure_glyphs_classification

    return ensure_glyphs_classification(ShapesConfig(image_size=32, num_train=1000, num_val=500), work / "data")


DATASETS = {
    "strokes": ("single stroke digits, 32 px, 2000 / 500 images", stroke_digits),
    "sklearn": ("scikit-learn digits (grey), 32 px, 1300 / 497 images", sklearn_digits),
    "glyphs": ("embedded glyph digits, 32 px, 1000 / 500 images", glyph_digits),
}


def last_val_top1(run_dir: Path) -> float | None:
    """The last ``val/acc_top1`` of a run's CSV log."""
    found = None
    for path in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("val/acc_top1"):
                    found = float(row["val/acc_top1"])
    return found


def run(data: str, name: str, epochs: int, overrides: list[str], work: Path) -> dict:
    run_dir = work / "runs" / f"{data}-{name}"
    refuse_earlier_run(run_dir)
    root = DATASETS[data][1](work)
    cmd = [sys.executable, str(REPO / "train.py"), "--config", CONFIG, "--data.root", str(root),
           "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(run_dir),
           "--trainer.enable_progress_bar", "false", *overrides]
    seconds = timed(cmd, run_dir / "train.log")
    return {"data": data, "name": name, "epochs": epochs, "train_seconds": seconds, "overrides": overrides,
            "acc_top1": last_val_top1(run_dir)}


DESCRIPTION = ("`configs/classification/small.yaml` trained 30 epochs through `train.py` on three digit sets: "
               "single hand-drawn stroke digits on coloured, cluttered backgrounds in any ink colour (a generator "
               "the recipe was not tuned on), scikit-learn's grey handwritten digits, and the embedded glyphs it "
               "was tuned on; top-1 of the last validation.")
COLUMNS = ["run", "data", "epochs", "train s", {"name": "acc_top1", "format": ".3f"}, "train.py overrides"]


def write_row(path: str, result: dict, command: str, glance: bool = False) -> None:
    """One row per run name in ``path`` (rows of other runs kept); ``glance``: this run is the
    README's "results at a glance" row of held-out classification."""
    row = [result["name"], DATASETS[result["data"]][0], result["epochs"], result["train_seconds"],
           finite(result["acc_top1"], 4), " ".join(result["overrides"]) or "none"]
    rows, shown = [row], []
    target = Path(path)
    if target.is_file():
        old = json.loads(target.read_text(encoding="utf-8"))
        if old.get("columns") == COLUMNS:
            rows = [r for r in old.get("rows", []) if r[0] != result["name"]] + rows
            shown = old.get("glance", [])
    if glance:
        shown = [{"task": "classification (held out)", "data": DATASETS[result["data"]][0],
                  "metric": f"acc_top1 {result['acc_top1']:.3f}", "time": f"{result['train_seconds']:.0f} s training"}]
    write_results(path, page="classification", title="small.yaml on digit sets it was not tuned on (classification)",
                  description=DESCRIPTION, command=command, columns=COLUMNS, rows=rows, glance=shown,
                  notes=["each row: the same command with DATA, --name RUN and its train.py overrides after --"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", choices=sorted(DATASETS))
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--name", default="small", help="the run's name (its row in --results)")
    parser.add_argument("--results", default=None, help="also write the run as a row of this results file")
    parser.add_argument("--work", default=None, help="data and runs (default: benchmarks/results/classification-work)")
    parser.add_argument("--glance", action="store_true",
                        help="with --results: this run is the README's 'results at a glance' row")
    parser.add_argument("--json", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(args.work or REPO / "benchmarks" / "results" / "classification-work").resolve()
    try:
        result = run(args.data, args.name, args.epochs, overrides, work)
    except FileExistsError as e:
        parser.error(str(e))
    result["machine"] = machine()
    sys.stdout.write(json.dumps(result) + "\n")
    write_result(args.json, result)
    if args.results:
        generic = "python -m benchmarks.classification_holdout DATA --name RUN --results " + args.results + \
            " -- OVERRIDES"
        write_row(args.results, result, generic if overrides or args.name != "small" else
                  command_line("benchmarks.classification_holdout", argv), glance=args.glance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
