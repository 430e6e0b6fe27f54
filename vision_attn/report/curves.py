"""Training curves of a run folder: Lightning's ``CSVLogger`` files read back (:func:`read_training_curves`)."""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path
from typing import Any

from vision_attn.report.markup import finite

__all__ = ["read_training_curves"]

log = logging.getLogger(__name__)


def _version_key(path: Path) -> tuple[int, str]:
    """``csv/version_10`` after ``csv/version_9``; other folder names after, by name."""
    m = re.fullmatch(r"version_(\d+)", path.parent.name)
    return (int(m.group(1)), "") if m else (1 << 30, path.parent.name)


def read_training_curves(ckpt_path: str | Path, max_bytes: int = 64 << 20) -> dict[str, Any] | None:
    """The training curves of the run a checkpoint belongs to, or ``None``.

    A checkpoint at ``<run>/checkpoints/<name>.ckpt`` belongs to ``<run>``; Lightning's
    ``CSVLogger`` writes ``<run>/csv/version_<k>/metrics.csv`` there (one version per start, a
    resumed run adds one). All versions are read in order, a later value for the same epoch
    replacing an earlier one. Nothing outside ``<run>`` is read: a ``csv`` folder or file that
    resolves (through links) outside the run folder is skipped, as are files over
    ``max_bytes``; unreadable, garbled or half-written files give what could be parsed.

    Returns:
        ``{"epochs": [int], "series": {"train/loss": [[epoch, value]], "val/loss": ...,
        "val/<metric>": ...}, "lr": {"<optimizer>/<group>": [[step, value]]}, "files":
        ["csv/version_0/metrics.csv", ...]}``: per epoch the epoch-level value of each
        ``train/*`` and ``val/*`` column (``train/loss_epoch`` is named ``train/loss``; per-step
        columns are left out), and the learning rate of each parameter group per logged step
        (groups with the same schedule as an earlier one are left out). ``None`` when the
        checkpoint is not in a ``checkpoints`` folder or no file gave a value.
    """
    ckpt = Path(ckpt_path)
    if ckpt.parent.name != "checkpoints":
        return None
    run = ckpt.parent.parent
    try:
        run_real = run.resolve(strict=True)
        found = sorted((run / "csv").glob("*/metrics.csv"), key=_version_key)
    except OSError:
        return None
    per_epoch: dict[str, dict[int, float]] = {}
    lr: dict[str, dict[float, float]] = {}
    used = [rel for f in found if (rel := _read_inside(f, run, run_real, max_bytes, per_epoch, lr)) is not None]
    series = {name: [[e, v] for e, v in sorted(values.items())]
              for name, values in sorted(per_epoch.items()) if values}
    groups: dict[str, list[list[float]]] = {}
    for name, values in lr.items():
        points = [[s, v] for s, v in sorted(values.items())]
        if points and all(points != other for other in groups.values()):
            groups[name] = points
    if not series and not groups:
        return None
    epochs = sorted({int(e) for points in series.values() for e, _ in points})
    return {"epochs": epochs, "series": series, "lr": groups, "files": used}


def _read_inside(f: Path, run: Path, run_real: Path, max_bytes: int, per_epoch: dict[str, dict[int, float]],
                 lr: dict[str, dict[float, float]]) -> str | None:
    """Read one ``metrics.csv`` when it lies inside the run folder and is not too large; its path
    relative to the run folder, or ``None`` when it was skipped."""
    try:
        real = f.resolve(strict=True)
        if not real.is_relative_to(run_real) or not real.is_file():
            log.warning("training curves: skipped %s, which resolves outside the run folder %s", f, run)
            return None
        size = real.stat().st_size
        if size > max_bytes:
            log.warning("training curves: skipped %s (%d bytes, more than %d)", f, size, max_bytes)
            return None
        _read_metrics_csv(real, per_epoch, lr)
        return real.relative_to(run_real).as_posix()
    except OSError as e:
        log.warning("training curves: could not read %s: %s", f, e)
        return None


def _read_metrics_csv(path: Path, per_epoch: dict[str, dict[int, float]], lr: dict[str, dict[float, float]]) -> None:
    """Add one ``metrics.csv``'s epoch-level values and learning rates (rows it cannot parse are skipped)."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            for row in csv.DictReader(fh):
                epoch, step = finite(row.get("epoch")), finite(row.get("step"))
                for col, cell in row.items():
                    if not isinstance(col, str) or not isinstance(cell, str):
                        continue  # a row with more cells than the header (restkey None), or fewer
                    value = finite(cell)
                    if value is None:
                        continue
                    if col.startswith("lr-") and step is not None:
                        lr.setdefault(col[3:], {})[step] = value
                    elif epoch is not None and col.startswith(("train/", "val/")) and not col.endswith("_step"):
                        name = col[: -len("_epoch")] if col.endswith("_epoch") else col
                        per_epoch.setdefault(name, {})[int(epoch)] = value
    except (csv.Error, UnicodeError) as e:
        log.warning("training curves: %s is garbled (%s); kept the rows before it", path, e)
