"""DSpark checkpoints in DeepSpec's released layout (``config.json`` + ``*.safetensors``, as on the hub for Qwen3).

The tensors are named as DeepSpec's ``Qwen3DSparkModel`` names them: DFlash's (``fc``, ``hidden_norm``,
``layers.<i>.…``, ``norm``: the same names as :class:`~lightning_codraft.models.dflash.DFlashDraft`'s), the heads'
(``markov_head.markov_w1`` / ``markov_w2`` / ``gate_proj``, ``confidence_head.proj``), and the drafter's own frozen
copies of the target's ``embed_tokens`` and ``lm_head``. Ours reads both from the policy, so the loader checks that
the copies equal the policy's (the logits would differ otherwise) and refuses naming the tensor. The config is a Qwen3
``config.json`` plus ``target_layer_ids`` (the output of layer ``i``, our tap ``i + 1``; -1 the embeddings, tap 0),
``mask_token_id``, ``block_size``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_with_markov``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file
from torch import nn

from lightning_codraft.models.config import shape_fields
from lightning_codraft.models.dspark import DSparkConfig, DSparkDraft

OWN_COPIES = {"embed_tokens.weight": ("model.embed_tokens", "embed_tokens"), "lm_head.weight": ("lm_head",)}
"""DeepSpec's drafter-owned copies of the target's tensors -> where a policy holds the original (HF names)."""


def _original(policy: nn.Module, paths: tuple[str, ...]) -> torch.Tensor:
    for p in paths:
        try:
            return policy.get_submodule(p).weight.detach()
        except AttributeError:
            continue
    raise ValueError(f"the policy has none of {paths}")


def from_deepspec_dict(d: dict) -> DSparkConfig:
    """A :class:`DSparkConfig` from a DeepSpec DSpark ``config.json`` dict."""
    missing = [k for k in ("target_layer_ids", "mask_token_id", "block_size") if d.get(k) is None]
    if missing:
        raise ValueError(f"a DeepSpec DSpark config.json needs {missing}")
    if d.get("attention_bias"):
        raise ValueError("attention_bias=true: DSpark draft layers with attention biases are not supported")
    if d.get("layer_types") and any(t != "full_attention" for t in d["layer_types"]):
        raise ValueError(f"layer_types={d['layer_types']}: only full-attention draft layers are supported")
    rope = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return DSparkConfig(
        **shape_fields(d),
        taps=tuple(int(i) + 1 for i in d["target_layer_ids"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        block_size=int(d["block_size"]),
        mask_token_id=int(d["mask_token_id"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        rope_scaling=d.get("rope_scaling"),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        markov_rank=int(d.get("markov_rank", 0)),
        markov_head_type=str(d.get("markov_head_type", "vanilla")).lower(),
        confidence_head=bool(d.get("enable_confidence_head", False)),
        confidence_with_markov=bool(d.get("confidence_head_with_markov", False)),
        sample_from_anchor=bool(d.get("sample_from_anchor", True)),
    )


def load_deepspec_dspark(path: str | Path, policy: Optional[nn.Module] = None) -> DSparkDraft:
    """A :class:`DSparkDraft` from a DeepSpec DSpark directory; ``policy``: the target whose ``embed_tokens`` /
    ``lm_head`` the checkpoint copies (checked equal; required when the checkpoint carries them).

    Raises:
        FileNotFoundError: no config.json or no weights.
        ValueError: a tensor missing, unexpected or of another shape, or a copied embedding / head that is not the
            policy's, naming it.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} not found: a DSpark directory holds config.json + weights")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    draft = DSparkDraft(from_deepspec_dict(json.loads((path / "config.json").read_text())))
    state = {k.removeprefix("model."): v for f in files for k, v in load_file(str(f)).items()}
    for key, paths in OWN_COPIES.items():
        if key not in state:
            continue
        copy = state.pop(key)
        if policy is None:
            raise ValueError(
                f"{path}: the checkpoint carries its own {key} (a copy of the target's); pass the policy it was "
                f"trained against (load_deepspec_dspark(path, policy)) so the copy can be checked"
            )
        original = _original(policy, paths)
        if copy.shape != original.shape or not torch.equal(copy.to(original.dtype), original):
            raise ValueError(f"{path}: {key} is not the policy's: this drafter was trained for another target")
    expected = draft.state_dict()
    extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if extra or missing:
        raise ValueError(
            f"{path}: unexpected tensors {extra[:5]}" if extra else f"{path}: missing tensors {missing[:5]}"
        )
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}")
    draft.load_state_dict(state)
    return draft


def load_dspark(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> DSparkDraft:
    """A DSpark drafter from a directory written by :meth:`DSparkDraft.save_pretrained` (or a DeepSpec one without
    its own embedding / head copies: :func:`load_deepspec_dspark` with the policy checks those)."""
    return load_deepspec_dspark(path).to(device=device, dtype=dtype)
