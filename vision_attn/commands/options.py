"""The tasks' inference options on the command line, knowing no task.

A task declares the dataclass of its predict / eval / explain options
(:attr:`~vision_attn.tasks.VisionTask.inference_options`) and the flag group they go in
(:attr:`~vision_attn.tasks.VisionTask.inference_group`). These helpers add its fields to a
command's parser and build the options from what was parsed:

- ``eval.py`` / ``validate`` / ``test`` (jsonargparse): ``--GROUP.FIELD``, or ``--explain.FIELD``
  for a task without a group of its own, next to the explanation options (:func:`add_eval_options`,
  :func:`eval_options`);
- ``predict`` / ``explain`` (argparse): ``--GROUP.FIELD``, or ``--FIELD`` for a task without a
  group (:func:`add_folder_options`, :func:`folder_options`).

The task receives them through :meth:`~vision_attn.tasks.VisionTask.set_inference_options`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Union

import docstring_parser  # jsonargparse's (its [signatures] extra): the same texts as its --help

from vision_attn.commands.args import (
    TRUE,
    _config_class_paths,
    _option_value,
    hide_options,
    plain_text,
)
from vision_attn.errors import ConfigError, VisionAttnError
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.tasks.base import TASKS, VisionTask, _allowed, resolve_class

__all__ = ["EXPLAIN_GROUP", "add_eval_options", "add_folder_options", "config_task_class", "eval_options",
           "folder_flags", "folder_options", "refuse_other_tasks_flags", "usable_task_classes"]

EXPLAIN_GROUP = "explain"
"""``eval.py``'s group of the explanation options, which also takes the options of a task
without a group of its own (``--explain.FIELD``)."""


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    hint: Any
    default: Any
    help: str


def _fields(options: type) -> list[_Field]:
    """The fields of an options dataclass: name, type, default and the text its docstring gives."""
    hints = typing.get_type_hints(options)
    texts = _field_texts(options)
    return [_Field(f.name, hints.get(f.name, str), f.default, texts.get(f.name, ""))
            for f in dataclasses.fields(options) if f.init]


def _field_texts(options: type) -> dict[str, str]:
    """``{field: text}`` of the ``Attributes:`` / ``Args:`` section of ``options``' docstring."""
    parsed = docstring_parser.parse(inspect.getdoc(options) or "")
    return {p.arg_name: plain_text(" ".join((p.description or "").split())) for p in parsed.params}


def usable_task_classes(allow_import: tuple[str, ...] = ()) -> list[type[VisionTask]]:
    """The registered tasks a command may name: vision_attn's own and those of the modules allowed
    with ``--allow_import`` (a task registered by other code of the process is not one of them)."""
    return [cls for cls in TASKS.values() if _allowed(cls.__module__, allow_import)]


def config_task_class(argv: Sequence[str], allow_import: tuple[str, ...] = ()) -> type[VisionTask] | None:
    """The task class that ``--model CLASS_PATH`` or the ``--config`` files in ``argv`` name (read
    as plain YAML), ``None`` when they name none, or none that may be imported."""
    given = _option_value(list(argv), "--model")
    path = given if given and all(p.isidentifier() for p in given.split(".")) else None
    path = path or _config_class_paths(list(argv)).get("model")
    try:
        return resolve_class(path, VisionTask, "--config", allow_import) if path else None
    except VisionAttnError:
        return None


def _task_classes(task_classes: Iterable[type]) -> list[type]:
    """The classes among ``task_classes`` that declare options, each once, in order."""
    out: list[type] = []
    for cls in task_classes:
        if getattr(cls, "inference_options", None) is not None and cls not in out:
            out.append(cls)
    return out


# ---------------------------------------------------------------------------- eval.py (jsonargparse)
def add_eval_options(parser: Any, task_classes: Iterable[type], hidden: bool = False) -> None:
    """Add ``--explain.*`` (:class:`~vision_attn.explain.evaluate.ExplainOptions` without its
    :attr:`~vision_attn.explain.evaluate.ExplainOptions.task_fields`) and the inference options of
    each of ``task_classes`` to a LightningCLI parser: ``--GROUP.FIELD``, or ``--explain.FIELD``
    for a task without a group (a field two tasks share is added once).

    Args:
        hidden: accept the options but leave them out of ``--help`` (``fit``).
    """
    parser.add_class_arguments(ExplainOptions, EXPLAIN_GROUP, instantiate=False,
                               skip=set(ExplainOptions.task_fields))
    groups = [EXPLAIN_GROUP]
    for cls in _task_classes(task_classes):
        group = cls.inference_group
        if group:
            if group not in groups:
                parser.add_class_arguments(cls.inference_options, group, instantiate=False)
                groups.append(group)
            continue
        container = parser.groups.get(EXPLAIN_GROUP, parser)
        for field in _fields(cls.inference_options):
            flag = f"--{EXPLAIN_GROUP}.{field.name}"
            if flag not in parser._option_string_actions:
                container.add_argument(flag, type=field.hint, default=field.default,
                                       help=f"{cls.task_name}: {field.help}")
    if hidden:
        hide_options(parser, groups)


def _mapping(value: Any) -> dict[str, Any]:
    """A parsed group (jsonargparse's ``Namespace``, a mapping or ``None``) as a ``dict``."""
    if value is None:
        return {}
    return dict(value.as_dict() if hasattr(value, "as_dict") else value)


def eval_options(config: Any, task_cls: type) -> tuple[ExplainOptions, Any]:
    """``(explanation options, the task's inference options or None)`` from the config parsed by
    a parser of :func:`add_eval_options` for ``task_cls``."""
    explain = _mapping(config.get(EXPLAIN_GROUP))
    options = None
    if getattr(task_cls, "inference_options", None) is not None:
        group = task_cls.inference_group
        source = _mapping(config.get(group)) if group else explain
        names = [f.name for f in _fields(task_cls.inference_options)]
        options = task_cls.inference_options(**{n: source[n] for n in names if n in source})
        if not group:
            explain = {k: v for k, v in explain.items() if k not in names}
    generic = {k: v for k, v in explain.items() if k not in ExplainOptions.task_fields}
    return ExplainOptions(**generic), options


# ---------------------------------------------------------------------------- predict / explain (argparse)
def _parse_bool(text: str) -> bool:
    return str(text).lower() in TRUE


def _argparse_type(hint: Any) -> tuple[Any, list[str] | None]:
    """``(type, choices)`` for argparse of a field annotated ``hint`` (``X | None`` reads as ``X``;
    a ``Literal`` gives its values as choices)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = kinds[0] if len(kinds) == 1 else str
    if typing.get_origin(hint) is Literal:
        return str, [str(v) for v in typing.get_args(hint)]
    if hint is bool:
        return _parse_bool, None
    return (hint if hint in (int, float, str) else str), None


def folder_flags(task_cls: type) -> dict[str, str]:
    """``{field: flag}`` of ``task_cls``' options in the folder commands: ``--GROUP.FIELD``, or
    ``--FIELD`` for a task without a group."""
    options = getattr(task_cls, "inference_options", None)
    if options is None:
        return {}
    group = task_cls.inference_group
    return {f.name: f"--{group}.{f.name}" if group else f"--{f.name}" for f in _fields(options)}


def add_folder_options(parser: argparse.ArgumentParser, task_classes: Iterable[type]) -> None:
    """Add the inference options of each of ``task_classes`` to a folder command's parser (a
    flag two tasks share is added once, with the first one's default)."""
    for cls in _task_classes(task_classes):
        fields = {f.name: f for f in _fields(cls.inference_options)}
        for name, flag in folder_flags(cls).items():
            if flag in parser._option_string_actions:
                continue
            field = fields[name]
            kind, choices = _argparse_type(field.hint)
            parser.add_argument(flag, dest=flag[2:], type=kind, choices=choices, default=field.default,
                                help=f"{cls.task_name}: {field.help}".replace("%", "%%"))


def folder_options(args: argparse.Namespace, task_cls: type) -> Any:
    """The inference options of ``task_cls`` from the parsed ``args`` (``None`` for a task without)."""
    options = getattr(task_cls, "inference_options", None)
    if options is None:
        return None
    return options(**{name: getattr(args, flag[2:]) for name, flag in folder_flags(task_cls).items()})


def refuse_other_tasks_flags(argv: Sequence[str], task_cls: type, task_classes: Iterable[type], what: str) -> None:
    """Refuse an option of another task's models in ``argv``, naming the task it belongs to.

    Raises:
        ConfigError: a flag of another task's options that the model's task does not have.
    """
    own = set(folder_flags(task_cls).values())
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    for cls in _task_classes(task_classes):
        for flag in folder_flags(cls).values():
            if flag in given and flag not in own:
                raise ConfigError(f"{flag} is an option of {cls.task_name} models; {what} holds a "
                                  f"{task_cls.task_name} model")
