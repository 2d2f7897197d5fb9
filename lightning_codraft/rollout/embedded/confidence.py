"""How often a draft proposal is accepted, given the draft's own confidence in it, measured as the engine runs.

A proposal's *confidence* is its probability under the distribution the draft drew it from (the draft's softmax;
tempered and filtered when sampling: :meth:`TokenSampler.draw(confidence=True)
<lightning_codraft.rollout.sampling.sampler.TokenSampler.draw>`). A draft fitted to its policy is roughly calibrated:
proposals it is sure of are accepted almost always, the ones it hesitates over rarely. :class:`ConfidenceCalibration`
keeps, per confidence bin, decayed counts of proposals verified (every position a row reached: all proposals before
it accepted) and accepted, shrunk towards the caller's prior (the engine-wide acceptance rate: a new engine predicts
as if it knew no confidence, and every bin keeps being verified until its own counts speak), so the adaptive
controller (rollout/embedded/adaptive.py) can stop a proposal chain once the next proposals are unlikely to pay for their
verify. How far confidence is from acceptance depends on the rule: greedy, a fitted draft is close to calibrated;
sampled with Gumbel coupling, a proposal the draft gives 7% is still accepted a third of the time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

EDGES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
"""Upper edges of the confidence bins (the last bin is [0.98, 1]): finer near 1, where most accepted proposals lie."""


class ConfidenceCalibration:
    """Decayed per-bin counts of verified and accepted proposals by the draft's confidence.

    Args:
        prior_weight: pseudo-proposals per bin at the prior rate passed to :meth:`rates`.
    """

    def __init__(self, prior_weight: float):
        if prior_weight <= 0:
            raise ValueError(f"prior_weight={prior_weight} must be > 0")
        self.prior_weight = float(prior_weight)
        self.acc = [0.0] * (len(EDGES) + 1)
        self.tried = [0.0] * (len(EDGES) + 1)

    @staticmethod
    def bin(confidence: float) -> int:
        """The bin of a confidence in [0, 1]."""
        return bisect.bisect_right(EDGES, confidence)

    def rates(self, prior: float) -> list[float]:
        """Per bin: the acceptance rate of a proposal of that bin's confidence, given it was reached, shrunk towards
        ``prior``."""
        w = self.prior_weight
        return [(a + w * prior) / (t + w) for a, t in zip(self.acc, self.tried)]

    def decay(self, factor: float) -> None:
        """Fade every count by ``factor`` (old evidence counts less as the draft and the policy change)."""
        self.acc = [x * factor for x in self.acc]
        self.tried = [x * factor for x in self.tried]

    def observe(self, confidences: Sequence[Sequence[float]], accepted: Sequence[int], verified: int) -> None:
        """Add a round: ``confidences`` ``(n, B)`` of the n proposals drawn per row, of which the first ``verified``
        were verified; row b accepted ``accepted[b]`` of them (it reached positions ``<= accepted[b]``)."""
        for b, a in enumerate(accepted):
            for j in range(min(int(a) + 1, verified)):
                i = self.bin(confidences[j][b])
                self.tried[i] += 1.0
                if j < a:
                    self.acc[i] += 1.0
