"""One table of the explanation numbers of the three demo checkpoints (``make bench``).

    python -m benchmarks.explanations [--classification CKPT] [--detection CKPT]
        [--captioning CKPT] [--images 40] [--steps 8] [--seed 0] [--classification_data ROOT ...]
        [--heldout TASK CKPT [ROOT] ...] [--json docs/results/explanations.json]

Trains nothing. Each checkpoint given (default: the newest
``runs/demo/*/<task>/checkpoints/last.ckpt`` of each task, when there is one) is evaluated by
``eval.py``'s own code (:func:`vision_attn.commands.evaluate.eval_main`, data from the settings saved in the
checkpoint) with every explanation method of its task, the sanity check on (the fully randomised
model only: ``--explain.sanity_cascade false``), ``--explain.faithfulness_images N`` and
``--explain.steps S``; the table reads the metrics it returns, per task and
method (the ``random`` baseline included):

- ``pointing``: ``pointing_<method>``, share of explained items whose map maximum lies in a
  ground-truth box of the explained object (higher is better);
- ``energy``: ``energy_<method>``, share of the map's mass in those boxes (higher is better);
- ``miou``: ``miou_<method>``, the map thresholded at its mean against the object's mask
  (Chefer et al. 2021; when the annotations have masks; higher is better);
- ``deletion``: ``deletion_auc_<method>`` (lower is better);
- ``insertion``: ``insertion_auc_<method>`` (higher is better);
- ``road``: ``road_<method>``, ROAD's (least - most relevant first) / 2 with the removed patches
  imputed (classification; higher is better);
- ``saco``: ``saco_<method>``, SaCo's salience-ordered effect coefficient (classification; higher
  is better);
- ``sanity``: ``sanity_<method>``, Spearman correlation between the maps of the trained and of
  the fully randomised model (closest to 0 is best: the map depends on the model).

``--heldout TASK CKPT [ROOT]`` (repeatable) adds a checkpoint trained on data the methods were
not tuned on (the stroke scenes of ``python -m benchmarks.holdout``), in rows labelled
``<task>, held out``: one command measures the demo models and the held-out ones side by side.
A metric the evaluation did not return shows as ``—``. Under the table, per task, the rank
agreement of the measures: Kendall's tau between the rankings of the methods by each pair of
measures (:func:`rank_agreement`; a measure that ranks like the others is telling the same story).
Under each task, the ``best`` row names
the best method of each column (``random`` included, ties joined with ``/``). ``--json`` writes
the rows (without the ``best`` rows) as a results file of the documentation's explanations page
(:mod:`benchmarks.results_json`; a missing metric is an empty cell).

``--images 40`` and ``--steps 8`` (the defaults: deletion and insertion curves of 9 points, every
eighth of the patches) keep the three demo checkpoints and three held-out ones within 5 minutes on
2 CPU cores (most of it the decoders' deletion and insertion curves: one forward pass per word or
detection, method and curve point); ``--images 100`` or more and ``--steps 16`` (``eval.py``'s
default) for tighter numbers.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import command_line, finite, machine, quiet_logging
from benchmarks.results_json import write_results

log = logging.getLogger("benchmarks.explanations")

TASKS = ("classification", "detection", "captioning")
COLUMNS = {  # column -> (metric key prefix, better)
    "pointing": ("pointing", "higher"),
    "energy": ("energy", "higher"),
    "miou": ("miou", "higher"),
    "deletion": ("deletion_auc", "lower"),
    "insertion": ("insertion_auc", "higher"),
    "road": ("road", "higher"),
    "saco": ("saco", "higher"),
    "sanity": ("sanity", "closer to 0"),
}
AGREEMENT = ("pointing", "energy", "miou", "deletion", "insertion", "road", "saco")
"""The columns whose rankings of the methods are compared (:func:`rank_agreement`)."""
COUNTS = ("explain_images", "explain_classes", "explain_words", "explain_detections")
"""Metrics that count what the numbers were measured on (printed under the table when present)."""
ARROWS = {"higher": "↑", "lower": "↓", "closer to 0": "→0"}
JSON_COLUMNS = {"pointing": "pointing", "energy": "energy", "miou": "mIoU", "deletion": "deletion AUC",
                "insertion": "insertion AUC", "road": "ROAD", "saco": "SaCo", "sanity": "sanity (Spearman)"}
"""The name of each column of :data:`COLUMNS` in the results file (``docs/results/explanations.json``;
the documentation's methods table reads ``deletion AUC``)."""


def task_methods(task: str) -> list[str]:
    """The explanation methods measured for ``task`` (``random`` last): every registered
    classifier method with faithfulness numbers, or the decoder heads' methods."""
    from vision_attn.explain.detection import DECODER_METHODS
    from vision_attn.explain.methods import METHODS

    if task == "classification":
        methods = [m for m, spec in METHODS.items() if spec.faithfulness and m != "random"]
    else:
        methods = list(DECODER_METHODS)
    return [*methods, "random"]


def newest_checkpoint(demo_dir: str | Path, task: str) -> Path | None:
    """The most recently written ``DEMO_DIR/*/<task>/checkpoints/last.ckpt``, or ``None``."""
    found = sorted(Path(demo_dir).glob(f"*/{task}/checkpoints/last.ckpt"), key=lambda p: (p.stat().st_mtime, str(p)))
    return found[-1] if found else None


def evaluate(task: str, ckpt: str | Path, images: int, seed: int, out_dir: Path,
             score_threshold: float | None = None, data_root: str | Path | None = None,
             methods: Sequence[str] | None = None, steps: int | None = None) -> dict[str, float]:
    """``eval_main`` on ``ckpt`` with every method of ``task``, the sanity check and (classification)
    ROAD; its metrics.

    ``score_threshold``: detection: the detections explained score at least this much
    (default: eval's ``--explain.score_threshold``). ``data_root``: evaluate on this root's
    validation split instead of the checkpoint's data (a classification root's boxes and masks:
    ``ROOT/annotations/instances_val.json`` when it exists). ``methods``: these registered methods
    instead of :func:`task_methods` (``random`` is always measured). ``steps``: points of the
    deletion / insertion curves after the first (default: eval's ``--explain.steps``).

    Raises:
        CheckpointError: ``ckpt`` is not a vision_attn checkpoint of ``task``.
    """
    from vision_attn.commands.evaluate import eval_main
    from vision_attn.errors import CheckpointError
    from vision_attn.tasks.base import read_task_meta

    meta, _ = read_task_meta(ckpt)
    if meta.get("task") != task:
        raise CheckpointError(f"--{task} {ckpt}: the checkpoint holds a {meta.get('task')!r} model, not {task!r}")
    methods = [m for m in (methods or task_methods(task)) if m != "random"]  # random: always measured
    # an option of the detector's own (DetectionOptions): the other tasks' evaluations do not take it
    given = score_threshold is not None and task == "detection"
    threshold = ["--explain.score_threshold", str(score_threshold)] if given else []
    data = [] if data_root is None else ["--data.root", str(data_root)]
    instances = Path(data_root or "") / "annotations" / "instances_val.json"
    if data_root is not None and task == "classification" and instances.is_file():
        data += ["--explain.annotations", str(instances)]
    extra = ["--explain.road", "true"] if task == "classification" else []
    extra += [] if steps is None else ["--explain.steps", str(steps)]
    # the table reports the fully randomised model's correlation: the steps before it are not measured
    extra += ["--explain.sanity_cascade", "false"]
    return eval_main(["--ckpt_path", str(ckpt), "--output_dir", str(out_dir), *threshold, *data, *extra,
                      "--seed_everything", str(seed),
                      "--explain.methods", f"[{', '.join(methods)}]",
                      "--explain.sanity", "true",
                      "--explain.faithfulness_images", str(images),
                      "--explain.seed", str(seed),
                      "--explain.num_overlays", "0", "--explain.report", "false",
                      "--trainer.enable_progress_bar", "false"])


def task_rows(task: str, metrics: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """``{method: {column: value or None}}`` read from ``metrics``."""
    rows = {}
    for m in task_methods(task):
        rows[m] = {}
        for col, (prefix, _) in COLUMNS.items():
            value = metrics.get(f"{prefix}_{m}")
            rows[m][col] = None if value is None else float(value)
    return rows


def rank_agreement(rows: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    """Kendall's tau-b between the rankings of the methods (``random`` included) by each pair of
    :data:`AGREEMENT` columns, every column oriented so that larger is better: ``{a: {b: tau}}``
    for ``a`` before ``b``; ``None`` where fewer than three methods have both values or a column
    ranks them all equal."""
    from scipy.stats import kendalltau

    sign = {"higher": 1.0, "lower": -1.0}
    out: dict[str, dict[str, float | None]] = {}
    for i, a in enumerate(AGREEMENT):
        for b in AGREEMENT[i + 1:]:
            both = [m for m, v in rows.items() if v.get(a) is not None and v.get(b) is not None]
            tau = None
            if len(both) >= 3:
                x = [sign[COLUMNS[a][1]] * rows[m][a] for m in both]
                y = [sign[COLUMNS[b][1]] * rows[m][b] for m in both]
                found = float(kendalltau(x, y).statistic)
                tau = None if found != found else found  # nan: a column with every method tied
            out.setdefault(a, {})[b] = tau
    return out


def best_methods(rows: dict[str, dict[str, float | None]], digits: int = 3) -> dict[str, list[str]]:
    """Per column, the methods with the best value as printed (rounded to ``digits``; several on a
    tie, none when no method has a value)."""
    best = {}
    for col, (_, better) in COLUMNS.items():
        scored = {m: round(v[col], digits) for m, v in rows.items() if v[col] is not None}
        if not scored:
            best[col] = []
            continue
        key = {"higher": lambda x: -x, "lower": lambda x: x, "closer to 0": abs}[better]
        top = min(key(x) for x in scored.values())
        best[col] = [m for m, x in scored.items() if key(x) == top]
    return best


def format_table(result: dict) -> str:
    """One markdown table: a row per task and method, then per task the best method of each column."""
    head = ["task", "method", *(f"{c} {ARROWS[b]}" for c, (_, b) in COLUMNS.items())]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for task, entry in result["tasks"].items():
        for method, values in entry["methods"].items():
            cells = ["—" if values[c] is None else f"{values[c]:.3f}" for c in COLUMNS]
            lines.append(f"| {task} | {method} | " + " | ".join(cells) + " |")
        cells = [" / ".join(entry["best"][c]) or "—" for c in COLUMNS]
        lines.append(f"| {task} | **best** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


HELD_OUT = "held out"
"""The label's suffix of a checkpoint given with ``--heldout`` (``detection, held out``)."""


def run(checkpoints: dict[str, str | Path], images: int = 40, seed: int = 0,
        work_dir: str | Path | None = None, score_threshold: float | None = None,
        data_roots: dict[str, str | Path] | None = None,
        heldout: Sequence[tuple[str, str | Path, str | Path | None]] = (), steps: int = 8) -> dict:
    """Evaluate each ``{task: checkpoint}`` and each held-out ``(task, checkpoint, root)``; the
    result :func:`format_table` prints.

    Args:
        checkpoints: a checkpoint per task (any subset of :data:`TASKS`).
        images: faithfulness / localisation / sanity images per task.
        seed: of the image sample, the random baseline and the randomised models.
        work_dir: where the evaluations write (``<work_dir>/<label>``); default a temporary folder.
        score_threshold: detection: explain detections scoring at least this (default: eval's).
        data_roots: per task, a data root to evaluate on instead of the checkpoint's data.
        heldout: more checkpoints, each evaluated on its own data or on ``root`` when given (models
            trained on data the methods were not tuned on); their rows are labelled
            ``<task>, held out``.
        steps: points of the deletion / insertion curves after the first.
    """
    t0 = time.perf_counter()
    tasks = {}
    runs = [(t, t, checkpoints[t], (data_roots or {}).get(t)) for t in TASKS if t in checkpoints]
    runs += [(f"{t}, {HELD_OUT}", t, c, r) for t, c, r in heldout]
    with tempfile.TemporaryDirectory(prefix="explanations-") as tmp:
        base = Path(work_dir) if work_dir is not None else Path(tmp)
        for label, task, ckpt, root in runs:
            t1 = time.perf_counter()
            metrics = evaluate(task, ckpt, images, seed, base / label.replace(", ", "-").replace(" ", "-"),
                               score_threshold, root, steps=steps)
            rows = task_rows(task, metrics)
            tasks[label] = {
                "task": task,
                "checkpoint": str(ckpt),
                "counts": {k: int(v) for k, v in metrics.items() if k in COUNTS},
                "methods": rows,
                "best": best_methods(rows),
                "agreement": rank_agreement(rows),
                "metrics": {k: float(v) for k, v in metrics.items()},
                "seconds": round(time.perf_counter() - t1, 1),
            }
    return {"tasks": tasks, "images": images, "seed": seed, "steps": steps,
            "better": {c: b for c, (_, b) in COLUMNS.items()},
            "machine": machine(), "seconds": round(time.perf_counter() - t0, 1)}


def format_agreement(agreement: dict[str, dict[str, float | None]]) -> str:
    """The pairs of :func:`rank_agreement` on one line (``pointing–energy 0.87, ...``)."""
    return ", ".join(f"{JSON_COLUMNS[a]}–{JSON_COLUMNS[b]} {'—' if t is None else f'{t:.2f}'}"
                     for a, inner in agreement.items() for b, t in inner.items())


DEMO_TITLE = "Explanation methods on the make demo models, per task"


def write_json(path: str | Path, result: dict, command: str, title: str = DEMO_TITLE) -> Path:
    """:func:`run`'s ``result`` as a results file: a row per task and method, the columns task,
    method and :data:`JSON_COLUMNS`, and per task a note with the rank agreement of the measures;
    ``command``: the command line that reproduces it."""
    columns = ["task", "method", *({"name": JSON_COLUMNS[c], "format": ".3f"} for c in COLUMNS)]
    rows = [[task, method, *(finite(values[c]) for c in COLUMNS)]
            for task, entry in result["tasks"].items() for method, values in entry["methods"].items()]
    notes = []
    for task, entry in result["tasks"].items():
        counts = ", ".join(f"{v} {k.removeprefix('explain_')}" for k, v in entry["counts"].items())
        best = "; ".join(f"{JSON_COLUMNS[c]} {' / '.join(entry['best'][c])}" for c in COLUMNS if entry["best"][c])
        notes.append(f"{task}: `{entry['checkpoint']}`; {counts or 'no counts reported'}; {entry['seconds']:.0f} s. "
                     f"Best: {best or 'none measured'}. Rank agreement of the measures over the methods "
                     f"(Kendall's tau): {format_agreement(entry['agreement'])}.")
    better = ", ".join(f"{JSON_COLUMNS[c]} {b}" for c, (_, b) in COLUMNS.items())
    return write_results(
        path, page="explanations", title=title, command=command,
        columns=columns, rows=rows,
        description=f"Every explanation method of each task, measured by `eval.py` with the sanity check on, "
                    f"{result['images']} sampled validation images per task (seed {result['seed']}), deletion and "
                    f"insertion curves of {result.get('steps', 16) + 1} points. Pointing: "
                    "the map's maximum within the box of the labelled class, the matched detection or the named "
                    "object; energy: the map's mass inside those boxes; mIoU: the map thresholded at its mean against "
                    "the object's mask (Chefer et al. 2021); deletion and insertion AUCs of the class "
                    "probability, the detection's score or the word's probability; ROAD: (least - most relevant "
                    "first) / 2 with the removed patches imputed (Rong et al. 2022); SaCo: the salience-ordered "
                    "effect coefficient (Wu et al. 2024); sanity: Spearman correlation "
                    "of the maps with those of the model randomised from the output down (head, then encoder; "
                    "Adebayo et al. 2018). Better: "
                    f"{better}. An empty cell: the task has no such measure.",
        notes=[*notes, f"{result['seconds']:.0f} s in all, {result['machine']['threads']} torch threads."])


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for task in TASKS:
        p.add_argument(f"--{task}", metavar="CKPT", default=None,
                       help=f"{task} checkpoint (default: the newest DEMO_DIR/*/{task}/checkpoints/last.ckpt)")
    p.add_argument("--demo_dir", default="runs/demo", help="where `make demo` writes its runs")
    p.add_argument("--images", type=int, default=40, help="images per task for the explanation numbers")
    p.add_argument("--steps", type=int, default=8,
                   help="points of the deletion / insertion curves after the first (eval.py's default: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the table here as a results file "
                                                "(make bench: docs/results/explanations.json)")
    p.add_argument("--score_threshold", type=float, default=None,
                   help="detection: explain detections scoring at least this (default: eval's 0.3)")
    p.add_argument("--work_dir", default=None, help="keep the evaluations' outputs here (default: temporary)")
    for task in TASKS:
        p.add_argument(f"--{task}_data", metavar="ROOT", default=None,
                       help=f"evaluate the {task} checkpoint on this root's validation split (default: its own data)")
    p.add_argument("--heldout", nargs="+", action="append", default=[], metavar="TASK CKPT [ROOT]",
                   help="also a checkpoint trained on other data (e.g. `python -m benchmarks.holdout detection "
                        "--scenes strokes`), evaluated on its own data or on ROOT; repeat for each task")
    p.add_argument("--title", default=DEMO_TITLE, help="the results file's title")
    a = p.parse_args(argv)
    heldout = []
    for entry in a.heldout:
        if len(entry) not in (2, 3) or entry[0] not in TASKS:
            p.error(f"--heldout {' '.join(entry)}: give TASK CKPT [ROOT] with TASK one of {', '.join(TASKS)}")
        heldout.append((entry[0], entry[1], entry[2] if len(entry) == 3 else None))
    given = {t: getattr(a, t) for t in TASKS if getattr(a, t)}
    checkpoints = given or {t: c for t in TASKS if (c := newest_checkpoint(a.demo_dir, t)) is not None}
    if not checkpoints and not heldout:
        p.error(f"no checkpoint: none given and no {a.demo_dir}/*/<task>/checkpoints/last.ckpt; run `make demo` "
                "or pass --classification / --detection / --captioning CKPT")
    quiet_logging()
    from vision_attn.errors import VisionAttnError

    try:
        roots = {t: r for t in TASKS if (r := getattr(a, f"{t}_data"))}
        result = run(checkpoints, a.images, a.seed, a.work_dir, a.score_threshold, roots, heldout, a.steps)
    except VisionAttnError as err:  # a wrong or unreadable checkpoint, data not found: one clear line
        p.exit(2, f"{p.prog}: error: {err}\n")
    print(format_table(result))
    print()
    for task, entry in result["tasks"].items():
        counts = ", ".join(f"{v} {k.removeprefix('explain_')}" for k, v in entry["counts"].items())
        print(f"{task}: {entry['checkpoint']}; {counts or 'no counts reported'}; {entry['seconds']} s")
        print(f"  rank agreement (Kendall's tau): {format_agreement(entry['agreement'])}")
    m = result["machine"]
    print(f"{m['cpu']}, {m['threads']} threads, torch {m['torch']}, CUDA: {m['cuda']}; {result['seconds']} s")
    if a.json:
        write_json(a.json, result, command_line("benchmarks.explanations", argv), a.title)
    return result


if __name__ == "__main__":
    main()
