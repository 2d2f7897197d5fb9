"""Decode-time attention over a key/value cache (the rollout engine's path).

:func:`cached_attention` lets a query at absolute position ``p`` attend to cache slots ``[0, p]`` of its
row, so a step of ``S`` new tokens (already written into the cache) is causal among itself and sees the
whole prefix. SDPA with a float (0 / -inf) additive mask and ``enable_gqa`` (no copy of the cache per
step): works on CPU and CUDA, any dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def cached_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor,
                     softmax_scale: float | None = None) -> Tensor:
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
        raise ValueError(f"cached_attention: expected q (B,S,H,D) and k/v caches (B,Hkv,C,D), got q "
                         f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    B, S, H, D = q.shape
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] != B or k_cache.shape[3] != D or H % Hkv:
        raise ValueError(f"cached_attention: q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)} "
                         "(batch and head_dim must agree, H a multiple of Hkv)")
    if q_pos.shape != (B, S):
        raise ValueError(f"cached_attention: q_pos shape {tuple(q_pos.shape)} must be (B, S)={(B, S)}")
    if int(q_pos.max()) >= C or int(q_pos.min()) < 0:
        raise ValueError(f"cached_attention: positions in [{int(q_pos.min())}, {int(q_pos.max())}] do not fit "
                         f"the cache capacity {C}")
    L = int(q_pos.max()) + 1                                   # slots anyone can see
    k, v = k_cache[:, :, :L], v_cache[:, :, :L]
    visible = torch.arange(L, device=q.device)[None, None, :] <= q_pos[:, :, None]       # (B, S, L)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=softmax_scale,
                                         enable_gqa=Hkv != H)          # GQA without copying the cache
    return out.transpose(1, 2)
