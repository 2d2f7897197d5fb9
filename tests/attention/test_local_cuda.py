"""The CUDA backends' call contracts, run on CPU against stand-in kernels with the real signatures/layouts."""

import importlib.util
import inspect

import flash_standins
import pytest
import torch
from attn_reference import dense_block_attention, random_cu
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_codraft.attention import local_cuda
from lightning_codraft.attention.local import (
    select_backend,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from lightning_codraft.attention.local_cuda import BackendUnavailable
from lightning_codraft.attention.merge import merge_attention


def _inputs(lq, lk, H=4, Hkv=2, D=8, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, D, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(sum(lq), H), mk(sum(lk), Hkv), mk(sum(lk), Hkv), random_cu(lq), random_cu(lk)


def _assert_matches_dense(q, k, v, cq, ck, causal, scale, backend, atol, device="cpu"):
    """varlen_attention on copies of (q, k, v) on ``device`` against the float64 dense reference on the CPU
    originals: out, lse, and the gradients of a loss through both outputs."""
    xs = [x.detach().to(device).requires_grad_() for x in (q, k, v)]
    out, lse = varlen_attention(*xs, cq.to(device), ck.to(device), causal=causal, softmax_scale=scale,
                                backend=backend)
    ref_out, ref_lse = dense_block_attention(q, k, v, cq, ck, causal, scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=atol, rtol=atol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite) and (lse.cpu()[~finite] < 0).all()
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(1)
    go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    loss = (out.float() * go.to(device)).sum() + (lse.masked_fill(~finite.to(device), 0) * gl.to(device)).sum()
    grads = torch.autograd.grad(loss, xs)
    ref = torch.autograd.grad((ref_out * go.double()).sum() + (ref_lse.masked_fill(~finite, 0) * gl.double()).sum(),
                              (q, k, v))
    for got, want in zip(grads, ref):
        assert got.dtype == q.dtype
        torch.testing.assert_close(got.cpu().double(), want.double(), atol=4 * atol, rtol=4 * atol)


# (lq, lk, causal): square causal; Lq < Lk causal (bottom-right); Lq > Lk causal (blind rows); non-causal ring
# blocks; at most one query per document (max_seqlen_q = 1); a document without queries; one without keys;
# a block without any query (nothing to launch)
CASES = [([5, 9, 3], [5, 9, 3], True), ([4, 6], [7, 6], True), ([3, 8], [5, 2], True), ([3, 8], [5, 2], False),
         ([1, 1, 1], [3, 2, 4], True), ([1, 0, 1], [2, 3, 2], False), ([2, 0, 3], [2, 4, 3], False),
         ([3, 2], [0, 2], True), ([0, 0], [2, 3], False)]


@pytest.mark.parametrize("kernel", flash_standins.KERNELS)
@pytest.mark.parametrize("lq,lk,causal", CASES)
@pytest.mark.parametrize("head_dim", [8, 12])
def test_flash_backends_match_dense(monkeypatch, kernel, lq, lk, causal, head_dim):
    backend = flash_standins.install(monkeypatch, kernel)
    q, k, v, cq, ck = _inputs(lq, lk, D=head_dim)   # head dim 12 is zero-padded to 16 for the kernel
    _assert_matches_dense(q, k, v, cq, ck, causal, 0.3, backend, atol=2e-3)


@pytest.mark.parametrize("backend", ["torch_flash", "flash_attn"])
@pytest.mark.parametrize("lq,lk,causal", CASES)
def test_real_cuda_kernels_match_dense(backend, lq, lk, causal):
    """The same contract on the real kernels, where a CUDA GPU (and, for flash_attn, the package) is present."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        getattr(local_cuda, "load_" + backend)(torch.device("cuda"))
    except BackendUnavailable as err:
        pytest.skip(str(err))
    q, k, v, cq, ck = _inputs(lq, lk, D=12)
    _assert_matches_dense(q, k, v, cq, ck, causal, 0.3, backend, atol=1e-2, device="cuda")


@pytest.mark.parametrize("kernel", flash_standins.KERNELS)
def test_flash_backends_bf16_and_default_scale(monkeypatch, kernel):
    backend = flash_standins.install(monkeypatch, kernel)
    q, k, v, cq, ck = _inputs([6, 10], [6, 10], H=6, Hkv=2, D=12, dtype=torch.bfloat16)
    _assert_matches_dense(q, k, v, cq, ck, True, 12 ** -0.5, backend, atol=1.6e-2)
    out, _ = varlen_attention(q, k, v, cq, ck, causal=True, backend=backend)       # scale 1/sqrt(12), not 1/4
    ref, _ = dense_block_attention(q, k, v, cq, ck, True, 12 ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("kernel", flash_standins.KERNELS)
def test_flash_backward_takes_the_merged_out_and_lse(monkeypatch, kernel):
    """The ring's use: two key blocks (earlier context, causal diagonal), merged, each differentiated
    against the merged (out, lse)."""
    backend = flash_standins.install(monkeypatch, kernel)
    q, k1, v1, cq, ck1 = _inputs([4, 6], [4, 6], seed=2)
    _, k2, v2, _, _ = _inputs([4, 6], [4, 6], seed=3)
    with torch.no_grad():
        o1, l1 = varlen_attention_forward(q, k1, v1, cq, ck1, causal=False, softmax_scale=0.4, backend=backend)
        o2, l2 = varlen_attention_forward(q, k2, v2, cq, cq, causal=True, softmax_scale=0.4, backend=backend)
        out, lse = merge_attention(o1, l1, o2, l2)
        out = out.to(q.dtype)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype)
        g1 = varlen_attention_backward(dout, q, k1, v1, out, lse, cq, ck1, causal=False, softmax_scale=0.4,
                                       backend=backend)
        g2 = varlen_attention_backward(dout, q, k2, v2, out, lse, cq, cq, causal=True, softmax_scale=0.4,
                                       backend=backend)
    # dense reference: one softmax over [k1 (all of the document), k2 (causal)] per document
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, torch.cat([k1, k2]), torch.cat([v1, v2])))
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor([4, 6]))
    pos = torch.cat([torch.arange(4), torch.arange(6)])
    same = doc.unsqueeze(1) == doc.unsqueeze(0)
    mask = torch.cat([same, same & (pos.unsqueeze(0) <= pos.unsqueeze(1))], 1)
    s = torch.einsum("thd,shd->hts", qd, kd.repeat_interleave(2, 1)) * 0.4
    ref = torch.einsum("hts,shd->thd", torch.softmax(s.masked_fill(~mask, float("-inf")), -1),
                       vd.repeat_interleave(2, 1))
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-3, rtol=2e-3)
    dq, dk, dv = torch.autograd.grad((ref * dout.double()).sum(), (qd, kd, vd))
    torch.testing.assert_close((g1[0].double() + g2[0].double()), dq, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(torch.cat([g1[1], g2[1]]).double(), dk, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(torch.cat([g1[2], g2[2]]).double(), dv, atol=8e-3, rtol=8e-3)


@pytest.mark.parametrize("kernel", ["torch_flash", "torch_flash-padded"])
def test_torch_flash_lse_layout_is_read_from_the_kernel(kernel):
    ops = flash_standins.ops_for(kernel)
    assert local_cuda.lse_layout_is_packed(ops.forward, torch.device("cpu")) == ops.packed_lse


def test_flash_attn_28_functions_hide_their_signature():
    """Why the mapping is positional per release: flash-attn >= 2.7's functions are torch.library custom ops
    whose Python signature names no parameter (a call filtered by inspect.signature passes nothing)."""
    assert str(inspect.signature(flash_standins.ops_for("flash_attn-2.8").forward)) == "(*args, **kwargs)"
    assert "window_size_left" in str(flash_standins.ops_for("flash_attn-2.8").forward._opoverload._schema)


def test_dlse_backward_past_the_head_dim_limit_uses_the_math_path(monkeypatch):
    """With a gradient through lse the backward appends a head-dim column: D=256 -> 257 exceeds the flash
    kernels, so that call runs the math path and stays exact."""
    backend = flash_standins.install(monkeypatch, "torch_flash")
    q, k, v, cq, ck = _inputs([3, 2], [3, 2], H=2, Hkv=1, D=256)
    _assert_matches_dense(q, k, v, cq, ck, True, 0.05, backend, atol=2e-3)


# ------------------------------------------------------------------------------- selection and errors


def _fake_cuda(dtype=torch.bfloat16, D=64):
    with FakeTensorMode():
        return torch.empty(4, 2, D, dtype=dtype, device="cuda")


def _unavailable(device):
    raise BackendUnavailable("not here")


def test_default_backend_table(monkeypatch):
    assert select_backend(torch.zeros(1, 1, 8)) == "cpu"
    assert select_backend(torch.zeros(1, 1, 8, dtype=torch.bfloat16)) == "cpu"
    flash_standins.install(monkeypatch, "torch_flash")
    flash_standins.install(monkeypatch, "flash_attn-2.8")
    assert select_backend(_fake_cuda()) == "torch_flash"
    assert select_backend(_fake_cuda(torch.float16)) == "torch_flash"
    assert select_backend(_fake_cuda(torch.float32)) == "torch"          # fp32 -> math path
    assert select_backend(_fake_cuda(D=264)) == "torch"                  # head dim past the kernels
    monkeypatch.setattr(local_cuda, "load_torch_flash", _unavailable)
    assert select_backend(_fake_cuda()) == "flash_attn"
    monkeypatch.setattr(local_cuda, "load_flash_attn", lambda device: local_cuda.FlashAttnOps(None, None, (2, 5)))
    assert select_backend(_fake_cuda()) == "torch"                       # flash-attn < 2.6 is not used
    monkeypatch.setattr(local_cuda, "load_flash_attn", _unavailable)
    assert select_backend(_fake_cuda()) == "torch"
    q = _fake_cuda(D=8)
    with pytest.raises(BackendUnavailable, match="'cpu' runs on CPU tensors, got tensors on cuda"):
        varlen_attention_forward(q, q, q, random_cu([4]), random_cu([4]), causal=True, softmax_scale=1.0,
                                 backend="cpu")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_forced_flash_attn_without_the_package_says_how_to_install():
    q, k, v, cq, ck = _inputs([4], [4])
    with pytest.raises(BackendUnavailable, match="flash-attn package") as err:
        local_cuda.load_flash_attn(torch.device("cuda"))
    assert 'pip install "flash-attn>=2.6,<2.9" --no-build-isolation' in str(err.value)
    assert "backend='torch_flash'" in str(err.value)
    with pytest.raises(BackendUnavailable, match="'flash_attn' runs on CUDA tensors"):
        varlen_attention(q, k, v, cq, ck, causal=True, backend="flash_attn")


def test_forced_torch_flash_on_cpu_names_the_backend_and_the_alternative():
    q, k, v, cq, ck = _inputs([4], [4])
    with pytest.raises(BackendUnavailable, match="'torch_flash' runs on CUDA tensors, got tensors on cpu.*"
                                                 "backend='cpu'"):
        varlen_attention(q, k, v, cq, ck, causal=True, backend="torch_flash")
    if not torch.backends.cuda.is_flash_attention_available():
        with pytest.raises(BackendUnavailable, match="built without it"):
            local_cuda.load_torch_flash(torch.device("cuda"))


@pytest.mark.parametrize("kernel", flash_standins.KERNELS)
def test_forced_flash_backend_rejects_fp32_and_wide_heads(monkeypatch, kernel):
    backend = flash_standins.install(monkeypatch, kernel)
    q, k, v, cq, ck = _inputs([4], [4], dtype=torch.float32)
    with pytest.raises(BackendUnavailable, match=f"'{backend}' needs float16 or bfloat16.*torch.float32.*"
                                                 "backend='torch'"):
        varlen_attention(q, k, v, cq, ck, causal=True, backend=backend)
    q, k, v, cq, ck = _inputs([4], [4], D=260)
    with pytest.raises(BackendUnavailable, match="head dim <= 256, got 260"):
        varlen_attention(q, k, v, cq, ck, causal=True, backend=backend)


def test_flash_attn_version_is_read_from_the_package(monkeypatch):
    for module, version in ((flash_standins.FLASH_ATTN_26, (2, 6)), (flash_standins.FLASH_ATTN_28, (2, 8))):
        monkeypatch.setattr(local_cuda, "_import_flash_attn", lambda m=module: (m, m, None))
        ops = local_cuda.load_flash_attn(torch.device("cuda"))
        assert ops.version == version and ops.forward is module._flash_attn_varlen_forward
    old = type(flash_standins.FLASH_ATTN_26)(**{**vars(flash_standins.FLASH_ATTN_26), "__version__": "2.5.9"})
    monkeypatch.setattr(local_cuda, "_import_flash_attn", lambda: (old, old, None))
    q, k, v, cq, ck = _inputs([4], [4])
    monkeypatch.setattr(local_cuda, "_need_cuda", lambda backend, device: None)
    with pytest.raises(BackendUnavailable, match="flash-attn 2.5 is installed.*>= 2.6"):
        varlen_attention(q, k, v, cq, ck, causal=True, backend="flash_attn")
