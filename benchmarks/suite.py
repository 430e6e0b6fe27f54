"""``make bench``: every side-by-side pair, one table of ratios.

    python -m benchmarks.suite [--repeats 7] [--json docs/results/performance_suite.json]

Each pair runs in this process, interleaved (A, B, A, B, ...), as medians of several repeats;
the table says for each the measured ratio, the goal and whether it is met. A few minutes on
2 CPU cores. ``--json`` writes the table as a results file of the documentation's performance
page (:mod:`benchmarks.results_json`: columns pair, ratio, goal, met, detail). Nothing here is a
test: the tests only check that each benchmark runs on tiny sizes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.caption_kv_cache import run as kv_cache
from benchmarks.common import command_line, finite, machine
from benchmarks.cpu_paths import pair_row as cpu_paths_row
from benchmarks.reference_pairs import attention_paths, capture_memory, encoder_pairs, map_backends
from benchmarks.results_json import write_results
from benchmarks.training_loop import augmentation_pair, training_pairs

COLUMNS = ["pair", {"name": "ratio", "format": ".3f"}, "goal", "met", "detail"]
"""The columns of the results file (those of ``docs/results/performance_suite.json``)."""


def run_all(repeats: int = 7, quick: bool = False) -> dict:
    """All rows; ``quick`` shrinks every size (for the tests)."""
    rows: list[dict] = []
    t0 = time.perf_counter()
    if quick:
        tiny = dict(patch_size=8, depth=2, embed_dim=32, num_heads=2)
        rows += encoder_pairs(img=32, batch=2, repeats=1, **tiny)
        rows.append(attention_paths(tokens=17, dim=16, heads=2, batch=2, repeats=1))
        rows.append(capture_memory(img=32, batch=2, **tiny))
        kv = kv_cache(tokens=6, batch=2, beam=3, hidden=16, layers=1, heads=2, vocab=20, grid=2, in_dim=8, repeats=1)
        rows.append(map_backends(images=10, repeats=1))
        rows += training_pairs(repeats=1, steps=7, batch=8)
        rows.append(augmentation_pair(repeats=1, images=4))
        rows.append(cpu_paths_row(steps=1, batch=2, tokens=5, vocab=12, hidden=16, layers=1,
                                  encoder=dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                               stem="conv", local_mlp=True)))
    else:
        rows += encoder_pairs(repeats=repeats)
        rows.append(attention_paths(repeats=2 * repeats))
        rows.append(capture_memory())
        kv = kv_cache(tokens=30, batch=8, beam=3, repeats=repeats)
        rows.append(map_backends(images=500, repeats=3))
        rows += training_pairs(repeats=5, steps=40)
        rows.append(augmentation_pair(repeats=repeats))
        rows.append(cpu_paths_row(steps=60))
    rows.insert(5, {"pair": "caption generation, KV cache vs recomputing the prefix (30 tokens, beam 3)",
                    "ours": kv["median_s"]["cached"], "reference": kv["median_s"]["uncached"], "ratio": kv["speedup"],
                    "goal": ">= 3x faster", "met": kv["speedup"] >= 3.0 and kv["same_tokens"],
                    "detail": f"batch {kv['batch']}, width {kv['hidden']}, {kv['patches']} patches; "
                              f"same tokens: {kv['same_tokens']}"})
    return {"rows": rows, "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
            "repeats": 1 if quick else repeats}


def format_table(result: dict) -> str:
    lines = ["| pair | ratio | goal | met | detail |", "| --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        met = "yes" if r["met"] else "no"
        lines.append(f"| {r['pair']} | {r['ratio']:.3f} | {r['goal']} | {met} | {r['detail']} |")
    return "\n".join(lines)


def write_json(path: str | Path, result: dict, command: str) -> Path:
    """The table of :func:`run_all`'s ``result`` as a results file (:data:`COLUMNS`); ``command``:
    the command line that reproduces it."""
    rows = [[r["pair"], finite(r["ratio"]), r["goal"], bool(r["met"]), r["detail"]] for r in result["rows"]]
    missed = sum(1 for row in rows if not row[3])
    return write_results(
        path, page="performance", title="make bench: each pair measured side by side", command=command,
        columns=COLUMNS, rows=rows,
        description="Every pair in one process, interleaved (A, B, A, B, ...), medians of repeats "
                    f"({result['repeats']} for most pairs); random weights (timing does not depend on them). "
                    f"{result['seconds']:.0f} s in all, {result['machine']['threads']} torch threads.",
        notes=[f"{len(rows) - missed} of {len(rows)} goals met."])


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write the table here as a results file "
                                                "(make bench: docs/results/performance_suite.json)")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    result = run_all(a.repeats)
    print(format_table(result))
    m = result["machine"]
    print(f"\n{m['cpu']}, {m['threads']} threads, torch {m['torch']}, CUDA: {m['cuda']}; {result['seconds']} s")
    if a.json:
        write_json(a.json, result, command_line("benchmarks.suite", argv))
    return result


if __name__ == "__main__":
    main()
