"""Collectives over a process group, written once for training/, parallel/ and rl/.

A ``group`` of ``None`` means this process alone; so does any group before a process group is initialised. Every
helper is the identity where there is nothing to reduce over, so single-process code calls them unconditionally.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def group_size(group: Optional[Any]) -> int:
    """Processes in ``group`` (1 for None, or without an initialised process group)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def world_size() -> int:
    """Processes in the world (1 without an initialised process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_distributed() -> bool:
    """Whether more than one process runs (an initialised process group of size > 1)."""
    return world_size() > 1


def reduced(x: Tensor, group: Optional[Any], op: str = "sum") -> Tensor:
    """``x`` reduced (``sum``, ``max`` or ``min``) over ``group`` into a new tensor, or ``x`` itself where the group
    holds this process alone. Not differentiable across processes: callers that need the local gradient add the
    reduced value's difference to the local part (training/objective.py)."""
    if group_size(group) == 1:
        return x
    out = x.clone()
    dist.all_reduce(out, op=_OPS[op], group=group)
    return out
