"""Streaming vs stored rollout: peak memory and time, at the demo size and at ViT-B/16 224.

    python -m benchmarks.streaming [--batch 1] [--repeats 3] [--device cpu]
                                   [--json docs/results/performance_streaming.json]

*Stored*: ``capture_attention`` keeps every block's ``[B, heads, T, T]``, then
``attention_rollout``. *Streaming*: ``streaming_rollout`` folds each block into one running
``[B, T, T]`` product during the forward. Both explain the class token's row (random weights;
memory and time do not depend on them).

**Memory.** ``tracemalloc`` only sees Python's own allocator: torch's CPU tensors never pass
through it (a 40 MB tensor shows as 80 bytes), so its peak is printed for completeness and the
tensor memory is read from torch's allocator: every allocation and free the profiler records
(``profile_memory=True``), in time order, summed; the peak of that running sum is the peak
tensor memory of the call (``torch.cuda.max_memory_allocated`` on a GPU). Reported:

- ``peak``: the whole call (forward + explanation), above what existed before it;
- ``extra``: ``peak`` minus the peak of the same forward with the fused kernel off and nothing
  kept (what any explanation needs: each block's probabilities exist once) — the memory the
  explanation itself adds;
- ``stored attention``: ``L * heads * T^2 * 4 bytes * B``, what the capture keeps.

Goal: streaming ``extra`` <= 1/L of the stored capture's attention memory, at equal
time (<= 1.05x). ``--json`` writes a row per configuration as a results file of the
documentation's performance page (:mod:`benchmarks.results_json`).
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.common import command_line, finite, interleaved_medians, machine
from benchmarks.results_json import write_results
from vision_attn import attention_rollout, capture_attention, create_encoder
from vision_attn.explain.capture import observe_attention, streaming_rollout

CONFIGS = {
    # the demo classifier (configs/classification/shapes.yaml)
    "demo": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4, "embed_dim": 96, "depth": 4, "num_heads": 3,
                                      "mlp_ratio": 2.0, "stem": "conv"}),
    "vit_b16_224": ("vit_base_patch16_224", {"img_size": 224}),
}


TIME_GOAL = 1.05
"""Streaming time over stored time, at most."""
COLUMNS = ["configuration", "L", "T", {"name": "max diff", "format": ".1e"},
           {"name": "peak MB, stored", "format": ".2f"}, {"name": "peak MB, streaming", "format": ".2f"},
           {"name": "extra MB, stored", "format": ".2f"}, {"name": "extra MB, streaming", "format": ".3f"},
           {"name": "extra / stored attention", "format": ".3f"}, {"name": "time ratio", "format": ".3f"},
           "goal", "met"]
"""The columns of the results file (``docs/results/performance_streaming.json``)."""


def peak_memory(fn: Callable[[], object], device: torch.device) -> dict[str, int]:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before: torch's tensors
    (profiler allocation events on CPU, ``max_memory_allocated`` on CUDA) and Python's heap
    (``tracemalloc``)."""
    tracemalloc.start()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            tensors = torch.cuda.max_memory_allocated() - base
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                fn()
            events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
            total = tensors = 0
            for _, nbytes in events:
                total += nbytes
                tensors = max(tensors, total)
        python = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"tensors": int(tensors), "python": int(python)}


def run_config(name: str, batch: int = 2, repeats: int = 3, device: str = "cpu") -> dict:
    model, kwargs = CONFIGS[name]
    dev = torch.device(device)
    torch.manual_seed(0)
    enc = create_encoder(model, **kwargs).eval().to(dev)
    size = kwargs["img_size"]
    x = torch.randn(batch, 3, size, size, device=dev)
    with torch.no_grad():
        out = enc(x)
    grid, p, t = out.grid, out.num_prefix_tokens, out.tokens.shape[1]

    @torch.no_grad()
    def forward_unfused() -> None:
        with observe_attention(enc, lambda _a: None):
            enc(x)

    @torch.no_grad()
    def stored() -> torch.Tensor:
        with capture_attention(enc) as attn:
            enc(x)
        return attention_rollout(attn, grid, p)

    @torch.no_grad()
    def streaming() -> torch.Tensor:
        with streaming_rollout(enc) as stream:
            enc(x)
        return stream.maps(grid, p)

    @torch.no_grad()
    def streaming_f64() -> torch.Tensor:
        with streaming_rollout(enc, dtype=torch.float64) as stream:
            enc(x)
        return stream.maps(grid, p)

    maps_stored = stored()
    max_diff = {k: float((maps_stored - fn()).abs().max()) for k, fn in
                (("streaming", streaming), ("streaming_f64", streaming_f64))}
    fns = {"forward_unfused": forward_unfused, "stored": stored, "streaming": streaming,
           "streaming_f64": streaming_f64}
    mem = {k: peak_memory(fn, dev) for k, fn in fns.items()}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fast = name == "demo"  # milliseconds per call: more repeats for a stable median
    med = interleaved_medians({k: (lambda fn=fns[k]: (fn(), sync())) for k in ("stored", "streaming", "streaming_f64")},
                              repeats=repeats * 10 if fast else repeats, warmup=3 if fast else 1)
    depth, heads = enc.depth, enc.num_heads
    stored_attention = depth * heads * t * t * 4 * batch
    base = mem["forward_unfused"]["tensors"]
    extra = {k: mem[k]["tensors"] - base for k in ("stored", "streaming", "streaming_f64")}
    return {
        "config": name, "model": model, "img": size, "batch": batch, "depth": depth, "heads": heads, "tokens": t,
        "max_abs_diff": max_diff,
        "peak_bytes": {k: v["tensors"] for k, v in mem.items()},
        "tracemalloc_peak_bytes": {k: v["python"] for k, v in mem.items()},
        "extra_bytes": extra,
        "stored_attention_bytes": stored_attention,
        "peak_ratio": mem["streaming"]["tensors"] / mem["stored"]["tensors"],
        "extra_over_stored_attention": extra["streaming"] / stored_attention,
        "goal_extra_over_stored_attention": 1 / depth,
        "median_s": med,
        "time_ratio": med["streaming"] / med["stored"],
        "met": extra["streaming"] / stored_attention <= 1 / depth and med["streaming"] / med["stored"] <= TIME_GOAL,
        "time_ratio_f64": med["streaming_f64"] / med["stored"],
    }


def run(batch: int = 1, repeats: int = 3, device: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return {"results": [run_config(name, batch, repeats, device) for name in CONFIGS], "device": device,
            "machine": machine()}


def write_json(path: str | Path, result: dict, command: str) -> Path:
    """:func:`run`'s ``result`` as a results file, a row per configuration (:data:`COLUMNS`);
    ``command``: the command line that reproduces it."""
    mb = 2.0 ** 20
    rows = []
    for c in result["results"]:
        pk, ex = c["peak_bytes"], c["extra_bytes"]
        rows.append([f"{c['config']}: {c['model']} {c['img']} px, batch {c['batch']}", c["depth"], c["tokens"],
                     finite(c["max_abs_diff"]["streaming"]), finite(pk["stored"] / mb, 3),
                     finite(pk["streaming"] / mb, 3), finite(ex["stored"] / mb, 3), finite(ex["streaming"] / mb, 4),
                     finite(c["extra_over_stored_attention"], 4), finite(c["time_ratio"], 3),
                     f"extra ≤ 1/L = {c['goal_extra_over_stored_attention']:.3f}; time ≤ {TIME_GOAL}",
                     bool(c["met"])])
    threads = result["machine"]["threads"]
    return write_results(
        path, page="performance", title="Streaming rollout against stored attention", command=command,
        columns=COLUMNS, rows=rows,
        description="The class token's rollout from every block's stored attention (`capture_attention`, then "
                    "`attention_rollout`) against `streaming_rollout`, which folds each block into one running "
                    "product during the forward; random weights. Max diff: largest absolute difference of the "
                    "two maps. Peak: tensor memory of the whole call (torch's profiler allocation events on a "
                    "CPU, `max_memory_allocated` on a GPU); extra: the peak above the same forward that keeps "
                    "nothing; stored attention: L·heads·T²·4 bytes per image. Time ratio: streaming over "
                    f"stored, medians of interleaved repeats. On {result['device']}, {threads} torch threads.")


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 keeps small ops from waiting on a busy second core")
    p.add_argument("--json", default=None, help="write the table here as a results file "
                                                "(make bench: docs/results/performance_streaming.json)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    r = run(a.batch, a.repeats, a.device)
    mb = 2.0 ** 20
    print(f"streaming vs stored rollout on {r['device']} ({r['machine']['threads']} threads), batch {a.batch}")
    for c in r["results"]:
        pk, ex = c["peak_bytes"], c["extra_bytes"]
        d = c["max_abs_diff"]
        print(f"\n{c['config']}: {c['model']} {c['img']}px, L={c['depth']} H={c['heads']} T={c['tokens']}; "
              f"max |stored - streaming| = {d['streaming']:.1e} (float64 product: {d['streaming_f64']:.1e})")
        print(f"  peak tensor memory   forward(unfused) {pk['forward_unfused'] / mb:8.2f} MB | stored "
              f"{pk['stored'] / mb:8.2f} MB | streaming {pk['streaming'] / mb:8.2f} MB | ratio {c['peak_ratio']:.3f}")
        print(f"  extra over forward   stored {ex['stored'] / mb:8.2f} MB | streaming {ex['streaming'] / mb:8.3f} MB"
              f" | float64 {ex['streaming_f64'] / mb:8.3f} MB | stored attention (L*H*T^2*4*B) "
              f"{c['stored_attention_bytes'] / mb:.2f} MB")
        print(f"  streaming extra / stored attention = {c['extra_over_stored_attention']:.3f} "
              f"(goal <= 1/L = {c['goal_extra_over_stored_attention']:.3f})")
        tm = c["tracemalloc_peak_bytes"]
        print(f"  tracemalloc (Python heap only) stored {tm['stored'] / 1024:.0f} KB | streaming "
              f"{tm['streaming'] / 1024:.0f} KB")
        m = c["median_s"]
        print(f"  time  stored {m['stored'] * 1e3:8.1f} ms | streaming {m['streaming'] * 1e3:8.1f} ms | ratio "
              f"{c['time_ratio']:.3f} (goal <= {TIME_GOAL}) | float64 product {c['time_ratio_f64']:.3f}")
    if a.json:
        write_json(a.json, r, command_line("benchmarks.streaming", argv))
    return r


if __name__ == "__main__":
    main()
