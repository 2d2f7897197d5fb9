"""Lazy package exports: ``import lightning_codraft.x`` stays light until a name is actually used."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) on first access of ``name``."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
