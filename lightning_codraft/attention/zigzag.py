"""Zigzag context-parallel layout of a packed batch, and the halo shift on it.

Every document length is a multiple of ``2 * cp``; each document is cut in ``2 * cp`` equal chunks and CP
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of every document, in that order, documents concatenated
(docs/design/architecture.md). So every rank holds ``L / cp`` rows of a document of length ``L``: the local ``cu_seqlens`` is the
global one divided by ``cp``, and every rank does the same causal work (load balance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_codraft.attention.comm import exchange
from lightning_codraft.attention.packing import shift_left_local, validate_cu_seqlens


def check_zigzag(cu_seqlens: Tensor, world_size: int) -> list[int]:
    """Raise ``ValueError`` unless every document length is a multiple of ``2 * world_size``; return cu as a list."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    validate_cu_seqlens(cu_seqlens)
    cu = cu_seqlens.tolist()
    m = 2 * world_size
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n % m:
            raise ValueError(
                f"document {i} has length {n} (cu_seqlens[{i}:{i + 2}]={cu[i : i + 2]}), not a multiple "
                f"of 2*cp={m}; pad documents with pack_documents(..., multiple_of={m})"
            )
    return cu


@dataclass
class ZigzagLayout:
    """Row bookkeeping of one rank's zigzag shard.

    Attributes:
        rank: CP rank; world_size: CP size.
        cu_local: ``(N + 1,)`` int32 prefix sums of this rank's per-document row counts (``cu_seqlens / cp``).
        cu_half: ``(N + 1,)`` int32 prefix sums of half of them (one chunk per document).
        front: ``(T_local / 2,)`` int64 local rows of the front chunks (chunk ``r`` of each document).
        back: ``(T_local / 2,)`` int64 local rows of the back chunks (chunk ``2 * cp - 1 - r``).
        chunk: per-document chunk lengths ``L / (2 * cp)``.
        global_rows: ``(T_local,)`` int64 global row of every local row.
    """

    rank: int
    world_size: int
    cu_local: Tensor
    cu_half: Tensor
    front: Tensor
    back: Tensor
    chunk: list[int]
    global_rows: Tensor

    @classmethod
    def build(cls, cu_seqlens: Tensor, rank: int, world_size: int, device=None) -> ZigzagLayout:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a CP group of size {world_size}")
        cu = check_zigzag(cu_seqlens, world_size)
        device = device if device is not None else cu_seqlens.device
        starts = torch.tensor(cu[:-1], dtype=torch.int64)
        chunk_t = (torch.tensor(cu[1:], dtype=torch.int64) - starts) // (2 * world_size)
        local_len = 2 * chunk_t
        cu_local = torch.zeros(len(cu), dtype=torch.int64)
        cu_local[1:] = torch.cumsum(local_len, 0)
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), local_len)
        off = torch.arange(int(cu_local[-1])) - cu_local[:-1][doc]  # offset in the local doc
        c = chunk_t[doc]
        is_back = off >= c
        chunk_idx = torch.where(is_back, torch.full_like(c, 2 * world_size - 1 - rank), torch.full_like(c, rank))
        global_rows = starts[doc] + chunk_idx * c + torch.where(is_back, off - c, off)
        rows = torch.arange(int(cu_local[-1]))
        return cls(
            rank=rank,
            world_size=world_size,
            cu_local=cu_local.to(device=device, dtype=torch.int32),
            cu_half=(cu_local // 2).to(device=device, dtype=torch.int32),
            front=rows[~is_back].to(device),
            back=rows[is_back].to(device),
            chunk=chunk_t.tolist(),
            global_rows=global_rows.to(device),
        )


def zigzag_shard(x: Tensor, cu_seqlens: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's zigzag rows of a packed tensor.

    Args:
        x: ``(T, ...)`` the whole packed batch.
        cu_seqlens: ``(N + 1,)`` GLOBAL prefix sum of document lengths, each a multiple of ``2 * world_size``.
        rank, world_size: CP rank and size.

    Returns:
        ``(T / world_size, ...)``: chunks ``rank`` and ``2 * world_size - 1 - rank`` of every document.
    """
    if x.shape[0] != int(cu_seqlens[-1]):
        raise ValueError(f"x has {x.shape[0]} rows but cu_seqlens[-1]={int(cu_seqlens[-1])}")
    layout = ZigzagLayout.build(cu_seqlens, rank, world_size, device=x.device)
    return x.index_select(0, layout.global_rows)


def zigzag_unshard(parts: list[Tensor], cu_seqlens: Tensor, world_size: int) -> Tensor:
    """Inverse of :func:`zigzag_shard`: ``parts[r]`` is rank r's ``(T / world_size, ...)`` shard; returns ``(T, ...)``."""
    if len(parts) != world_size:
        raise ValueError(f"got {len(parts)} shards for world_size={world_size}")
    T = int(cu_seqlens[-1])
    out = parts[0].new_empty((T, *parts[0].shape[1:]))
    for r, p in enumerate(parts):
        layout = ZigzagLayout.build(cu_seqlens, r, world_size, device=p.device)
        if p.shape[0] != layout.global_rows.numel():
            raise ValueError(
                f"shard {r} has {p.shape[0]} rows, expected {layout.global_rows.numel()} "
                f"(= cu_seqlens[-1] / world_size)"
            )
        out[layout.global_rows] = p
    return out


def shift_left(
    x: Tensor, cu_seqlens: Tensor, shift: int, *, group: Optional[dist.ProcessGroup] = None, fill: float | int = 0
) -> Tensor:
    """``y[i] = x[i + shift]`` within the same document (else ``fill``), on zigzag shards under CP.

    Without a group (or a group of size 1) this is :func:`~lightning_codraft.attention.packing.shift_left_local`.
    Under CP, the rows past the end of a chunk come from the head of the next chunk: for the front chunk
    ``r`` that is rank ``r + 1``'s front chunk (or this rank's own back chunk when ``r = cp - 1``), for the
    back chunk ``2cp - 1 - r`` it is rank ``r - 1``'s back chunk (or past the document end when ``r = 0``).
    One point-to-point halo exchange of ``shift`` rows per document and direction (repeated when ``shift`` is
    longer than a chunk).

    Args:
        x: ``(T_local, ...)`` this rank's zigzag shard (any dtype).
        cu_seqlens: ``(N + 1,)`` GLOBAL prefix sum of document lengths.
        shift: ``>= 0``; shifts longer than the shortest chunk ``min(L) / (2 * cp)`` take several exchanges.
        group: CP process group.
        fill: value of rows whose source lies past their document's end.

    Returns:
        ``(T_local, ...)`` shifted shard; not differentiable across ranks (use it on ids, targets, masks).
    """
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if group is None or dist.get_world_size(group) == 1:
        return shift_left_local(x, cu_seqlens, shift, fill=fill)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    lay = ZigzagLayout.build(cu_seqlens, r, P, device=x.device)
    T = x.shape[0]
    if T != lay.global_rows.numel():
        raise ValueError(
            f"x has {T} rows but this rank's zigzag shard of cu_seqlens[-1]={int(cu_seqlens[-1])} "
            f"over cp={P} has {lay.global_rows.numel()}"
        )
    if shift == 0:
        return x
    hop = min(lay.chunk)
    if shift > hop:
        # one exchange reaches one chunk ahead; y[i] = x[i + a + b] composes exactly (fill stays fill)
        for _ in range(shift // hop):
            x = _shift_one_chunk(x, lay, hop, group, fill)
        return _shift_one_chunk(x, lay, shift % hop, group, fill) if shift % hop else x
    return _shift_one_chunk(x, lay, shift, group, fill)


def _shift_one_chunk(x: Tensor, lay: ZigzagLayout, shift: int, group: dist.ProcessGroup, fill: float | int) -> Tensor:
    """:func:`shift_left` for ``1 <= shift <=`` the shortest chunk: one halo exchange each way."""
    P, r = lay.world_size, lay.rank
    T = x.shape[0]
    n = len(lay.chunk)
    dev = x.device
    cu_local = lay.cu_local.to(torch.int64)
    c = torch.tensor(lay.chunk, dtype=torch.int64, device=dev)
    heads = torch.arange(shift, device=dev)
    head_front = (cu_local[:-1].unsqueeze(1) + heads).reshape(-1)  # (N * shift,)
    head_back = (cu_local[:-1].unsqueeze(1) + c.unsqueeze(1) + heads).reshape(-1)
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x
    sends, recvs = [], []
    recv_front = wire.new_zeros((n * shift, *x.shape[1:]))  # head of the chunk after my front chunk
    recv_back = wire.new_zeros((n * shift, *x.shape[1:]))  # head of the chunk after my back chunk
    if r > 0:
        sends.append((wire.index_select(0, head_front), r - 1))
        recvs.append((recv_back, r - 1))
    if r < P - 1:
        sends.append((wire.index_select(0, head_back), r + 1))
        recvs.append((recv_front, r + 1))
    pending = exchange(sends, recvs, group)
    # source of every local row in E = [x, recv_front, recv_back, fill]
    doc = torch.repeat_interleave(torch.arange(n, device=dev), 2 * c)
    off = torch.arange(T, device=dev) - cu_local[:-1][doc]
    cd = c[doc]
    is_back = off >= cd
    p = torch.where(is_back, off - cd, off) + shift  # position in own chunk
    j = p - cd  # row in the next chunk's head
    inside = p < cd
    src = torch.arange(T, device=dev) + shift
    if r < P - 1:
        front_src = T + doc * shift + j
    else:  # the chunk after front chunk cp-1 is this rank's own back chunk
        front_src = cu_local[:-1][doc] + cd + j
    back_src = T + n * shift + doc * shift + j if r > 0 else torch.full_like(src, T + 2 * n * shift)
    src = torch.where(inside, src, torch.where(is_back, back_src, front_src))
    pending.wait()
    fill_row = wire.new_full((1, *x.shape[1:]), fill)
    E = torch.cat([wire, recv_front, recv_back, fill_row], 0)
    y = E.index_select(0, src)
    return y.to(torch.bool) if x.dtype == torch.bool else y
