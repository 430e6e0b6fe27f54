"""Self-critical sequence training (SCST) against as long a run of more cross-entropy, from the
shipped captioner, and how high CIDEr-D goes on its references (``python -m benchmarks.scst``;
not part of ``make test``: it trains for minutes).

    python -m benchmarks.scst [--minutes 4.5] [--seed 1] [--ckpt CKPT] [--work DIR]
        [--results docs/results/captioning_scst.json]

One run after the other, alone, as a user runs them:

1. the cross-entropy captioner (skipped with ``--ckpt``)::

       python train.py --config configs/captioning/shapes.yaml --seed_everything S

2. SCST from its weights, stopped by the clock::

       python train.py --config configs/captioning/shapes.yaml --config configs/captioning/scst.yaml \\
           --model.training.init_from CKPT --trainer.max_epochs 100 --trainer.max_time 00:00:MM:SS

3. as many minutes of cross-entropy from the same weights at the paper's constant SCST rate
   (``--model.optim.lr 5e-5 --model.optim.encoder_lr 5e-5 --model.optim.warmup_fraction 0
   --model.optim.min_lr_ratio 1``): what more training alone gives.

Each is scored by ``eval.py`` (beam 3; the explanations left out) and by CIDEr-D against all
five references and, as the COCO protocol scores humans, against four with the fifth held out
(:mod:`benchmarks.caption_ceiling`), next to the references' own rows: one of them verbatim,
and the best of each image (an oracle).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from benchmarks.caption_ceiling import embedded_root, prediction_row, read_predictions, reference_rows
from benchmarks.common import command_line, finite, refuse_earlier_run, write_result
from benchmarks.holdout import REPO, timed
from benchmarks.results_json import write_results
from benchmarks.shapes_ablation import EVAL_OPTIONS

log = logging.getLogger("benchmarks.scst")

CONFIG = "configs/captioning/shapes.yaml"
CE_MORE = ["--model.optim.lr", "5e-5", "--model.optim.encoder_lr", "5e-5", "--model.optim.warmup_fraction", "0",
           "--model.optim.min_lr_ratio", "1"]
"""The cross-entropy continuation's optimiser: SCST's constant rate of the paper, no warm-up."""
COLUMNS = ["captions", {"name": "CIDEr-D, all five references", "format": ".3f"},
           {"name": "CIDEr-D, four (fifth held out)", "format": ".3f"}, {"name": "BLEU-4", "format": ".3f"},
           {"name": "kinds_exact", "format": ".3f"}, {"name": "content_exact", "format": ".3f"},
           {"name": "train.py s", "format": ".0f"}]


def max_time(minutes: float) -> str:
    """Lightning's ``DD:HH:MM:SS`` of ``minutes`` (whole seconds)."""
    seconds = round(minutes * 60)
    if seconds < 1:
        raise ValueError(f"--minutes must be at least a second, not {minutes}")
    return f"{seconds // 86400:02d}:{seconds // 3600 % 24:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train_and_eval(run_dir: Path, overrides: list[str]) -> dict:
    """``train.py`` of the shapes captioner with ``overrides`` into ``run_dir``, then ``eval.py``:
    its seconds and metrics."""
    train_s = timed([sys.executable, str(REPO / "train.py"), "--config", CONFIG, *overrides,
                     "--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false"],
                    run_dir / "train.log")
    timed([sys.executable, str(REPO / "eval.py"), "--config", CONFIG, "--ckpt_path",
           str(run_dir / "checkpoints" / "last.ckpt"), "--output_dir", str(run_dir / "eval"), *EVAL_OPTIONS],
          run_dir / "eval.log")
    return {"run": str(run_dir), "train_seconds": train_s,
            "metrics": json.loads((run_dir / "eval" / "metrics.json").read_text())}


def table(references: dict, runs: dict[str, dict]) -> list[list]:
    """The rows: the references' own, then one per run (``{label: {"run", "train_seconds",
    "metrics"}}``) scored against the references."""
    ref = reference_rows(references)
    rows = [["a reference caption, verbatim (mean over which one)", ref["reference"], ref["held-out reference"],
             None, None, None, None],
            ["the best reference of each image (oracle)", ref["best reference"], None, None, None, None, None]]
    for label, run in runs.items():
        cider = prediction_row(read_predictions(Path(run["run"]), references), references)
        m = run["metrics"]
        rows.append([label, round(cider["all references"], 4), round(cider["held-out"], 4),
                     *(finite(m.get(k), 4) for k in ("bleu4", "kinds_exact", "content_exact")), run["train_seconds"]])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4.5, help="the length of SCST and of the cross-entropy run")
    parser.add_argument("--seed", type=int, default=1, help="the cross-entropy captioner's --seed_everything")
    parser.add_argument("--ckpt", default=None, help="start from this cross-entropy checkpoint instead of training one "
                        f"({CONFIG}'s model)")
    parser.add_argument("--results", default=None, help="also write the table as a results file of the documentation")
    parser.add_argument("--work", default=None, help="the runs (default: benchmarks/results/scst-work)")
    parser.add_argument("--json", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(args.work or REPO / "benchmarks" / "results" / "scst-work").resolve()
    try:
        clock = max_time(args.minutes)
        folders = {"ce": work / f"ce-seed{args.seed}", "scst": work / "scst", "more": work / "ce-more"}
        for name, folder in folders.items():  # every folder checked before the first training
            if name != "ce" or not args.ckpt:
                refuse_earlier_run(folder, "give another --work")
        if args.ckpt and not Path(args.ckpt).is_file():
            raise FileNotFoundError(f"--ckpt {args.ckpt}: no such checkpoint file")
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        parser.error(str(e))
    runs = {}
    if args.ckpt:
        ckpt = Path(args.ckpt).resolve()
        start = {"run": str(folders["ce"]), "train_seconds": None, "metrics": {}}
        timed([sys.executable, str(REPO / "eval.py"), "--config", CONFIG, "--ckpt_path", str(ckpt), "--output_dir",
               str(folders["ce"] / "eval"), *EVAL_OPTIONS], folders["ce"] / "eval.log")
        start["metrics"] = json.loads((folders["ce"] / "eval" / "metrics.json").read_text())
    else:
        start = train_and_eval(folders["ce"], ["--seed_everything", str(args.seed)])
        ckpt = folders["ce"] / "checkpoints" / "last.ckpt"
    runs[f"the cross-entropy captioner ({CONFIG}, seed {args.seed})"] = start
    length = f"{args.minutes:g} minutes"
    runs[f"+ SCST (scst.yaml), {length}"] = train_and_eval(folders["scst"], [
        "--config", "configs/captioning/scst.yaml", "--model.training.init_from", str(ckpt),
        "--trainer.max_epochs", "100", "--trainer.max_time", clock])
    runs[f"+ cross-entropy, lr 5e-5 constant, {length}"] = train_and_eval(folders["more"], [
        "--model.training.init_from", str(ckpt), "--trainer.max_epochs", "100", "--trainer.max_time", clock, *CE_MORE])
    from vision_attn.data.captioning import read_captions
    from vision_attn.data.tokenizer import normalize_caption

    root = embedded_root(REPO / CONFIG)
    images, captions = read_captions(root, "val")
    references = {im["id"]: [normalize_caption(c) for c in captions[im["id"]]] for im in images}
    rows = table(references, runs)
    write_result(args.json, {"runs": runs, "rows": rows})
    sys.stdout.write(json.dumps(rows) + "\n")
    if args.results:
        write_results(args.results, page="captioning",
                      title="Self-critical training (SCST) against more cross-entropy, and how high CIDEr-D goes",
                      description=f"From `{CONFIG}`'s captioner, {length} of SCST (`configs/captioning/scst.yaml`) "
                                  f"and {length} of more cross-entropy, one after the other, alone; {len(references)} "
                                  "validation images with five references each; beam 3.",
                      command=command_line("benchmarks.scst", argv), columns=COLUMNS, rows=rows,
                      notes=["CIDEr-D, four: the COCO protocol's human score, each reference in turn held out and "
                             "the caption scored against the other four, the mean over the five choices",
                             "train.py s: from start to exit; the two continuations stop at the clock (Lightning's "
                             "--trainer.max_time), their validations included"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
