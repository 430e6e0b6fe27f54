"""What a config or a checkpoint may hold: typed plain data with bounded sizes.

Configs and checkpoints are data, never code. Every value they give a constructor is checked
against the constructor's type hints (:func:`check_value`): JSON scalars, lists, mappings with
known keys, literals, dataclasses; a mapping that names a class (``{"class_path": ...}``) is
refused wherever the signature does not expect a class. Free-form mappings are typed too:
:data:`JSONValue` for keyword arguments handed on to timm, :class:`PreprocessOverrides` for
the preprocessing.

Sizes that decide how much memory a model takes are bounded (:data:`LIMITS`), and a model's
parameter and buffer bytes are computed on PyTorch's ``meta`` device, which allocates nothing,
before the real one is built (:func:`check_model_bytes`). Each limit is named in its error and
can be raised with an environment variable (``VISION_ATTN_MAX_EMBED_DIM=16384``,
``VISION_ATTN_MAX_MODEL_BYTES=64G``).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict, Union

import torch

from vision_attn.errors import CheckpointError, VisionAttnError

__all__ = [
    "JSONScalar",
    "JSONValue",
    "LIMITS",
    "MAX_MODEL_BYTES_ENV",
    "MAX_DATA_DEPTH",
    "MAX_DATA_VALUES",
    "PreprocessOverrides",
    "check_data_size",
    "check_limits",
    "check_model_bytes",
    "check_value",
    "constructor_hints",
    "limit",
    "parse_bytes",
]

JSONScalar = Union[bool, int, float, str, None]  # noqa: UP007 - a runtime alias jsonargparse reads
"""A JSON scalar."""
JSONValue = Union[bool, int, float, str, None, list[JSONScalar]]  # noqa: UP007
"""A JSON scalar or a list of them: what a free-form keyword argument (``timm_kwargs``) may hold."""

Interpolation = Literal["bicubic", "bilinear", "nearest", "lanczos", "box", "hamming"]
CropMode = Literal["center", "squash", "border"]


class PreprocessOverrides(TypedDict, total=False):
    """Overrides of timm's data config (every key optional).

    Attributes:
        input_size: ``[channels, height, width]`` of the model input.
        interpolation: the resize filter.
        mean: per-channel mean subtracted after scaling to ``[0, 1]``.
        std: per-channel standard deviation divided by.
        crop_pct: the centre crop's share of the resized image (``1.0``: no crop).
        crop_mode: ``center``, ``squash`` or ``border`` (as timm's evaluation transform).
    """

    input_size: tuple[int, int, int]
    interpolation: Interpolation
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_pct: float
    crop_mode: CropMode


# ---------------------------------------------------------------------------------------------
# Bounds. Each is the largest value accepted (the smallest is 1, or 0 where noted), settable
# with VISION_ATTN_MAX_<NAME>. They sit far above the largest published ViTs (ViT-22B: width
# 6144, 48 blocks, 48 heads) and far below what exhausts a machine by a single value.

LIMITS: dict[str, int] = {
    "embed_dim": 16384,
    "depth": 128,
    "num_heads": 256,
    "img_size": 8192,
    "input_size": 8192,
    "patch_size": 1024,
    "num_classes": 1 << 20,
    "vocab": 1 << 20,
    "hidden_dim": 16384,
    "num_layers": 128,
    "num_queries": 1 << 14,
    "max_length": 1 << 14,
    "tensor_dim": 1 << 22,
    "objects": 1000,  # training targets of one image (the matching's cost grows with them)
}
"""Name -> the largest value accepted (environment variable ``VISION_ATTN_MAX_<NAME>``)."""

# config keys -> the limit that bounds them (lists are bounded by their length)
_KEY_LIMITS = {
    "embed_dim": "embed_dim", "depth": "depth", "num_heads": "num_heads", "img_size": "img_size",
    "input_size": "input_size", "patch_size": "patch_size", "num_classes": "num_classes",
    "class_names": "num_classes", "category_ids": "num_classes", "vocab": "vocab", "max_vocab": "vocab",
    "hidden_dim": "hidden_dim", "num_layers": "num_layers", "num_queries": "num_queries",
    "max_length": "max_length", "scst_max_length": "max_length", "top_k": "num_queries",
    "dn_groups": "num_queries", "o2m_groups": "num_queries", "o2m_repeat": "num_queries",
    "reg_tokens": "num_queries", "beam_size": "num_queries",
}
_ZERO_ALLOWED = {"num_classes", "depth", "num_layers", "dn_groups", "o2m_groups", "reg_tokens", "top_k",
                 "max_length", "scst_max_length", "beam_size", "o2m_repeat"}

MAX_MODEL_BYTES_ENV = "VISION_ATTN_MAX_MODEL_BYTES"
"""Environment variable: the most parameter and buffer bytes a model built from a config or a
checkpoint may take (default ``8G``: two billion float32 parameters)."""
DEFAULT_MAX_MODEL_BYTES = 8 << 30
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(raw: str, env: str) -> int:
    """``"16G"``, ``"500M"`` or a plain byte count, as an ``int``; the variable ``env`` names it
    in the error."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", raw.strip(), re.IGNORECASE)
    if not match:
        raise VisionAttnError(f"{env}={raw!r} is not a size; give bytes (17179869184) or e.g. 16G, 500M")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def limit(name: str) -> int:
    """The bound :data:`LIMITS` ``[name]``, or the value of ``VISION_ATTN_MAX_<NAME>`` when set."""
    env = f"VISION_ATTN_MAX_{name.upper()}"
    raw = os.environ.get(env, "").strip()
    if not raw:
        return LIMITS[name]
    if not raw.isdigit() or int(raw) < 1:
        raise VisionAttnError(f"{env}={raw!r} is not a positive whole number")
    return int(raw)


def _size_error(what: str, key: str, value: Any, name: str, low: int,
                error: type[VisionAttnError]) -> VisionAttnError:
    top = limit(name)
    return error(
        f"{what}: {key} = {_short(value)} lies outside {low}..{top}; if you trust it and have the memory, "
        f"raise the limit with VISION_ATTN_MAX_{name.upper()}"
    )


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def check_limits(config: Any, what: str, key: str = "", error: type[VisionAttnError] = CheckpointError) -> None:
    """Refuse sizes outside :data:`LIMITS` anywhere in a nested config (mappings and lists).

    Integer values of known keys (``embed_dim``, ``depth``, ``img_size``, ``num_classes``,
    ``num_queries``, ...) and the lengths of known lists (``class_names``, ``vocab``) are checked;
    ``img_size`` and ``input_size`` may also be lists of sides.

    Raises:
        CheckpointError: (or ``error``) naming ``what``, the key, the value and the environment
            variable that raises the limit.
    """
    if isinstance(config, Mapping):
        for k, v in config.items():
            sub = f"{key}.{k}" if key else str(k)
            name = _KEY_LIMITS.get(str(k))
            if name is not None:
                _check_size(v, sub, name, what, 0 if k in _ZERO_ALLOWED else 1, error)
            check_limits(v, what, sub, error)
    elif isinstance(config, (list, tuple)):
        for i, v in enumerate(config):
            if isinstance(v, (Mapping, list, tuple)):
                check_limits(v, what, f"{key}[{i}]", error)


MAX_DATA_VALUES = 1 << 22
"""The most values a checkpoint's metadata may hold, shared containers counted each time they appear."""
MAX_DATA_DEPTH = 64
"""The deepest nesting of lists and mappings a config or a checkpoint's metadata may have."""


def check_data_size(data: Any, what: str, key: str = "", max_values: int = MAX_DATA_VALUES,
                    error: type[VisionAttnError] = CheckpointError) -> None:
    """Refuse nested data (lists, tuples, mappings and scalars) that holds more than ``max_values``
    values as the walkers of this module see it, every shared container counted each time it
    appears, that contains itself, or that nests deeper than :data:`MAX_DATA_DEPTH`.

    Pickle (a checkpoint) and YAML aliases (a config) keep shared containers shared, so a file of
    a few kilobytes can describe ``2**40`` values (``x = [x, x]`` forty times). The count is made
    once per distinct container, in time linear in the file.

    Raises:
        CheckpointError: (or ``error``) naming ``what`` and ``key``.
    """
    def children(obj: Any) -> list[Any]:
        return [*obj.keys(), *obj.values()] if isinstance(obj, Mapping) else list(obj)

    def nested(obj: Any) -> bool:
        return isinstance(obj, (Mapping, list, tuple))

    where = f"{what}: {key}" if key else what
    counted: dict[int, int] = {}  # id -> values below it, the container counted
    open_: set[int] = set()  # entered, not finished: its own descendants
    stack: list[tuple[Any, int, bool]] = [(data, 0, False)]
    while stack:
        obj, depth, finished = stack.pop()
        if not nested(obj):
            continue
        oid = id(obj)
        if finished:
            open_.discard(oid)
            counted[oid] = 1 + sum(counted[id(c)] if nested(c) else 1 for c in children(obj))
            if counted[oid] > max_values:
                raise error(f"{where} holds more than {max_values} values (shared parts counted each time they "
                            "appear); refusing to read it")
            continue
        if oid in counted:
            continue
        if oid in open_:
            raise error(f"{where} contains itself; refusing to read it")
        if depth >= MAX_DATA_DEPTH:
            raise error(f"{where} nests lists and mappings more than {MAX_DATA_DEPTH} deep; refusing to read it")
        open_.add(oid)
        stack.append((obj, depth, True))
        stack.extend((c, depth + 1, False) for c in children(obj) if nested(c))


def _check_size(value: Any, key: str, name: str, what: str, low: int, error: type[VisionAttnError]) -> None:
    top = limit(name)
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return
    if isinstance(value, int):
        if not low <= value <= top:
            raise _size_error(what, key, value, name, low, error)
    elif isinstance(value, (list, tuple)):
        if key.endswith(("img_size", "input_size", "patch_size")):
            for v in value:
                if isinstance(v, int) and not isinstance(v, bool) and not 1 <= v <= top:
                    raise _size_error(what, key, v, name, 1, error)
        elif len(value) > top:
            raise _size_error(what, f"len({key})", len(value), name, 0, error)


def human_bytes(n: int) -> str:
    """``n`` bytes as ``12.0 GiB`` / ``3.5 MiB`` / ``10.0 KiB`` / ``512 bytes``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def max_model_bytes() -> int:
    """The bound of :data:`MAX_MODEL_BYTES_ENV` (default 8 GiB)."""
    raw = os.environ.get(MAX_MODEL_BYTES_ENV, "").strip()
    return parse_bytes(raw, MAX_MODEL_BYTES_ENV) if raw else DEFAULT_MAX_MODEL_BYTES


def model_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (works on the ``meta`` device)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_model_bytes(build: Callable[[], torch.nn.Module], what: str,
                      error: type[VisionAttnError] = CheckpointError) -> None:
    """Build a model on the ``meta`` device (no memory is allocated) and refuse it when its
    parameters and buffers would take more than :data:`MAX_MODEL_BYTES_ENV` allows.

    A builder that cannot run on the ``meta`` device is let through: the field bounds
    (:func:`check_limits`) still hold for it.
    """
    try:
        with torch.device("meta"):
            size = model_bytes(build())
    except VisionAttnError:
        raise
    except (NotImplementedError, RuntimeError):
        return
    top = max_model_bytes()
    if size > top:
        raise error(
            f"{what}: the model it describes would take {human_bytes(size)} of parameters and "
            f"buffers, more than the {human_bytes(top)} allowed; if you trust it and have the memory, "
            f"raise the limit with {MAX_MODEL_BYTES_ENV} (e.g. {MAX_MODEL_BYTES_ENV}=64G)"
        )


# ---------------------------------------------------------------------------------------------
# Type checking of plain data against a constructor's type hints.

_MAX_STRING = 1 << 16
_CHARS_PER_WORD = 64  # a stored caption tokenizer (``vocab``): its JSON takes about 20 characters a word


def _max_string(key: str) -> int:
    """The longest string ``key`` may hold: :data:`_MAX_STRING`, or for ``vocab`` (a stored caption
    tokenizer's JSON) room for the largest vocabulary :data:`LIMITS` allows."""
    return _CHARS_PER_WORD * limit("vocab") if key.rsplit(".", 1)[-1] == "vocab" else _MAX_STRING


def constructor_hints(cls: type) -> dict[str, Any]:
    """``{argument: type hint}`` of ``cls.__init__`` (string annotations resolved)."""
    try:
        return typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):
        return {name: p.annotation for name, p in inspect.signature(cls.__init__).parameters.items()}


def check_value(value: Any, hint: Any, key: str, what: str, error: type[VisionAttnError] = CheckpointError) -> None:
    """Check that plain data ``value`` fits the type hint ``hint``.

    Accepted: ``None``, ``bool``, ``int``, finite ``float`` (an ``int`` too), ``str``, literals,
    enums (by value or name), unions, ``list`` / ``Sequence`` / ``tuple`` of them, ``dict`` with
    checked keys and values, ``TypedDict`` and dataclasses (as mappings of their fields).
    ``Any`` accepts JSON data only. Classes (modules, tasks, callables) are refused: a config or a
    checkpoint may not name code where the signature expects data.

    Raises:
        CheckpointError: (or ``error``) naming ``what`` and the key path, and what was expected.
    """
    if not _fits(value, hint, key, what, error):
        raise error(
            f"{what}: {key} = {_short(value)} is not {_describe(hint)}; "
            "configs and checkpoints hold plain data of the documented types only"
        )


def _describe(hint: Any) -> str:
    if hint == JSONValue:
        return "a number, a string, a boolean, null or a list of them"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (list, Sequence, tuple) and args:
        return f"a list of ({_describe(args[0])})"
    if origin in (dict, Mapping) and len(args) == 2:
        return f"a mapping of strings to ({_describe(args[1])})"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    if isinstance(hint, type):
        if _is_typed_dict(hint) or dataclasses.is_dataclass(hint):
            return f"a mapping of {', '.join(_fields(hint))}"
        return {"bool": "a boolean", "int": "a whole number", "float": "a finite number", "str": "a string"}.get(
            hint.__name__, f"a {hint.__name__}")
    return str(hint).replace("typing.", "")


def _is_typed_dict(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, dict) and hasattr(hint, "__total__")


def _fields(hint: type) -> dict[str, Any]:
    if _is_typed_dict(hint):
        return typing.get_type_hints(hint)
    hints = typing.get_type_hints(hint)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(hint) if f.init}


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > 32:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return not isinstance(value, str) or len(value) <= _MAX_STRING
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        return "class_path" not in value and all(
            isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _fits(value: Any, hint: Any, key: str, what: str, error: type[VisionAttnError]) -> bool:
    if hint is Any or hint is inspect.Parameter.empty or hint is object:
        return _plain(value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _fits(value, args[0], key, what, error)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a, key, what, error) for a in args)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str) and len(value) <= _max_string(key)
    if origin in (list, Sequence, typing.Sequence) or hint in (list,):
        item = args[0] if args else Any
        return isinstance(value, (list, tuple)) and all(
            _fits(v, item, f"{key}[{i}]", what, error) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0], f"{key}[{i}]", what, error) for i, v in enumerate(value))
        return len(value) == len(args) and all(
            _fits(v, a, f"{key}[{i}]", what, error) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin in (dict, Mapping, typing.Mapping):
        k_hint, v_hint = args if args else (str, Any)
        if not isinstance(value, Mapping) or "class_path" in value:
            return False
        for k, v in value.items():
            if not _fits(k, k_hint, key, what, error):
                return False
            check_value(v, v_hint, f"{key}.{k}", what, error)
        return True
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return any(value == m.value or value == m.name for m in hint)
    if isinstance(hint, type) and (_is_typed_dict(hint) or dataclasses.is_dataclass(hint)):
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(hint) if f.init}
        if not isinstance(value, Mapping) or "class_path" in value:
            return False
        fields = _fields(hint)
        unknown = sorted(str(k) for k in value if k not in fields)
        if unknown:
            raise error(
                f"{what}: {key} has unknown keys {unknown}; allowed: {', '.join(fields)}"
            )
        for k, v in value.items():
            check_value(v, fields[k], f"{key}.{k}", what, error)
        return True
    return False  # a class, a callable or a module: never from plain data
