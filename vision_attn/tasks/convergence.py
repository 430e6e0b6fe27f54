"""The convergence alarm of detection training: say early, and why, when a DETR is not learning.

DETRs on small or mis-prepared data can score zero for hundreds of epochs without any error. The
:class:`ConvergenceAlarm` callback (on by default for :class:`~vision_attn.tasks.DetectionTask`)
logs one warning

- when validation ``map_50`` is still below ``floor`` (0.05) at the first validation after a
  quarter of the planned epochs, or
- as soon as a training loss is not finite (NaN or infinite),

naming the likely causes that :func:`detection_checks` finds, and listing every check it made:

- **learning rate**: the peak learning rate (``model.optim.lr``) outside ``[1e-5, 3e-3]``
  (DETRs train at 1e-4 to 1e-3; too high diverges, too low does not move);
- **warm-up**: ``model.optim.warmup_fraction`` of a quarter of the run or more (the learning rate
  is still rising when the alarm looks);
- **classes**: the head's class count differs from the data's, or a training label lies outside it;
- **boxes**: a tenth of the training boxes or more reach past their image or have no area (boxes
  written as ``[x0, y0, x1, y1]`` where COCO wants ``[x, y, width, height]``, or in another
  image size), as the annotation file has them;
- **images**: no training image, or no training image with a box left (every annotation dropped).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning as L

__all__ = ["ConvergenceAlarm", "detection_checks"]

log = logging.getLogger(__name__)

LR_RANGE = (1e-5, 3e-3)
"""Peak learning rates a DETR trains at; outside, the alarm names the learning rate."""
BAD_BOX_SHARE = 0.1


def _boxes_problem(dataset: Any) -> str | None:
    sizes = {im["id"]: (im.get("height"), im.get("width")) for im in getattr(dataset, "images", [])}
    scored = getattr(dataset, "scored", None)
    if not scored:
        return None
    total = bad = 0
    for image_id, objects in scored.items():
        h, w = sizes.get(image_id, (None, None))
        for box, *_ in objects:
            x0, y0, x1, y1 = box
            total += 1
            outside = bool(h and w) and (x1 > w + 1 or y1 > h + 1 or x0 < -1 or y0 < -1)
            bad += outside or x1 <= x0 or y1 <= y0
    if total and bad / total >= BAD_BOX_SHARE:
        return (f"{bad} of {total} training boxes reach past their image or have no area: are they COCO's "
                "[x, y, width, height] in pixels of the image the file names (not [x0, y0, x1, y1], not "
                "normalised, not of a resized copy)?")
    return None


def detection_checks(task: Any, datamodule: Any) -> list[tuple[str, str | None]]:
    """``(check, problem or None)`` for each check of the module docstring, in its order."""
    checks: list[tuple[str, str | None]] = []
    lr = float(task.optim.lr)
    low, high = LR_RANGE
    checks.append(("learning rate", None if low <= lr <= high else
                   f"model.optim.lr {lr:g} is {'above' if lr > high else 'below'} the {low:g}-{high:g} DETRs train at"))
    warmup = float(task.optim.warmup_fraction)
    checks.append(("warm-up", None if warmup < 0.25 else
                   f"model.optim.warmup_fraction {warmup:g}: the learning rate still rises a quarter into the run"))
    dataset = (getattr(datamodule, "datasets", None) or {}).get("train") if datamodule is not None else None
    data_names = getattr(datamodule, "class_names", None)
    ours = len(task.class_names or [])
    problem = None
    if data_names is not None and ours and len(data_names) != ours:
        problem = f"the model has {ours} classes, the data {len(data_names)}"
    elif dataset is not None and ours:
        labels = {label for objects in getattr(dataset, "annotations", {}).values() for _, label in objects}
        if labels and max(labels) >= ours:
            problem = f"training labels go up to {max(labels)}, the model has {ours} classes"
    checks.append(("classes", problem))
    checks.append(("boxes", None if dataset is None else _boxes_problem(dataset)))
    problem = None
    if dataset is not None:
        targets = getattr(dataset, "annotations", {})
        if len(dataset) == 0:
            problem = "the training split has no image"
        elif targets and not any(targets.values()):
            problem = f"none of the {len(dataset)} training images has a box left (every annotation was dropped)"
    checks.append(("images", problem))
    return checks


class ConvergenceAlarm(L.Callback):
    """Warn once when a detector is not learning (see the module docstring).

    Args:
        metric: the validation metric watched.
        floor: below this at the first validation past ``at`` of the planned epochs: the warning.
        at: the share of the run after which the metric is judged.
    """

    def __init__(self, metric: str = "val/map_50", floor: float = 0.05, at: float = 0.25) -> None:
        self.metric, self.floor, self.at = metric, floor, at
        self.fired: str | None = None  # why the warning was given ("loss", "metric"), once per run

    def _warn(self, trainer: L.Trainer, task: Any, what: str) -> None:
        checks = detection_checks(task, getattr(trainer, "datamodule", None))
        causes = [f"{name}: {problem}" for name, problem in checks if problem]
        log.warning("%s. Likely %s. Checked: %s.", what,
                    "causes: " + "; ".join(causes) if causes else "cause: none of the checks found one (the data may "
                    "be too small or too hard for the schedule: more epochs, the small.yaml recipe)",
                    ", ".join(f"{name} {'PROBLEM' if problem else 'ok'}" for name, problem in checks))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.fired is None and loss is not None and not math.isfinite(float(loss)):
            self.fired = "loss"
            self._warn(trainer, pl_module, f"the training loss is {float(loss)} at step {trainer.global_step}")

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.fired is not None or trainer.sanity_checking or not trainer.max_epochs or trainer.max_epochs < 0:
            return
        if trainer.current_epoch + 1 < self.at * trainer.max_epochs:
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is not None and float(value) < self.floor:
            self.fired = "metric"
            self._warn(trainer, pl_module, f"{self.metric} is {float(value):.3f} after {trainer.current_epoch + 1} of "
                       f"{trainer.max_epochs} epochs (below {self.floor:g})")
