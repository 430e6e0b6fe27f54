"""The LightningCLI shared by ``train.py`` and ``eval.py``.

``python train.py --config CFG [--config MORE] [--section.key value ...]`` trains, writing into
``--trainer.default_root_dir`` (default ``runs/<config name>``)::

    ROOT/config.yaml              resolved config of the run
    ROOT/checkpoints/last.ckpt    latest state (resume with --ckpt_path last)
    ROOT/checkpoints/best-*.ckpt  best by the task's validation metric
    ROOT/tensorboard/version_N/   TensorBoard logs
    ROOT/csv/version_N/           metrics.csv

``python eval.py --config CFG --ckpt_path CKPT --output_dir OUT`` evaluates a checkpoint and
writes ``OUT/metrics.json``, ``OUT/predictions.json`` and the task's own files beside them
(:meth:`~vision_attn.tasks.base.VisionTask.eval_files`, e.g. ``per_class.json``).

What a config may import is checked where the parser resolves dotted paths (see
:func:`import_guard`): vision_attn, torch and Lightning only, unless ``--allow_import PREFIX`` is
given on the command line. Checkpoints (``--ckpt_path``) are local files read with
``weights_only=True`` and a bounded size (:mod:`vision_attn.checkpoint_io`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vision_attn.checkpoint_io import SafeCheckpointIO, check_checkpoint_file
from vision_attn.errors import CheckpointError, ConfigError, RunExistsError, VisionAttnError
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.explain.report import Report, read_training_curves, write_report
from vision_attn.models.captioner import GenerationOptions
from vision_attn.outputs import write_json
from vision_attn.schema import check_limits
from vision_attn.tasks.base import (
    TASKS,
    VisionTask,
    checked_data_settings,
    read_task_meta,
    resolve_class,
    restore_from_checkpoint,
)

__all__ = ["EvalCLI", "TrainCLI", "eval_main", "train_main"]

log = logging.getLogger("vision_attn")


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


# ---------------------------------------------------------------------------------------------
# What a config may import. Importing a module runs its code, and building a class runs its
# constructor, so the check sits where the parser (jsonargparse) turns a dotted path from any
# value (class_path, a class or callable given as a string, on the command line, in a --config
# file or string, in a group file such as --trainer FILE) into an object: jsonargparse's
# import-path policy, enforced for the whole of parsing and building. The policy names exact
# *classes*, not packages (torch and Lightning themselves hold classes that start processes,
# unpickle or download); everything else needs --allow_import on the command line.

# Lightning's and torch's classes a config may name, by their public paths (the modules that
# define them are added from the objects).
_TORCH_LIGHTNING_CLASSES = {
    "lightning.pytorch.callbacks": (
        "BackboneFinetuning", "BatchSizeFinder", "DeviceStatsMonitor", "EarlyStopping", "EMAWeightAveraging",
        "GradientAccumulationScheduler", "LambdaCallback", "LearningRateFinder", "LearningRateMonitor",
        "ModelCheckpoint", "ModelPruning", "ModelSummary", "OnExceptionCheckpoint", "RichModelSummary",
        "RichProgressBar", "SpikeDetection", "StochasticWeightAveraging", "ThroughputMonitor", "Timer",
        "TQDMProgressBar", "WeightAveraging"),
    "lightning.pytorch.loggers": ("CSVLogger", "TensorBoardLogger"),
    "lightning.pytorch.strategies": ("DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "SingleDeviceStrategy"),
    "lightning.pytorch.profilers": ("AdvancedProfiler", "PassThroughProfiler", "PyTorchProfiler", "SimpleProfiler"),
    "lightning.pytorch.plugins.environments": (
        "KubeflowEnvironment", "LightningEnvironment", "LSFEnvironment", "MPIEnvironment", "SLURMEnvironment",
        "TorchElasticEnvironment"),
    "lightning.pytorch.cli": ("ReduceLROnPlateau",),
}
# Modules that fetch, unpickle, compile or run code. Denied even when a prefix above them is
# allowed (the most specific entry wins), and refused as --allow_import prefixes.
CODE_LOADING_MODULES = (
    "torch.hub", "torch.load", "torch.serialization", "torch.package", "torch.jit", "torch.utils.cpp_extension",
    "torch.utils.model_zoo", "torch.ops", "torch.classes", "torch._inductor", "torch._dynamo", "torch.compiler",
    "torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher", "torch.multiprocessing",
    "lightning.fabric.utilities.cloud_io", "lightning_fabric.utilities.cloud_io", "lightning.pytorch.cli.instantiate_class",
    "pytorch_lightning.cli.instantiate_class", "lightning.pytorch.cli.LightningCLI", "pytorch_lightning.cli.LightningCLI",
    "builtins", "dill", "joblib", "cloudpickle", "numpy", "pickle", "_pickle", "marshal", "shelve", "importlib",
    "runpy", "code", "codeop", "ctypes", "pydoc", "pkgutil", "zipimport", "webbrowser", "urllib", "http", "socket",
    "requests", "fsspec", "huggingface_hub", "timm", "jsonargparse", "yaml",
)
DENIED_IMPORTS = CODE_LOADING_MODULES  # the name earlier versions exported
ALLOW_IMPORT_FLAG = "--allow_import"
ALLOW_IMPORT_HELP = (
    "Also allow the config to import classes and callables from modules under this prefix, or one class by "
    "its full path (repeatable, command line only, e.g. --allow_import my_callbacks). By default a config "
    "may only name the suite's own tasks, encoders, data modules and callbacks, and torch's and Lightning's "
    "optimizers, schedulers, callbacks, loggers and strategies: importing a module runs its code, so allow "
    "only code you trust. Never taken from a config file or a checkpoint."
)
_DENIED = re.compile(r"Importing '([^']+)' is not allowed, denied by the '([^']+)' entry")
_GUARD_BASE: list[dict[str, bool]] = []  # jsonargparse's verdicts before the outermost guard


def _suite_classes() -> list[type]:
    """The suite's own classes a config may name: its registered tasks, the encoder, the data
    modules and their generated-data settings, the option groups, the checkpoint callback and the
    sharding strategy."""
    from vision_attn.data import CaptioningDataModule, DetectionDataModule, ImageFolderDataModule
    from vision_attn.data.synthetic import DigitSceneConfig, SceneSetConfig, ShapesConfig
    from vision_attn.distributed import BlockFSDPStrategy
    from vision_attn.models import ViTEncoder
    from vision_attn.tasks.optim import Optimization

    tasks = [cls for cls in TASKS.values() if cls.__module__.split(".")[0] == "vision_attn"]
    return [*tasks, ViTEncoder, ImageFolderDataModule, DetectionDataModule, CaptioningDataModule,
            ShapesConfig, SceneSetConfig, DigitSceneConfig, Optimization, ExplainOptions, GenerationOptions,
            RunCheckpoint, BlockFSDPStrategy]


def allowed_class_paths() -> list[str]:
    """Every import path by which a config may name a class without ``--allow_import``: each
    class's defining path and its public ones (``torch.optim.AdamW`` and
    ``torch.optim.adamw.AdamW``). Optimizers and schedulers are torch's (all of
    ``torch.optim`` and ``torch.optim.lr_scheduler``); the rest are listed by name."""
    import importlib

    classes: dict[str, type] = {}
    for module_name, names in _TORCH_LIGHTNING_CLASSES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if isinstance(getattr(module, name, None), type):
                classes[f"{module_name}.{name}"] = getattr(module, name)
    for module, base in ((torch.optim, torch.optim.Optimizer),
                         (torch.optim.lr_scheduler, (torch.optim.lr_scheduler.LRScheduler,
                                                     torch.optim.lr_scheduler.ReduceLROnPlateau))):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, base) and obj not in (torch.optim.Optimizer,
                                                                                 torch.optim.lr_scheduler.LRScheduler):
                classes[f"{module.__name__}.{name}"] = obj
    public = ("vision_attn", "vision_attn.tasks", "vision_attn.models", "vision_attn.data", "vision_attn.cli",
              "vision_attn.distributed", "vision_attn.data.synthetic")
    for cls in _suite_classes():
        for module_name in public:
            if getattr(sys.modules.get(module_name), cls.__name__, None) is cls:
                classes[f"{module_name}.{cls.__name__}"] = cls
    paths = set(classes)
    paths.update(f"{cls.__module__}.{cls.__qualname__}" for cls in classes.values())
    return sorted(paths)


def _parsing_settings() -> dict[str, Any]:
    from jsonargparse import _common

    return _common.parsing_settings


@contextlib.contextmanager
def import_guard(extra: tuple[str, ...] = ()) -> Iterator[None]:
    """While active, the parser imports nothing but the classes of :func:`allowed_class_paths`
    and what ``extra`` allows (never :data:`CODE_LOADING_MODULES`): a value naming anything
    else is a parse error. The parser's previous settings are restored on exit, so nothing leaks
    into other parsers of the process."""
    from jsonargparse import set_parsing_settings

    settings = _parsing_settings()
    if "import_path_verdicts" not in settings:  # fail closed on a jsonargparse without the policy
        raise ConfigError("vision_attn needs jsonargparse >= 4.53 (its import-path policy); upgrade it")
    saved = (settings["import_path_verdicts"], settings["import_paths_enforced"])
    _GUARD_BASE.append(_GUARD_BASE[0] if _GUARD_BASE else dict(saved[0]))
    settings["import_path_verdicts"] = dict(_GUARD_BASE[-1])
    try:
        denied = [m for m in CODE_LOADING_MODULES if m != "jsonargparse"]
        set_parsing_settings(import_path_denylist=["*", *denied],
                             import_path_allowlist=[*allowed_class_paths(), *extra])
        yield
    finally:
        settings["import_path_verdicts"], settings["import_paths_enforced"] = saved
        _GUARD_BASE.pop()


def split_allow_import(args: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """``(other args, prefixes)``: the ``--allow_import PREFIX`` options taken out of ``args``.

    Raises:
        ConfigError: for a prefix that is not a dotted module path, one inside a module that can
            fetch, unpickle or run code (:data:`CODE_LOADING_MODULES` and jsonargparse's own
            list: ``os``, ``subprocess``, ...), and for an abbreviation of the flag.
    """
    rest: list[str] = []
    prefixes: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in (ALLOW_IMPORT_FLAG, ALLOW_IMPORT_FLAG + "+"):
            if "=" in arg:
                prefixes.append(arg.split("=", 1)[1])
            elif i + 1 >= len(args):
                raise ConfigError(
                    f"{ALLOW_IMPORT_FLAG} needs a module prefix, e.g. {ALLOW_IMPORT_FLAG} my_callbacks"
                )
            else:
                prefixes.append(args[i + 1])
                i += 1
        elif len(name) > 4 and name != ALLOW_IMPORT_FLAG and ALLOW_IMPORT_FLAG.startswith(name):
            raise ConfigError(f"{name}: spell the option out in full as {ALLOW_IMPORT_FLAG}")
        else:
            rest.append(arg)
        i += 1
    for prefix in prefixes:
        refuse_import_prefix(prefix)
    return rest, tuple(prefixes)


def refuse_import_prefix(prefix: str) -> None:
    """Raise :class:`ConfigError` for an ``--allow_import`` value that is not a dotted path or that
    lies inside a module that fetches, unpickles or runs code."""
    from jsonargparse._common import default_import_path_denylist

    if not prefix or not all(p.isidentifier() for p in prefix.split(".")):
        raise ConfigError(
            f"{ALLOW_IMPORT_FLAG} {prefix!r}: give a module prefix such as my_pkg or my_pkg.callbacks"
        )
    parts = prefix.split(".")
    parents = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
    risky = [e for e in (*CODE_LOADING_MODULES, *default_import_path_denylist) if e in parents]
    if risky:
        raise ConfigError(
            f"{ALLOW_IMPORT_FLAG} {prefix!r} is refused: {risky[0]} can run commands, load pickled or remote "
            "code or change the import policy; put the code you need in a module of your own"
        )


def _import_refused(message: str, key: str | None = None) -> ConfigError | None:
    """Our clear error for a jsonargparse import-policy denial in ``message`` (else None)."""
    match = _DENIED.search(message)
    if not match:
        return None
    path, entry = match.groups()
    where = key or (re.search(r'[Kk]ey "([^"]+)"', message) or [None, None])[1]
    prefix = f"config key {where}: " if where else ""
    if entry != "*":
        return ConfigError(
            f"{prefix}refusing to import {path!r}: {entry} can fetch, load or run code, which a config "
            "may not ask for"
        )
    top = path.split(".")[0]
    hint = path if top in ("vision_attn", "torch", "lightning") else top
    return ConfigError(
        f"{prefix}refusing to import {path!r}: it is not one of the classes a config may name (the suite's "
        "tasks, encoders, data modules and callbacks; torch's and Lightning's optimizers, schedulers, "
        "callbacks, loggers and strategies), and importing runs code. If you trust it, allow it explicitly "
        f"on the command line with {ALLOW_IMPORT_FLAG} {hint}"
    )


class _GuardedParser(LightningArgumentParser):
    """The command's parser: an import refused by :func:`import_guard` is a :class:`ConfigError`
    (one clear line from ``train.py`` / ``eval.py``) instead of a usage dump."""

    main: bool = False

    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        if self.main:
            cause: BaseException | None = ex
            while cause is not None and not isinstance(cause, ConfigError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:  # refused inside a --config string or file: already ours
                raise cause
            refused = _import_refused(message)
            if refused is not None:
                raise refused from ex
            if not os.environ.get("VISION_ATTN_DEBUG"):
                sys.stderr.write(f"error: {condense_parse_error(message)}\n"
                                 f"(see {self.prog} --help; VISION_ATTN_DEBUG=1 shows the parser's whole message)\n")
                raise SystemExit(2)
        return super().error(message, ex)


_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_GIVEN = re.compile(r"(Got value|Given value): .*")
_EXPECTED = re.compile(r"Expected an? <class '([^']+)'>")


def condense_parse_error(message: str, width: int = 240) -> str:
    """One line from jsonargparse's nested error message: the full key (``model.encoder.preprocess``)
    and the innermost reason, with long values cut."""
    keys: list[str] = []
    for key in _PARSER_KEY.findall(message):
        if not keys or keys[-1] != key:
            keys.append(key)
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    skip = ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Given value type", "Problem with given")
    reasons = [ln for ln in lines if not ln.startswith(skip) and not ln.startswith("Given value:")]
    expected = [m.group(1) for ln in reasons if (m := _EXPECTED.match(ln))]
    if len(set(expected)) > 1:
        given = next((m.group(0) for ln in lines if (m := _GIVEN.search(ln))), "")
        reason = f"expected one of {', '.join(dict.fromkeys(expected))}" + (f"; {given}" if given else "")
    else:
        reason = reasons[0] if reasons else lines[0] if lines else message
    reason = _GIVEN.sub(lambda m: m.group(0)[:80] + ("..." if len(m.group(0)) > 80 else ""), reason)
    text = f"config key {'.'.join(keys)}: {reason}" if keys else reason
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


_DATACLASS_FIELD = re.compile(r"--model\.(?:init_args\.)?optim\.(\w+)")
_NULLS = ("null", "none", "~")


def _null_dataclass_fields(argv: list[str]) -> list[str]:
    """``argv`` with ``--model.optim.FIELD null`` given as ``--model.optim '{"FIELD": null}'``.

    jsonargparse (4.53) rejects a null given to one field of a dataclass inside a model's
    ``init_args`` ("Expected a <class 'NoneType'>, given value: None"); the mapping form sets the
    same field and keeps the others.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        match = _DATACLASS_FIELD.fullmatch(name)
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        if match and value.strip().lower() in _NULLS:
            out += ["--model.optim", json.dumps({match.group(1): None})]
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return out


class _VisionAttnCLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = kwargs.pop("args", None)
        self._argv, self.allow_import = split_allow_import(list(sys.argv[1:] if argv is None else argv))
        self._argv = _null_dataclass_fields(self._argv)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("run", False)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("parser_class", _GuardedParser)
        if self.allow_import:
            log.warning("%s: configs may also import from %s", ALLOW_IMPORT_FLAG,
                        ", ".join(self.allow_import))
        try:
            with import_guard(self.allow_import):
                super().__init__(VisionTask, *args, **kwargs)
        except ImportError as err:  # refused while building (jsonargparse's ImportDenied)
            refused = _import_refused(str(err))
            if refused is None:
                raise
            raise refused from err

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        parser.main = True
        parser.allow_abbrev = False  # options are spelled out: --trainer.max_epoch is not --trainer.max_epochs
        return parser

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_default_arguments_to_parser(parser)
        # Taken from the command line before parsing (imports happen while parsing); declared
        # here for --help, and so that one in a config file is refused, not ignored.
        parser.add_argument(ALLOW_IMPORT_FLAG, type=list[str], default=[], metavar="PREFIX",
                            help=ALLOW_IMPORT_HELP)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.config = parser.parse_args(self._argv)
        if self.config.get("allow_import"):
            raise ConfigError(
                f"allow_import {self.config.allow_import} comes from a config file (or an abbreviated "
                f"option); imports are allowed only by {ALLOW_IMPORT_FLAG} PREFIX, in full, on the "
                "command line"
            )


def _config_class_paths(argv: list[str]) -> dict[str, str]:
    """``{"model": class path, "data": class path}`` named by the ``--config`` files in ``argv``
    (read as plain YAML; later files win), for ``--help``."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if not path or not Path(path).is_file():
            continue
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        for key in ("model", "data"):
            spec = data.get(key) if isinstance(data, dict) else None
            if isinstance(spec, dict) and isinstance(spec.get("class_path"), str):
                found[key] = spec["class_path"]
    return found


def _take_flag(argv: list[str], flag: str) -> tuple[list[str], bool]:
    """``(argv without flag, whether it was there)`` for a switch given as ``flag`` or ``flag=...``."""
    rest = [a for a in argv if a != flag and not a.startswith(flag + "=")]
    return rest, len(rest) != len(argv)


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
        # used by eval.py; accepted so one YAML serves both
        parser.add_class_arguments(ExplainOptions, "explain")
        parser.add_class_arguments(GenerationOptions, "generate")
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

    def _run_defaults(self, root: Path, user_callbacks: list[Any], logger: Any,
                      is_checkpoint, is_lr_monitor) -> tuple[Any, list[dict[str, Any]]]:
        """``(logger, callbacks to add)`` of a run into ``root``, as ``{class_path, init_args}``:
        TensorBoard + CSV loggers unless the config chose; the best-and-last checkpoint unless
        the config has a checkpoint callback; a learning-rate monitor when anything logs."""
        monitor, mode = self._monitor()
        added = []
        if not any(is_checkpoint(c) for c in user_callbacks):
            added.append({"class_path": "vision_attn.cli.RunCheckpoint", "init_args": {
                "dirpath": str(root / "checkpoints"), "filename": "best-{epoch:03d}-{step}", "monitor": monitor,
                "mode": mode, "save_last": True, "save_top_k": 1, "auto_insert_metric_name": False}})
        if logger in (None, True):
            logger = [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(root), "name": "tensorboard"}},
                      {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root), "name": "csv"}}]
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
                                           named("ModelCheckpoint", "RunCheckpoint"), named("LearningRateMonitor"))
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
            self.model.run_data = checked_data_settings({"data": data}, "the data settings")  # saved in checkpoints: evaluation needs no config
        except CheckpointError as err:
            log.warning("the data settings are not plain data, so checkpoints will not hold them (%s); "
                        "evaluate with --config", err)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        root = Path(config["default_root_dir"])
        user = config.get("callbacks") or []
        logger, added = self._run_defaults(root, user + callbacks, config.get("logger"),
                                           lambda c: isinstance(c, ModelCheckpoint),
                                           lambda c: isinstance(c, LearningRateMonitor))
        classes = {"vision_attn.cli.RunCheckpoint": RunCheckpoint, "lightning.pytorch.callbacks.LearningRateMonitor":
                   LearningRateMonitor, "lightning.pytorch.loggers.TensorBoardLogger": TensorBoardLogger,
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


def _option_value(argv: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``) in ``argv``."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


class EvalCLI(_VisionAttnCLI):
    """``eval.py`` / ``vision-attn validate`` / ``test``: the model (architecture, classes,
    preprocessing) comes from the checkpoint; the data from ``--config`` or, without one that
    names data, from the data settings saved in the checkpoint (any key overridable, e.g.
    ``--data.init_args.root DIR``)."""

    def __init__(self, args: list[str] | None = None, default_split: str | None = None) -> None:
        from vision_attn.commands import normalize_flags

        argv = normalize_flags(list(sys.argv[1:] if args is None else args), valued_bools=("--overwrite",))
        self.default_split = default_split
        self._read: tuple[str, dict[str, Any], dict[str, Any]] | None = None  # (path, meta, checkpoint)
        super().__init__(save_config_callback=None, args=self._from_checkpoint(argv))

    def _from_checkpoint(self, argv: list[str]) -> list[str]:
        """``argv`` with the checkpoint's model (and its saved data settings, unless a config
        names data or ``--data`` is given) in front, so no ``--config`` is needed. The file is
        read once; building the model reuses what was read here."""
        rest, allowed = split_allow_import(argv)
        ckpt = _option_value(rest, "--ckpt_path")
        if not ckpt or any(a in ("-h", "--help") for a in rest) or ckpt == "last":
            return argv
        meta, checkpoint = read_task_meta(ckpt, allowed)
        self._read = (ckpt, meta, checkpoint)
        front = ["--model", json.dumps(meta["model"])]
        has_data = "data" in _config_class_paths(rest) or any(a == "--data" or a.startswith("--data=") for a in rest)
        if not has_data:
            data = checked_data_settings(meta, f"checkpoint {ckpt}")
            if data is None:
                if not any(a in ("--config", "-c") or a.startswith("--config=") for a in rest):
                    raise ConfigError(
                        f"checkpoint {ckpt} holds no data settings (it was written before they were saved); "
                        "pass the training config: --config CFG"
                    )
            else:
                front += ["--data", json.dumps(data)]
        return front + argv

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint to evaluate.")
        parser.add_argument("--output_dir", type=str, required=True, help="Where metrics.json etc. go.")
        parser.add_argument("--split", type=str | None, default=None,
                            help="Split to evaluate (default: the data's validation split; `vision-attn test`: its "
                                 "test split).")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="Replace results already in --output_dir (a bare --overwrite means true).")
        parser.add_argument("--merge_r", type=int, default=0,
                            help="Token merging (ToMe, Bolya et al. 2023): merge R tokens in every encoder block: "
                                 "faster, slightly less accurate (0: off, the model as trained).")
        parser.add_class_arguments(ExplainOptions, "explain")
        parser.add_class_arguments(GenerationOptions, "generate")
        parser.set_defaults({"seed_everything": 0, "trainer.logger": False})

    def before_instantiate_classes(self) -> None:
        ckpt = self.config.ckpt_path
        if ckpt == "last" and self.config.trainer.get("default_root_dir"):
            ckpt = str(Path(self.config.trainer.default_root_dir) / "checkpoints" / "last.ckpt")
        if self._read is not None and self._read[0] == ckpt:
            self.ckpt_meta, self.ckpt = self._read[1:]
            self._read = None
        else:
            self.ckpt_meta, self.ckpt = read_task_meta(ckpt, self.allow_import)
        self.ckpt_file = ckpt
        out = Path(self.config.output_dir)
        _check_writable(out)
        model_cfg = self.ckpt_meta["model"]
        what = f"checkpoint {ckpt}"
        task_cls = resolve_class(model_cfg["class_path"], VisionTask, what, self.allow_import)
        existing = [name for name in result_file_names(task_cls) if (out / name).exists()]
        if existing and not self.config.overwrite:
            raise RunExistsError(
                f"{out} already holds evaluation results ({', '.join(existing)}); "
                "pass another --output_dir or --overwrite true"
            )
        # The data and trainer come from the config; the model (architecture, class names,
        # preprocessing) from the checkpoint, exactly as it was trained, with no download.
        config_class = self.config.model.class_path
        if resolve_class(config_class, VisionTask, what, self.allow_import) is not task_cls:
            raise CheckpointError(
                f"checkpoint {ckpt} holds a {self.ckpt_meta.get('task')!r} model ({model_cfg['class_path']}) "
                f"but the config describes {config_class}"
            )
        self.config.model = None
        self.config = self.parser.parse_object({"model": model_cfg}, self.config)

    def after_instantiate_classes(self) -> None:
        restore_from_checkpoint(self.model, self.ckpt_meta, self.ckpt, f"checkpoint {self.ckpt_file}")
        if self.config.get("merge_r"):
            from vision_attn.merge import merge_tokens

            merge_tokens(self.model, int(self.config.merge_r))

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        config["enable_checkpointing"] = False
        config["default_root_dir"] = self.config.output_dir
        return super()._instantiate_trainer(config, callbacks)


RESULT_FILES = ("metrics.json", "predictions.json")  # what every task's evaluation writes


def result_file_names(task_cls: type[VisionTask]) -> list[str]:
    """The result files an evaluation into a folder refuses to overwrite (without ``--overwrite``):
    :data:`RESULT_FILES` and the task files (:attr:`~vision_attn.tasks.base.VisionTask.eval_file_names`)
    of ``task_cls`` and of every registered task, so that no earlier evaluation's files, whatever
    its task, are replaced or left beside new results that they do not describe."""
    names = list(RESULT_FILES)
    for cls in (task_cls, *TASKS.values()):
        names += [n for n in cls.eval_file_names if n not in names]
    return names


def _task_files(model: VisionTask, dataset: Any) -> dict[str, Any]:
    """``model.eval_files(dataset)``, checked against the names the task declared (those were
    checked for earlier results before evaluating)."""
    files = model.eval_files(dataset)
    undeclared = sorted(set(files) - set(model.eval_file_names))
    if undeclared or set(files) & set(RESULT_FILES):
        raise VisionAttnError(
            f"{type(model).__name__}.eval_files gave {sorted(files)}, but its eval_file_names declares "
            f"{list(model.eval_file_names)} (and may not name {', '.join(RESULT_FILES)}): declare every file it writes"
        )
    return files


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


def eval_main(args: list[str] | None = None, default_split: str | None = None) -> dict[str, float]:
    """Entry point of ``eval.py`` (``vision-attn validate``; ``test`` with ``default_split="test"``):
    returns the metrics it wrote."""
    cli = EvalCLI(args=args, default_split=default_split)
    dm, model, trainer = cli.datamodule, cli.model, cli.trainer
    model.configure_datamodule(dm)
    if hasattr(model, "set_generation"):
        model.set_generation(cli.config_init.generate)
    split = cli.config.split or (_test_split(dm) if cli.default_split == "test" else dm.val_split)
    data = _SplitData(dm, split)
    trainer.test(model, datamodule=data, verbose=False)
    metrics, predictions = model.eval_results(data.loader.dataset)
    if trainer.is_global_zero:
        out = Path(cli.config.output_dir)
        model.eval()
        options = cli.config_init.explain
        options.predictions = predictions  # the worst mistakes are explained too (--explain.mistakes)
        report = Report() if options.report else None
        files = _task_files(model, data.loader.dataset)  # of the test run, before the explanations run the model
        metrics.update(model.explain_eval(data.loader.dataset, options, out, report=report))
        write_json(out / "predictions.json", predictions, root=out)
        for name, content in files.items():
            write_json(out / name, content, root=out)
        for name in result_file_names(type(model)):  # an earlier evaluation's files (--overwrite)
            if name not in files and name not in RESULT_FILES and (out / name).is_file():
                log.info("removed %s: an earlier evaluation's file that this one does not write", out / name)
                (out / name).unlink()
        write_json(out / "metrics.json", metrics, root=out)
        if report is not None:
            summary = {"checkpoint": str(cli.ckpt_file), "split": split, "model": cli.ckpt_meta["model"],
                       "preprocessing": cli.ckpt_meta.get("data_config"), "data": cli.config.data.as_dict()}
            write_report(out / "report.html", f"vision_attn {model.task_name} evaluation", metrics, summary,
                         report.items, report.curves, root=out, task=model.task_name,
                         per_class=files.get("per_class.json"), confusion=files.get("confusion_matrix.json"),
                         predictions=predictions, training_curves=read_training_curves(cli.ckpt_file),
                         split_size=len(data.loader.dataset), pr_curves=files.get("pr_curves.json"))
        log.info("evaluation of %s on split %r written to %s", cli.ckpt_file, split, out)
    return metrics


def _test_split(dm: Any) -> str:
    split = getattr(dm, "test_split", None)
    if not split:
        raise ConfigError(f"{type(dm).__name__} has no test split; pass --split NAME or use vision-attn validate")
    return split


def one_line(err: BaseException) -> str:
    """The message of ``err``; for errors re-raised from a DataLoader worker, the original one."""
    text = str(err)
    if "Original Traceback" in text:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1]
        return last.split(": ", 1)[1] if ": " in last and last.split(": ", 1)[0].endswith("Error") else last
    if "\n" in text.strip():  # jsonargparse's nested report of a value it could not build
        return condense_parse_error(text)
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
    except (*ours, ValueError, RuntimeError, TypeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError) as err:
        if os.environ.get("VISION_ATTN_DEBUG"):
            raise
        # jsonargparse wraps errors raised while building classes: report the original one.
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, ours):
            cause = cause.__cause__ or cause.__context__
        sys.stderr.write(f"error: {one_line(cause or err)}\n(set VISION_ATTN_DEBUG=1 for the traceback)\n")
        raise SystemExit(2) from None
