"""cached_attention vs a dense per-query reference written from the definition (slots [0, p] visible)."""

import math

import pytest
import torch

from lightning_codraft.attention import cached as cached_mod
from lightning_codraft.attention.cached import attended_slots, cached_attention, decode_attention


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


def _sdpa_reference(q, k, v, mask):
    """(B, H, S, D) attention with each key head repeated for its query heads, in float64."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("B,S,masked", [(1, 1, False), (1, 5, True), (4, 1, True), (4, 5, True), (3, 17, True),
                                        (2, 16, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_the_definition_on_both_paths(B, S, masked, dtype):
    torch.manual_seed(B * 100 + S)
    H, Hkv, L, D = 6, 2, 23, 8
    q, k, v = (torch.randn(B, h, n, D).to(dtype) for h, n in ((H, S), (Hkv, L), (Hkv, L)))
    mask = None
    if masked:
        visible = torch.rand(B, 1, S, L) < 0.7
        visible[..., 0] = True
        mask = torch.zeros(B, 1, S, L).masked_fill(~visible, float("-inf")).to(dtype)
    out = decode_attention(q, k, v, mask)
    assert out.shape == (B, H, S, D) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.double(), _sdpa_reference(q, k, v, mask), atol=tol)


def test_decode_attention_takes_the_grouped_path_for_few_queries(monkeypatch):
    """Decode / verify steps over several rows (and half-precision steps) must not reach the CPU flash kernel."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(cached_mod.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    k = v = torch.randn(4, 1, 9, 8)
    decode_attention(torch.randn(4, 2, cached_mod.GROUPED_MAX_QUERIES, 8), k, v)
    decode_attention(torch.randn(1, 2, 3, 8).bfloat16(), k[:1].bfloat16(), v[:1].bfloat16())
    assert calls == []
    decode_attention(torch.randn(4, 2, cached_mod.GROUPED_MAX_QUERIES + 1, 8), k, v)   # prefill: SDPA
    decode_attention(torch.randn(1, 2, 3, 8), k[:1], v[:1])                          # one fp32 row: SDPA
    assert calls == [1, 1]


def test_a_cache_with_little_slack_is_attended_whole_on_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attended_slots(300, 320, 1, cpu) == 320                    # within a block: no slice to copy
    assert attended_slots(300, 300 + 300 // 4, 5, cpu) == 375         # a quarter of the rows' length
    assert attended_slots(300, 400, 1, cpu) == 300                    # too much slack: attend the slice
    assert attended_slots(10, 74, 16, cpu) == 74 and attended_slots(10, 75, 1, cpu) == 10
    assert attended_slots(300, 320, 17, cpu) == 300                   # prefill (SDPA): its own width
    assert attended_slots(300, 320, 1, cuda) == 300                   # strided batched matmuls read slices in place


@pytest.mark.parametrize("queries", [1, 5])
def test_masked_slots_past_the_visible_ones_change_no_bit(queries):
    """The grouped path's result does not depend on how many masked slots it spans (so a verify step over a
    cache grown for a wider batch equals the plain step over its own): bf16, bitwise."""
    g = torch.Generator().manual_seed(0)
    B, L = 4, 130
    q = torch.randn(B, 9, queries, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, 3, 400, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    outs = []
    for width in (130, 131, 160, 192, 400):
        visible = torch.arange(width)[None, :] <= (L - queries + torch.arange(queries))[:, None]
        mask = torch.zeros(1, 1, queries, width, dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))
        outs.append(decode_attention(q, k[:, :, :width].contiguous(), v[:, :, :width].contiguous(), mask))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
