"""``codraft_attention``: causal packed attention of the policy/draft with the TTT branch keys merged in.

Query row ``i`` (of document ``d``) attends, in ONE softmax, to the main keys ``{K_j : j <= i, j in d}`` and
to the branch keys ``{K^m_i : 1 <= m <= k}`` at its own row (docs/design/architecture.md, "TTT branch attention"). The main part
is causal varlen attention (or, under context parallelism, the zigzag ring of
:mod:`lightning_codraft.attention.ring`); the branch part is closed-form and rank-local; the two are merged by
log-sum-exp, and the backward differentiates each part against the merged ``(out, lse)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_codraft.attention.branch import branch_attention_backward, branch_attention_forward
from lightning_codraft.attention.local import varlen_attention_backward, varlen_attention_forward
from lightning_codraft.attention.merge import merge_attention_
from lightning_codraft.attention.packing import suffix_rows, validate_cu_seqlens
from lightning_codraft.attention.ring import ring_codraft_attention


def check_codraft_inputs(
    q: Tensor, k: Tensor, v: Tensor, branch_k: Sequence[Tensor], branch_v: Sequence[Tensor], suffix: bool = False
) -> None:
    """Raise ``ValueError`` naming the offending shape unless q/k/v/branches agree (see codraft_attention);
    ``suffix``: the queries are a subset of the key rows (``cu_seqlens_q``), so their counts may differ."""
    if q.dim() != 3:
        raise ValueError(f"q must be (T, H, D), got shape {tuple(q.shape)}")
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be (T, Hkv, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    if (k.shape[0] != q.shape[0] and not suffix) or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"k shape {tuple(k.shape)} disagrees with q shape {tuple(q.shape)}: need the same "
            f"token count T and head dim D"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]}")
    if len(branch_k) != len(branch_v):
        raise ValueError(
            f"got {len(branch_k)} branch_k but {len(branch_v)} branch_v tensors; pass one K and one V per unroll step"
        )
    want = (q.shape[0], *k.shape[1:])
    for m, (bk, bv) in enumerate(zip(branch_k, branch_v)):
        if tuple(bk.shape) != want or tuple(bv.shape) != want:
            raise ValueError(
                f"branch step {m + 1}: branch_k {tuple(bk.shape)} / branch_v {tuple(bv.shape)} must "
                f"be {want}: the query rows, k's heads and head dim"
            )


class _LocalCoDraft(torch.autograd.Function):
    """Whole packed batch on one process: causal varlen main attention + branch, one softmax."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens, scale, num_branch, *branch):
        bk, bv = branch[:num_branch], branch[num_branch:]
        out, lse = varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens, causal=True, softmax_scale=scale)
        if num_branch:
            acc = out.float()
            b_out, b_lse = branch_attention_forward(q, bk, bv, scale)
            merge_attention_(acc, lse, b_out, b_lse)
            out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens, *branch)
        ctx.scale, ctx.num_branch = scale, num_branch
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu, *branch = ctx.saved_tensors
        nb = ctx.num_branch
        dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu, causal=True, softmax_scale=ctx.scale)
        dbk, dbv = [], []
        if nb:
            dq_b, dbk, dbv = branch_attention_backward(dout, q, branch[:nb], branch[nb:], out, lse, ctx.scale)
            dq = dq + dq_b
        return (dq, dk, dv, None, None, None, None, *dbk, *dbv)


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's when it is on (the kernels here are not autocast ops: with RoPE
    in fp32 and projections in bf16 their inputs would mix), else the promoted dtype of ``tensors``."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def codraft_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    branch_k: Sequence[Tensor] = (),
    branch_v: Sequence[Tensor] = (),
    group: Optional[dist.ProcessGroup] = None,
    softmax_scale: Optional[float] = None,
    cu_seqlens_q: Optional[Tensor] = None,
) -> Tensor:
    """Causal per-document attention with the TTT branch keys merged into the same softmax.

    Args:
        q: ``(T, H, D)`` queries: the whole packed batch, or this CP rank's zigzag shard under ``group``.
        k, v: ``(T, Hkv, D)`` main-sequence keys / values (step 0), GQA when ``Hkv < H``.
        cu_seqlens: ``(N + 1,)`` int32 GLOBAL prefix sum of document lengths (never sharded).
        branch_k, branch_v: ``k >= 0`` tensors ``(T, Hkv, D)``, the keys / values of unroll steps ``1..k`` at the
            same rows; row ``i`` sees ``branch_k[m][i]`` for every ``m``.
        group: context-parallel process group; ``None`` or size 1 means no CP.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        cu_seqlens_q: ``(N + 1,)`` int32, without CP only: the queries (and branch tensors) are the LAST
            ``cu_seqlens_q[d + 1] - cu_seqlens_q[d]`` rows of each document ``d``
            (:func:`~lightning_codraft.attention.packing.masked_suffix`, rows
            :func:`~lightning_codraft.attention.packing.suffix_rows`), ``Tq`` rows in all; each still sees every
            key of its document up to its own row. None: every row is a query.

    Returns:
        ``(T, H, D)`` (``(Tq, H, D)`` with ``cu_seqlens_q``) attention output for this rank's rows, in the compute
        dtype: the autocast dtype inside
        ``torch.autocast`` (bf16-mixed training), else the common dtype of the inputs. Differentiable in q, k, v and
        every branch tensor.
    """
    branch_k, branch_v = tuple(branch_k), tuple(branch_v)
    dtype = compute_dtype(q, k, v, *branch_k, *branch_v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    branch_k, branch_v = tuple(t.to(dtype) for t in branch_k), tuple(t.to(dtype) for t in branch_v)
    check_codraft_inputs(q, k, v, branch_k, branch_v, suffix=cu_seqlens_q is not None)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if group is not None and dist.get_world_size(group) > 1:
        if cu_seqlens_q is not None:
            raise ValueError(
                "cu_seqlens_q (queries on a suffix of each document) is not supported under context "
                "parallelism: the zigzag shards of a suffix are not balanced; pass every row"
            )
        return ring_codraft_attention(
            q, k, v, cu_seqlens, branch_k=branch_k, branch_v=branch_v, group=group, softmax_scale=scale
        )
    validate_cu_seqlens(cu_seqlens, total_tokens=k.shape[0])
    if cu_seqlens_q is None:
        cu_seqlens_q = cu_seqlens
    else:
        suffix_rows(cu_seqlens, cu_seqlens_q, total_tokens=q.shape[0])  # raises unless each suffix fits
    return _LocalCoDraft.apply(q, k, v, cu_seqlens_q, cu_seqlens, scale, len(branch_k), *branch_k, *branch_v)
