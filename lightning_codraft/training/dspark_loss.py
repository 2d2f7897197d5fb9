"""DSpark's three-term drafter loss on block positions (issue 51; DeepSpec's definitions, docs/design/drafters.md).

For N blocks of B positions, with the drafter's logits and the (detached) live policy's logits at each position:

- ``w[n, b] = valid[n, b] * exp(-b / gamma)`` (no decay when ``gamma`` is None or <= 0);
- **CE**: ``sum(w * CE(draft, target)) / sum(w)``;
- **L1** ("TV" in the issue; DeepSpec's ``l1_loss``): ``d = sum_v |p_draft - p_policy|`` (twice the total variation),
  ``sum(w * d) / sum(w)``;
- **confidence**: the per-position acceptance ``a = clamp(1 - d / 2, 0, 1)`` (detached) is the target of a BCE on the
  confidence head's logits, ``sum(w * BCE) / sum(w)``;
- **probabilistic acceptance**: ``1 + sum_b cumprod_b(a * valid)`` averaged over blocks with a valid position.

The loss is ``ce_weight * CE + l1_weight * L1 + confidence_weight * confidence`` (DeepSpec's 0.1 / 0.9 / 1.0).

:func:`dspark_loss` is that definition on one batch of blocks; :func:`dspark_block_loss` is the same definition on a
whole step spread over microbatches, CP ranks and replicas: ``sum(w * term) / sum(w)`` with ``sum(w) = sum_k
gamma_k den_k`` over the STEP's counted positions (``den_k``: ``RLBatch.norm.draft``), so every microbatch's value is
its share and the shares add up to DeepSpec's loss on the step's blocks (training/dspark_term.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_codraft.parallel.collectives import reduced
from lightning_codraft.training.dflash_loss import block_position_weights
from lightning_codraft.training.draft_loss import DraftLossOutput


@dataclass
class DSparkTerms:
    """The loss and its parts (scalars)."""

    loss: Tensor
    ce: Tensor
    l1: Tensor
    confidence: Tensor
    """0 without a confidence head."""
    acceptance: Tensor
    """The probabilistic acceptance length (no gradient)."""
    rates: Tensor
    """``(B,)`` mean acceptance rate per block position over valid positions (no gradient)."""


def position_weights(valid: Tensor, gamma: Optional[float]) -> Tensor:
    """``(N, B)`` float weights: ``valid`` decayed by ``exp(-b / gamma)`` along the block."""
    w = valid.to(torch.float32)
    if gamma is not None and gamma > 0:
        w = w * block_position_weights(valid.shape[-1], float(gamma)).to(valid.device)
    return w


def dspark_loss(
    draft_logits: Tensor,
    policy_logits: Tensor,
    targets: Tensor,
    valid: Tensor,
    confidence_logits: Optional[Tensor] = None,
    gamma: Optional[float] = None,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    confidence_weight: float = 1.0,
) -> DSparkTerms:
    """DSpark's loss (module docstring).

    Args:
        draft_logits: ``(N, B, V)`` the drafter's logits at each block position.
        policy_logits: ``(N, B, V)`` the live policy's logits there (detached here).
        targets: ``(N, B)`` the tokens the positions predict.
        valid: ``(N, B)`` bool, positions inside their document's completion.
        confidence_logits: ``(N, B)`` the confidence head's logits, or None.
        gamma: the CE / L1 / confidence decay along the block (None: none).
        ce_weight, l1_weight, confidence_weight: the three terms' weights.
    """
    if draft_logits.shape != policy_logits.shape or draft_logits.shape[:2] != targets.shape != valid.shape:
        raise ValueError(
            f"draft {tuple(draft_logits.shape)}, policy {tuple(policy_logits.shape)}, targets "
            f"{tuple(targets.shape)}, valid {tuple(valid.shape)}: expected (N, B, V) twice and (N, B) twice"
        )
    w = position_weights(valid, gamma)
    den = w.sum().clamp_min(1e-6)
    ce, dist, bce, accept = row_terms(draft_logits, policy_logits, targets, confidence_logits)
    zero = dist.new_zeros(())
    conf = zero if bce is None else (bce * w).sum() / den
    ce, l1 = (ce * w).sum() / den, (dist * w).sum() / den
    with torch.no_grad():
        vf = valid.to(torch.float32)
        blocks = valid.any(-1)
        tau = (1.0 + (accept * vf).cumprod(-1).sum(-1))[blocks]
        acceptance = tau.mean() if tau.numel() else zero
        rates = (accept * vf).sum(0) / vf.sum(0).clamp_min(1.0)
    loss = ce_weight * ce + l1_weight * l1 + confidence_weight * conf
    return DSparkTerms(loss, ce, l1, conf, acceptance, rates)


def row_terms(
    draft_logits: Tensor, policy_logits: Tensor, targets: Tensor, confidence_logits: Optional[Tensor]
) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """Per position ``(N, B)`` fp32: the CE against ``targets``, the L1 distance to the (detached) policy's
    distribution, the confidence BCE (None without a head) and its detached target ``a = clamp(1 - L1 / 2, 0, 1)``."""
    z = draft_logits.float()
    ce = F.cross_entropy(z.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    dist = (z.softmax(-1) - policy_logits.detach().float().softmax(-1)).abs().sum(-1)
    accept = (1.0 - 0.5 * dist).clamp(0.0, 1.0).detach()
    bce = None
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
    return ce, dist, bce, accept


def dspark_block_loss(
    block_logits: Tensor,
    policy_logits: Tensor,
    targets: Tensor,
    counted: Tensor,
    confidence_logits: Optional[Tensor],
    gamma_weights: Tensor,
    alphas: tuple[float, float, float] = (0.1, 0.9, 1.0),
    denominators: Optional[Tensor] = None,
    group=None,
) -> tuple[DraftLossOutput, Tensor]:
    """DSpark's loss of ``N`` blocks as this rank's share of a step (module docstring).

    Args:
        block_logits: ``(N, K, V)`` the drafter's logits at each block's K proposals (Markov bias included).
        policy_logits: ``(N, K, V)`` the policy's logits those proposals learn (detached here).
        targets: ``(N, K)`` the tokens they predict.
        counted: ``(N, K)`` 1 where the position counts (inside the anchor's document, a draft target row).
        confidence_logits: ``(N, K)`` the confidence head's logits, or None.
        gamma_weights: ``(K,)`` each position's decay ``gamma_k`` (:func:`block_position_weights`).
        alphas: the CE, L1 and confidence terms' weights.
        denominators: ``(K,)`` the step's counted positions over every microbatch and rank; None: these blocks'
            own (over ``group``).
        group: the CP group whose ranks hold the batch's other blocks (values the group's, gradients this rank's).

    Returns:
        ``(out, weights)``: ``out.per_step_loss[k]`` is position k's mean loss (its sum over the step's
        counted positions), ``out.loss = sum_k weights[k] * per_step_loss[k]``; ``weights`` ``(K,)`` are
        ``gamma_k den_k / sum_j gamma_j den_j`` (detached: what makes the per-position means DeepSpec's one weighted
        mean); ``out.extras`` are detached shares of the step's ``ce``, ``l1``, ``confidence_loss``,
        ``prob_acceptance`` (``1 + sum cumprod(a)`` per block over the step's blocks, ``den_0``),
        ``predicted_acceptance`` (the same with the confidence head's probabilities) and ``confidence_error`` (mean
        ``|sigmoid(c) - a|`` over counted positions).
    """
    N, K, V = block_logits.shape
    if policy_logits.shape != (N, K, V) or targets.shape != counted.shape != (N, K) or gamma_weights.shape != (K,):
        raise ValueError(
            f"block_logits {tuple(block_logits.shape)}, policy_logits {tuple(policy_logits.shape)}, targets "
            f"{tuple(targets.shape)}, counted {tuple(counted.shape)}, gamma_weights {tuple(gamma_weights.shape)}: "
            f"expected (N, K, V) twice, (N, K) twice and (K,)"
        )
    c = counted.float()
    ce, dist, bce, accept = row_terms(block_logits, policy_logits, targets, confidence_logits)
    terms = [ce, dist] + ([] if bce is None else [bce])
    local = torch.stack([(t * c).sum(0) for t in terms])  # (terms, K)
    with torch.no_grad():
        hit = (block_logits.argmax(-1) == policy_logits.argmax(-1)).float() * c
        kept = (accept * c).cumprod(-1)
        stats = [c.sum(0), hit.sum(0), kept.sum(0)]
        if confidence_logits is not None:
            prob = torch.sigmoid(confidence_logits.float())
            stats += [(prob * c).cumprod(-1).sum(0), ((prob - accept).abs() * c).sum(0)]
        packed = reduced(torch.cat([local.detach(), torch.stack(stats)]), group)
    sums = local + (packed[: len(terms)] - local.detach())  # the group's values, this rank's gradients
    total = packed[len(terms)]
    den = (total if denominators is None else denominators.to(total)).double()
    gw = gamma_weights.to(den) * den
    weights = (gw / gw.sum().clamp_min(1e-12)).float().to(sums.device)
    alpha = torch.tensor(alphas[: len(terms)], dtype=sums.dtype, device=sums.device)
    per_term = sums / den.clamp_min(1).to(sums)[None]  # (terms, K) per-position means
    per_step = (alpha[:, None] * per_term).sum(0)
    extras = {}
    with torch.no_grad():
        shares = (weights[None] * per_term.detach()).sum(1)
        for name, v in zip(("ce", "l1", "confidence_loss"), shares):
            extras[name] = v
        blocks, lead = den[0].clamp_min(1).to(sums), total[0]  # the step's blocks; these blocks' leading 1s
        extras["prob_acceptance"] = (lead + packed[len(terms) + 2].sum()) / blocks
        if confidence_logits is not None:
            extras["predicted_acceptance"] = (lead + packed[len(terms) + 3].sum()) / blocks
            extras["confidence_error"] = packed[len(terms) + 4].sum() / den.sum().clamp_min(1).to(sums)
    out = DraftLossOutput(
        loss=(weights * per_step).sum(),
        per_step_loss=per_step.detach(),
        correct=packed[len(terms) + 1],
        total=total,
        in_vocab=total,
        extras=extras,
    )
    return out, weights
