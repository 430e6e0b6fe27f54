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
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import command_line, finished_run, machine, read_run_record, refuse_earlier_run, write_result
from benchmarks.results_json import write_results

log = logging.getLogger("benchmarks.recipes")

REPO = Path(__file__).resolve().parents[1]
VAL_IMAGES = 1000
"""Validation images of every run (the accuracy of 1000 images has a standard error of at most
1.6 points, about 0.4 near 0.98)."""

_ENC = "--model.encoder.init_args."
_AUG = "--data.init_args.augment."
_BATCH = "--data.init_args.batching."
_OPTIM = "--model.init_args.optim."
ABLATION: dict[str, list[str]] = {
    "recipe (small.yaml)": [],
    "linear patch stem (timm's patch embedding)": [_ENC + "stem", "patch"],
    "SPT stem (shifted patch tokenization)": [_ENC + "stem", "spt"],
    "strided conv stem": [_ENC + "stem", "conv"],
    "layer norm in the CNN stem (instead of instance norm)": [_ENC + "stem_norm", "layer"],
    "CNN stem from 16 channels": [_ENC + "stem_channels", "16"],
    "CNN stem from 64 channels": [_ENC + "stem_channels", "64"],
    "8 x 8 patches (a 4 x 4 token grid)": [_ENC + "patch_size", "8"],
    "+ LSA (locality self-attention)": [_ENC + "lsa", "true"],
    "class-token pooling": ["--model.init_args.head.pooling", "cls"],
    "mean pooling": ["--model.init_args.head.pooling", "mean"],
    "width 96, 3 heads": [_ENC + "embed_dim", "96", _ENC + "num_heads", "3"],
    "depth 6": [_ENC + "depth", "6"],
    "mlp_ratio 4": [_ENC + "mlp_ratio", "4"],
    "drop_path_rate 0": [_ENC + "drop_path_rate", "0"],
    "label smoothing 0": ["--model.init_args.label_smoothing", "0"],
    "repeated augmentation x3": [_AUG + "repeated_augmentation", "3"],
    "mixup 0.8 / cutmix 1.0 (timm)": ["--model.init_args.mix.mixup", "0.8", "--model.init_args.mix.cutmix", "1.0"],
    "RandAugment 2 ops": [_AUG + "randaugment_ops", "2"],
    "horizontal flips on": [_AUG + "hflip", "true"],
    "colour jitter 0.5": [_AUG + "colour_jitter", "0.5"],
    "colour jitter 0 (none)": [_AUG + "colour_jitter", "0"],
    "batch 128 (fixed)": [_BATCH + "batch_size", "128"],
    "smaller batches (auto, floor 8, 100 steps per epoch)": [_BATCH + "min_batch_size", "8",
                                                             _BATCH + "min_steps_per_epoch", "100"],
    "lr 1.5e-3": [_OPTIM + "lr", "1.5e-3"],
    "lr 5e-4": [_OPTIM + "lr", "5e-4"],
    "weight decay 0.1": [_OPTIM + "weight_decay", "0.1"],
    "EMA of the weights (decay 0.998)": [_OPTIM + "ema_decay", "0.998"],
}
"""Row name -> the overrides of that row (on top of ``small.yaml``): one change per row."""

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


def run_folder(work: Path, kind: str, name: str) -> Path:
    """The folder of one run: ``WORK/runs/KIND/NAME`` with characters other than letters, digits
    and ``._+-`` of the name replaced by ``_``."""
    return work / "runs" / kind / (re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("._") or "run")


def sweep_name(size: int, colour: str, image_size: int) -> str:
    return f"glyphs-{size}-{colour}-{image_size}px"


def run_sweep(args, work: Path, on_row: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    cells = [(image_size, colour, size) for image_size in args.image_sizes for colour in args.colours
             for size in args.sizes]
    for image_size, colour, size in cells:  # every run's folder checked before the first training
        refuse_earlier_run(run_folder(work, "sweep", sweep_name(size, colour, image_size)), "give another --work")
    rows = []
    for image_size, colour, size in cells:
        root = glyph_root(work, size, image_size, colour)
        name = sweep_name(size, colour, image_size)
        result = train(args.config, root, args.epochs, run_folder(work, "sweep", name), [])
        rows.append({"train_images": size, "colour": colour, "image_size": image_size, **result})
        log.info("%s: %s", name, result)
        on_row(rows)
    return rows


RUN_RESULT = "result.json"
"""The file in an ablation run's folder holding its settings and result once it has finished: a
second ``ablation`` call with the same ``--work`` reads it instead of training again."""


def read_run_result(path: Path) -> dict:
    """A finished ablation run's :data:`RUN_RESULT` (its settings, ``top1`` and ``seconds``).

    Raises:
        ValueError: naming the file when it is not such a record.
    """
    return read_run_record(path, ("top1", "seconds"))


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known and len(known) == len(values) else None


def run_ablation(args, work: Path, on_row: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every row of :data:`ABLATION` (or ``args.rows``) at every seed of ``args.seeds``; a run
    finished earlier under ``work`` with the same settings is read back, not trained again."""
    names = [name for name in ABLATION if not args.rows or name in args.rows]
    unknown = sorted(set(args.rows or ()) - set(ABLATION))
    if unknown:
        raise ValueError(f"--rows: no ablation row named {', '.join(map(repr, unknown))}; the rows: "
                         + "; ".join(ABLATION))
    cells = {}
    for name in names:  # every run's folder checked before the first training
        for seed in args.seeds:
            run_dir = run_folder(work, "ablation", name if seed == 0 else f"{name} seed {seed}")
            settings = {"row": name, "overrides": ABLATION[name], "seed": seed, "config": args.config,
                        "epochs": args.epochs, "train_images": args.size, "colour": args.colour}
            cells[name, seed] = (run_dir, settings, finished_run(run_dir, settings, read_run_result, RUN_RESULT))
    root = glyph_root(work, args.size, 32, args.colour)
    rows = []
    for name in names:
        row: dict = {"row": name, "overrides": " ".join(ABLATION[name]), "seeds": [], "top1": [], "seconds": []}
        for seed in args.seeds:
            run_dir, settings, result = cells[name, seed]
            if result is not None:
                log.info("%s, seed %d: finished earlier (%s)", name, seed, run_dir / RUN_RESULT)
            else:
                result = train(args.config, root, args.epochs, run_dir,
                               [*ABLATION[name], "--seed_everything", str(seed)])
                if result["top1"] is not None:
                    (run_dir / RUN_RESULT).write_text(json.dumps({**settings, **result}, indent=1) + "\n",
                                                      encoding="utf-8")
            row["seeds"].append(seed)
            row["top1"].append(result["top1"])
            row["seconds"].append(result["seconds"])
            log.info("%s, seed %d: %s", name, seed, result)
        rows.append(row)
        on_row(rows)
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
        lines = ["| row | top-1 (mean of the seeds) | wall s (mean) |", "| --- | --- | --- |"]
        lines += [f"| {r['row']} | {pct(_mean(r['top1']))} | {_mean(r['seconds']) or 0:.0f} |" for r in rows]
    else:
        lines = ["| train images | from scratch | fine-tuned | gain |", "| --- | --- | --- | --- |"]
        for r in rows:
            a, b = r["scratch"]["top1"], r["finetune"]["top1"]
            gain = "—" if a is None or b is None else f"{100 * (b - a):+.1f} pts"
            lines.append(f"| {r['train_images']} | {pct(a)} | {pct(b)} | {gain} |")
    return "\n".join(lines)


def results_table(kind: str, rows: list[dict], args) -> dict:
    """The documentation's table of a ``sweep`` or ``ablation`` run: its title, description,
    columns and rows (``None`` where a run failed)."""
    seconds = {"name": "wall s", "format": ".0f"}
    if kind == "sweep":
        return {"title": "small.yaml on digit glyphs: top-1 by training-set size, colour and resolution",
                "description": f"`{args.config}` as shipped, {args.epochs} epochs through `train.py`, on the "
                f"embedded glyphs (ten digits in seven fonts, slanted, coloured, with clutter), {VAL_IMAGES} "
                "validation images; grey rows are single-channel copies; 64 px images are resized to the "
                "recipe's 32. Wall s: the whole `train.py` run (start-up, data scan and validations included), "
                "the runs one after another, alone.",
                "columns": ["train images", "colour", "px", {"name": "top-1", "format": ".3f"}, seconds],
                "rows": [[r["train_images"], r["colour"], r["image_size"], r["top1"], r["seconds"]] for r in rows]}
    recipe = next((r["top1"] for r in rows if not r["overrides"]), [])
    base = _mean(recipe) if recipe else None
    spread = [f"The recipe's own seeds lie {100 * (max(recipe) - min(recipe)):.1f} points apart (lowest to "
              "highest): a difference of that size is within what a seed changes."
              ] if len(recipe) > 1 and None not in recipe else []
    seeds = ", ".join(map(str, args.seeds))

    def difference(r: dict) -> float | None:
        top1 = _mean(r["top1"])
        return None if base is None or top1 is None or not r["overrides"] else 100 * (top1 - base)

    return {"title": f"small.yaml: one change at a time (top-1 after {args.epochs} epochs)",
            "description": f"Each row is one change to `{args.config}`, trained {args.epochs} epochs through "
            f"`train.py` on {args.size} embedded {args.colour} glyph images (ten digits in seven fonts, slanted, "
            f"with clutter) with {VAL_IMAGES} validation images, at seeds {seeds} (`--seed_everything`), the "
            "runs one after another, alone. Top-1: the mean over the seeds (each seed's in the next column); "
            "difference: the row's mean minus the recipe's, in points; wall s: the mean `train.py` run.",
            "columns": ["change", "train.py overrides", {"name": "top-1", "format": ".3f"}, "top-1 per seed",
                        {"name": "difference (points)", "format": "+.1f"}, {"name": "wall s", "format": ".0f"}],
            "notes": spread,
            "rows": [[r["row"], r["overrides"] or "none", _mean(r["top1"]),
                      " / ".join("–" if v is None else f"{v:.3f}" for v in r["top1"]), difference(r),
                      _mean(r["seconds"])] for r in rows]}


def write_results_table(path: str, kind: str, rows: list[dict], args, argv: list[str]) -> None:
    """Write the rows run so far as the documentation's results file ``path``."""
    write_results(path, page="classification", command=command_line("benchmarks.recipes", argv),
                  **results_table(kind, rows, args))


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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="ablation: train every row at these seeds")
    parser.add_argument("--pretrain_images", type=int, default=4000)
    parser.add_argument("--pretrain_epochs", type=int, default=30)
    parser.add_argument("--finetune_args", nargs="*", default=[], help="extra overrides of the fine-tuned runs")
    parser.add_argument("--work", default=None, help="data and runs (default: benchmarks/results/recipes-work)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--results", default=None,
                        help="sweep / ablation: the documentation's results file to write (after each run)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.sizes is None:
        args.sizes = [200, 1000] if args.kind == "finetune" else [500, 1000, 2000, 5000, 10000]
    work = Path(args.work or REPO / "benchmarks" / "results" / "recipes-work").resolve()
    if args.results and args.kind == "finetune":
        parser.error("--results: sweep and ablation write a results table, finetune does not")
    if args.kind == "finetune":
        rows = run_finetune(args, work)
    else:
        def on_row(rows: list[dict]) -> None:
            if args.results:
                write_results_table(args.results, args.kind, rows, args, argv)

        try:
            rows = (run_sweep if args.kind == "sweep" else run_ablation)(args, work, on_row)
        except (FileExistsError, ValueError) as e:
            parser.error(str(e))
    table = markdown(args.kind, rows)
    sys.stdout.write(table + "\n")
    write_result(args.json, {"kind": args.kind, "config": args.config, "epochs": args.epochs, "machine": machine(),
                             "rows": rows, "table": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
