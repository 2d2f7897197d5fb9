"""The step's first act: every row's weight in the whole step's objective, and the step's denominators.

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
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_codraft.batch import RLBatch, StepNorm
from lightning_codraft.parallel.collectives import reduced
from lightning_codraft.training.config import AGGREGATIONS


def doc_index(batch: RLBatch) -> Tensor:
    """``(T,)`` int64 index of the document each held row belongs to (a CP shard holds ``len / cp`` rows of each)."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long() // batch.cp_size
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def unroll_scored_rows(batch: RLBatch, num_steps: int, cp_group: Optional[Any] = None) -> Tensor:
    """``(K,)`` float64 rows of this batch (this rank's shard) that EAGLE-3's unroll step ``k`` scores: draft target
    rows ``k + 1`` ahead in their document."""
    return torch.stack(
        [batch.shift_left(batch.draft_targets, k + 1, group=cp_group).to(torch.float64).sum() for k in range(num_steps)]
    )


def normalize_step(
    batch: RLBatch,
    aggregation: str,
    ttt_steps: int,
    *,
    max_new_tokens: Optional[int] = None,
    dp_group: Optional[Any] = None,
    cp_group: Optional[Any] = None,
    scored_rows: Optional[Callable[[RLBatch, Optional[Any]], Tensor]] = None,
) -> RLBatch:
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
        scored_rows: ``scored_rows(batch, cp_group) -> (K,)`` the rows of this batch (shard) the drafter's loss
            scores at each of its positions (its ``norm.draft``); None: EAGLE-3's (:func:`unroll_scored_rows`).

    Returns:
        The batch with ``loss_weight (T,)`` and ``norm`` (:class:`~lightning_codraft.batch.StepNorm`).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {aggregation!r} must be one of {AGGREGATIONS}")
    if aggregation == "constant" and (max_new_tokens is None or max_new_tokens < 1):
        raise ValueError(
            f"the 'constant' (Dr. GRPO) aggregation divides by samples x max_new_tokens; "
            f"pass max_new_tokens >= 1, got {max_new_tokens}"
        )
    if batch.loss_weight is not None and batch.norm is not None:
        return batch
    if batch.is_sharded and cp_group is None:
        raise ValueError(f"normalize_step on CP rank {batch.cp_rank}'s shard needs the CP group")
    mask = batch.loss_mask.to(torch.float64)
    doc = doc_index(batch)
    per_doc = torch.zeros(batch.num_docs, dtype=torch.float64, device=mask.device).index_add_(0, doc, mask)
    if scored_rows is None:
        draft_rows = unroll_scored_rows(batch, ttt_steps, cp_group)
    else:
        draft_rows = scored_rows(batch, cp_group).to(torch.float64)
    if batch.is_sharded:  # whole documents' counts: the shards of a document are on every CP rank
        summed = reduced(torch.cat([per_doc, draft_rows]), cp_group)
        per_doc, draft_rows = summed[: batch.num_docs], summed[batch.num_docs :]
    local = torch.cat([torch.stack([per_doc.sum(), (per_doc > 0).sum().to(torch.float64)]), draft_rows])
    tokens, samples, *draft = reduced(local, dp_group).tolist()
    if aggregation == "token":
        denominator, row = tokens, mask
    elif aggregation == "sequence":
        denominator, row = samples, mask / per_doc.clamp(min=1)[doc]
    else:
        denominator, row = samples * float(max_new_tokens), mask
    norm = StepNorm(
        tokens=tokens,
        samples=samples,
        rl=max(denominator, 1.0),
        draft=torch.tensor(draft, dtype=torch.float32, device=mask.device).clamp(min=1),
    )
    return dataclasses.replace(batch, loss_weight=(row / norm.rl).to(torch.float32), norm=norm)
