"""GPU section: a ViT-B/16 training step, images/s and model FLOPs utilisation (MFU).

    python -m benchmarks.gpu [--model vit_base_patch16_224] [--batch 256] [--steps 20]
                             [--json docs/results/performance_gpu.json]

One training step (forward, cross-entropy on random labels, backward, fused AdamW step) of a
randomly initialised timm model on random images, in three set-ups, each timed over
``--steps`` steps after ``--warmup`` steps (``torch.compile`` compiles during the warm-up),
with CUDA synchronisation around the timed steps:

- ``bf16 + SDPA + compile``: ``torch.autocast(bfloat16)``, timm's fused attention
  (``F.scaled_dot_product_attention``, flash kernels), ``torch.compile(model)``;
- ``bf16 + SDPA, eager``: the same without ``torch.compile``;
- ``fp32 eager``: no autocast, no compile (TF32 off, PyTorch's default), for comparison.

MFU = model FLOPs per step / step time / the device's dense peak for the step's precision
(:data:`PEAK_FLOPS`, from the vendors' data sheets, looked up by device name; a device not in
the table gets no MFU, only images/s). Model FLOPs are counted analytically
(:func:`vit_train_flops`): the matmuls of the forward (patch embedding, QKV, the two attention
products, projection, MLP, head) and twice that for the backward, less the patch embedding's
input gradient (the images need none); layer norms, softmax, GELU and the optimiser are not
counted, as is usual for MFU. The count equals ``torch.utils.flop_counter.FlopCounterMode``'s
(tested on a tiny ViT).

``--json`` writes a row per set-up as a results file of the documentation's performance page
(:mod:`benchmarks.results_json`). Without a CUDA device it says so plainly, measures nothing,
writes no file (an existing one is left as it is) and exits 0. Goal: >= 40 % MFU for the
bf16 + SDPA + compile step.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import command_line, finite, machine
from benchmarks.results_json import write_results

MFU_GOAL = 0.40
COLUMNS = ["set-up", "batch", {"name": "images/s", "format": ".0f"}, {"name": "step ms", "format": ".1f"},
           {"name": "model TFLOP/s", "format": ".1f"}, {"name": "peak TFLOP/s", "format": ".0f"},
           {"name": "MFU %", "format": ".1f"}, {"name": "peak memory GiB", "format": ".1f"}]
"""The columns of the results file (``docs/results/performance_gpu.json``)."""

PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    # (substring of torch.cuda.get_device_name, dense peak FLOP/s per precision); first match wins
    ("H100 PCIe", {"bf16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp32": 67e12}),  # SXM
    ("H200", {"bf16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "fp32": 31.2e12}),
]
"""Dense (no sparsity) peak FLOP/s of known devices: bf16 tensor cores, and plain fp32."""


def peak_flops(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of ``device_name`` at ``precision`` (``bf16`` / ``fp32``), or ``None``."""
    for key, peaks in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(precision)
    return None


def vit_shape(model: nn.Module) -> dict[str, int]:
    """The sizes of a timm ``VisionTransformer`` that its FLOPs depend on."""
    proj = model.patch_embed.proj
    blocks = list(model.blocks)
    head = model.head
    return {
        "patches": int(model.patch_embed.num_patches),
        "patch_dim": int(proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1]),
        "dim": int(model.embed_dim),
        "depth": len(blocks),
        "mlp_hidden": int(blocks[0].mlp.fc1.out_features),
        "prefix": int(model.num_prefix_tokens),
        "classes": int(head.out_features) if isinstance(head, nn.Linear) else 0,
    }


def vit_forward_flops(patches: int, patch_dim: int, dim: int, depth: int, mlp_hidden: int, prefix: int = 1,
                      classes: int = 1000) -> int:
    """Matmul FLOPs (2 per multiply-add) of one image's forward through a ViT with a class-token head.

    Per block with ``T = prefix + patches`` tokens of width ``D``: QKV ``2·T·D·3D``, scores
    ``Q Kᵀ`` and ``A V`` ``2·T²·D`` each, projection ``2·T·D²``, MLP ``2·2·T·D·H``; plus the
    patch embedding ``2·patches·patch_dim·D`` and the head ``2·D·classes``.
    """
    t = prefix + patches
    block = 2 * t * dim * 3 * dim + 2 * 2 * t * t * dim + 2 * t * dim * dim + 2 * 2 * t * dim * mlp_hidden
    return 2 * patches * patch_dim * dim + depth * block + 2 * dim * classes


def vit_train_flops(patches: int, patch_dim: int, dim: int, depth: int, mlp_hidden: int, prefix: int = 1,
                    classes: int = 1000) -> int:
    """Forward + backward matmul FLOPs of one image: 3x the forward (the backward computes the
    gradients of both operands), less the patch embedding's input gradient (images need none)."""
    fwd = vit_forward_flops(patches, patch_dim, dim, depth, mlp_hidden, prefix, classes)
    return 3 * fwd - 2 * patches * patch_dim * dim


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
                  bf16: bool) -> Callable[[], None]:
    """One optimisation step (forward, loss, backward, optimiser) as a closure."""
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_steps(step: Callable[[], None], steps: int, warmup: int) -> float:
    """Seconds per step: one CUDA-synchronised span over ``steps`` steps, after ``warmup`` steps."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


SETUPS = {  # name -> (bf16 autocast, torch.compile)
    "bf16 + SDPA + compile": (True, True),
    "bf16 + SDPA, eager": (True, False),
    "fp32 eager": (False, False),
}


def run_setup(name: str, model_name: str, batch: int, steps: int, warmup: int, device_name: str) -> dict[str, Any]:
    """One row: images/s, step time, model TFLOP/s and MFU of a set-up (:data:`SETUPS`)."""
    import timm

    bf16, compiled = SETUPS[name]
    torch.manual_seed(0)
    model = timm.create_model(model_name, pretrained=False).cuda().train()
    shape = vit_shape(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    net = torch.compile(model) if compiled else model
    images = torch.randn(batch, 3, *model.patch_embed.img_size, device="cuda")
    labels = torch.randint(0, max(shape["classes"], 1), (batch,), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    seconds = time_steps(training_step(net, optimizer, images, labels, bf16), steps, warmup)
    flops = vit_train_flops(**shape) * batch
    peak = peak_flops(device_name, "bf16" if bf16 else "fp32")
    achieved = flops / seconds
    return {"setup": name, "batch": batch, "step_s": seconds, "images_per_s": batch / seconds,
            "tflops": achieved / 1e12, "peak_tflops": peak / 1e12 if peak else None,
            "mfu": achieved / peak if peak else None, "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def run(model: str = "vit_base_patch16_224", batch: int = 256, steps: int = 20, warmup: int = 5,
        setups: tuple[str, ...] = tuple(SETUPS)) -> dict[str, Any]:
    """Every set-up's row on the first CUDA device, or ``{"gpu": None, "reason"}`` without one."""
    if not torch.cuda.is_available():
        return {"gpu": None, "reason": "no CUDA GPU found (torch.cuda.is_available() is False): the GPU "
                                       "benchmark did not run", "machine": machine()}
    device_name = torch.cuda.get_device_name(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (PyTorch's default)
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name in setups:
        try:
            rows.append(run_setup(name, model, batch, steps, warmup, device_name))
        except torch.OutOfMemoryError as err:
            rows.append({"setup": name, "batch": batch, "error": f"out of memory at batch {batch}: {err}"})
        torch.cuda.empty_cache()
    best = next((r for r in rows if r["setup"] == "bf16 + SDPA + compile" and r.get("mfu") is not None), None)
    return {"gpu": device_name, "model": model, "batch": batch, "steps": steps, "warmup": warmup, "rows": rows,
            "mfu_goal": MFU_GOAL, "met": (best["mfu"] >= MFU_GOAL) if best else None,
            "torch": torch.__version__, "machine": machine()}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"training step, {result['model']} (random weights), batch {result['batch']}, {result['gpu']}",
             "| set-up | images/s | step ms | model TFLOP/s | MFU | peak GiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['setup']} | {r['error']} | | | | |")
            continue
        mfu = (f"{100 * r['mfu']:.1f} % of {r['peak_tflops']:.0f}" if r["mfu"] is not None
               else "— (device not in the table)")
        lines.append(f"| {r['setup']} | {r['images_per_s']:.0f} | {1000 * r['step_s']:.1f} | {r['tflops']:.1f} | {mfu} "
                     f"| {r['max_memory_gib']:.1f} |")
    lines.append(f"goal: bf16 + SDPA + compile >= {100 * MFU_GOAL:.0f} % MFU: "
                 + {True: "met", False: "not met", None: "unknown (no peak for this device)"}[result["met"]])
    return "\n".join(lines)


def write_json(path: str | Path, result: dict[str, Any], command: str) -> Path:
    """A measured :func:`run` ``result`` as a results file, a row per set-up (:data:`COLUMNS`; a
    set-up that ran out of memory has empty cells and a note); ``command``: the command line that
    reproduces it.

    Raises:
        ValueError: ``result`` measured nothing (no GPU).
    """
    if result.get("gpu") is None:
        raise ValueError(f"no GPU measurement to write: {result.get('reason', 'no GPU')}")
    rows, notes = [], []
    for r in result["rows"]:
        if "error" in r:
            rows.append([r["setup"], r["batch"], None, None, None, None, None, None])
            notes.append(f"{r['setup']}: {r['error'].split(':')[0]}.")
            continue
        mfu = None if r["mfu"] is None else 100 * r["mfu"]
        rows.append([r["setup"], r["batch"], finite(r["images_per_s"], 1), finite(1000 * r["step_s"], 2),
                     finite(r["tflops"], 2), finite(r["peak_tflops"]), finite(mfu, 2),
                     finite(r["max_memory_gib"], 2)])
    met = {True: "met", False: "not met", None: "unknown (no peak FLOP/s known for this device)"}[result["met"]]
    notes.insert(0, f"Goal: bf16 + SDPA + compile ≥ {100 * MFU_GOAL:.0f} % MFU: {met}.")
    return write_results(
        path, page="performance", title=f"Training step on a GPU, {result['model']}", command=command,
        columns=COLUMNS, rows=rows,
        description=f"One training step (forward, cross-entropy, backward, fused AdamW) of {result['model']} with "
                    f"random weights on random images, batch {result['batch']}, on {result['gpu']}; seconds per "
                    f"step over {result['steps']} CUDA-synchronised steps after {result['warmup']} warm-up steps "
                    "(`torch.compile` compiles during the warm-up). Model TFLOP/s: the forward's and backward's "
                    "matmul FLOPs counted analytically; MFU: that over the device's dense peak for the step's "
                    "precision (empty for a device without a known peak); fp32 without TF32.",
        notes=notes)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--json", default=None, help="write the table here as a results file when a GPU ran it "
                                                "(make bench: docs/results/performance_gpu.json)")
    a = p.parse_args(argv)
    result = run(a.model, a.batch, a.steps, a.warmup, tuple(a.setups))
    if result["gpu"] is None:
        kept = f"; {a.json} not written" if a.json else ""
        print(f"GPU benchmark: {result['reason']}; nothing measured{kept}.")
        return result
    print(format_table(result))
    if a.json:
        write_json(a.json, result, command_line("benchmarks.gpu", argv))
    return result


if __name__ == "__main__":
    main()
