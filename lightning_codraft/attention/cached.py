"""Decode-time attention over a key/value cache (the rollout engine's path).

:func:`cached_attention` lets a query at absolute position ``p`` attend to cache slots ``[0, p]`` of its
row, so a step of ``S`` new tokens (already written into the cache) is causal among itself and sees the
whole prefix. :func:`decode_attention` is the kernel both it and the fused decoders (models/decode.py) call:
a float (0 / -inf) additive mask, grouped-query heads without a copy of the cache per step, CPU and CUDA, any
dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

GROUPED_MAX_QUERIES = 16
"""Steps of at most this many new tokens per row take the grouped-matmul path on CPU (decode and verify)."""


ATTEND_ALL_SLACK = 64
"""On CPU a step attends to every slot of a cache holding at most ``max(ATTEND_ALL_SLACK, top // 4)`` slots more
than it needs (:func:`attended_slots`)."""


def attended_slots(top: int, capacity: int, queries: int, device: torch.device) -> int:
    """How many cache slots a step of ``queries`` new tokens a row, whose queries see slots ``[0, top)``, attends
    to (the rest masked).

    On CPU the batched matmuls of :func:`_grouped_attention` copy a slice ``k[:, :, :top]`` of a longer cache (its
    batch stride is not compact) in every layer, which costs more than attending to a few masked slots
    (docs/design/measurements.md). So a decode or verify step (at most :data:`GROUPED_MAX_QUERIES` queries) over a
    cache at most ``max(ATTEND_ALL_SLACK, top // 4)`` slots longer (``KVCache.reserve`` grows it in blocks)
    attends to the whole cache; its result does not depend on how many masked slots it spans. Prefill (SDPA,
    whose blocked softmax rounds differently over another width), steps over a much longer cache, and steps on
    accelerators (strided batched matmuls read a slice in place) attend to ``top`` slots.
    """
    slack = capacity - top
    if device.type == "cpu" and queries <= GROUPED_MAX_QUERIES and slack <= max(ATTEND_ALL_SLACK, top // 4):
        return capacity
    return top


def _grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``softmax(q k^T * scale + mask) v`` by two batched matmuls, the ``H / Hkv`` query heads that share a key
    head stacked as rows of one matrix; softmax in fp32 at least."""
    B, H, S, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    g = H // Hkv
    scores = torch.matmul(q.reshape(B, Hkv, g * S, D), k.transpose(-1, -2)).mul_(scale)  # (B, Hkv, g S, L)
    if mask is not None:
        scores = (scores.view(B, Hkv, g, S, L) + mask.view(mask.shape[0], 1, 1, S, L)).view(B, Hkv, g * S, L)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
    return torch.matmul(probs, v).view(B, H, S, D)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Attention of a step's queries over the visible cache slots.

    On CPU a step of at most :data:`GROUPED_MAX_QUERIES` queries per row (decode, speculative verify) over
    several rows, or any such step in half precision, runs as :func:`_grouped_attention`: PyTorch's CPU flash
    kernel is slow for so few queries (docs/design/measurements.md); else SDPA.

    Args:
        q: ``(B, H, S, D)`` queries.
        k: ``(B, Hkv, L, D)`` keys (``H`` a multiple of ``Hkv``).
        v: ``(B, Hkv, L, D)`` values.
        mask: ``(B or 1, 1, S, L)`` additive float mask (0 visible, -inf hidden), or None (all visible).
        scale: defaults to ``D ** -0.5``.

    Returns:
        ``(B, H, S, D)``.
    """
    B, H, S, D = q.shape
    scale = D**-0.5 if scale is None else scale
    half = q.dtype in (torch.bfloat16, torch.float16)
    if q.device.type == "cpu" and S <= GROUPED_MAX_QUERIES and (B > 1 or half):
        return _grouped_attention(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != H)


def cached_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, softmax_scale: float | None = None
) -> Tensor:
    """Causal attention of new queries against a cache.

    Args:
        q: ``(B, S, H, D)`` queries of the new tokens (RoPE applied).
        k_cache: ``(B, Hkv, C, D)`` cached keys, slot = absolute position; must already hold the new tokens.
        v_cache: ``(B, Hkv, C, D)`` cached values.
        q_pos: ``(B, S)`` int64 absolute position of each query (``< C``).
        softmax_scale: defaults to ``D ** -0.5``.

    Returns:
        ``(B, S, H, D)`` attention output.
    """
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cached_attention: expected q (B,S,H,D) and k/v caches (B,Hkv,C,D), got q "
            f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    B, S, H, D = q.shape
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] != B or k_cache.shape[3] != D or H % Hkv:
        raise ValueError(
            f"cached_attention: q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)} "
            "(batch and head_dim must agree, H a multiple of Hkv)"
        )
    if q_pos.shape != (B, S):
        raise ValueError(f"cached_attention: q_pos shape {tuple(q_pos.shape)} must be (B, S)={(B, S)}")
    if int(q_pos.max()) >= C or int(q_pos.min()) < 0:
        raise ValueError(
            f"cached_attention: positions in [{int(q_pos.min())}, {int(q_pos.max())}] do not fit the cache capacity {C}"
        )
    L = attended_slots(int(q_pos.max()) + 1, C, S, q.device)  # slots anyone can see (or the whole cache)
    k, v = k_cache[:, :, :L], v_cache[:, :, :L]
    visible = torch.arange(L, device=q.device)[None, None, :] <= q_pos[:, :, None]  # (B, S, L)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    return decode_attention(q.transpose(1, 2), k, v, mask[:, None], softmax_scale).transpose(1, 2)
