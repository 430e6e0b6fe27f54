"""Explain every image of a folder with a trained classifier:

    python -m vision_attn.overlay --ckpt_path CKPT --images DIR --output_dir OUT

Walks ``DIR`` recursively (any format PIL reads), predicts in batches with a progress bar and
writes, under ``OUT``:

- ``overlays/<relative path>.png`` — the input and one attention overlay per method;
- ``predictions.json`` — ``[{"file", "pred", "score"}]`` (``file`` relative to ``DIR``);
- ``skipped.json`` — files that could not be read, with the reason (they never abort the run).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from rich.progress import Progress

from vision_attn.cli import write_json_atomic
from vision_attn.data.imageio import IMAGE_EXTENSIONS, ImageReadError, read_image
from vision_attn.data.transforms import build_display_transform, build_eval_transform
from vision_attn.errors import RunExistsError, VisionAttnError
from vision_attn.explain.evaluate import explanation_panel
from vision_attn.explain.methods import explain_classifier
from vision_attn.explain.overlay import save_png
from vision_attn.tasks.base import load_task

__all__ = ["explain_folder", "main"]

log = logging.getLogger(__name__)


def _list_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def explain_folder(
    ckpt_path: str | Path,
    images: str | Path,
    output_dir: str | Path,
    methods: tuple[str, ...] = ("rollout", "relevance"),
    batch_size: int = 16,
    alpha: float = 0.5,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, list]:
    """Overlays and predictions for every image under ``images``; returns what was written.

    Returns ``{"predictions": [...], "skipped": [{"file", "reason"}]}``.
    """
    images, out = Path(images), Path(output_dir)
    if not images.is_dir():
        raise VisionAttnError(f"--images {images} is not a folder")
    if (out / "predictions.json").exists() and not overwrite:
        raise RunExistsError(f"{out} already holds predictions.json; pass another --output_dir or --overwrite")
    task = load_task(ckpt_path, expected_task="classification", map_location=device)
    tf, display_tf = build_eval_transform(task.data_config), build_display_transform(task.data_config)
    names = task.class_names or []
    files = _list_files(images)
    predictions: list[dict] = []
    skipped: list[dict] = []

    def flush(batch: list[tuple[Path, object]]) -> None:
        x = torch.stack([tf(img) for _, img in batch]).to(device)
        expl = explain_classifier(task, x, methods)
        probs = expl.logits.float().softmax(-1)
        for j, (path, img) in enumerate(batch):
            rel = path.relative_to(images)
            pred = int(expl.target[j])
            score = float(probs[j, pred])
            panel = explanation_panel(display_tf(img), expl.maps, j, f"{names[pred]} {score:.2f}", alpha)
            save_png(out / "overlays" / rel.with_suffix(".png"), panel)
            predictions.append({"file": str(rel), "pred": names[pred], "score": score})

    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("explaining", total=len(files))
        batch: list[tuple[Path, object]] = []
        for path in files:
            try:
                batch.append((path, read_image(path)))
            except ImageReadError as err:
                log.warning("skipping %s: %s", path, err.reason)
                skipped.append({"file": str(path.relative_to(images)), "reason": err.reason or str(err)})
            if len(batch) == batch_size:
                flush(batch)
                batch = []
            bar.advance(job)
        if batch:
            flush(batch)
    write_json_atomic(out / "predictions.json", predictions)
    write_json_atomic(out / "skipped.json", skipped)
    log.info("explained %d images into %s (%d skipped)", len(predictions), out, len(skipped))
    return {"predictions": predictions, "skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vision_attn.overlay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", required=True, help="classification checkpoint from train.py")
    parser.add_argument("--images", required=True, help="folder of images (searched recursively)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--methods", nargs="+", default=["rollout", "relevance"],
                        choices=["rollout", "relevance", "attention"])
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=0.5, help="heat-map opacity")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = explain_folder(args.ckpt_path, args.images, args.output_dir, tuple(args.methods),
                                args.batch_size, args.alpha, args.device, args.overwrite)
    except VisionAttnError as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    print(f"{len(result['predictions'])} images explained, {len(result['skipped'])} skipped -> {args.output_dir}")


if __name__ == "__main__":
    main()
