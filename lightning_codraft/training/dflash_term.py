"""DFlash behind the drafter protocol (training/drafter.py): its part of the joint objective, on any mesh.

Definitions in docs/design/drafters.md. One microbatch, on this rank's rows (its zigzag shard under CP):

- **Anchors** are a batch column (``RLBatch.draft_anchor``) drawn per DOCUMENT on the replica's whole batch before
  it is cut or sharded (:meth:`DFlashTerm.prepare`): ``block_anchors`` rows of each document among its completion
  rows that are draft targets (where the engine drafts), from a generator seeded by the document's tokens, so one process, any ``num_microbatches`` and any
  (dp, cp, pp) mesh draw the same anchors for the same document.
- **Context.** The drafter's context features ``hidden_norm(fc(cat(taps)))`` of this rank's rows are passed around
  the CP ring (``attention.gather.ring_gather_whole``: ``cp - 1`` point-to-point hops; the backward returns each
  row's gradient to its owner), so a block on any rank attends to its document's context before the anchor, in
  one softmax with its own block's keys (``models.dflash``).
- **Block input.** ``[x_a, MASK x (B - 1)]`` embedded by the policy: the anchor's embedding is tap 0 at the anchor
  row (what the policy's forward computed; the TapChannel ships it under PP), the mask embedding is
  ``CoDraftModule.block_mask_embedding`` (under PP the first stage sends it to the last). Logits go through the
  policy's ``lm_head`` weight. Both are read detached: the draft term never reaches the policy.
- **Targets.** Block position ``k`` learns the policy's distribution at row ``a + k - 1``: the policy's logits
  shifted left by ``k - 1`` within documents (a halo exchange under CP), read at the anchors.
- **Denominators.** Position ``k``'s sum is divided by the step's anchors whose row ``a + k - 1`` is a draft
  target in the same document (:meth:`DFlashTerm.scored_rows`, summed over the step by ``normalize_step``).
- **Implied rounds** replay block verification on the step's rollouts (``training.implied.block_row_acceptance``):
  a block at every completion row, without gradient, in chunks.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_codraft.attention.gather import ring_gather_whole
from lightning_codraft.attention.zigzag import ZigzagLayout
from lightning_codraft.batch import RLBatch
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.parallel.collectives import group_size, reduced
from lightning_codraft.training.dflash_loss import (
    block_loss,
    block_position_weights,
    context_visibility,
    default_block_gamma,
    sample_anchors,
)
from lightning_codraft.training.draft_loss import DraftLossOutput
from lightning_codraft.training.drafter import register_draft_term
from lightning_codraft.training.implied import ReferenceDraft, block_row_acceptance, walk_rounds
from lightning_codraft.training.objective import global_draft_objective, unroll_weights

IMPLIED_CHUNK = 256
"""Blocks per drafter forward when replaying verification for the implied rounds (bounds ``(chunk, B, V)``)."""


def draw_anchors(batch: RLBatch, per_doc: int, seed: int = 0) -> Tensor:
    """``(T,)`` float32: 1 on up to ``per_doc`` rows of each document, drawn without replacement among its completion
    rows that are draft targets (``loss_mask * RLBatch.draft_targets``: a block starts where the engine drafts) by a
    generator seeded with ``seed`` and the document's tokens."""
    batch._require_whole("draw_anchors")
    ids = batch.input_ids

    def document_generator(start: int, end: int) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(ids[start:end].cpu().numpy().tobytes(), seed) & 0x7FFFFFFF)

    rows = sample_anchors(batch.cu_seqlens, batch.draft_targets * batch.loss_mask, per_doc, document_generator)
    out = torch.zeros(batch.num_rows, dtype=torch.float32, device=ids.device)
    out[rows] = 1.0
    return out


@dataclass
class BlockInputs:
    """What the live drafter and the A/B reference both read (detached), computed once per microbatch.

    Attributes:
        feats: the drafter's taps, each ``(T, H)`` (this rank's rows).
        anchors: ``(N,)`` local rows of the training blocks' anchors.
        block_embeds: ``(N, B, H)`` their input embeddings.
        positions: ``(T_all,)`` position of every row of the whole microbatch (document order).
        global_rows: ``(T,)`` each local row's row in the whole microbatch.
        tap0: ``(T, H)`` the policy's input embeddings (the implied rounds' anchors read them).
        mask: ``(H,)`` the mask token's embedding.
        head: ``(V, H)`` the policy's ``lm_head`` weight.
    """

    feats: list[Tensor]
    anchors: Tensor
    block_embeds: Tensor
    positions: Tensor
    global_rows: Tensor
    tap0: Tensor
    mask: Tensor
    head: Tensor


class DFlashTerm:
    """The DFlash block drafter's term (module docstring)."""

    name = "dflash"
    fsdp_methods = ("context",)

    def __init__(self, draft: DFlashDraft):
        c = draft.config
        self.block_size, self._taps, self.mask_token_id = int(c.block_size), tuple(c.taps), int(c.mask_token_id)
        self.first_slot = int(draft.first_slot)  # the block row of the first proposal (models/dflash.py)

    def num_positions(self, module) -> int:
        return self.block_size - self.first_slot

    def taps(self, module) -> tuple[int, ...]:
        return self._taps

    def prepare(self, module, batch: RLBatch) -> RLBatch:
        if batch.draft_anchor is not None:
            return batch
        if batch.is_sharded:
            raise ValueError(
                "a CP shard without draft_anchor: a block drafter's anchors are drawn per document on the whole "
                "batch; pass the replica's whole batch (or set draft_anchor before sharding)"
            )
        return dataclasses.replace(batch, draft_anchor=draw_anchors(batch, module.config.block_anchors))

    def scored_rows(self, module, batch: RLBatch, cp_group) -> Tensor:
        anchor = batch.draft_anchor.double()
        return torch.stack(
            [
                (anchor * batch.shift_left(batch.draft_targets, k, group=cp_group).double()).sum()
                for k in range(self.num_positions(module))
            ]
        )

    def position_weights(self, module) -> Tensor:
        c, K = module.config, self.num_positions(module)
        if c.position_weights == "decay":
            gamma = c.block_gamma if c.block_gamma is not None else default_block_gamma(K + 1)
            return block_position_weights(K, gamma)
        return unroll_weights(c.position_weights, c.ttt_decay, K, module.live_position_rates)

    def inputs(self, module, taps: dict[int, Tensor], batch: RLBatch) -> BlockInputs:
        group = module.parallel_dims.cp_group
        anchors = torch.nonzero(batch.draft_anchor > 0).flatten()
        tap0 = taps[0].detach()
        mask = module.block_mask_embedding().to(tap0)
        embeds = self._block_embeds(tap0, mask, anchors)
        if batch.is_sharded:
            lay = ZigzagLayout.build(batch.cu_seqlens, batch.cp_rank, batch.cp_size, device=tap0.device)
            global_rows = lay.global_rows
        else:
            global_rows = torch.arange(batch.num_rows, device=tap0.device)
        with torch.no_grad():
            positions = ring_gather_whole(batch.position_ids, batch.cu_seqlens, group if batch.is_sharded else None)
        head = module.policy.lm_head.weight.detach()
        return BlockInputs(
            [taps[t].detach() for t in self.taps(module)], anchors, embeds, positions, global_rows, tap0, mask, head
        )

    def _block_embeds(self, tap0: Tensor, mask: Tensor, anchors: Tensor) -> Tensor:
        """``(N, B, H)`` the input embeddings of the blocks anchored at local rows ``anchors``: the anchor's token
        (tap 0 at its row), then the mask token's."""
        return torch.cat([tap0[anchors][:, None], mask.expand(anchors.numel(), self.block_size - 1, -1)], 1)

    def _context(self, draft, inputs: BlockInputs, batch: RLBatch, module) -> Tensor:
        local = draft.context([f.to(next(draft.parameters()).dtype) for f in inputs.feats])
        group = module.parallel_dims.cp_group if batch.is_sharded else None
        return ring_gather_whole(local, batch.cu_seqlens, group)

    def _hidden(self, draft, ctx: Tensor, inputs: BlockInputs, anchors: Tensor, embeds: Tensor, batch) -> Tensor:
        """``(N, K, H)`` the drafter's hidden states at the proposal rows of the blocks anchored at local rows
        ``anchors`` (position ``k`` predicts ``x_{a+k+1}``, the target of row ``a + k``)."""
        rows = inputs.global_rows[anchors]
        visible = context_visibility(batch.cu_seqlens, rows, ctx.shape[0])
        hidden = draft(ctx, inputs.positions, embeds.to(ctx.dtype), inputs.positions[rows], visible)
        return hidden[:, self.first_slot :]

    def _head(self, draft, hidden: Tensor, inputs: BlockInputs, anchors: Tensor) -> Tensor:
        """``(N, K, V)`` the proposals' logits from their hidden states: through the policy's head."""
        return DFlashDraft.logits(hidden, inputs.head.to(hidden.dtype))

    def _blocks(self, draft, ctx: Tensor, inputs: BlockInputs, anchors: Tensor, embeds: Tensor, batch) -> Tensor:
        """``(N, K, V)`` proposal logits of the blocks anchored at local rows ``anchors``."""
        return self._head(draft, self._hidden(draft, ctx, inputs, anchors, embeds, batch), inputs, anchors)

    def _targets(self, module, inputs: BlockInputs, logits: Tensor, batch: RLBatch) -> tuple[Tensor, Tensor]:
        """``(N, K, V)`` the policy's logits each block position learns (detached) and ``(N, K)`` where it counts,
        for this rank's anchors."""
        group = module.parallel_dims.cp_group if batch.is_sharded else None
        K, policy_logits = self.num_positions(module), logits.detach()
        with torch.no_grad():
            targets = torch.stack(
                [batch.shift_left(policy_logits, k, group=group)[inputs.anchors] for k in range(K)], 1
            )
            counted = torch.stack(
                [batch.shift_left(batch.draft_targets, k, group=group)[inputs.anchors] for k in range(K)], 1
            )
        return targets, counted

    def _loss(
        self, module, inputs: BlockInputs, logits: Tensor, batch: RLBatch, weights: Tensor
    ) -> tuple[DraftLossOutput, Tensor, Tensor]:
        """The block loss of this rank's anchors (values over the CP group), its positions weighed by ``weights``;
        the whole context it attended to; the positions' weights in the value (``weights`` here)."""
        dims, c = module.parallel_dims, module.config
        group = dims.cp_group if batch.is_sharded else None
        ctx = self._context(module.draft, inputs, batch, module)
        block_logits = self._blocks(module.draft, ctx, inputs, inputs.anchors, inputs.block_embeds, batch)
        targets, counted = self._targets(module, inputs, logits, batch)
        out = block_loss(
            block_logits,
            targets,
            counted,
            weights.to(block_logits.device),
            c.loss_type,
            None if batch.norm is None else batch.norm.draft,
            group=group if group_size(group) > 1 else None,
        )
        return out, ctx, weights

    def objective(self, module, inputs: BlockInputs, logits: Tensor, batch: RLBatch):
        out, ctx, weights = self._loss(module, inputs, logits, batch, self.position_weights(module))
        d = global_draft_objective(lambda _: out, [], weights, module.parallel_dims.dp_group)
        return d, self._implied(module, module.draft, ctx.detach(), inputs, batch)

    def warm_start_loss(self, module, batch: RLBatch, step: int) -> DraftLossOutput:
        batch = dataclasses.replace(batch, draft_anchor=draw_anchors(batch, module.config.block_anchors, seed=step + 1))
        ids = (0, *self._taps)
        with torch.no_grad():
            out = module.policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids, taps=ids)
        inputs = self.inputs(module, dict(zip(ids, out.taps)), batch)
        return self._loss(module, inputs, out.logits, batch, self.position_weights(module))[0]

    @torch.no_grad()
    def _implied(self, module, draft, ctx: Tensor, inputs: BlockInputs, batch: RLBatch) -> Tensor:
        """``(K + 2,)`` the implied rounds of ``draft`` on this microbatch, summed over dp (module docstring)."""
        dims = module.parallel_dims
        group = dims.cp_group if batch.is_sharded else None
        rows = torch.nonzero(batch.loss_mask > 0).flatten()  # a round at row i runs the block anchored at i + 1

        def blocks():
            for lo in range(0, rows.numel(), IMPLIED_CHUNK):
                part = rows[lo : lo + IMPLIED_CHUNK]
                embeds = self._block_embeds(inputs.tap0, inputs.mask, part)
                yield part, self._blocks(draft, ctx, inputs, part, embeds, batch)

        accept = block_row_acceptance(blocks(), self.num_positions(module), batch, module.config.temperature, group)
        counts = walk_rounds(accept, batch.loss_mask, batch.cu_seqlens, group=group).as_tensor()
        return reduced(counts, dims.dp_group)

    def reference_implied(self, module, reference: ReferenceDraft, inputs: BlockInputs, logits, batch) -> Tensor:
        reference.on(inputs.tap0)
        with torch.no_grad():
            ctx = self._context(reference.module, inputs, batch, module)
        return self._implied(module, reference.module, ctx, inputs, batch)


register_draft_term(DFlashDraft, DFlashTerm)
