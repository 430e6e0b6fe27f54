"""``make demo``: train each task briefly on the embedded synthetic data, evaluate, report.

    python -m vision_attn.demo --output_dir runs/demo

Every run goes into a new time-stamped folder under ``--output_dir`` (nothing earlier is
overwritten); the last lines say where everything went.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from datetime import datetime
from pathlib import Path

from vision_attn.commands.args import console_logging
from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.train import train_main
from vision_attn.outputs import write_json
from vision_attn.tasks.base import load_task

log = logging.getLogger("vision_attn.demo")

# The tasks the demo trains, each with its config configs/<task>/shapes.yaml (:func:`demo_config`).
TASKS = (
    "classification",  # about 3 minutes on 2 CPU cores
    "detection",  # about 7 minutes on 2 CPU cores (12 epochs, batch 8)
    "captioning",  # about 4 minutes on 2 CPU cores (5500 scenes generated once, training, evaluation)
)


def demo_config(task: str) -> str:
    """The demo's config of ``task``: the embedded shapes data, ``configs/<task>/shapes.yaml``."""
    return f"configs/{task}/shapes.yaml"


def run_demo(output_dir: str, tasks: list[str], extra: list[str] | None = None) -> dict[str, dict]:
    """Train + evaluate each task; returns ``{task: {"metrics", "train_seconds", "dir"}}``."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(output_dir) / stamp
    results = {}
    for task in tasks:
        config = demo_config(task)
        run_dir = base / task
        t0 = time.perf_counter()
        train_main(["--config", config, "--trainer.default_root_dir", str(run_dir), *(extra or [])])
        seconds = time.perf_counter() - t0
        ckpt = run_dir / "checkpoints" / "last.ckpt"
        # the checkpoint holds the model and the data settings; the config adds its explain section
        metrics = eval_main(["--config", config, "--ckpt_path", str(ckpt), "--output_dir", str(run_dir / "eval")])
        model = type(load_task(ckpt))
        results[task] = {"metrics": metrics, "train_seconds": round(seconds, 1), "dir": str(run_dir),
                         "headline": list(model.headline_metrics), "overlays": model.overlay_description}
    write_json(base / "summary.json", results, root=base)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/demo")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    args, extra = parser.parse_known_args()
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    console_logging()
    results = run_demo(args.output_dir, args.tasks, extra)
    print("\n== vision_attn demo ==")
    for task, r in results.items():
        metrics = ", ".join(f"{k}={r['metrics'][k]:.3f}" for k in r["headline"] if k in r["metrics"])
        print(f"{task:15s} trained in {r['train_seconds']:.0f} s  {metrics}")
        print(f"{'':15s} run:     {r['dir']}  (config.yaml, checkpoints/last.ckpt, tensorboard/, csv/)")
        print(f"{'':15s} results: {r['dir']}/eval/metrics.json, {r['dir']}/eval/predictions.json")
        print(f"{'':15s} overlays: {r['dir']}/eval/overlays/*.png ({r['overlays']})")
    print(f"TensorBoard: {Path(args.output_dir)}  ->  tensorboard --logdir {args.output_dir}")
