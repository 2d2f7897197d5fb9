"""Packed zigzag ring attention over a CP group, with the TTT branch keys merged into the same softmax.

Each CP rank holds its zigzag shard (chunks ``r`` and ``2cp-1-r`` of every document). K/V blocks travel
around the ring with overlapped ``batch_isend_irecv`` (point-to-point only: no all-gather). At ring step ``i``
rank ``r`` holds the K/V shard of rank ``s = (r - i) mod cp`` and, per document, computes only the visible
part (no masked-out work):

- ``s == r``: the diagonal block, causal (local rows are increasing positions);
- ``s < r``: all local queries against the *front* chunk of ``s`` (chunk ``s`` precedes both query chunks;
  chunk ``2cp-1-s`` follows both);
- ``s > r``: the *back* query chunk ``2cp-1-r`` against all of ``s``'s keys (both key chunks precede it; the
  front query chunk ``r`` precedes both).

Partial results are merged in fp32 by log-sum-exp, then the rank-local branch attention (row ``i`` sees
``K^m_i``) joins the same softmax. The backward rotates K/V around the ring again, computes each block's
gradients against the *merged* ``(out, lse)`` (the joint-softmax identity), and carries the partial dK/dV
around a second ring so that they arrive at their owner after ``cp`` hops. Branch gradients are closed-form.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_codraft.attention.branch import branch_attention_backward, branch_attention_forward
from lightning_codraft.attention.comm import ring_pass
from lightning_codraft.attention.local import varlen_attention_backward, varlen_attention_forward
from lightning_codraft.attention.merge import merge_attention_
from lightning_codraft.attention.zigzag import ZigzagLayout


def _merge_rows(acc_out: Tensor, acc_lse: Tensor, rows: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge a block computed for the local ``rows`` into the fp32 accumulators, in place."""
    sub_out, sub_lse = acc_out.index_select(0, rows), acc_lse.index_select(0, rows)
    merge_attention_(sub_out, sub_lse, out, lse)
    acc_out.index_copy_(0, rows, sub_out)
    acc_lse.index_copy_(0, rows, sub_lse)


class _RingCoDraft(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lay, scale, group, num_branch, *branch):
        P, r = lay.world_size, lay.rank
        cu_l, cu_h = lay.cu_local, lay.cu_half
        acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        q_back = q.index_select(0, lay.back)
        cur_k, cur_v = k, v
        for step in range(P):
            pending = ring_pass([cur_k, cur_v], group) if step < P - 1 else None
            s = (r - step) % P
            if s == r:
                o, l = varlen_attention_forward(q, cur_k, cur_v, cu_l, cu_l, causal=True, softmax_scale=scale)
                merge_attention_(acc_out, acc_lse, o, l)
            elif s < r:
                o, l = varlen_attention_forward(
                    q,
                    cur_k.index_select(0, lay.front),
                    cur_v.index_select(0, lay.front),
                    cu_l,
                    cu_h,
                    causal=False,
                    softmax_scale=scale,
                )
                merge_attention_(acc_out, acc_lse, o, l)
            else:
                o, l = varlen_attention_forward(q_back, cur_k, cur_v, cu_h, cu_l, causal=False, softmax_scale=scale)
                _merge_rows(acc_out, acc_lse, lay.back, o, l)
            if pending is not None:
                cur_k, cur_v = pending.wait()
        if num_branch:
            b_out, b_lse = branch_attention_forward(q, branch[:num_branch], branch[num_branch:], scale)
            merge_attention_(acc_out, acc_lse, b_out, b_lse)
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse, *branch)
        ctx.layout, ctx.scale, ctx.group, ctx.num_branch = lay, scale, group, num_branch
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *branch = ctx.saved_tensors
        lay, scale, group, nb = ctx.layout, ctx.scale, ctx.group, ctx.num_branch
        P, r = lay.world_size, lay.rank
        cu_l, cu_h = lay.cu_local, lay.cu_half
        dout = dout.contiguous()
        back = lay.back
        q_back, dout_back = q.index_select(0, back), dout.index_select(0, back)
        out_back, lse_back = out.index_select(0, back), lse.index_select(0, back)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        dkv_pending = None
        for step in range(P):
            kv_pending = ring_pass([cur_k, cur_v], group) if step < P - 1 else None
            s = (r - step) % P
            if s == r:
                g_q, g_k, g_v = varlen_attention_backward(
                    dout, q, cur_k, cur_v, out, lse, cu_l, cu_l, causal=True, softmax_scale=scale
                )
                dq += g_q
                dk_blk, dv_blk = g_k.float(), g_v.float()
            elif s < r:
                front = lay.front
                g_q, g_kf, g_vf = varlen_attention_backward(
                    dout,
                    q,
                    cur_k.index_select(0, front),
                    cur_v.index_select(0, front),
                    out,
                    lse,
                    cu_l,
                    cu_h,
                    causal=False,
                    softmax_scale=scale,
                )
                dq += g_q
                dk_blk = torch.zeros(k.shape, dtype=torch.float32, device=k.device).index_copy_(0, front, g_kf.float())
                dv_blk = torch.zeros(v.shape, dtype=torch.float32, device=v.device).index_copy_(0, front, g_vf.float())
            else:
                g_qb, g_k, g_v = varlen_attention_backward(
                    dout_back, q_back, cur_k, cur_v, out_back, lse_back, cu_h, cu_l, causal=False, softmax_scale=scale
                )
                dq.index_add_(0, back, g_qb.float())
                dk_blk, dv_blk = g_k.float(), g_v.float()
            if dkv_pending is not None:  # the partial dK/dV of the block we hold, from the previous rank
                dk_in, dv_in = dkv_pending.wait()
                dk_blk += dk_in
                dv_blk += dv_in
            dkv_pending = ring_pass([dk_blk, dv_blk], group)  # after cp hops each arrives at its owner
            if kv_pending is not None:
                cur_k, cur_v = kv_pending.wait()
        dk, dv = dkv_pending.wait()
        dbk, dbv = [], []
        if nb:
            dq_b, dbk, dbv = branch_attention_backward(dout, q, branch[:nb], branch[nb:], out, lse, scale)
            dq += dq_b
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, *dbk, *dbv)


def ring_codraft_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    branch_k: Sequence[Tensor],
    branch_v: Sequence[Tensor],
    group: dist.ProcessGroup,
    softmax_scale: float,
) -> Tensor:
    """:func:`~lightning_codraft.attention.codraft_attention` over a CP group of size >= 2 (inputs are shards).

    Args:
        q: ``(T_local, H, D)`` this rank's zigzag shard of the queries.
        k, v: ``(T_local, Hkv, D)`` this rank's zigzag shard of the main keys / values.
        cu_seqlens: ``(N + 1,)`` GLOBAL prefix sum of document lengths, each a multiple of ``2 * cp``;
            identical on every rank of ``group``.
        branch_k, branch_v: per unroll step, ``(T_local, Hkv, D)`` shards (rows aligned with q).
        group: the CP process group.
        softmax_scale: multiplier of ``q . k``.

    Returns:
        ``(T_local, H, D)`` this rank's output rows.
    """
    P, r = dist.get_world_size(group), dist.get_rank(group)
    lay = ZigzagLayout.build(cu_seqlens, r, P, device=q.device)
    expected = lay.global_rows.numel()
    if q.shape[0] != expected:
        raise ValueError(
            f"q has {q.shape[0]} rows but rank {r}'s zigzag shard of cu_seqlens[-1]="
            f"{int(cu_seqlens[-1])} over a CP group of size {P} has {expected} rows; pass "
            f"zigzag_shard(x, cu_seqlens, rank={r}, world_size={P}) and the GLOBAL cu_seqlens"
        )
    return _RingCoDraft.apply(q, k, v, lay, softmax_scale, group, len(branch_k), *branch_k, *branch_v)
