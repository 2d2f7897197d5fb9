"""Lazy package exports: ``import lightning_codraft.x`` stays light until a name is actually used.

Each package ``__init__`` lists its public names in a dict ``name -> defining module``, imports them under
``TYPE_CHECKING`` for IDEs and type checkers, and installs the module-level ``__getattr__`` / ``__dir__`` built
here, so ``dir(package)`` lists the exports before any of them is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package_globals: dict[str, Any], exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` for a package whose ``exports[name]`` is imported on first access.

    Args:
        package_globals: the package's ``globals()``.
        exports: public name -> dotted path of the module defining it.
    """
    package = package_globals["__name__"]

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            package_globals[name] = value  # later lookups skip __getattr__
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(package_globals) | set(exports))

    return __getattr__, __dir__
