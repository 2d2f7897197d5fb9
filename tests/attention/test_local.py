import pytest
import torch
from attn_reference import dense_block_attention, random_cu

from lightning_codraft.attention.local import select_backend, varlen_attention


def _inputs(lq, lk, H=4, Hkv=2, D=8, dtype=torch.float32):
    q = torch.randn(sum(lq), H, D, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lk), Hkv, D, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lk), Hkv, D, dtype=dtype, requires_grad=True)
    return q, k, v, random_cu(lq), random_cu(lk)


CASES = [([5, 9, 3], [5, 9, 3], True), ([4, 6], [7, 6], True), ([3, 8], [5, 2], True), ([3, 8], [5, 2], False)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("lq,lk,causal", CASES)
def test_varlen_matches_dense_values_and_grads(backend, lq, lk, causal):
    q, k, v, cq, ck = _inputs(lq, lk)
    out, lse = varlen_attention(q, k, v, cq, ck, causal=causal, softmax_scale=0.3, backend=backend)
    ref_out, ref_lse = dense_block_attention(q, k, v, cq, ck, causal, 0.3)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    # gradients through both outputs (lse is used by merges)
    go, gl = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * go).sum() + (lse.masked_fill(~finite, 0) * gl).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = (ref_out * go.double()).sum() + (ref_lse.masked_fill(~finite, 0) * gl.double()).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)


def test_varlen_bf16_close_to_fp32():
    q, k, v, cq, ck = _inputs([16, 8], [16, 8], dtype=torch.bfloat16)
    out, lse = varlen_attention(q, k, v, cq, ck, causal=True)
    ref, ref_lse = dense_block_attention(q, k, v, cq, ck, True, 8 ** -0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(k.grad.float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lq,lk,causal", CASES[:3])
def test_cpu_half_inputs_are_computed_in_fp32(dtype, lq, lk, causal):
    """The CPU backend computes bf16 / fp16 blocks in fp32 (faster on CPU, see attention/local.py): the results
    are the fp32 kernel's on the upcast inputs, rounded once to the inputs' dtype."""
    q, k, v, cq, ck = _inputs(lq, lk, dtype=dtype)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attention(q, k, v, cq, ck, causal=causal, softmax_scale=0.3, backend="cpu")
    ref, ref_lse = varlen_attention(q32, k32, v32, cq, ck, causal=causal, softmax_scale=0.3, backend="cpu")
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype)) and torch.equal(lse, ref_lse)
    go = torch.randn(out.shape).to(dtype)
    grads = torch.autograd.grad((out.float() * go.float()).sum(), (q, k, v))
    refs = torch.autograd.grad((ref * go.float()).sum(), (q32, k32, v32))
    for g, r in zip(grads, refs):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), r, atol=2e-2, rtol=2e-2)  # the saved out is rounded: close, not equal


def test_varlen_blind_rows_are_zero_and_minus_inf():
    q, k, v, cq, ck = _inputs([6], [2])  # bottom-right causal: the first 4 queries see nothing
    out, lse = varlen_attention(q, k, v, cq, ck, causal=True)
    assert torch.isinf(lse[:4]).all() and (lse[:4] < 0).all() and torch.isfinite(lse[4:]).all()
    assert (out[:4] == 0).all()


def test_varlen_errors_name_the_bad_value():
    q, k, v, cq, ck = _inputs([4], [4], H=3, Hkv=2)
    with pytest.raises(ValueError, match="multiple of key/value heads 2"):
        varlen_attention(q, k, v, cq, ck, causal=True)
    q, k, v, cq, ck = _inputs([4], [4])
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\]=5"):
        varlen_attention(q, k, v, random_cu([5]), ck, causal=True)
    with pytest.raises(ValueError, match="unknown attention backend 'tpu'"):
        varlen_attention(q, k, v, cq, ck, causal=True, backend="tpu")


def test_select_backend_cpu():
    assert select_backend(torch.zeros(1, 1, 1)) == "cpu"
