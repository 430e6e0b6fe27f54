"""Old import paths kept for one version: a module-level ``__getattr__`` that warns and forwards.

Each old module (``vision_attn.cli``, ``vision_attn.merge``, ...) is a few lines naming where its
names went (:func:`moved`); the new modules are imported only when an old name is used.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["moved"]


def moved(old: str, targets: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the old module ``old``: each name of ``targets`` (name -> new
    module) is imported from its new module, with a ``FutureWarning`` naming the new path."""

    def __getattr__(name: str) -> Any:
        new = targets.get(name)
        if new is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} is deprecated and will be removed in the next version; use {new}.{name}",
                      FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
