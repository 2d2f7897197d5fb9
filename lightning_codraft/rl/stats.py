"""Paired statistics over RL steps: how two arms run from the same seeds differ, with a confidence interval.

Arms of a comparison (``rl.compare``) see the same prompts and sampling seeds step by step, so their per-step
values pair up: the difference ``a_s - b_s`` removes what the step's prompts do to both. :func:`paired_difference`
reports the mean difference over a set of steps with a Student-t confidence interval (steps treated as independent
draws; successive RL steps are correlated through the policy, so read the interval as optimistic when the
differences trend). No SciPy: the t quantile is a bisection on the t CDF, integrated with Simpson's rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def _t_pdf(x: float, df: float) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: float, intervals: int = 4000) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom (Simpson's rule on [0, |x|], error < 1e-9)."""
    if df <= 0:
        raise ValueError(f"df={df} must be > 0")
    a = abs(x)
    if a == 0:
        return 0.5
    h = a / intervals
    s = _t_pdf(0.0, df) + _t_pdf(a, df)
    for i in range(1, intervals):
        s += (4 if i % 2 else 2) * _t_pdf(i * h, df)
    half = s * h / 3
    return 0.5 + half if x > 0 else 0.5 - half


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0 < p < 1:
        raise ValueError(f"p={p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class PairedDifference:
    """The mean of per-step differences ``a - b`` and its confidence interval.

    Attributes:
        mean: mean difference.
        low, high: the confidence interval of the mean (Student t, ``n - 1`` degrees of freedom).
        sd: standard deviation of the differences.
        n: number of paired steps.
        wins: steps where ``a > b``.
        level: the interval's confidence level.
    """

    mean: float
    low: float
    high: float
    sd: float
    n: int
    wins: int
    level: float = 0.95

    def __str__(self) -> str:
        return (f"{self.mean:+.3f} (95% CI {self.low:+.3f} .. {self.high:+.3f}; sd {self.sd:.3f}; "
                f"{self.wins}/{self.n} steps higher)")


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> PairedDifference:
    """Mean of ``a[i] - b[i]`` over the pairs, with a ``level`` Student-t confidence interval.

    Raises:
        ValueError: different lengths, fewer than 2 pairs, or a non-finite value.
    """
    if len(a) != len(b):
        raise ValueError(f"paired series need equal lengths, got {len(a)} and {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    if len(d) < 2:
        raise ValueError(f"a confidence interval needs >= 2 pairs, got {len(d)}")
    if not all(math.isfinite(x) for x in d):
        raise ValueError(f"paired differences must be finite, got {d}")
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return PairedDifference(mean, mean - half, mean + half, sd, n, sum(x > 0 for x in d), level)
