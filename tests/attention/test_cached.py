"""cached_attention vs a dense per-query reference written from the definition (slots [0, p] visible)."""

import math

import pytest
import torch

from lightning_codraft.attention.cached import cached_attention


def reference(q, k_cache, v_cache, q_pos):
    B, S, H, D = q.shape
    groups = H // k_cache.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for s in range(S):
            p = int(q_pos[b, s])
            for h in range(H):
                keys = k_cache[b, h // groups, : p + 1]                 # (p+1, D)
                vals = v_cache[b, h // groups, : p + 1]
                w = torch.softmax(keys @ q[b, s, h] / math.sqrt(D), dim=0)
                out[b, s, h] = w @ vals
    return out


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 1)])
def test_matches_dense_reference_ragged_positions(H, Hkv):
    B, S, C, D = 3, 3, 12, 8
    q = torch.randn(B, S, H, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, C, D, dtype=torch.float64)
    v = torch.randn(B, Hkv, C, D, dtype=torch.float64)
    start = torch.tensor([0, 4, 9])
    q_pos = start[:, None] + torch.arange(S)
    out = cached_attention(q, k, v, q_pos)
    assert out.shape == (B, S, H, D)
    assert torch.allclose(out, reference(q, k, v, q_pos), atol=1e-10)


def test_ignores_slots_after_the_query_position():
    q = torch.randn(1, 1, 2, 4)
    k = torch.randn(1, 2, 6, 4)
    v = torch.randn(1, 2, 6, 4)
    pos = torch.tensor([[2]])
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3:] = 1e3
    v2[:, :, 3:] = -1e3
    assert torch.equal(cached_attention(q, k, v, pos), cached_attention(q, k2, v2, pos))


def test_errors():
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="do not fit the cache capacity 5"):
        cached_attention(q, k, k, torch.tensor([[4, 5]]))
    with pytest.raises(ValueError, match=r"q_pos shape \(2,\) must be \(B, S\)"):
        cached_attention(q, k, k, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        cached_attention(torch.randn(1, 2, 3, 8), k, k, torch.tensor([[0, 1]]))
