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
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from lightning_codraft.attention.packing import document_ids_from_cu_seqlens
from lightning_codraft.parallel.collectives import reduced
from lightning_codraft.training.draft_loss import DRAFT_LOSSES, DraftLossOutput, draft_loss_sum


def context_visibility(cu_seqlens: Tensor, anchors: Tensor, num_rows: int) -> Tensor:
    """``(N, T)`` bool: packed row ``j`` is context of the block anchored at ``anchors[n]`` (same document, ``j <
    anchor``)."""
    starts = cu_seqlens.to(anchors.device).long()[document_ids_from_cu_seqlens(cu_seqlens)[anchors]]
    j = torch.arange(num_rows, device=anchors.device)
    return (j[None, :] >= starts[:, None]) & (j[None, :] < anchors[:, None])


def sample_anchors(
    cu_seqlens: Tensor,
    loss_mask: Tensor,
    per_doc: int,
    generator: torch.Generator | Callable[[int, int], torch.Generator],
) -> Tensor:
    """Up to ``per_doc`` anchor rows of each document, drawn without replacement among its rows whose own
    prediction is a draft target (``loss_mask``), sorted; ``(N,)`` int64 packed rows.

    ``generator``: one generator for every document, or ``generator(start, end)`` giving document ``[start, end)``'s
    own (the co-training term seeds each from the document's tokens: ``training.dflash_term.draw_anchors``)."""
    out = []
    bounds = cu_seqlens.long().tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        rows = torch.nonzero(loss_mask[start:end] > 0).flatten() + start
        if rows.numel():
            g = generator if isinstance(generator, torch.Generator) else generator(start, end)
            pick = torch.randperm(rows.numel(), generator=g)[:per_doc]
            out.append(rows[pick.to(rows.device)].sort().values)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=loss_mask.device)


def block_position_weights(num_positions: int, gamma: float) -> Tensor:
    """``(B - 1,)`` fp32 DFlash position weights: block position ``k = 1 .. B - 1`` weighs ``exp(-(k - 1) / gamma)``."""
    if gamma <= 0:
        raise ValueError(f"the block loss's position decay gamma={gamma} must be > 0")
    return torch.tensor([math.exp(-k / gamma) for k in range(num_positions)], dtype=torch.float32)


def default_block_gamma(block_size: int) -> float:
    """DFlash's position decay for a block size: 7 for B = 16, 5 for B = 10, 4 for B <= 8 (in between: the nearer)."""
    return 7.0 if block_size >= 13 else 5.0 if block_size >= 9 else 4.0


def block_loss(
    block_logits: Tensor,
    target_logits: Tensor,
    counted: Tensor,
    weights: Tensor,
    loss_type: str = "ce",
    denominators: Optional[Tensor] = None,
    group=None,
) -> DraftLossOutput:
    """The block loss of ``N`` blocks whose targets are already aligned with their proposals.

    Args:
        block_logits: ``(N, K, V)`` the drafter's logits at each block's K proposal rows (DFlash: block rows
            ``1 .. B - 1``).
        target_logits: ``(N, K, V)`` the policy's logits those proposals learn (detached here).
        counted: ``(N, K)`` 1 where the position counts (inside the anchor's document, a draft target row).
        weights: ``(K,)`` each position's weight (:func:`block_position_weights`).
        loss_type: the per-row loss, one of :data:`DRAFT_LOSSES`.
        denominators: ``(K,)`` what each position's sum is divided by (the step's counted rows over every
            microbatch and rank); None: the counted rows of these blocks (over ``group``).
        group: the CP group whose ranks hold the other blocks of the batch: the sums' VALUES are the group's,
            their gradients this rank's part.

    Returns:
        :class:`DraftLossOutput` with K steps.
    """
    if loss_type not in DRAFT_LOSSES:
        raise ValueError(f"draft loss {loss_type!r} must be one of {DRAFT_LOSSES}")
    N, K, V = block_logits.shape
    if target_logits.shape != (N, K, V) or counted.shape != (N, K) or weights.shape != (K,):
        raise ValueError(
            f"block_logits {tuple(block_logits.shape)}, target_logits {tuple(target_logits.shape)}, counted "
            f"{tuple(counted.shape)} and weights {tuple(weights.shape)} disagree (expected (N, K, V), "
            f"(N, K), (K,))"
        )
    nums, stats = [], []
    for k in range(K):
        with torch.no_grad():
            pl = target_logits[:, k].detach().float()
            target = torch.softmax(pl, dim=-1)
            hit = (block_logits[:, k].argmax(-1) == pl.argmax(-1)).float() * counted[:, k]
            stats.append(torch.stack([counted[:, k].sum(), hit.sum()]))
        nums.append(draft_loss_sum(block_logits[:, k], target, counted[:, k].float(), loss_type))
    local = torch.stack(nums)
    packed = reduced(torch.cat([local.detach()[:, None], torch.stack(stats).to(local)], 1), group)
    num = local + (packed[:, 0] - local.detach())  # the group's value, this rank's gradient
    total, correct = packed[:, 1], packed[:, 2]
    den = total.clamp(min=1) if denominators is None else denominators.to(num)
    per_step = num / den
    return DraftLossOutput(
        loss=(weights.to(per_step) * per_step).sum(),
        per_step_loss=per_step.detach(),
        correct=correct,
        total=total,
        in_vocab=total,
    )


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
    """The block loss (module docstring) on a whole packed batch (one process).

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
    N, B, V = block_logits.shape
    T = policy_logits.shape[0]
    if policy_logits.shape != (T, V) or anchors.shape != (N,) or loss_mask.shape != (T,):
        raise ValueError(
            f"block_logits {tuple(block_logits.shape)}, policy_logits {tuple(policy_logits.shape)}, "
            f"anchors {tuple(anchors.shape)} and loss_mask {tuple(loss_mask.shape)} disagree"
        )
    ends = cu_seqlens.to(anchors.device).long()[document_ids_from_cu_seqlens(cu_seqlens)[anchors] + 1]
    rows = anchors[:, None] + torch.arange(B - 1, device=anchors.device)  # (N, B-1): the policy row of position k+1
    rows_c = rows.clamp(max=T - 1)
    counted = (rows < ends[:, None]).float() * loss_mask.float()[rows_c]
    weights = block_position_weights(B - 1, gamma).to(block_logits.device)
    return block_loss(block_logits[:, 1:], policy_logits.detach()[rows_c], counted, weights, loss_type, denominators)
