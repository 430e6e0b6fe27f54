"""Which of the detection training aids help on the embedded scenes (``python -m
benchmarks.detection_ablation``; not part of ``make test``: each row trains a detector for minutes).

    python -m benchmarks.detection_ablation [--epochs 30] [--val_every 5] [--rows NAME ...]
        [--config configs/detection/shapes.yaml] [--work DIR] [--json FILE]
        [--results docs/results/detection_ablation.json]
    python -m benchmarks.detection_ablation --step_cost [--rows NAME ...] [--steps 30]

Every row is ``train.py`` exactly as a user runs it, in a subprocess, on the config's embedded
scenes (same seed, same data, same epochs, so the same number of optimiser steps), with one
change per row against the config::

    python train.py --config configs/detection/shapes.yaml --trainer.max_epochs 30 \\
        --trainer.check_val_every_n_epoch 5 <row's overrides>

The table reports the last validation's ``val/map``, ``val/map_50``, ``val/map_75`` (torchmetrics'
COCO mAP, equal to pycocotools), the first validated epoch at which ``val/map_50`` reaches 0.90,
and the wall time of the whole run (start-up and validations included). The wall time *at* that
epoch is the run's wall time times ``epoch / epochs`` (validation takes about 2 % of a run, so
this is within a few seconds).

``--step_cost`` measures what a row costs per training step instead, every row in this one
process (the config's model, data and batch, ``--steps`` timed steps after warm-up, median;
``--repeats`` rounds over the rows, interleaved, median of the rounds), so
that rows trained while the machine was shared can still be compared in wall time: time to an
epoch = epoch x steps per epoch x the step's median.
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

from lightning.pytorch import Callback

from benchmarks.common import command_line, machine, write_result
from benchmarks.results_json import write_results

log = logging.getLogger("benchmarks.detection_ablation")

REPO = Path(__file__).resolve().parents[1]
MAP50_BAR = 0.90

# shapes.yaml ships query selection + look forward twice (this ablation's winner); every row
# states all the aids it uses, so that the rows mean the same whatever the config turns on.
OFF = ["--model.init_args.head.query_selection", "false", "--model.init_args.head.look_forward_twice", "false",
       "--model.init_args.head.dn_groups", "0", "--model.init_args.head.o2m_groups", "0",
       "--model.init_args.head.pyramid", "false", "--model.init_args.head.dense_encoder", "false"]
PLAIN = [*OFF, "--model.init_args.head.box_refine", "false", "--model.init_args.head.focal", "false",
         "--model.init_args.loss.cost_class", "1", "--model.init_args.loss.weight_ce", "1"]
REMEDY = [*OFF, "--model.init_args.head.box_refine", "true", "--model.init_args.head.focal", "true"]
DN = ["--model.init_args.head.dn_groups", "5", "--model.init_args.head.box_noise_scale", "1.0"]  # the first noise
DN_04 = ["--model.init_args.head.dn_groups", "5", "--model.init_args.head.box_noise_scale", "0.4"]  # DN-DETR's own
NEG = ["--model.init_args.head.dn_negatives", "true"]
QS = ["--model.init_args.head.query_selection", "true", "--model.init_args.head.look_forward_twice", "true"]
HYBRID = ["--model.init_args.head.o2m_groups", "1", "--model.init_args.head.o2m_mode", "hybrid"]

ROWS: dict[str, list[str]] = {
    "plain DETR": PLAIN,
    "anchors + refinement + focal": REMEDY,
    "+ denoising (DN-DETR, 5 groups)": REMEDY + DN,
    "+ denoising with negatives (DINO)": REMEDY + DN + NEG,
    "+ query selection + look forward twice (DINO; shipped in shapes.yaml)": REMEDY + QS,
    "+ one-to-many, Group DETR (3 groups)": REMEDY + ["--model.init_args.head.o2m_groups", "3",
                                                      "--model.init_args.head.o2m_mode", "group"],
    "+ one-to-many, hybrid (H-DETR, K=6)": REMEDY + HYBRID,
    "+ simple feature pyramid (ViTDet)": REMEDY + ["--model.init_args.head.pyramid", "true"],
    "+ DN with negatives + query selection + look forward twice + hybrid": REMEDY + DN + NEG + QS + HYBRID,
    "+ query selection + look forward twice + denoising at noise 0.4": REMEDY + QS + DN_04,
    "+ query selection + look forward twice + dense token supervision (Co-DETR)": REMEDY + QS + [
        "--model.init_args.head.dense_encoder", "true"],
}
"""Row name -> overrides of the config (one aid per row against ``shapes.yaml``, then the combination)."""


def validation_curve(run_dir: Path, keys: tuple[str, ...] = ("val/map", "val/map_50", "val/map_75")) -> list[dict]:
    """``[{"epoch": e (1-based), key: value, ...}]`` of every validation logged in the run's newest
    ``csv/version_*/metrics.csv``."""
    files = sorted(run_dir.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not files:
        return []
    curve = []
    with files[-1].open() as f:
        for row in csv.DictReader(f):
            if row.get(keys[0]):
                curve.append({"epoch": int(row["epoch"]) + 1, **{k: float(row[k]) for k in keys if row.get(k)}})
    return curve


def summarise(curve: list[dict], seconds: float, epochs: int) -> dict:
    """The row's table entries from its validation curve and wall time."""
    last = curve[-1] if curve else {}
    reached = next((c["epoch"] for c in curve if c.get("val/map_50", 0.0) >= MAP50_BAR), None)
    return {"map": last.get("val/map"), "map_50": last.get("val/map_50"), "map_75": last.get("val/map_75"),
            "epoch_map50_090": reached,
            "seconds_map50_090": None if reached is None else round(seconds * reached / epochs, 1),
            "seconds": round(seconds, 1), "curve": curve}


def run_row(config: str, epochs: int, val_every: int, run_dir: Path, overrides: list[str]) -> dict:
    """One ``train.py`` run; the row's numbers (``map`` is None if the run failed, see its ``train.log``)."""
    cmd = [sys.executable, str(REPO / "train.py"), "--config", config, "--trainer.max_epochs", str(epochs),
           "--trainer.check_val_every_n_epoch", str(val_every), "--trainer.default_root_dir", str(run_dir),
           "--trainer.enable_progress_bar", "false", *overrides]
    log.info("%s", " ".join(cmd))
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ})
    seconds = time.perf_counter() - start
    (run_dir / "train.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        log.error("run failed (exit %d), see %s", done.returncode, run_dir / "train.log")
        return {"map": None, "seconds": round(seconds, 1), "curve": []}
    return summarise(validation_curve(run_dir), seconds, epochs)


class StepTimer(Callback):
    """Wall time of every training step (``on_train_batch_start`` to ``on_train_batch_end``)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)


def step_cost(config: str, overrides: list[str], steps: int, warmup: int, work: Path) -> dict:
    """Median seconds per training step of one row (in this process) and the steps per epoch."""
    from vision_attn.commands.train import TrainCLI

    cli = TrainCLI(args=["--config", config, *overrides, "--trainer.max_steps", str(warmup + steps),
                         "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
                         "--trainer.enable_progress_bar", "false",
                         "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(work)])
    timer = StepTimer()
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    timed = sorted(timer.times[warmup:])
    return {"step_s": round(timed[len(timed) // 2], 4), "steps_per_epoch": cli.trainer.num_training_batches}


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (the benchmark's standard output)."""
    def num(v):
        return "—" if v is None else f"{v:.3f}"

    lines = ["| row | map | map_50 | map_75 | map_50 ≥ 0.90 at epoch | … at wall s | run wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        at = "not reached" if r.get("epoch_map50_090") is None else str(r["epoch_map50_090"])
        wall = "—" if r.get("seconds_map50_090") is None else str(r["seconds_map50_090"])
        lines.append(f"| {r['row']} | {num(r.get('map'))} | {num(r.get('map_50'))} | {num(r.get('map_75'))} | "
                     f"{at} | {wall} | {r['seconds']} |")
    return "\n".join(lines)


def _validated_epochs(epochs: int, val_every: int) -> list[int]:
    return list(range(val_every, epochs + 1, val_every))


def results_columns(epochs: int, val_every: int) -> list:
    """The columns of the results table: the final scores, map_50 at each validation, the first
    epoch at map_50 >= 0.90 and the run's wall time."""
    checks = _validated_epochs(epochs, val_every)
    return ["row", *({"name": k, "format": ".3f"} for k in ("map", "map_50", "map_75")),
            *({"name": f"map_50 epoch {e}", "format": ".2f"} for e in checks),
            f"map_50 >= {MAP50_BAR:.2f} at epoch", {"name": "wall s", "format": ".0f"}]


def results_rows(rows: list[dict], epochs: int, val_every: int) -> list[list]:
    """One table row per ablation row (``None`` where a run failed or a validation is missing)."""
    checks = _validated_epochs(epochs, val_every)
    out = []
    for r in rows:
        at = {c["epoch"]: c.get("val/map_50") for c in r.get("curve", [])}
        out.append([r["row"], r.get("map"), r.get("map_50"), r.get("map_75"), *(at.get(e) for e in checks),
                    r.get("epoch_map50_090"), r.get("seconds")])
    return out


def write_results_table(path: str, rows: list[dict], config: str, epochs: int, val_every: int,
                        argv: list[str]) -> None:
    """The documentation's results file of the rows run so far (one machine, one after another)."""
    write_results(path, page="detection", title=f"Training aids of the DETR head after {epochs} epochs "
                  f"({Path(config).name})", command=command_line("benchmarks.detection_ablation", argv),
                  columns=results_columns(epochs, val_every), rows=results_rows(rows, epochs, val_every),
                  description=f"Every row is `train.py --config {config} --trainer.max_epochs {epochs}` with one "
                  "change (its overrides in `benchmarks/detection_ablation.py`), the same seed and data; "
                  f"torchmetrics' COCO mAP on the validation scenes every {val_every} epochs. The runs ran one "
                  "after another, alone.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/detection/shapes.yaml")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--val_every", type=int, default=5)
    parser.add_argument("--rows", nargs="*", default=None,
                        help="only the rows whose name contains one of these, in this order")
    parser.add_argument("--work", default=None, help="runs (default: benchmarks/results/detection-ablation)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--results", default=None, help="the documentation's results file to write (after each row)")
    parser.add_argument("--step_cost", action="store_true", help="per-step cost of each row instead of trainings")
    parser.add_argument("--steps", type=int, default=30, help="--step_cost: timed steps per row")
    parser.add_argument("--repeats", type=int, default=3, help="--step_cost: interleaved repeats (median)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(args.work or REPO / "benchmarks" / "results" / "detection-ablation").resolve()
    names = list(ROWS) if not args.rows else list(dict.fromkeys(n for key in args.rows for n in ROWS if key in n))
    if not names:
        parser.error(f"--rows {args.rows} matches none of: {', '.join(ROWS)}")
    if args.step_cost:
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.repeats):  # interleaved, so a slower spell of the machine hits every row alike
            for i, name in enumerate(names):
                runs[name].append(step_cost(args.config, ROWS[name], args.steps, 5, work / f"cost{r}-{i:02d}"))
                log.info("%s (repeat %d): %s", name, r, runs[name][-1])
        costs = [{"row": name, "step_s": sorted(c["step_s"] for c in runs[name])[len(runs[name]) // 2],
                  "steps_per_epoch": runs[name][0]["steps_per_epoch"], "repeats": [c["step_s"] for c in runs[name]]}
                 for name in names]
        lines = ["| row | s / step | s / epoch |", "| --- | --- | --- |"]
        lines += [f"| {c['row']} | {c['step_s']:.3f} | {c['step_s'] * c['steps_per_epoch']:.1f} |" for c in costs]
        sys.stdout.write("\n".join(lines) + "\n")
        write_result(args.json, {"config": args.config, "machine": machine(), "step_costs": costs})
        return 0
    rows = []
    for i, name in enumerate(names):
        result = run_row(args.config, args.epochs, args.val_every, work / f"row{i:02d}", ROWS[name])
        rows.append({"row": name, "overrides": ROWS[name], **result})
        log.info("%s: %s", name, {k: v for k, v in result.items() if k != "curve"})
        write_result(args.json, {"config": args.config, "epochs": args.epochs, "machine": machine(), "rows": rows,
                                 "table": markdown(rows)})
        if args.results:
            write_results_table(args.results, rows, args.config, args.epochs, args.val_every, argv)
    sys.stdout.write(markdown(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
