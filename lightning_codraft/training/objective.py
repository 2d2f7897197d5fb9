"""Pieces of the joint objective ``L_rl + lambda * L_draft`` shared by every schedule.

:class:`~lightning_codraft.training.module.CoDraftModule` computes one microbatch's objective with
:meth:`~lightning_codraft.training.module.CoDraftModule.objective`; the single-stage step and the pipeline's last
stage both call it. What it needs besides the model lives here:

- :func:`global_draft_objective`: the draft loss (a CP-group sum divided by the step's global scored rows) made this
  microbatch's share of the draft objective over the whole dp x cp step, value and gradient;
- :class:`MicrobatchRecord`: the detached statistics one microbatch reports (shares of the step: they add up);
- :func:`step_metrics`: a step's metrics from its microbatches' records (shares summed, draft accuracy over every
  scored row and the acceptance length it implies, through :class:`~lightning_codraft.training.metrics.DraftAcceptance`,
  and the share of rows whose policy top-1 is outside the draft vocabulary).

The step's first act, its loss weights and denominators, is training/normalize.py's :func:`normalize_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_codraft.parallel.collectives import reduced
from lightning_codraft.training.implied import RoundCounts
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
        metrics: ``loss``, ``policy/*`` (the RL loss's stats) and ``draft/loss*`` scalars: this microbatch's shares
            of the step's values (the step's value is their sum over microbatches).
        draft_correct: ``(K,)`` rows whose draft top-1 equals the policy's, per unroll step (None without a draft).
        draft_total: ``(K,)`` scored rows per unroll step (None without a draft).
        draft_in_vocab: ``(K,)`` scored rows whose policy top-1 is in the draft vocabulary (None without a draft).
        implied: ``(K + 2,)`` the draft's implied verification rounds on the microbatch's rollouts
            (``training.implied.RoundCounts.as_tensor``, over every replica); None when the draft did not run.
        reference_implied: the same for the A/B's reference draft; None without one.
    """

    metrics: dict[str, Tensor]
    draft_correct: Optional[Tensor] = None
    draft_total: Optional[Tensor] = None
    draft_in_vocab: Optional[Tensor] = None
    implied: Optional[Tensor] = None
    reference_implied: Optional[Tensor] = None


@dataclass
class DraftObjective:
    """This microbatch's share of the step's draft objective over the whole dp x cp batch.

    Attributes:
        loss: scalar whose VALUE is the share over every rank and whose gradient is this rank's part of it.
        per_step: ``(K,)`` detached share of each unroll step's soft cross-entropy.
        correct: ``(K,)`` global count of scored rows whose draft top-1 equals the policy top-1.
        total: ``(K,)`` global count of scored rows.
        in_vocab: ``(K,)`` global count of scored rows whose policy top-1 is in the draft vocabulary.
        extras: the drafter's own scalars (``DraftLossOutput.extras``), this microbatch's shares over dp x cp.
    """

    loss: Tensor
    per_step: Tensor
    correct: Tensor
    total: Tensor
    in_vocab: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)


def unroll_weights(kind: str, decay: float, num_steps: int, rates: Optional[Tensor] = None) -> Tensor:
    """``(K,)`` fp32 weight of each unroll step: ``decay`` -> ``decay ** k``; ``uniform`` -> 1; ``acceptance`` ->
    ``prod_{j<k} rates_j``, the probability that the engine verifies position k at all given the draft's live
    per-position acceptance ``rates`` (``decay ** k`` until they are measured)."""
    if kind == "uniform":
        return torch.ones(num_steps)
    if kind == "acceptance" and rates is not None:
        r = rates.detach().float().cpu().clamp(0, 1)
        return torch.cat([torch.ones(1), torch.cumprod(r[: num_steps - 1], 0)])
    if kind not in ("decay", "acceptance"):
        raise ValueError(f"position weights {kind!r} must be decay, uniform or acceptance")
    return decay ** torch.arange(num_steps, dtype=torch.float32)


def global_draft_objective(
    draft_loss: Callable[[Sequence[Tensor]], Any],
    step_logits: Sequence[Tensor],
    weights: Tensor,
    dp_group: Optional[Any],
) -> DraftObjective:
    """The draft loss of one microbatch, summed over the CP group, made its share over dp x cp.

    Args:
        draft_loss: ``draft_loss(step_logits) -> DraftLossOutput`` whose ``per_step_loss`` is a sum over the CP
            group divided by the STEP's global scored rows (``ttt_draft_loss(..., group=cp_group,
            denominators=batch.norm.draft)``), so the data-parallel replicas' values add up.
        step_logits: K tensors ``(T, Vd)``, the draft logits of each unroll step on this rank.
        weights: ``(K,)`` weight of each unroll step (:func:`unroll_weights`; the draft loss must use the same).
        dp_group: the data-parallel group, or None.
    """
    out = draft_loss(step_logits)
    in_vocab = out.total if out.in_vocab is None else out.in_vocab
    rows = [out.per_step_loss, out.correct, out.total, in_vocab]
    names = sorted(out.extras)
    extras = torch.stack([out.extras[n].detach().reshape(()) for n in names]) if names else out.total.new_zeros(0)
    packed = reduced(torch.cat([torch.stack([r.to(torch.float64) for r in rows]).flatten(), extras.double()]), dp_group)
    K = out.total.numel()
    per_step, counts = packed[:K].float(), packed[K : 4 * K].view(3, K).float()
    value = (weights.to(per_step) * per_step).sum()
    local = out.loss + (value.to(out.loss) - out.loss).detach()
    return DraftObjective(
        loss=local,
        per_step=per_step,
        correct=counts[0],
        total=counts[1],
        in_vocab=counts[2],
        extras={n: v.float() for n, v in zip(names, packed[4 * K :])},
    )


def merge_microbatch_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One step's statistics from its microbatches' (same keys in each): every value is a microbatch's share of the
    step's value (its losses and weighted means divide by the step's global denominators; token counts are counts),
    so the step's value is the sum; a maximum (a key ending in ``_max``) is the largest."""
    if not stats:
        return {}
    return {k: (max if k.endswith("_max") else sum)(s[k] for s in stats) for k in stats[0]}


def step_metrics(records: Sequence[MicrobatchRecord]) -> tuple[dict[str, Tensor], Optional[tuple[Tensor, Tensor]]]:
    """A step's metrics and draft counts from the records of its microbatches.

    Returns:
        ``(metrics, counts)``: the merged scalars plus ``draft/acc_step{k}``, ``draft/top1_acceptance`` (from the
        accuracy over every scored row) and ``draft/oov_share`` (scored rows whose policy top-1 the draft
        vocabulary lacks: each is a miss) when the draft ran; ``counts`` = ``(correct (K,), total (K,))`` summed
        over microbatches, or None.
    """
    metrics = {**merge_microbatch_stats([r.metrics for r in records]), **implied_metrics(records)}
    if not records or records[0].draft_correct is None:
        return metrics, None
    correct = sum(r.draft_correct for r in records)
    total = sum(r.draft_total for r in records)
    acceptance = DraftAcceptance(num_steps=int(correct.numel()), sync_on_compute=False)  # the counts are global
    acceptance.update(correct, total)
    for name, value in acceptance.compute().items():
        metrics["draft/" + name.replace("acc/step", "acc_step")] = value
    if records[0].draft_in_vocab is not None:
        in_vocab = sum(r.draft_in_vocab for r in records)
        metrics["draft/oov_share"] = (1 - in_vocab.sum() / total.sum().clamp(min=1)).float()
    return metrics, (correct, total)


def implied_metrics(records: Sequence[MicrobatchRecord]) -> dict[str, Tensor]:
    """``draft/implied_acceptance`` and ``draft/implied_rate{k}`` (the draft's implied acceptance length and per
    position rates on the step's rollouts), and ``draft/reference_*`` the same for the A/B's reference draft, from
    the microbatches' summed round counts; empty where neither ran."""
    out = {}
    for name, key in (("implied", "implied"), ("reference", "reference_implied")):
        parts = [getattr(r, key) for r in records if getattr(r, key) is not None]
        if parts:
            counts = RoundCounts.from_tensor(sum(parts))
            out[f"draft/{name}_acceptance"] = torch.tensor(counts.acceptance_length)
            for k, rate in enumerate(counts.position_rates):
                out[f"draft/{name}_rate{k}"] = torch.tensor(rate)
    return out
