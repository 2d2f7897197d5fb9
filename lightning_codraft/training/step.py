"""One optimizer step of the joint objective: the single step function of both Lightning front ends.

``lightning_codraft.fabric.fabric_training_step`` and ``CoDraftModule.training_step`` (Trainer, manual
optimisation) both call :func:`optimizer_step`; they differ only in how the backward runs (``fabric.backward`` /
``manual_backward``) and in what wraps the module's forward (DDP / FSDP)::

    zero grads -> forward(batch) (the joint loss; under PP the pipeline ran the backward)
      -> backward(loss) -> module.after_backward() (PP gradient reduction, norms, clipping)
      -> non-finite guard (skip the update, stop after too many in a row)
      -> optimizer.step() -> scheduler.step()
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_codraft.parallel.collectives import reduced


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class NonFiniteGuard:
    """Skips optimizer steps whose loss or gradient is not finite, and stops after too many in a row.

    The loss and gradient norms it reads are global (the same on every rank), so every rank skips the same steps.

    Args:
        max_consecutive: non-finite steps in a row allowed before :class:`NonFiniteError`.

    Attributes:
        skipped: every skipped step as ``(step index, reason)``.
    """

    def __init__(self, max_consecutive: int = 3):
        if int(max_consecutive) < 1:
            raise ValueError(f"max_consecutive={max_consecutive} must be >= 1")
        self.max_consecutive = int(max_consecutive)
        self.steps = 0
        self.in_a_row = 0
        self.skipped: list[tuple[int, str]] = []

    def check(self, metrics: dict[str, Tensor], microbatch_losses: Sequence[float]) -> Optional[str]:
        """Why this step must be skipped (naming the microbatch or gradient group), or None; counts the step."""
        reason = None
        bad = [m for m, v in enumerate(microbatch_losses) if not math.isfinite(v)]
        if bad:
            reason = f"non-finite loss in microbatch {bad[0]} ({microbatch_losses[bad[0]]})"
        else:
            norms = {k: float(v) for k, v in metrics.items() if k.startswith("grad_norm/")}
            bad_groups = [k.split("/", 1)[1] for k, v in norms.items() if not math.isfinite(v)]
            if bad_groups:
                reason = f"non-finite gradient of the {bad_groups[0]!r} parameters"
        step, self.steps = self.steps, self.steps + 1
        if reason is None:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.skipped.append((step, reason))
        warnings.warn(
            f"optimizer step {step}: {reason}; skipped the update ({self.in_a_row} in a row)",
            RuntimeWarning,
            stacklevel=3,
        )
        if self.in_a_row >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient (last: "
                f"step {step}, {reason}); stopping (lower the learning rate, check the rewards "
                f"and the data, or resume from the last checkpoint, which is finite)"
            )
        return reason


def optimizer_step(
    forward: Callable[[Any], Any],
    module: nn.Module,
    batch: Any,
    optimizer,
    scheduler=None,
    backward: Optional[Callable[[Tensor], None]] = None,
) -> dict[str, Tensor]:
    """Run one optimizer step of the joint objective and return its metrics.

    A step whose loss or gradient is not finite is skipped (no update, no scheduler step) through the module's
    ``nonfinite_guard`` (if it has one), which stops the run after too many in a row.

    Args:
        forward: what computes the step output from the batch: the (wrapped) module itself.
        module: the unwrapped ``CoDraftModule`` (for ``after_backward`` and ``nonfinite_guard``).
        batch: this dp replica's RL batch (an ``RLBatch`` or its dict layout).
        optimizer: the optimizer of ``module.build_optimizer()`` (possibly wrapped by Lightning).
        scheduler: its LR scheduler (stepped once), or None.
        backward: ``backward(loss)``; default ``loss.backward()``.

    Returns:
        Detached global scalar metrics: the loss terms, draft accuracy / acceptance length, gradient norms, and
        ``skipped`` (1.0 when the update was skipped).
    """
    optimizer.zero_grad(set_to_none=True)
    out = forward(batch)
    if out.loss is not None:
        (backward or Tensor.backward)(out.loss)
    metrics = {**out.metrics, **module.after_backward()}
    guard = getattr(module, "nonfinite_guard", None)
    reason = guard.check(metrics, out.microbatch_losses) if guard is not None else None
    metrics["skipped"] = torch.tensor(float(reason is not None))
    if reason is not None:
        optimizer.zero_grad(set_to_none=True)
        return metrics
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)  # no gradient memory held through the rollouts that follow
    return metrics


def grad_norms(
    groups: Mapping[str, Iterable[nn.Parameter]], max_norm: Optional[float] = None, norm_group: Optional[Any] = None
) -> dict[str, Tensor]:
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
            plain = plain + reduced(sq, group)
        norm = reduced(plain, norm_group).sqrt()
        if max_norm is not None:
            coef = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
            for g in grads:
                g.mul_(coef)
        out[f"grad_norm/{name}"] = norm
    return out
