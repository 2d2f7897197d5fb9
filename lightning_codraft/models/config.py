"""Model shapes with HF / vLLM ``config.json`` field names: :class:`PolicyConfig` (a Llama-family policy: Llama 2/3,
Qwen2, Qwen3, SmolLM2) and :class:`Eagle3Config` (an EAGLE-3 draft, vLLM's ``LlamaForCausalLMEagle3``).

``PolicyConfig.from_hf_dict(json.load(open("config.json")))`` reads a Hugging Face config;
``to_hf_dict()`` writes one that ``transformers`` (and vLLM) load. The architecture decides the details HF
hard-codes per family: Qwen2 always has q/k/v biases and no o_proj bias, Qwen3 normalises q and k per head,
Llama's ``attention_bias`` covers all four projections.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_codraft.models.rope import SUPPORTED_ROPE_TYPES, rope_scaling_type

#: architecture name -> HF model_type
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}


ATTENTION_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
)
"""The attention geometry a policy's and a draft's ``config.json`` both carry, under these names."""


def attention_fields(config) -> dict:
    """``config``'s :data:`ATTENTION_FIELDS`, by name (for a ``config.json``)."""
    return {name: getattr(config, name) for name in ATTENTION_FIELDS}


@dataclass
class PolicyConfig:
    """Shape and numerics of a Llama-family decoder (field names as in HF ``config.json``)."""

    vocab_size: int = 32000
    """Number of token ids (rows of ``embed_tokens`` and ``lm_head``)."""
    hidden_size: int = 4096
    """Model width H."""
    intermediate_size: int = 11008
    """Inner width of the gated MLP."""
    num_hidden_layers: int = 32
    """Number of decoder layers L."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (GQA when fewer than query heads); None means equal to ``num_attention_heads``."""
    head_dim: int | None = None
    """Per-head dimension; None means ``hidden_size // num_attention_heads`` (Qwen3 sets it explicitly)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict | None = None
    """HF ``rope_scaling`` dict (``rope_type`` ``linear`` or ``llama3``) or None for plain RoPE."""
    max_position_embeddings: int = 4096
    """Longest position the model was trained for (informational; RoPE is computed on the fly)."""
    tie_word_embeddings: bool = False
    """``lm_head`` shares its weight with ``embed_tokens`` (SmolLM2, small Qwen models)."""
    attention_bias: bool = False
    """q/k/v projections carry biases (always True for Qwen2)."""
    o_proj_bias: bool = False
    """o_proj carries a bias (Llama/Qwen3 with ``attention_bias: true``; never Qwen2)."""
    mlp_bias: bool = False
    """gate/up/down projections carry biases (Llama ``mlp_bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (``q_norm`` / ``k_norm``, Qwen3)."""
    architecture: str = "LlamaForCausalLM"
    """HF architecture name, one of :data:`ARCHITECTURES`."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if any."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id(s), if any."""
    pad_token_id: int | None = None
    """Padding token id, if any."""
    extra: dict = field(default_factory=dict, compare=False)
    """Informational config.json fields kept for :meth:`to_hf_dict` (not compared: they do not shape the model)."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {sorted(ARCHITECTURES)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        kind = rope_scaling_type(self.rope_scaling)
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def model_type(self) -> str:
        """HF ``model_type`` of :attr:`architecture`."""
        return ARCHITECTURES[self.architecture]

    @classmethod
    def tiny(cls, **overrides: Any) -> PolicyConfig:
        """A 4-layer, 64-wide, GQA model for tests; keyword arguments override any field.

        ``architecture="Qwen2ForCausalLM"`` defaults to q/k/v biases, ``"Qwen3ForCausalLM"`` to q/k norms and
        ``head_dim=32`` (not ``hidden_size // heads``), as those families have.
        """
        arch = overrides.get("architecture", "LlamaForCausalLM")
        family = {
            "Qwen2ForCausalLM": dict(attention_bias=True),
            "Qwen3ForCausalLM": dict(qk_norm=True, head_dim=32),
        }.get(arch, {})
        base = dict(
            **family,
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=256,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf_dict(cls, d: dict) -> PolicyConfig:
        """Build from a HF ``config.json`` dict (transformers 4 ``rope_scaling`` or 5 ``rope_parameters``)."""
        d = dict(d)
        archs = d.pop("architectures", None) or []
        model_type = d.pop("model_type", None)
        if archs:
            arch = archs[0]
            if arch not in ARCHITECTURES:
                raise ValueError(
                    f"unsupported architectures {archs} in config.json; supported: {sorted(ARCHITECTURES)}"
                )
        elif model_type in _MODEL_TYPE_TO_ARCH:
            arch = _MODEL_TYPE_TO_ARCH[model_type]
        else:
            raise ValueError(
                f"unsupported model_type {model_type!r} (and no architectures) in config.json; "
                f"supported model types: {sorted(_MODEL_TYPE_TO_ARCH)}"
            )
        if model_type is not None and model_type != ARCHITECTURES[arch]:
            raise ValueError(
                f"config.json: model_type {model_type!r} does not match architecture {arch!r} "
                f"(expected model_type {ARCHITECTURES[arch]!r})"
            )
        act = d.pop("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
        if d.pop("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported; full causal attention only")
        rope_params = d.pop("rope_parameters", None)
        rope_scaling = d.pop("rope_scaling", None)
        rope_theta = d.pop("rope_theta", None)
        if rope_params:
            rope_params = dict(rope_params)
            rope_theta = rope_params.pop("rope_theta", rope_theta)
            if rope_scaling_type(rope_params) != "default":
                rope_scaling = rope_params
        attn_bias = bool(d.pop("attention_bias", False))
        kw: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)} - {
            "extra",
            "architecture",
            "rope_scaling",
            "rope_theta",
            "attention_bias",
            "o_proj_bias",
            "qk_norm",
        }
        for name in names:
            if name in d:
                kw[name] = d.pop(name)
        if arch == "Qwen2ForCausalLM":
            kw.update(attention_bias=True, o_proj_bias=False, qk_norm=False)
        elif arch == "Qwen3ForCausalLM":
            kw.update(attention_bias=attn_bias, o_proj_bias=attn_bias, qk_norm=True)
        else:
            kw.update(attention_bias=attn_bias, o_proj_bias=attn_bias, qk_norm=False)
        if rope_theta is not None:
            kw["rope_theta"] = float(rope_theta)
        if rope_scaling:
            kw["rope_scaling"] = dict(rope_scaling)
        keep = {k: v for k, v in d.items() if k in _PASSTHROUGH and v is not None}
        return cls(architecture=arch, extra=keep, **kw)

    def to_hf_dict(self) -> dict:
        """A HF ``config.json`` dict that ``transformers.AutoConfig`` and vLLM read back to this config."""
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            hidden_act="silu",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            **attention_fields(self),
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.architecture == "Qwen2ForCausalLM":
            if not self.attention_bias or self.o_proj_bias or self.qk_norm:
                raise ValueError(
                    "Qwen2ForCausalLM needs attention_bias=True, o_proj_bias=False, qk_norm=False; got "
                    f"{self.attention_bias}, {self.o_proj_bias}, {self.qk_norm}"
                )
            d["use_sliding_window"] = False
        else:
            if self.attention_bias != self.o_proj_bias:
                raise ValueError(
                    f"{self.architecture} biases all four attention projections or none; got "
                    f"attention_bias={self.attention_bias}, o_proj_bias={self.o_proj_bias}"
                )
            if self.qk_norm != (self.architecture == "Qwen3ForCausalLM"):
                raise ValueError(
                    f"qk_norm={self.qk_norm} is not expressible as {self.architecture}; "
                    "use Qwen3ForCausalLM for q/k norms"
                )
            d["attention_bias"] = self.attention_bias
            if self.architecture == "LlamaForCausalLM":
                d["mlp_bias"] = self.mlp_bias
        if self.mlp_bias and self.architecture != "LlamaForCausalLM":
            raise ValueError(f"mlp_bias=True is only expressible as LlamaForCausalLM, not {self.architecture}")
        return d


#: config.json fields carried through unchanged (not used by the model, but useful to tools reading the dir)
_PASSTHROUGH = ("initializer_range", "use_cache")


#: ``architectures`` written to config.json; the second spelling is also accepted on load (both are vLLM's).
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
_ACCEPTED_ARCHITECTURES = (VLLM_ARCHITECTURE, "Eagle3LlamaForCausalLM")


@dataclass
class DrafterShape:
    """What every drafter's config starts with: the policy's width and vocabulary, its draft layers' attention and
    MLP geometry (HF / vLLM config.json field names)."""

    hidden_size: int
    """H, equal to the policy's hidden size (a drafter consumes the policy's embeddings and taps)."""
    intermediate_size: int
    """Inner width of a draft layer's gated MLP."""
    num_attention_heads: int
    """Query heads of a draft layer."""
    num_key_value_heads: int
    """Key/value heads (GQA when smaller than ``num_attention_heads``)."""
    head_dim: int
    """Per-head width D (even, for RoPE)."""
    vocab_size: int
    """V, the policy's (target) vocabulary."""


def shape_fields(d: dict) -> dict:
    """:class:`DrafterShape`'s fields from a drafter's HF ``config.json`` dict (``num_key_value_heads`` and
    ``head_dim`` defaulted as HF does)."""
    heads = int(d["num_attention_heads"])
    return dict(
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        vocab_size=int(d["vocab_size"]),
    )


@dataclass
class Eagle3Config(DrafterShape):
    """Shape of an EAGLE-3 draft (HF / vLLM config.json field names); ``t2d`` has ``vocab_size`` entries."""

    draft_vocab_size: int
    """Vd <= V, rows of ``lm_head``; ``d2t`` has this length."""
    taps: tuple[int, ...]
    """Three increasing policy tap ids fused by ``fc`` in this order (tap l = hidden state entering policy layer
    l); written to config.json as vLLM's ``eagle_aux_hidden_state_layer_ids``."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm of the draft."""
    rope_theta: float = 10000.0
    """RoPE base (the policy's)."""
    rope_scaling: dict | None = None
    """HF ``rope_scaling`` dict (the policy's) or None."""
    max_position_embeddings: int = 4096
    """Longest context the draft is used at (config.json metadata for vLLM)."""

    def __post_init__(self) -> None:
        self.taps = tuple(int(t) for t in self.taps)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "draft_vocab_size",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Eagle3Config.{name}={getattr(self, name)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size="
                f"{self.vocab_size}; it must be in [1, {self.vocab_size}]"
            )
        if len(self.taps) != 3 or len(set(self.taps)) != 3 or min(self.taps) < 0:
            raise ValueError(
                f"taps={self.taps} must be three distinct non-negative policy tap ids (vLLM's "
                "eagle_aux_hidden_state_layer_ids must be distinct), e.g. (2, L//2, L-3)"
            )
        if list(self.taps) != sorted(self.taps):
            raise ValueError(
                f"taps={self.taps} must be increasing, e.g. {tuple(sorted(self.taps))}: vLLM concatenates "
                "the aux hidden states for fc in layer order"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json for vLLM's ``LlamaForCausalLMEagle3`` loader."""
        taps = list(self.taps)
        return dict(
            architectures=[VLLM_ARCHITECTURE],
            model_type="llama",
            hidden_act="silu",
            num_hidden_layers=1,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            **attention_fields(self),
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.hidden_size,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            norm_before_residual=False,
            eagle_aux_hidden_state_layer_ids=taps,
            eagle_config={"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True},
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        """Inverse of :meth:`to_hf_dict`; accepts transformers-5 ``rope_parameters`` too."""
        archs = d.get("architectures") or []
        if not any(a in _ACCEPTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"unsupported architectures {archs} in the draft's config.json; expected "
                f"{[VLLM_ARCHITECTURE]} (an EAGLE-3 draft)"
            )
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"num_hidden_layers={d['num_hidden_layers']}: only single-layer EAGLE-3 drafts (midlayer) are supported"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is implemented")
        for flag in ("attention_bias", "mlp_bias", "norm_before_residual"):
            if d.get(flag):
                raise ValueError(f"{flag}=true is not supported by Eagle3Draft; expected false")
        taps = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if not taps:
            raise ValueError(
                "the draft's config.json has no eagle_aux_hidden_state_layer_ids; add the three policy "
                "tap ids the draft was trained on, or load it with policy= for vLLM's default "
                "[2, L//2, L-3]"
            )
        rope_theta, rope_scaling = d.get("rope_theta"), d.get("rope_scaling")
        params = d.get("rope_parameters")
        if params:
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return cls(
            **shape_fields(d),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            taps=tuple(taps),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )
