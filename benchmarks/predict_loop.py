"""The folder command's predict loop against a plain timm loop, and overlays against predictions only.

    python -m benchmarks.predict_loop [--images 256] [--model vit_small_patch16_224] [--repeats 3]
                                      [--num_workers 2] [--threads N]
                                      [--json docs/results/performance_predict_loop.json]

A randomly initialised timm model (``--model``, timing does not depend on the weights) is saved
to a local ``.safetensors`` file (no hub), and ``--images`` JPEGs of 320 x 420 px (width x
height: smooth colour noise with a few shapes on it, so they compress like photographs rather
than like white noise) are written to a temporary folder. Three pairs, each side by side in this
process, interleaved (A, B, A, B, ...), medians of ``--repeats``:

- ``predictions only vs plain timm``: :func:`vision_attn.predict.predict_folder` with overlays
  off (the folder command's own loop: Lightning's predict loop, ``--num_workers`` DataLoader
  workers decoding, ``predictions.json`` written) against a plain loop over the same files: PIL
  decode, timm's eval transform (``resolve_data_config`` + ``create_transform``), batches of 16,
  ``torch.inference_mode``. Both load the model from the weights file inside the timed call.
  Ratio: images/s of the folder path over the plain loop's (goal >= 0.9);
- ``rollout overlays vs predictions only``: the same call drawing rollout overlays (and the
  report page) against predictions only. Ratio: time over time (goal <= 1.5);
- ``whole process``: ``python -m vision_attn.predict --model timm:MODEL --weights_file F
  --images DIR --output_dir OUT --no_overlays`` against a plain script doing what the plain loop
  does (and writing its top-5 as JSON), each as a subprocess, start-up included. Ratio: the
  plain script's time over the command's (goal >= 0.85, i.e. the command takes at most 1/0.85
  of the plain script's time).

Every pair checks that both sides predict the same (top-1 class, scores to 1e-4). The
subprocesses inherit the environment (``OMP_NUM_THREADS``); ``--threads`` sets this process's
torch threads and, when given, the subprocesses' ``OMP_NUM_THREADS``; ``--python`` runs both
subprocesses with another interpreter (a runtime-only install: the test extras bring
matplotlib, which torchmetrics, and so Lightning, imports at start-up when it is present).
``--json`` writes the table as a results file of the documentation's performance page
(:mod:`benchmarks.results_json`: columns pair, ratio, goal, met, detail).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import command_line, finite, interleaved_medians, machine
from benchmarks.results_json import write_results

GOALS = {"predictions_only": 0.9, "overlays": 1.5, "whole_process": 0.85}
"""The goals: images/s ratio >= 0.9; overlays time ratio <= 1.5; whole process plain / ours >= 0.85."""
COLUMNS = ["pair", {"name": "ratio", "format": ".3f"}, "goal", "met", "detail"]
"""The columns of the results file (those of ``docs/results/performance_predict_loop.json``)."""

PLAIN_SCRIPT = textwrap.dedent('''\
    """A plain timm prediction script: PIL decode, timm's eval transform, batches, inference_mode."""
    import json
    import sys
    from pathlib import Path

    import safetensors.torch
    import timm
    import torch
    from PIL import Image


    def predict(model_name, weights, folder, batch):
        model = timm.create_model(model_name, pretrained=False)
        model.load_state_dict(safetensors.torch.load_file(str(weights)))
        model.eval()
        transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"})
        records = []
        with torch.inference_mode():
            for i in range(0, len(files), batch):
                chunk = files[i:i + batch]
                x = torch.stack([transform(Image.open(f).convert("RGB")) for f in chunk])
                scores, classes = model(x).softmax(-1).topk(5, dim=-1)
                for f, s, c in zip(chunk, scores.tolist(), classes.tolist()):
                    records.append({"file": str(f.relative_to(folder)), "classes": c, "scores": s})
        return records


    if __name__ == "__main__":
        name, weights, folder, out, batch = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        Path(out).write_text(json.dumps(predict(name, weights, folder, batch)))
''')


def make_images(folder: Path, n: int, width: int = 320, height: int = 420, seed: int = 0) -> list[Path]:
    """``n`` JPEGs (quality 90) of ``width x height`` px in ``folder``: smooth colour noise (a
    coarse grid upsampled bicubically) with a filled rectangle and a disc of random colours."""
    import cv2

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        coarse = rng.integers(0, 256, (height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
        img = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        cv2.rectangle(img, (x0, y0), (x0 + width // 3, y0 + height // 4),
                      tuple(int(c) for c in rng.integers(0, 256, 3)), -1)
        cv2.circle(img, (int(rng.integers(0, width)), int(rng.integers(0, height))), width // 6,
                   tuple(int(c) for c in rng.integers(0, 256, 3)), -1)
        img = np.clip(img.astype(np.int16) + rng.integers(-8, 9, img.shape), 0, 255).astype(np.uint8)
        path = folder / f"img_{i:05d}.jpg"
        cv2.imwrite(str(path), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        paths.append(path)
    return paths


def save_random_weights(model: str, path: Path, seed: int = 0) -> Path:
    """A randomly initialised timm ``model``'s state dict as ``.safetensors`` (nothing from the hub)."""
    import safetensors.torch
    import timm

    torch.manual_seed(seed)
    net = timm.create_model(model, pretrained=False)
    safetensors.torch.save_file(net.state_dict(), str(path))
    return path


def plain_predictions(model: str, weights: Path, folder: Path, batch: int = 16) -> list[dict]:
    """What :data:`PLAIN_SCRIPT` does, in this process (its own ``predict``, so both pairs time
    the same code): ``[{"file", "classes", "scores"}]`` (top-5)."""
    namespace: dict = {"__name__": "plain_predict"}
    exec(compile(PLAIN_SCRIPT, "plain_predict.py", "exec"), namespace)  # noqa: S102 - our own constant
    return namespace["predict"](model, weights, folder, batch)


def same_predictions(ours: list[dict], plain: list[dict]) -> bool:
    """Whether the folder command's records (``file``, ``score``) and the plain loop's agree:
    the same files in the same order and the same top-1 probability (1e-4; the class labels are
    names on one side, indices on the other, and random weights make near-ties likely)."""
    return (len(ours) == len(plain) and [r["file"] for r in ours] == [r["file"] for r in plain]
            and bool(np.allclose([r["score"] for r in ours], [r["scores"][0] for r in plain], atol=1e-4)))


def in_process_pairs(model: str, weights: Path, folder: Path, work: Path, repeats: int = 3, batch: int = 16,
                     num_workers: int = 2) -> list[dict]:
    """The two in-process rows (see the module docstring)."""
    from vision_attn.explain.evaluate import ExplainOptions
    from vision_attn.predict import FolderRun, ModelSource, predict_folder

    n = sum(1 for _ in folder.glob("*.jpg"))
    last: dict[str, object] = {}
    source = ModelSource(f"timm:{model}", weights_file=weights)
    run = FolderRun(batch_size=batch, num_workers=num_workers, overwrite=True, progress=False)

    def ours(overlays: bool, key: str):
        def call() -> None:
            drawn = ExplainOptions(methods=["rollout"]) if overlays else None
            last[key] = predict_folder(source, folder, work / key, run, drawn, overlays=overlays)
        return call

    def plain() -> None:
        last["plain"] = plain_predictions(model, weights, folder, batch)

    fns = {"plain": plain, "predictions": ours(False, "predictions"), "overlays": ours(True, "overlays")}
    med = interleaved_medians(fns, repeats=repeats, warmup=1)
    preds, overl, ref = last["predictions"]["predictions"], last["overlays"]["predictions"], last["plain"]
    ratio = med["plain"] / med["predictions"]  # images/s ours over plain
    over = med["overlays"] / med["predictions"]
    return [
        {"pair": f"folder predictions only vs plain timm loop ({n} images, batch {batch})", "ours": med["predictions"],
         "reference": med["plain"], "ratio": ratio, "goal": f">= {GOALS['predictions_only']}x images/s",
         "met": ratio >= GOALS["predictions_only"] and same_predictions(preds, ref),
         "detail": f"{n / med['predictions']:.1f} vs {n / med['plain']:.1f} images/s, {num_workers} workers; "
                   f"same predictions: {same_predictions(preds, ref)}"},
        {"pair": "folder command: rollout overlays vs predictions only", "ours": med["overlays"],
         "reference": med["predictions"], "ratio": over, "goal": f"<= {GOALS['overlays']}x time",
         "met": over <= GOALS["overlays"] and same_predictions(overl, ref),
         "detail": f"{med['overlays']:.2f} vs {med['predictions']:.2f} s; same predictions: "
                   f"{same_predictions(overl, ref)}"},
    ]


def whole_process_pair(model: str, weights: Path, folder: Path, work: Path, repeats: int = 3, batch: int = 16,
                       num_workers: int = 2, env: dict[str, str] | None = None, python: str | None = None) -> dict:
    """The whole-process row: ``python -m vision_attn.predict ... --no_overlays`` vs :data:`PLAIN_SCRIPT`,
    both run by the interpreter ``python`` (default: this one)."""
    script = work / "plain_predict.py"
    script.write_text(PLAIN_SCRIPT)
    env = {**os.environ, **(env or {})}
    python = python or sys.executable
    ours_cmd = [python, "-m", "vision_attn.predict", "--model", f"timm:{model}", "--weights_file", str(weights),
                "--images", str(folder), "--output_dir", str(work / "cli"), "--no_overlays", "--overwrite",
                "--batch_size", str(batch), "--num_workers", str(num_workers)]
    plain_cmd = [python, str(script), model, str(weights), str(folder), str(work / "plain.json"), str(batch)]

    def runner(cmd: list[str]):
        def call() -> None:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        return call

    med = interleaved_medians({"plain": runner(plain_cmd), "ours": runner(ours_cmd)}, repeats=repeats, warmup=0)
    ours = json.loads((work / "cli" / "predictions.json").read_text())
    same = same_predictions(ours, json.loads((work / "plain.json").read_text()))
    n = len(ours)
    ratio = med["plain"] / med["ours"]
    return {"pair": f"whole process: python -m vision_attn.predict --no_overlays vs a plain timm script ({n} images)",
            "ours": med["ours"], "reference": med["plain"], "ratio": ratio,
            "goal": f">= {GOALS['whole_process']} (time <= {1 / GOALS['whole_process']:.3f}x)",
            "met": ratio >= GOALS["whole_process"] and same,
            "detail": f"{med['ours']:.2f} vs {med['plain']:.2f} s, start-up included; same predictions: {same}"}


def run(images: int = 256, model: str = "vit_small_patch16_224", repeats: int = 3, batch: int = 16,
        num_workers: int = 2, whole_process: bool = True, whole_repeats: int | None = None,
        env: dict[str, str] | None = None, work_dir: str | Path | None = None, python: str | None = None) -> dict:
    """The rows of the table (small ``images`` / ``model`` for tests)."""
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="predict_loop_", dir=work_dir))
    try:
        folder = tmp / "images"
        make_images(folder, images)
        weights = save_random_weights(model, tmp / f"{model}.safetensors")
        rows = in_process_pairs(model, weights, folder, tmp, repeats, batch, num_workers)
        if whole_process:
            rows.append(whole_process_pair(model, weights, folder, tmp, whole_repeats or repeats, batch, num_workers,
                                           env, python))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"model": model, "images": images, "batch": batch, "num_workers": num_workers, "repeats": repeats,
            "rows": rows, "machine": machine(), "seconds": round(time.perf_counter() - t0, 1)}


def write_json(path: str | Path, result: dict, command: str) -> Path:
    """:func:`run`'s ``result`` as a results file (:data:`COLUMNS`); ``command``: the command line
    that reproduces it."""
    rows = [[r["pair"], finite(r["ratio"]), r["goal"], bool(r["met"]), r["detail"]] for r in result["rows"]]
    return write_results(
        path, page="performance", title="The folder command's predict loop against a plain timm loop",
        command=command, columns=COLUMNS, rows=rows,
        description=f"{result['model']} with random weights saved as a local `.safetensors`, {result['images']} "
                    f"JPEGs of 320 x 420 px, batch {result['batch']}, {result['num_workers']} DataLoader workers, "
                    f"{result['machine']['threads']} torch threads; medians of {result['repeats']} interleaved "
                    "repeats. Every pair checks that both sides predict the same top-1 score to 1e-4 (detail "
                    "column), and a pair whose sides differ does not meet its goal.",
        notes=[f"{result['seconds']:.0f} s in all."])


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--model", default="vit_small_patch16_224")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--no_whole_process", action="store_true", help="skip the subprocess pair")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here and OMP_NUM_THREADS of the subprocesses (default: torch's / inherited)")
    p.add_argument("--python", default=None,
                   help="interpreter of the whole-process pair, both sides (default: this one); e.g. the .venv of "
                        "`make install`, which lacks the test extras "
                        "(matplotlib, which torchmetrics imports when present)")
    p.add_argument("--json", default=None, help="write the table here as a results file "
                                                "(make bench: docs/results/performance_predict_loop.json)")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "vision_attn"):
        logging.getLogger(name).setLevel(logging.ERROR)
    env = None
    if a.threads:
        torch.set_num_threads(a.threads)
        env = {"OMP_NUM_THREADS": str(a.threads)}
    res = run(a.images, a.model, a.repeats, a.batch, a.num_workers, not a.no_whole_process, env=env, python=a.python)
    print(f"predict loop, {a.model} (random weights), {a.images} JPEGs 320x420, batch {a.batch}, "
          f"{a.num_workers} workers, {res['machine']['threads']} threads")
    print("| pair | ratio | goal | met | detail |\n| --- | --- | --- | --- | --- |")
    for r in res["rows"]:
        print(f"| {r['pair']} | {r['ratio']:.3f} | {r['goal']} | {'yes' if r['met'] else 'no'} | {r['detail']} |")
    print(f"{res['seconds']} s")
    if a.json:
        write_json(a.json, res, command_line("benchmarks.predict_loop", argv))
    return res


if __name__ == "__main__":
    main()
