"""DFlash checkpoint I/O: the directory z-lab publishes and vLLM's ``method: dflash`` loads (``config.json`` +
``*.safetensors``).

The tensors are named as z-lab's ``DFlashDraftModel`` names them and vLLM's ``DFlashQwen3Model`` loads them
(``fc``, ``hidden_norm``, ``layers.<i>.self_attn.{q,k,v,o}_proj``, ``layers.<i>.self_attn.{q,k}_norm``,
``layers.<i>.mlp.{gate,up,down}_proj``, ``layers.<i>.{input,post_attention}_layernorm``, ``norm``): the same names
as :class:`~lightning_codraft.models.dflash.DFlashDraft`'s parameters, so no tensor is renamed. The config is a
Qwen3 ``config.json`` of the draft layers plus the drafter's keys, read from ``dflash_config`` or, as z-lab's code
also reads them, the top level: ``target_layer_ids`` (z-lab's layer ids: the OUTPUT of layer ``i``, our tap
``i + 1``), ``block_size``, ``mask_token_id``. The drafter owns no embedding and no head (the policy's are used);
a checkpoint that carries them is refused by name, never silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from lightning_codraft.models.config import ATTENTION_FIELDS, shape_fields
from lightning_codraft.models.dflash import DFlashConfig, DFlashDraft
from lightning_codraft.models.dflash_export import ARCHITECTURE, WEIGHTS_FILE, WRITTEN_KEYS, save_dflash, to_hf_dict

__all__ = ["ARCHITECTURE", "WEIGHTS_FILE", "from_hf_dict", "load_dflash", "save_dflash", "to_hf_dict"]


def from_hf_dict(d: dict) -> DFlashConfig:
    """A :class:`DFlashConfig` from a z-lab / vLLM DFlash ``config.json`` dict (drafter keys in ``dflash_config``
    or at the top level; ``rope_theta`` there or in ``rope_parameters``)."""
    drafter = {**d, **(d.get("dflash_config") or {})}
    missing = [k for k in ("target_layer_ids", "mask_token_id") if drafter.get(k) is None]
    if missing:
        raise ValueError(f"a DFlash config.json needs {missing} (in dflash_config or at the top level)")
    if drafter.get("layer_types") and any(t != "full_attention" for t in drafter["layer_types"]):
        raise ValueError(
            f"layer_types={drafter['layer_types']}: only full-attention DFlash layers are supported "
            f"(sliding-window draft layers are not)"
        )
    rope = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    known = {*WRITTEN_KEYS, *ATTENTION_FIELDS}
    return DFlashConfig(
        **shape_fields(d),
        taps=tuple(int(i) + 1 for i in drafter["target_layer_ids"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        block_size=int(drafter.get("block_size", 16)),
        mask_token_id=int(drafter["mask_token_id"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        rope_scaling=d.get("rope_scaling"),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        extra={k: v for k, v in d.items() if k not in known},
    )


def load_dflash(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> DFlashDraft:
    """A DFlash drafter from a directory of ``config.json`` + ``*.safetensors`` (ours, z-lab's or vLLM's names).

    Raises:
        FileNotFoundError: no config.json or no weights.
        ValueError: a tensor missing, unexpected (an embedding or a head the drafter does not own) or of another
            shape than config.json says, naming it.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path / 'config.json'} not found: a DFlash directory holds config.json + *.safetensors"
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    draft = DFlashDraft(from_hf_dict(json.loads((path / "config.json").read_text())))
    state = {k.removeprefix("model."): v for f in files for k, v in load_file(str(f)).items()}
    expected = draft.state_dict()
    extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if extra or missing:
        raise ValueError(
            f"{path}: tensors {extra[:5]} are not a DFlash drafter's (it owns no embedding and no head: "
            f"the policy's are used)"
            if extra
            else f"{path}: missing tensors {missing[:5]}"
        )
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}")
    draft.load_state_dict(state)
    return draft.to(device=device, dtype=dtype)
