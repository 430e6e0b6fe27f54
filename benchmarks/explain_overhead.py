"""What observing attention costs: ViT forward vs forward with capture vs rollout.

    python -m benchmarks.explain_overhead [--model vit_tiny_patch16_224] [--img 224] [--batch 8]

Prints medians and the ratios ``capture / forward`` and ``rollout / forward`` (random weights;
timing does not depend on them) and writes them as JSON with ``--json``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import interleaved_medians, machine, write_result
from vision_attn import attention_rollout, capture_attention, create_encoder


def run(model: str = "vit_tiny_patch16_224", img: int = 224, batch: int = 8, repeats: int = 7, **kw) -> dict:
    torch.manual_seed(0)
    enc = create_encoder(model, img_size=img, **kw).eval()
    x = torch.randn(batch, 3, img, img)
    with torch.no_grad(), capture_attention(enc) as attn:
        out = enc(x)
    grid, prefix = out.grid, out.num_prefix_tokens

    @torch.no_grad()
    def forward():
        enc(x)

    @torch.no_grad()
    def forward_capture():
        with capture_attention(enc):
            enc(x)

    def rollout():
        attention_rollout(attn, grid, prefix)

    med = interleaved_medians({"forward": forward, "forward_capture": forward_capture, "rollout": rollout}, repeats)
    return {
        "model": model, "img": img, "batch": batch, "median_s": med,
        "capture_over_forward": med["forward_capture"] / med["forward"],
        "rollout_over_forward": med["rollout"] / med["forward"],
        "machine": machine(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--img", type=int, default=224)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = run(a.model, a.img, a.batch, a.repeats)
    m = r["median_s"]
    print(f"{a.model} {a.img}px batch {a.batch} ({r['machine']['threads']} threads)")
    print(f"forward            {m['forward'] * 1e3:8.1f} ms")
    print(f"forward + capture  {m['forward_capture'] * 1e3:8.1f} ms   ratio {r['capture_over_forward']:.2f}")
    print(f"rollout            {m['rollout'] * 1e3:8.1f} ms   ratio {r['rollout_over_forward']:.3f}")
    write_result(a.json, r)


if __name__ == "__main__":
    main()
