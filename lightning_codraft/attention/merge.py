"""Merging two partial softmax attentions by their log-sum-exp (the one merge used everywhere).

If ``(out_a, lse_a)`` is attention over key set A and ``(out_b, lse_b)`` over a disjoint key set B (same
queries), the attention over A ∪ B in ONE softmax is::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

computed here in fp32 and safe when either (or both) ``lse`` is ``-inf`` (a key set the row cannot see).
"""

from __future__ import annotations

import torch
from torch import Tensor


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from the two partial results.

    Args:
        out_a: ``(T, H, D)`` attention output over key set A.
        lse_a: ``(T, H)`` log-sum-exp of the scores over A (``-inf`` where a row sees nothing in A).
        out_b: ``(T, H, D)`` attention output over key set B.
        lse_b: ``(T, H)`` log-sum-exp over B.

    Returns:
        ``out (T, H, D)`` in ``out_a``'s dtype and ``lse (T, H)`` fp32. Rows that see nothing in either set
        get ``out = 0`` and ``lse = -inf``. Differentiable in all four inputs.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attention needs out (T, H, D) and lse (T, H) of equal shapes, got out "
            f"{tuple(out_a.shape)} / {tuple(out_b.shape)}, lse {tuple(lse_a.shape)} / "
            f"{tuple(lse_b.shape)}"
        )
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    s = wa + wb
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    lse = torch.where(s > 0, m + torch.log(s_safe), torch.full_like(m, float("-inf")))
    out = (wa / s_safe).unsqueeze(-1) * out_a.float() + (wb / s_safe).unsqueeze(-1) * out_b.float()
    return out.to(out_a.dtype), lse


def merge_attention_(acc_out: Tensor, acc_lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """In-place, no-grad :func:`merge_attention` into fp32 accumulators (used inside ring loops).

    Args:
        acc_out: ``(T, H, D)`` fp32 running output, updated in place.
        acc_lse: ``(T, H)`` fp32 running log-sum-exp, updated in place.
        out_b, lse_b: the block to fold in, shapes as the accumulators (any float dtype for ``out_b``).
    """
    with torch.no_grad():
        out, lse = merge_attention(acc_out, acc_lse, out_b.float(), lse_b)
        acc_out.copy_(out)
        acc_lse.copy_(lse)
