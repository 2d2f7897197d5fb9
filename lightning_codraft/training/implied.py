"""Implied acceptance: what a draft would have achieved when decoding the rollouts it is scored on.

A step's rollouts are already in its training batch, with the policy's taps computed by the training forward. One
forward of a draft on those taps (its K training-time-test steps) therefore tells, for every row, whether its
proposals would have been accepted — without decoding again (docs/cotraining.md). Two pieces:

**Row acceptance** (:func:`row_acceptance`). Row ``i`` of unroll step ``k`` proposes the token ``x = x_{i+2+k}``
(the rollout's token after row ``i + 1 + k``) given that the proposals of steps ``< k`` were accepted, which makes
them the rollout's own tokens, exactly what TTT feeds. Conditional on the rollout's tokens, the probability that the
engine accepts that proposal is

- ``T = 0`` (greedy): ``1`` if the draft's top-1 (mapped to a target id) is ``x``, else ``0``;
- ``T > 0`` (rejection sampling, the classic rule and vLLM's): ``min(1, q(x) / p(x))``: the draft proposes ``x``
  with probability ``q(x)`` and keeps it with ``min(1, p(x) / q(x))``, while ``x`` itself was emitted with
  probability ``p(x)``. ``q`` is the draft's ``softmax(z / T)`` (0 outside its vocabulary), ``p(x)`` the rollout's
  own log-probability (the engine's filtered distribution).

The steps' events are independent given the tokens (fresh proposals and uniforms per step), so the chain of a round
is their product. Gumbel-coupled verification (the embedded engine's default) accepts slightly less than
rejection sampling (docs/design/sampling.md: 0.6-3% shorter acceptance); for it this is an estimate.

**Round walk** (:func:`walk_rounds`). The engine does not start a round at every row: the prefill emits the first
completion token, then each round starts where the last one ended. :func:`walk_rounds` replays that walk over each
completion in expectation (exactly, for 0/1 acceptances): a round at row ``i`` with ``r`` tokens left to emit accepts
``a`` proposals with the chain's probability, emits ``min(a + 1, r)`` tokens and counts ``min(a + 1, r) - 1`` of them
as accepted (what the embedded engine records), and the next round starts that many rows later. Acceptance length
= ``1 + accepted / rounds``, the figure the engine reports.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_codraft.attention.zigzag import shift_left, zigzag_unshard
from lightning_codraft.parallel.collectives import reduced


@dataclass
class RoundCounts:
    """Expected verification rounds of a batch's completions and what they accept (summable across batches).

    Attributes:
        rounds: expected drafting rounds (one policy forward each).
        accepted: expected accepted (and emitted) proposals.
        per_position: ``(K,)`` expected rounds that accepted proposal ``j`` (then also every ``j' < j``).
    """

    rounds: float
    accepted: float
    per_position: list[float]

    @property
    def acceptance_length(self) -> float:
        """Tokens per round, ``1 + accepted / rounds`` (NaN without a round)."""
        return 1.0 + self.accepted / self.rounds if self.rounds > 0 else float("nan")

    @property
    def position_rates(self) -> list[float]:
        """``(K,)`` acceptance rate of each draft position given the earlier ones were accepted."""
        prev, out = self.rounds, []
        for n in self.per_position:
            out.append(n / prev if prev > 0 else float("nan"))
            prev = n
        return out

    def as_tensor(self) -> Tensor:
        """``(K + 2,)`` float64 ``[rounds, accepted, per_position...]`` (for all-reduces and records)."""
        return torch.tensor([self.rounds, self.accepted, *self.per_position], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: Tensor) -> RoundCounts:
        v = t.double().tolist()
        return cls(v[0], v[1], v[2:])


def target_to_draft(d2t: Tensor, vocab_size: int) -> Tensor:
    """``(V,)`` int64: the draft id of each target id, -1 where the draft vocabulary lacks it."""
    Vd = d2t.numel()
    inv = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    inv[torch.arange(Vd, device=d2t.device) + d2t.long()] = torch.arange(Vd, device=d2t.device)
    return inv


@torch.no_grad()
def row_acceptance(
    step_logits: Sequence[Tensor],
    target_ids: Tensor,
    target_logprobs: Optional[Tensor],
    cu_seqlens: Tensor,
    d2t: Tensor,
    vocab_size: int,
    temperature: float,
    group=None,
) -> Tensor:
    """Per row and unroll step, the probability that the engine accepts the draft's proposal (module docstring).

    Args:
        step_logits: K tensors ``(T, Vd)``: the draft logits of each unroll step on this rank's rows.
        target_ids: ``(T,)`` the rollout's token after each row (``RLBatch.target_ids``).
        target_logprobs: ``(T,)`` log-probability of ``target_ids`` under the rollouts' sampling distribution
            (``RLBatch.old_logprobs``); unused at ``temperature == 0``.
        cu_seqlens: ``(N + 1,)`` GLOBAL int32 prefix sum of document lengths.
        d2t: ``(Vd,)`` int64, ``target_id = draft_id + d2t[draft_id]``.
        vocab_size: V, the policy's vocabulary.
        temperature: the rollouts' sampling temperature (0: greedy).
        group: CP group (the tensors are this rank's zigzag shard), or None.

    Returns:
        ``(K, T)`` float32 in ``[0, 1]``; 0 where row ``i + 1 + k`` lies outside row ``i``'s document.
    """
    if temperature > 0 and target_logprobs is None:
        raise ValueError("row_acceptance at temperature > 0 needs the rollouts' log-probabilities of their tokens")
    T = target_ids.shape[0]
    device = step_logits[0].device
    d2t = d2t.to(device)
    draft_targets = torch.arange(d2t.numel(), device=device) + d2t.long()
    inv = target_to_draft(d2t, vocab_size)
    lp = target_logprobs if target_logprobs is not None else torch.zeros(T, device=device)
    side = torch.stack(
        [target_ids.to(device).double(), lp.to(device).double(), torch.ones(T, device=device, dtype=torch.float64)], 1
    )
    out = []
    for k, z in enumerate(step_logits):
        shifted = shift_left(side, cu_seqlens, k + 1, group=group, fill=0)
        x, lp_x, inside = shifted[:, 0].round().long(), shifted[:, 1].float(), shifted[:, 2].float()
        out.append(proposal_acceptance(z, x, lp_x, temperature, draft_targets, inv) * inside)
    return torch.stack(out)


def proposal_acceptance(
    z: Tensor, x: Tensor, lp_x: Tensor, temperature: float, draft_targets: Tensor, inv: Tensor
) -> Tensor:
    """``(R,)`` the probability that the engine accepts a proposal drawn from draft logits ``z (R, Vd)`` when the
    rollout's token is ``x (R,)`` with log-probability ``lp_x`` (module docstring): greedy, ``[top-1 == x]``; else
    ``min(1, q(x) / p(x))``. ``draft_targets (Vd,)`` maps draft ids to target ids, ``inv (V,)`` back (-1: none)."""
    if temperature <= 0:
        return (draft_targets[z.max(-1).indices] == x).float()
    d = inv[x]
    lq = torch.log_softmax(z.float() / temperature, dim=-1).gather(1, d.clamp(min=0)[:, None])[:, 0]
    return torch.where(d >= 0, (lq - lp_x).clamp(max=0).exp(), torch.zeros_like(lq))


@torch.no_grad()
def block_row_acceptance(
    blocks: Iterable[tuple[Tensor, Tensor]], num_positions: int, batch, temperature: float, group=None
) -> Tensor:
    """Per row and block position, the probability that the engine accepts a block drafter's proposal.

    A round that starts at row ``i`` (the rollout has emitted ``x_{i+1}``, the pending token) runs the block
    anchored at row ``a = i + 1``; its proposal ``k = 0 .. K - 1`` is ``x_{a+k+1}``, the target of row ``a + k``. The
    block's positions draw independently given the context, so, as for EAGLE-3's steps, a round's chain is the
    product of :func:`proposal_acceptance` over its positions.

    Args:
        blocks: ``(anchors (N,), logits (N, K, V))`` pairs: local rows of ``batch`` (this rank's shard) and the
            drafter's proposal logits of the blocks anchored there (consumed one pair at a time; no communication).
        num_positions: K, the proposals of a block.
        batch: the microbatch (``target_ids``, ``old_logprobs``, ``cu_seqlens``).
        temperature: the rollouts' sampling temperature (0: greedy).
        group: the CP group, or None.

    Returns:
        ``(K, T)`` float32, indexed by the round's row ``i = a - 1`` (0 where no block was given).
    """
    T, device = batch.target_ids.shape[0], batch.target_ids.device
    side = torch.stack(
        [batch.target_ids.double(), batch.old_logprobs.double(), torch.ones(T, dtype=torch.float64, device=device)], 1
    )
    shifted = [shift_left(side, batch.cu_seqlens, k, group=group, fill=0) for k in range(num_positions)]
    at_anchor = torch.zeros(T, num_positions, dtype=torch.float32, device=device)
    for anchors, logits in blocks:
        ids = torch.arange(logits.shape[-1], device=device)
        for k in range(num_positions):
            x, lp_x, inside = shifted[k][anchors].unbind(1)
            a = proposal_acceptance(logits[:, k], x.round().long(), lp_x.float(), temperature, ids, ids)
            at_anchor[anchors, k] = a * inside.float()
    return shift_left(at_anchor, batch.cu_seqlens, 1, group=group, fill=0).T.contiguous()


def _whole(rows: Tensor, cu_seqlens: Tensor, group) -> Tensor:
    """``(T_local, C)`` zigzag shard -> ``(T, C)`` whole batch on every rank of ``group`` (None: unchanged)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, rows.contiguous(), group=group)
    return zigzag_unshard(parts, cu_seqlens, len(parts))


def walk_rounds(accept: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, group=None) -> RoundCounts:
    """The engine's verification rounds over every completion of a batch, in expectation (module docstring).

    Args:
        accept: ``(K, T)`` :func:`row_acceptance` of this rank's rows.
        loss_mask: ``(T,)`` 1 where the row's target is a completion token (``RLBatch.loss_mask``; contiguous per
            document: the first such row is the prompt's last, whose token the prefill emits).
        cu_seqlens: ``(N + 1,)`` GLOBAL prefix sum of document lengths.
        group: CP group (the rows are this rank's zigzag shard; every rank returns the whole batch's counts).

    Returns:
        :class:`RoundCounts` of this batch (this data-parallel replica's).
    """
    K = accept.shape[0]
    rows = _whole(torch.cat([accept.T.double(), loss_mask.double()[:, None]], 1), cu_seqlens, group)
    acc_rows, mask = rows[:, :K], rows[:, K] > 0
    starts, lengths = [], []
    for d in range(cu_seqlens.numel() - 1):
        lo, hi = int(cu_seqlens[d]), int(cu_seqlens[d + 1])
        idx = torch.nonzero(mask[lo:hi]).flatten()
        if idx.numel() > 1:  # rounds follow the prefill's token: a completion of one token has none
            starts.append(lo + int(idx[0]))
            lengths.append(int(idx[-1] - idx[0]))  # tokens left to emit after the prefill's
    per_position = torch.zeros(K, dtype=torch.float64)
    if not starts:
        return RoundCounts(0.0, 0.0, per_position.tolist())
    n = torch.tensor(lengths)
    N, L = len(starts), int(n.max())
    offsets = torch.arange(L)
    src = (torch.tensor(starts)[:, None] + offsets).clamp(max=rows.shape[0] - 1)
    A = acc_rows[src] * (offsets < n[:, None])[..., None]  # (N, L, K)
    chain = torch.cat([torch.ones(N, L, 1, dtype=torch.float64), torch.cumprod(A, dim=2)], 2)  # c_0 .. c_K
    exact = torch.cat([chain[..., :-1] - chain[..., 1:], chain[..., -1:]], 2)  # P(a = m), m = 0..K
    s = torch.zeros(N, L + K + 2, dtype=torch.float64)
    s[:, 0] = 1.0
    rounds = accepted = 0.0
    m = torch.arange(K + 1)
    for p in range(L):
        left = (n - p).clamp(min=0)  # (N,) tokens left to emit
        sp = s[:, p] * (left > 0)
        if not bool(sp.any()):
            continue
        emitted = torch.minimum(m[None, :] + 1, left[:, None])  # (N, K + 1)
        w = sp[:, None] * exact[:, p]
        rounds += float(sp.sum())
        accepted += float((w * (emitted - 1)).sum())
        s.scatter_add_(1, p + emitted, w)
        usable = torch.arange(1, K + 1)[None, :] <= (left[:, None] - 1)  # proposal j+1 can be emitted
        per_position += (sp[:, None] * chain[:, p, 1:] * usable).sum(0)
    return RoundCounts(rounds, accepted, per_position.tolist())


def implied_counts(
    step_logits: Sequence[Tensor], batch, d2t: Tensor, vocab_size: int, temperature: float, cp_group=None, dp_group=None
) -> Tensor:
    """``(K + 2,)`` float64 :class:`RoundCounts` of one microbatch (:meth:`RoundCounts.as_tensor`), summed over the
    data-parallel replicas: the rounds the engine would run on these rollouts with the draft of ``step_logits``.

    Args:
        step_logits: K tensors ``(T, Vd)``, the draft's unroll steps on this rank's rows of ``batch``.
        batch: this rank's :class:`~lightning_codraft.batch.RLBatch` microbatch (its CP shard under CP).
        d2t: the draft's ``(Vd,)`` id offsets; vocab_size: the policy's V; temperature: the rollouts' temperature.
        cp_group, dp_group: the CP and data-parallel groups, or None.
    """
    accept = row_acceptance(
        step_logits,
        batch.target_ids,
        batch.old_logprobs,
        batch.cu_seqlens,
        d2t,
        vocab_size,
        temperature,
        group=cp_group,
    )
    counts = walk_rounds(accept, batch.loss_mask, batch.cu_seqlens, group=cp_group).as_tensor()
    return reduced(counts, dp_group)


class ReferenceDraft:
    """A frozen copy of a draft, scored beside the live one (the A/B): held outside the module tree, so it is in no
    checkpoint, no optimizer, no FSDP sharding and no pipeline pruning; it follows the taps' device and dtype.

    Args:
        draft: the draft to copy (whole, unsharded: e.g. before the strategy wraps the module).
    """

    def __init__(self, draft: torch.nn.Module):
        self.module = copy.deepcopy(draft).requires_grad_(False).eval()

    def on(self, like: Tensor) -> torch.dtype:
        """Move the copy to ``like``'s device; returns its own dtype (fp32 under bf16-mixed: an exact reference)."""
        if next(self.module.parameters()).device != like.device:
            self.module.to(like.device)
        return next(self.module.parameters()).dtype

    @torch.no_grad()
    def step_logits(self, taps: Sequence[Tensor], token_embeds: Sequence[Tensor], batch, cp_group=None) -> list[Tensor]:
        """K tensors ``(T, Vd)``: the reference's unroll steps on detached policy features (no gradient)."""
        dtype = self.on(taps[0])
        steps = self.module.ttt_forward(
            [t.to(dtype) for t in taps],
            [e.to(dtype) for e in token_embeds],
            batch.cu_seqlens,
            batch.position_ids,
            cp_group=cp_group,
        )
        return [logits for logits, _ in steps]
