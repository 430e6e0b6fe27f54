"""Explain every image of a folder with a trained classifier (``python -m vision_attn.predict``
does the same for every task and for exported ONNX models):

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

from vision_attn.errors import VisionAttnError
from vision_attn.predict import predict_folder

__all__ = ["explain_folder", "main"]

log = logging.getLogger(__name__)


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
    """Overlays and predictions for every image under ``images`` with a classification checkpoint
    (:func:`vision_attn.predict.predict_folder`, which serves every task).

    Returns ``{"predictions": [...], "skipped": [{"file", "reason"}]}``.
    """
    return predict_folder(ckpt_path, images, output_dir, batch_size, True, tuple(methods), alpha=alpha, device=device,
                          overwrite=overwrite, progress=progress, expected_task="classification")


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
