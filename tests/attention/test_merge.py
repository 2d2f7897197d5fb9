import torch
from attn_reference import dense_block_attention, random_cu

from lightning_codraft.attention.merge import merge_attention


def test_merge_two_key_sets_equals_one_softmax():
    q = torch.randn(5, 2, 4)
    k, v = torch.randn(9, 2, 4), torch.randn(9, 2, 4)
    cq = random_cu([5])
    a_out, a_lse = dense_block_attention(q, k[:4], v[:4], cq, random_cu([4]), False, 0.5)
    b_out, b_lse = dense_block_attention(q, k[4:], v[4:], cq, random_cu([5]), False, 0.5)
    out, lse = merge_attention(a_out, a_lse, b_out, b_lse)
    ref_out, ref_lse = dense_block_attention(q, k, v, cq, random_cu([9]), False, 0.5)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse.double(), ref_lse)
    assert lse.dtype == torch.float32


def test_merge_is_minus_inf_safe_and_differentiable():
    out_a = torch.randn(3, 1, 2, requires_grad=True)
    out_b = torch.randn(3, 1, 2, requires_grad=True)
    ninf = float("-inf")
    lse_a = torch.tensor([[ninf], [0.5], [ninf]], requires_grad=True)
    lse_b = torch.tensor([[0.2], [ninf], [ninf]], requires_grad=True)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0], out_b[0])
    torch.testing.assert_close(out[1], out_a[1])
    assert (out[2] == 0).all() and lse[2, 0] == ninf
    torch.testing.assert_close(lse[:2, 0], torch.tensor([0.2, 0.5]))
    (out.sum() + lse[:2].sum()).backward()
    for t in (out_a, out_b, lse_a, lse_b):
        assert torch.isfinite(t.grad).all()
