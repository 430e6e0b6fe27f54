"""Reading weights and checkpoints without executing pickled code.

``torch.load`` on an untrusted file can run arbitrary code. Every file the suite reads goes
through here: ``.safetensors`` with the safetensors reader, everything else with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers. Resumed
training reads its checkpoint through :class:`SafeCheckpointIO`, the same loader.

Only local files are read (a URL is refused: download it and check it first), and only files
whose unpacked size is bounded: a ``torch.save`` archive stores its members uncompressed, so one
that would unpack to much more than its size on disk (a "zip bomb") is refused, as is any file
beyond :data:`MAX_LOAD_BYTES_ENV` (default 16 GiB).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import Tensor

from vision_attn.errors import CheckpointError
from vision_attn.schema import limit

__all__ = [
    "MAX_LOAD_BYTES_ENV",
    "CheckpointError",
    "SafeCheckpointIO",
    "check_local_file",
    "check_checkpoint_file",
    "check_unpacked_size",
    "check_tensor_shapes",
    "load_checkpoint_file",
    "load_state_dict_file",
    "safetensors_shapes",
]

_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")

MAX_LOAD_BYTES_ENV = "VISION_ATTN_MAX_LOAD_BYTES"
"""Environment variable: the largest (unpacked) weights or checkpoint file read, in bytes
(``17179869184``) or with a unit (``16G``, ``500M``)."""
DEFAULT_MAX_LOAD_BYTES = 16 << 30
# torch.save never compresses: an archive may unpack to at most this many times its size on disk
# (plus a little slack for tiny files) before it is treated as a zip bomb.
MAX_EXPANSION = 2.0
_EXPANSION_SLACK = 1 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def max_load_bytes() -> int:
    """The size limit from :data:`MAX_LOAD_BYTES_ENV` (default 16 GiB)."""
    raw = os.environ.get(MAX_LOAD_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_LOAD_BYTES
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", raw, re.IGNORECASE)
    if not match:
        raise CheckpointError(
            f"{MAX_LOAD_BYTES_ENV}={raw!r} is not a size; give bytes (17179869184) or e.g. 16G, 500M"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def check_local_file(path: str | Path, what: str = "checkpoint") -> Path:
    """``path`` as a local file; a URL (``https://...``, ``s3://...``) or a missing file is an error."""
    if _URL.match(str(path)):
        raise CheckpointError(
            f"{what} {path} is a URL; vision_attn reads only local files (a downloaded checkpoint "
            "can hold pickled code). Download it, check where it comes from, and pass the local path."
        )
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist (or is not a file)")
    return path


def check_unpacked_size(path: str | Path, what: str = "checkpoint") -> None:
    """Refuse, before reading it, a file that is (or unpacks to) more than the size limit, and a
    zip archive whose members unpack to much more than the archive itself (a zip bomb)."""
    path = Path(path)
    size = path.stat().st_size
    unpacked = size
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                unpacked = sum(info.file_size for info in archive.infolist())
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {what} {path}: not a valid archive ({err})") from err
        if unpacked > MAX_EXPANSION * size + _EXPANSION_SLACK:
            raise CheckpointError(
                f"{what} {path} would unpack to {_human(unpacked)} from {_human(size)} on disk (a "
                f"compressed archive; torch.save writes uncompressed ones); refusing to load more than "
                f"{MAX_EXPANSION:g}x its size. Re-save it with torch.save or as .safetensors."
            )
    limit = max_load_bytes()
    if max(size, unpacked) > limit:
        raise CheckpointError(
            f"{what} {path} holds {_human(max(size, unpacked))} unpacked, more than the "
            f"{_human(limit)} vision_attn loads; if you trust it, raise the limit with "
            f"{MAX_LOAD_BYTES_ENV} (e.g. {MAX_LOAD_BYTES_ENV}=64G)"
        )


def load_checkpoint_file(path: str | Path, map_location: Any = "cpu", what: str = "checkpoint",
                         mmap: bool = False) -> Any:
    """Load a ``.ckpt`` / ``.pth`` / ``.pt`` / ``.bin`` safely (tensors and plain containers only).

    Args:
        path: a local file (URLs are refused).
        map_location: as for ``torch.load``.
        what: how messages name the file (``"checkpoint"``, ``"weights file"``).
        mmap: map the tensors of a zip archive instead of reading them (their shapes can then be
            checked before any data is read).

    Raises:
        CheckpointError: naming the file, for a URL, a missing, oversized or unreadable file, and
            one that holds pickled Python objects (which are never executed).
    """
    path = check_local_file(path, what)
    check_unpacked_size(path, what)
    try:
        return torch.load(path, map_location=map_location, weights_only=True,
                          mmap=mmap and zipfile.is_zipfile(path))
    except Exception as err:  # noqa: BLE001 - every failure becomes one clear message
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            reason = (
                "it contains pickled Python objects, which vision_attn refuses to execute "
                f"({reason}); re-save it as plain tensors or .safetensors"
            )
        raise CheckpointError(f"cannot read {what} {path}: {reason}") from err


def check_checkpoint_file(path: str | Path, what: str = "checkpoint") -> None:
    """Check, without keeping it in memory, that ``path`` is a local checkpoint that the safe
    loader reads (bounded size, no pickled code). Tensors are memory-mapped, not read."""
    path = check_local_file(path, what)
    check_unpacked_size(path, what)
    if not zipfile.is_zipfile(path):  # legacy format: cannot be memory-mapped
        load_checkpoint_file(path, what=what)
        return
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - re-read without mmap for the one clear message
        load_checkpoint_file(path, what=what)


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, reading only local files with :func:`load_checkpoint_file`
    (``weights_only=True`` whatever the caller asks, bounded size). Writing is unchanged
    (Lightning's atomic save)."""

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        location = "cpu" if map_location is None else map_location
        return load_checkpoint_file(path, map_location=location, what="checkpoint")


_SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


def safetensors_shapes(path: str | Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """``{name: (shape, bytes per element)}`` from a ``.safetensors`` file's header, without
    reading any tensor.

    Raises:
        CheckpointError: naming the file, for a header that is not what the format defines.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < n <= min(_MAX_HEADER, path.stat().st_size - 8):
                raise CheckpointError(f"cannot read weights file {path}: not a safetensors file (header size {n})")
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"cannot read weights file {path}: not a safetensors file ({err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"cannot read weights file {path}: its header is not a mapping")
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        size = _SAFETENSORS_BYTES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if (not isinstance(shape, list) or size is None
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise CheckpointError(f"cannot read weights file {path}: tensor {name!r} has no valid dtype and shape")
        shapes[str(name)] = (tuple(shape), size)
    return shapes


def check_tensor_shapes(shapes: dict[str, tuple[tuple[int, ...], int]], what: str) -> None:
    """Refuse tensors whose declared shapes are out of bounds, before any is read or allocated:
    a dimension above :data:`~vision_attn.schema.LIMITS` ``["tensor_dim"]`` (``VISION_ATTN_MAX_TENSOR_DIM``),
    or a size above the load limit counting zero-sized dimensions as one (a ``[2**31, 0]`` tensor
    holds nothing, but a model sized from it would not)."""
    top_dim, top_bytes = limit("tensor_dim"), max_load_bytes()
    for name, (shape, item) in shapes.items():
        big = [d for d in shape if d > top_dim]
        declared = item
        for d in shape:
            declared *= max(d, 1)
        if big or declared > top_bytes:
            raise CheckpointError(
                f"{what}: tensor {name!r} declares shape {list(shape)}, beyond the {top_dim} elements per dimension "
                f"and {_human(top_bytes)} per tensor vision_attn reads; if you trust the file, raise "
                f"VISION_ATTN_MAX_TENSOR_DIM or {MAX_LOAD_BYTES_ENV}"
            )


def load_state_dict_file(path: str | Path) -> dict[str, Tensor]:
    """A flat ``{name: tensor}`` from a weights file, unwrapping ``state_dict`` / ``model`` keys."""
    path = Path(path)
    if path.suffix not in _SUFFIXES:
        raise CheckpointError(
            f"weights file {path}: unsupported extension {path.suffix!r}; use one of {', '.join(_SUFFIXES)}"
        )
    if path.suffix == ".safetensors":
        path = check_local_file(path, "weights file")
        check_unpacked_size(path, "weights file")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        check_tensor_shapes(safetensors_shapes(path), f"weights file {path}")
        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"cannot read weights file {path}: {err}") from err
    obj = load_checkpoint_file(path, what="weights file", mmap=True)
    for key in ("state_dict", "model", "state_dict_ema", "model_ema"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"weights file {path} does not hold a state dict of tensors")
    check_tensor_shapes({str(k): (tuple(v.shape), v.element_size()) for k, v in obj.items()}, f"weights file {path}")
    return obj
