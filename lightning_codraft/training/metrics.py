"""Draft quality as a torchmetrics Metric: per-step top-1 accuracy and the acceptance length it implies.

Three acceptance figures have one name each, everywhere (metrics.csv, the loggers, both progress bars, the docs):

- ``acceptance_length``: MEASURED by the rollout engine, tokens emitted per drafting round of the step's rollouts;
- ``top1_acceptance`` (``draft/top1_acceptance``): IMPLIED by the draft's top-1 accuracy on the step's batch (this
  module), what greedy verification would accept;
- ``implied_acceptance`` (``draft/implied_acceptance``): IMPLIED by the draft's and the policy's distributions on
  the step's rollouts, the expected acceptance of sampling verification (training/implied.py).

With ``acc_k`` the top-1 accuracy of unroll step ``k`` (``k = 0 .. K-1``, conditioned on the earlier steps
having been fed the true tokens, as in TTT), a chain draft of K tokens verified greedily is accepted up to
step k with probability ``prod_{j<=k} acc_j``, so the expected number of tokens per verification is

    top1_acceptance = 1 + sum_k prod_{j<=k} acc_j        (1 = the policy's own token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

RENAMED_METRICS = {"draft/acceptance_length": "draft/top1_acceptance"}
"""Metric names that changed: old -> new (CHANGELOG lists them); :func:`check_metric_names` refuses the old ones."""


def check_metric_names(names, where: str) -> None:
    """Raise ``KeyError`` naming the new name when ``names`` holds a renamed metric (``where``: who asked for it)."""
    for name in names:
        if name in RENAMED_METRICS:
            raise KeyError(
                f"{where} asks for the metric {name!r}, renamed {RENAMED_METRICS[name]!r} (the acceptance "
                f"length implied by the draft's top-1 accuracy; the engine's measured one is "
                f"'acceptance_length', the distribution-implied one 'draft/implied_acceptance')"
            )


def implied_acceptance_length(rates: Tensor | Sequence[float]) -> float:
    """``1 + sum_k prod_{j <= k} r_k``: tokens per verification round when draft position k is accepted with
    probability ``r_k`` given that the positions before it were (``rates``: ``(K,)``). The one home of this formula:
    the draft's top-1-implied figure, the warm start's reports and the calibration all call it."""
    total, prod = 1.0, 1.0
    for r in rates.tolist() if isinstance(rates, Tensor) else rates:
        prod *= float(r)
        total += prod
    return total


class DraftAcceptance(Metric):
    """Accumulates per-step (correct, total) counts; ``compute()`` returns accuracies and acceptance length.

    The states are sums, so torchmetrics' synchronisation (``dist_reduce_fx="sum"`` over the metric's
    process group) gives the exact global accuracy whatever the per-process counts are.

    Args:
        num_steps: K, number of TTT unroll steps tracked.
        **kwargs: forwarded to :class:`torchmetrics.Metric` (e.g. ``process_group``, ``sync_on_compute``).

    Example::

        metric = DraftAcceptance(num_steps=3)
        metric.update(out.correct, out.total)       # the counts of a DraftLossOutput
        metric.compute()   # {"acc/step0": ..., "acc/step1": ..., "acc/step2": ..., "top1_acceptance": ...}
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, num_steps: int, **kwargs):
        super().__init__(**kwargs)
        if int(num_steps) < 1:
            raise ValueError(f"num_steps={num_steps} must be >= 1 (one per TTT unroll step)")
        self.num_steps = int(num_steps)
        self.add_state("correct", default=torch.zeros(self.num_steps, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(self.num_steps, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: Tensor, total: Tensor) -> None:
        """Add counts of one batch.

        Args:
            correct: ``(K,)`` rows of each step whose draft top-1 equals the policy top-1.
            total: ``(K,)`` rows counted at each step; ``correct <= total``.
        """
        correct = torch.as_tensor(correct).detach().reshape(-1)
        total = torch.as_tensor(total).detach().reshape(-1)
        if correct.numel() != self.num_steps or total.numel() != self.num_steps:
            raise ValueError(
                f"DraftAcceptance(num_steps={self.num_steps}) got correct of {correct.numel()} and "
                f"total of {total.numel()} entries; pass one count per step"
            )
        if bool((correct > total).any()) or bool((correct < 0).any()):
            raise ValueError(
                f"need 0 <= correct <= total per step, got correct={correct.tolist()} total={total.tolist()}"
            )
        self.correct += correct.to(self.correct)
        self.total += total.to(self.total)

    def compute(self) -> dict[str, Tensor]:
        """``{"acc/step{k}": (), "top1_acceptance": ()}`` fp32 scalars; a step with no rows has accuracy 0."""
        acc = (self.correct / self.total.clamp(min=1)).float()
        result = {f"acc/step{k}": acc[k] for k in range(self.num_steps)}
        result["top1_acceptance"] = acc.new_tensor(implied_acceptance_length(acc))
        return result
