import pytest
import torch
from attn_reference import dense_codraft_attention, random_cu

from lightning_codraft.attention import codraft_attention
from lightning_codraft.attention.packing import masked_suffix, suffix_rows


def _inputs(lengths, nk, H=4, Hkv=2, D=8, dtype=torch.float32):
    T = sum(lengths)
    mk = lambda h: torch.randn(T, h, D, dtype=dtype, requires_grad=True)  # noqa: E731
    return mk(H), mk(Hkv), mk(Hkv), [mk(Hkv) for _ in range(nk)], [mk(Hkv) for _ in range(nk)], random_cu(lengths)


@pytest.mark.parametrize("nk", [0, 1, 2, 3])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_codraft_local_matches_dense(nk, heads):
    q, k, v, bk, bv, cu = _inputs([7, 12, 1, 5], nk, H=heads[0], Hkv=heads[1])
    out = codraft_attention(q, k, v, cu, branch_k=bk, branch_v=bv)
    ref = dense_codraft_attention(q, k, v, cu, bk, bv)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    inputs = (q, k, v, *bk, *bv)
    grads = torch.autograd.grad((out * g).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), inputs)
    for name, a, b in zip(["q", "k", "v"] + [f"bk{m}" for m in range(nk)] + [f"bv{m}" for m in range(nk)],
                          grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


def test_codraft_local_softmax_scale_and_bf16():
    q, k, v, bk, bv, cu = _inputs([16, 8], 2, dtype=torch.bfloat16)
    out = codraft_attention(q, k, v, cu, branch_k=bk, branch_v=bv, softmax_scale=0.2)
    ref = dense_codraft_attention(q, k, v, cu, bk, bv, scale=0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v, *bk, *bv))


def test_codraft_first_row_sees_itself_and_its_branches_only():
    q, k, v, bk, bv, cu = _inputs([3, 3], 1, H=2, Hkv=2)
    out = codraft_attention(q, k, v, cu, branch_k=bk, branch_v=bv)
    # row 3 starts doc 1: keys {k_3, bk_3}; the result must not move when doc 0 changes
    with torch.no_grad():
        k2 = k.clone()
        k2[:3] += 5.0
    out2 = codraft_attention(q, k2, v, cu, branch_k=bk, branch_v=bv)
    torch.testing.assert_close(out[3:], out2[3:])


def test_codraft_errors():
    q, k, v, bk, bv, cu = _inputs([4, 4], 2)
    with pytest.raises(ValueError, match="2 branch_k but 1 branch_v"):
        codraft_attention(q, k, v, cu, branch_k=bk, branch_v=bv[:1])
    with pytest.raises(ValueError, match="branch step 1"):
        codraft_attention(q, k, v, cu, branch_k=[bk[0][:4]], branch_v=[bv[0]])
    with pytest.raises(ValueError, match="disagrees with q shape"):
        codraft_attention(q, k[:7], v[:7], cu)
    with pytest.raises(ValueError, match="does not cover the batch of 8 tokens"):
        codraft_attention(q, k, v, random_cu([4, 5]))


def test_masked_suffix_and_its_rows():
    cu = torch.tensor([0, 6, 9, 14, 16], dtype=torch.int32)
    mask = torch.zeros(16)
    mask[[4, 5, 12, 13, 15]] = 1  # doc 0 from row 4, doc 1 none, doc 2 from row 12 (its 3rd), doc 3 its last row
    cu_q = masked_suffix(cu, mask, reach=2)
    assert cu_q.tolist() == [0, 4, 4, 8, 10] and cu_q.dtype == torch.int32  # rows 2-5 | - | 10-13 | 14-15
    assert suffix_rows(cu, cu_q).tolist() == [2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
    assert masked_suffix(cu, mask, reach=0).tolist() == [0, 2, 2, 4, 5]
    assert masked_suffix(cu, mask, reach=9).tolist() == [0, 6, 6, 11, 13]  # clamped at each document's start
    with pytest.raises(ValueError, match="reach must be >= 0"):
        masked_suffix(cu, mask, reach=-1)
    with pytest.raises(ValueError, match=r"mask has shape \(15,\)"):
        masked_suffix(cu, mask[:15], reach=1)
    with pytest.raises(ValueError, match="suffix length"):
        suffix_rows(cu, torch.tensor([0, 7, 7, 7, 7], dtype=torch.int32))


@pytest.mark.parametrize("nk", [0, 2])
def test_codraft_queries_on_a_suffix_equal_the_full_rows(nk):
    """Queries (and branch keys) on the last rows of each document only: the same outputs and gradients as those
    rows of the full attention, every key of the document still visible up to the row."""
    lengths, suffix = [7, 12, 1, 5], [3, 12, 0, 1]
    q, k, v, bk, bv, cu = _inputs(lengths, nk)
    cu_q = torch.tensor([0, *torch.tensor(suffix).cumsum(0).tolist()], dtype=torch.int32)
    rows = suffix_rows(cu, cu_q)
    qs = q.detach()[rows].requires_grad_()
    bks, bvs = [t.detach()[rows].requires_grad_() for t in bk], [t.detach()[rows].requires_grad_() for t in bv]
    out = codraft_attention(qs, k, v, cu, branch_k=bks, branch_v=bvs, cu_seqlens_q=cu_q)
    ref = dense_codraft_attention(q, k, v, cu, bk, bv)[rows]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (qs, k, v, *bks, *bvs))
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), (q, k, v, *bk, *bv))
    for name, a, b in zip(["q", "k", "v"] + [f"bk{m}" for m in range(nk)] + [f"bv{m}" for m in range(nk)],
                          grads, ref_grads):
        b = b if name in ("k", "v") else b[rows]
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5, msg=f"grad of {name}")
    with pytest.raises(ValueError, match="suffix length"):
        codraft_attention(qs, k, v, cu, branch_k=bks, branch_v=bvs,
                          cu_seqlens_q=torch.tensor([0, 8, 15, 15, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="must\\s+be \\(16, 2, 8\\)"):
        codraft_attention(qs, k, v, cu, branch_k=[k], branch_v=[v], cu_seqlens_q=cu_q)  # all rows
