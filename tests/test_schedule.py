"""Optimisation: the warmup + cosine schedule survives resumes in another configuration, and
exactly the intended parameters escape weight decay."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from vision_attn import create_encoder
from vision_attn.data.classification import ImageFolderDataModule
from vision_attn.data.loading import Batching
from vision_attn.models.captioner import DecoderConfig
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks import CaptioningTask, ClassificationTask, DetectionTask
from vision_attn.tasks.optim import (
    Optimization,
    WarmupCosineSchedule,
    cosine_factor,
    param_groups,
    warmup_cosine,
)

from .conftest import TINY_VIT

LR, MIN_RATIO = 1e-3, 0.05


# ---------------------------------------------------------------------- the schedule itself
def _schedule(total: int, warmup: int) -> WarmupCosineSchedule:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return WarmupCosineSchedule(opt, total, warmup, MIN_RATIO)


def _run(schedule: WarmupCosineSchedule, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    return out


def test_fresh_plan_is_warmup_cosine_and_state_round_trips():
    s = _schedule(40, 6)
    lrs = _run(s, 40)
    assert lrs == pytest.approx([warmup_cosine(k, 40, 6, MIN_RATIO) for k in range(40)])
    assert s.get_last_lr()[0] == pytest.approx(MIN_RATIO)
    # the plan is in the state dict: a fresh scheduler planned for another length resumes it
    half = _schedule(40, 6)
    _run(half, 17)
    other = _schedule(999, 50)
    other.load_state_dict(half.state_dict())
    assert _run(other, 23) == pytest.approx(lrs[17:])


@pytest.mark.parametrize("new_remaining", [5, 23, 60])
def test_replan_continues_from_the_current_factor_and_ends_at_min(new_remaining):
    s = _schedule(40, 6)
    before = _run(s, 17)
    current = s.factor(17)
    assert s.replan(new_remaining) == (new_remaining != 23)  # 23 steps were planned: nothing to do
    after = _run(s, new_remaining)
    assert after[0] == pytest.approx(current)  # no jump
    steps = [a - b for a, b in zip([before[-1], *after], after, strict=False)]
    # the cosine's steepest step over the remaining progress spread on new_remaining steps
    p = (17 - 6) / (40 - 6)
    bound = (1 - MIN_RATIO) * math.pi / 2 * (1 - p) / new_remaining
    assert max(steps[1:]) <= bound + 1e-9 and min(steps) >= -1e-12  # decreasing, smoothly
    assert s.get_last_lr()[0] == pytest.approx(MIN_RATIO)


def test_replan_inside_the_warmup_finishes_it_first():
    s = _schedule(40, 10)
    _run(s, 4)
    s.replan(20)
    lrs = _run(s, 20)
    assert lrs[:6] == pytest.approx([(k + 1) / 10 for k in range(4, 10)])
    assert lrs[6] == pytest.approx(1.0)
    assert s.get_last_lr()[0] == pytest.approx(MIN_RATIO)
    assert cosine_factor(0.5, MIN_RATIO) == pytest.approx((1 + MIN_RATIO) / 2)


# ---------------------------------------------------------------------- resumed Lightning runs
class _RecordLR(Callback):
    """The learning rate each optimizer step used, and the scheduler's value after the last one."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.final = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]


def _fit(root, tmp, max_epochs: int, batch_size: int = 8, accumulate: int = 1, ckpt=None, callbacks=()):
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT),
                              optim=Optimization(lr=LR, warmup_fraction=0.2, min_lr_ratio=MIN_RATIO))
    dm = ImageFolderDataModule(root=str(root), batching=Batching(batch_size=batch_size, num_workers=0))
    record = _RecordLR()
    trainer = L.Trainer(max_epochs=max_epochs, accumulate_grad_batches=accumulate, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=tmp, callbacks=[record, *callbacks])
    trainer.fit(task, datamodule=dm, ckpt_path=ckpt)
    return trainer, record


@pytest.fixture(scope="module")
def first_half(shapes_root, tmp_path_factory):
    """2 planned epochs of 7 steps (60 images, batches of 8), checkpointed after the first."""
    tmp = tmp_path_factory.mktemp("sched")
    every = ModelCheckpoint(dirpath=tmp / "ck", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    _, record = _fit(shapes_root, tmp, max_epochs=2, callbacks=[every])
    return tmp / "ck" / "epoch=0.ckpt", record.lrs


@pytest.mark.parametrize(
    ("change", "kwargs", "remaining"),
    [
        ("accumulation", {"accumulate": 2}, 4),  # ceil(7 / 2) steps in the last epoch
        ("batch size", {"batch_size": 16}, 3),  # 60 // 16
        ("max_epochs and batch size", {"max_epochs": 3, "batch_size": 16}, 2 * 3),
    ],
)
def test_resumed_schedule_continues_smoothly_and_ends_at_min(first_half, shapes_root, tmp_path, change, kwargs,
                                                             remaining):
    ckpt, full = first_half
    assert len(full) == 14
    trainer, record = _fit(shapes_root, tmp_path, ckpt=str(ckpt), **{"max_epochs": 2, **kwargs})
    lrs = [lr / LR for lr in record.lrs]
    assert len(lrs) == remaining, change
    assert lrs[0] == pytest.approx(full[7] / LR)  # the step after the checkpoint: no jump
    p = trainer.lr_scheduler_configs[0].scheduler.anchor_progress
    bound = (1 - MIN_RATIO) * math.pi / 2 * (1 - p) / remaining  # steepest cosine step on the new plan
    diffs = [a - b for a, b in zip([full[6] / LR, *lrs], lrs, strict=False)]
    assert max(diffs[1:]) <= bound + 1e-9 and min(diffs) >= -1e-12, change
    assert record.final == pytest.approx(MIN_RATIO * LR)  # ends at min_lr_ratio


def test_resume_in_the_same_configuration_is_the_uninterrupted_run(first_half, shapes_root, tmp_path):
    ckpt, full = first_half
    _, record = _fit(shapes_root, tmp_path, max_epochs=2, ckpt=str(ckpt))
    assert record.lrs == full[7:]
    assert record.final == pytest.approx(MIN_RATIO * LR)


# ---------------------------------------------------------------------- weight decay
def _encoder():
    torch.manual_seed(0)
    return create_encoder("vit_tiny_patch16_224", **TINY_VIT)


def _not_decayed(task) -> set[str]:
    names = {id(p): n for n, p in task.named_parameters()}
    groups = param_groups(task, task.optim)
    assert sum(len(g["params"]) for g in groups) == len(names)  # every parameter in one group
    for g in groups:
        assert g["weight_decay"] in (0.0, task.optim.weight_decay)
    return {names[id(p)] for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}


TASKS = {
    "classification": lambda: ClassificationTask(_encoder(), class_names=["a", "b", "c"]),
    "detection": lambda: DetectionTask(_encoder(), class_names=["a", "b"], head=DETRConfig(hidden_dim=16, num_layers=2,
                                                                                           num_heads=2, num_queries=4)),
    "detection-box_refine": lambda: DetectionTask(_encoder(), class_names=["a", "b"],
                                                  head=DETRConfig(hidden_dim=16, num_layers=2, num_heads=2,
                                                                  num_queries=4, box_refine=True)),
    "captioning": lambda: CaptioningTask(_encoder(), vocab=["<pad>", "<bos>", "<eos>", "<unk>", "a", "b"],
                                         decoder=DecoderConfig(hidden_dim=16, num_layers=1, num_heads=2, max_length=8)),
}
# matrices (ndim >= 2) that are embeddings of positions, queries, anchors or tokens
EMBEDDINGS = {
    "classification": {"encoder.model.pos_embed", "encoder.model.cls_token"},
    "detection": {"encoder.model.pos_embed", "encoder.model.cls_token", "head.query_embed.weight"},
    "detection-box_refine": {"encoder.model.pos_embed", "encoder.model.cls_token", "head.anchors"},
    "captioning": {"encoder.model.pos_embed", "encoder.model.cls_token", "head.pos"},
}


@pytest.mark.parametrize("name", list(TASKS))
def test_weight_decay_spares_biases_norms_tokens_and_every_embedding(name):
    task = TASKS[name]()
    params = dict(task.named_parameters())
    vectors = {n for n, p in params.items() if p.ndim < 2}
    norms = {f"{m}.{k}" for m, mod in task.named_modules() if isinstance(mod, (torch.nn.LayerNorm, torch.nn.GroupNorm))
             for k in ("weight", "bias")}
    assert all(n.endswith("bias") or n in norms for n in vectors), vectors - norms  # biases and norms only
    assert _not_decayed(task) == vectors | EMBEDDINGS[name]
    if name == "captioning":
        assert "head.embed.weight" not in _not_decayed(task)  # the tied output projection is decayed
