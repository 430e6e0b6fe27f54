"""The detection recipe's options one at a time on few training images, over seeds
(``python -m benchmarks.small_data_ablation``; not part of ``make test``).

    python -m benchmarks.small_data_ablation [--sizes 300 1500 5000] [--seeds 0 1 2]
        [--variants base fill_epoch copy_paste mosaic mal fdr local_mlp lr5e-4 shipped] [--scenes digits]
        [--results docs/results/detection_small_data_ablation.json]

Every run is a :mod:`benchmarks.holdout` detection run (``train.py --config
configs/detection/small.yaml`` on the embedded digit scenes, 96 px, 300 validation images,
40 epochs, then ``eval.py``; timed from start to exit) with the variant's ``train.py``
overrides:

- ``base``: the recipe without the small-data options (one pass over the images per epoch, no
  copy-paste, plain box regression with look-forward-twice, a plain MLP in the encoder, peak
  learning rate 5e-4);
- one option added to ``base``: ``fill_epoch`` (the self-sizing batches: at least 90 steps an
  epoch), ``copy_paste`` (Simple Copy-Paste, probability 0.8: dense one-to-one matching, DEIM),
  ``mosaic`` (mosaic of four, probability 0.5, DEIM), ``mal`` (the matchability-aware loss, DEIM),
  ``fdr`` (D-FINE's fine-grained distribution refinement with GO-LSD), ``local_mlp`` (LocalViT's
  depthwise convolution in the MLP);
- ``lr5e-4``: ``small.yaml`` at the peak learning rate the options above are measured at (5e-4;
  ``small.yaml`` trains at 1e-3);
- ``shipped``: ``small.yaml`` unchanged.

A finished run is kept as ``WORK/ablation/<variant>-<size>-seed<S>.json`` and not run again, so
the grid can be filled over several invocations; the table is written after each run. The
results file keeps every run's numbers (its ``runs``): a run it holds is not run again either, and
a later invocation in another checkout adds to it. A run folder that already holds a training
(``WORK/runs/detection-ablation <variant> <size> seed <S>``, made with other settings under the same
variant name) is not trained into: the run stops and names it. One row per variant, size and CPU: the seeds
finished, mean and standard deviation of pycocotools' map, the means of map_50 and map_75, the
median number of epochs to validation map_50 0.80 (every 5 epochs; empty: a seed never reached
it), the mean training seconds, and the runs whose training loss went non-finite (the convergence
alarm's warning in ``train.log``).
The evaluation measures boxes only (no overlays or explanation numbers).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import command_line, finite
from benchmarks.holdout import EPOCHS_TO, REPO, run, run_folder
from benchmarks.results_json import cpu_model, git_commit, write_results

log = logging.getLogger("benchmarks.small_data_ablation")

_BASE = ["--data.batching.fill_epoch", "false", "--data.copy_paste.prob", "0", "--model.head.fdr", "false",
         "--model.head.look_forward_twice", "true", "--model.encoder.local_mlp", "false", "--model.optim.lr", "0.0005"]


def _without(overrides: list[str], *keys: str) -> list[str]:
    """``overrides`` (``--key value`` pairs) without the pairs of ``keys``."""
    out = []
    for k, v in zip(overrides[::2], overrides[1::2], strict=True):
        if k not in keys:
            out += [k, v]
    return out


VARIANTS: dict[str, tuple[str, list[str]]] = {
    "base": ("without the small-data options", _BASE),
    "fill_epoch": ("+ self-sizing batches (fill_epoch)", _without(_BASE, "--data.batching.fill_epoch")),
    "copy_paste": ("+ copy-paste 0.8 (DEIM's dense one-to-one)", [*_without(_BASE, "--data.copy_paste.prob"),
                                                                   "--data.copy_paste.prob", "0.8"]),
    "mosaic": ("+ mosaic 0.5 (DEIM's dense one-to-one)", [*_BASE, "--data.mosaic.prob", "0.5",
                                                          "--data.mosaic.scale", "1.0"]),
    "mal": ("+ matchability-aware loss (DEIM)", [*_BASE, "--model.loss.mal_gamma", "1.5"]),
    "fdr": ("+ FDR / GO-LSD (D-FINE)", [*_without(_BASE, "--model.head.fdr", "--model.head.look_forward_twice"),
                                        "--model.head.fdr", "true", "--model.head.look_forward_twice", "false"]),
    "local_mlp": ("+ local feed-forward (LocalViT)", [*_without(_BASE, "--model.encoder.local_mlp"),
                                                      "--model.encoder.local_mlp", "true"]),
    "lr5e-4": ("small.yaml at lr 5e-4", ["--model.optim.lr", "0.0005"]),
    "shipped": ("small.yaml as shipped", []),
}
"""Variant name -> (row label, ``train.py`` overrides)."""

EVAL_BOXES_ONLY = ["--explain.num_overlays", "0", "--explain.mistakes", "0", "--explain.faithfulness", "false",
                   "--explain.faithfulness_images", "0", "--explain.report", "false"]
"""``eval.py`` options of the ablation's evaluations: the boxes' numbers, no explanations."""

NAN_WARNING = "the training loss is"
"""What the convergence alarm writes when a training loss is not finite
(:mod:`vision_attn.tasks.convergence`)."""


def run_name(variant: str, size: int, seed: int) -> str:
    return f"ablation {variant} {size} seed {seed}"


def record(result: dict) -> dict:
    """The numbers of one finished run that the table keeps (``runs`` of the results file)."""
    scores = result["scores"]
    return {"variant": result["variant"], "size": result["size"], "seed": result["seed"], "scenes": result["scenes"],
            "map": scores["map"], "map_50": scores["map_50"], "map_75": scores["map_75"],
            "epochs_to": scores.get(EPOCHS_TO), "train_seconds": result["train_seconds"],
            "non_finite": bool(result["non_finite"]), "cpu": result.get("cpu") or "not recorded",
            "commit": result.get("commit")}


def _measured(known: list[dict], variant: str, size: int, seed: int, scenes: str) -> dict | None:
    """The record of ``known`` (a results file's ``runs``) that already holds this cell and seed."""
    for r in known:
        seeds = r.get("seeds", [r.get("seed")])
        if (r["variant"], r["size"], r["scenes"]) == (variant, size, scenes) and seed in seeds:
            return r
    return None


def one_run(variant: str, size: int, seed: int, args, work: Path, known: Sequence[dict] = ()) -> dict | None:
    """Run one cell of the grid and return its :func:`record`; ``None`` when ``known`` (the runs of
    the results file) already holds it; the record of an earlier run kept under ``WORK/ablation``."""
    cached = work / "ablation" / f"{variant}-{size}-seed{seed}.json"
    if cached.is_file():
        return record(json.loads(cached.read_text(encoding="utf-8")))
    if _measured(list(known), variant, size, seed, args.scenes) is not None:
        return None
    spec = argparse.Namespace(img_size=96, train_images=size, val_images=args.val_images, captions_only=False,
                              scenes=args.scenes, name=run_name(variant, size, seed), epochs=args.epochs,
                              overrides=[*VARIANTS[variant][1], "--seed_everything", str(seed),
                                         "--trainer.check_val_every_n_epoch", "5"],
                              eval_overrides=EVAL_BOXES_ONLY)
    result = run("detection", spec, work)
    train_log = run_folder(work / "runs", "detection", spec.name) / "train.log"
    result.update(variant=variant, size=size, seed=seed, scenes=args.scenes, cpu=cpu_model(), commit=git_commit(),
                  non_finite=NAN_WARNING in train_log.read_text(encoding="utf-8", errors="replace"))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return record(result)


def _pool(records: list[dict]) -> dict:
    """One variant and size: its records (single runs, or aggregates of several seeds written by an
    earlier version of this table, with ``seeds``, the mean ``map`` and its ``map_sd``) pooled
    into the row's numbers. The mean and standard deviation of map are exact (an aggregate enters
    through its seed count, mean and deviation); the epochs to map_50 0.80 are the median over the
    seeds, an aggregate counting its own median once per seed (exact when it holds one seed); the
    training seconds are averaged per CPU, since seconds of different machines do not compare."""
    parts = []
    for r in records:
        seeds = list(r["seeds"]) if "seeds" in r else [r["seed"]]
        sd = r.get("map_sd") or 0.0
        parts.append({"r": r, "n": len(seeds), "seeds": seeds, "sd": sd})
    n = sum(p["n"] for p in parts)
    mean = sum(p["n"] * p["r"]["map"] for p in parts) / n
    squares = sum((p["n"] - 1) * p["sd"] ** 2 + p["n"] * p["r"]["map"] ** 2 for p in parts)
    sd = math.sqrt(max(0.0, squares - n * mean**2) / (n - 1)) if n > 1 else None
    epochs = [p["r"]["epochs_to"] for p in parts for _ in range(p["n"])]
    median = None if None in epochs else statistics.median(epochs)
    seconds: dict[str, list[float]] = {}
    for p in parts:
        seconds.setdefault(p["r"]["cpu"], []).extend([p["r"]["train_seconds"]] * p["n"])
    first = records[0]
    return {"variant": first["variant"], "size": first["size"], "scenes": first["scenes"],
            "seeds": sorted(s for p in parts for s in p["seeds"]), "map": mean, "map_sd": sd,
            "map_50": sum(p["n"] * p["r"]["map_50"] for p in parts) / n,
            "map_75": sum(p["n"] * p["r"]["map_75"] for p in parts) / n,
            "epochs_to": int(median) if median is not None and float(median).is_integer() else median,
            "train_seconds": {cpu: statistics.fmean(v) for cpu, v in sorted(seconds.items())},
            "non_finite": sum(int(p["r"]["non_finite"]) for p in parts)}


def table_rows(records: list[dict]) -> list[list]:
    """One row per variant and size, in :data:`VARIANTS`' order, then by size: every seed's run
    pooled (:func:`_pool`: mean and standard deviation of map, means of map_50 and map_75, the
    median epochs to map_50 0.80, the non-finite runs); the training seconds and the CPU per
    machine, ``a / b`` in the same order when the seeds ran on several."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["variant"], r["size"]), []).append(r)
    cells = sorted((_pool(g) for g in groups.values()), key=lambda c: (list(VARIANTS).index(c["variant"]), c["size"]))
    rows = []
    for c in cells:
        seconds = c["train_seconds"]
        per_cpu = (round(next(iter(seconds.values())), 1) if len(seconds) == 1
                   else " / ".join(f"{v:.0f}" for v in seconds.values()))
        rows.append([VARIANTS[c["variant"]][0], c["size"], ", ".join(str(s) for s in c["seeds"]), finite(c["map"], 4),
                     finite(c["map_sd"], 4) if c["map_sd"] is not None else None, finite(c["map_50"], 4),
                     finite(c["map_75"], 4), c["epochs_to"], per_cpu, c["non_finite"], " / ".join(seconds),
                     " ".join(VARIANTS[c["variant"]][1]) or "none"])
    return rows


COLUMNS = ["variant", "train images", "seeds", {"name": "map", "format": ".3f"}, {"name": "map sd", "format": ".3f"},
           {"name": "map_50", "format": ".3f"}, {"name": "map_75", "format": ".3f"}, "epochs to map_50 0.80",
           {"name": "train s", "format": ".0f"}, "non-finite runs", "CPU", "train.py overrides"]


def known_runs(path: str | None) -> list[dict]:
    """The ``runs`` of an existing results file (none without one)."""
    if not path or not Path(path).is_file():
        return []
    return list(json.loads(Path(path).read_text(encoding="utf-8")).get("runs", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[300, 1500, 5000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--scenes", choices=["digits", "strokes"], default="digits")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--val_images", type=int, default=300)
    parser.add_argument("--results", default=None, help="the results file of the documentation to write; the runs "
                        "it already holds are not run again and stay in it")
    parser.add_argument("--work", default=None, help="data and runs (default: benchmarks/results/holdout-work)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(args.work or REPO / "benchmarks" / "results" / "holdout-work").resolve()
    for size in args.sizes:
        for seed in args.seeds:
            for variant in args.variants:
                try:
                    result = one_run(variant, size, seed, args, work, known_runs(args.results))
                except FileExistsError as e:  # a run folder of another recipe under this run's name
                    parser.error(str(e))
                if result is None:
                    log.info("%s, %d images, seed %d: already in %s", variant, size, seed, args.results)
                    continue
                log.info("%s, %d images, seed %d: map %.4f, %.0f s", variant, size, seed, result["map"],
                         result["train_seconds"])
                if args.results:
                    write_table(args.results, work, args.scenes)
    if args.results:  # also when every run was measured before: the table as this code renders it
        write_table(args.results, work, args.scenes)
    return 0


def write_table(path: str, work: Path, scenes: str) -> None:
    """The results file from the runs it already holds and every finished run of ``scenes`` under
    ``WORK/ablation`` (a run in both: the one under ``WORK``); the runs are kept in the file's
    ``runs``, so that a later invocation, in another checkout, adds to them."""
    fresh = [record(json.loads(f.read_text(encoding="utf-8"))) for f in sorted((work / "ablation").glob("*.json"))]
    fresh = [r for r in fresh if r["scenes"] == scenes]
    ids = {(r["variant"], r["size"], r["seed"], r["scenes"]) for r in fresh}
    known = known_runs(path)
    other = sorted({r["scenes"] for r in known} - {scenes})
    if other:
        raise ValueError(f"{path} holds runs of the {', '.join(other)} scenes, not {scenes}: write the {scenes} "
                         "table to a results file of its own")
    kept = [r for r in known if "seeds" in r or (r["variant"], r["size"], r["seed"], r["scenes"]) not in ids]
    runs = kept + fresh
    total = sum(len(r.get("seeds", [None])) for r in runs)
    non_finite = sum(int(r["non_finite"]) for r in runs)
    write_results(path, page="detection", title=f"The detection recipe's small-data options one at a time ({scenes} "
                  "scenes, 96 px, 300 validation images, 40 epochs)",
                  command=command_line("benchmarks.small_data_ablation", ["--scenes", scenes, "--results", path]),
                  columns=COLUMNS, rows=table_rows(runs), runs=runs,
                  notes=["each run: python -m benchmarks.holdout detection --scenes SCENES --train_images N "
                         "--val_images 300 -- OVERRIDES --seed_everything S --trainer.check_val_every_n_epoch 5",
                         "map sd: the standard deviation over the seeds; epochs to map_50 0.80: the median over "
                         "the seeds, empty when a seed never reached it",
                         "non-finite runs: runs whose training loss was NaN or infinite at some step",
                         "CPU: the processors the row's seeds trained on; train s: the mean training seconds on "
                         "each, in the same order (a / b): seconds of different machines do not compare",
                         f"{total} runs in all, {non_finite} of them with a non-finite training loss"])


if __name__ == "__main__":
    raise SystemExit(main())
