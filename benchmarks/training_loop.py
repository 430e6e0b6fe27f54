"""The Lightning task's training step vs a plain PyTorch loop, and the data pipeline vs both.

Same model (the demo classifier: conv-stem ViT, 32 px, dim 96, depth 4), same batches, same
AdamW over the task's parameter groups; the Lightning side is ``ClassificationTask`` run by
``Trainer.fit`` (metrics, logging and the schedule included), the plain side is forward, loss,
backward, step. Throughput is images per second over the steps after a warm-up, medians of
interleaved repeats. The data side decodes and transforms the embedded shapes images with 2
loader workers, as the demo does.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from vision_attn import create_encoder
from vision_attn.data.loading import Batching
from vision_attn.tasks import ClassificationTask
from vision_attn.tasks.optim import param_groups

DEMO_ENCODER = dict(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0, stem="conv",
                    preprocess={"crop_pct": 1.0})


class _StepClock(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end, self.images = warmup, None, None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.images += len(batch[0])
            self.end = time.perf_counter()


def _task(classes: int) -> ClassificationTask:
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **DEMO_ENCODER))
    task._build_head(classes, [str(i) for i in range(classes)])
    return task


def _batches(steps: int, batch: int, classes: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 3, 32, 32, generator=g)
    y = torch.randint(0, classes, (steps * batch,), generator=g)
    return TensorDataset(x, y, torch.arange(len(y)))


def lightning_throughput(steps: int = 30, warmup: int = 5, batch: int = 128, classes: int = 5) -> float:
    task = _task(classes)
    clock = _StepClock(warmup)
    loader = DataLoader(_batches(steps, batch, classes), batch_size=batch)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", callbacks=[clock], default_root_dir=tmp,
                            limit_val_batches=0)
        trainer.fit(task, train_dataloaders=loader)
    return clock.images / (clock.end - clock.start)


def plain_throughput(steps: int = 30, warmup: int = 5, batch: int = 128, classes: int = 5) -> float:
    task = _task(classes).train()
    model = torch.nn.ModuleDict({"encoder": task.encoder, "head": task.head})
    opt = torch.optim.AdamW(param_groups(model, task.optim), betas=(0.9, 0.999))  # the task's groups and lrs
    start, images = None, 0
    for i, (x, y, _) in enumerate(DataLoader(_batches(steps, batch, classes), batch_size=batch)):
        if i == warmup:
            start = time.perf_counter()
        loss = F.cross_entropy(model["head"](model["encoder"](x)), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            images += len(y)
    return images / (time.perf_counter() - start)


def data_throughput(batches: int = 20, batch: int = 128, workers: int = 2) -> float:
    """Images per second the demo's training loader delivers (decode + transforms)."""
    from vision_attn.data import ImageFolderDataModule, ShapesConfig

    with tempfile.TemporaryDirectory() as tmp:
        dm = ImageFolderDataModule(synthetic=ShapesConfig(image_size=32, num_train=(batches + 2) * batch, num_val=10),
                                   cache_dir=tmp, batching=Batching(batch_size=batch, num_workers=workers))
        dm.preprocess = _task(5).data_config
        dm.setup("fit")
        loader = dm.train_dataloader()
        n, t0, t1 = 0, 0.0, 0.0
        # read to the end: an iterator left with batches in flight keeps its workers waiting to be joined
        for i, (x, *_) in enumerate(loader):
            if i == 0:  # workers started
                t0 = time.perf_counter()
            elif i <= batches:
                n, t1 = n + len(x), time.perf_counter()
        return n / (t1 - t0)


def training_pairs(repeats: int = 3, steps: int = 30, batch: int = 128) -> list[dict]:
    lightning, plain = [], []
    for _ in range(repeats):  # interleaved
        lightning.append(lightning_throughput(steps, batch=batch))
        plain.append(plain_throughput(steps, batch=batch))
    lt, pt = statistics.median(lightning), statistics.median(plain)
    data = data_throughput(batch=batch)
    return [
        {"pair": "Lightning task training step vs plain PyTorch loop", "ours": lt, "reference": pt, "ratio": lt / pt,
         "goal": ">= 0.95 of its throughput", "met": lt / pt >= 0.95,
         "detail": f"images/s, demo classifier, batch {batch}: {lt:.0f} vs {pt:.0f}"},
        {"pair": "data pipeline (2 workers) vs training consumption", "ours": data, "reference": lt, "ratio": data / lt,
         "goal": "> 1 (data never the bottleneck)", "met": data / lt > 1.0,
         "detail": f"images/s: loader {data:.0f} vs training {lt:.0f}"},
    ]


def augmentation_pair(repeats: int = 7, images: int = 300) -> dict:
    """The ``small`` preset in one step (:class:`~vision_attn.data.transforms.SmallAugment`) vs
    the torchvision chain it replaced (resize, reflect-pad crop, flip, colour jitter, to float,
    normalise), per 32 px image on one thread, interleaved medians."""
    import numpy as np
    from torchvision.transforms import v2 as T

    from benchmarks.common import interleaved_medians
    from vision_attn.data.transforms import build_train_transform

    pre = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3, "interpolation": "bicubic",
           "crop_pct": 1.0}
    pictures = np.random.default_rng(0).integers(0, 256, (images, 32, 32, 3), dtype=np.uint8)
    ours = build_train_transform(pre, "small", hflip=True)
    chain = T.Compose([T.ToImage(), T.Resize((32, 32), antialias=True),
                       T.RandomCrop((32, 32), padding=4, padding_mode="reflect"), T.RandomHorizontalFlip(),
                       T.ColorJitter(brightness=0.2, contrast=0.2), T.ToDtype(torch.float32, scale=True),
                       T.Normalize(mean=[0.5] * 3, std=[0.5] * 3)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        med = interleaved_medians({"ours": lambda: [ours(p) for p in pictures],
                                   "chain": lambda: [chain(p) for p in pictures]}, repeats=repeats, warmup=1)
    finally:
        torch.set_num_threads(threads)
    ratio = med["ours"] / med["chain"]
    return {"pair": "small augmentation in one step vs the torchvision chain", "ours": med["ours"],
            "reference": med["chain"], "ratio": ratio, "goal": "<= 0.5", "met": ratio <= 0.5,
            "detail": f"ms per 32 px image, one thread: {1e3 * med['ours'] / images:.3f} vs "
                      f"{1e3 * med['chain'] / images:.3f}"}
