"""Writing output files: the one place where the suite writes results.

Every writer here (:func:`write_bytes`, :func:`write_text`, :func:`write_json`,
:func:`write_csv`, :func:`write_png`, :func:`write_npy`, and :func:`atomic_output` for libraries that want a path)

- checks that the file resolves under its output folder ``root`` (:func:`resolve_under`): the
  folders on the way are resolved with their symbolic links, so neither a name such as
  ``../../x`` nor a planted ``OUT/overlays -> /elsewhere`` link writes outside ``root``;
- writes through a *fresh* temporary file in the same folder (:func:`tempfile.mkstemp`, which
  never follows a link) and renames it over the final name with :func:`os.replace`: a planted
  link at the final name (``OUT/overlays/1.png -> victim``) is replaced, never followed, and
  readers never see half a file (Ctrl-C included); the temporary is removed on any failure.

Names built from data (image ids, file names, class names) go through :func:`safe_filename`
first: one path component, no separators, no control or invisible format characters (bidi
overrides such as ``photo<U+202E>gnp.exe.png``, zero-width spaces), no leading dot, at most
:data:`MAX_NAME_BYTES` bytes (a changed or long name ends with a short hash, so the result is
deterministic and distinct names stay distinct).

JSON files are strict JSON whatever the values hold (:func:`write_json`, :func:`json_ready`):
NumPy and PyTorch numbers become plain ones, and non-finite numbers (a model with NaN weights
scores ``NaN``), which JSON has no way to write, become ``null``, with one warning per file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import numpy as np

from vision_attn.errors import VisionAttnError

__all__ = [
    "ConsoleText",
    "MAX_NAME_BYTES",
    "OutputPathError",
    "atomic_output",
    "console_text",
    "csv_cell",
    "display_path",
    "json_ready",
    "resolve_under",
    "safe_filename",
    "write_bytes",
    "write_csv",
    "write_json",
    "write_npy",
    "write_png",
    "write_result",
    "write_text",
]

log = logging.getLogger(__name__)

MAX_NAME_BYTES = 200
"""Longest file name written, in UTF-8 bytes: file systems allow 255, and the temporary file's
name (``.<up to 40 characters>.<random>.tmp``) must fit too."""

_HASH_CHARS = 10
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
"""Unicode categories replaced in file names: controls (C0, DEL, C1), format characters (bidi
embeddings, overrides and isolates U+202A-U+202E and U+2066-U+2069, marks such as U+200E/F,
zero-width U+200B-U+200D, U+2060, U+FEFF, the soft hyphen) and the line and paragraph
separators U+2028/U+2029: each either hides or reorders what a listing shows, or breaks a line."""
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


def _unsafe_char(c: str) -> bool:
    return c in "/\\" or unicodedata.category(c) in _UNSAFE_CATEGORIES


def console_text(text: str) -> str:
    """``text`` safe to print on a terminal or in a log: control and invisible format characters
    (those :func:`safe_filename` replaces; separators excepted) escaped as ``\\xNN`` / ``\\uNNNN``,
    so a file name or an id from a file cannot move the cursor, colour the screen or erase a
    line; a line break starts an indented line, so no such text can forge a log line of its own."""
    out = []
    for c in str(text):
        if c == "\n":
            out.append("\n    ")
        elif c not in "/\\\t" and unicodedata.category(c) in _UNSAFE_CATEGORIES:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


class ConsoleText(logging.Filter):
    """A handler's filter that passes every record's message through :func:`console_text`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = console_text(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def safe_filename(name: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    """``name`` as one safe, deterministic file name component.

    Separators (``/``, ``\\``), NUL, control characters (C0, DEL, C1: Unicode category ``Cc``),
    invisible format characters (category ``Cf``: bidi overrides and isolates, zero-width
    spaces and joiners, U+FEFF, U+2060) and line or paragraph separators become ``_``; a leading ``.``
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
    clean = "".join("_" if _unsafe_char(c) else c for c in str(name))
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


def _key_path(parent: str, key: Any) -> str:
    """``parent`` extended by a dict key: ``a.b`` for identifiers, ``a["b c"]`` for other keys
    (JSON-escaped, so no key can put a control character into a log line)."""
    if isinstance(key, str) and key.isidentifier() and key.isascii():
        return f"{parent}.{key}" if parent else key
    return f"{parent}[{json.dumps(str(key))}]"


def _plain(value: Any) -> Any:
    """NumPy scalars and arrays and PyTorch tensors as Python numbers and lists; others as they are."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    torch = sys.modules.get("torch")  # a tensor can only exist once torch is imported
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    return value


def json_ready(obj: Any) -> tuple[Any, int, str | None]:
    """``obj`` as plain values that :func:`json.dumps` writes as strict JSON.

    NumPy scalars and arrays and PyTorch tensors (at any depth) become Python numbers and
    lists, tuples become lists, and every non-finite float (``NaN``, ``inf``, ``-inf``, which
    JSON cannot write) becomes ``None`` (``null``). Dict keys that are NumPy scalars become
    Python ones. Other values are left as they are (``json.dumps`` refuses unknown types).

    Args:
        obj: the value to write.

    Returns:
        ``(value, count, first)``: the plain value, how many non-finite numbers became
        ``None``, and the key path of the first (``[0].score``, ``per_class["a b"].ap``; ``""``
        for ``obj`` itself), ``None`` when there were none.
    """
    count, first = 0, None

    def walk(value: Any, where: str) -> Any:
        nonlocal count, first
        value = _plain(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            count += 1
            first = where if first is None else first
            return None
        if isinstance(value, dict):
            return {_plain(k): walk(v, _key_path(where, _plain(k))) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    return walk(obj, ""), count, first


def write_json(path: str | Path, obj: Any, root: str | Path | None = None, indent: int | None = 2) -> Path:
    """Write ``obj`` as strict JSON to ``path`` (inside ``root``) through a temporary file.

    NumPy and PyTorch values are written as plain numbers and lists, and non-finite numbers as
    ``null`` (:func:`json_ready`), with one warning naming the file, how many there were and
    where the first one was: ``OUT/predictions.json: 3 non-finite values written as null
    (first at [0].score)``.
    """
    try:  # most results are plain and finite already: written as they are, in one pass
        text = json.dumps(obj, indent=indent, allow_nan=False)
    except (TypeError, ValueError):
        value, count, first = json_ready(obj)
        if count:
            log.warning("%s: %d non-finite values written as null (first at %s)", path, count,
                        first or "the top level")
        text = json.dumps(value, indent=indent, allow_nan=False)
    return write_text(path, text, root)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""A text cell starting with one of these is read as a formula by spreadsheet programs."""


def csv_cell(value: Any) -> Any:
    """One CSV cell: numbers as they are (non-finite ones empty), ``None`` empty, text that a
    spreadsheet would run as a formula (a class named ``=HYPERLINK(...)``) prefixed with ``'``."""
    value = _plain(value)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        try:
            float(value)  # a negative number written as text stays a number
        except ValueError:
            return "'" + value
    return value


def write_csv(path: str | Path, rows: list[dict[str, Any]], root: str | Path | None = None) -> Path:
    """Write ``rows`` (dicts with the same keys: the header, in the first row's order) as UTF-8 CSV
    to ``path`` (inside ``root``) through a temporary file; cells through :func:`csv_cell`."""
    import csv
    import io

    buffer = io.StringIO()
    columns = list(rows[0]) if rows else []
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([csv_cell(row.get(c)) for c in columns])
    return write_text(path, buffer.getvalue(), root)


def write_result(path: str | Path, content: Any, root: str | Path | None = None) -> Path:
    """A result file by its suffix: ``.csv`` rows (:func:`write_csv`), else JSON (:func:`write_json`)."""
    if Path(path).suffix == ".csv":
        return write_csv(path, content, root)
    return write_json(path, content, root)


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


def display_path(path: str | Path) -> str:
    """``path`` as a page shows it: relative to the working folder when it lies inside it, else its
    last two parts (``.../run/last.ckpt``), so a report names no absolute path of the machine.
    Anything that is not a local absolute path (``timm:NAME``, a relative path) is kept as given."""
    text = str(path)
    candidate = Path(text)
    if not candidate.is_absolute():
        return text
    try:
        return candidate.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return ".../" + "/".join(candidate.parts[-2:])
