"""Errors about user input. Each message names the file, id or key and says what to do.

Commands (``train.py``, ``eval.py``) print these as one line and exit with status 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EncoderError",
    "RunExistsError",
    "TrainingDivergedError",
    "VisionAttnError",
]


class VisionAttnError(Exception):
    """Base of the suite's user-facing errors."""


class DataError(VisionAttnError, ValueError):
    """A data root, split, folder or annotation that cannot be used."""


class CheckpointError(VisionAttnError, ValueError):
    """A weights or checkpoint file that cannot be used."""


class EncoderError(VisionAttnError, ValueError):
    """An encoder that cannot be built: unknown timm name, not a ViT, bad arguments."""


class RunExistsError(VisionAttnError, FileExistsError):
    """An output folder that already holds results which would be overwritten."""


class TrainingDivergedError(VisionAttnError, ArithmeticError):
    """A loss became NaN or infinite; the run stops and keeps its last good checkpoint."""


class ConfigError(VisionAttnError, ValueError):
    """A config that must not be used (e.g. a class from outside the suite, torch and Lightning)."""
