"""vLLM EAGLE-3 checkpoint I/O for the draft: a directory of ``config.json`` + ``model.safetensors``.

- :func:`save_draft` writes a draft in the layout vLLM loads as ``LlamaForCausalLMEagle3`` (config from
  :meth:`~lightning_codraft.models.config.Eagle3Config.to_hf_dict`); :func:`save_draft_state` the same from a state
  dict.
- :func:`load_draft` reads such a directory into an instance of the draft class it is given
  (``Eagle3Draft.from_pretrained`` passes its own class), strictly: a missing, unexpected or mis-shaped tensor is an
  error naming it. It reads the ecosystem's EAGLE-3 formats too:

  - ours and vLLM's (``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``);
  - SpecForge's export: the same names plus ``embed_tokens.weight`` (the target's embedding, which the draft reads
    from the policy): it is checked against ``policy``'s embedding and dropped (a clear error if they differ or no
    policy is given); a config without ``eagle_aux_hidden_state_layer_ids`` (SpecForge's default) gets the policy's
    default taps, as vLLM does;
  - speculators' (``speculators_model_type: eagle3``): the decoder layer's settings under
    ``transformer_layer_config`` and its weights under ``layers.0.*``; ``norm_before_residual`` (vLLM reads a missing
    one as true) and a ``target_hidden_size`` other than the draft's width are refused by name, since this draft
    implements neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lightning_codraft.models.config import VLLM_ARCHITECTURE, Eagle3Config

WEIGHTS_FILE = "model.safetensors"


def save_draft(draft: nn.Module, path: str | Path) -> Path:
    """Write ``draft``'s ``config.json`` + ``model.safetensors`` to ``path`` (created if needed); return it.

    ``d2t`` is omitted when the draft vocabulary is the whole target vocabulary (vLLM then has no
    ``draft_id_to_target_id`` and refuses one); ``t2d`` is always written (vLLM skips it).
    """
    return save_draft_state(draft.state_dict(), draft.config, path)


def save_draft_state(state: dict[str, Tensor], config: Eagle3Config, path: str | Path) -> Path:
    """:func:`save_draft` from a state dict (e.g. gathered from FSDP shards) and the draft's config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = config
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if c.draft_vocab_size == c.vocab_size:
        if bool(state["d2t"].any()):
            raise ValueError("a full-vocabulary draft must have d2t == 0 (identity map)")
        del state["d2t"]
    config = c.to_hf_dict()
    config["torch_dtype"] = str(state["fc.weight"].dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def _speculators_config(d: dict) -> dict:
    """A speculators EAGLE-3 ``config.json`` as the vLLM-style dict :meth:`Eagle3Config.from_hf_dict` reads."""
    if d.get("speculators_model_type") != "eagle3":
        raise ValueError(
            f"speculators_model_type={d.get('speculators_model_type')!r}: only 'eagle3' is an EAGLE-3 draft"
        )
    layer = dict(d.get("transformer_layer_config") or {})
    if not layer:
        raise ValueError(
            "a speculators EAGLE-3 config.json needs transformer_layer_config (the decoder layer's LlamaConfig)"
        )
    target_hidden = d.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != int(layer["hidden_size"]):
        raise ValueError(
            f"target_hidden_size={target_hidden} differs from the draft's hidden_size="
            f"{layer['hidden_size']}; Eagle3Draft fuses taps of its own width only"
        )
    layer.update(
        architectures=[VLLM_ARCHITECTURE],
        num_hidden_layers=1,
        draft_vocab_size=d.get("draft_vocab_size") or layer.get("vocab_size"),
        norm_before_residual=d.get("norm_before_residual", True),
        eagle_aux_hidden_state_layer_ids=d.get("eagle_aux_hidden_state_layer_ids"),
    )
    return layer


def _read_config(path: Path, policy: Optional[nn.Module]) -> Eagle3Config:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: a draft directory holds config.json + *.safetensors")
    d = json.loads(cfg_file.read_text())
    if "speculators_model_type" in d:
        d = _speculators_config(d)
    if policy is not None and not (
        d.get("eagle_aux_hidden_state_layer_ids")
        or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ):
        d = {**d, "eagle_aux_hidden_state_layer_ids": list(policy.default_taps)}  # vLLM's default
    try:
        return Eagle3Config.from_hf_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _drop_embedding(path: Path, embed: Tensor, policy: Optional[nn.Module]) -> None:
    """Check a checkpoint's copy of the target embedding (SpecForge writes one) against the policy's."""
    if policy is None:
        raise ValueError(
            f"{path}: the checkpoint carries embed_tokens.weight (a SpecForge export: the target's "
            f"embedding); pass policy= to from_pretrained so it is checked against the policy's and "
            f"dropped (the draft reads the policy's embedding)"
        )
    own = policy.model.embed_tokens.weight.detach().to("cpu")
    if own.shape != embed.shape:
        raise ValueError(
            f"{path}: embed_tokens.weight has shape {tuple(embed.shape)} but the policy's embedding is "
            f"{tuple(own.shape)}: the draft was trained for another target"
        )
    ref = own.to(embed.dtype).float()
    diff = float((embed.float() - ref).abs().max())
    tol = 1e-6 if embed.dtype == torch.float32 else 1e-2 * float(ref.abs().max())
    if diff > tol:
        raise ValueError(
            f"{path}: embed_tokens.weight differs from the policy's embedding (max difference "
            f"{diff:.3g}): the draft was trained against another target's weights"
        )


def load_draft(
    draft_cls: type[nn.Module],
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    policy: Optional[nn.Module] = None,
) -> nn.Module:
    """A ``draft_cls`` (:class:`~lightning_codraft.models.eagle3.Eagle3Draft` or a subclass) holding the draft
    directory ``path`` (ours, vLLM's, SpecForge's or speculators' format; see the module docstring), in ``dtype``
    on ``device``. ``policy``: the target the draft serves; needed for a checkpoint with ``embed_tokens.weight``
    (checked and dropped) and one without tap ids (the policy's defaults)."""
    path = Path(path)
    config = _read_config(path, policy)
    if policy is not None:
        pc = policy.config
        if (config.vocab_size, config.hidden_size) != (pc.vocab_size, pc.hidden_size):
            raise ValueError(
                f"{path}: the draft was built for vocab_size={config.vocab_size}, hidden_size="
                f"{config.hidden_size} but the policy has {pc.vocab_size}, {pc.hidden_size}"
            )
        policy.validate_taps(config.taps)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(
            {
                ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
                for k, v in load_file(str(f)).items()
            }
        )
    if "embed_tokens.weight" in state:
        _drop_embedding(path, state.pop("embed_tokens.weight"), policy)
    draft = draft_cls(config)
    Vd, V = config.draft_vocab_size, config.vocab_size
    if "d2t" not in state:
        if Vd != V:
            raise ValueError(f"{path}: draft_vocab_size={Vd} < vocab_size={V} but the weights have no d2t")
        state["d2t"] = torch.zeros(Vd, dtype=torch.int64)
    if "t2d" not in state:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.arange(Vd) + state["d2t"].long()] = True
        state["t2d"] = t2d
    expected = draft.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match an EAGLE-3 draft of this config: missing {missing}, unexpected {unexpected}"
        )
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)} from config.json"
            )
    buffers = {"d2t": state.pop("d2t").long(), "t2d": state.pop("t2d").bool()}
    draft.load_state_dict(state, strict=False)
    draft.set_vocab_mapping(buffers["d2t"], buffers["t2d"])
    return draft.to(device=device, dtype=dtype)
