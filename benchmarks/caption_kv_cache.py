"""Caption generation with and without the key/value cache, side by side.

    python -m benchmarks.caption_kv_cache [--tokens 30] [--batch 8] [--beam 1] [--hidden 256] [--layers 3]

Generates exactly ``--tokens`` tokens (``<eos>`` is disabled so every run has the same length)
for a batch of images from a ViT-Ti/16-224 encoder output, once reusing the cached keys and
values of earlier tokens and once recomputing the whole prefix at every step; prints the
medians and the speed-up ``uncached / cached`` (random weights: timing does not depend on them),
and checks that both produced the same tokens. ``--json`` writes the result.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import interleaved_medians, machine, write_result
from vision_attn.models.captioner import CaptionDecoder, DecoderConfig
from vision_attn.models.encoder import EncoderOutput

BOS, EOS = 1, 2


def run(tokens: int = 30, batch: int = 8, beam: int = 1, hidden: int = 256, layers: int = 3, heads: int = 4,
        vocab: int = 1000, grid: int = 14, in_dim: int = 192, repeats: int = 7) -> dict:
    torch.manual_seed(0)
    dec = CaptionDecoder(vocab, in_dim, config=DecoderConfig(hidden_dim=hidden, num_layers=layers, num_heads=heads,
                                                             max_length=tokens + 1, dropout=0.0)).eval()
    with torch.no_grad():
        dec.out_bias[EOS] = -1e4  # never ends: both runs generate exactly `tokens` tokens
    enc = EncoderOutput(tokens=torch.randn(batch, 1 + grid * grid, in_dim), num_prefix_tokens=1, grid=(grid, grid))

    def gen(use_cache: bool):
        return dec.generate(enc, BOS, EOS, max_length=tokens, beam_size=beam, use_cache=use_cache)

    same = torch.equal(gen(True).tokens, gen(False).tokens)
    med = interleaved_medians({"cached": lambda: gen(True), "uncached": lambda: gen(False)}, repeats, warmup=1)
    return {
        "tokens": tokens, "batch": batch, "beam": beam, "hidden": hidden, "layers": layers, "patches": grid * grid,
        "median_s": med, "speedup": med["uncached"] / med["cached"], "same_tokens": same, "machine": machine(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = run(a.tokens, a.batch, a.beam, a.hidden, a.layers, repeats=a.repeats)
    m = r["median_s"]
    print(f"{a.tokens} tokens, batch {a.batch}, beam {a.beam}, width {a.hidden}, {a.layers} layers, "
          f"{r['patches']} patches ({r['machine']['threads']} threads)")
    print(f"cached     {m['cached'] * 1e3:8.1f} ms")
    print(f"uncached   {m['uncached'] * 1e3:8.1f} ms   speed-up of the cache {r['speedup']:.2f}x   "
          f"same tokens: {r['same_tokens']}")
    write_result(a.json, r)


if __name__ == "__main__":
    main()
