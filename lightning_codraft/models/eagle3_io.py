"""vLLM EAGLE-3 checkpoint I/O for the draft: a directory of ``config.json`` + ``model.safetensors``.

- :func:`save_draft` writes a draft in the layout vLLM loads as ``LlamaForCausalLMEagle3`` (config from
  :meth:`~lightning_codraft.models.config.Eagle3Config.to_hf_dict`); :func:`save_draft_state` the same from a state
  dict.
- :func:`load_draft` reads such a directory (ours or another vLLM-loadable EAGLE-3 draft) into an instance of
  the draft class it is given (``Eagle3Draft.from_pretrained`` passes its own class), strictly: a missing,
  unexpected or mis-shaped tensor is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lightning_codraft.models.config import Eagle3Config

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


def load_draft(draft_cls: type[nn.Module], path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> nn.Module:
    """A ``draft_cls`` (:class:`~lightning_codraft.models.eagle3.Eagle3Draft` or a subclass) holding the draft
    directory ``path``, in ``dtype`` on ``device``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: a draft directory holds config.json + *.safetensors")
    config = Eagle3Config.from_hf_dict(json.loads(cfg_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
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
        raise ValueError(f"{path}: weights do not match an EAGLE-3 draft of this config: missing {missing}, "
                         f"unexpected {unexpected}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)} "
                             "from config.json")
    buffers = {"d2t": state.pop("d2t").long(), "t2d": state.pop("t2d").bool()}
    draft.load_state_dict(state, strict=False)
    draft.set_vocab_mapping(buffers["d2t"], buffers["t2d"])
    return draft.to(device=device, dtype=dtype)
