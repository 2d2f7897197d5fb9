"""Extra Lightning loggers for a run's per-step metrics (``run.loggers``): a name (``wandb``, ``mlflow``, ``comet``,
``neptune``: Lightning's logger, when its package is installed) or ``{class_path, init_args}`` for any class with
Lightning's ``log_metrics(metrics, step)``. Light to import (the classes are imported by name when built), so the
checks before launch (rl/run/preflight.py) can tell a missing package without loading torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

LOGGER_SHORTHANDS = {
    "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
    "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
    "comet": ("lightning.pytorch.loggers.CometLogger", "comet_ml"),
    "neptune": ("lightning.pytorch.loggers.NeptuneLogger", "neptune"),
}
"""``run.loggers`` names: Lightning's logger class and the package it needs."""


def logger_spec(entry: Any, index: int) -> tuple[str, dict[str, Any], Optional[str]]:
    """``(class path, init args, package it needs or None)`` of ``run.loggers[index]``; ``ValueError`` naming the
    key for an entry that is neither a known name nor ``{class_path, init_args}``."""
    if isinstance(entry, str):
        if entry not in LOGGER_SHORTHANDS:
            raise ValueError(
                f"run.loggers[{index}]={entry!r} is not one of {sorted(LOGGER_SHORTHANDS)}; give "
                f"{{class_path: package.module.Class, init_args: {{...}}}} for another logger"
            )
        path, package = LOGGER_SHORTHANDS[entry]
        return path, {}, package
    if isinstance(entry, Mapping) and set(entry) <= {"class_path", "init_args"} and "class_path" in entry:
        return str(entry["class_path"]), dict(entry.get("init_args") or {}), None
    raise ValueError(
        f"run.loggers[{index}]={entry!r}: give a name ({sorted(LOGGER_SHORTHANDS)}) or "
        f"{{class_path: package.module.Class, init_args: {{...}}}}"
    )


def logger_class(entry: Any, index: int) -> type:
    """The class of ``run.loggers[index]``, imported; ``ValueError`` naming the key and the missing package."""
    path, _, package = logger_spec(entry, index)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"run.loggers[{index}]={entry!r} needs the {package!r} package: pip install {package}")
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"run.loggers[{index}]: cannot import {path!r} ({e})") from None


def build_loggers(entries: Sequence[Any], out_dir: Path) -> list[Any]:
    """The extra loggers of ``run.loggers``, saving under ``out_dir`` unless their ``init_args`` say otherwise."""
    out = []
    for i, entry in enumerate(entries):
        cls = logger_class(entry, i)
        args = logger_spec(entry, i)[1]
        if isinstance(entry, str):
            args = {"save_dir": str(out_dir)} if entry != "mlflow" else {"tracking_uri": f"file:{out_dir}/mlruns"}
        out.append(cls(**args))
    return out
