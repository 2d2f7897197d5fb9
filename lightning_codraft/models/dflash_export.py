"""Writing a DFlash drafter in z-lab's / vLLM's format (``config.json`` + ``model.safetensors``): the half of
models/dflash_io.py the model itself calls (:meth:`~lightning_codraft.models.dflash.DFlashDraft.save_pretrained`), so
it reads the drafter by its ``config`` and ``state_dict`` only. Reading the format back is models/dflash_io.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from lightning_codraft.models.config import attention_fields

ARCHITECTURE = "DFlashDraftModel"
"""``architectures`` written to config.json (z-lab's class; vLLM maps ``method: dflash`` to its own)."""
WEIGHTS_FILE = "model.safetensors"
WRITTEN_KEYS = (
    "architectures model_type hidden_act hidden_size intermediate_size num_hidden_layers vocab_size tie_word_embeddings "
    "attention_bias target_layer_ids block_size mask_token_id dflash_config"
).split()
"""The keys :func:`to_hf_dict` writes besides the attention geometry (a loaded config's others are kept in ``extra``)."""


def to_hf_dict(c) -> dict:
    """The draft's ``config.json``: a Qwen3 config of the draft layers with z-lab's drafter keys."""
    drafter = {
        "target_layer_ids": [t - 1 for t in c.taps],
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
    }
    return {
        **c.extra,
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "vocab_size": c.vocab_size,
        **attention_fields(c),
        "tie_word_embeddings": False,
        "attention_bias": False,
        **drafter,
        "dflash_config": drafter,
    }


def save_dflash(draft, path: str | Path) -> Path:
    """Write ``draft`` as ``config.json`` + ``model.safetensors`` under ``path`` (created if needed)."""
    return save_block_drafter(draft, path, to_hf_dict(draft.config))


def save_block_drafter(draft, path: str | Path, config: dict) -> Path:
    """Write ``config`` as ``config.json`` and ``draft``'s state dict as ``model.safetensors`` under ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path
