"""Every CP rank's rows on every rank, passed around the ring, with a gradient that returns to each row's owner.

A block drafter's queries (docs/design/drafters.md) attend to the context rows of their document before the
anchor, which under packed zigzag CP lie on every rank. :func:`ring_gather` passes this rank's context rows
around the ring (``cp - 1`` point-to-point hops, like the K/V of attention/ring.py: no all-gather collective), so
every rank holds every shard; the backward passes the gradients around the reverse ring, each hop adding the
receiving rank's contribution, so after ``cp - 1`` hops every shard's summed gradient arrives at its owner
(a ring reduce-scatter). :func:`ring_gather_whole` puts the shards back in document order (``zigzag_unshard``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_codraft.attention.comm import ring_pass
from lightning_codraft.attention.zigzag import zigzag_unshard


class _RingGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> tuple[Tensor, ...]:
        P, r = dist.get_world_size(group), dist.get_rank(group)
        ctx.group = group
        parts: list[Optional[Tensor]] = [None] * P
        parts[r] = x.detach().clone()
        cur = x.detach().contiguous()
        for step in range(1, P):  # after hop `step` this rank holds rank (r - step)'s shard
            cur = ring_pass([cur], group).wait()[0]
            parts[(r - step) % P] = cur
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        group = ctx.group
        P, r = dist.get_world_size(group), dist.get_rank(group)
        g = [torch.zeros_like(grads[r]) if t is None else t for t in grads]
        acc = g[(r - 1) % P].contiguous()  # destined for rank r - 1: it travels r -> r + 1 -> ... -> r - 1
        for step in range(P - 1):
            acc = ring_pass([acc], group).wait()[0] + g[(r - 2 - step) % P]
        return acc, None


def ring_gather(x: Tensor, group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    """Every rank's ``x`` (group rank order), differentiable: the gradient of part ``s`` is summed over the ranks
    and returned to rank ``s``.

    Args:
        x: ``(T_local, ...)`` this rank's rows (the same shape on every rank).
        group: the CP group; None or size 1: ``[x]``.
    """
    if group is None or dist.get_world_size(group) == 1:
        return [x]
    return list(_RingGather.apply(x, group))


def ring_gather_whole(x: Tensor, cu_seqlens: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """``(T_local, ...)`` zigzag shard -> ``(T, ...)`` the whole packed batch in document order, on every rank of
    ``group``, differentiable (:func:`ring_gather`); without a group, ``x`` itself."""
    parts = ring_gather(x, group)
    return parts[0] if len(parts) == 1 else zigzag_unshard(parts, cu_seqlens, len(parts))
