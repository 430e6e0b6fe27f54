"""How a task is optimised: one settings object shared by the three tasks, the parameter
groups (no weight decay where it does not belong), the warmup + cosine schedule that survives a
resume, and the optimiser and scheduler a config may choose (``--optimizer``,
``--lr_scheduler``, as LightningCLI spells them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Optimization", "WarmupCosineSchedule", "cosine_factor", "no_weight_decay_names", "param_groups",
           "warmup_cosine"]

log = logging.getLogger(__name__)

# Heads' position, query and anchor embeddings, by parameter or nn.Embedding name: never decayed.
NO_DECAY_EMBEDDINGS = ("pos", "pos_embed", "query_embed", "anchors")


@dataclass(frozen=True)
class Optimization:
    """The optimisation settings of a task (``--model.optim.*``; each task has its own defaults).

    Args:
        lr: peak learning rate of the heads (and of the encoder unless ``encoder_lr`` is set).
        encoder_lr: peak learning rate of the encoder (e.g. lower when fine-tuning).
        weight_decay: weight decay of the weight matrices. Not decayed
            (:func:`no_weight_decay_names`): biases and norm weights (every parameter with
            fewer than 2 dimensions); every position, query and anchor embedding and every
            token — the encoder's own ``no_weight_decay()`` set (timm: ``pos_embed``,
            ``cls_token``, ``reg_token``, ``dist_token``), any parameter named ``*token``, and
            the heads' parameters or ``nn.Embedding`` modules named ``pos``, ``pos_embed``,
            ``query_embed`` or ``anchors``. The caption decoder's word embedding is also its
            output projection and is decayed like one.
        warmup_fraction: fraction of the training steps spent in linear warmup (fixed as a
            number of optimizer steps when training starts).
        min_lr_ratio: final learning rate as a fraction of the peak. The schedule
            (:class:`WarmupCosineSchedule`) is planned when training starts and saved in
            checkpoints; a run resumed with another number of processes, batch size,
            ``accumulate_grad_batches``, ``max_epochs`` or ``max_steps`` continues the cosine
            from its current value, stretched or compressed onto the steps now remaining, and
            still ends at ``min_lr_ratio``.
    """

    lr: float = 1e-3
    encoder_lr: float | None = None
    weight_decay: float = 0.05
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.01


DEFAULT_OPTIM = Optimization()

# Format-1 checkpoints kept these as the task's own arguments (format 2 groups them in ``optim``).
V1_OPTIMIZATION_KEYS = ("lr", "encoder_lr", "weight_decay", "warmup_fraction", "min_lr_ratio")


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters of ``model`` that are not decayed (see :class:`Optimization`)."""
    declared = set()
    for prefix, module in model.named_modules():
        skip = getattr(module, "no_weight_decay", None)
        if callable(skip) and module is not model:  # timm's convention: names relative to the module
            declared |= {f"{prefix}.{n}" if prefix else n for n in skip()}
    out = set()
    for name, p in model.named_parameters():
        parts = name.split(".")
        owner = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]  # nn.Embedding's weight
        if (p.ndim < 2 or name in declared or parts[-1].endswith("token") or parts[-1] in NO_DECAY_EMBEDDINGS
                or owner in NO_DECAY_EMBEDDINGS):
            out.add(name)
    return out


def param_groups(model: nn.Module, optim: Optimization) -> list[dict[str, Any]]:
    """Parameter groups of a task (parameters named ``encoder.*`` are the encoder's): the peak
    ``lr`` and ``weight_decay`` of each group, trainable parameters only."""
    no_decay = no_weight_decay_names(model)
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_encoder = name.startswith("encoder.")
        groups.setdefault((is_encoder, name not in no_decay), []).append(p)
    out = []
    for (is_encoder, decay), params in groups.items():
        lr = optim.encoder_lr if (is_encoder and optim.encoder_lr is not None) else optim.lr
        out.append({"params": params, "lr": lr, "weight_decay": optim.weight_decay if decay else 0.0})
    return out


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate factor: linear warmup over ``warmup`` steps, then cosine to ``min_ratio``.

    ``step`` counts optimizer steps from 0; the factor reaches ``min_ratio`` at ``step = total``
    (the value the scheduler holds after the last of ``total`` steps).
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cosine_factor(progress, min_ratio)


def cosine_factor(progress: float, min_ratio: float) -> float:
    """Cosine from 1 (``progress = 0``) to ``min_ratio`` (``progress = 1``)."""
    progress = min(1.0, max(0.0, progress))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosineSchedule(torch.optim.lr_scheduler.LRScheduler):
    """Per-step warmup + cosine whose position survives a resume in another configuration.

    The schedule is a function of training *progress*, not of the trainer that happens to run
    it. At the start of training the run's total optimizer steps ``T`` and warmup steps ``W``
    are fixed (``W`` stays a number of optimizer steps for the whole run). After the warmup the
    factor is ``cosine_factor(p, min_ratio)`` with the cosine progress ``p`` going linearly from
    ``anchor_progress`` at step ``anchor_step`` to 1 at ``end_step``; initially
    ``(anchor_step, anchor_progress, end_step) = (W, 0, T)``, which is :func:`warmup_cosine`.
    All of this is in :meth:`state_dict`, so it travels in the checkpoint.

    :meth:`replan` is called when a (resumed) fit starts, with the optimizer steps that the
    current trainer will still take. If that differs from what the schedule planned (another
    number of processes, batch size, ``accumulate_grad_batches``, ``max_epochs`` or
    ``max_steps``), the rest of the cosine is stretched or compressed onto the new remaining
    steps: the factor continues from its current value, without a jump, and reaches
    ``min_ratio`` after the last step of the new plan. An unfinished warmup is finished first
    (same ``W``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_ratio: float,
                 last_epoch: int = -1) -> None:
        self.warmup_steps = max(0, int(warmup_steps))
        self.min_ratio = float(min_ratio)
        self.anchor_step = self.warmup_steps
        self.anchor_progress = 0.0
        self.end_step = max(int(total_steps), self.warmup_steps + 1)
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """Multiplier of the peak learning rates at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return cosine_factor(self._progress(step), self.min_ratio)

    def _progress(self, step: int) -> float:
        if step < self.anchor_step:
            return 0.0 if step <= self.warmup_steps else self.anchor_progress
        span = max(1, self.end_step - self.anchor_step)
        return min(1.0, self.anchor_progress + (1.0 - self.anchor_progress) * (step - self.anchor_step) / span)

    def replan(self, remaining_steps: int) -> bool:
        """Fit the rest of the schedule into ``remaining_steps`` more optimizer steps (see the
        class docstring). Returns whether the plan changed."""
        step = self.last_epoch
        end = step + max(1, int(remaining_steps))
        if end == self.end_step:
            return False
        anchor = max(step, self.warmup_steps)
        self.anchor_progress = self._progress(anchor)
        self.anchor_step = anchor
        self.end_step = max(end, anchor + 1)
        return True

    def get_lr(self) -> list[float]:
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]




def default_optimizers(model: nn.Module, optim: Optimization, total_steps: float) -> dict[str, Any]:
    """AdamW over :func:`param_groups` with a per-step :class:`WarmupCosineSchedule` planned over
    ``total_steps`` optimizer steps (Lightning's ``configure_optimizers`` return value)."""
    optimizer = torch.optim.AdamW(param_groups(model, optim), betas=(0.9, 0.999))
    total = max(1, int(total_steps)) if math.isfinite(total_steps) else 1
    warmup = int(optim.warmup_fraction * total)
    schedule = WarmupCosineSchedule(optimizer, total, warmup, optim.min_lr_ratio)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def build_optimizers(model: nn.Module, optim: Optimization, total_steps: float,
                     optimizer_init: dict[str, Any] | None = None, lr_scheduler_init: dict[str, Any] | None = None,
                     monitor: str = "val/loss") -> dict[str, Any]:
    """PLACEHOLDER (helper A implements --optimizer / --lr_scheduler)."""
    return default_optimizers(model, optim, total_steps)


def ema_callbacks(optim: Optimization) -> list:
    """PLACEHOLDER (helper A implements EMA)."""
    return []
