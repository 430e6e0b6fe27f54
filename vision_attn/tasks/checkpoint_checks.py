"""Checks of what a checkpoint describes, made before anything is imported or built from it.

- :func:`resolve_class`: a class path, imported only from vision_attn or a module the user
  allowed (``--allow_import``);
- :func:`_check_plain`, :func:`_class_spec`: plain data and ``{class_path, init_args}`` mappings;
- :func:`regroup_arguments`, :func:`grouped_arguments`: the flat arguments of older checkpoint
  formats moved into their groups, and the groups built into their dataclasses;
- :func:`checked_data_settings`: the data settings a checkpoint was trained with;
- :func:`check_state_shapes`: weights that fit the model they are loaded into.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import torch
from torch import nn

from vision_attn.checkpoint_io import CheckpointError
from vision_attn.data import CaptioningDataModule, DetectionDataModule, ImageFolderDataModule, ImagesDataModule
from vision_attn.schema import constructor_hints

__all__ = ["CHECKPOINT_KEY", "check_state_shapes", "checked_data_settings", "grouped_arguments", "one_line",
           "regroup_arguments", "resolve_class"]

CHECKPOINT_KEY = "vision_attn"
"""The checkpoint entry that describes the model (task, arguments, preprocessing, data)."""


def _allowed(module: str, allow_import: tuple[str, ...]) -> bool:
    parts = module.split(".")
    return parts[0] == "vision_attn" or any(parts[: len(p.split("."))] == p.split(".") for p in allow_import)


def resolve_class(class_path: str, base: type, what: str, allow_import: tuple[str, ...] = ()) -> type:
    """The class that ``class_path`` names, which must be a ``base`` defined in vision_attn or
    in a module the user allowed (``allow_import``: module prefixes, from ``--allow_import``).

    Importing a module runs its code: any other path is refused before anything is imported.

    Raises:
        CheckpointError: naming ``what``, for a path outside those modules, one that does not
            exist, or a class that is not a ``base``.
    """
    parts = class_path.split(".") if isinstance(class_path, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise CheckpointError(f"{what}: {class_path!r} is not a class path; refusing to build it")
    module_name, _, name = class_path.rpartition(".")
    if not _allowed(module_name, allow_import):
        raise CheckpointError(
            f"{what}: class {class_path!r} is not part of vision_attn; refusing to import it. If you trust "
            f"that code, allow it explicitly with --allow_import {parts[0]}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CheckpointError(f"{what}: class {class_path!r} cannot be imported ({err})") from err
    cls = getattr(module, name, None)
    ours = isinstance(cls, type) and _allowed(cls.__module__, allow_import)
    if not (ours and issubclass(cls, base)):
        raise CheckpointError(f"{what}: {class_path!r} is not a {base.__name__} of vision_attn or an allowed module")
    return cls


def _check_plain(value: Any, key: str, what: str) -> None:
    """Refuse anything but plain data (numbers, strings, lists, mappings without class paths)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{key}[{i}]", what)
        return
    if isinstance(value, dict) and "class_path" not in value:
        for k, v in value.items():
            _check_plain(v, f"{key}.{k}", what)
        return
    kind = "a class path" if isinstance(value, dict) else type(value).__name__
    raise CheckpointError(f"{what}: {key} is {kind}, not plain data; refusing to build from it")


def _class_spec(cfg: Any, key: str, what: str) -> dict[str, Any]:
    if not isinstance(cfg, dict) or set(cfg) - {"class_path", "init_args"}:
        raise CheckpointError(
            f"{what}: {key} is not a {{class_path, init_args}} mapping; "
            "use a checkpoint written by train.py"
        )
    if not isinstance(cfg.get("init_args", {}), dict):
        raise CheckpointError(f"{what}: {key}.init_args is not a mapping")
    return cfg


def regroup_arguments(init_args: dict[str, Any], legacy: dict[str, str], what: str,
                      key: str = "model.init_args") -> dict[str, Any]:
    """``init_args`` with the flat arguments of an older layout moved into their groups.

    ``legacy`` maps an old argument name to ``"group.field"`` (``{"num_queries":
    "head.num_queries"}``). Arguments already grouped are kept, so converting twice changes
    nothing; an old name that is also a group's name (captioning's ``scst``, classification's
    ``head``) is converted only when its value is not a mapping.

    Raises:
        CheckpointError: naming ``what``, for a group that is not a mapping, or a value given both
            flat and inside its group.
    """
    out = dict(init_args)
    # an old name that is also its group's name first (classification's head="linear" -> head.kind)
    for old, new in sorted(legacy.items(), key=lambda item: item[0] != item[1].split(".", 1)[0]):
        if old not in out or (old == new.split(".", 1)[0] and isinstance(out[old], dict)):
            continue
        group, field = new.split(".", 1)
        value = out.pop(old)
        target = out.setdefault(group, {})
        if not isinstance(target, dict):
            raise CheckpointError(f"{what}: {key}.{group} is not a mapping; use a checkpoint written by train.py")
        if field in target:
            raise CheckpointError(f"{what}: {key} gives {old} and {group}.{field}; use a checkpoint written by "
                                  "train.py")
        out[group] = {**target, field: value}
    return out


def grouped_arguments(cls: type, init_args: dict[str, Any]) -> dict[str, Any]:
    """``init_args`` with every mapping given to a dataclass-typed argument of ``cls`` (an argument
    group) built into that dataclass: the constructor's default group with the given fields
    replaced, as the config parser builds it."""
    params = inspect.signature(cls.__init__).parameters
    hints = constructor_hints(cls)
    out = dict(init_args)
    for name, value in init_args.items():
        hint = hints.get(name)
        if isinstance(value, dict) and isinstance(hint, type) and dataclasses.is_dataclass(hint):
            default = params[name].default if name in params else None
            out[name] = (dataclasses.replace(default, **value) if isinstance(default, hint) else hint(**value))
    return out


def _data_modules() -> dict[str, type]:
    """The suite's data modules by every class path that names them."""
    classes = (ImageFolderDataModule, DetectionDataModule, CaptioningDataModule, ImagesDataModule)
    return {path: c for c in classes for path in (f"vision_attn.data.{c.__name__}", f"{c.__module__}.{c.__name__}")}


def checked_data_settings(meta: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The data settings a checkpoint was trained with (``{"class_path", "init_args"}``, plain
    data only; the class path is checked by the command line's import policy when parsed), or
    ``None`` for checkpoints written before they were saved (format 1). The flat arguments of
    the suite's data modules in format 2 are moved into their groups (the data module's
    ``legacy_arguments``)."""
    data = meta.get("data")
    if data is None:
        return None
    data = _class_spec(data, f"{CHECKPOINT_KEY}.data", what)
    if not isinstance(data.get("class_path"), str):
        raise CheckpointError(f"{what}: {CHECKPOINT_KEY}.data.class_path is not a string")
    _check_plain(data.get("init_args") or {}, "data.init_args", what)
    init_args = dict(data.get("init_args") or {})
    module = _data_modules().get(data["class_path"])
    if module is not None:
        init_args = regroup_arguments(init_args, module.legacy_arguments, what, "data.init_args")
    return {"class_path": data["class_path"], "init_args": init_args}


def check_state_shapes(model: nn.Module, state: Any, what: str) -> None:
    """Refuse, before loading, a state dict that is not a mapping of tensors or whose tensors do not
    have the shapes of ``model``'s (one line naming the first keys that differ)."""
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{what}: its state_dict is not a mapping of tensors; use a checkpoint written by "
                              "train.py")
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (model {tuple(own[k].shape)})"
             for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if wrong or missing or unexpected:
        parts = [f"{label} {items[:3]}{' ...' if len(items) > 3 else ''} ({len(items)})"
                 for label, items in (("shapes differ:", wrong), ("missing", missing), ("unexpected", unexpected))
                 if items]
        raise CheckpointError(f"{what}: weights do not fit the model it describes: {'; '.join(parts)}")


def one_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when empty)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
