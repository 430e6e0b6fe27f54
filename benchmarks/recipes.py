"""How the from-scratch classification recipe holds up across data sizes, and what each
small-data technique and pretraining add (``python -m benchmarks.recipes``; not part of
``make test``: it trains dozens of models).

    python -m benchmarks.recipes sweep    [--sizes 500 1000 2000 5000 10000] [--colours grey colour]
                                          [--image_sizes 32 64] [--epochs 30]
    python -m benchmarks.recipes ablation [--size 1000] [--epochs 30]
    python -m benchmarks.recipes finetune [--sizes 200 1000] [--epochs 30]
        [--config configs/classification/small.yaml] [--work DIR] [--json FILE]

Every run is ``train.py`` exactly as a user runs it, in a subprocess::

    python train.py --config configs/classification/small.yaml --data.root ROOT --trainer.max_epochs 30

(plus the row's overrides), timed from start to exit (start-up, data scan and validation
included), and scored by the last epoch's ``val/acc_top1`` (read from the run's
``csv/version_*/metrics.csv``). The data are the embedded glyphs (ten digits in seven fonts,
slanted, coloured, cluttered: :func:`vision_attn.data.synthetic.ensure_glyphs_classification`)
with ``N`` training and :data:`VAL_IMAGES` validation images; ``grey`` rows use a copy written as
single-channel PNGs (as many small real datasets are).

- ``sweep``: the recipe as shipped at every size, colour and image size.
- ``ablation``: one technique changed per row against the recipe, same data, same epochs (so
  the same number of optimiser steps, except the batch-size row, which is about steps).
- ``finetune``: a small ViT (linear patch stem, so its weights are a plain timm state dict) is
  pretrained on the embedded *shapes* data, saved as a ``.safetensors`` timm weights file, and
  fine-tuned through ``--model.encoder.init_args.weights_file`` on ``N`` glyph images, against
  the same architecture trained from scratch on the same images.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine, write_result

log = logging.getLogger("benchmarks.recipes")

REPO = Path(__file__).resolve().parents[1]
VAL_IMAGES = 1000
"""Validation images of every run (the accuracy of 1000 images has a standard error of at most
1.6 points, about 0.4 near 0.98)."""

ABLATION: dict[str, list[str]] = {
    "recipe (small.yaml)": [],
    "stem linear (patch)": ["--model.encoder.init_args.stem", "patch"],
    "stem SPT": ["--model.encoder.init_args.stem", "spt"],
    "conv stem from 16 channels (a narrower stem)": ["--model.encoder.init_args.stem_channels", "16"],
    "+ LSA": ["--model.encoder.init_args.lsa", "true"],
    "pooling cls": ["--model.init_args.head.pooling", "cls"],
    "pooling mean": ["--model.init_args.head.pooling", "mean"],
    "repeated augmentation x3": ["--data.init_args.augment.repeated_augmentation", "3"],
    "mixup 0.8 / cutmix 1.0": ["--model.init_args.mix.mixup", "0.8", "--model.init_args.mix.cutmix", "1.0"],
    "RandAugment 2 ops": ["--data.init_args.augment.randaugment_ops", "2"],
    "hflip on": ["--data.init_args.augment.hflip", "true"],
    "batch 128 (fixed)": ["--data.init_args.batching.batch_size", "128"],
    "batch 16 (auto, min 8)": ["--data.init_args.batching.min_batch_size", "8",
                               "--data.init_args.batching.min_steps_per_epoch", "60"],
    "embed dim 96 (3 heads)": ["--model.encoder.init_args.embed_dim", "96", "--model.encoder.init_args.num_heads", "3"],
}
"""Row name -> the overrides of that row (on top of the recipe). A row whose override equals
the recipe's own setting measures the recipe again (a second seed of sorts)."""

FINETUNE_ENCODER = ["--model.encoder.init_args.stem", "patch"]
"""The pretrained and the from-scratch model of the ``finetune`` rows: the recipe's encoder with
timm's linear patch embedding (a conv / SPT stem is not part of a timm state dict)."""


def glyph_root(work: Path, size: int, image_size: int, colour: str) -> Path:
    """The embedded glyphs with ``size`` training images (written once under ``work``); for
    ``colour == "grey"`` a single-channel copy next to it."""
    from vision_attn.data.synthetic import ShapesConfig, ensure_glyphs_classification

    root = ensure_glyphs_classification(ShapesConfig(image_size=image_size, num_train=size, num_val=VAL_IMAGES),
                                        cache_dir=work / "data")
    if colour == "colour":
        return root
    if colour != "grey":
        raise ValueError(f"colour must be 'grey' or 'colour', got {colour!r}")
    grey = root.with_name(root.name + "-grey")
    if not (grey / "done").exists():
        import cv2

        for png in sorted(root.glob("*/*/*.png")):
            target = grey / png.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(target), cv2.cvtColor(cv2.imread(str(png)), cv2.COLOR_BGR2GRAY))
        (grey / "done").write_text("")
    return grey


def shapes_root(work: Path, size: int, image_size: int) -> Path:
    from vision_attn.data.synthetic import ShapesConfig, ensure_shapes_classification

    return ensure_shapes_classification(ShapesConfig(image_size=image_size, num_train=size, num_val=VAL_IMAGES),
                                        cache_dir=work / "data")


def last_metric(run_dir: Path, key: str = "val/acc_top1") -> float | None:
    """The last logged value of ``key`` in the run's ``csv/version_*/metrics.csv`` (newest version)."""
    files = sorted(run_dir.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not files:
        return None
    value = None
    with files[-1].open() as f:
        for row in csv.DictReader(f):
            if row.get(key):
                value = float(row[key])
    return value


def train(config: str, root: Path, epochs: int, run_dir: Path, overrides: list[str]) -> dict[str, float | None]:
    """One ``train.py`` run as a user runs it; ``{"top1", "seconds"}``."""
    cmd = [sys.executable, str(REPO / "train.py"), "--config", config, "--data.root", str(root),
           "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(run_dir),
           "--trainer.enable_progress_bar", "false", *overrides]
    log.info("%s", " ".join(cmd))
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ})
    seconds = time.perf_counter() - start
    (run_dir / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        log.error("run failed (exit %d), see %s", done.returncode, run_dir / "train.log")
        return {"top1": None, "seconds": round(seconds, 1)}
    return {"top1": last_metric(run_dir), "seconds": round(seconds, 1)}


def export_timm_weights(ckpt: Path, target: Path) -> Path:
    """The encoder of a suite checkpoint as a timm ``.safetensors`` state dict (what
    ``--model.encoder.init_args.weights_file`` reads)."""
    from safetensors.torch import save_file

    from vision_attn.tasks.base import load_task

    task = load_task(ckpt)
    state = {k: v.contiguous() for k, v in task.encoder.model.state_dict().items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target))
    return target


def run_sweep(args, work: Path) -> list[dict]:
    rows = []
    for image_size in args.image_sizes:
        for colour in args.colours:
            for size in args.sizes:
                root = glyph_root(work, size, image_size, colour)
                name = f"glyphs-{size}-{colour}-{image_size}px"
                result = train(args.config, root, args.epochs, work / "runs" / "sweep" / name, [])
                rows.append({"train_images": size, "colour": colour, "image_size": image_size, **result})
                log.info("%s: %s", name, result)
    return rows


def run_ablation(args, work: Path) -> list[dict]:
    root = glyph_root(work, args.size, 32, args.colour)
    rows = []
    for name, overrides in ABLATION.items():
        if args.rows and name not in args.rows:
            continue
        result = train(args.config, root, args.epochs, work / "runs" / "ablation" / name.replace(" ", "_").replace(
            "/", "-"), overrides)
        rows.append({"row": name, "overrides": " ".join(overrides), **result})
        log.info("%s: %s", name, result)
    return rows


def run_finetune(args, work: Path) -> list[dict]:
    pre_dir = work / "runs" / "finetune" / "pretrain-shapes"
    weights = work / "pretrained" / "vit_small_data.safetensors"
    if not weights.exists():
        result = train(args.config, shapes_root(work, args.pretrain_images, 32), args.pretrain_epochs, pre_dir,
                       FINETUNE_ENCODER)
        log.info("pretraining on shapes: %s", result)
        export_timm_weights(pre_dir / "checkpoints" / "last.ckpt", weights)
    rows = []
    for size in args.sizes:
        root = glyph_root(work, size, 32, args.colour)
        scratch = train(args.config, root, args.epochs, work / "runs" / "finetune" / f"scratch-{size}",
                        FINETUNE_ENCODER)
        tuned = train(args.config, root, args.epochs, work / "runs" / "finetune" / f"finetune-{size}",
                      [*FINETUNE_ENCODER, "--model.encoder.init_args.weights_file", str(weights), *args.finetune_args])
        rows.append({"train_images": size, "scratch": scratch, "finetune": tuned})
        log.info("%d images: scratch %s, fine-tuned %s", size, scratch, tuned)
    return rows


def markdown(kind: str, rows: list[dict]) -> str:
    def pct(v):
        return "—" if v is None else f"{v:.3f}"

    if kind == "sweep":
        lines = ["| train images | colour | px | top-1 | wall s |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['train_images']} | {r['colour']} | {r['image_size']} | {pct(r['top1'])} | {r['seconds']} |"
                  for r in rows]
    elif kind == "ablation":
        lines = ["| row | top-1 | wall s |", "| --- | --- | --- |"]
        lines += [f"| {r['row']} | {pct(r['top1'])} | {r['seconds']} |" for r in rows]
    else:
        lines = ["| train images | from scratch | fine-tuned | gain |", "| --- | --- | --- | --- |"]
        for r in rows:
            a, b = r["scratch"]["top1"], r["finetune"]["top1"]
            gain = "—" if a is None or b is None else f"{100 * (b - a):+.1f} pts"
            lines.append(f"| {r['train_images']} | {pct(a)} | {pct(b)} | {gain} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["sweep", "ablation", "finetune"])
    parser.add_argument("--config", default="configs/classification/small.yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--size", type=int, default=1000, help="ablation: training images")
    parser.add_argument("--colours", nargs="+", default=["grey", "colour"])
    parser.add_argument("--colour", default="colour", help="ablation / finetune: grey or colour")
    parser.add_argument("--image_sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--rows", nargs="*", default=None, help="ablation: only these rows")
    parser.add_argument("--pretrain_images", type=int, default=4000)
    parser.add_argument("--pretrain_epochs", type=int, default=30)
    parser.add_argument("--finetune_args", nargs="*", default=[], help="extra overrides of the fine-tuned runs")
    parser.add_argument("--work", default=None, help="data and runs (default: benchmarks/results/recipes-work)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.sizes is None:
        args.sizes = [200, 1000] if args.kind == "finetune" else [500, 1000, 2000, 5000, 10000]
    work = Path(args.work or REPO / "benchmarks" / "results" / "recipes-work").resolve()
    runner = {"sweep": run_sweep, "ablation": run_ablation, "finetune": run_finetune}[args.kind]
    rows = runner(args, work)
    table = markdown(args.kind, rows)
    sys.stdout.write(table + "\n")
    write_result(args.json, {"kind": args.kind, "config": args.config, "epochs": args.epochs, "machine": machine(),
                             "rows": rows, "table": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
