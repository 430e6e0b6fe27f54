"""Side-by-side pairs against the reference implementations (random weights: timing does not depend on them).

Each function measures one pair in the same process, interleaved, as medians of ``repeats``, and
returns ``{"pair", "ours", "reference", "ratio", "goal", "met", "detail"}`` where ``ratio`` is
what the goal constrains (``ours / reference`` for times unless stated).
"""

from __future__ import annotations

import gc
import time

import torch

from benchmarks.common import interleaved_medians
from vision_attn import attention_rollout, capture_attention, create_encoder
from vision_attn.attention import MultiHeadAttention
from vision_attn.explain import extract_attention


def _row(pair: str, ours: float, reference: float, ratio: float, goal: str, met: bool, detail: str = "") -> dict:
    return {"pair": pair, "ours": ours, "reference": reference, "ratio": ratio, "goal": goal, "met": bool(met),
            "detail": detail}


def encoder_pairs(model: str = "vit_tiny_patch16_224", img: int = 224, batch: int = 8, repeats: int = 7,
                  **kw) -> list[dict]:
    """Encoder vs timm's model called directly; capture vs none; capture vs timm's AttentionExtract;
    rollout vs the forward pass."""
    from timm.utils import AttentionExtract

    torch.manual_seed(0)
    enc = create_encoder(model, img_size=img, **kw).eval()
    timm_model = enc.model
    x = torch.randn(batch, 3, img, img)
    with torch.no_grad(), capture_attention(enc) as attn:
        out = enc(x)

    @torch.no_grad()
    def ours():
        enc(x)

    @torch.no_grad()
    def timm_direct():
        timm_model.forward_features(x)

    @torch.no_grad()
    def ours_capture():
        with capture_attention(enc):
            enc(x)

    # timm's extractor needs the explicit attention path, so fused attention is off for it
    for m in timm_model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    extractor = AttentionExtract(timm_model, method="fx")

    @torch.no_grad()
    def timm_extract():
        extractor(x)

    def ours_extract():  # the same work as timm's extractor: stops after the last attention
        extract_attention(enc, x)

    def rollout():
        attention_rollout(attn, out.grid, out.num_prefix_tokens)

    try:
        med_explicit = interleaved_medians({"ours_extract": ours_extract, "timm_extract": timm_extract}, repeats)
    finally:
        for m in timm_model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = True
    med = interleaved_medians({"ours": ours, "timm": timm_direct, "capture": ours_capture, "rollout": rollout}, repeats)
    where = f"{model}, {img} px, batch {batch}"
    return [
        _row("encoder forward vs timm forward_features", med["ours"], med["timm"], med["ours"] / med["timm"], "<= 1.02",
             med["ours"] / med["timm"] <= 1.02, where),
        _row("forward with capture vs without", med["capture"], med["ours"], med["capture"] / med["ours"], "<= 1.30",
             med["capture"] / med["ours"] <= 1.30, where),
        _row("extract_attention vs timm AttentionExtract (fused off)", med_explicit["ours_extract"],
             med_explicit["timm_extract"], med_explicit["ours_extract"] / med_explicit["timm_extract"], "<= 1.00",
             med_explicit["ours_extract"] / med_explicit["timm_extract"] <= 1.00,
             where + "; both stop after the last attention softmax"),
        _row("rollout vs the forward it explains", med["rollout"], med["ours"], med["rollout"] / med["ours"], "<= 0.10",
             med["rollout"] / med["ours"] <= 0.10, where),
    ]


def attention_paths(tokens: int = 197, dim: int = 192, heads: int = 3, batch: int = 8, repeats: int = 15) -> dict:
    """MultiHeadAttention: fused kernel vs explicit softmax path, self-attention."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(dim, heads).eval()
    x = torch.randn(batch, tokens, dim)

    @torch.no_grad()
    def fused():
        mha(x)

    @torch.no_grad()
    def explicit():
        mha(x, need_weights=True)

    med = interleaved_medians({"fused": fused, "explicit": explicit}, repeats)
    r = med["fused"] / med["explicit"]
    return _row(f"MultiHeadAttention fused vs explicit (T={tokens})", med["fused"], med["explicit"], r,
                "<= 1.00", r <= 1.00, f"dim {dim}, {heads} heads, batch {batch}")


def capture_memory(model: str = "vit_tiny_patch16_224", img: int = 224, batch: int = 8, **kw) -> dict:
    """Memory the captured attention holds per image vs the theoretical L·H·T²·4 bytes."""
    torch.manual_seed(0)
    enc = create_encoder(model, img_size=img, **kw).eval()
    x = torch.randn(batch, 3, img, img)
    with torch.no_grad(), capture_attention(enc) as attn:
        out = enc(x)
    held = sum(a.untyped_storage().nbytes() for a in {id(a): a for a in attn}.values()) / batch
    layers, heads, t = len(attn), attn[0].shape[1], out.tokens.shape[1]
    theory = layers * heads * t * t * 4
    del attn
    gc.collect()
    r = held / theory
    return _row("captured attention memory per image vs L·H·T²·4 bytes", held, theory, r, "<= 1.2", r <= 1.2,
                f"{layers} layers, {heads} heads, T={t}: {held / 2**20:.2f} MiB per image")


def map_backends(images: int = 500, repeats: int = 3) -> dict:
    """COCO mAP of the same detections: faster_coco_eval vs pycocotools backend (torchmetrics)."""
    from torchmetrics.detection import MeanAveragePrecision

    g = torch.Generator().manual_seed(0)
    preds, targets = [], []
    for _ in range(images):
        n = int(torch.randint(1, 6, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * 400
        gt = torch.cat([xy, xy + 20 + torch.rand(n, 2, generator=g) * 80], 1)
        labels = torch.randint(0, 5, (n,), generator=g)
        det = torch.cat([gt + torch.randn(n, 4, generator=g) * 4, torch.rand(20, 2, generator=g).repeat(1, 2) * 400
                         + torch.tensor([0.0, 0.0, 30.0, 30.0])])
        preds.append({"boxes": det, "scores": torch.rand(len(det), generator=g),
                      "labels": torch.cat([labels, torch.randint(0, 5, (20,), generator=g)])})
        targets.append({"boxes": gt, "labels": labels})

    def run(backend: str):
        def fn():
            m = MeanAveragePrecision(backend=backend, iou_type="bbox")
            m.update(preds, targets)
            return float(m.compute()["map"])
        return fn

    same = abs(run("faster_coco_eval")() - run("pycocotools")()) < 1e-6
    med = interleaved_medians({"fast": run("faster_coco_eval"), "ref": run("pycocotools")}, repeats, warmup=0)
    speed = med["ref"] / med["fast"]
    return _row(f"mAP of {images} images: faster_coco_eval vs pycocotools", med["fast"], med["ref"], speed,
                ">= 2.5x faster", speed >= 2.5, f"same map: {same}; ratio = pycocotools / faster_coco_eval")


def timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
