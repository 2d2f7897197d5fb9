"""Stream a sharded, pipelined model's whole tensors to every rank of its replica, one tensor at a time.

Rollout engines need whole weights on every rank, while training holds each stage's tensors sharded by FSDP2 over
the stage's dp x cp ranks. :func:`stream_full_state` walks the stages in order; for every tensor of stage ``s`` the
ranks of that stage gather it whole (``DTensor.full_tensor()``, a collective over their dp x cp group) and stage ``s``
broadcasts it over the pipeline group, so every rank of every stage receives it. The caller copies it where it
belongs and drops it before the next one: at no point does a rank hold more than one whole tensor beyond its own
shards. Every rank must consume the whole stream (the collectives pair up tensor by tensor).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_codraft.parallel.parallel_dims import ParallelDims


def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def stream_full_state(
    state: Mapping[str, Tensor], dims: Optional[ParallelDims] = None, device: Optional[torch.device] = None
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, whole tensor)`` for every entry of every stage's ``state``; call on every rank, consume fully.

    Args:
        state: this rank's state dict (its stage's entries; DTensor shards under FSDP2). Ranks of one stage pass
            the same names in the same order (the module's own ``state_dict()``).
        dims: the mesh (None: one process; the entries are yielded as they are, gathered if sharded).
        device: where received tensors land (default: the device of this rank's first tensor, else CPU).

    Yields:
        Entries in stage order, each stage's in its ``state`` order; a tensor is valid until the next one is asked
        for (then the stream releases it).
    """
    dims = dims or ParallelDims()
    pp_group = dims.pp_group
    if pp_group is None:
        for name, value in state.items():
            yield name, _full(value)
        return
    if device is None:
        first = next(iter(state.values()), None)
        device = first.device if first is not None else torch.device("cpu")
    for stage in range(dims.pp):
        # the stage's catalogue: names, shapes and dtypes, so the other stages can allocate the landing tensors
        box = [[(n, tuple(v.shape), v.dtype) for n, v in state.items()] if dims.pp_rank == stage else None]
        dist.broadcast_object_list(box, group=pp_group, group_src=stage)
        for name, shape, dtype in box[0]:
            if dims.pp_rank == stage:
                tensor = _full(state[name]).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, group=pp_group, group_src=stage)
            yield name, tensor
            del tensor
