"""What every task system shares: optimiser and schedule, checkpoint metadata, result gathering.

A task is a LightningModule ("system") wrapping plain ``nn.Module`` models. Its checkpoints
carry a ``"vision_attn"`` entry — the task's class path and constructor arguments, the
encoder's architecture and the preprocessing — so :func:`load_task` rebuilds the model from
the checkpoint alone, without downloading anything and without executing pickled code.
"""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from vision_attn.checkpoint_io import CheckpointError, load_checkpoint_file
from vision_attn.distributed import gather_objects
from vision_attn.errors import DataError, TrainingDivergedError
from vision_attn.models.encoder import ViTEncoder

__all__ = ["VisionTask", "gather_objects", "load_task", "warmup_cosine"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "vision_attn"
CHECKPOINT_FORMAT = 1
RUNTIME_ARGS = ("compile",)  # constructor switches that describe the run, not the model


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate factor: linear warmup over ``warmup`` steps, then cosine to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class VisionTask(L.LightningModule):
    """Base system: an encoder, AdamW with warmup + cosine decay, self-describing checkpoints.

    Args:
        encoder: the :class:`~vision_attn.models.ViTEncoder`.
        lr: peak learning rate of the heads (and of the encoder unless ``encoder_lr`` is set).
        encoder_lr: peak learning rate of the encoder (e.g. lower when fine-tuning).
        weight_decay: AdamW weight decay (not applied to biases, norms, tokens and position
            embeddings).
        warmup_fraction: fraction of the training steps spent in linear warmup.
        min_lr_ratio: final learning rate as a fraction of the peak.
        compile: ``torch.compile`` the encoder (in place: parameter names and checkpoints are
            unchanged) when training or evaluation starts.
    """

    task_name: str = ""
    built_from: str = "class names"  # what the data gives the head (checkpoints store it)
    monitor: tuple[str, str] = ("val/loss", "min")

    def __init__(
        self,
        encoder: ViTEncoder,
        lr: float = 1e-3,
        encoder_lr: float | None = None,
        weight_decay: float = 0.05,
        warmup_fraction: float = 0.05,
        min_lr_ratio: float = 0.01,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.lr = lr
        self.encoder_lr = encoder_lr
        self.weight_decay = weight_decay
        self.warmup_fraction = warmup_fraction
        self.min_lr_ratio = min_lr_ratio
        self.compile_encoder = compile

    def configure_model(self) -> None:
        if self.compile_encoder and getattr(self.encoder, "_compiled_call_impl", None) is None:
            log.info("compiling the encoder with torch.compile")
            self.encoder.compile()

    # ------------------------------------------------------------------ labels from the data
    # Set by subclasses in __init__ (``None`` until built). No class-level default for
    # ``head``: it would shadow the registered sub-module.
    head: nn.Module | None
    class_names: list[str] | None

    def build_from_data(self, datamodule: Any) -> None:
        """Build the label-dependent parts (heads, losses, metrics) from the datamodule."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        # Class names (and their number) come from the data, never from a config: build the
        # head when training starts, or check that a built model fits the data.
        dm = getattr(self.trainer, "datamodule", None)
        names = getattr(dm, "class_names", None)
        if self.head is None:
            if names is None:
                raise DataError(f"{type(self).__name__} has no class names and the datamodule gives none")
            self.build_from_data(dm)
        elif names is not None and list(names) != self.class_names:
            raise DataError(
                f"the model was built for classes {self.class_names} but the data has {list(names)}; "
                "evaluate on data with the same classes (or fine-tune a new head)"
            )

    def check_finite(self, loss: torch.Tensor, terms: dict[str, torch.Tensor] | None = None) -> None:
        """Stop training when the loss is NaN or infinite, naming the loss terms that are."""
        if bool(torch.isfinite(loss).all()):
            return
        terms = terms or {"loss": loss}
        bad = {k: float(v.detach().float().mean()) for k, v in terms.items() if not bool(torch.isfinite(v).all())}
        raise TrainingDivergedError(
            f"the training loss became non-finite at step {self.global_step}: "
            + ", ".join(f"{k}={v}" for k, v in (bad or {"loss": float(loss)}).items())
            + ". The last good checkpoint is kept; lower --model.lr, raise --trainer.gradient_clip_val "
            "or check the data, then resume with --ckpt_path last."
        )

    def configure_datamodule(self, datamodule: Any) -> None:
        """Make ``datamodule`` prepare data for this model (its preprocessing; tasks add more,
        e.g. the caption tokenizer). ``eval.py`` calls it with the checkpoint's model."""
        if datamodule is not None:
            datamodule.preprocess = self.data_config

    @property
    def data_config(self) -> dict[str, Any]:
        """The preprocessing this model expects (timm data config; saved in checkpoints)."""
        return self.encoder.data_config

    # ------------------------------------------------------------------ optimisation
    def _param_groups(self) -> list[dict[str, Any]]:
        no_decay_names = set()
        skip = getattr(self.encoder.model, "no_weight_decay", None)
        if callable(skip):
            no_decay_names = {f"encoder.model.{n}" for n in skip()}
        groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            is_encoder = name.startswith("encoder.")
            decay = p.ndim > 1 and name not in no_decay_names and not name.endswith("token")
            groups.setdefault((is_encoder, decay), []).append(p)
        out = []
        for (is_encoder, decay), params in groups.items():
            lr = self.encoder_lr if (is_encoder and self.encoder_lr is not None) else self.lr
            out.append({"params": params, "lr": lr, "weight_decay": self.weight_decay if decay else 0.0})
        return out

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self._param_groups(), betas=(0.9, 0.999))
        # The schedule follows the trainer's length (max_epochs / max_steps on the command line).
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(self.warmup_fraction * total)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, total, warmup, self.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ------------------------------------------------------------------ checkpoints
    def task_init_args(self) -> dict[str, Any]:
        """Constructor arguments other than the encoder (from ``hparams``); run-time switches
        such as ``compile`` are left out."""
        return {k: v for k, v in dict(self.hparams).items() if not k.startswith("_") and k not in RUNTIME_ARGS}

    def checkpoint_meta(self) -> dict[str, Any]:
        cls = type(self)
        return {
            "format": CHECKPOINT_FORMAT,
            "task": self.task_name,
            "model": {
                "class_path": f"{cls.__module__}.{cls.__qualname__}",
                "init_args": {**self.task_init_args(), "encoder": self.encoder.architecture_config()},
            },
            "data_config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.data_config.items()},
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = self.checkpoint_meta()


def resolve_class(class_path: str, base: type, what: str) -> type:
    if not class_path.startswith("vision_attn."):
        raise CheckpointError(f"{what}: class {class_path!r} is not part of vision_attn; refusing to build it")
    module_name, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise CheckpointError(f"{what}: {class_path!r} is not a {base.__name__}")
    return cls


def read_task_meta(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(meta, checkpoint)`` of a vision_attn checkpoint, with clear errors for foreign files."""
    ckpt = load_checkpoint_file(path)
    if not isinstance(ckpt, dict) or CHECKPOINT_KEY not in ckpt or "state_dict" not in ckpt:
        raise CheckpointError(
            f"checkpoint {path} was not written by a vision_attn task (no {CHECKPOINT_KEY!r} entry); "
            "pass a .ckpt from train.py"
        )
    return ckpt[CHECKPOINT_KEY], ckpt


def build_task_from_meta(meta: dict[str, Any], what: str = "checkpoint") -> VisionTask:
    """Instantiate the task described by a checkpoint's metadata (random weights)."""
    model_cfg = meta["model"]
    cls = resolve_class(model_cfg["class_path"], VisionTask, what)
    init_args = dict(model_cfg["init_args"])
    enc_cfg = init_args.pop("encoder")
    enc_cls = resolve_class(enc_cfg["class_path"], ViTEncoder, what)
    encoder = enc_cls(**enc_cfg["init_args"])
    return cls(encoder=encoder, **init_args)


def restore_from_checkpoint(task: VisionTask, meta: dict[str, Any], ckpt: dict[str, Any], what: str) -> VisionTask:
    """Load a checkpoint's weights into ``task`` and its stored preprocessing into the encoder
    (the stored one wins over today's timm defaults), then switch to eval mode."""
    try:
        task.load_state_dict(ckpt["state_dict"])
    except RuntimeError as err:
        if getattr(task, "head", True) is None:
            raise CheckpointError(
                f"{what} does not store the model's {task.built_from} (model.init_args in its "
                f"{CHECKPOINT_KEY!r} entry), so its head cannot be rebuilt; use a checkpoint written by train.py"
            ) from err
        raise CheckpointError(f"{what}: weights do not fit the model it describes: {err}") from err
    stored = meta.get("data_config")
    if stored:
        task.encoder.data_config = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()}
    return task.eval()


def load_task(path: str | Path, expected_task: str | None = None, map_location: str = "cpu") -> VisionTask:
    """Rebuild a trained task from a checkpoint written by ``train.py`` (or ``Trainer.save_checkpoint``).

    Args:
        path: the ``.ckpt`` file.
        expected_task: ``"classification"`` etc.; a checkpoint of another task is an error.
        map_location: device for the weights.
    """
    meta, ckpt = read_task_meta(path)
    if expected_task is not None and meta.get("task") != expected_task:
        raise CheckpointError(
            f"checkpoint {path} holds a {meta.get('task')!r} model, not a {expected_task!r} one"
        )
    what = f"checkpoint {path}"
    task = restore_from_checkpoint(build_task_from_meta(meta, what), meta, ckpt, what)
    return task.to(map_location)
