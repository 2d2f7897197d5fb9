"""The EAGLE-3 training-time-test (TTT) draft loss: soft cross-entropy against the detached policy.

Row ``i`` of unroll step ``k`` (``k = 0 .. K-1``) predicts the token after ``x_{i+1+k}``, which is what the
policy's logits at row ``i + 1 + k`` predict. Its target is therefore the policy distribution at row
``i + 1 + k`` restricted to the draft vocabulary (a softmax over the policy logits of the draft's target ids),
and it counts only when

- row ``i + 1 + k`` lies inside row ``i``'s document,
- ``loss_mask[i + 1 + k]`` is set (the mask is indexed by the *policy* row, like every column of the
  next-token-aligned RL batch), and
- the policy's top-1 token at that row is in the draft vocabulary (``t2d[argmax]``; SpecForge's position mask).

Each step's loss is divided by its SCORED rows (the first two conditions), and its top-1 accuracy counts every
scored row: a row whose policy top-1 lies outside the draft vocabulary is a miss (greedy verification rejects it),
so the accuracy and the acceptance length it implies are what verification measures, not figures conditional on
the top-1 being drafted (``in_vocab`` counts those rows; ``1 - in_vocab / total`` is the out-of-vocabulary share).
SpecForge divides its loss by all positions and its accuracy by the loss-mask rows, the same convention up to
padding. Under microbatching the denominators are the whole step's (``denominators``), known before the forward.

Step ``k`` is weighted ``decay ** k`` (0.8 in EAGLE-3). Under context parallelism every tensor is this rank's
zigzag shard; the shift ``i -> i + 1 + k`` crosses shard boundaries through
``lightning_codraft.attention.shift_left`` and the sums and counts are all-reduced over ``group``, so the loss
value is the same on every rank and equal to the single-process one.

Gradient convention under CP: the returned ``loss`` carries, on each rank, the gradient of the global loss
with respect to that rank's own ``step_logits`` only. The global gradient of a parameter replicated over the
CP group is therefore the SUM over the group of the per-rank gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_codraft.attention.packing import validate_cu_seqlens
from lightning_codraft.attention.zigzag import shift_left
from lightning_codraft.parallel.collectives import group_size, reduced
from lightning_codraft.training.config import DRAFT_LOSSES as _LOSS_NAMES


@dataclass
class DraftLossOutput:
    """Result of :func:`ttt_draft_loss`.

    Attributes:
        loss: scalar, ``sum_k decay**k * per_step_loss[k]``, differentiable in the step logits.
        per_step_loss: ``(K,)`` detached soft cross-entropy of each unroll step summed over its loss rows and
            divided by the step's scored rows (this batch's, or ``denominators``).
        correct: ``(K,)`` fp32 number of scored rows whose draft top-1 (mapped to a target id) equals the
            policy top-1, summed over ``group``.
        total: ``(K,)`` fp32 number of scored rows of each step (out-of-vocabulary top-1 included), over ``group``.
        in_vocab: ``(K,)`` fp32 scored rows whose policy top-1 is in the draft vocabulary (the loss rows).
        extras: a drafter's own detached scalars (``draft/<name>``), each this batch's share of the step's value
            over the CP group (summed over dp and microbatches like the loss), e.g. DSpark's probabilistic
            acceptance.
    """

    loss: Tensor
    per_step_loss: Tensor
    correct: Tensor
    total: Tensor
    in_vocab: Optional[Tensor] = None
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def accuracy(self) -> Tensor:
        """``(K,)`` per-step top-1 accuracy (0 where a step counted no row)."""
        return self.correct / self.total.clamp(min=1)


class _SoftCrossEntropySum(torch.autograd.Function):
    """``sum_i w_i (logsumexp(z_i) - <p_i, z_i>)`` with the gradient ``w_i (softmax(z_i) - p_i)`` in one pass."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, target, weight, lse)
        return (weight * (lse - (target * z).sum(-1))).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, target, weight, lse = ctx.saved_tensors
        dz = (logits.float() - lse[:, None]).exp_().sub_(target).mul_((grad * weight)[:, None])
        return dz.to(logits.dtype), None, None


def soft_cross_entropy_sum(logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:
    """Weighted sum over rows of the soft cross-entropy ``-sum_v p_v log softmax(z)_v``, computed in fp32.

    Uses ``-sum_v p_v log q_v = logsumexp(z) - <p, z>``, exact when each target row sums to 1 (a row of weight 0
    may hold anything finite); the backward is ``w (softmax(z) - p)`` in place, without the ``(T, V)``
    log-probabilities a ``log_softmax`` formulation keeps.

    Args:
        logits: ``(T, V)`` draft logits ``z`` (any float dtype; the gradient comes back in it).
        target: ``(T, V)`` fp32 target probabilities ``p`` (no gradient).
        weight: ``(T,)`` fp32 row weights ``w`` (no gradient).

    Returns:
        Scalar fp32.
    """
    return _SoftCrossEntropySum.apply(logits, target.detach(), weight.detach())


DRAFT_LOSSES = _LOSS_NAMES
"""Per-row draft losses against the policy distribution ``p`` (over the draft vocabulary) with ``q = softmax(z)``
and the overlap ``alpha = sum_v min(p_v, q_v)``, the probability that rejection sampling accepts the draft's proposal:

- ``ce``: soft cross-entropy ``-sum_v p_v log q_v`` (EAGLE-3; a proxy: KL's optimum is acceptance's, but a small
  draft's KL-optimal fit is not its acceptance-optimal one);
- ``tv``: total variation ``1 - alpha`` (acceptance itself; its gradient vanishes where the overlap is small);
- ``lk_alpha``: ``-log alpha`` (LK^alpha, Samarin et al. 2026): TV's gradient scaled by ``1 / alpha``, so it trains
  from a poor start;
- ``lk_lambda``: ``lam * CE + (1 - lam) * TV`` with ``lam = exp(-eta * alpha)`` (detached, eta = 3): cross-entropy
  where the overlap is small, TV as the draft aligns (LK^lambda)."""

LK_ETA = 3.0
"""eta of the ``lk_lambda`` blend (the paper's best setting)."""


class _OverlapLossSum(torch.autograd.Function):
    """``sum_i w_i loss(p_i, softmax(z_i))`` for the overlap losses of :data:`DRAFT_LOSSES`, gradient in closed form.

    With ``m_v = [q_v < p_v]`` and ``S = sum_v m_v q_v``: ``d alpha / d z = q * (m - S)``, so ``tv``'s gradient is
    ``q (S - m)``, ``lk_alpha``'s ``q (S - m) / alpha`` and ``lk_lambda``'s ``lam (q - p) + (1 - lam) q (S - m)``.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, weight: Tensor, kind: str) -> Tensor:
        z = logits.float()
        q = torch.softmax(z, dim=-1)
        alpha = torch.minimum(q, target).sum(-1)
        if kind == "tv":
            per_row = 1 - alpha
        elif kind == "lk_alpha":
            per_row = -alpha.clamp(min=1e-6).log()
        else:
            lam = torch.exp(-LK_ETA * alpha)
            per_row = lam * (torch.logsumexp(z, -1) - (target * z).sum(-1)) + (1 - lam) * (1 - alpha)
        ctx.kind = kind
        ctx.save_for_backward(logits, target, weight)
        return (weight * per_row).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, target, weight = ctx.saved_tensors
        q = torch.softmax(logits.float(), dim=-1)
        m = (q < target).float()
        alpha = torch.minimum(q, target).sum(-1, keepdim=True)
        dz = q * ((m * q).sum(-1, keepdim=True) - m)  # d(1 - alpha) / dz
        if ctx.kind == "lk_alpha":
            dz = dz / alpha.clamp(min=1e-6)
        elif ctx.kind == "lk_lambda":
            lam = torch.exp(-LK_ETA * alpha)
            dz = lam * (q - target) + (1 - lam) * dz
        return (dz * (grad * weight)[:, None]).to(logits.dtype), None, None, None


def draft_loss_sum(logits: Tensor, target: Tensor, weight: Tensor, kind: str = "ce") -> Tensor:
    """Weighted sum over rows of the per-row draft loss ``kind`` (:data:`DRAFT_LOSSES`), in fp32.

    Args:
        logits: ``(T, V)`` draft logits ``z``.
        target: ``(T, V)`` fp32 target probabilities ``p`` (rows of weight 0 may hold anything finite).
        weight: ``(T,)`` fp32 row weights.
        kind: one of :data:`DRAFT_LOSSES`.

    Returns:
        Scalar fp32.
    """
    if kind == "ce":
        return soft_cross_entropy_sum(logits, target, weight)
    if kind not in DRAFT_LOSSES:
        raise ValueError(f"draft loss {kind!r} must be one of {DRAFT_LOSSES}")
    return _OverlapLossSum.apply(logits, target.detach(), weight.detach(), kind)


def ttt_draft_loss(
    step_logits: Sequence[Tensor],
    policy_logits: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor,
    d2t: Tensor,
    t2d: Tensor,
    decay: float = 0.8,
    group=None,
    denominators: Optional[Tensor] = None,
    loss_type: str = "ce",
    step_weights: Optional[Tensor] = None,
) -> DraftLossOutput:
    """TTT draft loss of K unroll steps.

    Args:
        step_logits: K tensors ``(T, Vd)``, the draft logits of each unroll step (row i of step k was fed
            the token ``x_{i+1+k}``), this CP rank's tokens.
        policy_logits: ``(T, V)`` policy logits of the same rows; detached here (no gradient reaches the
            policy through the draft loss).
        cu_seqlens: ``(N + 1,)`` GLOBAL int32 prefix sum of document lengths.
        loss_mask: ``(T,)`` bool / float, 1 on policy rows whose distribution is a draft target (e.g. the
            RL batch's ``draft_mask``).
        d2t: ``(Vd,)`` int64, ``target_id = draft_id + d2t[draft_id]``.
        t2d: ``(V,)`` bool, target ids present in the draft vocabulary.
        decay: weight ratio between consecutive steps; step k weighs ``decay ** k``.
        group: CP process group (None: the tensors hold the whole batch).
        denominators: ``(K,)`` what each step's summed loss is divided by (the whole step's scored rows over every
            microbatch and dp rank, ``RLBatch.norm.draft``): the result is then this batch's share; None: this
            batch's own scored rows.
        loss_type: the per-row loss, one of :data:`DRAFT_LOSSES`.
        step_weights: ``(K,)`` weight of each unroll step instead of ``decay ** k`` (e.g. the live probability that
            the engine verifies position k).

    Returns:
        :class:`DraftLossOutput`.
    """
    num_steps = len(step_logits)
    T, Vd = _check_draft_loss_inputs(step_logits, policy_logits, loss_mask, d2t, t2d, loss_type)
    world = group_size(group)
    validate_cu_seqlens(cu_seqlens, total_tokens=T * world)
    device = policy_logits.device
    target_ids = torch.arange(Vd, device=device) + d2t.to(device)
    target_p, side = _draft_targets(policy_logits, loss_mask, t2d, target_ids, with_targets=world > 1)
    nums, stats = [], []
    for k in range(num_steps):
        s = k + 1
        logits = step_logits[k]
        with torch.no_grad():
            shifted = shift_left(side, cu_seqlens, s, group=group, fill=0)
            row_scored, mask, target_top = shifted[:, -3], shifted[:, -2], shifted[:, -1].round().long()
        if world == 1:
            # rows i and i + s of the packed batch: views, no shifted copy; a row whose i + s leaves its
            # document has mask 0, and the last s rows have no source row at all
            nums.append(draft_loss_sum(logits[: T - s], target_p[s:], mask[: T - s], loss_type))
        else:
            nums.append(draft_loss_sum(logits, shifted[:, :Vd], mask, loss_type))
        with torch.no_grad():
            hit = (target_ids[logits.max(-1).indices] == target_top).float() * row_scored
            stats.append(torch.stack([row_scored.sum(), hit.sum(), mask.sum()]))
    local_num = torch.stack(nums)
    packed = torch.cat([local_num.detach()[:, None], torch.stack(stats)], dim=1)  # (K, 4): num, total, correct, in
    packed = reduced(packed, group)
    total, correct, in_vocab = packed[:, 1], packed[:, 2], packed[:, 3]
    # value of the global sum, gradient of the local part only (see the module docstring)
    per_step = _step_losses(local_num + (packed[:, 0] - local_num.detach()), total, denominators)
    weights = _step_weights(num_steps, decay, step_weights, device)
    return DraftLossOutput(
        loss=(weights * per_step).sum(),
        per_step_loss=per_step.detach(),
        correct=correct,
        total=total,
        in_vocab=in_vocab,
    )


def _check_draft_loss_inputs(step_logits, policy_logits, loss_mask, d2t, t2d, loss_type) -> tuple[int, int]:
    """:func:`ttt_draft_loss`'s shape checks (``ValueError`` naming the tensor); returns ``(T, Vd)``."""
    if loss_type not in DRAFT_LOSSES:
        raise ValueError(f"draft loss {loss_type!r} must be one of {DRAFT_LOSSES}")
    if len(step_logits) < 1:
        raise ValueError("ttt_draft_loss needs at least one unroll step (K >= 1), got an empty step_logits")
    if policy_logits.dim() != 2:
        raise ValueError(f"policy_logits must be (T, V), got shape {tuple(policy_logits.shape)}")
    T, V = policy_logits.shape
    Vd = int(d2t.shape[0])
    for k, lg in enumerate(step_logits):
        if tuple(lg.shape) != (T, Vd):
            raise ValueError(
                f"step_logits[{k}] has shape {tuple(lg.shape)}, expected (T, Vd)=({T}, {Vd}) "
                "matching policy_logits rows and len(d2t)"
            )
    if tuple(t2d.shape) != (V,):
        raise ValueError(f"t2d has shape {tuple(t2d.shape)}, expected ({V},) = the policy vocabulary")
    if tuple(loss_mask.shape) != (T,):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected ({T},)")
    return T, Vd


@torch.no_grad()
def _draft_targets(
    policy_logits: Tensor, loss_mask: Tensor, t2d: Tensor, target_ids: Tensor, with_targets: bool
) -> tuple[Tensor, Tensor]:
    """The policy's targets over the draft vocabulary and the per-row side columns the unroll shifts.

    Returns:
        ``(target_p, side)``: ``(T, Vd)`` fp32 softmax of the policy logits at the draft's target ids (a row's
        softmax does not depend on where it is shifted to: once), and ``(T, 3)`` ``[row scored | loss row |
        policy top-1 id]`` (``(T, Vd + 3)`` with the targets in front when ``with_targets``: under CP they shift
        with it, one halo exchange).
    """
    device = policy_logits.device
    pl = policy_logits.detach().float()
    top = pl.max(-1).indices  # the first maximal index, as argmax (and faster on CPU: design/measurements.md)
    scored = loss_mask.to(device=device, dtype=torch.float32)
    counted = scored * t2d.to(device)[top].float()
    target_p = torch.softmax(pl.index_select(1, target_ids), dim=-1)
    side = torch.stack([scored, counted, top.float()], dim=1)
    return target_p, torch.cat([target_p, side], dim=1) if with_targets else side


def _step_losses(global_num: Tensor, total: Tensor, denominators: Optional[Tensor]) -> Tensor:
    """``(K,)`` each step's summed loss over its denominator (the step's scored rows, or ``denominators``)."""
    if denominators is None:
        denominators = total.clamp(min=1)
    elif tuple(denominators.shape) != tuple(global_num.shape):
        raise ValueError(
            f"denominators has shape {tuple(denominators.shape)}, expected ({global_num.shape[0]},), one per step"
        )
    return global_num / denominators.to(global_num)


def _step_weights(num_steps: int, decay: float, step_weights: Optional[Tensor], device) -> Tensor:
    """``(K,)`` fp32 weight of each unroll step: ``step_weights`` when given, else ``decay ** k``."""
    if step_weights is None:
        return decay ** torch.arange(num_steps, device=device, dtype=torch.float32)
    if tuple(step_weights.shape) != (num_steps,):
        raise ValueError(f"step_weights has shape {tuple(step_weights.shape)}, expected ({num_steps},)")
    return step_weights.to(device=device, dtype=torch.float32)
