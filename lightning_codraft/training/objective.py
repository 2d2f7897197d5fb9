"""Pieces of the joint objective ``L_rl + lambda * L_draft`` shared by every schedule.

:class:`~lightning_codraft.training.module.CoDraftModule` computes one microbatch's objective with
:meth:`~lightning_codraft.training.module.CoDraftModule.objective`; the single-stage step and the pipeline's last
stage both call it. What it needs besides the model lives here:

- :func:`global_draft_objective`: the draft loss (a CP-group sum divided by the step's global scored rows) made this
  microbatch's share of the draft objective over the whole dp x cp step, value and gradient;
- :class:`MicrobatchRecord`: the detached statistics one microbatch reports (shares of the step: they add up);
- :func:`step_metrics`: a step's metrics from its microbatches' records (shares summed, draft accuracy over every
  scored row and the acceptance length it implies, through :class:`~lightning_codraft.training.metrics.DraftAcceptance`,
  and the share of rows whose policy top-1 is outside the draft vocabulary);
- :func:`normalize_step`: the step's loss weights and denominators, computed once before the microbatch loop (below).

**One normalisation for every layout** (:func:`normalize_step`): the step's loss denominators, computed once before
the microbatch loop.

GRPO's objective is a weighted sum over the completion tokens of the WHOLE step. If every microbatch divided by its
own token count and the microbatches were averaged, the objective would depend on how the step is cut: with one
sample per microbatch, ``sequence`` aggregation would weigh sample ``i`` by ``mean_len / len_i`` and ``token``
aggregation would become a per-sample mean. TRL (``grpo``, ``dapo``, ``dr_grpo``) and verl (global token count and
batch size, microbatch losses summed) are invariant; so is this: :func:`normalize_step` gives every row of the
replica's batch its weight in the global objective (``RLBatch.loss_weight``) and the global counts the draft term
and the logged statistics divide by (``RLBatch.norm``), with ONE all-reduce over the data-parallel group. Every
microbatch's loss is then its share of the step's objective and the shares are summed, on one process, under any
``num_microbatches``, any dp x cp mesh and in the pipeline schedule alike (docs/design/interfaces.md, "Loss
normalisation").

Aggregations (``rl.loss_aggregation``), per row ``t`` of sample ``i`` with ``n_i`` completion tokens:

- ``token`` (DAPO; TRL ``loss_type="dapo"``; verl ``token-mean``): ``w_t = 1 / N``, N the step's completion tokens;
- ``sequence`` (GRPO; TRL ``"grpo"``; verl ``seq-mean-token-mean``): ``w_t = 1 / (n_i S)``, S the step's samples;
- ``constant`` (Dr. GRPO; TRL ``"dr_grpo"``; verl ``seq-mean-token-sum-norm``): ``w_t = 1 / (S L)``, L =
  ``max_new_tokens``.

The weight multiplies the whole per-token loss (the clipped surrogate AND the KL term).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from lightning_codraft.batch import RLBatch, StepNorm
from lightning_codraft.parallel.collectives import reduced
from lightning_codraft.training.config import AGGREGATIONS
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
    """

    loss: Tensor
    per_step: Tensor
    correct: Tensor
    total: Tensor
    in_vocab: Tensor


def unroll_weights(kind: str, decay: float, num_steps: int, rates: Optional[Tensor] = None) -> Tensor:
    """``(K,)`` fp32 weight of each unroll step: ``decay`` -> ``decay ** k``; ``uniform`` -> 1; ``acceptance`` ->
    ``prod_{j<k} rates_j``, the probability that the engine verifies position k at all given the draft's live
    per-position acceptance ``rates`` (``decay ** k`` until they are measured)."""
    if kind == "uniform":
        return torch.ones(num_steps)
    if kind == "acceptance" and rates is not None:
        r = rates.detach().float().cpu().clamp(0, 1)
        return torch.cat([torch.ones(1), torch.cumprod(r[:num_steps - 1], 0)])
    if kind not in ("decay", "acceptance"):
        raise ValueError(f"position weights {kind!r} must be decay, uniform or acceptance")
    return decay ** torch.arange(num_steps, dtype=torch.float32)


def global_draft_objective(draft_loss: Callable[[Sequence[Tensor]], Any], step_logits: Sequence[Tensor],
                           weights: Tensor, dp_group: Optional[Any]) -> DraftObjective:
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
    packed = reduced(torch.stack([out.per_step_loss.to(torch.float64), out.correct.to(torch.float64),
                                  out.total.to(torch.float64), in_vocab.to(torch.float64)]), dp_group)
    per_step = packed[0].float()
    value = (weights.to(per_step) * per_step).sum()
    local = out.loss + (value.to(out.loss) - out.loss).detach()
    return DraftObjective(loss=local, per_step=per_step, correct=packed[1].float(), total=packed[2].float(),
                          in_vocab=packed[3].float())


def merge_microbatch_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One step's statistics from its microbatches' (same keys in each): every value is a microbatch's share of the
    step's value (its losses and weighted means divide by the step's global denominators; token counts are counts),
    so the step's value is the sum."""
    if not stats:
        return {}
    return {k: sum(s[k] for s in stats) for k in stats[0]}


def step_metrics(records: Sequence[MicrobatchRecord]) -> tuple[dict[str, Tensor], Optional[tuple[Tensor, Tensor]]]:
    """A step's metrics and draft counts from the records of its microbatches.

    Returns:
        ``(metrics, counts)``: the merged scalars plus ``draft/acc_step{k}``, ``draft/acceptance_length`` (from the
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


# ---------------------------------------------------------------- the step's normalisation

def _doc_index(batch: RLBatch) -> Tensor:
    """``(T,)`` int64 index of the document each held row belongs to (a CP shard holds ``len / cp`` rows of each)."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long() // batch.cp_size
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def normalize_step(batch: RLBatch, aggregation: str, ttt_steps: int, *, max_new_tokens: Optional[int] = None,
                   dp_group: Optional[Any] = None, cp_group: Optional[Any] = None) -> RLBatch:
    """The replica's batch with ``loss_weight`` and ``norm`` set for the whole step.

    Call it on every rank with this dp replica's batch of the step (whole, or this rank's CP shard), before the batch
    is cut into microbatches. A batch whose ``loss_weight`` is already set is returned unchanged (the caller
    normalised it).

    Args:
        batch: the replica's :class:`~lightning_codraft.batch.RLBatch`.
        aggregation: ``token``, ``sequence`` or ``constant`` (see the module docstring).
        ttt_steps: K, the draft's unroll depth (``norm.draft`` has K entries).
        max_new_tokens: L of the ``constant`` aggregation (required there).
        dp_group: the data-parallel group (the step is every replica's batch).
        cp_group: the CP group; needed only when ``batch`` is already a CP shard.

    Returns:
        The batch with ``loss_weight (T,)`` and ``norm`` (:class:`~lightning_codraft.batch.StepNorm`).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {aggregation!r} must be one of {AGGREGATIONS}")
    if aggregation == "constant" and (max_new_tokens is None or max_new_tokens < 1):
        raise ValueError(f"the 'constant' (Dr. GRPO) aggregation divides by samples x max_new_tokens; "
                         f"pass max_new_tokens >= 1, got {max_new_tokens}")
    if batch.loss_weight is not None and batch.norm is not None:
        return batch
    if batch.is_sharded and cp_group is None:
        raise ValueError(f"normalize_step on CP rank {batch.cp_rank}'s shard needs the CP group")
    mask = batch.loss_mask.to(torch.float64)
    doc = _doc_index(batch)
    per_doc = torch.zeros(batch.num_docs, dtype=torch.float64, device=mask.device).index_add_(0, doc, mask)
    draft_rows = torch.stack([batch.shift_left(batch.draft_targets, k + 1, group=cp_group).to(torch.float64).sum()
                              for k in range(ttt_steps)])
    if batch.is_sharded:  # whole documents' counts: the shards of a document are on every CP rank
        summed = reduced(torch.cat([per_doc, draft_rows]), cp_group)
        per_doc, draft_rows = summed[:batch.num_docs], summed[batch.num_docs:]
    local = torch.cat([torch.stack([per_doc.sum(), (per_doc > 0).sum().to(torch.float64)]), draft_rows])
    tokens, samples, *draft = reduced(local, dp_group).tolist()
    if aggregation == "token":
        denominator, row = tokens, mask
    elif aggregation == "sequence":
        denominator, row = samples, mask / per_doc.clamp(min=1)[doc]
    else:
        denominator, row = samples * float(max_new_tokens), mask
    norm = StepNorm(tokens=tokens, samples=samples, rl=max(denominator, 1.0),
                    draft=torch.tensor(draft, dtype=torch.float32, device=mask.device).clamp(min=1))
    return dataclasses.replace(batch, loss_weight=(row / norm.rl).to(torch.float32), norm=norm)
