"""The policy: a Llama-family decoder (Llama 2/3, Qwen2, Qwen3, SmolLM2) with HF names and hidden-state taps.

Read top to bottom: :class:`Attention` -> :class:`DecoderLayer` -> :class:`Policy`. Three input forms:

- packed ``input_ids (T,)`` + ``cu_seqlens (N+1,)`` (+ ``position_ids`` restarting per document): the
  training path. Attention is :func:`lightning_codraft.attention.codraft_attention` (``cp_group`` passed
  through: under CP the inputs are this rank's zigzag shard and ``position_ids`` are required).
- padded ``input_ids (B, T)`` (+ ``attention_mask``, left or right padding): the valid tokens of each row are
  packed into one document and run through the packed path, so each row's positions start at 0 at its first
  valid token (what ``transformers.generate`` does); padded rows get zero logits and taps.
- decode ``input_ids (B, S)`` + ``kv_cache``: positions ``kv_cache.lengths[b] + arange(S)``, attention
  :func:`lightning_codraft.attention.cached.cached_attention`; rows then advance by ``num_new`` (default S).

Pipeline stages are built from ``embed``, ``rotary``, ``model.layers[i](x, cos, sin, cu_seqlens, cp_group)``
and ``head``. The rollout engine decodes through :meth:`Policy.decoder` (models/decode.py: the decode path's
math with fewer ops per layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_codraft.attention import codraft_attention
from lightning_codraft.attention.cached import cached_attention
from lightning_codraft.attention.packing import position_ids_from_cu_seqlens, validate_cu_seqlens
from lightning_codraft.models import hf_io
from lightning_codraft.models.config import PolicyConfig
from lightning_codraft.models.decode import ModulePolicyDecoder, PolicyDecoder, custom_decode_math, plain_parameters
from lightning_codraft.models.fused_decode import FusedPolicyDecoder
from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.models.layers import GatedMLP, RMSNorm
from lightning_codraft.models.rope import RotaryEmbedding, apply_rotary


@dataclass
class PolicyOutput:
    """Result of :meth:`Policy.forward`.

    Attributes:
        logits: ``(..., V)`` with the leading shape of ``input_ids``.
        taps: the requested hidden states, each ``(..., H)``, in the requested order; None if none requested.
    """

    logits: Tensor
    taps: tuple[Tensor, ...] | None = None


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE (and Qwen3 per-head q/k RMSNorm)."""

    def __init__(self, config: PolicyConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: ``(..., H)`` -> q ``(..., Hq, D)``, k and v ``(..., Hkv, D)``; q/k normed (Qwen3) and rotated."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, cp_group=None) -> Tensor:
        """x: ``(T, H)`` packed tokens (this CP rank's shard under CP); cos/sin ``(T, D)``. Returns ``(T, H)``."""
        q, k, v = self.qkv(x, cos, sin)
        out = codraft_attention(q, k, v, cu_seqlens, group=cp_group)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def step(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, q_pos: Tensor) -> Tensor:
        """Decode: x ``(B, S, H)``, cos/sin ``(B, S, D)``, q_pos ``(B, S)``. Writes k/v, returns ``(B, S, H)``."""
        q, k, v = self.qkv(x, cos, sin)
        kv_cache.write(self.layer_idx, k, v)
        out = cached_attention(q, kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx], q_pos)
        return self.o_proj(out.reshape(*x.shape[:2], -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: PolicyConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, cp_group=None) -> Tensor:
        """x: ``(T, H)`` packed tokens; cos/sin ``(T, D)``; cu_seqlens ``(N+1,)`` global. Returns ``(T, H)``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, cp_group)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, q_pos: Tensor) -> Tensor:
        """Decode: x ``(B, S, H)`` -> ``(B, S, H)`` (see :meth:`Attention.step`)."""
        x = x + self.self_attn.step(self.input_layernorm(x), cos, sin, kv_cache, q_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    """Holds the HF ``model.*`` parameters: ``embed_tokens``, ``layers``, ``norm`` (and the RoPE tables)."""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


class Policy(nn.Module):
    """Llama-family causal LM with HF parameter names (``model.embed_tokens``, ``model.layers.{i}.*``,
    ``model.norm``, ``lm_head``) and hidden-state taps (tap ``l`` = hidden state entering layer ``l``).

    Args:
        config: the model shape; see :class:`PolicyConfig`.
    """

    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init: normal(0, std) weights, zero biases, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    # ----- pieces (used by pipeline stages and the draft) -----

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def default_taps(self) -> tuple[int, int, int]:
        """``(2, L//2, L-3)``, the EAGLE-3 default; needs L >= 3."""
        L = self.num_layers
        taps = (2, L // 2, L - 3)
        self.validate_taps(taps)
        return taps

    def validate_taps(self, taps: Sequence[int]) -> tuple[int, ...]:
        """Raise ``ValueError`` unless every tap id is an int in ``[0, L]``; return them as a tuple."""
        L = self.num_layers
        taps = tuple(taps)
        for t in taps:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= L:
                raise ValueError(
                    f"tap id {t!r} out of range: tap ids are ints in [0, {L}] (tap l = hidden state "
                    f"entering layer l of this {L}-layer policy); got taps={taps}"
                )
        return taps

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids ``(...)`` -> ``(..., H)`` token embeddings."""
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        return self.model.embed_tokens(input_ids)

    def rotary(self, position_ids: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """position_ids ``(...)`` -> ``(cos, sin)`` each ``(..., head_dim)`` in ``dtype`` (default: params')."""
        return self.model.rotary_emb(position_ids, dtype or self.model.embed_tokens.weight.dtype)

    def head(self, hidden: Tensor) -> Tensor:
        """hidden ``(..., H)`` (output of the last layer) -> logits ``(..., V)``: final norm then ``lm_head``."""
        return self.lm_head(self.model.norm(hidden))

    # ----- forward -----

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        position_ids: Tensor | None = None,
        taps: Sequence[int] | None = None,
        cp_group=None,
        kv_cache: KVCache | None = None,
        num_new: Tensor | None = None,
    ) -> PolicyOutput:
        """Logits (and taps) for packed, padded or decode input; see the module docstring.

        Args:
            input_ids: ``(T,)`` packed, or ``(B, T)`` padded, or ``(B, S)`` new tokens with ``kv_cache``.
            attention_mask: ``(B, T)`` 1 on real tokens (contiguous per row: left or right padding).
            cu_seqlens: ``(N+1,)`` int32 GLOBAL document boundaries of packed input (default: one document).
            position_ids: ``(T,)`` packed (required under CP) or ``(B, T)`` padded positions.
            taps: tap ids in ``[0, L]`` to return (e.g. :attr:`default_taps`).
            cp_group: context-parallel process group (packed input only).
            kv_cache: decode cache; written in place and advanced.
            num_new: ``(B,)`` tokens each row really adds (right-padded prefill); default ``S``.

        Returns:
            :class:`PolicyOutput` with logits ``(..., V)`` and taps ``(..., H)``, leading shape of ``input_ids``.
        """
        taps = None if taps is None else self.validate_taps(taps)
        if kv_cache is not None:
            if attention_mask is not None or cu_seqlens is not None or cp_group is not None:
                raise ValueError(
                    "decode with kv_cache takes input_ids (B, S) only: no attention_mask (right-pad "
                    "and pass num_new instead), cu_seqlens or cp_group"
                )
            return self._forward_decode(input_ids, kv_cache, num_new, taps)
        if num_new is not None:
            raise ValueError("num_new is only meaningful with kv_cache")
        if input_ids.dim() == 1:
            if attention_mask is not None:
                raise ValueError("packed input_ids (T,) take cu_seqlens, not attention_mask")
            return self._forward_packed(input_ids, cu_seqlens, position_ids, taps, cp_group)
        if input_ids.dim() == 2:
            if cu_seqlens is not None or cp_group is not None:
                raise ValueError(
                    f"input_ids of shape {tuple(input_ids.shape)} is padded (B, T); cu_seqlens and "
                    "cp_group are for packed (T,) input"
                )
            return self._forward_padded(input_ids, attention_mask, position_ids, taps)
        raise ValueError(f"input_ids must be (T,) packed or (B, T) padded, got shape {tuple(input_ids.shape)}")

    def _run_packed(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, taps, cp_group):
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if taps and i in taps:
                captured[i] = x
            x = layer(x, cos, sin, cu_seqlens, cp_group)
        if taps and self.num_layers in taps:
            captured[self.num_layers] = x
        return self.head(x), (tuple(captured[t] for t in taps) if taps is not None else None)

    def _forward_packed(self, input_ids, cu_seqlens, position_ids, taps, cp_group) -> PolicyOutput:
        T = input_ids.shape[0]
        world = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
        if cu_seqlens is None:
            if world > 1:
                raise ValueError("packed input under CP needs the global cu_seqlens")
            cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=input_ids.device)
        validate_cu_seqlens(cu_seqlens, total_tokens=T * world, multiple_of=2 * world if world > 1 else 1)
        if position_ids is None:
            if world > 1:
                raise ValueError(
                    "packed input under CP needs position_ids of this rank's zigzag shard "
                    "(zigzag_shard(position_ids_from_cu_seqlens(cu_seqlens), ...))"
                )
            position_ids = position_ids_from_cu_seqlens(cu_seqlens).to(input_ids.device)
        if position_ids.shape != (T,):
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must match input_ids ({T},)")
        x = self.embed(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        logits, tapped = self._run_packed(x, cos, sin, cu_seqlens.to(input_ids.device), taps, cp_group)
        return PolicyOutput(logits, tapped)

    def _forward_padded(self, input_ids, attention_mask, position_ids, taps) -> PolicyOutput:
        B, T = input_ids.shape
        dev = input_ids.device
        if attention_mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=dev)
        else:
            if attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids' {(B, T)}")
            mask = attention_mask.bool()
        lengths = mask.sum(1)
        start = torch.where(lengths > 0, mask.int().argmax(1), torch.zeros_like(lengths))
        ar = torch.arange(T, device=dev)
        contiguous = (ar >= start[:, None]) & (ar < (start + lengths)[:, None])
        if not torch.equal(contiguous, mask):
            bad = int((contiguous != mask).any(1).nonzero()[0])
            raise ValueError(
                f"attention_mask row {bad} = {mask[bad].int().tolist()} is not left- or right-padded; "
                "real tokens must be contiguous"
            )
        if position_ids is None:
            position_ids = (ar - start[:, None]).clamp(min=0)
        elif position_ids.shape != (B, T):
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must equal input_ids' {(B, T)}")
        if int(lengths.sum()) == 0:
            raise ValueError("attention_mask has no real token in any row")
        nonempty = lengths[lengths > 0]
        cu = torch.zeros(nonempty.numel() + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.cumsum(nonempty, 0)
        flat = mask.reshape(-1)
        x = self.embed(input_ids.reshape(-1)[flat])
        cos, sin = self.rotary(position_ids.reshape(-1)[flat], x.dtype)
        logits, tapped = self._run_packed(x, cos, sin, cu, taps, None)

        def unpack(y: Tensor) -> Tensor:
            out = y.new_zeros(B * T, y.shape[-1])
            out[flat] = y
            return out.view(B, T, -1)

        return PolicyOutput(unpack(logits), None if tapped is None else tuple(unpack(t) for t in tapped))

    def _forward_decode(self, input_ids, kv_cache: KVCache, num_new, taps) -> PolicyOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"decode input_ids must be (B, S), got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if kv_cache.batch_size != B or kv_cache.num_layers != self.num_layers:
            raise ValueError(
                f"kv_cache has batch {kv_cache.batch_size} and {kv_cache.num_layers} layers; input has "
                f"batch {B} and the policy {self.num_layers} layers"
            )
        if num_new is not None and (torch.as_tensor(num_new) > S).any():
            raise ValueError(f"num_new={torch.as_tensor(num_new).tolist()} exceeds the {S} tokens given per row")
        q_pos = kv_cache.positions(S)
        x = self.embed(input_ids)
        cos, sin = self.rotary(q_pos, x.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if taps and i in taps:
                captured[i] = x
            x = layer.step(x, cos, sin, kv_cache, q_pos)
        if taps and self.num_layers in taps:
            captured[self.num_layers] = x
        kv_cache.advance(S if num_new is None else num_new)
        return PolicyOutput(self.head(x), None if taps is None else tuple(captured[t] for t in taps))

    def allocate_kv_cache(self, batch_size: int, capacity: int, device=None, dtype=None) -> KVCache:
        """An empty :class:`KVCache` shaped for this policy."""
        w = self.model.embed_tokens.weight
        c = self.config
        return KVCache.allocate(
            c.num_hidden_layers,
            batch_size,
            c.num_key_value_heads,
            c.head_dim,
            capacity,
            dtype or w.dtype,
            device or w.device,
        )

    def decoder(self, capacity: int, dtype: torch.dtype | None = None) -> PolicyDecoder:
        """The decode-time forward the rollout engine calls, over caches of at most ``capacity`` slots, in
        ``dtype`` (None: the parameters' dtype; e.g. bfloat16 decodes from a bf16 copy of the weights).

        A :class:`~lightning_codraft.models.decode.FusedPolicyDecoder` (the decode path's math with fewer ops,
        reading the weights now: build one after any weight update); subclasses inherit it. Parameters that are
        not plain tensors (DTensor shards) and subclasses that change the decode math (override ``forward``,
        ``_forward_decode``, ``embed`` or ``head``, or swap a layer) get the module path, :meth:`forward` with
        ``kv_cache``.
        """
        if custom_decode_math(self, Policy, ("forward", "_forward_decode", "embed", "head")) or not plain_parameters(
            self
        ):
            return ModulePolicyDecoder(self)
        return FusedPolicyDecoder(self, capacity, dtype)

    # ----- I/O (HF directories; see models.hf_io) -----

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Policy:
        """Load a HF checkpoint directory (config.json + safetensors, sharded or not) as an instance of ``cls``."""
        return hf_io.load_policy(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
        """Write config.json + safetensors that ``transformers.AutoModelForCausalLM`` loads."""
        return hf_io.save_policy(self, path, max_shard_bytes=max_shard_bytes)
