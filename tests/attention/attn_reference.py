"""Dense reference attention written from the definitions (shares no code with lightning_codraft.attention)."""

from __future__ import annotations

import torch


def doc_ids(cu: torch.Tensor) -> torch.Tensor:
    cu = cu.tolist()
    return torch.cat([torch.full((cu[i + 1] - cu[i],), i) for i in range(len(cu) - 1)])


def dense_codraft_attention(q, k, v, cu, branch_k=(), branch_v=(), scale=None):
    """Row i attends in one softmax to {k_j: j <= i, same doc} and {branch_k[m][i]}: a boolean mask over (K+1)*T keys.

    q (T, H, D), k/v (T, Hkv, D); computed in float64; returns (T, H, D) float64.
    """
    T, H, D = q.shape
    hkv = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    keys = torch.cat([k, *branch_k], 0).double().repeat_interleave(H // hkv, 1)      # ((K+1)T, H, D)
    vals = torch.cat([v, *branch_v], 0).double().repeat_interleave(H // hkv, 1)
    nk = len(branch_k)
    doc = doc_ids(cu)
    i = torch.arange(T).unsqueeze(1)
    j = torch.arange(T).unsqueeze(0)
    main = (doc.unsqueeze(1) == doc.unsqueeze(0)) & (j <= i)
    blocks = [main] + [torch.eye(T, dtype=torch.bool) for _ in range(nk)]
    mask = torch.cat(blocks, 1)                                                        # (T, (K+1)T)
    s = torch.einsum("thd,shd->hts", q.double(), keys) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("hts,shd->thd", p, vals)


def dense_block_attention(q, k, v, cu_q, cu_k, causal, scale):
    """(out, lse) of query doc i vs key doc i, bottom-right causal when asked; float64; lse -inf on blind rows."""
    T, H, D = q.shape
    kk = k.double().repeat_interleave(H // k.shape[1], 1)
    vv = v.double().repeat_interleave(H // k.shape[1], 1)
    dq, dk = doc_ids(cu_q), doc_ids(cu_k)
    pos_q = torch.arange(T) - cu_q[:-1].long()[dq]
    pos_k = torch.arange(k.shape[0]) - cu_k[:-1].long()[dk]
    len_q = (cu_q[1:] - cu_q[:-1]).long()[dq]
    len_k = (cu_k[1:] - cu_k[:-1]).long()[dk]
    mask = dq.unsqueeze(1) == dk.unsqueeze(0)
    if causal:
        mask &= pos_k.unsqueeze(0) <= pos_q.unsqueeze(1) + (len_k.unsqueeze(0) - len_q.unsqueeze(1))
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)                                                       # (H, T)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0).unsqueeze(-1))
    return torch.einsum("hts,shd->thd", p, vv), lse.t()


def random_cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
