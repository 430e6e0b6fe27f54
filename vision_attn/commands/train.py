"""``vision-attn fit`` / ``python train.py --config CFG [--config MORE] [--section.key value ...]``.

Outputs under ``--trainer.default_root_dir`` (default ``runs/<config name>``)::

    ROOT/config.yaml              resolved config of the run
    ROOT/checkpoints/last.ckpt    latest state (resume with --ckpt_path last)
    ROOT/checkpoints/best-*.ckpt  best by the task's validation metric
    ROOT/tensorboard/version_N/   TensorBoard logs
    ROOT/csv/version_N/           metrics.csv

``--trainer.enable_checkpointing false`` writes no checkpoint (a timing or a trial run).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from vision_attn.checkpoint_io import SafeCheckpointIO, check_checkpoint_file
from vision_attn.commands.args import _config_class_paths, _take_flag
from vision_attn.commands.callbacks import RunCheckpoint, RunConfigCallback
from vision_attn.commands.lightning import _VisionAttnCLI
from vision_attn.commands.options import add_eval_options, config_task_class, usable_task_classes
from vision_attn.commands.run import run_entry
from vision_attn.errors import CheckpointError, ConfigError
from vision_attn.schema import check_limits
from vision_attn.tasks.base import (
    VisionTask,
    checked_data_settings,
    resolve_class,
)

log = logging.getLogger("vision_attn")


class TrainCLI(_VisionAttnCLI):
    """``vision-attn fit`` / ``train.py``: parse, build, fit.

    ``--print_config`` prints the config the run will really use: its folder
    (``trainer.default_root_dir``), loggers and callbacks included. ``--help`` after
    ``--config CFG`` also lists the model and data options of the classes that CFG names.
    """

    def __init__(self, args: list[str] | None = None) -> None:
        argv = list(sys.argv[1:] if args is None else args)
        if argv[:1] == ["fit"]:  # train.py fit --config ... (LightningCLI's spelling)
            argv = argv[1:]
        argv, self.print_run_config = _take_flag(argv, "--print_config")
        super().__init__(
            save_config_callback=RunConfigCallback,
            save_config_kwargs={"config_filename": "config.yaml"},
            args=argv,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="Resume training from this local checkpoint file ('last' = ROOT/checkpoints/last.ckpt). "
            "It is read without executing pickled code (weights_only); URLs are refused.",
        )
        # The optimiser and scheduler, as LightningCLI spells them (default: AdamW + warmup-cosine);
        # learning rates and weight decay stay in --model.optim (per parameter group).
        parser.add_optimizer_args((torch.optim.Optimizer,), nested_key="optimizer", link_to="AUTOMATIC")
        parser.add_lr_scheduler_args(nested_key="lr_scheduler", link_to="AUTOMATIC")
        # evaluation's options (the explanations' and the tasks' own), accepted so that one YAML serves fit
        # and validate; not listed in fit's --help
        tasks = [*usable_task_classes(self.allow_import), config_task_class(self._argv, self.allow_import)]
        add_eval_options(parser, tasks, hidden=True)
        parser.set_defaults({"trainer.default_root_dir": None, "seed_everything": 0})

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if any(a in ("-h", "--help") for a in self._argv):
            named = _config_class_paths(self._argv)
            for argv in ([a for a in self._argv if a not in ("-h", "--help")] + ["--help"],
                         *(["--" + key + ".help", path] for key, path in named.items())):
                with contextlib.suppress(SystemExit):
                    parser.parse_args(argv)
                    break
            raise SystemExit(0)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        if not cfg.trainer.get("default_root_dir"):
            names = [Path(str(c)).stem for c in (cfg.get("config") or [])]
            cfg.trainer.default_root_dir = str(Path("runs") / ("-".join(names) or "run"))
        if self.print_run_config:
            self._print_run_config()
            raise SystemExit(0)
        check_resume_path(cfg.get("ckpt_path"), Path(cfg.trainer.default_root_dir))
        model = cfg.get("model")
        model = model.as_dict() if hasattr(model, "as_dict") else model
        check_limits((model or {}).get("init_args") or {}, "the config", "model.init_args", ConfigError)

    def _monitor(self) -> tuple[str, str]:
        cls = resolve_class(self.config.model.class_path, VisionTask, "--model", self.allow_import)
        return getattr(cls, "monitor", ("val/loss", "min"))

    def _run_defaults(self, root: Path, user_callbacks: list[Any], logger: Any, is_checkpoint, is_lr_monitor,
                      checkpointing: bool) -> tuple[Any, list[dict[str, Any]]]:
        """``(logger, callbacks to add)`` of a run into ``root``, as ``{class_path, init_args}``:
        TensorBoard + CSV loggers unless the config chose; the best-and-last checkpoint unless
        the config has a checkpoint callback or switched checkpoints off (``checkpointing``, the
        trainer's ``enable_checkpointing``); a learning-rate monitor when anything logs."""
        monitor, mode = self._monitor()
        added = []
        if checkpointing and not any(is_checkpoint(c) for c in user_callbacks):
            added.append({"class_path": "vision_attn.commands.callbacks.RunCheckpoint", "init_args": {
                "dirpath": str(root / "checkpoints"), "filename": "best-{epoch:03d}-{step}", "monitor": monitor,
                "mode": mode, "save_last": True, "save_top_k": 1, "auto_insert_metric_name": False}})
        if logger in (None, True):
            logger = [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(root), "name": "tensorboard"}},
                      {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(root), "name": "csv"}}]
        if logger and not any(is_lr_monitor(c) for c in user_callbacks):
            added.append({"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                          "init_args": {"logging_interval": "step"}})
        return logger, added

    def _print_run_config(self) -> None:
        cfg = yaml.safe_load(self.parser.dump(self.config, skip_none=False, skip_validation=True))
        trainer = cfg.setdefault("trainer", {})
        user = trainer.get("callbacks") or []

        def named(*suffixes: str):
            return lambda c: isinstance(c, dict) and str(c.get("class_path", "")).endswith(suffixes)

        logger, added = self._run_defaults(Path(trainer["default_root_dir"]), user, trainer.get("logger"),
                                           named("ModelCheckpoint", "RunCheckpoint"), named("LearningRateMonitor"),
                                           trainer.get("enable_checkpointing") is not False)
        trainer["logger"], trainer["callbacks"] = logger, [*user, *added]
        cfg.pop("print_config", None)
        sys.stdout.write(yaml.safe_dump(cfg, sort_keys=False))

    def after_instantiate_classes(self) -> None:
        if not hasattr(self, "model"):  # a parse-only subclass (tests) built nothing
            return

        def spec(key: str) -> dict[str, Any] | None:
            value = self.config.get(key)
            return value.as_dict() if hasattr(value, "as_dict") else (dict(value) if value else None)

        self.model.optimizer_init = spec("optimizer")
        self.model.lr_scheduler_init = spec("lr_scheduler")
        data = spec("data")
        try:
            # saved in checkpoints: evaluation needs no config
            self.model.run_data = checked_data_settings({"data": data}, "the data settings")
        except CheckpointError as err:
            log.warning("the data settings are not plain data, so checkpoints will not hold them (%s); "
                        "evaluate with --config", err)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        root = Path(config["default_root_dir"])
        user = config.get("callbacks") or []
        logger, added = self._run_defaults(root, user + callbacks, config.get("logger"),
                                           lambda c: isinstance(c, ModelCheckpoint),
                                           lambda c: isinstance(c, LearningRateMonitor),
                                           config.get("enable_checkpointing") is not False)
        classes = {"vision_attn.commands.callbacks.RunCheckpoint": RunCheckpoint,
                   "lightning.pytorch.callbacks.LearningRateMonitor": LearningRateMonitor,
                   "lightning.pytorch.loggers.TensorBoardLogger": TensorBoardLogger,
                   "lightning.pytorch.loggers.CSVLogger": CSVLogger}

        def build(c: Any) -> Any:
            return classes[c["class_path"]](**c["init_args"]) if isinstance(c, dict) else c

        config["logger"] = [build(c) for c in logger] if isinstance(logger, list) else logger
        callbacks.extend(build(c) for c in added)
        self.save_config_kwargs["resuming"] = bool(self.config.get("ckpt_path"))
        trainer = super()._instantiate_trainer(config, callbacks)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            # resuming reads the checkpoint with the suite's safe loader (weights_only, local, bounded)
            trainer.strategy.checkpoint_io = SafeCheckpointIO()
        return trainer


# ``ckpt_path`` values that Lightning resolves to a checkpoint its own callbacks wrote locally
RESUME_KEYWORDS = ("last", "best", "hpc")


def check_resume_path(ckpt_path: str | None, root: Path) -> None:
    """Refuse, before anything is built, a ``--ckpt_path`` that is not a local checkpoint that
    the safe loader reads: a URL or other scheme, Lightning's ``registry`` downloads, a missing
    file, pickled code, an oversized or zip-bomb file. ``last`` is checked when it exists."""
    if not ckpt_path:
        return
    if ckpt_path in RESUME_KEYWORDS:
        if ckpt_path == "last" and (root / "checkpoints" / "last.ckpt").is_file():
            check_checkpoint_file(root / "checkpoints" / "last.ckpt")
        return
    if ckpt_path == "registry" or ckpt_path.startswith("registry:"):
        raise CheckpointError(
            f"--ckpt_path {ckpt_path}: downloading checkpoints is not supported; download it, check "
            "where it comes from, and pass the local file"
        )
    check_checkpoint_file(ckpt_path)


def train_main(args: list[str] | None = None) -> TrainCLI:
    """Entry point of ``train.py``."""
    cli = TrainCLI(args=args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.ckpt_path, weights_only=True)
    if cli.trainer.is_global_zero:
        root = Path(cli.trainer.default_root_dir)
        log.info("run written to %s (config.yaml, checkpoints/, tensorboard/, csv/)", root)
    return cli


def command(argv: list[str]) -> None:
    """``vision-attn fit ARGS``: :func:`train_main` under the one error policy."""
    run_entry(lambda: train_main(argv))
