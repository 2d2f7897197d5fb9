"""The run directory: its resumable RL checkpoints, its warmed-up weights, and the trained models out of it.

``<out_dir>/checkpoints/step-NNNNNN/`` holds a checkpoint written through ``fabric.save`` (the strategy's
mesh-independent format) plus a ``COMPLETE`` marker written after every rank finished, so a run killed while
saving never resumes from a partial checkpoint. ``<out_dir>/warm/weights.pt`` holds the policy and draft after the
warm-ups (safetensors-free plain tensors, read with ``weights_only=True``), so another run can skip them
(``run.init_from``).

:func:`load_run` (tokenizer, policy, draft, in one call) and :func:`export_run` (``codraft export RUN_DIR OUT_DIR``:
the policy as a Hugging Face model directory with its tokenizer, the draft as a vLLM EAGLE-3 checkpoint) read the
architecture from the run's ``config.yaml`` and the weights from its newest complete checkpoint (or, before any, its
warmed-up weights), in one process on the CPU, whatever mesh wrote them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_codraft.config import CoDraftConfig, load_config
from lightning_codraft.drafters import drafter_kind
from lightning_codraft.models import Policy
from lightning_codraft.models.tokenizer import CharTokenizer
from lightning_codraft.parallel.checkpoint import load_checkpoint
from lightning_codraft.parallel.safe_read import CheckpointError
from lightning_codraft.rl.run.build import build_module, build_parts
from lightning_codraft.run_config import flatten, warm_weights


class RunCheckpoints:
    """Checkpoints of one run directory.

    Args:
        out_dir: the run directory (``run.out_dir``).
        fabric: the launched ``Fabric`` whose strategy writes and reads the checkpoints.
    """

    def __init__(self, out_dir: str | Path, fabric, keep: int = 0):
        self.out = Path(out_dir)
        self.fabric = fabric
        self.keep = keep
        """Keep only the newest ``keep`` complete checkpoints (``run.keep_checkpoints``; 0: all)."""

    @property
    def directory(self) -> Path:
        return self.out / "checkpoints"

    def complete(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete checkpoint (its ``COMPLETE`` marker written), oldest first."""
        return sorted(
            (int(p.name.split("-")[1]), p) for p in self.directory.glob("step-*") if (p / "COMPLETE").exists()
        )

    def last(self) -> Optional[tuple[int, Path]]:
        """``(step, path)`` of the newest complete checkpoint, or None."""
        found = self.complete()
        return found[-1] if found else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` (modules, optimizer, scheduler, plain entries) as checkpoint ``step``; call on every rank."""
        path = self.directory / f"step-{step:06d}"
        self.fabric.save(path, {**state, "step": step})
        self.fabric.barrier()
        if self.fabric.global_rank == 0:
            (path / "COMPLETE").write_text(str(step))
            for _, old in self.complete()[: -self.keep] if self.keep else ():  # only once the new one is complete
                shutil.rmtree(old)
        self.fabric.barrier()
        return path

    def load(self, path: Path, state: dict[str, Any], strict: bool = True) -> tuple[int, dict[str, Any]]:
        """Restore ``state``'s objects from ``path``; returns ``(step, the checkpoint's other plain entries)``.

        Raises:
            CheckpointError: the checkpoint cannot be read (naming it and how to resume from an older one).
        """
        try:
            rest = self.fabric.load(path, state, strict=strict)
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint fails in many ways; name it and the fix
            older = [p for _, p in self.complete() if p != path and p.name < path.name]
            fix = (
                f"move it aside (mv {path} {path}.unreadable) and run the same command again: it resumes from "
                f"{older[-1]}"
                if older
                else f"no older complete checkpoint is in {self.directory}: move it "
                f"aside and the same command starts the run over (or restore the directory from a backup)"
            )
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); {fix}"
            ) from e
        step = int(rest.pop("step", path.name.split("-")[1]))
        return step, rest

    # ------------------------------------------------------------------ warm weights
    @property
    def warm_file(self) -> Path:
        return self.out / "warm" / "weights.pt"

    def save_warm(self, policy: nn.Module, draft: nn.Module, extra: dict[str, Any], key: str = "") -> None:
        """Write the warmed-up policy + draft (global rank 0 only); another run starts from them (``init_from``);
        ``key``: :func:`warm_key` of the settings that made them."""
        if self.fabric.global_rank == 0:
            write_warm(self.warm_file, policy, draft, extra, key)

    @staticmethod
    def load_warm(path: str | Path, policy: nn.Module, draft: nn.Module) -> dict[str, Any]:
        """Load warmed-up weights from a ``warm`` directory (or its ``weights.pt``); returns their extra entries."""
        state = warm_state(path, "run.init_from")
        policy.load_state_dict(state["policy"])
        draft.load_state_dict(state["draft"])
        return dict(state.get("extra", {}))


WARM_FREE = (
    "run",
    "rl.steps",
    "rl.lr",
    "task.reward",
    "task.rewards",
    "task.on_reward_error",
    "task.reward_failure_budget",
    "task.eval_every",
    "task.eval_prompts",
)
"""Settings the warm-ups do not read (run.seed aside): changing them keeps a run's warm start valid."""


def warm_key(cfg) -> str:
    """A digest of the settings the warm-ups depend on (everything but :data:`WARM_FREE`, ``run.seed`` kept)."""
    flat = {
        k: v
        for k, v in flatten(dataclasses.asdict(cfg)).items()
        if not any(k == f or k.startswith(f + ".") for f in WARM_FREE)
    }
    flat["run.seed"] = cfg.run.seed
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_warm(path: Path, policy: nn.Module, draft: nn.Module, extra: dict[str, Any], key: str = "") -> None:
    """Write warmed-up weights to ``path`` (a ``warm/weights.pt``): ``policy``, ``draft``, ``extra``, ``key``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"policy": policy.state_dict(), "draft": draft.state_dict(), "extra": extra, "key": key}, path)


def warm_state(path: str | Path, key: str = "run.init_from") -> dict[str, Any]:
    """The contents of a ``warm`` directory's ``weights.pt`` (or of that file): ``policy``, ``draft``, ``extra``;
    ``key`` names the setting that pointed at it in the error."""
    path, f = Path(path).expanduser(), warm_weights(path)
    if not f.is_file():
        raise FileNotFoundError(
            f"{key}={str(path)!r} has no weights.pt; point it at the 'warm' directory of an earlier run"
        )
    return torch.load(f, map_location="cpu", weights_only=True)


def reference_draft(cfg, draft: nn.Module, start_file: Optional[Path] = None) -> Optional[nn.Module]:
    """The A/B's reference draft of a run (``cfg.draft.reference``): None when not co-training or ``none``; for
    ``start``, ``draft`` itself (the draft as RL begins) or, given ``start_file`` (a resumed run's
    ``warm/weights.pt``), a copy holding the draft stored there; for a path, a copy holding the draft stored there."""
    ref = cfg.draft.reference
    if ref == "none" or cfg.draft.mode != "cotrain":
        return None
    if ref == "start" and start_file is None:
        return draft
    copied = copy.deepcopy(draft)
    copied.load_state_dict(warm_state(start_file if ref == "start" else ref, "draft.reference")["draft"])
    return copied


CHAR_TOKENIZER_FILE = "codraft_char_tokenizer.json"
"""Where an exported tiny policy's character alphabet is also written (ids 0-2 are pad, bos, eos; the directory's
``tokenizer.json`` is the same tokenizer for ``AutoTokenizer``)."""


@dataclass
class LoadedRun:
    """A run's trained models, as :func:`load_run` returns them."""

    cfg: CoDraftConfig
    """The run's config (its ``config.yaml``)."""
    tokenizer: Any
    """The run's tokenizer (``encode`` / ``encode_prompt`` / ``decode``)."""
    policy: Policy
    """The trained policy (eval mode, CPU, fp32)."""
    draft: Optional[nn.Module]
    """The trained drafter, of ``draft.type`` (None for ``draft.mode=none``)."""
    step: int
    """The RL steps the weights have taken (0: the warmed-up weights)."""
    source: Path
    """The checkpoint (or warm weights) they were read from."""


def load_run(run_dir: str | Path, step: Optional[int] = None) -> LoadedRun:
    """The tokenizer, policy and draft of the run in ``run_dir`` after its newest complete checkpoint (or RL step
    ``step``'s; before any checkpoint, the warmed-up weights).

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.yaml``, or no checkpoint / warm weights (naming what it has).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a run directory: it has no config.yaml (every `codraft fit` writes one in run.out_dir)"
        )
    cfg = load_config(run_dir / "config.yaml")
    parts = build_parts(cfg, with_task=False)  # the models only: no data file, no reward code needed
    module = build_module(cfg, parts)
    found = RunCheckpoints(run_dir, fabric=None).complete()
    if step is not None:
        found = [f for f in found if f[0] == step]
        if not found:
            raise FileNotFoundError(f"{run_dir} has no complete checkpoint of step {step}")
    if found:
        done, source = found[-1]
        load_checkpoint(source, {"module": module}, strict=False)
    else:
        source, done = run_dir / "warm" / "weights.pt", 0
        if not source.is_file():
            raise FileNotFoundError(
                f"{run_dir} holds neither a complete checkpoint (checkpoints/step-*) nor warmed-up "
                f"weights (warm/weights.pt)"
            )
        RunCheckpoints.load_warm(source, module.policy, module.draft)
    draft = None if cfg.draft.mode == "none" else module.draft.eval()
    return LoadedRun(cfg, parts.tokenizer, module.policy.eval(), draft, done, source)


def export_run(run_dir: str | Path, out_dir: str | Path, step: Optional[int] = None) -> dict[str, Path]:
    """Write ``out_dir/policy`` (a Hugging Face model directory with its tokenizer: ``transformers`` and vLLM load
    it) and ``out_dir/draft`` (the drafter's vLLM checkpoint: EAGLE-3's, DFlash's or DSpark's), from :func:`load_run`; returns the paths written."""
    run = load_run(run_dir, step)
    out = Path(out_dir)
    paths = {"policy": Path(run.policy.save_pretrained(out / "policy"))}
    tok = run.tokenizer
    if isinstance(tok, CharTokenizer):  # the tiny policy's, as a transformers tokenizer with the same ids
        tok.to_transformers().save_pretrained(paths["policy"])
        (paths["policy"] / CHAR_TOKENIZER_FILE).write_text(json.dumps({"alphabet": tok.alphabet}))
    else:
        tok.tok.save_pretrained(paths["policy"])
    if run.draft is not None:  # in the format vLLM loads for the drafter's type (method eagle3 / dflash)
        paths["draft"] = Path(drafter_kind(run.draft).save(run.draft, out / "draft"))
    (out / "export.json").write_text(
        json.dumps({"run": str(Path(run_dir).resolve()), "step": run.step, "source": str(run.source)}, indent=1)
    )
    return paths
