"""``predict --model timm:NAME --weights_file F`` on the timm ViTs people most want to look inside,
at their real sizes (not part of ``make test``: each model is built full size).

    python -m benchmarks.timm_predict [NAME ...] [--json docs/results/timm_predict.json]

For every model: plain timm builds it with random weights (no download), saved with safetensors;
the folder command runs on one picture with every explanation method asked for, as a user runs
it::

    vision-attn predict --model timm:NAME --weights_file F --images IMAGE --output_dir OUT \\
        --methods rollout relevance attention gradcam lrp tokens random

The table: the model's timm class, whether it has a classifier or is explained as an embedding
(no head, or a projection), the exit status, the methods drawn in the overlay (those that do not
apply are skipped with a warning) and the seconds the command took. A model the suite cannot
explain (windowed or pooling attention, convolutions) exits with status 2 and one line: that line
is the row's note.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import command_line
from benchmarks.results_json import write_results

MODELS = (
    "vit_small_patch16_224", "deit_tiny_distilled_patch16_224", "flexivit_small",
    "vit_small_patch14_reg4_dinov2", "vit_base_patch16_siglip_224", "vit_base_patch16_clip_224",
    "eva02_small_patch14_224", "vit_pe_core_tiny_patch16_384", "beit_base_patch16_224", "cait_xxs24_224",
    "vit_relpos_small_patch16_224", "naflexvit_base_patch16_gap", "vit_base_patch16_rope_reg1_gap_256",
    "swin_tiny_patch4_window7_224",
)
"""The models of the table (timm's names; each built with random weights)."""
METHODS = ("rollout", "relevance", "attention", "gradcam", "lrp", "tokens", "random")


def check(name: str, work: Path, image: Path) -> dict:
    """Build ``name`` with random weights, save them, run ``predict`` with every method; the row."""
    import timm
    import torch
    from safetensors.torch import save_file

    from vision_attn.commands.predict import main as predict
    from vision_attn.explain.methods import applicable_methods
    from vision_attn.tasks.sources import load_model

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    kind = type(model).__name__
    weights = work / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    del model
    out = work / name
    err = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            predict(["--model", f"timm:{name}", "--weights_file", str(weights), "--images", str(image),
                     "--output_dir", str(out), "--methods", *METHODS, "--num_workers", "0", "--device", "cpu"])
        status = 0
    except SystemExit as stop:
        status = int(stop.code or 0)
    seconds = time.perf_counter() - start
    note, drawn, head = "", [], "—"
    if status == 0:
        task = load_model(f"timm:{name}", weights_file=weights)
        head = "embedding" if task.task_name == "embedding" else "classifier"
        drawn = [m for m, reason in applicable_methods(task, METHODS).items() if reason is None]
        written = sorted(p.name for p in (out / "overlays").glob("*.png"))
        record = json.loads((out / "predictions.json").read_text())[0]
        keys = ", ".join(sorted(k for k in record if k != "embedding"))
        note = f"overlay {written[0]}; predictions.json keys: {keys}"
    else:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        note = lines[-1] if lines else f"exit status {status}"
    weights.unlink()
    return {"model": name, "class": kind, "head": head, "status": status, "methods": drawn,
            "seconds": round(seconds, 1), "note": note}


def run(names: Sequence[str] = MODELS) -> list[dict]:
    import numpy as np
    from PIL import Image

    rows = []
    with tempfile.TemporaryDirectory(prefix="timm-predict-") as tmp:
        work = Path(tmp)
        image = work / "picture.png"
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 260, 3), dtype=np.uint8)).save(image)
        for name in names:
            row = check(name, work, image)
            print(f"{name}: {row['class']}, {row['head']}, status {row['status']}, {', '.join(row['methods']) or '—'}, "
                  f"{row['seconds']} s", flush=True)
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", default=list(MODELS), help="timm model names (default: the table's)")
    p.add_argument("--json", default=None, help="write the table as a results file")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = run(a.names or MODELS)
    if a.json:
        columns = ["model", "timm class", "explained as", "exit status", "methods drawn",
                   {"name": "seconds", "format": ".1f"}, "note"]
        write_results(a.json, page="explanations", title="`predict --model timm:NAME` on full-size timm models",
                      command=command_line("benchmarks.timm_predict", argv), columns=columns,
                      rows=[[r["model"], r["class"], r["head"], r["status"], ", ".join(r["methods"]) or "—",
                             r["seconds"], r["note"]] for r in rows],
                      description="Each model built by plain timm at its real size with random weights, saved with "
                                  "safetensors, and explained by the folder command with every method on one "
                                  "260 x 200 picture (`--device cpu`). Methods that do not apply are skipped with "
                                  "a warning; a model that cannot be explained exits with status 2 and one line.")
    return rows


if __name__ == "__main__":
    main()
