"""Explanation measures as objects: ``update`` with what was explained, ``compute`` the numbers.

Every head (classification, detection, captioning) explains *items* — an image's labelled class,
a kept detection, a generated word — and produces, per item, its maps and what it is measured
against (the boxes of its object, the model's score as patches are perturbed, the maps of a
randomised model). The measures here accumulate those items, average them and name the numbers
of ``metrics.json``, the same way for every head:

- :class:`Localisation`: ``pointing_<method>`` and ``energy_<method>`` of maps in original image
  pixels against their item's boxes (:func:`~vision_attn.explain.localisation.localisation`),
  and, given the objects' masks, ``pixel_acc_<method>``, ``miou_<method>`` and
  ``map_mask_<method>`` (:mod:`vision_attn.explain.segmentation`);
- :class:`Perturbation`: ``deletion_auc_<method>`` / ``insertion_auc_<method>`` from the
  deletion / insertion curves (:mod:`vision_attn.explain.faithfulness`), ``deletion_auc`` /
  ``insertion_auc`` of the head's first method, and the mean curves (``report.html``);
- :class:`ItemScores`: per-item scores averaged, ``<name>_<method>`` (ROAD's ``road_<method>``,
  ``road_morf_<method>``, ``road_lerf_<method>`` and SaCo's ``saco_<method>``,
  :mod:`vision_attn.explain.road`);
- :class:`Sanity`: ``sanity_<method>``, the mean Spearman correlation with the maps of the fully
  randomised model (:mod:`vision_attn.explain.sanity`), and ``OUT/sanity.json``;
- :class:`MapWriter`: the maps as ``OUT/maps/<method>/<name>.npy`` and ``OUT/maps/index.json``.

As torchmetrics' metrics: ``update(...)`` adds items, ``compute()`` returns ``{name: float}``
(nothing when no item was added), ``reset()`` forgets them. The methods are those of the
updates, in the order they first appear (the ``random`` baseline is a method like the others).

Progress: :class:`Localisation`, :class:`Perturbation` and :class:`Sanity` report what they
measure as items come in (:class:`~vision_attn.explain.progress.Progress`: a bar on a terminal,
a log line every 30 s otherwise, nothing when quiet); given the ``total`` of items expected,
with the time left. The clock starts when the measure is created (the work of the first items
counts), the report shows with the first update and ends with ``compute()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from vision_attn.explain.faithfulness import MODES, auc
from vision_attn.explain.localisation import localisation
from vision_attn.explain.progress import Progress
from vision_attn.explain.segmentation import SegmentationScores
from vision_attn.outputs import safe_filename, write_json, write_npy

__all__ = ["ItemScores", "Localisation", "MapWriter", "Measures", "Perturbation", "Sanity"]

log = logging.getLogger(__name__)


class _Reported:
    """What the measures share: a progress report of the items added (see the module docstring)."""

    what = "explanation measures"
    unit = "item"
    _progress: Progress | None = None

    def __init__(self, total: int | None = None, progress: bool | None = None) -> None:
        self.total, self.progress_enabled = total, progress
        self._began = time.monotonic()

    def _advance(self, n: int) -> None:
        if self._progress is None:
            self._progress = Progress(self.what, self.total, self.unit, enabled=self.progress_enabled,
                                      start=self._began)
        self._progress.update(n)

    def _done(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None


def _rows(values: Mapping[str, Mapping[str, Tensor]]) -> int:
    """The number of items of an update ``{method: {key: [R, ...]}}``, the same for every entry."""
    counts = {len(v) for inner in values.values() for v in inner.values()}
    if len(counts) > 1:
        raise ValueError(f"an update holds the same items for every method, got {sorted(counts)} rows")
    return counts.pop() if counts else 0


class Localisation(_Reported):
    """Pointing game and energy share of each method's maps against their items' boxes.

    ``pointing_<method>``: the share of items whose map maximum lies within ``tolerance`` px of
    one of their boxes; ``energy_<method>``: the mean share of the map's mass inside them (see
    :func:`~vision_attn.explain.localisation.localisation`). Items without boxes are not
    scored. A method given several maps per item (draws of the ``random`` baseline) scores
    the mean over them.

    Args:
        tolerance: of the pointing hit, in pixels.
        total: the items expected (the progress report's time left; ``None``: unknown).
        progress: report progress (``None``: unless quiet; see the module docstring).
    """

    what = "explanation measures: localisation"

    def __init__(self, tolerance: float = 1.0, total: int | None = None, progress: bool | None = None) -> None:
        super().__init__(total, progress)
        self.tolerance = tolerance
        self.reset()

    def reset(self) -> None:
        self.hits: dict[str, float] = {}
        self.energy: dict[str, float] = {}
        self.count = 0  # the items scored
        self.segmentation = SegmentationScores()

    def update(self, maps: Mapping[str, np.ndarray], boxes: Sequence[Sequence[float]],
               masks: Sequence[np.ndarray] | None = None) -> bool:
        """Score one item; ``False`` (nothing added) when it has no box.

        Args:
            maps: per method the item's map in original image pixels, float ``[H, W]``, or
                ``[D, H, W]`` for ``D`` draws whose mean counts.
            boxes: the boxes of the item's object, ``[x0, y0, x1, y1]`` pixels.
            masks: the pixel masks of the item's object (bool ``[H, W]``, the map's size), when
                the data has them: ``pixel_acc_<method>``, ``miou_<method>`` and
                ``map_mask_<method>`` too (:mod:`vision_attn.explain.segmentation`).
        """
        self._advance(1)
        if masks:
            self.segmentation.update(maps, masks)
        if len(boxes) == 0:
            return False
        for method, image_map in maps.items():
            draws = np.asarray(image_map)
            draws = draws[None] if draws.ndim == 2 else draws  # (D, H, W)
            for one in draws:
                hit, share = localisation(one, boxes, self.tolerance)
                self.hits[method] = self.hits.get(method, 0.0) + int(hit) / len(draws)
                self.energy[method] = self.energy.get(method, 0.0) + share / len(draws)
        self.count += 1
        return True

    def compute(self) -> dict[str, float]:
        """``pointing_<method>`` and ``energy_<method>`` means over the scored items."""
        self._done()
        out: dict[str, float] = {}
        if not self.count:
            return out
        for method in self.hits:
            out[f"pointing_{method}"] = self.hits[method] / self.count
            out[f"energy_{method}"] = self.energy[method] / self.count
        return {**out, **self.segmentation.compute()}


class Perturbation(_Reported):
    """Deletion / insertion AUC of each method's maps, from the curves of their items.

    Args:
        first: the head's method reported again as ``deletion_auc`` / ``insertion_auc``
            (``None``: no such keys).
        total: the items expected (the progress report's time left; ``None``: unknown).
        progress: report progress (``None``: unless quiet; see the module docstring).
    """

    what = "explanation measures: deletion / insertion curves"

    def __init__(self, first: str | None = None, total: int | None = None, progress: bool | None = None) -> None:
        super().__init__(total, progress)
        self.first = first
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}  # "<mode>_auc_<method>": summed AUC
        self.curve_sums: dict[tuple[str, str], Tensor] = {}  # (method, mode): summed curve, float64
        self.count = 0  # the items measured

    def update(self, curves: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Add ``R`` items: ``curves[method][mode]`` is ``[R, steps + 1]``, the item's score as
        its patches are deleted or inserted (``mode``: ``deletion`` | ``insertion``) in the
        method's map order, sampled evenly on ``[0, 1]``; the same ``R`` items for every entry."""
        rows = _rows(curves)
        for method, per_mode in curves.items():
            for mode, curve in per_mode.items():
                if mode not in MODES:
                    raise ValueError(f"perturbation mode must be one of {', '.join(MODES)}, got {mode!r}")
                key = f"{mode}_auc_{method}"
                self.sums[key] = self.sums.get(key, 0.0) + float(auc(curve).sum())
                total = curve.detach().double().sum(0).cpu()
                prev = self.curve_sums.get((method, mode))
                self.curve_sums[method, mode] = total if prev is None else prev + total
        self.count += rows
        self._advance(rows)

    def compute(self) -> dict[str, float]:
        """``<mode>_auc_<method>`` means over the items, then ``deletion_auc`` / ``insertion_auc``
        of :attr:`first`."""
        self._done()
        if not self.count:
            return {}
        out = {key: total / self.count for key, total in self.sums.items()}
        if self.first is not None:
            out["deletion_auc"] = out[f"deletion_auc_{self.first}"]
            out["insertion_auc"] = out[f"insertion_auc_{self.first}"]
        return out

    def curves(self, mode: str = "deletion") -> dict[str, list[float]]:
        """``{method: mean curve}`` of ``mode`` over the items (``report.html``'s curves)."""
        if not self.count:
            return {}
        return {method: (total / self.count).tolist() for (method, m), total in self.curve_sums.items() if m == mode}


class ItemScores(_Reported):
    """Per-item scores of each method averaged over the items: ``<name>_<method>`` for
    ``update({method: {name: [R]}})`` (ROAD's ``road`` / ``road_morf`` / ``road_lerf`` and SaCo's
    ``saco``, :mod:`vision_attn.explain.road`).

    Args:
        what: what the progress report calls the work.
        total: the items expected (``None``: unknown).
        progress: report progress (``None``: unless quiet).
    """

    def __init__(self, what: str = "explanation measures: ROAD and SaCo", total: int | None = None,
                 progress: bool | None = None) -> None:
        super().__init__(total, progress)
        self.what = what
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def update(self, scores: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Add ``R`` items: ``scores[method][name]`` is ``[R]``; the same ``R`` items everywhere."""
        rows = _rows(scores)
        for method, named in scores.items():
            for name, values in named.items():
                key = f"{name}_{method}"
                self.sums[key] = self.sums.get(key, 0.0) + float(values.double().sum())
        self.count += rows
        self._advance(rows)

    def compute(self) -> dict[str, float]:
        """``<name>_<method>``: the means over the items."""
        self._done()
        return {key: total / self.count for key, total in self.sums.items()} if self.count else {}


class Sanity(_Reported):
    """The model-randomisation check: mean Spearman correlation between each method's maps of
    the trained model and of its copies randomised from the output down
    (:func:`~vision_attn.explain.sanity.model_cascade`), per randomisation step.
    ``sanity_<method>`` is the step ``all`` (the fully randomised model).

    Args:
        total: the items expected (the progress report's time left; ``None``: unknown).
        progress: report progress (``None``: unless quiet; see the module docstring).
    """

    what = "explanation measures: sanity check"

    def __init__(self, total: int | None = None, progress: bool | None = None) -> None:
        super().__init__(total, progress)
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, dict[str, float]] = {}  # method -> step -> summed correlation
        self.count = 0  # the items measured

    def update(self, correlations: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Add ``R`` items: ``correlations[method][step]`` is ``[R]``, the steps in cascade order
        (``all`` last); the same ``R`` items for every entry."""
        rows = _rows(correlations)
        for method, steps in correlations.items():
            sums = self.sums.setdefault(method, {})
            for step, rho in steps.items():
                sums[step] = sums.get(step, 0.0) + float(rho.sum())
        self.count += rows
        self._advance(rows)

    def curves(self) -> dict[str, dict[str, float]]:
        """``{method: {step: mean correlation}}``."""
        if not self.count:
            return {}
        return {m: {step: total / self.count for step, total in steps.items()} for m, steps in self.sums.items()}

    def compute(self) -> dict[str, float]:
        """``sanity_<method>``: the mean correlation after full randomisation."""
        self._done()
        return {f"sanity_{m}": curve["all"] for m, curve in self.curves().items()}

    def write(self, out_dir: Path) -> None:
        """``out_dir/sanity.json`` (through :mod:`vision_attn.outputs`): the per-step curves
        ``{"measure", "steps", "methods": {method: {step: mean}}}``; nothing without items."""
        curves = self.curves()
        if not curves:
            return
        write_json(out_dir / "sanity.json", {"measure": "mean Spearman correlation with the trained model's maps",
                                             "steps": list(next(iter(curves.values()))), "methods": curves},
                   root=out_dir)


class MapWriter:
    """The explained items' maps in original image pixels: ``OUT/maps/<method>/<name>.npy``
    (float32 ``[H, W]``) and ``OUT/maps/index.json`` (one entry per item, in update order),
    written through :mod:`vision_attn.outputs` (inside ``out_dir``, safe method names).

    Args:
        out_dir: the evaluation output folder.
        items: what an item is, for the log (``images``, ``detections``, ``words``).
    """

    def __init__(self, out_dir: Path, items: str = "images") -> None:
        self.out_dir, self.items = Path(out_dir), items
        self.reset()

    def reset(self) -> None:
        self.index: list[dict[str, Any]] = []

    @property
    def count(self) -> int:
        """The items written so far (the running number of the next default name)."""
        return len(self.index)

    def update(self, maps: Mapping[str, np.ndarray], entry: dict[str, Any], name: str | None = None) -> str:
        """Write one item's maps (``{method: [H, W]}``) as ``<name>.npy`` (default: the running
        number, ``00000``, ``00001``, ...) and add ``entry`` to the index; returns the name."""
        name = f"{self.count:05d}" if name is None else name
        for method, image_map in maps.items():
            write_npy(self.out_dir / "maps" / safe_filename(method) / f"{name}.npy",
                      np.asarray(image_map, dtype=np.float32), root=self.out_dir)
        self.index.append(entry)
        return name

    def compute(self) -> dict[str, float]:
        """Write ``OUT/maps/index.json`` (an empty list when no item was written); no numbers."""
        write_json(self.out_dir / "maps" / "index.json", self.index, root=self.out_dir)
        log.info("wrote the maps of %d %s to %s", len(self.index), self.items, self.out_dir / "maps")
        return {}


@dataclass
class Measures:
    """The measures one evaluation updates together (``maps``: ``None`` when not saved)."""

    localisation: Localisation = field(default_factory=Localisation)
    perturbation: Perturbation = field(default_factory=Perturbation)
    sanity: Sanity = field(default_factory=Sanity)
    maps: MapWriter | None = None

