"""A run directory's settings across its segments (the runs of one ``run.out_dir``, each resuming the last), and the
run directory's file handling that needs no torch (atomic rewrites, where a ``warm`` path's weights are).

``config.yaml`` holds the current segment's full settings (a recipe: ``codraft fit --config RUN/config.yaml``
continues the run, ``codraft export`` reads its architecture), headed by comment lines saying the step the segment
began at and what it changed. A resume that changes a setting first keeps the previous segment's file as
``config.step-NNNNNN.yaml`` (NNNNNN: the step that segment began at), so every segment's settings stay on disk.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_codraft.config import CoDraftConfig, to_yaml

_BEGAN = re.compile(r"^# segment began at step (\d+)", re.MULTILINE)


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a reader (or a crash) sees the old file or the new one, never less."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def warm_weights(path: str | Path) -> Path:
    """The weights file a ``warm`` path names: ``<dir>/weights.pt`` for a directory, else the path itself."""
    path = Path(path).expanduser()
    return path / "weights.pt" if path.is_dir() else path


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict of settings as ``{"section.key": value}``."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_changes(old_yaml: str | Path, cfg: CoDraftConfig) -> list[str]:
    """``key: old -> new`` for every setting of ``cfg`` that differs from the config written at ``old_yaml`` (a run
    directory's ``config.yaml``), in key order; empty when none does."""
    old = flatten(OmegaConf.to_container(OmegaConf.load(old_yaml), resolve=True))
    new = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    return [
        f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def segment_start(path: str | Path) -> int:
    """The step the segment whose settings ``path`` holds began at (0 for a file without the header)."""
    m = _BEGAN.search(Path(path).read_text())
    return int(m.group(1)) if m else 0


def write_run_config(out_dir: str | Path, cfg: CoDraftConfig, step: int, changes: list[str]) -> Path:
    """Record ``cfg`` as the settings of the run in ``out_dir`` from ``step`` on.

    Args:
        out_dir: the run directory.
        cfg: the settings of this segment.
        step: the RL step it starts from (0 for a new run, the checkpoint's step on a resume).
        changes: :func:`config_changes` against the existing ``config.yaml`` (empty: the segment goes on and its
            file stays as it is).

    Returns:
        The path of ``config.yaml``.
    """
    path = Path(out_dir) / "config.yaml"
    resumed = step > 0 and path.is_file()
    if resumed and not changes:
        return path
    if resumed:
        shutil.copyfile(path, path.with_name(f"config.step-{segment_start(path):06d}.yaml"))
    earlier = sorted(p.name for p in path.parent.glob("config.step-*.yaml")) if resumed else []
    head = [
        f"# segment began at step {step}"
        + (f", resumed with {len(changes)} changed setting(s):" if resumed else " (a new run)")
    ]
    head += [f"#   {c}" for c in changes if resumed]
    head += [f"# earlier segments' settings: {', '.join(earlier)}"] if earlier else []
    replace_file(path, "\n".join(head) + "\n" + to_yaml(cfg))
    return path
