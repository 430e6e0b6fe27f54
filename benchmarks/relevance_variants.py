"""Variants of the classifier's gradient-weighted relevance (Chefer et al. 2021) against rollout and
AttnLRP, on the ``make demo`` classifier and one trained on data the methods were not tuned on
(``python -m benchmarks.relevance_variants``; not part of ``make test``).

    python -m benchmarks.relevance_variants [--classification CKPT] [--heldout CKPT ROOT ...]
        [--images 100] [--seed 0] [--json docs/results/explanations_relevance_variants.json]

Each checkpoint is evaluated by ``eval.py``'s own code (:func:`benchmarks.explanations.evaluate`:
the sanity check and ROAD on, ``--explain.faithfulness_images N``) with the methods below, which
this module registers for the measurement only (they are not shipped):

- ``relevance``: as shipped, every block;
- ``relevance_from_block_K``: the blocks before block ``K`` (1-based) left out (``start_layer``);
- ``relevance_smoothed``: the token map blurred by a 3 x 3 binomial kernel;
- ``relevance_x_rollout``: its product with the rollout;
- ``relevance_sqrt``: its square root (a monotone change: pointing, deletion, insertion and ROAD,
  which read only the order of the patches, stay; energy, mIoU and SaCo, which read the values, move);
- ``relevance_abs_grad``: ``|gradient| * attention`` instead of ``relu(gradient * attention)``;
- ``relevance_of_lrp``: ``relu(gradient * R_A)`` with ``R_A`` the AttnLRP relevance of each block's
  attention weights instead of the weights themselves (the LRP-based rule of Chefer et al., CVPR
  2021; one more forward and backward pass).

Beside the methods, the notes give the **ceiling** of mIoU and mask mAP at the model's patch grid:
the scores of an ideal map, each patch's share of the object's mask, upsampled to the image as the
evaluation upsamples every method's map (:func:`patch_ceiling`, over every validation image): how
far a method's map, which lives on the same grid, is from the object's own shape at that grid.

The default ``--classification`` is the newest ``runs/demo/*/classification/checkpoints/last.ckpt``;
``--heldout`` (repeatable: several training seeds) a checkpoint of
``python -m benchmarks.classification_holdout strokes`` with its data root (the masks come from
``ROOT/annotations/instances_val.json``); its rows are labelled ``held out: RUN``, the run's folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import command_line, finite, quiet_logging
from benchmarks.explanations import evaluate, newest_checkpoint
from benchmarks.results_json import write_results

log = logging.getLogger("benchmarks.relevance_variants")

MEASURES = {"pointing": "pointing", "energy": "energy", "mIoU": "miou", "mask mAP": "map_mask",
            "deletion AUC": "deletion_auc", "insertion AUC": "insertion_auc", "ROAD": "road", "SaCo": "saco"}
"""Column -> metric key prefix (``<prefix>_<method>`` in ``metrics.json``)."""

_BINOMIAL = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16


def _from_block(k: int):
    def fn(x) -> Tensor:
        from vision_attn.explain.rollout import gradient_relevance

        start = min(k - 1, len(x.attentions) - 1)
        return gradient_relevance(x.attentions, x.attention_grads, x.grid, x.num_prefix_tokens, x.token_index,
                                  start, merges=x.merges)
    return fn


def _smoothed(x) -> Tensor:
    from vision_attn.explain.methods import METHODS

    maps = METHODS["relevance"].fn(x).float()
    return F.conv2d(maps[:, None], _BINOMIAL[None, None].to(maps.device), padding=1)[:, 0]


def _times_rollout(x) -> Tensor:
    from vision_attn.explain.methods import METHODS

    rollout = METHODS["rollout"].fn(x)
    return METHODS["relevance"].fn(x) * rollout / rollout.amax(dim=(1, 2), keepdim=True).clamp(min=1e-12)


def _sqrt(x) -> Tensor:
    from vision_attn.explain.methods import METHODS

    return METHODS["relevance"].fn(x).clamp(min=0).sqrt()


def _abs_grad(x) -> Tensor:
    from vision_attn.explain.rollout import gradient_relevance

    return gradient_relevance(x.attentions, [g.abs() for g in x.attention_grads], x.grid, x.num_prefix_tokens,
                              x.token_index, merges=x.merges)


def attention_relevance(task, images: Tensor, target: Tensor, blocks: int, rules: bool = True) -> list[Tensor]:
    """Per block the relevance of its attention weights, ``A * dS/dA`` with ``S`` the target
    logits' sum: under AttnLRP's rules (:func:`vision_attn.explain.lrp.lrp_rules`), or with
    ``rules=False`` the plain gradient times the weights. ``[B, heads, T, T]`` each."""
    from vision_attn.explain.lrp import lrp_rules

    with torch.inference_mode(False), torch.enable_grad():
        x = images.detach().clone().requires_grad_(True)
        with lrp_rules(task, rules=rules, trace=True) as record:
            logits = task.head(task.encoder(x))
        score = logits.gather(1, target.to(logits.device).long().view(-1, 1)).sum()
        weights = record.probabilities[:blocks]  # a sequence-pooling head records its weights last
        grads = torch.autograd.grad(score, weights)
    return [(w * g).detach() for w, g in zip(weights, grads, strict=True)]


def _of_lrp(x) -> Tensor:
    from vision_attn.explain.rollout import gradient_relevance

    if "attention_relevance" not in x.shared:
        x.shared["attention_relevance"] = attention_relevance(x.task, x.images, x.target, len(x.attentions))
    return gradient_relevance(x.shared["attention_relevance"], x.attention_grads, x.grid, x.num_prefix_tokens,
                              x.token_index, merges=x.merges)


def variants(blocks: Sequence[int] = (2, 3, 4)) -> dict[str, object]:
    """Variant name -> map function (``MethodInputs -> [B, h, w]``)."""
    out: dict[str, object] = {f"relevance_from_block_{k}": _from_block(k) for k in blocks}
    out.update(relevance_smoothed=_smoothed, relevance_x_rollout=_times_rollout, relevance_sqrt=_sqrt,
               relevance_abs_grad=_abs_grad, relevance_of_lrp=_of_lrp)
    return out


def register_variants() -> list[str]:
    """Add :func:`variants` to the method registry; the methods measured, reference ones included."""
    from vision_attn.explain.methods import register_method

    for name, fn in variants().items():
        register_method(name, needs=("attention", "attention_grad"), description=f"benchmark variant: {name}")(fn)
    return ["relevance", *variants(), "rollout", "lrp", "random"]


def patch_ceiling(instances: str | Path, grid: tuple[int, int], data_config: dict) -> dict[str, float]:
    """``{"miou", "map_mask"}`` of the ideal patch-grid maps of a classification validation split.

    Per image of the COCO ``instances`` file, its objects' union mask (bool ``[H, W]``) is averaged
    over the model input's ``grid`` cells (the share of each cell the mask covers, the mask taken
    through the evaluation's resizing and crop: ``data_config``, the checkpoint's preprocessing), and
    that grid map is brought back to the image by
    :func:`~vision_attn.explain.localisation.grid_to_image` and scored by
    :class:`~vision_attn.explain.segmentation.SegmentationScores`, as every method's map is.
    """
    import json

    import numpy as np

    from vision_attn.data.masks import decode_segmentation
    from vision_attn.explain.localisation import grid_to_image
    from vision_attn.explain.segmentation import SegmentationScores

    coco = json.loads(Path(instances).read_text(encoding="utf-8"))
    sizes = {im["id"]: (int(im["height"]), int(im["width"])) for im in coco["images"]}
    objects: dict[object, list] = {}
    for ann in coco["annotations"]:
        if ann.get("segmentation"):
            objects.setdefault(ann["image_id"], []).append(ann["segmentation"])
    scores = SegmentationScores()
    for image_id, segmentations in objects.items():
        h, w = sizes[image_id]
        masks = [decode_segmentation(seg, h, w, f"{instances}, image {image_id}") for seg in segmentations]
        cells = _cell_shares(np.logical_or.reduce(masks), grid, data_config)
        scores.update({"ceiling": grid_to_image(cells, (h, w), data_config)}, masks)
    out = scores.compute()
    return {"miou": out["miou_ceiling"], "map_mask": out["map_mask_ceiling"]} if out else {}


def _cell_shares(mask, grid: tuple[int, int], data_config: dict):
    """``[gh, gw]``: the fraction of each grid cell's image pixels that ``mask`` covers (a cell's
    pixels: those that :func:`~vision_attn.explain.localisation.grid_to_image` in ``nearest`` mode
    maps onto it; a cell no pixel falls in: 0)."""
    import numpy as np

    from vision_attn.explain.localisation import grid_to_image

    gh, gw = grid
    numbers = np.arange(1, gh * gw + 1, dtype=np.float64).reshape(grid)  # 0: outside the model input
    cell = np.rint(grid_to_image(numbers, mask.shape, data_config, mode="nearest")).astype(np.int64).ravel()
    count = np.bincount(cell, minlength=gh * gw + 1)[1:]
    cover = np.bincount(cell, weights=mask.ravel().astype(np.float64), minlength=gh * gw + 1)[1:]
    return np.divide(cover, count, out=np.zeros(gh * gw), where=count > 0).reshape(grid)


def ceiling_of(ckpt: str | Path, data_root: str | Path | None) -> dict[str, float]:
    """:func:`patch_ceiling` of a classifier checkpoint on ``data_root``'s validation split (default:
    the checkpoint's own data: its root, or the embedded shapes data it was trained on); ``{}``
    without an instances file with masks. The grid is the input size over the encoder's patch size."""
    from vision_attn.data.synthetic import ShapesConfig, ensure_shapes_classification
    from vision_attn.tasks.base import read_task_meta

    meta, _ = read_task_meta(ckpt)
    encoder = meta["model"]["init_args"]["encoder"]["init_args"]
    data_config = meta["data_config"]
    patch = encoder.get("patch_size")
    if not isinstance(patch, int):
        return {}
    grid = (int(data_config["input_size"][1]) // patch, int(data_config["input_size"][2]) // patch)
    if data_root is None:
        data = meta.get("data", {}).get("init_args", {})
        data_root = data.get("root") or ensure_shapes_classification(ShapesConfig(**data.get("synthetic") or {}),
                                                                     data.get("cache_dir"))
    instances = Path(data_root) / "annotations" / "instances_val.json"
    return patch_ceiling(instances, grid, data_config) if instances.is_file() else {}


def rows_of(label: str, metrics: dict[str, float], methods: Sequence[str]) -> list[list]:
    """One row per method: ``label``, the method, then :data:`MEASURES` (empty where not measured)."""
    return [[label, m, *(finite(metrics.get(f"{key}_{m}"), 4) for key in MEASURES.values())] for m in methods]


def main(argv: Sequence[str] | None = None) -> list[list]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classification", default=None, help="default: the newest make demo classifier")
    p.add_argument("--demo_dir", default="runs/demo")
    p.add_argument("--heldout", nargs=2, metavar=("CKPT", "ROOT"), action="append", default=[])
    p.add_argument("--images", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="the results file to write")
    args = p.parse_args(argv)
    quiet_logging()
    demo = args.classification or newest_checkpoint(args.demo_dir, "classification")
    if demo is None:
        p.error(f"no {args.demo_dir}/*/classification/checkpoints/last.ckpt: run make demo or pass --classification")
    methods = register_variants()
    models = [("demo classifier", demo, None)]
    models += [(f"held out: {Path(ckpt).parent.parent.name}", ckpt, root) for ckpt, root in args.heldout]
    rows, ceilings, t0 = [], [], time.perf_counter()
    for label, ckpt, root in models:
        with tempfile.TemporaryDirectory() as out:
            metrics = evaluate("classification", ckpt, args.images, args.seed, Path(out), data_root=root,
                               methods=methods)
        rows += rows_of(label, metrics, methods)
        ceiling = ceiling_of(ckpt, root)
        if ceiling:
            ceilings.append(f"{label}: mIoU {ceiling['miou']:.3f}, mask mAP {ceiling['map_mask']:.3f}")
    header = ["model", "method", *MEASURES]
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join("–" if c is None else f"{c:.3f}" if isinstance(c, float) else str(c) for c in row)
              + " |")
    if args.json:
        write_results(args.json, page="explanations",
                      title="Variants of the classifier's relevance (Chefer et al. 2021) against rollout and AttnLRP",
                      command=command_line("benchmarks.relevance_variants", argv),
                      columns=["model", "method", *({"name": c, "format": ".3f"} for c in MEASURES)], rows=rows,
                      description=f"{args.images} validation images per model (seed {args.seed}), measured by "
                                  "`eval.py`'s code. mIoU and mask mAP: the map against the object's mask as Chefer "
                                  "et al. (2021) score it (thresholded at its mean; average precision). None of the "
                                  "variants ships: the shipped `relevance` is the first row of each model.",
                      notes=[*(["The ceiling at the patch grid (an ideal map: each patch's share of the object's "
                                   "mask, upsampled as every map is; all validation images): " + "; ".join(ceilings)]
                               if ceilings else []),
                             f"{time.perf_counter() - t0:.0f} s in all"])
    return rows


if __name__ == "__main__":
    main()
