"""Writing a DSpark drafter in the layout vLLM's ``method: dspark`` (``Qwen3DSparkModel``) and DeepSpec load
(``config.json`` + ``model.safetensors``); models/dspark_io.py reads it back.

The config is DFlash's (models/dflash_export.py: a Qwen3 config of the draft layers, ``target_layer_ids``,
``block_size``, ``mask_token_id``) with ``architectures: ["DSparkDraftModel"]`` (vLLM maps it, with ``model_type:
qwen3``, to its Qwen3 DSpark model) and DeepSpec's head keys: ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``. The tensors keep our names, which
are DeepSpec's (``markov_head.markov_w1`` / ``markov_w2`` / ``gate_proj``, ``confidence_head.proj``); like DFlash's,
the checkpoint carries no embedding and no head (vLLM shares the target's).
"""

from __future__ import annotations

from pathlib import Path

from lightning_codraft.models.dflash_export import save_block_drafter
from lightning_codraft.models.dflash_export import to_hf_dict as dflash_dict

ARCHITECTURE = "DSparkDraftModel"
"""``architectures`` written to config.json (vLLM: with ``model_type: qwen3``, its ``Qwen3DSparkModel``)."""


def to_dspark_dict(c) -> dict:
    """The drafter's ``config.json``: DFlash's plus DeepSpec's head keys (module docstring)."""
    return {
        **dflash_dict(c),
        "architectures": [ARCHITECTURE],
        "markov_rank": int(c.markov_rank),
        "markov_head_type": c.markov_head_type,
        "enable_confidence_head": bool(c.confidence_head),
        "confidence_head_with_markov": bool(c.confidence_with_markov),
        "sample_from_anchor": bool(c.sample_from_anchor),
    }


def save_dspark(draft, path: str | Path) -> Path:
    """Write ``draft`` as ``config.json`` + ``model.safetensors`` under ``path`` (created if needed)."""
    return save_block_drafter(draft, path, to_dspark_dict(draft.config))
