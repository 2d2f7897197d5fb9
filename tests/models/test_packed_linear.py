"""models/packed_linear.py: the oneDNN-packed decode linear equals ``F.linear`` (bf16 bit for bit), gives each row
the same result whatever the number of rows (what token-exact speculative verification needs), and falls back to
``F.linear`` where it cannot serve (gradients, another input dtype)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_codraft.models.packed_linear import PackedLinear, packing_available

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed linear")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(dtype, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    lin = PackedLinear(w, b)
    bf16_kernel = torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2") or "avx_ne_convert" in \
        open("/proc/cpuinfo").read()
    # packed wherever oneDNN has the dtype's kernel; an AVX2-only CPU runs bf16 through F.linear instead of failing
    assert (lin.packed is not None) == (dtype == torch.float32 or bf16_kernel)
    for shape in ((1, 40), (5, 40), (3, 7, 40)):
        x = torch.randn(*shape, generator=g).to(dtype)
        y, ref = lin(x), F.linear(x, w, b)
        assert y.shape == ref.shape and y.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(y, ref)
        else:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 6, 40, generator=g).to(dtype)[:, ::2]          # a strided input
    torch.testing.assert_close(lin(x).float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(384, 192), (576, 1536)], ids=["small", "smollm2-down"])
def test_a_rows_result_does_not_depend_on_how_many_rows_the_call_holds(dtype, shape):
    """Also for one row: oneDNN's one-row bf16 kernel over 1536 inputs rounds some outputs differently (6 of
    34560 here without the two-row padding); and past 32 rows, where oneDNN on an AMX CPU switches to AMX tiles
    that round differently (without the 32-row blocks 8-36 rows of 96 differed on a Sapphire Rapids Xeon)."""
    g = torch.Generator().manual_seed(0)
    lin = PackedLinear((torch.randn(*shape, generator=g) * 0.05).to(dtype))
    for _ in range(20):
        x = (torch.randn(96, shape[1], generator=g) * torch.rand(96, 1, generator=g) * 2).to(dtype)
        ref = lin(x)
        for rows in (1, 2, 3, 5, 16, 32, 33, 40, 65, 80):
            assert torch.equal(lin(x[:rows]), ref[:rows])
        assert torch.equal(lin(x[3:4].view(1, 1, -1)), ref[3:4].view(1, 1, -1))


def test_gradients_and_other_dtypes_take_f_linear():
    w = torch.randn(8, 4, requires_grad=True)
    lin = PackedLinear(w)
    x = torch.randn(3, 4, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, w.detach().sum(0).expand(3, 4))
    torch.testing.assert_close(w.grad, x.detach().sum(0).expand(8, 4))
    x64 = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(PackedLinear(w.detach().double())(x64), F.linear(x64, w.detach().double()))
    assert PackedLinear(w.detach(), pack=False).packed is None
