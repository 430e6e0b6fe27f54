"""Reading weights and checkpoints without executing pickled code.

``torch.load`` on an untrusted file can run arbitrary code. Every file the suite reads goes
through here: ``.safetensors`` with the safetensors reader, everything else with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vision_attn.errors import CheckpointError

__all__ = ["CheckpointError", "load_checkpoint_file", "load_state_dict_file"]

_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def load_checkpoint_file(path: str | Path) -> Any:
    """Load a ``.ckpt`` / ``.pth`` / ``.pt`` / ``.bin`` safely (tensors and plain containers only)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a file)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - every failure becomes one clear message
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            reason = (
                "it contains pickled Python objects, which vision_attn refuses to execute "
                f"({reason}); re-save it as plain tensors or .safetensors"
            )
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from err


def load_state_dict_file(path: str | Path) -> dict[str, Tensor]:
    """A flat ``{name: tensor}`` from a weights file, unwrapping ``state_dict`` / ``model`` keys."""
    path = Path(path)
    if path.suffix not in _SUFFIXES:
        raise CheckpointError(
            f"weights file {path}: unsupported extension {path.suffix!r}; use one of {', '.join(_SUFFIXES)}"
        )
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise CheckpointError(f"weights file {path} does not exist (or is not a file)")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"cannot read weights file {path}: {err}") from err
    obj = load_checkpoint_file(path)
    for key in ("state_dict", "model", "state_dict_ema", "model_ema"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"weights file {path} does not hold a state dict of tensors")
    return obj
