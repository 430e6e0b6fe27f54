"""Writing output files: the one place where the suite writes results.

Every writer here (:func:`write_bytes`, :func:`write_text`, :func:`write_json`,
:func:`write_png`, :func:`write_npy`, and :func:`atomic_output` for libraries that want a path)

- checks that the file resolves under its output folder ``root`` (:func:`resolve_under`): the
  folders on the way are resolved with their symbolic links, so neither a name such as
  ``../../x`` nor a planted ``OUT/overlays -> /elsewhere`` link writes outside ``root``;
- writes through a *fresh* temporary file in the same folder (:func:`tempfile.mkstemp`, which
  never follows a link) and renames it over the final name with :func:`os.replace`: a planted
  link at the final name (``OUT/overlays/1.png -> victim``) is replaced, never followed, and
  readers never see half a file (Ctrl-C included); the temporary is removed on any failure.

Names built from data (image ids, file names, class names) go through :func:`safe_filename`
first: one path component, no separators or control characters, no leading dot, at most
:data:`MAX_NAME_BYTES` bytes (long names are truncated and end with a short hash, so the result
is deterministic and distinct names stay distinct).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import numpy as np

from vision_attn.errors import VisionAttnError

__all__ = [
    "MAX_NAME_BYTES",
    "OutputPathError",
    "atomic_output",
    "resolve_under",
    "safe_filename",
    "write_bytes",
    "write_json",
    "write_npy",
    "write_png",
    "write_text",
]

MAX_NAME_BYTES = 200
"""Longest file name written, in UTF-8 bytes: file systems allow 255, and the temporary file's
name (``.<up to 40 characters>.<random>.tmp``) must fit too."""

_HASH_CHARS = 10
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read the process umask once: mkstemp creates 0600, results get the usual mode


class OutputPathError(VisionAttnError, ValueError):
    """An output file that would land outside its output folder."""


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:_HASH_CHARS]


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


def _truncate_bytes(text: str, limit: int) -> str:
    """The longest prefix of ``text`` within ``limit`` UTF-8 bytes (never half a character)."""
    return text.encode("utf-8", "surrogateescape")[:limit].decode("utf-8", "ignore")


def safe_filename(name: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    """``name`` as one safe, deterministic file name component.

    Separators (``/``, ``\\``), NUL and control characters become ``_``; a leading ``.``
    (``..``, hidden files) becomes ``_``; an empty name becomes ``_``. A name that had to change,
    or is longer than ``max_bytes`` UTF-8 bytes, ends with ``-`` and a short hash of the original
    (before its extension, which is kept when it is short), so two different names never map to
    one file. A name that is already safe is returned unchanged.

    Args:
        name: a file name, possibly built from data (an image id, a class name).
        max_bytes: the longest result in UTF-8 bytes (at least 32).

    Returns:
        The safe name.
    """
    if max_bytes < 32:
        raise ValueError(f"max_bytes must be at least 32, got {max_bytes}")
    clean = "".join("_" if c in "/\\" or ord(c) < 32 or ord(c) == 127 else c for c in str(name))
    if clean.startswith("."):
        clean = "_" + clean[1:]
    clean = clean or "_"
    if clean == name and _utf8_len(clean) <= max_bytes:
        return clean
    tag = "-" + _digest(str(name))
    stem, dot, ext = clean.rpartition(".")
    if not dot or not stem or _utf8_len(ext) > 16:
        stem, ext = clean, ""
    suffix = tag + ("." + ext if ext else "")
    return _truncate_bytes(stem, max_bytes - _utf8_len(suffix)) + suffix


def resolve_under(root: str | Path, path: str | Path) -> Path:
    """The absolute path of ``path``, checked to lie inside the folder ``root``.

    The folders of ``path`` are resolved (``..`` and symbolic links followed); its last
    component is not: the writers replace a link there instead of following it.

    Args:
        root: the output folder (it may itself be a link; it is resolved first).
        path: the file, absolute or relative to the working directory (``root / name``).

    Returns:
        ``<resolved folder>/<name>``.

    Raises:
        OutputPathError: ``path`` has no file name, or lands outside ``root``.
    """
    root_dir = Path(root).resolve()
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise OutputPathError(f"output path {path} names no file; pass a file name under {root}")
    parent = path.parent.resolve()
    if parent != root_dir and not parent.is_relative_to(root_dir):
        raise OutputPathError(
            f"refusing to write {path}: it resolves to {parent / path.name}, outside the output folder "
            f"{root_dir}. Check the names that built it (image ids, file names) and links in {root}")
    return parent / path.name


def _prepare(path: str | Path, root: str | Path | None) -> Path:
    """Resolve and check ``path`` (see :func:`resolve_under`), then create its folder."""
    path = Path(path)
    root = path.parent if root is None else Path(root)
    target = resolve_under(root, path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"cannot create the folder of {path}: {err.strerror or err}") from err
    return resolve_under(root, target)  # the folders now exist: check them again, links included


def _temporary(target: Path, suffix: str) -> tuple[int, str]:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:40]}.", suffix=suffix, dir=target.parent)
    with suppress(OSError):
        os.fchmod(fd, 0o666 & ~_UMASK)
    return fd, tmp


@contextmanager
def atomic_output(path: str | Path, root: str | Path | None = None, suffix: str = ".tmp") -> Iterator[Path]:
    """A fresh temporary file to write ``path`` through, for libraries that take a file name.

    On leaving the block the temporary is renamed over ``path``; on an error it is removed::

        with atomic_output(out / "model.onnx", root=out, suffix=".tmp.onnx") as tmp:
            onnx.save(model, tmp)

    Args:
        path: the final file.
        root: the folder it must lie in (default: its own folder).
        suffix: the temporary's suffix (some libraries choose the format by it).
    """
    target = _prepare(path, root)
    fd, tmp = _temporary(target, suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _write(path: str | Path, root: str | Path | None, fill: Callable[[IO[bytes]], None]) -> Path:
    target = _prepare(path, root)
    fd, tmp = _temporary(target, ".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fill(fh)
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def write_bytes(path: str | Path, data: bytes, root: str | Path | None = None) -> Path:
    """Write ``data`` to ``path`` (inside ``root``) through a temporary file; returns the path."""
    return _write(path, root, lambda fh: fh.write(data))


def write_text(path: str | Path, text: str, root: str | Path | None = None) -> Path:
    """Write UTF-8 ``text`` to ``path`` (inside ``root``) through a temporary file."""
    return write_bytes(path, text.encode("utf-8"), root)


def write_json(path: str | Path, obj: Any, root: str | Path | None = None, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON to ``path`` (inside ``root``) through a temporary file."""
    return write_text(path, json.dumps(obj, indent=indent), root)


def write_png(path: str | Path, image_rgb: np.ndarray, root: str | Path | None = None) -> Path:
    """Write an RGB ``uint8`` image ``[H, W, 3]`` (encoded in memory by OpenCV, in the format
    of the file's suffix, PNG by default) to ``path`` (inside ``root``) through a temporary file.

    Raises:
        OSError: OpenCV cannot encode the image in that format (the message names the file).
    """
    import cv2

    path = Path(path)
    image = np.ascontiguousarray(image_rgb)
    try:
        bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR) if image.ndim == 3 else image
        suffix = (path.suffix or ".png").lower()
        # PNG level 1 (OpenCV's default is 3): half the encoding time for files ~3 % larger
        params = [cv2.IMWRITE_PNG_COMPRESSION, 1] if suffix == ".png" else []
        ok, buf = cv2.imencode(path.suffix or ".png", bgr, params)
    except cv2.error:
        ok, buf = False, None
    if not ok:
        raise OSError(f"OpenCV could not write {path} (is the name's suffix an image format OpenCV knows?)")
    return write_bytes(path, buf.tobytes(), root)


def write_npy(path: str | Path, array: np.ndarray, root: str | Path | None = None) -> Path:
    """Write ``array`` as ``.npy`` (no pickled objects) to ``path`` (inside ``root``)."""
    array = np.asarray(array)
    return _write(path, root, lambda fh: np.save(fh, array, allow_pickle=False))
