"""The trained models out of a run directory: :func:`load_run` (tokenizer, policy, draft, in one call) and
:func:`export_run` (``codraft export RUN_DIR OUT_DIR``): the policy as a Hugging Face model directory with its
tokenizer, the draft as a vLLM EAGLE-3 checkpoint, whatever drafter the run trained.

The run's architecture comes from its ``config.yaml`` (written by every run), the weights from its newest complete
checkpoint (or, before any, its warmed-up weights), read in one process on the CPU from the mesh-independent
checkpoint format, whatever mesh wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_codraft.config import CoDraftConfig, load_config
from lightning_codraft.models import Eagle3Draft, Policy
from lightning_codraft.models.tokenizer import CharTokenizer
from lightning_codraft.parallel.checkpoint import load_checkpoint
from lightning_codraft.rl.build import build_module, build_parts
from lightning_codraft.rl.checkpoints import RunCheckpoints

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
    draft: Optional[Eagle3Draft]
    """The trained draft (None for ``draft.mode=none``)."""
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
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.yaml (every `codraft fit` "
                                f"writes one in run.out_dir)")
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
            raise FileNotFoundError(f"{run_dir} holds neither a complete checkpoint (checkpoints/step-*) nor warmed-up "
                                    f"weights (warm/weights.pt)")
        RunCheckpoints.load_warm(source, module.policy, module.draft)
    draft = None if cfg.draft.mode == "none" else module.draft.eval()
    return LoadedRun(cfg, parts.tokenizer, module.policy.eval(), draft, done, source)


def export_run(run_dir: str | Path, out_dir: str | Path, step: Optional[int] = None) -> dict[str, Path]:
    """Write ``out_dir/policy`` (a Hugging Face model directory with its tokenizer: ``transformers`` and vLLM load
    it) and ``out_dir/draft`` (the vLLM EAGLE-3 checkpoint), from :func:`load_run`; returns the paths written."""
    run = load_run(run_dir, step)
    out = Path(out_dir)
    paths = {"policy": Path(run.policy.save_pretrained(out / "policy"))}
    tok = run.tokenizer
    if isinstance(tok, CharTokenizer):  # the tiny policy's, as a transformers tokenizer with the same ids
        tok.to_transformers().save_pretrained(paths["policy"])
        (paths["policy"] / CHAR_TOKENIZER_FILE).write_text(json.dumps({"alphabet": tok.alphabet}))
    else:
        tok.tok.save_pretrained(paths["policy"])
    if run.draft is not None:
        paths["draft"] = Path(run.draft.save_pretrained(out / "draft"))
    (out / "export.json").write_text(json.dumps({"run": str(Path(run_dir).resolve()), "step": run.step,
                                                 "source": str(run.source)}, indent=1))
    return paths
