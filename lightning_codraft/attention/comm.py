"""Point-to-point exchanges on a process group (the only communication the CP attention path uses).

Peers are ranks *within* the group (``group_peer``), so a CP group carved out of a larger mesh works
unchanged. Exchanges start asynchronously (``batch_isend_irecv``) so the caller overlaps them with compute
and waits only when it needs the received tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class PendingExchange:
    """In-flight sends/receives; :meth:`wait` returns the receive buffers once they are filled."""

    def __init__(self, works: list, recv: list[Tensor], keep_alive: list[Tensor]):
        self._works, self._recv, self._keep_alive = works, recv, keep_alive

    def wait(self) -> list[Tensor]:
        for w in self._works:
            w.wait()
        self._works, self._keep_alive = [], []
        return self._recv


def exchange(
    sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]], group: dist.ProcessGroup
) -> PendingExchange:
    """Start sending each ``(tensor, group_peer)`` and receiving into each ``(buffer, group_peer)``.

    Args:
        sends: tensors to send and the group rank each goes to (made contiguous; bool is sent as uint8).
        recvs: pre-allocated buffers and the group rank each comes from.
        group: the process group the peers are ranks of.

    Returns:
        A :class:`PendingExchange`; call ``.wait()`` before reading the buffers or reusing the sent tensors.
    """
    ops, keep = [], []
    for t, peer in sends:
        t = t.contiguous()
        keep.append(t)
        ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=peer))
    for buf, peer in recvs:
        ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=peer))
    works = dist.batch_isend_irecv(ops) if ops else []
    return PendingExchange(works, [b for b, _ in recvs], keep)


def ring_pass(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> PendingExchange:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's tensors of equal shapes."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    return exchange([(t, nxt) for t in tensors], [(torch.empty_like(t), prv) for t in tensors], group)
