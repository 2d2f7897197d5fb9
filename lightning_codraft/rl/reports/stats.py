"""Paired statistics over RL steps: how two arms run from the same seeds differ, with a confidence interval.

Arms of a comparison (``rl.reports.compare``) see the same prompts and sampling seeds step by step, so their per-step
values pair up: the difference ``a_s - b_s`` removes what the step's prompts do to both. :func:`paired_difference`
reports the mean difference over a set of steps with a Student-t confidence interval (steps treated as independent
draws; successive RL steps are correlated through the policy, so read the interval as optimistic when the
differences trend). No SciPy: the t CDF is the regularized incomplete beta function (a continued fraction), the
quantile Newton's method on it, cached: microseconds a call (the live A/B computes an interval every step).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist


def _t_pdf(x: float, df: float) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz; relative error 1e-15)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((qam + 2 * m) * (a + 2 * m)),
            -(a + m) * (qab + m) * x / ((a + 2 * m) * (qap + 2 * m)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0``, ``0 <= x <= 1``."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom, in closed form:
    ``1 - I_{df / (df + x^2)}(df / 2, 1 / 2) / 2`` for ``x > 0`` (symmetric below 0)."""
    if df <= 0:
        raise ValueError(f"df={df} must be > 0")
    if x == 0:
        return 0.5
    tail = 0.5 * beta_inc(df / 2, 0.5, df / (df + x * x))
    return 1.0 - tail if x > 0 else tail


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom: Newton's method on :func:`t_cdf` kept
    inside a bracket (bisection where a Newton step leaves it), to 1e-12; cached (the live A/B asks for the same
    few quantiles every step)."""
    if not 0 < p < 1:
        raise ValueError(f"p={p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    x = min(max(NormalDist().inv_cdf(p), lo), hi)
    for _ in range(200):
        f = t_cdf(x, df) - p
        if f == 0.0 or hi - lo < 1e-13:
            break
        lo, hi = (x, hi) if f < 0 else (lo, x)
        step = x - f / _t_pdf(x, df)
        x = step if lo <= step <= hi else (lo + hi) / 2
    return x


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
        return (
            f"{self.mean:+.3f} (95% CI {self.low:+.3f} .. {self.high:+.3f}; sd {self.sd:.3f}; "
            f"{self.wins}/{self.n} steps higher)"
        )


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
