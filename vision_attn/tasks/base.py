"""What every task system shares: optimiser and schedule, checkpoint metadata, result gathering.

A task is a LightningModule ("system") wrapping plain ``nn.Module`` models. Its checkpoints
carry a ``"vision_attn"`` entry — the task's class path and constructor arguments, the
encoder's architecture and the preprocessing — so :func:`load_task` rebuilds the model from
the checkpoint alone, without downloading anything and without executing pickled code.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from vision_attn.checkpoint_io import CheckpointError, load_checkpoint_file
from vision_attn.data.transforms import whole_image
from vision_attn.distributed import gather_objects
from vision_attn.errors import ConfigError, DataError, TrainingDivergedError, VisionAttnError
from vision_attn.explain.evaluate import write_overlays
from vision_attn.explain.records import Explained
from vision_attn.models.encoder import ViTEncoder
from vision_attn.schema import (
    PreprocessOverrides,
    check_data_size,
    check_limits,
    check_model_bytes,
    check_value,
    constructor_hints,
)
from vision_attn.tasks.checkpoint_checks import (  # noqa: F401 (re-exported)
    CHECKPOINT_KEY,
    _allowed,
    _check_plain,
    _class_spec,
    _data_modules,
    check_state_shapes,
    checked_data_settings,
    grouped_arguments,
    one_line,
    regroup_arguments,
    resolve_class,
)
from vision_attn.tasks.optim import (
    DEFAULT_OPTIM,
    V1_OPTIMIZATION_KEYS,
    Optimization,
    WarmupCosineSchedule,
    build_optimizers,
    cosine_factor,
    ema_callbacks,
    no_weight_decay_names,
    warmup_cosine,
)
from vision_attn.tasks.report_hooks import TaskReportHooks

__all__ = ["Optimization", "VisionTask", "WarmupCosineSchedule", "cosine_factor", "gather_objects", "load_task",
           "warmup_cosine"]

log = logging.getLogger(__name__)

# 2: optimisation settings grouped in "optim", out of the model's arguments; 3: the model's arguments
# in named groups (a task's ``legacy_arguments`` say where the flat arguments of formats 1 and 2 went)
CHECKPOINT_FORMAT = 3
RUNTIME_ARGS = ("compile", "optim")  # constructor arguments that describe the run, not the model
# Encoder classes a checkpoint may name: the suite's own, never a class from another module
# (not even one allowed with --allow_import: a checkpoint is data, and names no code to import).
CHECKPOINT_ENCODERS: dict[str, type[ViTEncoder]] = {
    "vision_attn.models.ViTEncoder": ViTEncoder,
    "vision_attn.models.encoder.ViTEncoder": ViTEncoder,
}


TASKS: dict[str, type[VisionTask]] = {}
"""The registry: task name -> task class (:func:`register_task`)."""


def register_task(cls: type[VisionTask]) -> type[VisionTask]:
    """Class decorator: register a :class:`VisionTask` under its ``task_name``, so checkpoints
    and commands can name it. A task of your own module (imported with ``--allow_import``)
    registers itself the same way."""
    name = getattr(cls, "task_name", "")
    if not (isinstance(cls, type) and issubclass(cls, VisionTask)) or not name:
        raise TypeError(f"register_task needs a VisionTask subclass with a task_name, got {cls!r}")
    known = TASKS.get(name)
    if known is not None and f"{known.__module__}.{known.__qualname__}" != f"{cls.__module__}.{cls.__qualname__}":
        raise ValueError(f"task name {name!r} is already registered by {known.__module__}.{known.__qualname__}")
    TASKS[name] = cls
    return cls


class VisionTask(TaskReportHooks, L.LightningModule):
    """Base system: an encoder, the optimisation settings, self-describing checkpoints.

    Args:
        encoder: the :class:`~vision_attn.models.ViTEncoder`.
        optim: learning rates, weight decay and schedule (:class:`~vision_attn.tasks.optim.Optimization`);
            the optimiser is AdamW unless the command line chooses another (``--optimizer``).
        compile: ``torch.compile`` the encoder (in place: parameter names and checkpoints are
            unchanged) when training or evaluation starts.
    """

    task_name: str = ""  # the registry's name (:func:`register_task`); stored in checkpoints
    built_from: str = "class names"  # what the data gives the head (checkpoints store it)
    monitor: tuple[str, str] = ("val/loss", "min")
    # Inference preprocessing: timm's centre crop (``crop_pct``), or the whole image resized
    # (detection and captioning: a crop would cut objects off). See :meth:`inference_data_config`.
    crop_at_inference: bool = True
    export_output_names: tuple[str, ...] = ()  # names of :meth:`export_forward`'s outputs (ONNX)
    onnx_predicts: bool = True  # whether :meth:`predictions_from_outputs` can run on ONNX outputs
    headline_metrics: tuple[str, ...] = ()  # the metrics a summary shows first (demo, report)
    # the one metric of report.html's summary line and training plot (None: the first metric)
    headline_metric: str | None = None
    eval_file_names: tuple[str, ...] = ()  # the files :meth:`eval_files` gives, next to metrics.json
    overlay_description: str = ""  # what one overlay panel shows (demo, README)
    # The dataclass of the task's own predict / eval / explain options (None: it has none), given to
    # :meth:`set_inference_options`; the commands add its fields to their command line, as
    # ``--GROUP.FIELD`` for the group named by ``inference_group`` (``--generate.beam_size``), else as
    # ``--FIELD`` of ``predict`` / ``explain`` and ``--explain.FIELD`` of ``eval.py`` (``--topk``,
    # ``--explain.topk``).
    inference_options: type | None = None
    inference_group: str | None = None
    # Why the task's checkpoints cannot be evaluated, predict or explain (e.g. a pretrained encoder
    # meant for another task), or None: ``eval.py`` and the folder commands stop with it at once.
    no_inference: str | None = None
    # constructor arguments that say where a run's weights came from (a file to read), never
    # taken from a checkpoint: dropped with a warning when a checkpoint holds them ("group.field"
    # for one inside an argument group)
    source_args: tuple[str, ...] = ()
    # where the flat constructor arguments of older checkpoints (formats 1 and 2) went: old name ->
    # "group.field" (:func:`regroup_arguments`)
    legacy_arguments: dict[str, str] = {}

    def __init__(
        self,
        encoder: ViTEncoder,
        optim: Optimization = DEFAULT_OPTIM,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.optim = optim
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
            + ". The last good checkpoint is kept; lower --model.optim.lr, raise --trainer.gradient_clip_val "
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

    # ------------------------------------------------------------------ inference, export, explanation
    # What the commands ask of a task (``eval.py``, ``vision-attn predict / explain / export``,
    # the demo and the report): none of them knows which task it runs.
    def inference_data_config(self) -> dict[str, Any]:
        """The preprocessing of single images at inference: :attr:`data_config`, without the
        centre crop when the task must see the whole image (:attr:`crop_at_inference`)."""
        return self.data_config if self.crop_at_inference else whole_image(self.data_config)

    _inference: Any = None  # the options given to set_inference_options (None: none given)
    evaluation_options: Any = None
    """The evaluation's :class:`~vision_attn.explain.evaluate.ExplainOptions` (``eval.py`` sets
    them before the test run), for a task whose metrics take options; ``None`` otherwise."""

    @property
    def inference(self) -> Any:
        """The task's inference options in use: those of :meth:`set_inference_options`, else the
        defaults of :attr:`inference_options` (``None`` for a task without options)."""
        if self._inference is not None or self.inference_options is None:
            return self._inference
        return self.inference_options()

    def set_inference_options(self, options: Any) -> None:
        """Predict, evaluate and explain with ``options`` (an :attr:`inference_options` instance)
        from now on: the one way ``eval.py``, ``predict`` and ``explain`` hand a task its options.

        Raises:
            ConfigError: options of another type than the task declares.
        """
        if self.inference_options is None or not isinstance(options, self.inference_options):
            wanted = getattr(self.inference_options, "__name__", "no options")
            raise ConfigError(f"{type(self).__name__} takes {wanted} as its inference options, "
                              f"not {type(options).__name__}")
        self._inference = options

    def explain_options(self, options: Any) -> Any:
        """``options`` (an :class:`~vision_attn.explain.evaluate.ExplainOptions`) with the fields
        that share a name with the task's inference options set from those given to
        :meth:`set_inference_options` (the explanation functions read e.g. ``score_threshold``
        there); a copy, or ``options`` itself when no options were given."""
        if self._inference is None or not dataclasses.is_dataclass(options):
            return options
        names = {f.name for f in dataclasses.fields(options)}
        out = copy.copy(options)
        for field in dataclasses.fields(self._inference):
            if field.name in names:
                setattr(out, field.name, getattr(self._inference, field.name))
        return out

    def export_forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors-in, tensors-out forward that ONNX holds (:attr:`export_output_names`)."""
        raise NotImplementedError(f"{type(self).__name__} does not define export_forward")

    def predictions_from_outputs(self, outputs: tuple[torch.Tensor, ...], sizes: list[tuple[int, int]],
                                 options: Any = None) -> list[dict[str, Any]]:
        """One ``predictions.json`` record per image (without ``file``) of the folder commands,
        from :meth:`export_forward`'s outputs for images of original ``(height, width)``
        ``sizes`` (``options``: an :class:`~vision_attn.explain.evaluate.ExplainOptions`, e.g.
        detection's ``score_threshold``). Needs only the model's description (labels), not its
        weights, so it serves ONNX models too (:attr:`onnx_predicts`)."""
        raise NotImplementedError(f"{type(self).__name__} does not define predictions_from_outputs")

    def explain_batch(self, images: torch.Tensor, pictures: list[Any], options: Any,
                      truths: list[str] | None = None) -> list[Explained]:
        """Predictions, overlay panels and report items of a batch: the one code path behind the
        overlays of ``eval.py`` and of the folder commands.

        Args:
            images: ``[B, 3, H, W]`` preprocessed as the model expects.
            pictures: the ``B`` original RGB images (uint8 ``[h, w, 3]``) the panels are drawn on.
            options: an :class:`~vision_attn.explain.evaluate.ExplainOptions`.
            truths: the ground truth of each image as text, drawn on the panel when given.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define explain_batch")

    def eval_results(self, dataset: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """``(metrics, predictions)`` of the last ``trainer.test`` run on ``dataset``, in the
        task's ``metrics.json`` / ``predictions.json`` formats."""
        raise NotImplementedError(f"{type(self).__name__} does not define eval_results")

    def eval_files(self, dataset: Any) -> dict[str, Any]:
        """The task's own result files of the last ``trainer.test`` run on ``dataset``, written by
        ``eval.py`` next to ``metrics.json``: file name -> JSON object (e.g. classification's
        ``per_class.json`` and ``confusion_matrix.json``). Called after :meth:`eval_results`,
        on the main process only. The names are those of :attr:`eval_file_names`, which
        ``eval.py`` checks before evaluating, so that it refuses to overwrite earlier results
        (without ``--overwrite``) exactly as it refuses for ``metrics.json``."""
        return {}

    def explain_eval(self, dataset: Any, options: Any, out_dir: Path, report: Any = None) -> dict[str, float]:
        """Overlays of the evaluated split into ``out_dir/overlays`` and the explanation metrics;
        fills ``report`` (a :class:`~vision_attn.explain.records.Report`) when given.

        By default the overlays of the seeded sample and of the worst mistakes (:meth:`rank_mistakes`),
        drawn by :meth:`explain_batch` (:func:`~vision_attn.explain.evaluate.write_overlays`, which
        says what it reads of ``dataset``), and no metrics: a task overrides it to add measures. A
        task without :meth:`explain_batch` draws none."""
        if type(self).explain_batch is VisionTask.explain_batch:
            log.info("no overlays: %s does not define explain_batch", type(self).__name__)
            return {}
        write_overlays(self, dataset, options, out_dir, report)
        return {}

    def truth_text(self, dataset: Any, index: int) -> str | None:
        """The ground truth of image ``index`` of an evaluated split as text, drawn on its overlay
        panel by the default :meth:`explain_eval` (default: ``None``, none drawn)."""
        return None

    # Set by the folder commands (vision_attn.predict): an ExplainOptions, whether to draw, and
    # how many images report.html shows (later images need no report item: ExplainOptions.report
    # is turned off for their batches).
    predict_options: Any = None
    predict_overlays: bool = False
    predict_report_images: int | None = None

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """Lightning's predict step of the folder commands.

        Args:
            batch: ``{"images": [B, 3, H, W], "pictures": [B original RGB arrays, or None each
                in a predictions-only run], "sizes": [B (height, width) of the originals],
                "files": [B names], "skipped": [{"file", "reason"}]}`` (:mod:`vision_attn.predict`).

        Returns:
            ``{"files", "records", "panels", "report_items", "skipped"}``: per image its record
            (:meth:`predictions_from_outputs`) and, when :attr:`predict_overlays` is true, its
            panel and report item (:meth:`explain_batch`; options: :attr:`predict_options`).
        """
        files, pictures = batch["files"], batch["pictures"]
        if not files:
            return {"files": [], "records": [], "panels": [], "report_items": [], "skipped": batch["skipped"]}
        if self.predict_overlays:
            options, seen = self.predict_options, 0 if batch_idx == 0 else getattr(self, "_predict_seen", 0)
            self._predict_seen = seen + len(files)
            if (self.predict_report_images is not None and seen >= self.predict_report_images
                    and dataclasses.is_dataclass(options) and getattr(options, "report", False)):
                options = dataclasses.replace(options, report=False)  # past the report's images
            explained = self.explain_batch(batch["images"], pictures, options)
            records = [e.record for e in explained]
            panels = [e.panel for e in explained]
            items = [e.report_item for e in explained]
        else:
            with torch.no_grad():
                outputs = self.export_forward(batch["images"])
            records = self.predictions_from_outputs(outputs, batch["sizes"], self.predict_options)
            panels, items = [None] * len(files), [None] * len(files)
        return {"files": files, "records": records, "panels": panels, "report_items": items,
                "skipped": batch["skipped"]}

    # ------------------------------------------------------------------ optimisation
    def no_weight_decay_names(self) -> set[str]:
        """Names of the parameters that are not decayed (see :class:`Optimization`)."""
        return no_weight_decay_names(self)

    # Chosen on the command line (--optimizer, --lr_scheduler: {"class_path", "init_args"}); None
    # = AdamW and the warmup-cosine schedule of ``optim``. Run settings, not saved with the model.
    optimizer_init: dict[str, Any] | None = None
    lr_scheduler_init: dict[str, Any] | None = None

    def configure_optimizers(self) -> dict[str, Any]:
        # A fresh run plans the schedule from the trainer's length (max_epochs / max_steps); a
        # resumed run loads the checkpoint's plan over this one and on_train_start re-plans the
        # rest for the trainer now running (WarmupCosineSchedule).
        return build_optimizers(self, self.optim, self.trainer.estimated_stepping_batches,
                                self.optimizer_init, self.lr_scheduler_init, monitor=self.monitor[0],
                                monitor_mode=self.monitor[1])

    def configure_callbacks(self) -> list[L.Callback]:
        """The exponential moving average of the weights when ``optim.ema_decay`` is set."""
        return ema_callbacks(self.optim)

    def _remaining_optimizer_steps(self) -> float:
        """Optimizer steps the running trainer will still take in this ``fit`` (``inf`` when it
        has no end). Exact at epoch ends (where ``last.ckpt`` is written); after a mid-epoch
        checkpoint the interrupted epoch's remaining batches are counted from the loop state."""
        trainer = self.trainer
        done = trainer.global_step
        by_steps = trainer.max_steps - done if trainer.max_steps not in (None, -1) else math.inf
        batches = trainer.num_training_batches
        if trainer.max_epochs in (None, -1) or not math.isfinite(batches):
            return by_steps
        accumulate = trainer.accumulate_grad_batches
        per_epoch = math.ceil(batches / accumulate)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        epochs_left = trainer.max_epochs - trainer.current_epoch
        if progress.is_last_batch or progress.current.completed == 0:  # at an epoch boundary
            by_epochs = per_epoch * epochs_left
        else:  # inside an epoch: its remaining batches, then the full epochs
            rest = max(0, batches - progress.current.completed)
            by_epochs = math.ceil(rest / accumulate) + per_epoch * max(0, epochs_left - 1)
        return min(by_epochs, by_steps)

    def on_train_start(self) -> None:
        # Resumed runs: fit the rest of the schedule to this trainer (another process count,
        # batch size, accumulation or max_epochs); a no-op when nothing changed.
        for config in self.trainer.lr_scheduler_configs:
            schedule = config.scheduler
            remaining = self._remaining_optimizer_steps()
            if isinstance(schedule, WarmupCosineSchedule) and math.isfinite(remaining):
                old_end = schedule.end_step
                if schedule.replan(int(remaining)):
                    log.info("learning-rate schedule re-planned at step %d: it ends at step %d instead of %d",
                             schedule.last_epoch, schedule.end_step, old_end)

    # ------------------------------------------------------------------ checkpoints
    run_data: dict[str, Any] | None = None  # the data settings of the run (set by ``fit``; saved)

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
            "optim": dataclasses.asdict(self.optim),
            **({"data": self.run_data} if self.run_data else {}),
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = self.checkpoint_meta()


def _checked_model_config(model_cfg: Any, what: str,
                          allow_import: tuple[str, ...] = ()) -> tuple[type, type, dict[str, Any]]:
    """``(task class, encoder class, model config)`` of a checkpoint's ``model`` entry, checked
    before anything is built from it:

    - the task is a registered :class:`VisionTask` of vision_attn (or of a module allowed with
      ``allow_import``); the encoder is the suite's :class:`~vision_attn.models.ViTEncoder`;
    - every argument is plain data of the type the constructor declares
      (:func:`~vision_attn.schema.check_value`; no class path anywhere), sizes within
      :data:`~vision_attn.schema.LIMITS`;
    - arguments that point at files (``pretrained``, ``weights_file``, a task's
      :attr:`VisionTask.source_args`) are dropped with a warning; the encoder's are those of
      :meth:`~vision_attn.models.ViTEncoder.checked_architecture_args`;
    - the flat arguments of formats 1 and 2 are moved into the task's argument groups
      (:attr:`VisionTask.legacy_arguments`, :func:`regroup_arguments`) before any check.
    """

    model_cfg = _class_spec(model_cfg, f"{CHECKPOINT_KEY}.model", what)
    cls = resolve_class(model_cfg.get("class_path"), VisionTask, what, allow_import)
    init_args = dict(model_cfg.get("init_args") or {})
    for key in (*RUNTIME_ARGS, *V1_OPTIMIZATION_KEYS):  # how it was trained (format 1 kept lr etc. here)
        init_args.pop(key, None)
    init_args = regroup_arguments(init_args, cls.legacy_arguments, what)
    for key in cls.source_args:
        group, _, field = key.rpartition(".")
        holder = init_args.get(group) if group else init_args
        if not isinstance(holder, dict) or field not in holder:
            continue
        if group:
            init_args[group] = holder = dict(holder)
        if holder.pop(field) is not None:
            log.warning("%s: ignoring the stored argument %s (weights come from the checkpoint)", what, key)
    enc_cfg = _class_spec(init_args.pop("encoder", None), "model.init_args.encoder", what)
    enc_path = enc_cfg.get("class_path")
    enc_cls = CHECKPOINT_ENCODERS.get(enc_path) if isinstance(enc_path, str) else None
    if enc_cls is None:
        raise CheckpointError(
            f"{what}: encoder class {enc_path!r} is not part of vision_attn; refusing to import it (a checkpoint "
            f"may name only {', '.join(sorted(CHECKPOINT_ENCODERS))}, with or without --allow_import)"
        )
    enc_args = enc_cls.checked_architecture_args(enc_cfg.get("init_args") or {}, what)
    enc_hints = constructor_hints(enc_cls)
    for key, value in enc_args.items():
        check_value(value, enc_hints.get(key), f"model.init_args.encoder.init_args.{key}", what)
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(str(k) for k in init_args
                     if k in ("self", "encoder") or (k not in params and not takes_any))
    if unknown:
        raise CheckpointError(
            f"{what}: model.init_args has keys {unknown} that {cls.__name__} does not take; "
            "use a checkpoint written by train.py"
        )
    hints = constructor_hints(cls)
    for key, value in init_args.items():
        _check_plain(value, f"model.init_args.{key}", what)
        check_value(value, hints.get(key, Any), f"model.init_args.{key}", what)
    encoder = {"class_path": enc_cfg["class_path"], "init_args": enc_args}
    model = {"class_path": model_cfg["class_path"], "init_args": {**init_args, "encoder": encoder}}
    check_limits(model["init_args"], what, "model.init_args")
    return cls, enc_cls, model


def read_task_meta(path: str | Path, allow_import: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(meta, checkpoint)`` of a vision_attn checkpoint, with clear errors for foreign files.

    The file is read without executing pickled code, and its metadata is checked before
    anything imports or builds from it (see :func:`_checked_model_config`); the ``meta``
    returned holds the checked model description.
    """
    ckpt = load_checkpoint_file(path)
    if not isinstance(ckpt, dict) or CHECKPOINT_KEY not in ckpt or "state_dict" not in ckpt:
        raise CheckpointError(
            f"checkpoint {path} was not written by a vision_attn task (no {CHECKPOINT_KEY!r} entry); "
            "pass a .ckpt from train.py"
        )
    meta = ckpt[CHECKPOINT_KEY]
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: its {CHECKPOINT_KEY!r} entry is not a mapping")
    what = f"checkpoint {path}"
    check_data_size(meta, what, CHECKPOINT_KEY)  # first: every check below walks it
    check_value(meta.get("format", 1), int, f"{CHECKPOINT_KEY}.format", what)
    check_value(meta.get("task"), str, f"{CHECKPOINT_KEY}.task", what)
    for key, hint in (("data_config", PreprocessOverrides), ("optim", Optimization)):
        if meta.get(key) is not None:
            check_value(meta[key], hint, f"{CHECKPOINT_KEY}.{key}", what)
            check_limits(meta[key], what, f"{CHECKPOINT_KEY}.{key}")
    data = checked_data_settings(meta, what)
    cls, _, model_cfg = _checked_model_config(meta.get("model"), what, allow_import)
    if TASKS.get(meta["task"]) is not cls:  # the registry names the class the checkpoint names
        raise CheckpointError(
            f"checkpoint {path}: its task {meta.get('task')!r} is not the registered name of "
            f"{model_cfg['class_path']} ({cls.task_name!r}); use a checkpoint written by vision-attn fit"
        )
    return {**meta, "model": model_cfg, **({"data": data} if data is not None else {})}, ckpt


def build_task_from_meta(meta: dict[str, Any], what: str = "checkpoint",
                         allow_import: tuple[str, ...] = ()) -> VisionTask:
    """Instantiate the task described by a checkpoint's metadata (random weights), after
    checking it: vision_attn classes only, no pretrained or file weights, plain arguments."""
    model_cfg = meta.get("model") if isinstance(meta, dict) else None
    cls, enc_cls, model_cfg = _checked_model_config(model_cfg, what, allow_import)
    init_args = dict(model_cfg["init_args"])
    enc_args = init_args.pop("encoder")["init_args"]

    def build() -> VisionTask:
        return cls(encoder=enc_cls(**enc_args), **grouped_arguments(cls, init_args))

    try:
        check_model_bytes(build, what)  # sized on the meta device before anything is allocated
        return build()
    except VisionAttnError:
        raise
    except (AssertionError, ValueError, TypeError, RuntimeError, ZeroDivisionError, OverflowError) as err:
        raise CheckpointError(f"{what}: the model it describes cannot be built: {one_line(err)}") from err


def restore_from_checkpoint(task: VisionTask, meta: dict[str, Any], ckpt: dict[str, Any], what: str) -> VisionTask:
    """Load a checkpoint's weights into ``task`` and its stored preprocessing into the encoder
    (the stored one wins over today's timm defaults), then switch to eval mode."""
    if getattr(task, "head", True) is None:
        raise CheckpointError(
            f"{what} does not store the model's {task.built_from} (model.init_args in its "
            f"{CHECKPOINT_KEY!r} entry), so its head cannot be rebuilt; use a checkpoint written by train.py"
        )
    check_state_shapes(task, ckpt.get("state_dict"), what)
    try:
        task.load_state_dict(ckpt["state_dict"])
    except RuntimeError as err:
        raise CheckpointError(f"{what}: weights do not fit the model it describes: {one_line(err)}") from err
    stored = meta.get("data_config")
    if stored:
        check_value(stored, PreprocessOverrides, f"{CHECKPOINT_KEY}.data_config", what)
        check_limits(stored, what, f"{CHECKPOINT_KEY}.data_config")
        task.encoder.data_config = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()}
    return task.eval()


def load_task(path: str | Path, expected_task: str | None = None, map_location: str = "cpu",
              allow_import: tuple[str, ...] = ()) -> VisionTask:
    """Rebuild a trained task from a checkpoint written by ``train.py`` (or ``Trainer.save_checkpoint``).

    Args:
        path: the ``.ckpt`` file.
        expected_task: ``"classification"`` etc.; a checkpoint of another task is an error.
        map_location: device for the weights.
        allow_import: module prefixes (besides vision_attn) whose task and encoder classes the
            checkpoint may name (``--allow_import``); importing a module runs its code.
    """
    if expected_task is not None and expected_task not in TASKS:
        raise ValueError(f"unknown task {expected_task!r}; registered tasks: {', '.join(sorted(TASKS))}")
    meta, ckpt = read_task_meta(path, allow_import)
    if expected_task is not None and meta.get("task") != expected_task:
        raise CheckpointError(
            f"checkpoint {path} holds a {meta.get('task')!r} model, not a {expected_task!r} one"
        )
    what = f"checkpoint {path}"
    task = restore_from_checkpoint(build_task_from_meta(meta, what, allow_import), meta, ckpt, what)
    return task.to(map_location)
