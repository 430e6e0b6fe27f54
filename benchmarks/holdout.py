"""The detection and captioning ``small.yaml`` recipes on data they were not tuned on, run
exactly as a new user runs them (``python -m benchmarks.holdout``; not part of ``make test``).

    python -m benchmarks.holdout detection  [--epochs 40] [--img_size 96] [-- OVERRIDES ...]
    python -m benchmarks.holdout captioning [--epochs 40] [--img_size 64] [--captions_only] [-- OVERRIDES ...]
        [--train_images 1500] [--val_images 300] [--name NAME] [--work DIR] [--json FILE]

The recipes were tuned on the embedded *shape* scenes. This benchmark writes the embedded
*digit* scenes instead (:func:`vision_attn.data.synthetic.ensure_digit_scenes_coco`: grey
glyph digits in a cluttered picture, ten categories told apart by their strokes, captions such
as "a two above a zero"): detection on 1.5k 96 px scenes with 1-4 digits, captioning on 1.5k
64 px scenes with two digits and five template captions each. Then, as a user runs them::

    python train.py --config configs/<task>/small.yaml --data.root ROOT --trainer.max_epochs 40 \\
        --model.encoder.init_args.img_size SIZE
    python eval.py --ckpt_path RUN/checkpoints/last.ckpt --output_dir RUN/eval

Both timed from start to exit (start-up, data scan, validation included). Detection is scored
by pycocotools on ``eval.py``'s ``predictions.json`` against ``instances_val.json`` (``map``,
``map_50``); captioning by corpus BLEU-4 and CIDEr-D of ``predictions.json`` against
``captions_val.json`` (the suite's scorers, equal to pycocoevalcap's: tests/test_caption_metrics.py),
next to ``eval.py``'s own ``metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import command_line, finite, machine, refuse_earlier_run, write_result
from benchmarks.results_json import column_name, write_results
from vision_attn.data.strokes import StrokeSceneConfig, ensure_stroke_scenes
from vision_attn.data.synthetic import DigitSceneConfig, ensure_digit_scenes_coco

log = logging.getLogger("benchmarks.holdout")

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = {
    "detection": {"img_size": 96, "min_objects": 1, "max_objects": 4, "min_size": 0.2, "max_size": 0.45, "seed": 0},
    "captioning": {"img_size": 64, "min_objects": 2, "max_objects": 2, "min_size": 0.3, "max_size": 0.5, "seed": 1},
}
"""Per task: the image side and the scenes' digits (count, height as a fraction of the side)."""


def digit_root(task: str, work: Path, img_size: int, train_images: int, val_images: int,
               captions_only: bool = False, scenes: str = "digits") -> Path:
    """The task's digit scenes (written once under ``work/data``): font ``digits``
    (:func:`~vision_attn.data.synthetic.ensure_digit_scenes_coco`) or hand-drawn ``strokes``
    (:func:`~vision_attn.data.strokes.ensure_stroke_scenes`); ``captions_only``: a copy without the
    instance files (as a captions-only dataset is: no box grounding)."""
    d = DEFAULTS[task]
    if scenes == "strokes":
        root = ensure_stroke_scenes(StrokeSceneConfig(image_size=img_size, num_train=train_images, num_val=val_images,
                                                      min_objects=d["min_objects"], max_objects=d["max_objects"],
                                                      seed=d["seed"]), cache_dir=work / "data")
    else:
        config = DigitSceneConfig(image_size=img_size, num_train=train_images, num_val=val_images,
                                  min_objects=d["min_objects"], max_objects=d["max_objects"], min_size=d["min_size"],
                                  max_size=d["max_size"], seed=d["seed"])
        root = ensure_digit_scenes_coco(config, cache_dir=work / "data")
    if not captions_only:
        return root
    copy = root.with_name(root.name + "-captions-only")
    if not (copy / "manifest.json").is_file():
        shutil.copytree(root, copy, ignore=shutil.ignore_patterns("instances_*.json"), dirs_exist_ok=True)
    return copy


def timed(cmd: list[str], log_file: Path) -> float:
    """Run ``cmd`` in the repository; its output goes to ``log_file``; seconds, or an error."""
    log.info("%s", " ".join(cmd))
    log_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log_file.open("w") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed (exit {done.returncode}), see {log_file}")
    return round(seconds, 1)


def score_detection(predictions: Path, annotations: Path) -> dict[str, float]:
    """pycocotools' map, map_50 and map_75 of a COCO results file."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    truth = COCO(str(annotations))
    results = json.loads(predictions.read_text())
    if not results:
        return {"map": 0.0, "map_50": 0.0, "map_75": 0.0}
    evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    return {k: float(v) for k, v in zip(("map", "map_50", "map_75"), evaluation.stats[:3], strict=True)}


def validation_curve(run_dir: Path, key: str = "val/map_50") -> list[tuple[int, float]]:
    """``[(epochs trained, value)]`` of ``key`` at each validation of a run, from the CSV log
    ``train.py`` writes (``RUN/csv/version_*/metrics.csv``, the newest version); ``[]`` without one."""
    import csv

    logs = sorted((run_dir / "csv").glob("version_*/metrics.csv"), key=lambda f: f.stat().st_mtime)
    if not logs:
        return []
    with logs[-1].open(encoding="utf-8", newline="") as f:
        return [(int(r["epoch"]) + 1, float(r[key])) for r in csv.DictReader(f) if r.get(key) and r.get("epoch")]


def epochs_to(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first validated epoch count at which the curve reaches ``threshold`` (``None``: never)."""
    return next((epoch for epoch, value in curve if value >= threshold), None)


def score_captioning(predictions: Path, annotations: Path) -> dict[str, float]:
    """Corpus BLEU-4 and CIDEr-D of ``[{"image_id", "caption"}]`` against the references."""
    from vision_attn.data.tokenizer import normalize_caption
    from vision_attn.metrics.caption import caption_metrics

    refs: dict[int, list[str]] = {}
    for ann in json.loads(annotations.read_text())["annotations"]:
        refs.setdefault(ann["image_id"], []).append(normalize_caption(ann["caption"]))
    hyps = {p["image_id"]: normalize_caption(p["caption"]) for p in json.loads(predictions.read_text())}
    scores = caption_metrics(hyps, {k: refs[k] for k in hyps})
    return {"bleu4": scores["bleu4"], "cider": scores["cider"]}


def run_folder(runs: Path, task: str, name: str) -> Path:
    """``runs/<task>-<name>`` with the name made one safe folder name (every character but
    letters, digits and ``._+,()- `` replaced by ``_``): a ``--name`` with separators or ``..``
    stays inside ``runs``."""
    safe = re.sub(r"[^A-Za-z0-9._+,() -]", "_", name).strip(". ") or "run"
    return runs / f"{task}-{safe}"


def run(task: str, args, work: Path) -> dict:
    run_dir = run_folder(work / "runs", task, args.name)
    refuse_earlier_run(run_dir)
    root = digit_root(task, work, args.img_size, args.train_images, args.val_images, args.captions_only,
                      args.scenes)
    train_cmd = [sys.executable, str(REPO / "train.py"), "--config", f"configs/{task}/small.yaml",
                 "--data.root", str(root), "--trainer.max_epochs", str(args.epochs),
                 "--model.encoder.init_args.img_size", str(args.img_size),
                 "--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false",
                 *args.overrides]
    train_s = timed(train_cmd, run_dir / "train.log")
    out = run_dir / "eval"
    eval_cmd = [sys.executable, str(REPO / "eval.py"), "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"),
                "--output_dir", str(out), *getattr(args, "eval_overrides", [])]
    eval_s = timed(eval_cmd, run_dir / "eval.log")
    if task == "detection":
        scores = score_detection(out / "predictions.json", root / "annotations" / "instances_val.json")
    else:
        scores = score_captioning(out / "predictions.json", root / "annotations" / "captions_val.json")
    metrics = json.loads((out / "metrics.json").read_text())
    if task == "detection":
        scores[EPOCHS_TO] = epochs_to(validation_curve(run_dir), 0.80)
    return {"task": task, "name": args.name, "root": str(root), "train_seconds": train_s, "eval_seconds": eval_s,
            "overrides": args.overrides, "scores": scores, "metrics": metrics}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(DEFAULTS))
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--img_size", type=int, default=None, help="default: 96 detection, 64 captioning")
    parser.add_argument("--train_images", type=int, default=1500)
    parser.add_argument("--val_images", type=int, default=300)
    parser.add_argument("--captions_only", action="store_true",
                        help="captioning: hide the instance files (no grounding, no content accuracy)")
    parser.add_argument("--scenes", choices=["digits", "strokes"], default="digits",
                        help="font digits (the embedded scenes) or hand-drawn stroke digits (vision-attn data strokes)")
    parser.add_argument("--name", default="small", help="the run's name in the results (its folder under WORK/runs: "
                        "run-name characters other than letters, digits and ._+,()- replaced by _)")
    parser.add_argument("--results", default=None,
                        help="also write the run as a results file of the documentation (docs/results/...json)")
    parser.add_argument("--title", default=None,
                        help="with --results: the table's title (default: small.yaml on data it was not tuned on)")
    parser.add_argument("--glance", action="store_true",
                        help="with --results: this run is the README's 'results at a glance' row of the task")
    parser.add_argument("--explanations", default=None,
                        help="also write eval.py's explanation measures of the run (a row per method) as a results "
                             "file of the documentation")
    parser.add_argument("--work", default=None, help="data and runs (default: benchmarks/results/holdout-work)")
    parser.add_argument("--json", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.overrides = overrides  # extra train.py overrides, after --
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.img_size = args.img_size or DEFAULTS[args.task]["img_size"]
    work = Path(args.work or REPO / "benchmarks" / "results" / "holdout-work").resolve()
    try:
        result = run(args.task, args, work)
    except FileExistsError as e:
        parser.error(str(e))
    result["machine"] = machine()
    sys.stdout.write(json.dumps({k: result[k] for k in ("task", "train_seconds", "eval_seconds", "scores")}) + "\n")
    write_result(args.json, result)
    if args.results:
        write_holdout_results(args.results, result, args, command_line("benchmarks.holdout", argv))
    if args.explanations:
        write_explanation_results(args.explanations, result, args, command_line("benchmarks.holdout", argv))
    return 0


CAPTION_COLUMNS = ("bleu4", "cider", "objects_exact", "relations_exact", "hallucination_rate")
EPOCHS_TO = "epochs to map_50 0.80"
DETECTION_COLUMNS = ("map", "map_50", "map_75", EPOCHS_TO)


def write_holdout_results(path: str, result: dict, args, command: str) -> None:
    """One row per run: the data, the run's length and times, the task's scores and the
    ``train.py`` overrides. Rows of other runs already in ``path`` (same columns) are kept, a
    row of the same run name is replaced: several runs (an ablation) make one table."""
    keys = CAPTION_COLUMNS if result["task"] == "captioning" else DETECTION_COLUMNS
    scores = {**result["metrics"], **result["scores"]}
    data = f"{args.scenes}, {args.img_size} px, {args.train_images} / {args.val_images} images" + (
        ", captions only" if args.captions_only else "")
    row = [result["name"], data, args.epochs, result["train_seconds"], result["eval_seconds"],
           *(scores.get(k) if k == EPOCHS_TO else finite(scores.get(k), 4) for k in keys),
           " ".join(result["overrides"]) or "none"]
    columns = ["run", "data", "epochs", "train s", "eval s", *keys, "train.py overrides"]
    rows, glance = [row], []
    target = Path(path)
    if target.is_file():
        old = json.loads(target.read_text(encoding="utf-8"))
        names = [column_name(c) for c in old.get("columns", [])]
        if set(names) <= set(columns):  # the same table, perhaps before a column was added
            runs = Path(getattr(args, "work", None) or REPO / "benchmarks" / "results" / "holdout-work") / "runs"
            rows = [_old_row(dict(zip(names, r, strict=True)), columns, run_folder(runs, result["task"], r[0]))
                    for r in old.get("rows", []) if r[0] != result["name"]] + rows
            glance = old.get("glance", [])
    if getattr(args, "glance", False):  # this run is the README's "results at a glance" row of the task
        shown = ", ".join(f"{k} {scores[k]:.3f}" for k in keys
                          if k != EPOCHS_TO and isinstance(scores.get(k), (int, float)))
        glance = [{"task": f"{result['task']} (held out)", "data": data, "metric": shown,
                   "time": f"{result['train_seconds']:.0f} s training", "command": command}]
    captions_only = {str(r[1]).endswith(", captions only") for r in rows}  # a row's data says it
    flag = " [--captions_only]" if len(captions_only) > 1 else " --captions_only" if True in captions_only else ""
    template = (f"python -m benchmarks.holdout {result['task']} --scenes SCENES --train_images N --val_images N"
                f"{flag} --name RUN --results {path} -- OVERRIDES")
    title = getattr(args, "title", None) or f"small.yaml on data it was not tuned on ({result['task']})"
    write_results(path, page=result["task"], title=title,
                  command=template, columns=columns, rows=rows, glance=glance,
                  notes=["each row: the command with the row's scenes and image counts (its data), --name RUN "
                         "and its train.py overrides after --",
                         *([f"{EPOCHS_TO}: the first validation at or above it (small.yaml validates every 10 "
                            "epochs, a run with --trainer.check_val_every_n_epoch 5 every 5); empty: never"]
                           if result["task"] == "detection" else [])])


EXPLANATION_MEASURES = (("pointing", "pointing_"), ("energy", "energy_"), ("mIoU", "miou_"),
                        ("deletion AUC", "deletion_auc_"), ("insertion AUC", "insertion_auc_"),
                        ("sanity (Spearman)", "sanity_"))
"""Column name and ``metrics.json`` key prefix (``<prefix><method>``) of each explanation measure."""
EXPLAINED = {"captioning": "explain_words", "detection": "explain_images"}


def explanation_rows(metrics: dict, task: str, eval_seconds: float) -> tuple[list, list[list]]:
    """The columns and one row per method of ``eval.py``'s explanation measures in ``metrics``
    (its ``metrics.json``, whose other keys sharing a prefix, such as ``pointing_words``, name no
    registered method); a measure no method has (pointing without boxes) is left out."""
    from vision_attn.explain.methods import METHODS

    prefixes = [prefix for _, prefix in EXPLANATION_MEASURES]
    methods = list(dict.fromkeys(key[len(prefix):] for key in metrics for prefix in prefixes
                                 if key.startswith(prefix) and key[len(prefix):] in METHODS))
    measures = [(name, prefix) for name, prefix in EXPLANATION_MEASURES
                if any(f"{prefix}{m}" in metrics for m in methods)]
    columns = ["method", *({"name": name, "format": ".3f"} for name, _ in measures), "items explained",
               {"name": "eval.py s", "format": ".0f"}]
    explained = metrics.get(EXPLAINED[task], metrics.get("explain_images"))
    rows = [[m, *(finite(metrics.get(f"{prefix}{m}"), 4) for _, prefix in measures),
             None if explained is None else int(explained), eval_seconds] for m in methods]
    return columns, rows


def write_explanation_results(path: str, result: dict, args, command: str) -> None:
    """The run's explanation measures, a row per method (:func:`explanation_rows`), as a results
    file of the documentation; refused (``ValueError``) when ``eval.py`` measured none."""
    columns, rows = explanation_rows(result["metrics"], result["task"], result["eval_seconds"])
    if not rows:
        raise ValueError(f"{result['name']}: eval.py wrote no explanation measures (see its metrics.json)")
    data = f"{args.scenes}, {args.img_size} px, {args.train_images} / {args.val_images} images" + (
        ", captions only" if args.captions_only else "")
    title = f"Explanations of small.yaml's {result['task']} model on data it was not tuned on ({data})"
    description = ("`eval.py`'s explanation measures of the run's model on its validation split, one row per method "
                   "it draws (the task's defaults and the baselines).")
    if result["task"] == "captioning" and args.captions_only:
        description += (" Without boxes the deletion and insertion curves cover the generated words that can name "
                        "something in the image; articles, pronouns, auxiliaries, conjunctions and a caption's frame "
                        "(\"a picture of\") are left out (`vision_attn.explain.captioning.UNGROUNDED_WORDS`, "
                        "`FRAME_WORDS`).")
    write_results(path, page="explanations", title=title, description=description,
                  command=command, columns=columns, rows=rows,
                  notes=[f"The run: {result['name']}, {args.epochs} epochs, train.py overrides: "
                         f"{' '.join(result['overrides']) or 'none'}."])


def _old_row(values: dict, columns: list[str], run_dir: Path) -> list:
    """An earlier row in today's ``columns``: a column it lacks is read from its run's folder when
    that is still there (``map_75`` from ``eval/metrics.json``, the epochs to map_50 0.80 from the
    CSV log), else left empty."""
    missing = [c for c in columns if c not in values]
    if "map_75" in missing and (run_dir / "eval" / "metrics.json").is_file():
        values["map_75"] = finite(json.loads((run_dir / "eval" / "metrics.json").read_text()).get("map_75"), 4)
    curve = validation_curve(run_dir) if EPOCHS_TO in missing else []
    if curve:
        values[EPOCHS_TO] = epochs_to(curve, 0.80)
    return [values.get(c) for c in columns]


if __name__ == "__main__":
    raise SystemExit(main())
