"""The CPU's fast paths, caches and other switches, each side by side with PyTorch's default.

    python -m benchmarks.cpu_paths [--steps 40] [--repeats 7] [--no-compile]
                                   [--json docs/results/performance_cpu.json]

Every row times one switch both ways in this process, the two sides alternating call by call
(A, B, A, B, ...: the load of a shared machine drifts over seconds), as medians; both sides
compute the same values up to rounding (the explicit attention path, the channels-last stem and
the key/value cache are tested for it). The rows:

- attention over short sequences (at least ``EXPLICIT_MIN_QUERIES`` queries, at most
  ``EXPLICIT_MAX_SCORES`` scores per head) runs the explicit path (matmul, softmax, matmul)
  instead of ``F.scaled_dot_product_attention``'s fused kernel: forward + backward at four
  shapes, the column ``used`` says which path the suite takes there;
- the convolutional stem runs channels-last (oneDNN's faster layout);
- both together on a training step of the captioning and the detection ``shapes.yaml`` recipes'
  architectures (random images, captions of 20 tokens, 1-3 boxes per image);
- switches the recipes make or leave off: torch's fused AdamW, the local feed-forward
  (``local_mlp``), the decoder's dropout, flushing denormals, bf16 autocast, ``torch.compile``
  of the encoder (its first, compiling step is reported in the notes);
- the decoded-image cache of the training datasets (a batch read from the embedded detection
  scenes, cache warm vs off), and the square detection transform in one call against the
  torchvision v2 pipeline it computes;
- caption generation with the key/value cache, greedy and beam 3
  (:mod:`benchmarks.caption_kv_cache`).

``--json`` writes the table as a results file of the documentation's performance page.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

import vision_attn.attention as attention
from benchmarks.caption_kv_cache import run as kv_cache
from benchmarks.common import command_line, finite, interleaved_medians, machine, quiet_logging
from benchmarks.results_json import write_results
from vision_attn import create_encoder
from vision_attn.models.captioner import CaptionDecoder, DecoderConfig
from vision_attn.models.encoder import ConvStem

CAPTIONER_ENCODER = dict(img_size=64, patch_size=8, embed_dim=128, depth=4, num_heads=4, mlp_ratio=2.0, stem="conv",
                         local_mlp=True, preprocess={"crop_pct": 1.0})
"""The encoder of ``configs/captioning/shapes.yaml`` (and, with the same sizes, of the detection one)."""
DETECTOR_HEAD = dict(num_queries=12, hidden_dim=128, num_layers=3, num_heads=4, box_refine=True, focal=True,
                     query_selection=True, look_forward_twice=True)
"""The head of ``configs/detection/shapes.yaml``."""
ATTENTION_SHAPES = (  # (label, batch, heads, queries, keys, head dim)
    ("64 x 64 tokens, batch 16, 4 heads of 32", 16, 4, 64, 64, 32),
    ("30 x 30 tokens, batch 24, 8 heads of 16", 24, 8, 30, 30, 16),
    ("256 x 256 tokens, batch 16, 4 heads of 32", 16, 4, 256, 256, 32),
    ("one query over 64 keys, batch 3, 4 heads of 32 (incremental decoding)", 3, 4, 1, 64, 32),
)
COLUMNS = ["change", "unit", {"name": "with", "format": ".3g"}, {"name": "without", "format": ".3g"},
           {"name": "with / without", "format": ".2f"}, "used"]
"""The columns of the results file (``docs/results/performance_cpu.json``)."""


@contextlib.contextmanager
def attention_path(explicit: bool) -> Iterator[None]:
    """Every attention call on the explicit path (``explicit``) or in the fused kernel."""
    saved = attention.EXPLICIT_MAX_SCORES, attention.EXPLICIT_MIN_QUERIES
    attention.EXPLICIT_MAX_SCORES, attention.EXPLICIT_MIN_QUERIES = (2**62, 1) if explicit else (0, 2**62)
    try:
        yield
    finally:
        attention.EXPLICIT_MAX_SCORES, attention.EXPLICIT_MIN_QUERIES = saved


@contextlib.contextmanager
def pytorch_defaults() -> Iterator[None]:
    """Both CPU choices off: the fused attention kernel everywhere, the stem in the input's layout."""
    forward = ConvStem.forward
    ConvStem.forward = lambda self, x: self.layers(x)
    try:
        with attention_path(False):
            yield
    finally:
        ConvStem.forward = forward


@contextlib.contextmanager
def flushed_denormals() -> Iterator[None]:
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def within(context: Callable[[], contextlib.AbstractContextManager], fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` called inside a fresh ``context()`` each time."""
    def call() -> None:
        with context():
            fn()
    return call


def _adamw(params, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=fused or None)  # None: torch's per-parameter loop on the CPU


def captioner_step(batch: int = 16, tokens: int = 20, vocab: int = 40, encoder: dict | None = None,
                   hidden: int = 128, layers: int = 3, dropout: float = 0.0) -> Callable[[], None]:
    """A training step (forward, cross-entropy, backward, fused AdamW) of the captioning
    ``shapes.yaml`` architecture on random images and captions."""
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", **(encoder or CAPTIONER_ENCODER))
    enc.keep_embedding = enc.keep_pixels = True
    ph, pw = enc.patch_size
    config = DecoderConfig(hidden_dim=hidden, num_layers=layers, num_heads=4 if hidden % 4 == 0 else 2, mlp_ratio=2.0,
                           dropout=dropout, max_length=tokens + 1, embedding_memory=True, pixel_memory=True)
    dec = CaptionDecoder(vocab, enc.embed_dim, config, pixel_dim=3 * ph * pw).train()
    enc.train()
    opt = _adamw(list(enc.parameters()) + list(dec.parameters()), fused=True)
    img = enc.data_config["input_size"][-1]
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, img, img, generator=g)
    seq = torch.randint(1, vocab, (batch, tokens), generator=g)

    def step() -> None:
        logits, _ = dec(enc(images), seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def detector(local_mlp: bool = True, encoder: dict | None = None, head: dict | None = None, classes: int = 3):
    """The detection ``shapes.yaml`` architecture (a :class:`~vision_attn.tasks.DetectionTask`)."""
    from vision_attn.models.detr import DETRConfig
    from vision_attn.tasks.detection import DetectionTask, SetLossConfig

    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", **{**(encoder or CAPTIONER_ENCODER), "local_mlp": local_mlp})
    return DetectionTask(enc, num_classes=classes, head=DETRConfig(**(head or DETECTOR_HEAD)),
                         loss=SetLossConfig(cost_class=2.0, weight_ce=2.0)).train()


def detection_batch(img: int, batch: int, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, list[dict]]:
    """Random images and 1-3 random boxes (cxcywh in [0, 1]) per image."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, img, img, generator=g)
    targets = []
    for _ in range(batch):
        n = int(torch.randint(1, 4, (1,), generator=g))
        centre = 0.25 + 0.5 * torch.rand(n, 2, generator=g)
        size = 0.1 + 0.3 * torch.rand(n, 2, generator=g)
        targets.append({"labels": torch.randint(0, classes, (n,), generator=g), "boxes": torch.cat([centre, size], 1)})
    return images, targets


def detector_step(batch: int = 8, local_mlp: bool = True, fused: bool = True, compiled: bool = False,
                  encoder: dict | None = None, head: dict | None = None) -> tuple[Callable[[], None], Callable, float]:
    """``(training step, optimizer step alone, seconds of the first step)`` of the detection
    ``shapes.yaml`` architecture (the first step compiles the encoder when ``compiled``)."""
    task = detector(local_mlp, encoder, head)
    if compiled:
        task.encoder.compile()
    opt = _adamw(list(task.parameters()), fused)
    images, targets = detection_batch(task.encoder.data_config["input_size"][-1], batch)
    started = time.perf_counter()

    def step() -> None:
        outputs = task(images, targets=targets)
        terms = task.criterion(outputs, targets, across_processes=False)
        loss = task.criterion.total(terms, len(outputs["aux_outputs"]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()  # every parameter has a gradient and an optimizer state: opt.step alone is a full step
    return step, opt.step, time.perf_counter() - started  # the first step compiles when ``compiled``


def attention_call(batch: int, heads: int, tq: int, tk: int, dim: int) -> Callable[[], None]:
    """Forward + backward of :func:`vision_attn.attention.scaled_dot_product_attention`."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=g, requires_grad=True) for n in (tq, tk, tk))

    def call() -> None:
        out, _ = attention.scaled_dot_product_attention(q, k, v)
        out.sum().backward()
    return call


def stem_step(batch: int = 16, encoder: dict | None = None) -> Callable[[], None]:
    """Forward + backward of the convolutional stem alone."""
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", **(encoder or CAPTIONER_ENCODER))
    stem = next(m for m in enc.modules() if isinstance(m, ConvStem))
    img = (encoder or CAPTIONER_ENCODER)["img_size"]
    x = torch.randn(batch, 3, img, img)

    def call() -> None:
        stem(x).sum().backward()
    return call


def loader_batch(batch: int = 8, image_size: int = 64) -> tuple[Callable[[], None], Callable[[], None], Callable]:
    """``(read with the cache warm, read with the cache off, cleanup)``: a batch of the embedded
    detection scenes' training dataset (decode + training transforms)."""
    from vision_attn.data import DetectionDataModule
    from vision_attn.data.imageio import DecodedCache
    from vision_attn.data.loading import Batching
    from vision_attn.data.synthetic import SceneSetConfig

    tmp = tempfile.TemporaryDirectory()
    dm = DetectionDataModule(synthetic=SceneSetConfig(image_size=image_size, num_train=4 * batch, num_val=2),
                             cache_dir=tmp.name, batching=Batching(batch_size=batch, num_workers=0))
    dm.preprocess = create_encoder("vit_tiny_patch16_224", **CAPTIONER_ENCODER).data_config
    dm.prepare_data()
    dm.setup("fit")
    cached, uncached = dm.dataset(dm.train_split, train=True), dm.dataset(dm.train_split, train=True)
    uncached._decoded = DecodedCache(len(uncached), max_bytes=0)
    for i in range(batch):
        cached[i]  # decoded once: later epochs read from memory

    def read(ds) -> Callable[[], None]:
        def call() -> None:
            for i in range(batch):
                ds[i]
        return call
    return read(cached), read(uncached), tmp.cleanup


def detection_transform_pair(images: int = 64, size: int = 64, source: int = 96
                             ) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(one call, torchvision's v2 pipeline)``: the square training transform of the detection
    data (flip, random resized crop, clamp and drop boxes, to float, normalise) over ``images``
    ``source``-px images with 4 boxes each, one thread's work as in a loader worker."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2 as T

    from vision_attn.data.detection import SquareDetectionTransform

    mean, std, scale = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), (0.6, 1.0)
    fast = SquareDetectionTransform((size, size), True, scale, mean=mean, std=std)
    slow = T.Compose([
        T.RandomHorizontalFlip(),
        T.RandomResizedCrop((size, size), scale=scale, ratio=(0.75, 4 / 3), antialias=True,
                            interpolation=T.InterpolationMode.BICUBIC),
        T.ClampBoundingBoxes(), T.SanitizeBoundingBoxes(min_size=1.0, labels_getter=lambda s: s[2]),
        T.ToDtype(torch.float32, scale=True), T.Normalize(mean=list(mean), std=list(std))])
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(images):
        xy = torch.rand(4, 2, generator=g) * (source - 20)
        boxes = torch.cat([xy, xy + 4 + torch.rand(4, 2, generator=g) * 16], 1)
        samples.append((tv_tensors.Image(torch.randint(0, 256, (3, source, source), dtype=torch.uint8, generator=g)),
                        tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(source, source)), torch.arange(4)))

    def over(transform) -> Callable[[], None]:
        def call() -> None:
            for image, boxes, labels in samples:
                transform(image, boxes, labels)
        return call
    return over(fast), over(slow)


def _row(change: str, unit: str, with_: float, without: float, used: str) -> dict:
    return {"change": change, "unit": unit, "with": with_, "without": without, "ratio": with_ / without, "used": used}


def _pair(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> tuple[float, float]:
    med = interleaved_medians(fns, repeats=repeats, warmup=warmup)
    a, b = fns
    return med[a], med[b]


def run(steps: int = 40, repeats: int = 7, compile_encoder: bool = True, quick: bool = False) -> dict:
    """Every row (``quick``: tiny sizes and one repeat, for the tests)."""
    t0 = time.perf_counter()
    rows: list[dict] = []
    notes: list[str] = []
    enc = dict(CAPTIONER_ENCODER, img_size=32, embed_dim=32, depth=1, num_heads=2) if quick else None
    head = dict(DETECTOR_HEAD, num_queries=4, hidden_dim=32, num_layers=1, num_heads=2) if quick else None
    small = dict(batch=2, tokens=5, vocab=12, hidden=16, layers=1, encoder=enc) if quick else {}
    det_batch = 2 if quick else 8
    warmup = 0 if quick else 3
    if quick:
        steps, repeats = 1, 1

    def pair(fns: dict[str, Callable[[], object]], calls: int) -> tuple[float, float]:
        return _pair(fns, calls, warmup)

    for label, b, h, tq, tk, d in ATTENTION_SHAPES:
        if quick:
            b, tq, tk = 2, min(tq, 4), min(tk, 4)
        call = attention_call(b, h, tq, tk, d)
        a, f = pair({"explicit": within(lambda: attention_path(True), call),
                      "fused": within(lambda: attention_path(False), call)}, 5 * repeats)
        used = "explicit" if attention.explicit_is_faster(torch.device("cpu"), tq, tk) else "fused"
        rows.append(_row(f"explicit attention path instead of the fused kernel, forward + backward: {label}",
                         "ms", 1e3 * a, 1e3 * f, used))

    stem = stem_step(2 if quick else 16, enc)
    a, f = pair({"channels_last": stem, "defaults": within(pytorch_defaults, stem)}, 3 * steps)
    rows.append(_row("channels-last convolutional stem: the stem's forward + backward, batch 16 at 64 px", "ms",
                     1e3 * a, 1e3 * f, "yes"))

    cap = captioner_step(**small)
    a, f = pair({"paths": cap, "defaults": within(pytorch_defaults, cap)}, steps)
    rows.append(_row("both CPU paths: captioner training step, batch 16 (captioning shapes.yaml)", "ms",
                     1e3 * a, 1e3 * f, "yes"))
    det, opt_step, _ = detector_step(det_batch, encoder=enc, head=head)
    a, f = pair({"paths": det, "defaults": within(pytorch_defaults, det)}, steps)
    rows.append(_row("both CPU paths: detector training step, batch 8 (detection shapes.yaml)", "ms",
                     1e3 * a, 1e3 * f, "yes"))

    det_foreach, opt_foreach, _ = detector_step(det_batch, fused=False, encoder=enc, head=head)
    a, f = pair({"fused": opt_step, "loop": opt_foreach}, 3 * steps)
    rows.append(_row("torch's fused AdamW: the detector's optimizer step alone", "ms", 1e3 * a, 1e3 * f,
                     "detection shapes.yaml"))
    a, f = pair({"fused": det, "loop": det_foreach}, steps)
    rows.append(_row("torch's fused AdamW: detector training step", "ms", 1e3 * a, 1e3 * f, "detection shapes.yaml"))

    det_plain, _, _ = detector_step(det_batch, local_mlp=False, encoder=enc, head=head)
    a, f = pair({"local": det, "plain": det_plain}, steps)
    rows.append(_row("local feed-forward (local_mlp, a depthwise 3x3 convolution per block): detector training step",
                     "ms", 1e3 * a, 1e3 * f, "shapes.yaml and detection small.yaml"))

    cap_dropout = captioner_step(dropout=0.1, **small)
    a, f = pair({"no_dropout": cap, "dropout": cap_dropout}, steps)
    rows.append(_row("decoder without dropout (0 instead of 0.1): captioner training step", "ms", 1e3 * a, 1e3 * f,
                     "captioning shapes.yaml"))

    a, f = pair({"flushed": within(flushed_denormals, cap), "plain": cap}, steps)
    rows.append(_row("flushing denormals: captioner training step", "ms", 1e3 * a, 1e3 * f, "no"))
    a, f = pair({"bf16": within(lambda: torch.autocast("cpu", dtype=torch.bfloat16), cap), "fp32": cap}, steps)
    rows.append(_row("bf16 autocast on the CPU: captioner training step", "ms", 1e3 * a, 1e3 * f, "no"))

    if compile_encoder:
        det_compiled, _, first = detector_step(det_batch, compiled=True, encoder=enc, head=head)
        a, f = pair({"compiled": det_compiled, "eager": det}, steps)
        rows.append(_row("torch.compile of the encoder: detector training step after the first", "ms",
                         1e3 * a, 1e3 * f, "no (--model.compile true)"))
        notes.append(f"torch.compile: the first detector step, which compiles the encoder (or loads it from torch's "
                     f"compile cache, when an earlier run left it there), took {first:.1f} s.")

    warm, cold, cleanup = loader_batch(det_batch)
    try:
        a, f = pair({"cached": warm, "decoded": cold}, 3 * steps)
    finally:
        cleanup()
    rows.append(_row("decoded images kept in memory: a batch of 8 embedded detection scenes read by the training "
                     "dataset (second and later epochs)", "ms", 1e3 * a, 1e3 * f, "yes (splits that fit)"))

    images = 4 if quick else 64
    one_call, pipeline = detection_transform_pair(images)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker
    try:
        a, f = pair({"one_call": one_call, "pipeline": pipeline}, steps)
    finally:
        torch.set_num_threads(threads)
    rows.append(_row("square detection transform in one call instead of torchvision's v2 pipeline: per 96 px "
                     "training image to 64 px, one thread", "ms", 1e3 * a / images, 1e3 * f / images, "yes"))

    for beam in (1, 3):
        kv = (kv_cache(tokens=6, batch=2, beam=beam, hidden=16, layers=1, heads=2, vocab=20, grid=2, in_dim=8,
                       repeats=1) if quick else kv_cache(tokens=30, batch=8, beam=beam, repeats=repeats))
        m = kv["median_s"]
        search = "greedy" if beam == 1 else f"beam {beam}"
        rows.append(_row(f"key/value cache: caption generation, {search}, {kv['tokens']} tokens, batch {kv['batch']}",
                         "ms", 1e3 * m["cached"], 1e3 * m["uncached"], "yes"))
        if not kv["same_tokens"]:
            notes.append(f"caption generation ({search}): the cached and uncached tokens differ.")
    return {"rows": rows, "notes": notes, "steps": steps, "repeats": repeats, "machine": machine(),
            "seconds": round(time.perf_counter() - t0, 1)}


def pair_row(steps: int = 60, **kwargs) -> dict:
    """:mod:`benchmarks.suite`'s row: the captioner's training step with the CPU paths over
    PyTorch's defaults (``kwargs``: :func:`captioner_step`'s sizes)."""
    cap = captioner_step(**kwargs)
    paths, defaults = _pair({"paths": cap, "defaults": within(pytorch_defaults, cap)}, steps, warmup=5)
    ratio = paths / defaults
    batch = kwargs.get("batch", 16)
    return {"pair": "captioner training step: CPU paths (explicit short attention, channels-last stem) vs defaults",
            "ours": paths, "reference": defaults, "ratio": ratio, "goal": "<= 1.00", "met": ratio <= 1.0,
            "detail": f"shapes captioner, batch {batch}: {1e3 * paths:.1f} vs {1e3 * defaults:.1f} ms"}


def write_json(path: str | Path, result: dict, command: str) -> Path:
    """:func:`run`'s ``result`` as a results file (:data:`COLUMNS`); ``command``: the command
    line that reproduces it."""
    rows = [[r["change"], r["unit"], finite(r["with"], 4), finite(r["without"], 4), finite(r["ratio"], 3), r["used"]]
            for r in result["rows"]]
    return write_results(
        path, page="performance", title="CPU paths, caches and other switches", command=command, columns=COLUMNS,
        rows=rows,
        description="Each switch timed both ways in one process, the two sides alternating call by call, as "
                    f"medians ({result['steps']} training steps a side; attention, stem, optimizer and loader rows "
                    f"more). `with` / `without`: the measure with and without the switch (below 1: the switch is "
                    f"faster); `used`: whether the shipped code or configs use it (for attention: which path runs "
                    f"at that size). {result['machine']['threads']} torch threads.",
        notes=[*result["notes"], f"The whole benchmark took {result['seconds']:.0f} s."])


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="training steps a side (medians)")
    p.add_argument("--repeats", type=int, default=7, help="repeats of the caption-generation rows")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile row (its first step compiles for about half a minute)")
    p.add_argument("--json", default=None, help="write the table here as a results file "
                                                "(docs/results/performance_cpu.json)")
    a = p.parse_args(argv)
    quiet_logging()
    res = run(a.steps, a.repeats, a.compile)
    width = max(len(r["change"]) for r in res["rows"])
    for r in res["rows"]:
        print(f"{r['change']:<{width}}  {r['with']:9.3f} {r['without']:9.3f} {r['unit']:<3} "
              f"ratio {r['ratio']:.2f}  used: {r['used']}")
    for line in res["notes"]:
        print(line)
    print(f"{res['seconds']:.0f} s, {res['machine']['threads']} threads, {res['machine']['cpu']}")
    if a.json:
        write_json(a.json, res, command_line("benchmarks.cpu_paths", argv))
    return res


if __name__ == "__main__":
    main()
