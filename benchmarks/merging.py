"""Token merging (ToMe): throughput, top-1 agreement and rollout agreement with the unmerged model.

    python -m benchmarks.merging [--model vit_small_patch16_224] [--batch 8] [--repeats 3]
                                 [--json docs/results/performance_merging.json]

A timm ViT-S/16 at 224 px with random weights (timing does not depend on them), batch 8, eval
mode, ``inference_mode``. For ``r`` in {0, 4, 8, 16} (tokens merged per block,
:func:`vision_attn.merge_tokens`):

- ``throughput``: images/s, median of interleaved repeats; ``speedup`` against the unmerged
  timm model (``r=0`` measures what the patched blocks cost when they merge nothing);
- ``top1_agreement``: share of images whose argmax class (timm's own 1000-class head) is the
  unmerged model's;
- ``rollout_spearman``: Spearman rank correlation of the class token's rollout over the
  ``14 x 14`` patch grid, merged (mapped back through the merges) vs unmerged, median over the
  images.

The images are smooth random images (a 14x14 colour noise upsampled bicubically, plus fine
noise), not photographs: with random weights the maps show how much merging disturbs the
attention flow, not what a trained model looks at. Goal: r=8 >= 1.4x throughput,
rollout rank correlation >= 0.8. ``--json`` writes a row per ``r`` as a results file of the
documentation's performance page (:mod:`benchmarks.results_json`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

from benchmarks.common import command_line, finite, interleaved_medians, machine
from benchmarks.results_json import write_results
from vision_attn import attention_rollout, capture_attention
from vision_attn.explain.sanity import spearman
from vision_attn.models.merging import merge_log, merge_state, merge_tokens

R_VALUES = (0, 4, 8, 16)
GOAL_R, GOAL_SPEEDUP, GOAL_SPEARMAN = 8, 1.4, 0.8
"""The goal: at r = 8, at least 1.4x the unmerged images/s and a rollout rank correlation of at least 0.8."""
COLUMNS = ["r", {"name": "images/s", "format": ".1f"}, {"name": "speed-up", "format": ".2f"},
           {"name": "top-1 agreement", "format": ".2f"}, {"name": "rollout Spearman, median", "format": ".3f"},
           {"name": "rollout Spearman, min", "format": ".3f"}, "tokens after the last block"]
"""The columns of the results file (``docs/results/performance_merging.json``)."""


def smooth_images(batch: int, size: int = 224, seed: int = 0, grid: int = 14) -> torch.Tensor:
    """``[B, 3, size, size]`` images with structure at the patch scale (normalised-looking values)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(batch, 3, grid, grid, generator=g)
    return F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False) + 0.1 * torch.randn(
        batch, 3, size, size, generator=g)


def rollout_maps(vit: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Class-token rollout ``[B, h, w]`` of a bare timm ViT (merged or not)."""
    with torch.no_grad(), capture_attention(vit) as attn:
        vit.forward_features(x)
    h, w = vit.patch_embed.dynamic_feat_size(x.shape[-2:])
    return attention_rollout(attn, (h, w), vit.num_prefix_tokens, merges=merge_log(vit))


def run(model: str = "vit_small_patch16_224", batch: int = 8, repeats: int = 3, r_values=R_VALUES,
        **timm_kwargs) -> dict:
    """The table's numbers (``timm_kwargs``: sizes of a smaller model, for tests)."""
    torch.manual_seed(0)
    plain = timm.create_model(model, pretrained=False, **timm_kwargs).eval()
    merged = merge_tokens(copy.deepcopy(plain), 0)
    state = merge_state(merged)
    x = smooth_images(batch, plain.patch_embed.img_size[0], grid=plain.patch_embed.grid_size[0])

    def forward(m: torch.nn.Module, r: int | None = None):
        def call() -> None:
            if r is not None:
                state.r = r
            with torch.inference_mode():
                m(x)
        return call

    fns = {"unmerged": forward(plain), **{f"r={r}": forward(merged, r) for r in r_values}}
    med = interleaved_medians(fns, repeats=repeats, warmup=1)
    with torch.inference_mode():
        logits = plain(x)
    ref_maps = rollout_maps(plain, x)
    rows = []
    for r in r_values:
        state.r = r
        with torch.inference_mode():
            top1 = float((merged(x).argmax(-1) == logits.argmax(-1)).float().mean())
        rho = spearman(rollout_maps(merged, x), ref_maps)
        rows.append({
            "r": r,
            "images_per_s": batch / med[f"r={r}"],
            "speedup": med["unmerged"] / med[f"r={r}"],
            "top1_agreement": top1,
            "rollout_spearman_median": float(statistics.median(rho.tolist())),
            "rollout_spearman_min": float(rho.min()),
            "tokens_last_block": int(state.size.shape[1]) if state.size is not None else None,
        })
    return {"model": model, "batch": batch, "repeats": repeats, "unmerged_images_per_s": batch / med["unmerged"],
            "median_s": med, "rows": rows, "machine": machine()}


def write_json(path: str | Path, result: dict, command: str) -> Path:
    """:func:`run`'s ``result`` as a results file, a row per ``r`` (:data:`COLUMNS`); ``command``:
    the command line that reproduces it."""
    rows = [[r["r"], finite(r["images_per_s"], 2), finite(r["speedup"], 3), finite(r["top1_agreement"], 3),
             finite(r["rollout_spearman_median"], 4), finite(r["rollout_spearman_min"], 4), r["tokens_last_block"]]
            for r in result["rows"]]
    notes = [f"Unmerged timm model: {result['unmerged_images_per_s']:.1f} images/s."]
    goal = next((r for r in result["rows"] if r["r"] == GOAL_R), None)
    if goal is not None:
        met = goal["speedup"] >= GOAL_SPEEDUP and goal["rollout_spearman_median"] >= GOAL_SPEARMAN
        notes.append(f"Goal at r = {GOAL_R}: speed-up ≥ {GOAL_SPEEDUP}x and rollout Spearman ≥ {GOAL_SPEARMAN}: "
                     f"{'met' if met else 'not met'} ({goal['speedup']:.2f}x, {goal['rollout_spearman_median']:.3f}).")
    return write_results(
        path, page="performance", title=f"Token merging, {result['model']}", command=command, columns=COLUMNS,
        rows=rows,
        description=f"`merge_tokens` with r tokens merged per block, {result['model']} with random weights, batch "
                    f"{result['batch']}, smooth random images, `inference_mode`. Images/s: medians of "
                    f"{result['repeats']} interleaved repeats; speed-up: against the unmerged timm model (r = 0 "
                    "measures what the patched blocks cost when they merge nothing); top-1 agreement: share of "
                    "images whose argmax class is the unmerged model's; rollout Spearman: rank correlation of the "
                    "class token's rollout, merged (mapped back through the merges) against unmerged, over the "
                    f"images. {result['machine']['threads']} torch threads.",
        notes=notes)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_small_patch16_224")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 keeps small ops from waiting on a busy second core")
    p.add_argument("--json", default=None, help="write the table here as a results file "
                                                "(make bench: docs/results/performance_merging.json)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(a.model, a.batch, a.repeats)
    print(f"token merging, {a.model} (random weights) 224px, batch {a.batch}, "
          f"{res['machine']['threads']} threads; unmerged {res['unmerged_images_per_s']:.1f} images/s")
    print(f"{'r':>3} {'images/s':>9} {'speedup':>8} {'top1 agree':>10} {'rollout rho':>11} {'(min)':>6} {'tokens':>6}")
    for row in res["rows"]:
        print(f"{row['r']:>3} {row['images_per_s']:>9.1f} {row['speedup']:>8.2f} {row['top1_agreement']:>10.2f} "
              f"{row['rollout_spearman_median']:>11.3f} {row['rollout_spearman_min']:>6.3f} "
              f"{row['tokens_last_block'] or '-':>6}")
    print(f"goals: r={GOAL_R} speedup >= {GOAL_SPEEDUP}, rollout rho >= {GOAL_SPEARMAN}")
    if a.json:
        write_json(a.json, res, command_line("benchmarks.merging", argv))
    return res


if __name__ == "__main__":
    main()
