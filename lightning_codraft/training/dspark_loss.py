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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_codraft.training.dflash_loss import block_position_weights


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
    ce = F.cross_entropy(draft_logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(w) * w
    dist = (draft_logits.float().softmax(-1) - policy_logits.detach().float().softmax(-1)).abs().sum(-1)
    accept = (1.0 - 0.5 * dist).clamp(0.0, 1.0).detach()
    l1 = (dist * w).sum() / den
    zero = dist.new_zeros(())
    conf = zero
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        conf = (bce * w).sum() / den
    ce = ce.sum() / den
    with torch.no_grad():
        vf = valid.to(torch.float32)
        blocks = valid.any(-1)
        tau = (1.0 + (accept * vf).cumprod(-1).sum(-1))[blocks]
        acceptance = tau.mean() if tau.numel() else zero
        rates = (accept * vf).sum(0) / vf.sum(0).clamp_min(1.0)
    loss = ce_weight * ce + l1_weight * l1 + confidence_weight * conf
    return DSparkTerms(loss, ce, l1, conf, acceptance, rates)
