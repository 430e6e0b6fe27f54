"""How a task is optimised: one settings object shared by the three tasks, the parameter
groups (no weight decay where it does not belong, layer-wise learning-rate decay for
fine-tuning), the warmup + cosine schedule that survives a resume, the optimiser and scheduler a
config may choose (``--optimizer``, ``--lr_scheduler``, as LightningCLI spells them) and the
exponential moving average of the weights.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from vision_attn.errors import ConfigError

__all__ = ["EMAWeights", "Optimization", "WarmupCosineSchedule", "build_optimizers", "classifier_names",
           "cosine_factor", "default_optimizers", "ema_callbacks", "encoder_layer_ids", "no_weight_decay_names",
           "param_groups", "warmup_cosine"]

log = logging.getLogger(__name__)

# Heads' position, query and anchor embeddings, by parameter or nn.Embedding name: never decayed.
NO_DECAY_EMBEDDINGS = ("pos", "pos_embed", "query_embed", "anchors")


@dataclass(frozen=True)
class Optimization:
    """The optimisation settings of a task (``--model.optim.*``; each task has its own defaults).

    The optimiser is AdamW (betas 0.9, 0.999) with a per-step warmup + cosine schedule unless
    the command line chooses others (``--optimizer``, ``--lr_scheduler``; see
    :func:`build_optimizers`). Whatever the optimiser, each parameter group's learning rate and
    weight decay come from here (``--optimizer.lr`` and ``--optimizer.weight_decay`` are not
    used).

    Args:
        lr: peak learning rate of the heads (and of the encoder unless ``encoder_lr`` is set).
            With ``head='timm'`` the timm model's classifier is a head, although it lives in
            the encoder (:func:`param_groups`).
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
        layer_decay: layer-wise learning-rate decay of the encoder for fine-tuning (BEiT, MAE;
            ``None`` = off, typical 0.65-0.75). With ``L`` transformer blocks, encoder
            parameters get their learning rate (``encoder_lr``, else ``lr``) times
            ``layer_decay ** (L + 1 - layer_id)``, where ``layer_id`` is 0 for the patch
            embedding, the position embedding and the class / register tokens, ``i + 1`` for
            block ``i`` and ``L + 1`` (factor 1) for the final norm; the heads are not scaled.
            (timm's ``train.py --layer-decay`` puts the final norm with the last block: its
            factors are these divided by ``layer_decay``.)
        ema_decay: keep an exponential moving average of all the weights, updated after each
            optimizer step: ``avg = ema_decay * avg + (1 - ema_decay) * weights`` (``None`` =
            off, typical 0.999-0.9999; Lightning's ``WeightAveraging``). Validation during
            training, the checkpoints' ``state_dict`` (hence ``eval.py``, ``predict`` and
            ``export``) and the model after ``fit`` use the averaged weights; checkpoints also
            keep the raw weights (``current_model_state``) so that a resumed run continues
            both.
        ema_start_step: optimizer steps before the averaging starts; until then the average is
            the weights themselves.
        fused: use torch's fused AdamW kernel (one kernel over all parameters, CPU or GPU)
            instead of its per-parameter loop. The same update up to rounding; several times faster
            on the CPU for the small detector of ``configs/detection/shapes.yaml``
            (``python -m benchmarks.cpu_paths``, docs/results/performance.md).
            Only for the default AdamW (a ``--optimizer`` class takes its own ``fused`` argument,
            if any).
    """

    lr: float = 1e-3
    encoder_lr: float | None = None
    weight_decay: float = 0.05
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.01
    layer_decay: float | None = None
    ema_decay: float | None = None
    ema_start_step: int = 0
    fused: bool = False

    def __post_init__(self) -> None:
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ConfigError(f"optim.layer_decay must be in (0, 1] (or null for none), not {self.layer_decay}")
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"optim.ema_decay must be in [0, 1) (or null for none), not {self.ema_decay}")
        if self.ema_start_step < 0:
            raise ConfigError(f"optim.ema_start_step must be >= 0, not {self.ema_start_step}")


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


# timm ViTs' embedding parameters (layer 0 of the layer-wise decay) when the model has no group_matcher.
_STEM = r"^(cls_token|reg_token|dist_token|pos_embed|patch_embed|norm_pre)"
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def encoder_layer_ids(vit: nn.Module) -> tuple[dict[str, int], int]:
    """``({parameter name: layer id}, number of blocks L)`` of a timm ViT, for
    :attr:`Optimization.layer_decay`: 0 for the embeddings (timm's ``group_matcher()["stem"]``:
    patch and position embedding, class and register tokens), ``i + 1`` for ``blocks.i.*``,
    ``L + 1`` for everything after the blocks (the final norm).

    Raises:
        ConfigError: when the model has no ``blocks`` (not a ViT-like timm model).
    """
    blocks = getattr(vit, "blocks", None)
    if not isinstance(blocks, nn.Sequential | nn.ModuleList) or len(blocks) == 0:
        raise ConfigError(
            f"optim.layer_decay needs a timm ViT with transformer blocks ('blocks'); {type(vit).__name__} has "
            "none. Set --model.optim.layer_decay null for this encoder."
        )
    matcher = vit.group_matcher(coarse=False) if callable(getattr(vit, "group_matcher", None)) else {}
    stem = matcher.get("stem") if isinstance(matcher.get("stem"), str) else _STEM
    num_layers = len(blocks)
    ids = {}
    for name, _ in vit.named_parameters():
        block = _BLOCK.match(name)
        if block:
            ids[name] = int(block.group(1)) + 1
        else:
            ids[name] = 0 if re.match(stem, name) else num_layers + 1
    return ids, num_layers


def classifier_names(model: nn.Module) -> set[str]:
    """Names of the parameters of the timm classifier inside a task's encoder: the modules its
    ``classifier_keys()`` names (``head``; ``head``, ``head_dist`` for a distilled DeiT) under
    ``encoder.model``. Only the classifier: the pooled features' ``fc_norm`` stays the encoder's."""
    encoder = getattr(model, "encoder", None)
    keys = getattr(encoder, "classifier_keys", None)
    vit = getattr(encoder, "model", None)
    if not callable(keys) or not isinstance(getattr(vit, "pretrained_cfg", None), dict):  # not a timm model
        return set()
    prefixes = tuple(f"encoder.model.{key}." for key in keys())
    return {name for name, _ in model.named_parameters() if name.startswith(prefixes)}


def param_groups(model: nn.Module, optim: Optimization) -> list[dict[str, Any]]:
    """Parameter groups of a task: the peak ``lr`` and ``weight_decay`` of each group, trainable
    parameters only (see :class:`Optimization`).

    Parameters named ``encoder.*`` are the encoder's (learning rate ``encoder_lr`` when set),
    except the timm model's own classifier (``encoder.model.head.*``, and ``head_dist.*`` of a
    distilled DeiT: :func:`classifier_names`), a head (``head='timm'``) that learns at ``lr``.
    With ``optim.layer_decay`` the encoder's parameters are also split by layer (the timm model
    ``model.encoder.model``; :func:`encoder_layer_ids`) and their learning rate scaled by
    ``layer_decay ** (L + 1 - layer_id)``; the heads keep theirs.
    """
    no_decay = no_weight_decay_names(model)
    classifier = classifier_names(model)
    layer_ids: dict[str, int] = {}
    top = 0
    if optim.layer_decay is not None:
        vit = getattr(getattr(model, "encoder", None), "model", None)
        if not isinstance(vit, nn.Module):
            raise ConfigError(
                f"optim.layer_decay needs a task whose encoder wraps a timm ViT (task.encoder.model); "
                f"{type(model).__name__} has none"
            )
        ids, num_layers = encoder_layer_ids(vit)
        layer_ids = {f"encoder.model.{k}": v for k, v in ids.items()}
        top = num_layers + 1
    groups: dict[tuple[bool, bool, int], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_encoder = name.startswith("encoder.") and name not in classifier
        layer = layer_ids.get(name, top) if is_encoder else top  # top: factor 1 (or no layer decay)
        groups.setdefault((is_encoder, name not in no_decay, layer), []).append(p)
    out = []
    for (is_encoder, decay, layer), params in groups.items():
        lr = optim.encoder_lr if (is_encoder and optim.encoder_lr is not None) else optim.lr
        if optim.layer_decay is not None:
            lr = lr * optim.layer_decay ** (top - layer)
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




def _warmup_cosine_config(optimizer: torch.optim.Optimizer, optim: Optimization, total_steps: float) -> dict:
    total = max(1, int(total_steps)) if math.isfinite(total_steps) else 1
    warmup = int(optim.warmup_fraction * total)
    schedule = WarmupCosineSchedule(optimizer, total, warmup, optim.min_lr_ratio)
    return {"scheduler": schedule, "interval": "step"}


def _adamw(groups: list[dict[str, Any]], optim: Optimization) -> torch.optim.AdamW:
    """The default optimiser: AdamW (betas 0.9, 0.999), fused when ``optim.fused``."""
    return torch.optim.AdamW(groups, betas=(0.9, 0.999), fused=optim.fused or None)  # None: torch's own choice


def default_optimizers(model: nn.Module, optim: Optimization, total_steps: float) -> dict[str, Any]:
    """AdamW over :func:`param_groups` with a per-step :class:`WarmupCosineSchedule` planned over
    ``total_steps`` optimizer steps (Lightning's ``configure_optimizers`` return value)."""
    optimizer = _adamw(param_groups(model, optim), optim)
    return {"optimizer": optimizer, "lr_scheduler": _warmup_cosine_config(optimizer, optim, total_steps)}


def _class_and_args(spec: dict[str, Any], what: str) -> tuple[type, dict[str, Any]]:
    """The class and ``init_args`` of a ``{class_path, init_args}`` mapping (its class path was
    checked by the command line's import policy)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str) or "." not in spec["class_path"]:
        raise ConfigError(f"{what} must be a {{class_path, init_args}} mapping, not {spec!r}")
    args = spec.get("init_args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{what}.init_args must be a mapping, not {args!r}")
    module, _, name = spec["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{what}: class {spec['class_path']!r} does not exist ({err})") from err
    return cls, dict(args)


def build_optimizers(model: nn.Module, optim: Optimization, total_steps: float,
                     optimizer_init: dict[str, Any] | None = None, lr_scheduler_init: dict[str, Any] | None = None,
                     monitor: str = "val/loss", monitor_mode: str | None = None) -> dict[str, Any]:
    """The optimiser and schedule of a task (Lightning's ``configure_optimizers`` return value).

    Without ``optimizer_init`` and ``lr_scheduler_init``: :func:`default_optimizers` (AdamW and
    the per-step warmup + cosine of ``optim``).

    Args:
        model: the task; its parameter groups come from :func:`param_groups`.
        optim: learning rates, weight decay, layer decay and schedule.
        total_steps: optimizer steps of the run (``trainer.estimated_stepping_batches``).
        optimizer_init: ``{"class_path": "torch.optim.SGD", "init_args": {...}}`` from
            ``--optimizer`` (already checked against the import policy): that class over
            :func:`param_groups`. Each group's ``lr`` and ``weight_decay`` come from ``optim``
            (``--model.optim.*``) and override ``--optimizer.lr`` / ``--optimizer.weight_decay``
            (a warning says so when they differ); the other arguments (momentum, betas, ...)
            are used as given.
        lr_scheduler_init: the same from ``--lr_scheduler``: that scheduler over the optimizer,
            stepped once per epoch (LightningCLI's convention); a ``ReduceLROnPlateau`` watches
            ``monitor`` (or its ``init_args.monitor``). ``None``: the per-step warmup + cosine
            of ``optim``, whatever the optimizer.
        monitor: the metric a ``ReduceLROnPlateau`` watches (the task's checkpoint metric).
        monitor_mode: ``"min"`` or ``"max"`` for ``monitor``: the ``mode`` of a
            ``ReduceLROnPlateau`` that watches ``monitor``.
    """
    if optimizer_init is None and lr_scheduler_init is None:
        return default_optimizers(model, optim, total_steps)
    groups = param_groups(model, optim)
    if optimizer_init is None:
        optimizer: torch.optim.Optimizer = _adamw(groups, optim)
    else:
        cls, args = _class_and_args(optimizer_init, "--optimizer")
        defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
        for key, ours in (("lr", optim.lr), ("weight_decay", optim.weight_decay)):
            # a value that is the class's own default was filled in by the parser, not asked for
            if key in args and args[key] != ours and args[key] != defaults.get(key, inspect.Parameter.empty):
                log.warning("--optimizer.%s=%s is not used: each parameter group's %s comes from "
                            "--model.optim (%s=%s)", key, args[key], key, key, ours)
        if "lr" in defaults:  # the groups' own lr wins anyway; some optimizers have no default
            args["lr"] = optim.lr
        optimizer = cls(groups, **args)
    if lr_scheduler_init is None:
        return {"optimizer": optimizer, "lr_scheduler": _warmup_cosine_config(optimizer, optim, total_steps)}
    cls, args = _class_and_args(lr_scheduler_init, "--lr_scheduler")
    plateau = isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if plateau:
        takes_monitor = "monitor" in inspect.signature(cls).parameters  # LightningCLI's subclass does
        watched = args.get("monitor", monitor) if takes_monitor else args.pop("monitor", monitor)
        if takes_monitor:
            args["monitor"] = watched
        if watched == monitor and monitor_mode is not None:  # the task knows its metric's direction
            if args.get("mode", monitor_mode) not in (monitor_mode, "min"):  # "min": the parser's default
                log.warning("--lr_scheduler.mode=%s is not used: %s is better when %s",
                            args["mode"], monitor, "larger" if monitor_mode == "max" else "smaller")
            args["mode"] = monitor_mode
    scheduler = cls(optimizer, **args)
    config: dict[str, Any] = {"scheduler": scheduler, "interval": "epoch"}
    if plateau:
        config["monitor"] = watched
    return {"optimizer": optimizer, "lr_scheduler": config}


def _ema_multi_avg_fn(decay: float):
    """EMA of floating-point tensors (torch's :func:`get_ema_multi_avg_fn`); other tensors (integer
    buffers such as counters) follow the weights instead of being averaged and truncated."""
    ema = get_ema_multi_avg_fn(decay)

    @torch.no_grad()
    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        if averaged and not (averaged[0].is_floating_point() or averaged[0].is_complex()):
            torch._foreach_copy_(averaged, current)
        else:
            ema(averaged, current, num_averaged)

    return update


class EMAWeights(WeightAveraging):
    """Exponential moving average of a task's weights (:attr:`Optimization.ema_decay`).

    Lightning's :class:`~lightning.pytorch.callbacks.WeightAveraging` with an EMA update after
    every optimizer step, so: validation during ``fit`` runs on the averaged weights, every
    checkpoint's ``state_dict`` holds them (the raw weights go to ``current_model_state`` and
    the average's step count to ``averaging_state``, all tensors, so ``weights_only`` loading
    and :func:`vision_attn.load_task` work), a run resumed from such a checkpoint continues both,
    and after ``fit`` the task holds the averaged weights.

    Differences from ``WeightAveraging``: the average is created when ``fit`` starts (after
    the task has built its heads from the data and moved to its device; Lightning's creates it
    in ``setup``, before the task's own ``setup`` builds the heads, and on the CPU); before
    ``start_step`` optimizer steps it is the weights themselves; outside ``fit`` (``validate``
    or ``test`` of a checkpoint, whose ``state_dict`` is already averaged) it does nothing.
    Sharded strategies (FSDP, DeepSpeed, model parallel) are refused when ``fit`` starts.

    Args:
        decay: ``avg = decay * avg + (1 - decay) * weights`` after each optimizer step.
        start_step: optimizer steps before the averaging starts.
    """

    def __init__(self, decay: float, start_step: int = 0) -> None:
        super().__init__(use_buffers=True, multi_avg_fn=_ema_multi_avg_fn(decay))
        self.decay = float(decay)
        self.start_step = int(start_step)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None  # after optimizer steps, never at epoch ends

    def _average(self, pl_module: L.LightningModule) -> AveragedModel:
        if self._average_model is None:
            self._average_model = AveragedModel(model=pl_module, use_buffers=self._use_buffers, **self._kwargs)
        return self._average_model

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # The average is created in on_fit_start (or when a checkpoint is loaded), once the heads exist.
        if stage == "fit" and isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy | DeepSpeedStrategy):
            raise ConfigError(
                f"optim.ema_decay does not work with a sharded strategy ({type(trainer.strategy).__name__}): "
                "the average would hold one process's shards only. Train with ddp, or set "
                "--model.optim.ema_decay null."
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._average(pl_module).to(pl_module.device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step <= self._latest_update_step:  # no optimizer step (accumulating)
            return
        average = self._average(pl_module)
        if trainer.global_step <= self.start_step:
            average.n_averaged.zero_()  # not started: the next update copies the weights
        average.update_parameters(pl_module)
        self._latest_update_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._average_model is not None:
            self._copy_average_to_current(pl_module)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return  # evaluating a checkpoint: its state_dict already holds the averaged weights
        self._average(pl_module)
        super().on_load_checkpoint(trainer, pl_module, checkpoint)


def ema_callbacks(optim: Optimization) -> list[L.Callback]:
    """``[EMAWeights]`` when ``optim.ema_decay`` is set, else ``[]`` (a task's
    ``configure_callbacks``)."""
    if optim.ema_decay is None:
        return []
    return [EMAWeights(optim.ema_decay, optim.ema_start_step)]
