"""What a config may import: an explicit list of classes, and ``--allow_import`` on the command line.

Importing a module runs its code, and building a class runs its constructor. The policy names
exact classes (see :func:`allowed_class_paths`), never whole packages, and is enforced where the
config parser (jsonargparse) turns a dotted path into an object (:func:`import_guard`).
The documentation's security page lists the classes and the refused modules.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch

from vision_attn.commands.callbacks import RunCheckpoint
from vision_attn.data import CaptioningDataModule, DetectionDataModule, ImageFolderDataModule, ImagesDataModule
from vision_attn.data.synthetic import DigitSceneConfig, SceneSetConfig, ShapesConfig
from vision_attn.distributed import BlockFSDPStrategy
from vision_attn.errors import ConfigError
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.models import ViTEncoder
from vision_attn.tasks.base import (
    TASKS,
)
from vision_attn.tasks.optim import Optimization

log = logging.getLogger("vision_attn")


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
    "lightning.fabric.utilities.cloud_io", "lightning_fabric.utilities.cloud_io",
    "lightning.pytorch.cli.instantiate_class", "pytorch_lightning.cli.instantiate_class",
    "lightning.pytorch.cli.LightningCLI", "pytorch_lightning.cli.LightningCLI",
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


# Paths that configs written by earlier versions name (kept for one version; they warn when used).
DEPRECATED_CLASS_PATHS = ("vision_attn.cli.RunCheckpoint",)
_DENIED = re.compile(r"Importing '([^']+)' is not allowed, denied by the '([^']+)' entry")


_GUARD_BASE: list[dict[str, bool]] = []  # jsonargparse's verdicts before the outermost guard


def _suite_classes() -> list[type]:
    """The suite's own classes a config may name: its registered tasks, the encoder, the data
    modules and their generated-data settings, the option groups, the checkpoint callback and the
    sharding strategy."""
    tasks = [cls for cls in TASKS.values() if cls.__module__.split(".")[0] == "vision_attn"]
    options = [cls.inference_options for cls in tasks if cls.inference_options is not None]  # the tasks' own
    return [*tasks, ViTEncoder, ImageFolderDataModule, DetectionDataModule, CaptioningDataModule, ImagesDataModule,
            ShapesConfig, SceneSetConfig, DigitSceneConfig, Optimization, ExplainOptions, *options,
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
    public = ("vision_attn", "vision_attn.tasks", "vision_attn.models", "vision_attn.data", "vision_attn.distributed",
              "vision_attn.data.synthetic", "vision_attn.commands.train")
    for cls in _suite_classes():
        for module_name in public:
            if getattr(sys.modules.get(module_name), cls.__name__, None) is cls:
                classes[f"{module_name}.{cls.__name__}"] = cls
    paths = set(classes) | set(DEPRECATED_CLASS_PATHS)
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
    saved = (settings["import_path_verdicts"], settings["import_paths_enforced"],
             settings.get("instantiate_subclass_spec_in_any"))
    _GUARD_BASE.append(_GUARD_BASE[0] if _GUARD_BASE else dict(saved[0]))
    settings["import_path_verdicts"] = dict(_GUARD_BASE[-1])
    try:
        denied = [m for m in CODE_LOADING_MODULES if m != "jsonargparse"]
        set_parsing_settings(import_path_denylist=["*", *denied],
                             import_path_allowlist=[*allowed_class_paths(), *extra])
        if "instantiate_subclass_spec_in_any" in settings:  # a class path where any value goes stays data
            settings["instantiate_subclass_spec_in_any"] = False
        yield
    finally:
        settings["import_path_verdicts"], settings["import_paths_enforced"] = saved[:2]
        if "instantiate_subclass_spec_in_any" in settings:
            settings["instantiate_subclass_spec_in_any"] = saved[2]
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
