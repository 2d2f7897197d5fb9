"""DSpark behind the drafter protocol (training/drafter.py): DFlash's term (training/dflash_term.py) plus the
Markov and confidence heads and DeepSpec's three-term loss (training/dspark_loss.py), on any mesh.

What differs from DFlash, for this rank's blocks (docs/design/drafters.md):

- **Layout.** DeepSpec's next-token layout by default (models/dspark.py): a block of B rows makes K = B proposals,
  row ``k`` predicting ``x_{a+k+1}``, the target of policy row ``a + k`` (DFlash's: rows ``1 .. B - 1``, K = B - 1;
  both learn rows ``a .. a + K - 1``).
- **Tokens.** Proposal ``k`` has the Markov bias of ``x_{a+k}`` (teacher forced: the rollout's tokens, which are
  the ones drafted whenever proposal k is verified at all). Both come from
  the batch's ``input_ids`` shifted left within documents (a halo exchange under CP), read at the anchors, once per
  microbatch (:class:`SparkInputs`).
- **Loss.** CE against ``x_{a+k}``, the L1 distance to the policy's distribution and the confidence BCE, each
  decay-weighted and divided by the STEP's weighted counted positions, so the microbatches' and ranks' shares add
  up to DeepSpec's loss on the step's blocks (``dspark_block_loss``); weights ``draft.dspark_ce_weight`` / ``dspark_l1_weight`` /
  ``dspark_confidence_weight``.
- **Logged** (``draft/<name>``): ``ce``, ``l1``, ``confidence_loss``, ``prob_acceptance`` (``1 + sum cumprod(1 -
  TV)``), ``predicted_acceptance`` (the confidence head's) and ``confidence_error``, beside the implied acceptance.
- **Implied rounds** replay verification with the Markov bias of the rollout's previous tokens (exact for the
  acceptance walk: a position is verified only when every earlier proposal equalled the rollout's token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_codraft.batch import RLBatch
from lightning_codraft.models.dspark import DSparkDraft
from lightning_codraft.parallel.collectives import group_size
from lightning_codraft.training.dflash_term import BlockInputs, DFlashTerm
from lightning_codraft.training.draft_loss import DraftLossOutput
from lightning_codraft.training.drafter import register_draft_term
from lightning_codraft.training.dspark_loss import dspark_block_loss


@dataclass
class SparkInputs(BlockInputs):
    """:class:`BlockInputs` plus ``tokens`` ``(T, K + 1)``: ``tokens[i, j] = x_{i+j}`` within row i's document (0
    past its end), this rank's rows."""

    tokens: Tensor = None


class DSparkTerm(DFlashTerm):
    """The DSpark drafter's term (module docstring)."""

    name = "dspark"
    fsdp_methods = ("context", "block_logits", "confidence_logits")

    def inputs(self, module, taps: dict[int, Tensor], batch: RLBatch) -> SparkInputs:
        base = super().inputs(module, taps, batch)
        group = module.parallel_dims.cp_group if batch.is_sharded else None
        K = self.num_positions(module)
        with torch.no_grad():
            tokens = torch.stack([batch.shift_left(batch.input_ids, j, group=group) for j in range(K + 1)], 1)
        return SparkInputs(**vars(base), tokens=tokens)

    def _head(self, draft, hidden: Tensor, inputs: SparkInputs, anchors: Tensor) -> Tensor:
        prev = inputs.tokens[anchors][:, : hidden.shape[1]]
        return draft.block_logits(hidden, inputs.head.to(hidden.dtype), prev)

    def _loss(
        self, module, inputs: SparkInputs, logits: Tensor, batch: RLBatch, weights: Tensor
    ) -> tuple[DraftLossOutput, Tensor, Tensor]:
        dims, c, draft = module.parallel_dims, module.config, module.draft
        group = dims.cp_group if batch.is_sharded else None
        ctx = self._context(draft, inputs, batch, module)
        hidden = self._hidden(draft, ctx, inputs, inputs.anchors, inputs.block_embeds, batch)
        tokens = inputs.tokens[inputs.anchors]
        prev, truth = tokens[:, :-1], tokens[:, 1:]
        block_logits = self._head(draft, hidden, inputs, inputs.anchors)
        confidence = draft.confidence_logits(hidden, prev)
        targets, counted = self._targets(module, inputs, logits, batch)
        out, value_weights = dspark_block_loss(
            block_logits,
            targets,
            truth,
            counted,
            confidence,
            weights.to(block_logits.device),
            (c.dspark_ce_weight, c.dspark_l1_weight, c.dspark_confidence_weight),
            None if batch.norm is None else batch.norm.draft,
            group=group if group_size(group) > 1 else None,
        )
        return out, ctx, value_weights


register_draft_term(DSparkDraft, DSparkTerm)
