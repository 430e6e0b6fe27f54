"""The LightningCLI shared by ``train.py`` and ``eval.py``.

``python train.py --config CFG [--config MORE] [--section.key value ...]`` trains, writing into
``--trainer.default_root_dir`` (default ``runs/<config name>``)::

    ROOT/config.yaml              resolved config of the run
    ROOT/checkpoints/last.ckpt    latest state (resume with --ckpt_path last)
    ROOT/checkpoints/best-*.ckpt  best by the task's validation metric
    ROOT/tensorboard/version_N/   TensorBoard logs
    ROOT/csv/version_N/           metrics.csv

``python eval.py --config CFG --ckpt_path CKPT --output_dir OUT`` evaluates a checkpoint and
writes ``OUT/metrics.json`` and ``OUT/predictions.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vision_attn.errors import CheckpointError, ConfigError, RunExistsError, VisionAttnError
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.explain.report import Report, write_report
from vision_attn.models.captioner import GenerationOptions
from vision_attn.tasks.base import (
    VisionTask,
    read_task_meta,
    resolve_class,
    restore_from_checkpoint,
)

__all__ = ["EvalCLI", "TrainCLI", "eval_main", "train_main", "write_json_atomic"]

log = logging.getLogger("vision_attn")


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file and one rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_writable(folder: Path) -> None:
    """Fail before any work when results could not be written into ``folder``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as err:
        raise VisionAttnError(f"cannot write results into {folder}: {err.strerror or err}; pass a writable --output_dir") from err


class RunConfigCallback(SaveConfigCallback):
    """Save the resolved config as ``ROOT/config.yaml``; never overwrite a previous run's.

    A run into a folder that already holds a ``config.yaml`` is refused unless it resumes from
    a checkpoint (``--ckpt_path``), in which case the config goes to ``config.resume-N.yaml``.
    """

    def __init__(self, *args: Any, resuming: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resuming = resuming

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if self.already_saved or stage != "fit":
            return
        root = Path(trainer.default_root_dir)
        target = root / self.config_filename
        if trainer.is_global_zero:
            if target.exists():
                if not self.resuming:
                    raise RunExistsError(
                        f"{root} already holds a training run ({target} exists). Refusing to overwrite it: "
                        "pass another --trainer.default_root_dir, or resume it with --ckpt_path last."
                    )
                n = 1
                while (root / f"config.resume-{n}.yaml").exists():
                    n += 1
                target = root / f"config.resume-{n}.yaml"
            root.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, target, overwrite=False, multifile=False)
        self.already_saved = True
        trainer.strategy.barrier()


class RunCheckpoint(ModelCheckpoint):
    """The best checkpoint by the task's validation metric, plus ``last.ckpt`` refreshed at the end
    of every training epoch. (Lightning 2.6 refreshes ``last`` only when it also saves a new
    best one, so without this a run whose metric stops improving resumes from a stale state.)"""

    _last_saved_step: int = -1

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if (self.save_last and not trainer.sanity_checking and not trainer.fast_dev_run
                and trainer.state.fn == "fit" and self._last_saved_step != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_saved_step = trainer.global_step

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        """An interruption (SIGTERM, Ctrl-C) saves ``last.ckpt`` so ``--ckpt_path last`` continues
        from there; any other failure (a diverged loss, a data error) keeps the last good one."""
        if not isinstance(exception, (SIGTERMException, KeyboardInterrupt)):
            return
        if (self.save_last and not trainer.sanity_checking and trainer.state.fn == "fit"
                and self._last_saved_step != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            log.warning("interrupted at step %d: saved %s; continue with --ckpt_path last",
                        trainer.global_step, self.last_model_path)


ALLOWED_CLASS_MODULES = ("vision_attn", "torch", "lightning", "pytorch_lightning")
# keys whose value is a class (given as a class_path or as a plain string)
_CLASS_KEYS = {"model", "data", "optimizer", "lr_scheduler", "strategy", "logger", "callbacks", "plugins", "profiler",
               "accelerator", "class_path"}


def _class_refs(obj: Any, where: str):
    """``(key, value)`` of every class reference in a parsed config value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{where}.{k}" if where else str(k)
            if k in _CLASS_KEYS and isinstance(v, str):
                yield key, v
            else:
                yield from _class_refs(v, key)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from (_class_refs(v, f"{where}[{i}]") if not isinstance(v, str) or where.split(".")[-1] not in _CLASS_KEYS
                        else [(f"{where}[{i}]", v)])


def check_class_paths(args: list[str]) -> None:
    """Refuse, before anything is imported or built, any class outside vision_attn, torch and
    Lightning named in the command line or in a ``--config`` file (importing a module runs its code)."""
    import yaml

    refs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key, value = (arg.split("=", 1) + [None])[:2] if arg.startswith("--") else (None, None)
        if key is not None and value is None and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 1
        i += 1
        if key is None or value is None:
            continue
        name = key.lstrip("-").rstrip("+")
        if name == "config":
            path = Path(value)
            if path.is_file():
                try:
                    refs += list(_class_refs(yaml.safe_load(path.read_text()), ""))
                except yaml.YAMLError as err:
                    raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
            continue
        last = name.split(".")[-1]
        if "class_path" in value or value.lstrip().startswith(("{", "[")):
            try:
                refs += list(_class_refs(yaml.safe_load(value), name))
            except yaml.YAMLError:
                pass
        elif last in _CLASS_KEYS:
            refs.append((name, value))
    for where, value in refs:
        module = value.split(".")[0]
        if "." in value and module not in ALLOWED_CLASS_MODULES:
            raise ConfigError(
                f"config key {where}: {value!r} is not a class of vision_attn, torch or Lightning; refusing to "
                "import it (a module's code runs when it is imported). Use one of the suite's classes."
            )


class _VisionAttnCLI(LightningCLI):
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        check_class_paths(list(sys.argv[1:] if args is None else args))
        super().parse_arguments(parser, args)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("run", False)
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(VisionTask, *args, **kwargs)


class TrainCLI(_VisionAttnCLI):
    """``train.py``: parse, build, fit."""

    def __init__(self, args: list[str] | None = None) -> None:
        super().__init__(
            save_config_callback=RunConfigCallback,
            save_config_kwargs={"config_filename": "config.yaml"},
            args=args,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="Resume training from this checkpoint ('last' = ROOT/checkpoints/last.ckpt).",
        )
        # used by eval.py; accepted so one YAML serves both
        parser.add_class_arguments(ExplainOptions, "explain")
        parser.add_class_arguments(GenerationOptions, "generate")
        parser.set_defaults({"trainer.default_root_dir": None, "seed_everything": 0})

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        if not cfg.trainer.get("default_root_dir"):
            names = [Path(str(c)).stem for c in (cfg.get("config") or [])]
            cfg.trainer.default_root_dir = str(Path("runs") / ("-".join(names) or "run"))

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        root = Path(config["default_root_dir"])
        monitor, mode = getattr(self.model, "monitor", ("val/loss", "min"))
        user = config.get("callbacks") or []
        if not any(isinstance(c, ModelCheckpoint) for c in user + callbacks):
            callbacks.append(
                RunCheckpoint(
                    dirpath=root / "checkpoints",
                    filename="best-{epoch:03d}-{step}",
                    monitor=monitor,
                    mode=mode,
                    save_last=True,
                    save_top_k=1,
                    auto_insert_metric_name=False,
                )
            )
        if config.get("logger") in (None, True):
            config["logger"] = [
                TensorBoardLogger(save_dir=str(root), name="tensorboard"),
                CSVLogger(save_dir=str(root), name="csv"),
            ]
        if config.get("logger") and not any(isinstance(c, LearningRateMonitor) for c in user + callbacks):
            callbacks.append(LearningRateMonitor(logging_interval="step"))
        self.save_config_kwargs["resuming"] = bool(self.config.get("ckpt_path"))
        return super()._instantiate_trainer(config, callbacks)


class EvalCLI(_VisionAttnCLI):
    """``eval.py``: the model (architecture, classes, preprocessing) comes from the checkpoint."""

    def __init__(self, args: list[str] | None = None) -> None:
        super().__init__(save_config_callback=None, args=args)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint to evaluate.")
        parser.add_argument("--output_dir", type=str, required=True, help="Where metrics.json etc. go.")
        parser.add_argument("--split", type=str | None, default=None,
                            help="Split folder to evaluate (default: the data's validation split).")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="Replace results already in --output_dir.")
        parser.add_class_arguments(ExplainOptions, "explain")
        parser.add_class_arguments(GenerationOptions, "generate")
        parser.set_defaults({"seed_everything": 0, "trainer.logger": False})

    def before_instantiate_classes(self) -> None:
        ckpt = self.config.ckpt_path
        if ckpt == "last" and self.config.trainer.get("default_root_dir"):
            ckpt = str(Path(self.config.trainer.default_root_dir) / "checkpoints" / "last.ckpt")
        self.ckpt_meta, self.ckpt = read_task_meta(ckpt)
        self.ckpt_file = ckpt
        out = Path(self.config.output_dir)
        _check_writable(out)
        existing = [p.name for p in (out / "metrics.json", out / "predictions.json") if p.exists()]
        if existing and not self.config.overwrite:
            raise RunExistsError(
                f"{out} already holds evaluation results ({', '.join(existing)}); "
                "pass another --output_dir or --overwrite true"
            )
        # The data and trainer come from the config; the model (architecture, class names,
        # preprocessing) from the checkpoint, exactly as it was trained, with no download.
        model_cfg = self.ckpt_meta["model"]
        config_class = self.config.model.class_path
        what = f"checkpoint {ckpt}"
        if resolve_class(config_class, VisionTask, what) is not resolve_class(model_cfg["class_path"], VisionTask, what):
            raise CheckpointError(
                f"checkpoint {ckpt} holds a {self.ckpt_meta.get('task')!r} model ({model_cfg['class_path']}) "
                f"but the config describes {config_class}"
            )
        self.config.model = None
        self.config = self.parser.parse_object({"model": model_cfg}, self.config)

    def after_instantiate_classes(self) -> None:
        restore_from_checkpoint(self.model, self.ckpt_meta, self.ckpt, f"checkpoint {self.ckpt_file}")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        config["enable_checkpointing"] = False
        config["default_root_dir"] = self.config.output_dir
        return super()._instantiate_trainer(config, callbacks)


class _SplitData(L.LightningDataModule):
    """One split of a task's datamodule for ``trainer.test``. The loader is built when Lightning
    asks for it — after the processes of a distributed run have started — so that it samples
    every image exactly once (see :mod:`vision_attn.data.loading`)."""

    def __init__(self, datamodule: L.LightningDataModule, split: str) -> None:
        super().__init__()
        self.datamodule, self.split = datamodule, split
        self.loader = None

    def test_dataloader(self):
        self.loader = self.datamodule.eval_dataloader(self.split)
        return self.loader


def train_main(args: list[str] | None = None) -> TrainCLI:
    """Entry point of ``train.py``."""
    cli = TrainCLI(args=args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.ckpt_path)
    if cli.trainer.is_global_zero:
        root = Path(cli.trainer.default_root_dir)
        log.info("run written to %s (config.yaml, checkpoints/, tensorboard/, csv/)", root)
    return cli


def eval_main(args: list[str] | None = None) -> dict[str, float]:
    """Entry point of ``eval.py``: returns the metrics it wrote."""
    cli = EvalCLI(args=args)
    dm, model, trainer = cli.datamodule, cli.model, cli.trainer
    model.configure_datamodule(dm)
    if hasattr(model, "set_generation"):
        model.set_generation(cli.config_init.generate)
    split = cli.config.split or dm.val_split
    data = _SplitData(dm, split)
    trainer.test(model, datamodule=data, verbose=False)
    metrics, predictions = model.eval_results(data.loader.dataset)
    if trainer.is_global_zero:
        out = Path(cli.config.output_dir)
        model.eval()
        options = cli.config_init.explain
        report = Report() if options.report else None
        metrics.update(model.explain_eval(data.loader.dataset, options, out, report=report))
        write_json_atomic(out / "predictions.json", predictions)
        write_json_atomic(out / "metrics.json", metrics)
        if report is not None:
            summary = {"checkpoint": str(cli.ckpt_file), "split": split, "model": cli.ckpt_meta["model"],
                       "preprocessing": cli.ckpt_meta.get("data_config"), "data": cli.config.data.as_dict()}
            write_report(out / "report.html", f"vision_attn {model.task_name} evaluation", metrics, summary,
                         report.items, report.curves)
        log.info("evaluation of %s on split %r written to %s", cli.ckpt_file, split, out)
    return metrics


def one_line(err: BaseException) -> str:
    """The message of ``err``; for errors re-raised from a DataLoader worker, the original one."""
    text = str(err)
    if "Original Traceback" in text:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1]
        return last.split(": ", 1)[1] if ": " in last and last.split(": ", 1)[0].endswith("Error") else last
    return text


def run_entry(fn) -> None:
    """Run a command entry point: errors we anticipate become one clear line, exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("faster_coco_eval").setLevel(logging.WARNING)  # its per-evaluation summary tables
    torch.set_float32_matmul_precision("high")
    ours = (VisionAttnError,)
    try:
        fn()
    except SIGTERMException:
        sys.stderr.write("interrupted by SIGTERM: last.ckpt holds the state; continue with --ckpt_path last\n")
        raise SystemExit(143) from None
    except (*ours, ValueError, RuntimeError, TypeError) as err:
        if os.environ.get("VISION_ATTN_DEBUG"):
            raise
        # jsonargparse wraps errors raised while building classes: report the original one.
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, ours):
            cause = cause.__cause__ or cause.__context__
        sys.stderr.write(f"error: {one_line(cause or err)}\n(set VISION_ATTN_DEBUG=1 for the traceback)\n")
        raise SystemExit(2) from None
