"""The EAGLE-3 training-time-test (TTT) draft loss: soft cross-entropy against the detached policy.

Row ``i`` of unroll step ``k`` (``k = 0 .. K-1``) predicts the token after ``x_{i+1+k}``, which is what the
policy's logits at row ``i + 1 + k`` predict. Its target is therefore the policy distribution at row
``i + 1 + k`` restricted to the draft vocabulary (a softmax over the policy logits of the draft's target ids),
and it counts only when

- row ``i + 1 + k`` lies inside row ``i``'s document,
- ``loss_mask[i + 1 + k]`` is set (the mask is indexed by the *policy* row, like every column of the
  next-token-aligned RL batch), and
- the policy's top-1 token at that row is in the draft vocabulary (``t2d[argmax]``).

Step ``k`` is weighted ``decay ** k`` (0.8 in EAGLE-3). Under context parallelism every tensor is this rank's
zigzag shard; the shift ``i -> i + 1 + k`` crosses shard boundaries through
``lightning_codraft.attention.shift_left`` and the sums and counts are all-reduced over ``group``, so the loss
value is the same on every rank and equal to the single-process one.

Gradient convention under CP: the returned ``loss`` carries, on each rank, the gradient of the global loss
with respect to that rank's own ``step_logits`` only. The global gradient of a parameter replicated over the
CP group is therefore the SUM over the group of the per-rank gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_codraft.attention.packing import validate_cu_seqlens
from lightning_codraft.attention.zigzag import shift_left


@dataclass
class DraftLossOutput:
    """Result of :func:`ttt_draft_loss`.

    Attributes:
        loss: scalar, ``sum_k decay**k * per_step_loss[k]``, differentiable in the step logits.
        per_step_loss: ``(K,)`` detached mean soft cross-entropy of each unroll step over its counted rows.
        correct: ``(K,)`` fp32 number of counted rows whose draft top-1 (mapped to a target id) equals the
            policy top-1, summed over ``group``.
        total: ``(K,)`` fp32 number of counted rows of each step, summed over ``group``.
    """

    loss: Tensor
    per_step_loss: Tensor
    correct: Tensor
    total: Tensor

    @property
    def accuracy(self) -> Tensor:
        """``(K,)`` per-step top-1 accuracy (0 where a step counted no row)."""
        return self.correct / self.total.clamp(min=1)


def _group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def ttt_draft_loss(
    step_logits: Sequence[Tensor],
    policy_logits: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor,
    d2t: Tensor,
    t2d: Tensor,
    decay: float = 0.8,
    group=None,
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

    Returns:
        :class:`DraftLossOutput`.
    """
    num_steps = len(step_logits)
    if num_steps < 1:
        raise ValueError("ttt_draft_loss needs at least one unroll step (K >= 1), got an empty step_logits")
    if policy_logits.dim() != 2:
        raise ValueError(f"policy_logits must be (T, V), got shape {tuple(policy_logits.shape)}")
    T, V = policy_logits.shape
    Vd = int(d2t.shape[0])
    for k, lg in enumerate(step_logits):
        if tuple(lg.shape) != (T, Vd):
            raise ValueError(f"step_logits[{k}] has shape {tuple(lg.shape)}, expected (T, Vd)=({T}, {Vd}) "
                             "matching policy_logits rows and len(d2t)")
    if tuple(t2d.shape) != (V,):
        raise ValueError(f"t2d has shape {tuple(t2d.shape)}, expected ({V},) = the policy vocabulary")
    if tuple(loss_mask.shape) != (T,):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected ({T},)")
    world = _group_size(group)
    validate_cu_seqlens(cu_seqlens, total_tokens=T * world)

    device = policy_logits.device
    target_ids = torch.arange(Vd, device=device) + d2t.to(device)
    with torch.no_grad():
        pl = policy_logits.detach().float()
        top = pl.argmax(-1)
        counted = loss_mask.to(device=device, dtype=torch.float32) * t2d.to(device)[top].float()
        # one tensor per row: [restricted logits (Vd) | counted | policy top-1 id], shifted together
        rows = torch.cat([pl[:, target_ids], counted[:, None], top[:, None].float()], dim=1)

    nums, stats = [], []
    shifted = rows
    for k in range(num_steps):
        with torch.no_grad():
            # shifting by one per step composes to a shift of 1 + k (fill 0 propagates), and the CP halo
            # exchange then never reaches further than one row into the next zigzag chunk
            shifted = shift_left(shifted, cu_seqlens, 1, group=group, fill=0)
            target_p = torch.softmax(shifted[:, :Vd], dim=-1)
            mask = shifted[:, Vd]
            target_top = shifted[:, Vd + 1].round().long()
        logp = F.log_softmax(step_logits[k].float(), dim=-1)
        ce = -(target_p * logp).sum(-1)
        nums.append((ce * mask).sum())
        with torch.no_grad():
            hit = (target_ids[logp.argmax(-1)] == target_top).float() * mask
            stats.append(torch.stack([mask.sum(), hit.sum()]))

    local_num = torch.stack(nums)
    packed = torch.cat([local_num.detach()[:, None], torch.stack(stats)], dim=1)  # (K, 3): num, total, correct
    if world > 1:
        dist.all_reduce(packed, group=group)
    total, correct = packed[:, 1], packed[:, 2]
    # value of the global sum, gradient of the local part only (see the module docstring)
    global_num = local_num + (packed[:, 0] - local_num.detach())
    per_step = global_num / total.clamp(min=1)
    weights = decay ** torch.arange(num_steps, device=device, dtype=torch.float32)
    return DraftLossOutput(loss=(weights * per_step).sum(), per_step_loss=per_step.detach(),
                           correct=correct, total=total)
