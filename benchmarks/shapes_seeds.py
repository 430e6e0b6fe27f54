"""The shipped ``shapes.yaml`` recipes of detection and captioning over several seeds, run as
``make demo`` runs them (``python -m benchmarks.shapes_seeds``; not part of ``make test``).

    python -m benchmarks.shapes_seeds detection  [--seeds 0 1] [--results docs/results/detection_shapes.json]
    python -m benchmarks.shapes_seeds captioning [--seeds 0 1] [--results docs/results/captioning_shapes.json]

Each seed runs, one after the other, as a user runs them::

    python train.py --config configs/<task>/shapes.yaml --seed_everything S
    python eval.py --ckpt_path RUN/checkpoints/last.ckpt --output_dir RUN/eval

(detection validates after every epoch, to find the first epoch at map_50 >= 0.90 with map >= 0.60),
timed from start to exit. One row per seed with ``eval.py``'s ``metrics.json``, and their mean.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import command_line, finite, refuse_earlier_run, write_result
from benchmarks.holdout import REPO, run_folder, timed, validation_curve
from benchmarks.results_json import write_results

POINTING = (("pointing lrp_attention", "pointing_lrp_attention"), ("energy lrp_attention", "energy_lrp_attention"),
            ("pointing attention", "pointing_attention"), ("pointing random", "pointing_random"))
"""The explanations of both heads' default method (``lrp_attention``) and of the baselines."""
METRICS = {
    "detection": (("map", "map"), ("map_50", "map_50"), ("map_75", "map_75"), *POINTING),
    "captioning": (("BLEU-1", "bleu1"), ("BLEU-4", "bleu4"), ("CIDEr-D", "cider"), ("ROUGE-L", "rouge_l"),
                   ("METEOR", "meteor"), ("kinds_exact", "kinds_exact"), ("content_exact", "content_exact"),
                   ("count_acc", "count_acc"), *POINTING),
}
"""Per task: (column, ``metrics.json`` key) of the table."""
TARGET = "first epoch at map_50 0.90 / map 0.60"


def first_epoch(run_dir: Path, map_50: float = 0.90, map_: float = 0.60) -> int | None:
    """The first validated epoch with ``val/map_50 >= map_50`` and ``val/map >= map_`` (``None``: never)."""
    both = dict(validation_curve(run_dir, "val/map"))
    return next((e for e, v in validation_curve(run_dir, "val/map_50") if v >= map_50 and both.get(e, 0) >= map_), None)


def run_seed(task: str, seed: int, work: Path, overrides: Sequence[str] = (), run_dir: Path | None = None,
             eval_options: Sequence[str] = ()) -> dict:
    """``train.py`` then ``eval.py`` of ``configs/<task>/shapes.yaml`` at ``seed`` (with the
    ``train.py`` ``overrides`` and ``eval.py`` ``eval_options``), in ``run_dir`` (default:
    ``WORK/runs/<task>-seed<S>``): the seconds of each, ``eval.py``'s metrics and (detection) the
    first epoch at the target."""
    run_dir = run_dir or run_folder(work / "runs", task, f"seed{seed}")
    train = [sys.executable, str(REPO / "train.py"), "--config", f"configs/{task}/shapes.yaml",
             "--seed_everything", str(seed), "--trainer.default_root_dir", str(run_dir),
             "--trainer.enable_progress_bar", "false"]
    if task == "detection":
        train += ["--trainer.check_val_every_n_epoch", "1"]
    train_s = timed([*train, *overrides], run_dir / "train.log")
    out = run_dir / "eval"
    eval_s = timed([sys.executable, str(REPO / "eval.py"), "--config", f"configs/{task}/shapes.yaml", "--ckpt_path",
                    str(run_dir / "checkpoints" / "last.ckpt"), "--output_dir", str(out), *eval_options],
                   run_dir / "eval.log")
    result = {"seed": seed, "train_seconds": train_s, "eval_seconds": eval_s,
              "metrics": json.loads((out / "metrics.json").read_text())}
    if task == "detection":
        result["first_epoch"] = first_epoch(run_dir)
    return result


def table(task: str, runs: list[dict]) -> tuple[list, list[list]]:
    """The columns and rows (one per seed, then the mean of every column over the seeds)."""
    names = [name for name, _ in METRICS[task]]
    columns = ["seed", *({"name": n, "format": ".2f" if n == "CIDEr-D" else ".3f"} for n in names),
               *([TARGET] if task == "detection" else []),
               {"name": "train.py s", "format": ".0f"}, {"name": "eval.py s", "format": ".0f"}]
    rows = []
    for r in runs:
        rows.append([str(r["seed"]), *(finite(r["metrics"].get(key), 4) for _, key in METRICS[task]),
                     *([r["first_epoch"]] if task == "detection" else []), r["train_seconds"], r["eval_seconds"]])
    if len(rows) > 1:
        def mean(i: int) -> float | None:
            values = [row[i] for row in rows if isinstance(row[i], (int, float))]
            return round(statistics.fmean(values), 4) if len(values) == len(rows) else None
        rows.append([f"mean of seeds {', '.join(r[0] for r in rows)}", *(mean(i) for i in range(1, len(columns)))])
    return columns, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(METRICS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--results", default=None, help="also write the table as a results file of the documentation")
    parser.add_argument("--work", default=None, help="the runs (default: benchmarks/results/shapes-work)")
    parser.add_argument("--json", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(args.work or REPO / "benchmarks" / "results" / "shapes-work").resolve()
    try:  # every seed's folder checked before the first training
        for seed in args.seeds:
            refuse_earlier_run(run_folder(work / "runs", args.task, f"seed{seed}"), "run it with another --work")
    except FileExistsError as e:
        parser.error(str(e))
    runs = [run_seed(args.task, seed, work) for seed in args.seeds]
    write_result(args.json, {"task": args.task, "runs": runs})
    sys.stdout.write(json.dumps(table(args.task, runs)[1]) + "\n")
    if args.results:
        write_table(args.results, args.task, runs, command_line("benchmarks.shapes_seeds", argv))
    return 0


def write_table(path: str, task: str, runs: list[dict], command: str) -> None:
    """The runs' table as a results file of the documentation (``command``: what reproduces it)."""
    columns, rows = table(task, runs)
    config = f"configs/{task}/shapes.yaml"
    write_results(path, page=task, title=f"{config} over seeds",
                  description=f"`{config}` as shipped on its embedded shape scenes (the `make demo` data), "
                              "one seed after the other; `eval.py` on the validation split "
                              f"({'torchmetrics COCO mAP' if task == 'detection' else 'beam 3'}).",
                  command=command, columns=columns, rows=rows,
                  notes=["train.py s / eval.py s: from start to exit, data generation on first use included"]
                  + ([f"{TARGET}: validated after every epoch; empty: never"] if task == "detection" else []))


if __name__ == "__main__":
    raise SystemExit(main())
