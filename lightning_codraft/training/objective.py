"""Pieces of the joint objective ``L_rl + lambda * L_draft`` shared by every schedule.

:class:`~lightning_codraft.training.module.CoDraftModule` computes one microbatch's objective with
:meth:`~lightning_codraft.training.module.CoDraftModule.objective`; the single-stage step and the pipeline's last
stage both call it. What it needs besides the model lives here:

- :func:`global_draft_objective`: the draft loss (a token mean over the CP group) made a token mean over the whole
  dp x cp batch, value and gradient;
- :class:`MicrobatchRecord`: the detached statistics one microbatch reports;
- :func:`step_metrics`: a step's metrics from its microbatches' records (means, token counts summed, draft accuracy
  and the acceptance length it implies, through :class:`~lightning_codraft.training.metrics.DraftAcceptance`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_codraft.training.metrics import DraftAcceptance


@dataclass
class CoDraftStepOutput:
    """What one forward of the joint objective produced.

    Attributes:
        loss: the scalar to back-propagate on this rank (its share of the global loss, already multiplied by the
            strategy's gradient-averaging size); ``None`` when the pipeline schedule already ran the backward.
        metrics: detached global scalars for logging (same value on every rank).
        draft_counts: ``(correct (K,), total (K,))`` global per-step counts, or None when the draft did not run.
        microbatch_losses: the global loss value of every microbatch (what the non-finite guard names).
    """

    loss: Optional[Tensor]
    metrics: dict[str, Tensor] = field(default_factory=dict)
    draft_counts: Optional[tuple[Tensor, Tensor]] = None
    microbatch_losses: list[float] = field(default_factory=list)


@dataclass
class MicrobatchRecord:
    """Detached global statistics of one microbatch's objective.

    Attributes:
        metrics: ``loss``, ``policy/*`` (the RL loss's stats) and ``draft/loss*`` scalars.
        draft_correct: ``(K,)`` rows whose draft top-1 equals the policy's, per unroll step (None without a draft).
        draft_total: ``(K,)`` counted rows per unroll step (None without a draft).
    """

    metrics: dict[str, Tensor]
    draft_correct: Optional[Tensor] = None
    draft_total: Optional[Tensor] = None


@dataclass
class DraftObjective:
    """The draft loss as a token mean over the whole dp x cp batch.

    Attributes:
        loss: scalar whose VALUE is the global loss and whose gradient is this rank's share of its gradient.
        per_step: ``(K,)`` detached global mean soft cross-entropy per unroll step.
        correct: ``(K,)`` global count of rows whose draft top-1 equals the policy top-1.
        total: ``(K,)`` global count of scored rows.
    """

    loss: Tensor
    per_step: Tensor
    correct: Tensor
    total: Tensor


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by ``scale[0]``, a factor known only after the forward."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: list) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale[0], None


def sum_over(x: Tensor, group: Optional[Any]) -> Tensor:
    """``x`` summed over ``group`` (a new tensor), or ``x`` itself without a group."""
    if group is None:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def global_draft_objective(draft_loss: Callable[[Sequence[Tensor]], Any], step_logits: Sequence[Tensor],
                           decay: float, dp_group: Optional[Any]) -> DraftObjective:
    """A CP-token-mean draft loss made a token mean over dp x cp.

    Args:
        draft_loss: ``draft_loss(step_logits) -> DraftLossOutput`` (``loss``, ``per_step_loss``, ``correct``,
            ``total``, all reduced over the CP group, e.g. ``ttt_draft_loss(..., group=cp_group)``).
        step_logits: K tensors ``(T, Vd)``, the draft logits of each unroll step on this rank.
        decay: weight ratio between consecutive unroll steps (step k weighs ``decay ** k``).
        dp_group: the data-parallel group, or None.

    Each step's gradient is rescaled in the backward by ``total_cp[k] / total_global[k]``, a factor known only once
    the dp all-reduce of the counts ran; the value is the global per-step mean, weighted.
    """
    K = len(step_logits)
    scales = [[1.0] for _ in range(K)]  # filled below, read by the backward
    step_logits = [_ScaleGrad.apply(lg, scales[k]) if lg.requires_grad else lg for k, lg in enumerate(step_logits)]
    out = draft_loss(step_logits)
    total_cp = out.total.to(torch.float64)
    num_cp = out.per_step_loss.to(torch.float64) * total_cp.clamp(min=1)
    packed = sum_over(torch.stack([num_cp, total_cp, out.correct.to(torch.float64)]), dp_group)
    num, total, correct = packed[0], packed[1], packed[2]
    for k in range(K):
        scales[k][0] = float(total_cp[k].clamp(min=1) / total[k].clamp(min=1))
    per_step = (num / total.clamp(min=1)).float()
    weights = decay ** torch.arange(K, dtype=torch.float32)
    value = (weights * per_step).sum()
    local = out.loss + (value.to(out.loss) - out.loss).detach()
    return DraftObjective(loss=local, per_step=per_step, correct=correct.float(), total=total.float())


def merge_microbatch_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One step's statistics from its microbatches' (same keys in each): the mean over microbatches, as the
    objective weighs them, except token counts (keys ending in ``num_tokens``), which are summed."""
    if not stats:
        return {}
    return {k: sum(s[k] for s in stats) / (1 if k.endswith("num_tokens") else len(stats)) for k in stats[0]}


def step_metrics(records: Sequence[MicrobatchRecord]) -> tuple[dict[str, Tensor], Optional[tuple[Tensor, Tensor]]]:
    """A step's metrics and draft counts from the records of its microbatches.

    Returns:
        ``(metrics, counts)``: the merged scalars plus ``draft/acc_step{k}`` and ``draft/acceptance_length`` when
        the draft ran; ``counts`` = ``(correct (K,), total (K,))`` summed over microbatches, or None.
    """
    metrics = merge_microbatch_stats([r.metrics for r in records])
    if not records or records[0].draft_correct is None:
        return metrics, None
    correct = sum(r.draft_correct for r in records)
    total = sum(r.draft_total for r in records)
    acceptance = DraftAcceptance(num_steps=int(correct.numel()), sync_on_compute=False)  # the counts are global
    acceptance.update(correct, total)
    for name, value in acceptance.compute().items():
        metrics["draft/" + name.replace("acc/step", "acc_step")] = value
    return metrics, (correct, total)
