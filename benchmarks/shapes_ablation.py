"""The shipped ``shapes.yaml`` recipes of detection and captioning, one change at a time
(``python -m benchmarks.shapes_ablation``; not part of ``make test``: each run trains for minutes).

    python -m benchmarks.shapes_ablation detection  [--seeds 0 1] [--rows NAME ...] [--work DIR]
        [--results docs/results/detection_changes.json]
    python -m benchmarks.shapes_ablation captioning [--seeds 0 1] [--rows NAME ...] [--work DIR]
        [--results docs/results/captioning_changes.json]

Every run is the ``make demo`` command with one change (:data:`CHANGES`) at one seed, one after
the other::

    python train.py --config configs/<task>/shapes.yaml --seed_everything S <change>
    python eval.py --ckpt_path RUN/checkpoints/last.ckpt --output_dir RUN/eval <EVAL_OPTIONS>

(the evaluation scores the captions or boxes and leaves out the explanations, which no change
here touches). A row is the mean over the seeds of ``eval.py``'s ``metrics.json``, each seed's
headline value, and the difference of the means to the unchanged recipe. A finished run's
``result.json`` is read back instead of trained again, so an interrupted ablation resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

from benchmarks.common import command_line, finished_run, finite, read_run_record, write_result
from benchmarks.holdout import REPO, run_folder
from benchmarks.results_json import column_name, write_results
from benchmarks.shapes_seeds import run_seed

log = logging.getLogger("benchmarks.shapes_ablation")

RECIPE = "recipe (shapes.yaml)"
ENC = "--model.init_args.encoder.init_args."
HEAD = "--model.init_args.head."
OPT = "--model.init_args.optim."
CHANGES: dict[str, dict[str, list[str]]] = {
    "detection": {
        RECIPE: [],
        "random crops, area 0.6-1.0 (DETR's augmentation)": ["--data.init_args.transform.scale_jitter", "[0.6, 1.0]"],
        "no horizontal flips": ["--data.init_args.transform.hflip", "false"],
        "no local feed-forward (local_mlp false)": [f"{ENC}local_mlp", "false"],
        "depth 3": [f"{ENC}depth", "3"],
        "10 epochs": ["--trainer.max_epochs", "10"],
        "lr 1e-3": [f"{OPT}lr", "0.001"],
        "encoder lr 1.5e-3 (heads 7.5e-4)": [f"{OPT}encoder_lr", "0.0015"],
        "EMA of the weights (decay 0.998)": [f"{OPT}ema_decay", "0.998"],
        "conv stem 32 channels wide": [f"{ENC}stem_channels", "32"],
        "timm's linear patch embedding (stem patch)": [f"{ENC}stem", "patch"],
        "denoising, 5 groups at box noise 0.4 (DN-DETR)": [f"{HEAD}dn_groups", "5", f"{HEAD}box_noise_scale", "0.4"],
        "dense token supervision (Co-DETR)": [f"{HEAD}dense_encoder", "true"],
        "20 queries": [f"{HEAD}num_queries", "20"],
        "batch 4": ["--data.init_args.batching.batch_size", "4"],
    },
    "captioning": {
        RECIPE: [],
        "3 epochs": ["--trainer.max_epochs", "3"],
        "5 epochs": ["--trainer.max_epochs", "5"],
        "depth 4": [f"{ENC}depth", "4"],
        "no local feed-forward (local_mlp false)": [f"{ENC}local_mlp", "false"],
        "conv stem 32 channels wide": [f"{ENC}stem_channels", "32"],
        "no pixels in the decoder's memory (pixel_memory false)": ["--model.init_args.decoder.pixel_memory", "false"],
        "no embeddings in the decoder's memory (embedding_memory false)": [
            "--model.init_args.decoder.embedding_memory", "false", "--model.init_args.decoder.pixel_memory", "false"],
        "decoder dropout 0.1": ["--model.init_args.decoder.dropout", "0.1"],
        "grounding weight 0 (captions alone)": ["--model.init_args.training.grounding_weight", "0"],
        "grounding weight 0.5": ["--model.init_args.training.grounding_weight", "0.5"],
        "encoder lr 1.5e-3 (the decoder's)": [f"{OPT}encoder_lr", "0.0015"],
        "encoder lr 3e-3": [f"{OPT}encoder_lr", "0.003"],
        "EMA of the weights (decay 0.995)": [f"{OPT}ema_decay", "0.995"],
        "batch 12": ["--data.init_args.batching.batch_size", "12"],
    },
}
"""Per task: row name -> ``train.py`` overrides of ``configs/<task>/shapes.yaml`` (the recipe first)."""
EVAL_OPTIONS = ["--explain.num_overlays", "0", "--explain.mistakes", "0", "--explain.faithfulness", "false",
                "--explain.sanity", "false"]
"""``eval.py`` options of every run: the scores, without the explanation measures."""
METRICS = {
    "detection": (("map", "map"), ("map_50", "map_50"), ("map_75", "map_75")),
    "captioning": (("BLEU-4", "bleu4"), ("CIDEr-D", "cider"), ("kinds_exact", "kinds_exact"),
                   ("content_exact", "content_exact")),
}
"""Per task: (column, ``metrics.json`` key); the last is the headline (per seed, and the difference)."""
RUN_RESULT = "result.json"
"""A finished run's settings and result, in its folder: read back instead of training again."""


def read_run_result(path: Path) -> dict:
    """A finished run's :data:`RUN_RESULT`.

    Raises:
        ValueError: naming the file when it is not such a record.
    """
    return read_run_record(path, ("train_seconds", "eval_seconds"), ("metrics",))


def run_ablation(task: str, rows: list[str], seeds: list[int], work: Path, train=None,
                 on_row=lambda done: None) -> list[dict]:
    """Every row at every seed (``train(task, seed, work, overrides, run_dir, eval_options)`` runs
    one, :func:`~benchmarks.shapes_seeds.run_seed` by default); every run's folder is checked
    before the first training."""
    train = train or run_seed
    changes = CHANGES[task]
    cells = {}
    for name in rows:
        for seed in seeds:
            run_dir = run_folder(work / "runs", task, f"{name} seed {seed}")
            settings = {"task": task, "row": name, "overrides": changes[name], "seed": seed}
            cells[name, seed] = (run_dir, settings, finished_run(run_dir, settings, read_run_result, RUN_RESULT))
    out = []
    for name in rows:
        runs = []
        for seed in seeds:
            run_dir, settings, result = cells[name, seed]
            if result is None:
                result = {**settings, **train(task, seed, work, changes[name], run_dir, EVAL_OPTIONS)}
                (run_dir / RUN_RESULT).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
            else:
                log.info("%s, seed %d: finished earlier (%s)", name, seed, run_dir / RUN_RESULT)
            runs.append(result)
        out.append({"row": name, "overrides": " ".join(changes[name]), "runs": runs})
        on_row(out)
    return out


def _mean(values: list) -> float | None:
    known = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.fmean(known), 4) if known and len(known) == len(values) else None


def seed_spread(seed_table: dict, column: str) -> tuple[list[str], float] | None:
    """The seeds and the spread (max - min) of ``column`` in a ``benchmarks.shapes_seeds`` results
    file (one row per seed, named by the seed, then their mean); None without two such seeds."""
    names = [column_name(c) for c in seed_table.get("columns", [])]
    if column not in names:
        return None
    i = names.index(column)
    cells = [(r[0], r[i]) for r in seed_table.get("rows", []) if isinstance(r[0], str) and r[0].isdigit()]
    values = [v for _, v in cells if isinstance(v, (int, float))]
    if len(values) < 2 or len(values) != len(cells):
        return None
    return [s for s, _ in cells], round(100 * (max(values) - min(values)), 2)


def table(task: str, rows: list[dict], seed_table: dict | None = None) -> tuple[list, list[list], list[str]]:
    """Columns, rows and notes: each metric's mean over the seeds, the headline per seed, its
    difference to the recipe's mean (points), the mean ``train.py`` seconds. With one seed of the
    recipe, the note gives the recipe's seed spread from ``seed_table`` (the task's
    ``benchmarks.shapes_seeds`` results) instead."""
    metrics = METRICS[task]
    headline, key = metrics[-1]
    means = {r["row"]: {k: _mean([run["metrics"].get(k) for run in r["runs"]]) for _, k in metrics} for r in rows}
    base = means.get(RECIPE, {}).get(key)
    columns = ["change", "seeds", *({"name": n, "format": ".2f" if n == "CIDEr-D" else ".3f"} for n, _ in metrics),
               f"{headline} per seed", {"name": f"{headline} difference (points)", "format": "+.1f"},
               {"name": "train.py s", "format": ".0f"}, "train.py overrides"]
    out = []
    for r in rows:
        value = means[r["row"]][key]
        diff = None if base is None or value is None or r["row"] == RECIPE else round(100 * (value - base), 2)
        out.append([r["row"], ", ".join(str(run["seed"]) for run in r["runs"]),
                    *(means[r["row"]][k] for _, k in metrics),
                    " / ".join("–" if finite(run["metrics"].get(key)) is None else f"{run['metrics'][key]:.3f}"
                               for run in r["runs"]),
                    diff, _mean([run["train_seconds"] for run in r["runs"]]), r["overrides"] or "none"])
    notes = []
    recipe = next((r for r in rows if r["row"] == RECIPE), None)
    values = [run["metrics"].get(key) for run in recipe["runs"]] if recipe else []
    if len(values) > 1 and all(isinstance(v, (int, float)) for v in values):
        notes.append(f"The recipe's own seeds lie {100 * (max(values) - min(values)):.1f} points of {headline} "
                     "apart: a difference of that size is within what a seed changes.")
    elif seed_table is not None and (spread := seed_spread(seed_table, headline)) is not None:
        notes.append(f"One seed per row. The unchanged recipe's seeds {', '.join(spread[0])} lie {spread[1]:.1f} "
                     f"points of {headline} apart (`{seed_table.get('command', 'benchmarks.shapes_seeds')}`): "
                     "a difference of that size is within what a seed changes.")
    return columns, out, notes


def write_table(path: str, task: str, rows: list[dict], command: str) -> None:
    """The rows run so far as a results file of the documentation."""
    seeds = REPO / "docs" / "results" / f"{task}_shapes.json"
    columns, out, notes = table(task, rows, json.loads(seeds.read_text(encoding="utf-8")) if seeds.is_file() else None)
    config = f"configs/{task}/shapes.yaml"
    write_results(path, page=task, title=f"{config}: one change at a time",
                  description=f"Each row is `{config}` (the `make demo` recipe, on its embedded shape scenes) with "
                              "one change, trained and evaluated at each seed listed, the runs one after another, "
                              "alone. The metrics are the means over the seeds of `eval.py` on the validation "
                              "split; the difference is the row's mean minus the recipe's.",
                  command=command, columns=columns, rows=out, notes=notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(CHANGES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rows", nargs="+", default=None, help="only these rows (names of CHANGES), in this order")
    parser.add_argument("--results", default=None, help="also write the table as a results file of the documentation")
    parser.add_argument("--work", default=None, help="the runs (default: benchmarks/results/shapes-ablation)")
    parser.add_argument("--json", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    unknown = [r for r in args.rows or () if r not in CHANGES[args.task]]
    if unknown:
        parser.error(f"--rows: no {args.task} row named {', '.join(map(repr, unknown))}; the rows: "
                     + "; ".join(CHANGES[args.task]))
    work = Path(args.work or REPO / "benchmarks" / "results" / "shapes-ablation").resolve()
    command = command_line("benchmarks.shapes_ablation", argv)

    def on_row(done: list[dict]) -> None:
        if args.results:
            write_table(args.results, args.task, done, command)

    try:
        rows = run_ablation(args.task, args.rows or list(CHANGES[args.task]), args.seeds, work, on_row=on_row)
    except (FileExistsError, ValueError) as e:
        parser.error(str(e))
    write_result(args.json, {"task": args.task, "rows": rows})
    sys.stdout.write(json.dumps(table(args.task, rows)[1]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
