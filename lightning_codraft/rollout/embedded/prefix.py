"""How many of a block's proposals a round verifies when the drafter predicts its own acceptance (DSpark's
confidence head): the prefix rule of the block engine (docs/design/drafters.md, "A verify length the confidence
chooses").

The rule reads the confidence head's probabilities ``c[b, j]`` of the block's proposal rows, computed from the
drafter's hidden states alone, BEFORE any proposal is drawn: the chosen length is a function of the context (what
every round's k may depend on), never of the drafted tokens, so greedy output stays plain decoding's and samples
stay the policy's under coupled and rejection sampling alike. A head that reads the previous drafted token
(``confidence_with_markov``) would make the rule look at the proposals; the engine refuses it.

- With the adaptive controller: the k in ``0..K`` (K: what the controller chose from earlier rounds) maximising
  expected tokens per second, ``c[b, j]`` standing for each row's conditional acceptance at position j and the
  measured cost model pricing a verify of ``1 + k`` rows (the drafter's forward, already run, counted in every k).
- Without it: the longest prefix whose mean (over the batch's rows) probability of being reached and accepted,
  ``prod_{i <= j} c[b, i]``, stays at least ``threshold``; at least one proposal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_codraft.rollout.embedded.adaptive import SpeculationController, expected_tokens


def threshold_length(probs: torch.Tensor, threshold: float) -> int:
    """``probs`` ``(B, K)`` -> the longest prefix (>= 1) whose rows' mean reach probability is >= ``threshold``."""
    reach = torch.cumprod(probs.float().clamp(0, 1), dim=1).mean(0)
    return max(1, int((reach >= threshold).to(torch.int64).cumprod(0).sum()))


def costed_length(ctl: SpeculationController, probs: torch.Tensor, remaining: Sequence[int]) -> int:
    """``probs`` ``(B, K)`` -> the k in ``0..K`` maximising expected tokens per predicted second (module
    docstring)."""
    K = probs.shape[1]
    tokens = expected_tokens(probs.float().clamp(0, 1).tolist(), remaining)
    times = ctl.costs.round_times(probs.shape[0], K, drafted=1)
    return max(range(K + 1), key=lambda k: tokens[k] / times[k])
