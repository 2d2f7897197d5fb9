"""One optimizer step of the joint objective: the single step function of both Lightning front ends.

``lightning_codraft.fabric.fabric_training_step`` and ``CoDraftModule.training_step`` (Trainer, manual
optimisation) both call :func:`optimizer_step`; they differ only in how the backward runs (``fabric.backward`` /
``manual_backward``) and in what wraps the module's forward (DDP / FSDP)::

    zero grads -> forward(batch) (the joint loss; under PP the pipeline ran the backward)
      -> backward(loss) -> module.after_backward() (PP gradient reduction, norms, clipping)
      -> optimizer.step() -> scheduler.step()
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_codraft.training.objective import sum_over


def optimizer_step(forward: Callable[[Any], Any], module: nn.Module, batch: Any, optimizer, scheduler=None,
                   backward: Optional[Callable[[Tensor], None]] = None) -> dict[str, Tensor]:
    """Run one optimizer step of the joint objective and return its metrics.

    Args:
        forward: what computes the step output from the batch: the (wrapped) module itself.
        module: the unwrapped ``CoDraftModule`` (for ``after_backward``).
        batch: this dp replica's RL batch (an ``RLBatch`` or its dict layout).
        optimizer: the optimizer of ``module.build_optimizer()`` (possibly wrapped by Lightning).
        scheduler: its LR scheduler (stepped once), or None.
        backward: ``backward(loss)``; default ``loss.backward()``.

    Returns:
        Detached global scalar metrics: the loss terms, draft accuracy / acceptance length, gradient norms.
    """
    optimizer.zero_grad(set_to_none=True)
    out = forward(batch)
    if out.loss is not None:
        (backward or Tensor.backward)(out.loss)
    metrics = {**out.metrics, **module.after_backward()}
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return metrics


def grad_norms(groups: Mapping[str, Iterable[nn.Parameter]], max_norm: Optional[float] = None,
               norm_group: Optional[Any] = None) -> dict[str, Tensor]:
    """Global L2 gradient norm of every parameter group, each clipped to ``max_norm`` when given.

    Args:
        groups: group name -> its parameters (those without a gradient are skipped). FSDP2-sharded gradients
            (DTensors) contribute their local shard, summed over their shard group.
        max_norm: clip each group's gradients so its norm is at most this; None = no clipping.
        norm_group: process group over which a group's parameters are spread (the pipeline stages): the squared
            norms are summed over it. Every rank of it must call with the same group names.

    Returns:
        ``{"grad_norm/<name>": norm}`` before clipping.
    """
    out = {}
    for name, params in groups.items():
        grads = [p.grad for p in params if p.grad is not None and p.requires_grad]
        plain = torch.zeros((), dtype=torch.float32)
        sharded: dict[Any, Tensor] = {}  # shard group -> local sum of squares
        for g in grads:
            if isinstance(g, DTensor):
                group = g.device_mesh.get_group()
                local = g.to_local().detach().float().pow(2).sum()
                sharded[group] = sharded.get(group, torch.zeros((), dtype=torch.float32)) + local
            else:
                plain = plain + g.detach().float().pow(2).sum()
        for group, sq in sharded.items():
            plain = plain + sum_over(sq, group)
        norm = sum_over(plain, norm_group).sqrt()
        if max_norm is not None:
            coef = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
            for g in grads:
                g.mul_(coef)
        out[f"grad_norm/{name}"] = norm
    return out
