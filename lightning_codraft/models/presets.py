"""Built-in architectures: the shapes of well-known checkpoints, so a tool can reason about a model whose weights are
not at hand (``codraft plan`` on a laptop for a cluster recipe).

Each preset is the :class:`~lightning_codraft.models.config.PolicyConfig` that ``PolicyConfig.from_hf_dict`` reads
from the model's Hugging Face ``config.json`` (the values below are copied from those files, field by field):

=================  ==================================  ======  =====  ======  ===  ========  ===  ==========  =====
preset             Hugging Face repository              vocab   H      I       L    heads/kv  D    rope_theta  tied
=================  ==================================  ======  =====  ======  ===  ========  ===  ==========  =====
``qwen3-8b``       Qwen/Qwen3-8B                        151936  4096   12288   36   32 / 8    128  1e6         no
``llama-3.1-8b``   meta-llama/Llama-3.1-8B              128256  4096   14336   32   32 / 8    128  5e5 llama3  no
``qwen2.5-7b``     Qwen/Qwen2.5-7B                      152064  3584   18944   28   28 / 4    128  1e6         no
``smollm2-135m``   HuggingFaceTB/SmolLM2-135M-Instruct  49152   576    1536    30   9 / 3     64   1e5         yes
=================  ==================================  ======  =====  ======  ===  ========  ===  ==========  =====

(Llama-3.1-8B's ``rope_scaling`` is ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``; ``head_dim`` is derived as ``H / heads``
where the config.json omits it.)

:func:`resolve_architecture` turns a recipe's ``model.config`` (a preset name, a ``config.json`` path or a
checkpoint directory holding one) into a ``PolicyConfig``; :func:`architecture_differences` lists what makes two
configs build different parameters (a recipe that names a preset for a checkpoint is checked against the
checkpoint's own file).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lightning_codraft.models.config import PolicyConfig
from lightning_codraft.models.tokenizer import CharTokenizer

#: preset name -> the HF config.json fields that shape the model (plus token ids and the context length)
_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(  # Qwen/Qwen3-8B config.json
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=None,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B config.json
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2.5-7b": dict(  # Qwen/Qwen2.5-7B config.json
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151643,
    ),
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M-Instruct config.json
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
}

PRESETS: tuple[str, ...] = tuple(_HF_CONFIGS)
"""Names of the built-in architectures."""

#: PolicyConfig fields that do not change which parameters a model has or their shapes
_NOT_SHAPE = (
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "extra",
)


def preset_config(name: str) -> PolicyConfig:
    """The :class:`PolicyConfig` of built-in architecture ``name`` (one of :data:`PRESETS`, case-insensitive)."""
    key = name.strip().lower()
    if key not in _HF_CONFIGS:
        raise ValueError(
            f"unknown built-in architecture {name!r}; built-in: {', '.join(PRESETS)} (or give the path "
            f"of a Hugging Face config.json)"
        )
    return PolicyConfig.from_hf_dict(_HF_CONFIGS[key])


def resolve_architecture(spec: str) -> PolicyConfig:
    """A preset name, a ``config.json`` path or a directory holding one -> its :class:`PolicyConfig`.

    Raises:
        FileNotFoundError: ``spec`` looks like a path (or is no preset) and no config.json is there.
        ValueError: the config.json describes an unsupported architecture.
    """
    if spec.strip().lower() in _HF_CONFIGS:
        return preset_config(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{spec!r} is neither a built-in architecture ({', '.join(PRESETS)}) nor a "
            f"config.json file or a directory holding one"
        )
    return PolicyConfig.from_hf_dict(json.loads(path.read_text()))


def recipe_architecture(model) -> PolicyConfig:
    """The architecture of a recipe's ``model`` section (a :class:`~lightning_codraft.config.ModelConfig`), without
    loading weights: what ``codraft fit`` builds and ``codraft plan`` plans.

    ``tiny``: the section's fields over the :class:`~lightning_codraft.models.tokenizer.CharTokenizer` vocabulary.
    Otherwise ``model.config`` when set (:func:`resolve_architecture`), else ``smollm2-135m``'s built-in
    architecture or the checkpoint directory's config.json.

    Raises:
        ValueError: ``model.config`` names neither a built-in architecture nor a valid config.json (the message
            names the key).
        FileNotFoundError: ``model.source`` is a directory without config.json and ``model.config`` is null.
    """
    if model.source == "tiny":
        tok = CharTokenizer()
        return PolicyConfig.tiny(
            vocab_size=tok.vocab_size,
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size,
            num_hidden_layers=model.num_hidden_layers,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_key_value_heads,
            max_position_embeddings=model.max_position_embeddings,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    if model.config is not None:
        try:
            return resolve_architecture(model.config)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"model.config={model.config!r}: {e}") from None
    if model.source == "smollm2-135m":
        return preset_config("smollm2-135m")
    path = Path(model.source) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"model.source={model.source!r} is not 'tiny', 'smollm2-135m' or a Hugging Face "
            f"checkpoint directory with config.json (to plan without the weights, name its "
            f"architecture: model.config=qwen3-8b or a config.json path)"
        )
    return PolicyConfig.from_hf_dict(json.loads(path.read_text()))


def architecture_differences(a: PolicyConfig, b: PolicyConfig) -> list[str]:
    """The fields that make ``a`` and ``b`` build different parameters (empty: same names and shapes)."""
    fields = [f.name for f in dataclasses.fields(PolicyConfig) if f.name not in _NOT_SHAPE]
    return [f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}" for f in fields if getattr(a, f) != getattr(b, f)]
