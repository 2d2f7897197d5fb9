"""TTT branch attention in closed form (rank-local: row i only sees keys of row i).

At unroll step ``k`` of the EAGLE-3 draft, query ``i`` attends to the branch keys ``K^m_i`` for
``1 <= m <= k`` (besides the causal main keys, merged separately by log-sum-exp). Those keys sit at the
query's own row, so this part is a tiny per-row softmax over ``k`` scores, computed densely here and never
communicated under context parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _stack(xs: Sequence[Tensor], q: Tensor) -> Tensor:
    """``k`` tensors ``(T, Hkv, D)`` -> ``(T, Hkv, k, D)`` fp32."""
    for m, x in enumerate(xs):
        if x.dim() != 3 or x.shape[0] != q.shape[0] or x.shape[2] != q.shape[2] or q.shape[1] % x.shape[1]:
            raise ValueError(
                f"branch tensor {m} has shape {tuple(x.shape)}; expected (T={q.shape[0]}, Hkv, "
                f"D={q.shape[2]}) with Hkv dividing H={q.shape[1]}"
            )
    return torch.stack([x.float() for x in xs], dim=2)


def branch_attention_forward(
    q: Tensor, branch_k: Sequence[Tensor], branch_v: Sequence[Tensor], softmax_scale: float
) -> tuple[Tensor, Tensor]:
    """Per-row softmax of ``q_i`` over ``{K^m_i}``; no autograd.

    Args:
        q: ``(T, H, D)`` queries.
        branch_k, branch_v: ``k >= 1`` tensors ``(T, Hkv, D)`` each, the keys/values of steps ``1..k``.
        softmax_scale: multiplier of ``q . K``.

    Returns:
        ``out (T, H, D)`` in q's dtype and ``lse (T, H)`` fp32.
    """
    with torch.no_grad():
        T, H, D = q.shape
        K, V = _stack(branch_k, q), _stack(branch_v, q)  # (T, Hkv, k, D)
        qg = q.float().unflatten(1, (K.shape[1], -1))  # (T, Hkv, G, D)
        s = torch.einsum("tngd,tnkd->tngk", qg, K) * softmax_scale
        lse = torch.logsumexp(s, dim=-1)  # (T, Hkv, G)
        out = torch.einsum("tngk,tnkd->tngd", torch.softmax(s, dim=-1), V)
        return out.reshape(T, H, D).to(q.dtype), lse.reshape(T, H)


def branch_attention_backward(
    dout: Tensor,
    q: Tensor,
    branch_k: Sequence[Tensor],
    branch_v: Sequence[Tensor],
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Gradients of the branch keys' share of a joint softmax, given that softmax's ``(out, lse)``.

    With ``P_m = exp(s_m - lse)`` (``lse`` the joint, merged log-sum-exp) and ``delta = rowsum(dO * O)``:
    ``dV^m = P_m dO``, ``dS_m = P_m (dO . V^m - delta)``, ``dq = scale * sum_m dS_m K^m``,
    ``dK^m = scale * dS_m q`` (summed over the query heads of each KV head).

    Args:
        dout: ``(T, H, D)`` gradient of the joint output.
        q, branch_k, branch_v: as in :func:`branch_attention_forward`.
        out: ``(T, H, D)`` joint (merged) output; lse: ``(T, H)`` joint log-sum-exp.

    Returns:
        ``dq (T, H, D)`` (this share only), ``dK^m`` and ``dV^m`` lists of ``(T, Hkv, D)``.
    """
    with torch.no_grad():
        T, H, D = q.shape
        K, V = _stack(branch_k, q), _stack(branch_v, q)
        hkv = K.shape[1]
        qg = q.float().unflatten(1, (hkv, -1))
        dog = dout.float().unflatten(1, (hkv, -1))
        l = lse.float().masked_fill(torch.isinf(lse), 0.0).unflatten(1, (hkv, -1))  # (T, Hkv, G)
        s = torch.einsum("tngd,tnkd->tngk", qg, K) * softmax_scale
        p = torch.exp(s - l.unsqueeze(-1))  # (T, Hkv, G, k)
        delta = (dout.float() * out.float()).sum(-1).unflatten(1, (hkv, -1))
        ds = p * (torch.einsum("tngd,tnkd->tngk", dog, V) - delta.unsqueeze(-1))
        dq = (torch.einsum("tngk,tnkd->tngd", ds, K) * softmax_scale).reshape(T, H, D).to(q.dtype)
        dK = torch.einsum("tngk,tngd->tnkd", ds, qg) * softmax_scale  # (T, Hkv, k, D)
        dV = torch.einsum("tngk,tngd->tnkd", p, dog)
        dks = [dK[:, :, m].to(x.dtype) for m, x in enumerate(branch_k)]
        dvs = [dV[:, :, m].to(x.dtype) for m, x in enumerate(branch_v)]
        return dq, dks, dvs
