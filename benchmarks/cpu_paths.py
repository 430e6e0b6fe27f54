"""The CPU's fast paths vs PyTorch's defaults, on a training step of the shipped captioner.

    python -m benchmarks.cpu_paths [--repeats 5] [--steps 20]

Two choices the suite makes on the CPU (both give the same values up to rounding, tested):

- attention over short sequences (at least ``EXPLICIT_MIN_QUERIES`` queries, at most
  ``EXPLICIT_MAX_SCORES`` scores per head) runs the explicit path (matmul, softmax, matmul)
  instead of ``F.scaled_dot_product_attention``'s fused kernel, in the encoder's blocks and in
  the decoder's self- and cross-attention;
- the convolutional stem runs channels-last (oneDNN's faster layout).

The step is the captioning shapes recipe's architecture (``configs/captioning/shapes.yaml``:
conv-stem ViT 64 px, patch 8, width 128, depth 4, local feed-forward; 3-layer decoder of width
128 reading the stem's embeddings and the pixels) on random images and captions of 20 tokens:
forward, cross-entropy, backward, fused AdamW. "defaults" turns both choices off. The two
sides alternate step by step (A, B, A, B, ...: this machine's load drifts over seconds, which
blocks of steps turned into ratios from 0.94 to 1.03 between runs); medians over ``steps``
steps each.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import vision_attn.attention as attention
from benchmarks.common import interleaved_medians, machine, write_result
from vision_attn import create_encoder
from vision_attn.models.captioner import CaptionDecoder, DecoderConfig
from vision_attn.models.encoder import ConvStem

CAPTIONER_ENCODER = dict(img_size=64, patch_size=8, embed_dim=128, depth=4, num_heads=4, mlp_ratio=2.0, stem="conv",
                         local_mlp=True, preprocess={"crop_pct": 1.0})


@contextlib.contextmanager
def pytorch_defaults() -> Iterator[None]:
    """Both CPU choices off: the fused attention kernel everywhere, the stem in the input's layout."""
    limit, forward = attention.EXPLICIT_MAX_SCORES, ConvStem.forward
    attention.EXPLICIT_MAX_SCORES = 0
    ConvStem.forward = lambda self, x: self.layers(x)
    try:
        yield
    finally:
        attention.EXPLICIT_MAX_SCORES, ConvStem.forward = limit, forward


def run(steps: int = 60, batch: int = 16, tokens: int = 20, vocab: int = 40,
        encoder: dict | None = None, hidden: int = 128, layers: int = 3) -> dict:
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", **(encoder or CAPTIONER_ENCODER))
    enc.keep_embedding = enc.keep_pixels = True
    ph, pw = enc.patch_size
    config = DecoderConfig(hidden_dim=hidden, num_layers=layers, num_heads=4 if hidden % 4 == 0 else 2, mlp_ratio=2.0,
                           dropout=0.0, max_length=tokens + 1, embedding_memory=True, pixel_memory=True)
    dec = CaptionDecoder(vocab, enc.embed_dim, config, pixel_dim=3 * ph * pw)
    params = list(enc.parameters()) + list(dec.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    img = enc.data_config["input_size"][-1]
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, img, img, generator=g)
    seq = torch.randint(1, vocab, (batch, tokens), generator=g)

    def train_step() -> None:
        logits, _ = dec(enc(images), seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def defaults() -> None:
        with pytorch_defaults():
            train_step()

    med = interleaved_medians({"fast_paths": train_step, "defaults": defaults}, repeats=steps, warmup=5)
    ms = {k: 1000 * v for k, v in med.items()}
    return {"ms_per_step": ms, "ratio": ms["fast_paths"] / ms["defaults"], "batch": batch, "steps": steps}


def pair_row(steps: int = 60, **kwargs) -> dict:
    """The suite's row: time per step with the CPU paths over PyTorch's defaults."""
    r = run(steps=steps, **kwargs)
    ms = r["ms_per_step"]
    return {"pair": "captioner training step: CPU paths (explicit short attention, channels-last stem) vs defaults",
            "ours": ms["fast_paths"], "reference": ms["defaults"], "ratio": r["ratio"], "goal": "<= 1.00",
            "met": r["ratio"] <= 1.0,
            "detail": f"shapes captioner, batch {r['batch']}: {ms['fast_paths']:.1f} vs {ms['defaults']:.1f} ms"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = run(a.steps)
    r["machine"] = machine()
    ms = r["ms_per_step"]
    print(f"captioner training step, batch {r['batch']}: CPU paths {ms['fast_paths']:.1f} ms, "
          f"PyTorch defaults {ms['defaults']:.1f} ms, ratio {r['ratio']:.3f} "
          f"(medians of {r['steps']} alternating steps each, {r['machine']['threads']} threads)")
    write_result(a.json, r)


if __name__ == "__main__":
    main()
