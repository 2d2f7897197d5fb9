"""The fused decoders: the policy's and the draft's decode math from their own parameters, with fewer ops per step.

:class:`FusedPolicyDecoder` and :class:`FusedDraftDecoder` implement models/decode.py's ``PolicyDecoder`` and
``DraftDecoder`` (what ``Policy.forward(ids, kv_cache=...)`` and ``Eagle3Draft.step`` compute); decode.py says
when they are used and how they are fast, tests/models/test_decode.py compares them with a full recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_codraft.attention.cached import attended_slots, decode_attention
from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.models.packed_linear import PackedLinear

Taps = tuple[Tensor, ...]


def gather_rows(x: Tensor, logit_rows: Tensor | None) -> Tensor:
    """x ``(B, S, ...)`` -> ``(B, ...)`` at index ``logit_rows[b]`` of each row, or x itself when None."""
    if logit_rows is None:
        return x
    return x[torch.arange(x.shape[0], device=x.device), logit_rows]


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of the last dimension with the module's numerics (fp32 statistics, cast back)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _cat(*tensors: Tensor | None) -> Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors, dim=0)


def _caster(dtype: torch.dtype | None):
    """``t -> t.to(dtype)`` (None passes through; no copy when ``t`` already has that dtype)."""
    return lambda t: t if t is None or dtype is None else t.to(dtype)


@dataclass
class _Layer:
    """One decoder layer's weights: norms and o/down projections by reference, q/k/v and gate/up concatenated."""

    ln1: Tensor
    ln2: Tensor
    qkv: PackedLinear
    o: PackedLinear
    gu: PackedLinear
    down: PackedLinear
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None

    @classmethod
    def pack(
        cls,
        ln1: nn.Module,
        ln2: nn.Module,
        attn: nn.Module,
        mlp: nn.Module,
        eps: float,
        dtype: torch.dtype | None = None,
    ) -> _Layer:
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        c = _caster(dtype)
        return cls(
            ln1=c(ln1.weight),
            ln2=c(ln2.weight),
            qkv=PackedLinear(c(torch.cat([q.weight, k.weight, v.weight])), c(_cat(q.bias, k.bias, v.bias))),
            o=PackedLinear(c(o.weight), c(o.bias)),
            gu=PackedLinear(c(torch.cat([g.weight, u.weight])), c(_cat(g.bias, u.bias))),
            down=PackedLinear(c(d.weight), c(d.bias)),
            heads=int(attn.num_heads),
            kv_heads=int(attn.num_kv_heads),
            head_dim=int(attn.head_dim),
            eps=float(eps),
            q_norm=c(attn.q_norm.weight) if hasattr(attn, "q_norm") else None,
            k_norm=c(attn.k_norm.weight) if hasattr(attn, "k_norm") else None,
        )


@dataclass
class _Geometry:
    """Per-forward indices shared by every layer: positions, cache slots, RoPE rows and the attention mask."""

    rows: Tensor | None  # (B, S) row index of each new token; None for a single row
    slots: Tensor | int  # (B, S) cache slot (= absolute position) of each new token; a single row's first slot
    cos: Tensor  # (B, S, 1, D)
    sin: Tensor  # (B, S, 1, D)
    visible: int  # slots any query can see: max position + 1
    width: int  # slots attended (attention.cached.attended_slots): ``visible`` or the whole cache
    mask: Tensor | None  # (B, 1, S, width) additive 0 / -inf, None when every query sees every attended slot


class _FusedMath:
    """The shared pieces of the fused decoders: geometry, RoPE, attention with cache writes, gated MLP.

    Args:
        module: the model decoded; its parameters are read at construction (rebuild after a weight update).
        capacity: largest cache capacity the caller will use (RoPE table size).
        rotary: the model's RoPE module, ``rotary(positions, dtype) -> (cos, sin)``.
        like: a (cast) weight of the decoder: the dtype and device of the tables and caches.
    """

    def __init__(self, module: nn.Module, capacity: int, rotary, like: Tensor):
        self.module = module
        self.capacity = int(capacity)
        self.dtype = like.dtype
        positions = torch.arange(self.capacity, device=like.device)
        self.cos, self.sin = rotary(positions, like.dtype)  # (C, D) each
        self._rotate_half: dict[int, Tensor] = {}

    def allocate_cache(self, batch_size: int, capacity: int) -> KVCache:
        return self.module.allocate_kv_cache(batch_size, capacity, dtype=self.dtype)

    def _geometry(self, cache: KVCache, num_tokens: int) -> _Geometry:
        capacity = min(cache.capacity, self.capacity)
        start = cache.lengths
        batch = start.shape[0]
        first = int(start[0]) if batch == 1 else None
        top = (first if batch == 1 else int(start.max())) + num_tokens  # the one host sync of the forward
        if top > capacity:
            raise ValueError(
                f"KV cache overflow: a row at length {top - num_tokens} + {num_tokens} new tokens "
                f"needs {top} slots but capacity is {capacity}; allocate a larger cache"
            )
        offsets = torch.arange(num_tokens, device=start.device)
        cos, sin = self.cos, self.sin
        width = attended_slots(top, cache.capacity, num_tokens, start.device)
        slot_ids = torch.arange(width, device=start.device)
        if first is not None:  # one row: its slots are the contiguous range [first, top)
            mask = None
            if num_tokens > 1 or width > top:
                visible = slot_ids[None, :] <= (offsets + first)[:, None]  # (S, W)
                mask = torch.zeros(visible.shape, dtype=cos.dtype, device=start.device)
                mask = mask.masked_fill_(~visible, float("-inf"))[None, None]
            return _Geometry(
                rows=None,
                slots=first,
                cos=cos[first:top][None, :, None],
                sin=sin[first:top][None, :, None],
                visible=top,
                width=width,
                mask=mask,
            )
        slots = start[:, None] + offsets  # (B, S)
        rows = torch.arange(batch, device=start.device)[:, None].expand(batch, num_tokens)
        visible = slot_ids[None, None, :] <= slots[:, :, None]  # (B, S, W)
        mask = torch.zeros(visible.shape, dtype=cos.dtype, device=start.device)
        mask = mask.masked_fill_(~visible, float("-inf"))[:, None]
        return _Geometry(
            rows=rows,
            slots=slots,
            cos=cos[slots][:, :, None],
            sin=sin[slots][:, :, None],
            visible=top,
            width=width,
            mask=mask,
        )

    def _rotate(self, x: Tensor, geo: _Geometry) -> Tensor:
        """x: (B, S, h, D) -> RoPE-rotated ``x * cos + rotate_half(x) * sin`` (half-split layout).

        ``rotate_half(x) = x @ R`` with R the signed permutation ``cat(-x2, x1)``: one exact matmul (each output
        is a single ±x term) instead of two slices, a negation and a concatenation; as one 2-D matmul over the
        flattened rows (``x`` is a slice of the fused qkv: a batched ``x @ R`` would copy ``R`` once per row and
        head, ~25 MB a layer at batch 256).
        """
        R = self._rotate_half.get(x.shape[-1])
        if R is None or R.dtype != x.dtype:
            half = x.shape[-1] // 2
            R = torch.zeros(x.shape[-1], x.shape[-1], dtype=x.dtype, device=x.device)
            R[torch.arange(half, 2 * half), torch.arange(half)] = -1.0
            R[torch.arange(half), torch.arange(half, 2 * half)] = 1.0
            self._rotate_half[x.shape[-1]] = R
        return torch.addcmul(x * geo.cos, (x.reshape(-1, x.shape[-1]) @ R).view(x.shape), geo.sin)

    def _attention(self, layer: _Layer, x: Tensor, k_cache: Tensor, v_cache: Tensor, geo: _Geometry) -> Tensor:
        """x: (B, S, H_in) normed attention input -> (B, S, H) o_proj output; writes the new keys/values."""
        B, S = x.shape[:2]
        heads, kv_heads = layer.heads, layer.kv_heads
        qkv = layer.qkv(x).view(B, S, heads + 2 * kv_heads, layer.head_dim)
        if layer.q_norm is None:
            qk = self._rotate(qkv[:, :, : heads + kv_heads], geo)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        else:
            q = self._rotate(_rms(qkv[:, :, :heads], layer.q_norm, layer.eps), geo)
            k = self._rotate(_rms(qkv[:, :, heads : heads + kv_heads], layer.k_norm, layer.eps), geo)
        v = qkv[:, :, heads + kv_heads :]
        L = geo.visible
        if geo.rows is None:  # one row: slice copy into slots [L - S, L)
            k_cache[0, :, L - S : L] = k[0].transpose(0, 1)
            v_cache[0, :, L - S : L] = v[0].transpose(0, 1)
        else:
            k_cache[geo.rows, :, geo.slots] = k.to(k_cache.dtype)
            v_cache[geo.rows, :, geo.slots] = v.to(v_cache.dtype)
        W = geo.width
        out = decode_attention(q.transpose(1, 2), k_cache[:, :, :W], v_cache[:, :, :W], geo.mask)
        return layer.o(out.transpose(1, 2).reshape(B, S, heads * layer.head_dim))

    @staticmethod
    def _mlp(layer: _Layer, x: Tensor) -> Tensor:
        gate, up = layer.gu(_rms(x, layer.ln2, layer.eps)).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)


class FusedPolicyDecoder(_FusedMath):
    """:class:`PolicyDecoder` of a :class:`~lightning_codraft.models.Policy` (or a subclass): ``(policy,
    capacity, dtype=None)``, its parameters read now (rebuild after a weight update); ``dtype`` decodes from a
    copy of the weights in that dtype (e.g. bfloat16, as rollout engines serve an fp32-trained policy), caches
    and taps in it too, RMSNorm statistics in fp32 as the module computes them."""

    def __init__(self, policy: nn.Module, capacity: int, dtype: torch.dtype | None = None):
        backbone, eps, c = policy.model, float(policy.config.rms_norm_eps), _caster(dtype)
        self.embed_weight = c(backbone.embed_tokens.weight)
        super().__init__(policy, capacity, policy.rotary, self.embed_weight)
        self.layers = [
            _Layer.pack(l.input_layernorm, l.post_attention_layernorm, l.self_attn, l.mlp, eps, dtype)
            for l in backbone.layers
        ]
        tied = policy.lm_head.weight is backbone.embed_tokens.weight
        self.eps, self.norm = eps, c(backbone.norm.weight)
        self.lm_head = PackedLinear(self.embed_weight if tied else c(policy.lm_head.weight))

    def embed(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embed_weight)

    def forward(
        self, ids: Tensor, cache: KVCache, taps: Sequence[int] | None = None, logit_rows: Tensor | None = None
    ) -> tuple[Tensor, Taps | None]:
        B, S = ids.shape
        geo = self._geometry(cache, S)
        x = self.embed(ids)
        captured = {}
        for i, layer in enumerate(self.layers):
            if taps and i in taps:
                captured[i] = x
            x = x + self._attention(layer, _rms(x, layer.ln1, self.eps), cache.k[i], cache.v[i], geo)
            x = x + self._mlp(layer, x)
        if taps and len(self.layers) in taps:
            captured[len(self.layers)] = x
        cache.lengths = cache.lengths + S
        logits = self.lm_head(_rms(gather_rows(x, logit_rows), self.norm, self.eps))
        return logits, (None if taps is None else tuple(captured[t] for t in taps))


class FusedDraftDecoder(_FusedMath):
    """:class:`DraftDecoder` of an :class:`~lightning_codraft.models.Eagle3Draft` (or a subclass): ``(draft,
    capacity, dtype=None)``, its parameters read now (rebuild after a weight update); ``dtype`` as in
    :class:`FusedPolicyDecoder`."""

    def __init__(self, draft: nn.Module, capacity: int, dtype: torch.dtype | None = None):
        mid, eps, c = draft.midlayer, float(draft.config.rms_norm_eps), _caster(dtype)
        self.fc = PackedLinear(c(draft.fc.weight))
        super().__init__(draft, capacity, draft.rotary_emb, self.fc.weight)
        self.in_ln, self.hidden_ln = c(mid.input_layernorm.weight), c(mid.hidden_norm.weight)
        self.layer = _Layer.pack(mid.input_layernorm, mid.post_attention_layernorm, mid.self_attn, mid.mlp, eps, dtype)
        self.eps, self.norm, self.lm_head = eps, c(draft.norm.weight), PackedLinear(c(draft.lm_head.weight))

    def fuse(self, taps: Taps) -> Tensor:
        return self.fc(torch.cat(taps, dim=-1))

    def step(
        self, hidden: Tensor, embeds: Tensor, cache: KVCache, logit_rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        S = hidden.shape[1]
        geo = self._geometry(cache, S)
        x = torch.cat([_rms(embeds, self.in_ln, self.eps), _rms(hidden, self.hidden_ln, self.eps)], dim=-1)
        h = self._attention(self.layer, x, cache.k[0], cache.v[0], geo) + hidden
        h = gather_rows(h, logit_rows)
        out = self._mlp(self.layer, h) + h
        cache.lengths = cache.lengths + S
        return out, self.lm_head(_rms(out, self.norm, self.eps))
