"""Masked-image pretraining at equal total time: does pretraining the encoder on the training
images themselves (``configs/pretrain/mae.yaml``) give a better classifier than training
``configs/classification/small.yaml`` from scratch for the same wall time?

    python -m benchmarks.pretrain [--train_images 2000] [--val_images 500] [--epochs 30] \\
        [--pretrain_epochs 10] [--results docs/results/classification_pretraining.json]

The data is a generator the recipes were not tuned on: single hand-drawn stroke digits
(:func:`benchmarks.classification_holdout.stroke_digits`, one digit per image, 32 px, ten
classes) in the ImageFolder layout, written once under ``--work``. Four runs, each as a user runs it
(``train.py``, then ``eval.py``; timed from start to exit):

1. from scratch: ``small.yaml`` for ``--epochs`` epochs (time ``T``);
2. pretraining: ``mae.yaml`` for ``--pretrain_epochs`` epochs (time ``P``);
3. fine-tuning at equal time: ``small.yaml`` from the pretrained encoder
   (``--model.encoder.init_args.weights_file``) for ``round(epochs * (T - P) / T)`` epochs, so that
   pretraining and fine-tuning together take about ``T``;
4. fine-tuning for all ``--epochs`` epochs (``P + T`` in all: what pretraining gives with more time).

Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from benchmarks.classification_holdout import stroke_digits
from benchmarks.common import command_line, finite, machine, write_result
from benchmarks.holdout import REPO, timed
from benchmarks.results_json import write_results

log = logging.getLogger("benchmarks.pretrain")


def train_and_eval(name: str, config: str, root: Path, epochs: int, work: Path, extra: list[str],
                   evaluate: bool = True) -> dict:
    run_dir = work / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, str(REPO / "train.py"), "--config", config, "--data.root", str(root),
           "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(run_dir),
           "--trainer.enable_progress_bar", "false", *extra]
    result = {"name": name, "epochs": epochs, "train_seconds": timed(cmd, run_dir / "train.log"),
              "checkpoint": str(run_dir / "checkpoints" / "last.ckpt")}
    if evaluate:
        out = run_dir / "eval"
        timed([sys.executable, str(REPO / "eval.py"), "--ckpt_path", result["checkpoint"], "--output_dir", str(out),
               "--explain.num_overlays", "0", "--explain.faithfulness_images", "0"], run_dir / "eval.log")
        result["metrics"] = json.loads((out / "metrics.json").read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_images", type=int, default=2000)
    parser.add_argument("--val_images", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--pretrain_epochs", type=int, default=10)
    parser.add_argument("--work", default=None, help="data and runs (default: benchmarks/results/pretrain-work)")
    parser.add_argument("--results", default=None, help="also write the table (docs/results/...json)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(args.work or REPO / "benchmarks" / "results" / "pretrain-work").resolve()
    root = stroke_digits(work, args.train_images, args.val_images)
    small, mae = "configs/classification/small.yaml", "configs/pretrain/mae.yaml"
    scratch = train_and_eval("scratch", small, root, args.epochs, work, [])
    pre = train_and_eval("mae", mae, root, args.pretrain_epochs, work, [], evaluate=False)
    init = ["--model.encoder.init_args.weights_file", pre["checkpoint"]]
    equal_epochs = max(1, round(args.epochs * (scratch["train_seconds"] - pre["train_seconds"])
                                / scratch["train_seconds"]))
    equal = train_and_eval("mae-equal-time", small, root, equal_epochs, work, init)
    longer = train_and_eval("mae-full", small, root, args.epochs, work, init)
    runs = [("from scratch", scratch, None), ("MAE pretraining, then fine-tuning at equal total time", equal, pre),
            ("MAE pretraining, then fine-tuning for every epoch", longer, pre)]
    rows = []
    for label, run, before in runs:
        total = run["train_seconds"] + (before["train_seconds"] if before else 0.0)
        rows.append([label, before["epochs"] if before else 0, run["epochs"],
                     before["train_seconds"] if before else 0.0, run["train_seconds"], round(total, 1),
                     finite(run["metrics"].get("acc_top1"), 4), finite(run["metrics"].get("acc_macro"), 4)])
    result = {"rows": rows, "machine": machine(), "root": str(root)}
    sys.stdout.write(json.dumps(rows) + "\n")
    write_result(args.json, result)
    if args.results:
        write_results(args.results, page="classification",
                      title="Masked-image pretraining on the training images, at equal total time",
                      description=(f"Single hand-drawn stroke digits, 32 px, {args.train_images} / {args.val_images} "
                                   "images, ten classes: `configs/classification/small.yaml` from scratch against "
                                   "`configs/pretrain/mae.yaml` on the same training images followed by "
                                   "`small.yaml` with `--model.encoder.init_args.weights_file` (top-1 on val)."),
                      command=command_line("benchmarks.pretrain", sys.argv[1:] if argv is None else argv),
                      columns=["run", "pretraining epochs", "epochs", *({"name": f"{k} s", "format": ".0f"}
                                                                        for k in ("pretraining", "training", "total")),
                               {"name": "acc_top1", "format": ".3f"}, {"name": "acc_macro", "format": ".3f"}],
                      rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
