"""Lean decode-time forwards of the policy and the EAGLE-3 draft for the embedded engine.

At rollout sizes a decode step is bound by per-op overhead (Python dispatch and small kernels), not FLOPs.
:class:`DecodeStep` computes exactly what ``Policy.forward(ids, kv_cache=...)`` and ``Eagle3Draft.step``
compute, from the same modules' parameters (read at construction, so build one per ``generate`` call, after
any weight update), with fewer ops per layer:

- q/k/v and gate/up projections as one matmul each (weights concatenated once per construction);
- RoPE cos/sin gathered from a table built once for every cache slot (the same elementwise values the modules
  compute per step), rotated for q and k together;
- the attention mask, cache slots and positions built once per forward and shared by all layers;
- capacity checked once per forward instead of in every layer;
- logits only at the rows the caller needs (``logit_rows``).

Caches are the engine's :class:`~lightning_codraft.models.kv_cache.KVCache` objects (same layout, same
``lengths`` semantics), so ``truncate`` / row selection work unchanged. Values equal the module path up to
floating-point reassociation of the fused matmuls (fp32: ~1e-6); tests compare both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_codraft.models.eagle3 import Eagle3Draft
from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.models.policy import Policy


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of the last dimension with the module's numerics (fp32 statistics, cast back)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _cat(*tensors: Tensor | None) -> Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors, dim=0)


@dataclass
class _Layer:
    """One decoder layer's weights: norms and o/down projections by reference, q/k/v and gate/up concatenated."""

    ln1: Tensor
    ln2: Tensor
    wqkv: Tensor
    bqkv: Tensor | None
    wo: Tensor
    bo: Tensor | None
    wgu: Tensor
    bgu: Tensor | None
    wd: Tensor
    bd: Tensor | None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None


def _pack_layer(ln1: nn.Module, ln2: nn.Module, attn: nn.Module, mlp: nn.Module) -> _Layer:
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    return _Layer(ln1=ln1.weight, ln2=ln2.weight, wqkv=torch.cat([q.weight, k.weight, v.weight]),
                  bqkv=_cat(q.bias, k.bias, v.bias), wo=o.weight, bo=o.bias,
                  wgu=torch.cat([g.weight, u.weight]), bgu=_cat(g.bias, u.bias), wd=d.weight, bd=d.bias,
                  q_norm=attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                  k_norm=attn.k_norm.weight if hasattr(attn, "k_norm") else None)


@dataclass
class _StepGeometry:
    """Per-forward indices shared by every layer: positions, cache slots, RoPE rows and the attention mask."""

    rows: Tensor | None  # (B, S) row index of each new token; None for a single row
    slots: Tensor | int  # (B, S) cache slot (= absolute position) of each new token; a single row's first slot
    cos: Tensor         # (B, S, 1, D)
    sin: Tensor         # (B, S, 1, D)
    visible: int        # slots any query can see: max position + 1
    mask: Tensor | None  # (B, 1, S, visible) additive 0 / -inf, None when every query sees every visible slot


class DecodeStep:
    """Decode forwards of ``policy`` (and ``draft``) over KV caches of at most ``capacity`` slots.

    Args:
        policy: a :class:`~lightning_codraft.models.Policy`.
        draft: an :class:`~lightning_codraft.models.Eagle3Draft` or None.
        capacity: largest cache capacity the caller will use (RoPE table size).
    """

    def __init__(self, policy: nn.Module, draft: nn.Module | None, capacity: int):
        pc = policy.config
        self._rotate_half: dict[int, Tensor] = {}
        self.eps = float(pc.rms_norm_eps)
        self.num_heads, self.num_kv_heads = int(pc.num_attention_heads), int(pc.num_key_value_heads)
        self.head_dim = int(policy.model.layers[0].self_attn.head_dim)
        self.embed_weight = policy.model.embed_tokens.weight
        dtype, device = self.embed_weight.dtype, self.embed_weight.device
        self.layers = [_pack_layer(l.input_layernorm, l.post_attention_layernorm, l.self_attn, l.mlp)
                       for l in policy.model.layers]
        self.norm, self.lm_head = policy.model.norm.weight, policy.lm_head.weight
        self.capacity = int(capacity)
        positions = torch.arange(self.capacity, device=device)
        self.cos, self.sin = policy.rotary(positions, dtype)                      # (C, D) each
        self.draft = draft
        if draft is not None:
            dc, mid = draft.config, draft.midlayer
            self.d_eps = float(dc.rms_norm_eps)
            self.d_heads, self.d_kv_heads = int(mid.self_attn.num_heads), int(mid.self_attn.num_kv_heads)
            self.d_head_dim = int(mid.self_attn.head_dim)
            self.d_fc = draft.fc.weight
            self.d_in_ln, self.d_hidden_ln = mid.input_layernorm.weight, mid.hidden_norm.weight
            self.d_layer = _pack_layer(mid.input_layernorm, mid.post_attention_layernorm, mid.self_attn, mid.mlp)
            self.d_norm, self.d_lm_head = draft.norm.weight, draft.lm_head.weight
            self.d_cos, self.d_sin = draft.rotary_emb(positions, dtype)

    # ------------------------------------------------------------------ shared pieces
    def _geometry(self, cache: KVCache, num_tokens: int, cos: Tensor, sin: Tensor) -> _StepGeometry:
        capacity = min(cache.capacity, self.capacity)
        start = cache.lengths
        batch = start.shape[0]
        first = int(start[0]) if batch == 1 else None
        top = (first if batch == 1 else int(start.max())) + num_tokens   # the one host sync of the forward
        if top > capacity:
            raise ValueError(f"KV cache overflow: a row at length {top - num_tokens} + {num_tokens} new tokens "
                             f"needs {top} slots but capacity is {capacity}; allocate a larger cache")
        offsets = torch.arange(num_tokens, device=start.device)
        if first is not None:  # one row: its slots are the contiguous range [first, top)
            mask = None
            if num_tokens > 1:
                visible = torch.arange(top, device=start.device)[None, :] <= (offsets + first)[:, None]  # (S, L)
                mask = torch.zeros(visible.shape, dtype=cos.dtype, device=start.device)
                mask = mask.masked_fill_(~visible, float("-inf"))[None, None]
            return _StepGeometry(rows=None, slots=first, cos=cos[first:top][None, :, None],
                                 sin=sin[first:top][None, :, None], visible=top, mask=mask)
        slots = start[:, None] + offsets                        # (B, S)
        rows = torch.arange(batch, device=start.device)[:, None].expand(batch, num_tokens)
        visible = torch.arange(top, device=start.device)[None, None, :] <= slots[:, :, None]  # (B, S, L)
        mask = torch.zeros(visible.shape, dtype=cos.dtype, device=start.device)
        mask = mask.masked_fill_(~visible, float("-inf"))[:, None]
        return _StepGeometry(rows=rows, slots=slots, cos=cos[slots][:, :, None], sin=sin[slots][:, :, None],
                             visible=top, mask=mask)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: (B, S, h, D) -> RoPE-rotated ``x * cos + rotate_half(x) * sin`` (half-split layout).

        ``rotate_half(x) = x @ R`` with R the signed permutation ``cat(-x2, x1)``: one exact matmul (each output
        is a single ±x term) instead of two slices, a negation and a concatenation.
        """
        R = self._rotate_half.get(x.shape[-1])
        if R is None or R.dtype != x.dtype:
            half = x.shape[-1] // 2
            R = torch.zeros(x.shape[-1], x.shape[-1], dtype=x.dtype, device=x.device)
            R[torch.arange(half, 2 * half), torch.arange(half)] = -1.0
            R[torch.arange(half), torch.arange(half, 2 * half)] = 1.0
            self._rotate_half[x.shape[-1]] = R
        return torch.addcmul(x * cos, x @ R, sin)

    def _attention(self, layer: _Layer, x: Tensor, k_cache: Tensor, v_cache: Tensor, geo: _StepGeometry,
                   heads: int, kv_heads: int, head_dim: int) -> Tensor:
        """x: (B, S, H_in) normed attention input -> (B, S, H) o_proj output; writes the new keys/values."""
        B, S = x.shape[:2]
        qkv = F.linear(x, layer.wqkv, layer.bqkv).view(B, S, heads + 2 * kv_heads, head_dim)
        if layer.q_norm is None:
            qk = self._rotate(qkv[:, :, :heads + kv_heads], geo.cos, geo.sin)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        else:
            q = self._rotate(_rms(qkv[:, :, :heads], layer.q_norm, self.eps), geo.cos, geo.sin)
            k = self._rotate(_rms(qkv[:, :, heads:heads + kv_heads], layer.k_norm, self.eps), geo.cos, geo.sin)
        v = qkv[:, :, heads + kv_heads:]
        L = geo.visible
        if geo.rows is None:  # one row: slice copy into slots [L - S, L)
            k_cache[0, :, L - S:L] = k[0].transpose(0, 1)
            v_cache[0, :, L - S:L] = v[0].transpose(0, 1)
        else:
            k_cache[geo.rows, :, geo.slots] = k.to(k_cache.dtype)
            v_cache[geo.rows, :, geo.slots] = v.to(v_cache.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, :L], v_cache[:, :, :L],
                                             attn_mask=geo.mask, enable_gqa=kv_heads != heads)
        return F.linear(out.transpose(1, 2).reshape(B, S, heads * head_dim), layer.wo, layer.bo)

    def _mlp(self, layer: _Layer, x: Tensor, eps: float) -> Tensor:
        gate, up = F.linear(_rms(x, layer.ln2, eps), layer.wgu, layer.bgu).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.wd, layer.bd)

    @staticmethod
    def _gather_rows(x: Tensor, logit_rows: Tensor | None) -> Tensor:
        """x (B, S, H) -> (B, H) at index ``logit_rows[b]`` of each row, or x itself when None."""
        if logit_rows is None:
            return x
        return x[torch.arange(x.shape[0], device=x.device), logit_rows]

    # ------------------------------------------------------------------ policy
    def embed(self, ids: Tensor) -> Tensor:
        """ids (...) -> (..., H) policy token embeddings."""
        return F.embedding(ids, self.embed_weight)

    def policy(self, ids: Tensor, cache: KVCache, taps: tuple[int, ...] | None = None,
               logit_rows: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """Policy decode forward of S new tokens per row; the cache advances by S.

        Args:
            ids: (B, S) new tokens at positions ``cache.lengths[b] + arange(S)``.
            cache: the policy's cache (one entry per layer).
            taps: tap ids to capture (hidden state entering layer ``l``; ``L`` = last layer's output).
            logit_rows: (B,) one position per row to compute logits at (None: every position).

        Returns:
            logits (B, S, V), or (B, V) with ``logit_rows``; taps, each (B, S, H) (None when not asked).
        """
        B, S = ids.shape
        geo = self._geometry(cache, S, self.cos, self.sin)
        x = self.embed(ids)
        captured = {}
        for i, layer in enumerate(self.layers):
            if taps and i in taps:
                captured[i] = x
            x = x + self._attention(layer, _rms(x, layer.ln1, self.eps), cache.k[i], cache.v[i], geo,
                                    self.num_heads, self.num_kv_heads, self.head_dim)
            x = x + self._mlp(layer, x, self.eps)
        if taps and len(self.layers) in taps:
            captured[len(self.layers)] = x
        cache.lengths = cache.lengths + S
        logits = F.linear(_rms(self._gather_rows(x, logit_rows), self.norm, self.eps), self.lm_head)
        return logits, (None if taps is None else tuple(captured[t] for t in taps))

    # ------------------------------------------------------------------ draft
    def fuse(self, taps: tuple[Tensor, ...]) -> Tensor:
        """Three (B, S, H) policy taps -> (B, S, H) draft hidden input ``fc(cat(taps))``."""
        return F.linear(torch.cat(taps, dim=-1), self.d_fc)

    def draft_step(self, hidden: Tensor, embeds: Tensor, cache: KVCache,
                   logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Draft decode step (``Eagle3Draft.step``); the cache advances by S.

        Args:
            hidden: (B, S, H) draft hidden input (fused taps or a previous output).
            embeds: (B, S, H) policy embeddings of the token following each position.
            cache: the draft's one-layer cache.
            logit_rows: (B,) one position per row to return (None: every position).

        Returns:
            hidden_out (B, S, H) and logits (B, S, Vd), or (B, H) and (B, Vd) with ``logit_rows``.
        """
        S = hidden.shape[1]
        layer, eps = self.d_layer, self.d_eps
        geo = self._geometry(cache, S, self.d_cos, self.d_sin)
        x = torch.cat([_rms(embeds, self.d_in_ln, eps), _rms(hidden, self.d_hidden_ln, eps)], dim=-1)
        h = self._attention(layer, x, cache.k[0], cache.v[0], geo, self.d_heads, self.d_kv_heads,
                            self.d_head_dim) + hidden
        h = self._gather_rows(h, logit_rows)
        out = self._mlp(layer, h, eps) + h
        cache.lengths = cache.lengths + S
        return out, F.linear(_rms(out, self.d_norm, eps), self.d_lm_head)


class ModuleStep:
    """The same interface as :class:`DecodeStep` through the modules' own ``forward(kv_cache=)`` / ``step``.

    Used for policies and drafts that are not the library's :class:`~lightning_codraft.models.Policy` /
    :class:`~lightning_codraft.models.Eagle3Draft` (wrappers, other implementations of the engine's contract).
    """

    def __init__(self, policy: nn.Module, draft: nn.Module | None):
        self.policy_module, self.draft = policy, draft

    def embed(self, ids: Tensor) -> Tensor:
        return self.policy_module.embed(ids)

    def policy(self, ids: Tensor, cache: KVCache, taps: tuple[int, ...] | None = None,
               logit_rows: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        out = self.policy_module(ids, kv_cache=cache, taps=taps)
        return DecodeStep._gather_rows(out.logits, logit_rows), out.taps

    def fuse(self, taps: tuple[Tensor, ...]) -> Tensor:
        return self.draft.fuse(taps)

    def draft_step(self, hidden: Tensor, embeds: Tensor, cache: KVCache,
                   logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        out, logits = self.draft.step(hidden, embeds, cache)
        return DecodeStep._gather_rows(out, logit_rows), DecodeStep._gather_rows(logits, logit_rows)


def decode_step(policy: nn.Module, draft: nn.Module | None, capacity: int) -> DecodeStep | ModuleStep:
    """A :class:`DecodeStep` for the library's Policy / Eagle3Draft with plain (unsharded) parameters, else a
    :class:`ModuleStep` (wrappers, other implementations, DTensor / sharded parameters)."""
    modules = [policy] if draft is None else [policy, draft]
    plain = all(type(p) in (torch.Tensor, nn.Parameter) for m in modules for p in m.parameters())
    if plain and type(policy) is Policy and (draft is None or type(draft) is Eagle3Draft):
        return DecodeStep(policy, draft, capacity)
    return ModuleStep(policy, draft)
