"""The DFlash block drafter's training loss: anchors sampled per document, every block position against the detached
policy, weighed by its position.

For an anchor at packed row ``a`` (docs/design/drafters.md), block position ``k = 1 .. B - 1`` predicts ``x_{a+k}``,
which the policy's logits at row ``a + k - 1`` predict; its target is that row's distribution (the policy's, over
its whole vocabulary: a block drafter proposes through the policy's head) and it counts when that row lies inside
the anchor's document and ``loss_mask`` is set there (the mask is indexed by the POLICY row, like every column of
the next-token-aligned RL batch). Position ``k`` weighs ``exp(-(k - 1) / gamma)`` (DFlash: gamma 7 for B = 16, 4
for B = 7); the per-row loss is one of :data:`~lightning_codraft.training.draft_loss.DRAFT_LOSSES`. Each position's
sum is divided by its counted rows (or the step's ``denominators``), as the EAGLE-3 loss divides each unroll step,
and the result is a :class:`~lightning_codraft.training.draft_loss.DraftLossOutput` with one "step" per block
position, so the draft's metrics (``draft/acc_step{k}``, ``draft/top1_acceptance``) read the same for both drafters.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from lightning_codraft.attention.packing import document_ids_from_cu_seqlens
from lightning_codraft.training.draft_loss import DRAFT_LOSSES, DraftLossOutput, draft_loss_sum


def context_visibility(cu_seqlens: Tensor, anchors: Tensor, num_rows: int) -> Tensor:
    """``(N, T)`` bool: packed row ``j`` is context of the block anchored at ``anchors[n]`` (same document, ``j <
    anchor``)."""
    starts = cu_seqlens.to(anchors.device).long()[document_ids_from_cu_seqlens(cu_seqlens)[anchors]]
    j = torch.arange(num_rows, device=anchors.device)
    return (j[None, :] >= starts[:, None]) & (j[None, :] < anchors[:, None])


def sample_anchors(cu_seqlens: Tensor, loss_mask: Tensor, per_doc: int, generator: torch.Generator) -> Tensor:
    """Up to ``per_doc`` anchor rows of each document, drawn without replacement among its rows whose own
    prediction is a draft target (``loss_mask``), sorted; ``(N,)`` int64 packed rows."""
    out = []
    bounds = cu_seqlens.long().tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        rows = torch.nonzero(loss_mask[start:end] > 0).flatten() + start
        if rows.numel():
            pick = torch.randperm(rows.numel(), generator=generator)[:per_doc]
            out.append(rows[pick.to(rows.device)].sort().values)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=loss_mask.device)


def dflash_draft_loss(
    block_logits: Tensor,
    policy_logits: Tensor,
    anchors: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor,
    gamma: float = 7.0,
    loss_type: str = "ce",
    denominators: Optional[Tensor] = None,
) -> DraftLossOutput:
    """The block loss (module docstring).

    Args:
        block_logits: ``(N, B, V)`` the drafter's logits of ``N`` blocks (row 0, the anchor, is not scored).
        policy_logits: ``(T, V)`` the policy's logits of the packed batch (detached here).
        anchors: ``(N,)`` the blocks' anchor rows (packed).
        cu_seqlens: ``(D + 1,)`` document boundaries of the packed batch.
        loss_mask: ``(T,)`` 1 on policy rows whose distribution is a draft target.
        gamma: position ``k`` weighs ``exp(-(k - 1) / gamma)``.
        loss_type: the per-row loss, one of :data:`DRAFT_LOSSES`.
        denominators: ``(B - 1,)`` what each position's sum is divided by (the step's counted rows over every
            microbatch); None: this batch's own.

    Returns:
        :class:`DraftLossOutput` with ``B - 1`` steps (block positions 1 .. B - 1).
    """
    if loss_type not in DRAFT_LOSSES:
        raise ValueError(f"draft loss {loss_type!r} must be one of {DRAFT_LOSSES}")
    N, B, V = block_logits.shape
    T = policy_logits.shape[0]
    if policy_logits.shape != (T, V) or anchors.shape != (N,) or loss_mask.shape != (T,):
        raise ValueError(
            f"block_logits {tuple(block_logits.shape)}, policy_logits {tuple(policy_logits.shape)}, "
            f"anchors {tuple(anchors.shape)} and loss_mask {tuple(loss_mask.shape)} disagree"
        )
    ends = cu_seqlens.to(anchors.device).long()[document_ids_from_cu_seqlens(cu_seqlens)[anchors] + 1]
    rows = anchors[:, None] + torch.arange(B - 1, device=anchors.device)  # (N, B-1): the policy row of position k+1
    inside = rows < ends[:, None]
    rows_c = rows.clamp(max=T - 1)
    with torch.no_grad():
        pl = policy_logits.detach().float()
        counted = inside.float() * loss_mask.float()[rows_c]
    nums, stats = [], []
    for k in range(B - 1):
        target = torch.softmax(pl[rows_c[:, k]], dim=-1)
        nums.append(draft_loss_sum(block_logits[:, k + 1], target, counted[:, k], loss_type))
        with torch.no_grad():
            hit = (block_logits[:, k + 1].argmax(-1) == pl[rows_c[:, k]].argmax(-1)).float() * counted[:, k]
            stats.append(torch.stack([counted[:, k].sum(), hit.sum()]))
    num = torch.stack(nums)
    total, correct = torch.stack(stats).unbind(-1)
    den = total.clamp(min=1) if denominators is None else denominators.to(num)
    per_step = num / den
    weights = torch.tensor([math.exp(-k / gamma) for k in range(B - 1)], dtype=torch.float32, device=num.device)
    return DraftLossOutput(
        loss=(weights * per_step).sum(), per_step_loss=per_step.detach(), correct=correct, total=total, in_vocab=total
    )
