"""How fine the decoder heads' AttnLRP maps should be: cells per patch side and the smoothing.

    python -m benchmarks.lrp_cells CKPT [--data ROOT] [--images 100] [--cells 1 2 4 8] [--own_query]
        [--score_threshold 0.3] [--steps 16] [--json docs/results/explanations_lrp_cells.json]

A detection or captioning checkpoint is evaluated by ``eval.py``'s own code with the ``lrp``
method only, once per setting: each patch split into ``k`` x ``k`` cells
(:data:`vision_attn.explain.lrp_decoder.CELLS`; ``1``: one value per patch), the cells smoothed by
half a cell or not (:func:`~vision_attn.explain.lrp_decoder.smooth_cells`); with ``--own_query``
each smoothed setting also with :data:`~vision_attn.explain.lrp_decoder.OWN_QUERY` (the other
queries held constant in the decoder's self-attention). The rows are the
map's pointing, energy, mask mIoU and deletion / insertion AUCs (the curves remove whole patches
whatever the map's resolution, so the AUCs compare the orders the maps give the patches). The
shipped setting is 4 cells, smoothed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import command_line, finite, quiet_logging
from benchmarks.results_json import write_results

COLUMNS = ["cells per patch side", "smoothed", "own query only", {"name": "pointing", "format": ".3f"},
           {"name": "energy", "format": ".3f"}, {"name": "mIoU", "format": ".3f"},
           {"name": "deletion AUC", "format": ".3f"}, {"name": "insertion AUC", "format": ".3f"}, "seconds"]
MEASURES = ("pointing", "energy", "miou", "deletion_auc", "insertion_auc")


def measure(ckpt: str | Path, cells: int, smoothed: bool, images: int, out_dir: Path,
            data_root: str | Path | None = None, score_threshold: float | None = None,
            own_query: bool = False, steps: int | None = None) -> dict[str, float]:
    """The ``lrp`` numbers of one setting (``eval_main`` with the cells, smoothing and
    :data:`~vision_attn.explain.lrp_decoder.OWN_QUERY` patched in; ``steps``: the curves' points
    after the first, default eval's)."""
    from vision_attn.commands.evaluate import eval_main
    from vision_attn.explain import lrp_decoder

    saved = lrp_decoder.CELLS, lrp_decoder._SMOOTH, lrp_decoder.OWN_QUERY
    lrp_decoder.CELLS, lrp_decoder._SMOOTH = cells, (saved[1] if smoothed else 0.0)
    lrp_decoder.OWN_QUERY = own_query
    try:
        data = [] if data_root is None else ["--data.root", str(data_root)]
        if score_threshold is not None:  # detection: the detections explained
            data += ["--explain.score_threshold", str(score_threshold)]
        if steps is not None:
            data += ["--explain.steps", str(steps)]
        metrics = eval_main(["--ckpt_path", str(ckpt), "--output_dir", str(out_dir), *data,
                             "--explain.methods", "[lrp]", "--explain.faithfulness_images", str(images),
                             "--explain.seed", "0", "--seed_everything", "0", "--explain.num_overlays", "0",
                             "--explain.report", "false", "--explain.mistakes", "0",
                             "--trainer.enable_progress_bar", "false"])
    finally:
        lrp_decoder.CELLS, lrp_decoder._SMOOTH, lrp_decoder.OWN_QUERY = saved
    return {m: metrics.get(f"{m}_lrp") for m in MEASURES}


def main(argv: Sequence[str] | None = None) -> list[list]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="a detection or captioning checkpoint")
    p.add_argument("--data", default=None, help="evaluate on this root's validation split (default: the checkpoint's)")
    p.add_argument("--images", type=int, default=100, help="explained images per setting")
    p.add_argument("--cells", type=int, nargs="+", default=[1, 2, 4, 8], help="cells per patch side to measure")
    p.add_argument("--score_threshold", type=float, default=None,
                   help="detection: explain detections scoring at least this (default: eval's 0.3)")
    p.add_argument("--own_query", action="store_true",
                   help="detection: also each setting with relevance through the explained query's own "
                        "self-attention keys and values only (lrp_decoder.OWN_QUERY)")
    p.add_argument("--steps", type=int, default=None,
                   help="points of the deletion / insertion curves after the first (default: eval.py's 16)")
    p.add_argument("--json", default=None, help="write the rows here as a results file")
    a = p.parse_args(argv)
    quiet_logging()
    rows = []
    with tempfile.TemporaryDirectory(prefix="lrp-cells-") as tmp:
        for cells in a.cells:
            for smoothed, own in [(False, False), (True, False)] + ([(True, True)] if a.own_query else []):
                start = time.perf_counter()
                got = measure(a.ckpt, cells, smoothed, a.images, Path(tmp) / f"{cells}-{int(smoothed)}-{int(own)}",
                              a.data, a.score_threshold, own, a.steps)
                rows.append([cells, smoothed, own, *(finite(got[m]) for m in MEASURES),
                             round(time.perf_counter() - start, 1)])
                print(" | ".join(str(v) for v in rows[-1]), flush=True)
    if a.json:
        write_results(a.json, page="explanations", title="Decoder AttnLRP maps: cells per patch and smoothing",
                      command=command_line("benchmarks.lrp_cells", argv), columns=COLUMNS, rows=rows,
                      description=f"The `lrp` map of `{a.ckpt}` on {a.images} validation images per setting: "
                                  "each patch split into k x k cells (1: a value per patch), smoothed by half a "
                                  "cell or not. Pointing, energy and mIoU against the objects' boxes and masks; "
                                  "the deletion and insertion curves remove whole patches. Own query only: the "
                                  "detection's relevance passes through its own query's self-attention keys and "
                                  "values only. Shipped: 4, smoothed, all queries.")
    return rows


if __name__ == "__main__":
    main()
