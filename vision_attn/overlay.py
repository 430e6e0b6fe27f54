"""Explain every image of a folder with a trained model (= ``vision-attn explain``;
``vision-attn predict`` also runs exported ONNX models):

    python -m vision_attn.overlay --ckpt_path CKPT --images DIR --output_dir OUT

Walks ``DIR`` recursively (any format PIL reads), predicts in batches with a progress bar and
writes, under ``OUT``:

- ``overlays/<relative path>.png`` — the input and one attention overlay per method (the image's
  extension is kept: ``a.jpg`` -> ``a.jpg.png``; long names are shortened with a hash);
- ``predictions.json`` — the task's records, e.g. ``[{"file", "pred", "score"}]`` (``file``
  relative to ``DIR``);
- ``skipped.json`` — files that could not be read, and FIFOs / devices (never opened), with the
  reason (they never abort the run).

An ``OUT`` that already holds any of these is refused unless ``--overwrite`` is given.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.predict import FolderRun, predict_folder

__all__ = ["explain_folder"]

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
    """Overlays and predictions for every image under ``images`` with a checkpoint of any task
    (:func:`vision_attn.predict.predict_folder`).

    Returns ``{"predictions": [...], "skipped": [{"file", "reason"}]}``.
    """
    run = FolderRun(batch_size=batch_size, device=device, overwrite=overwrite, progress=progress)
    return predict_folder(ckpt_path, images, output_dir, run, ExplainOptions(methods=list(methods), alpha=alpha))


if __name__ == "__main__":
    from vision_attn.commands.predict import run_cli

    run_cli(None, "python -m vision_attn.overlay", __doc__, explain=True)
